//! The pyo3 binding layer: converts types, releases the interpreter around
//! work longer than a few microseconds, and maps core errors to exceptions in
//! exactly one place (`From<Error> for PyErr`).

pub mod budget;
pub mod calibrate;
pub mod classify;
pub mod compress;
pub mod openai;

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
