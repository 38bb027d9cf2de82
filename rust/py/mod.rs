//! The pyo3 binding layer: converts types, releases the interpreter around
//! work longer than a few microseconds, and maps core errors to exceptions in
//! exactly one place (`From<Error> for PyErr`).

pub mod admission;
#[cfg(feature = "server")]
pub mod admission_lua;
pub mod assign;
pub mod autoscale;
pub mod autoscale_sim;
pub mod budget;
pub mod calibrate;
pub mod classify;
pub mod compress;
pub mod disagg;
pub mod dispatch;
pub mod flow;
pub mod flow_sim;
#[cfg(feature = "kv-events")]
pub mod kv;
#[cfg(feature = "server")]
pub mod loadgen;
pub mod openai;
pub mod pick;
pub mod pipeline;
pub mod planner;
pub mod prefix;
pub mod profile;
pub mod queueing;
#[cfg(feature = "server")]
pub mod serve;
pub mod sim;
pub mod tokenize;
pub mod vtc;
pub mod workload;

use numpy::PyReadonlyArray1;
use pyo3::exceptions::{PyKeyError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString, PyTuple};

use crate::error::{invalid, Error};
use crate::prefix::Tokens;

pyo3::create_exception!(
    routecore,
    NotInFlightError,
    PyValueError,
    "Ending a request that is not in flight: completed or released already, never\n\
     started, or its lease expired. Every ``complete`` / ``completed`` / ``release``\n\
     raises it for that mistake and changes nothing. A ``ValueError``."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::UnknownName { .. } => PyKeyError::new_err(e.to_string()),
            Error::NotInFlight(_) => NotInFlightError::new_err(e.to_string()),
            Error::InvalidArgument(_) | Error::Snapshot(_) => PyValueError::new_err(e.to_string()),
        }
    }
}

/// A Python object (a list of message dicts, a tools list, a config
/// mapping) as JSON, through ``json.dumps`` (a value it cannot serialize is
/// a ValueError).
pub fn json_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<serde_json::Value> {
    let text = obj
        .py()
        .import("json")?
        .call_method1("dumps", (obj,))
        .map_err(|e| invalid(format!("{what} must be JSON-serializable: {e}")))?;
    let text = text.cast::<PyString>()?.to_str()?;
    Ok(serde_json::from_str(text).map_err(|e| invalid(format!("{what}: {e}")))?)
}

/// Seconds on routecore's monotonic clock: the default ``now`` of every call
/// that takes one (windows, EWMAs, TTLs, Retry-After). Its epoch is fixed when
/// first read in this process, so values are small and only differences mean
/// anything. Pass ``monotonic()`` where an explicit ``now`` must agree with the
/// default one.
#[pyfunction]
pub fn monotonic() -> f64 {
    crate::clock::monotonic()
}

/// `now` as given, else `monotonic()`.
pub fn now_or_monotonic(now: Option<f64>) -> f64 {
    now.unwrap_or_else(crate::clock::monotonic)
}

/// The extractor of every integer argument (`#[pyo3(from_py_with = int_arg)]`,
/// also for `Option`s and lists of integers): an int outside the Rust type's
/// range (beyond 2^63 or 2^64, or negative where unsigned), on which pyo3
/// raises OverflowError, is a ValueError like any other bad argument. pyo3
/// notes the argument's name on the exception ("while processing 'x'").
pub fn int_arg<'a, 'py, T: FromPyObject<'a, 'py>>(obj: &'a Bound<'py, PyAny>) -> PyResult<T> {
    obj.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        if e.is_instance_of::<PyOverflowError>(obj.py()) {
            // The value itself unless it is long (or not an int at all).
            let got = obj
                .str()
                .map(|s| s.to_string())
                .ok()
                .filter(|s| s.len() <= 40)
                .map_or_else(String::new, |s| format!(" (got {s})"));
            PyValueError::new_err(format!("integer out of range: {}{got}", e.value(obj.py())))
        } else {
            e
        }
    })
}

/// A 1-D NumPy array (or anything `numpy.asarray` takes) of any integer dtype,
/// as i64. Floats, bools, objects and unsigned values above i64::MAX are refused.
pub fn int_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    Ok(int_view(obj, what)?.as_array().to_vec())
}

/// `int_array` read in place: a contiguous int64 array is borrowed as it is
/// (the caller must not mutate it during the call); any other integer array
/// or sequence is converted once. Same checks as `int_array`.
pub fn int_view<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArray1<'py, i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
        if a.as_slice().is_ok() {
            return Ok(a);
        }
    }
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("asarray", (obj,))?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be 1-D, got {ndim} dimensions"
        )));
    }
    let size: usize = arr.getattr("size")?.extract()?;
    // `[]` arrives as float64; an empty array holds no value to misread.
    if size > 0 {
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
    }
    np.call_method1("ascontiguousarray", (arr, "int64"))?
        .extract()
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

