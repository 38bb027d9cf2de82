//! The pyo3 binding layer: converts types, releases the interpreter around
//! work longer than a few microseconds, and maps core errors to exceptions in
//! exactly one place (`From<Error> for PyErr`).

pub mod budget;
pub mod calibrate;
pub mod classify;
pub mod openai;
pub mod planner;
pub mod profile;
pub mod queueing;
pub mod workload;

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::error::Error;

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::UnknownName { .. } => PyKeyError::new_err(e.to_string()),
            Error::InvalidArgument(_) | Error::Snapshot(_) => PyValueError::new_err(e.to_string()),
        }
    }
}

/// A 1-D NumPy array (or anything `numpy.asarray` takes) of any integer dtype,
/// as i64. Floats, bools, objects and unsigned values above i64::MAX are refused.
pub fn int_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("asarray", (obj,))?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be 1-D, got {ndim} dimensions"
        )));
    }
    let size: usize = arr.getattr("size")?.extract()?;
    if size == 0 {
        // `[]` arrives as float64; an empty array holds no value to misread.
        return Ok(Vec::new());
    }
    let dtype = arr.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(PyValueError::new_err(format!(
            "{what} must have an integer dtype, got {}",
            dtype.str()?
        )));
    }
    if kind == "u" {
        let max: u64 = arr.call_method0("max")?.extract()?;
        if max > i64::MAX as u64 {
            return Err(PyValueError::new_err(format!(
                "{what} holds a value above 2^63 - 1"
            )));
        }
    }
    let arr = arr.call_method1("astype", ("int64",))?;
    let arr: PyReadonlyArray1<'_, i64> = arr.extract()?;
    Ok(arr.as_array().to_vec())
}

/// The bytes of a `str` (UTF-8) or `bytes` argument.
pub fn text_bytes<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a [u8]> {
    if let Ok(s) = obj.cast::<PyString>() {
        Ok(s.to_str()?.as_bytes())
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        Ok(b.as_bytes())
    } else {
        Err(PyTypeError::new_err(format!("{what} must be str or bytes")))
    }
}

/// A 1-D NumPy array (or anything `numpy.asarray` takes) of real numbers, as
/// f64. Bool, complex, object and string dtypes are refused; NaN is left to the core.
pub fn float_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f64>> {
    let np = obj.py().import("numpy")?;
    let dtype = np.call_method1("asarray", (obj,))?.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    if !matches!(kind.as_str(), "i" | "u" | "f") {
        let got = dtype.str()?;
        return Err(PyValueError::new_err(format!(
            "{what} must have a real numeric dtype, got {got}"
        )));
    }
    let floats = np.call_method1("ascontiguousarray", (obj, "float64"))?;
    let floats: PyReadonlyArray1<'_, f64> = floats
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{what} must be 1-D")))?;
    Ok(floats.as_array().to_vec())
}

/// `d[name] = src.name` for each listed field of `src` (the `as_dict` /
/// `fields` of a binding class).
macro_rules! set_fields {
    ($d:expr, $src:expr; $($field:ident),* $(,)?) => {{
        $( $d.set_item(stringify!($field), &$src.$field)?; )*
    }};
}
pub(crate) use set_fields;

/// `__reduce__` for a class that restores from `cls.from_bytes(state)`.
pub fn reduce_from_bytes<'py, T: pyo3::PyClass>(
    slf: &Bound<'py, T>,
    state: Bound<'py, PyBytes>,
) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let py = slf.py();
    let restore = slf.as_any().get_type().getattr("from_bytes")?;
    let args = pyo3::types::PyTuple::new(py, [state])?;
    pyo3::types::PyTuple::new(py, [restore, args.into_any()])
}