/// An array-like of real numbers (float, int or unsigned dtype; bools,
/// complex, objects and strings refused) as a row-major Vec of `T` ("float64"
/// or "float32", named by `dtype`) and its shape, which must have `ndim`
/// dimensions. An array already of that dtype is read without a round trip
/// through `numpy.asarray`.
pub fn real_array<T: numpy::Element + Copy>(
    obj: &Bound<'_, PyAny>,
    ndim: usize,
    dtype: &str,
    what: &str,
) -> PyResult<(Vec<T>, Vec<usize>)> {
    let arr = if let Ok(a) = obj.extract::<numpy::PyReadonlyArrayDyn<'_, T>>() {
        a
    } else {
        let np = obj.py().import("numpy")?;
        let arr = np.call_method1("asarray", (obj,))?;
        let dtype_obj = arr.getattr("dtype")?;
        let kind: String = dtype_obj.getattr("kind")?.extract()?;
        if !matches!(kind.as_str(), "f" | "i" | "u") {
            return Err(PyValueError::new_err(format!(
                "{what} must hold real numbers, got dtype {}",
                dtype_obj.str()?
            )));
        }
        arr.call_method1("astype", (dtype,))?.extract()?
    };
    let view = arr.as_array();
    if view.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{what} must be {ndim}-D, got {} dimensions",
            view.ndim()
        )));
    }
    // a contiguous array is one copy; iterating a dynamic-rank view is slow
    let data = match view.as_slice() {
        Some(s) => s.to_vec(),
        None => view.iter().copied().collect(),
    };
    Ok((data, view.shape().to_vec()))
}

/// A non-negative integer argument as `usize`; a clear ValueError otherwise.
pub fn size_arg(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0, got {v}")))
}

/// Prompts at least this long (in tokens) are hashed with the interpreter
/// released; shorter ones finish faster than the release and re-acquire.
pub const DETACH_TOKENS: usize = 4096;

/// Runs `f` with the interpreter released when `big`, else directly.
pub fn detach_if<T: Send>(py: Python<'_>, big: bool, f: impl FnOnce() -> T + Send) -> T {
    if big {
        py.detach(f)
    } else {
        f()
    }
}

/// A prompt argument: a NumPy uint32 array (read in place; do not mutate it
/// during the call), any other integer array or sequence of token ids in
/// [0, 2^32) (copied), or `str` / `bytes` for the character tokenizer (bytes
/// of UTF-8).
pub enum TokenArg<'py> {
    Array(PyReadonlyArray1<'py, u32>),
    Owned(Vec<u32>),
    Text(Bound<'py, PyAny>),
}

impl<'py> TokenArg<'py> {
    pub fn new(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
            return Ok(Self::Text(obj.clone()));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u32>>() {
            if a.as_slice().is_ok() {
                return Ok(Self::Array(a));
            }
            return Ok(Self::Owned(a.as_array().to_vec()));
        }
        let ids = int_array(obj, what)?;
        if let Some(bad) = ids.iter().find(|&&t| !(0..=u32::MAX as i64).contains(&t)) {
            return Err(PyValueError::new_err(format!(
                "{what}: token id {bad} is outside [0, 2^32)"
            )));
        }
        Ok(Self::Owned(ids.into_iter().map(|t| t as u32).collect()))
    }

    pub fn tokens(&self) -> PyResult<Tokens<'_>> {
        Ok(match self {
            Self::Array(a) => Tokens::Ids(a.as_slice()?),
            Self::Owned(v) => Tokens::Ids(v),
            Self::Text(obj) => Tokens::Bytes(text_bytes(obj, "tokens")?),
        })
    }
}

/// A 1-D uint64 NumPy array of block hashes (from `block_hashes`), copied.
pub fn hash_array(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let a: PyReadonlyArray1<'_, u64> = obj.extract().map_err(|_| {
        PyTypeError::new_err("hashes must be a 1-D uint64 NumPy array (from block_hashes)")
    })?;
    Ok(a.as_array().to_vec())
}

/// ``(type(obj).from_bytes, (state,))``: pickling through the snapshot.
pub fn reduce<'py, T: pyo3::PyClass>(
    slf: &Bound<'py, T>,
    state: Bound<'py, PyBytes>,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = slf.py();
    let restore = slf.as_any().get_type().getattr("from_bytes")?;
    PyTuple::new(py, [restore, PyTuple::new(py, [state])?.into_any()])
}

/// A 1-D array-like of real numbers as f64 (see `real_array`); NaN is left
/// to the core.
pub fn float_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f64>> {
    real_array::<f64>(obj, 1, "float64", what).map(|(data, _)| data)
}

/// `d[name] = src.name` for each listed field of `src` (the `as_dict` /
/// `fields` of a binding class).
macro_rules! set_fields {
    ($d:expr, $src:expr; $($field:ident),* $(,)?) => {{
        $( $d.set_item(stringify!($field), &$src.$field)?; )*
    }};
}
pub(crate) use set_fields;
