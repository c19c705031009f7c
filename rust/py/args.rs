//! Argument conversion at the Python boundary.
//!
//! Every value that crosses in is checked here, with the argument's name in the message:
//! integers (no floats, no bools, no overflow), id lists given as Python sequences or as 1-D
//! C-contiguous int32/int64 numpy arrays (other dtypes and strided views are refused rather
//! than silently copied), and token ids in `0 ..= i32::MAX`.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyString};

use super::errors::{invalid_argument, invalid_type};
use crate::error::CoreError;

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// A Python integer (or numpy integer scalar) as `i64`.
pub fn int_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid_type(format!("{name} must be an integer, got bool")));
    }
    obj.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(obj.py()) {
            invalid_argument(format!("{name} is out of range: {obj}"))
        } else {
            invalid_type(format!("{name} must be an integer, got {}", type_name(obj)))
        }
    })
}

/// A bool (Python bool or numpy bool; ints and other objects are refused).
pub fn bool_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    obj.extract::<bool>()
        .map_err(|_| invalid_type(format!("{name} must be a bool, got {}", type_name(obj))))
}

/// A non-negative integer.
pub fn count_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = int_arg(obj, name)?;
    usize::try_from(v).map_err(|_| invalid_argument(format!("{name} must be >= 0, got {v}")))
}

/// A 1-D sequence of integers: a list/tuple/iterable of ints, or a 1-D C-contiguous int32 or
/// int64 numpy array.
pub fn int_list_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(invalid_argument(format!("{name} must be a 1-D array, got shape {:?}", arr.shape())));
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            let ro = a.readonly();
            let s = ro.as_slice().map_err(|_| not_contiguous(name))?;
            return Ok(s.to_vec());
        }
        if let Ok(a) = obj.cast::<PyArray1<i32>>() {
            let ro = a.readonly();
            let s = ro.as_slice().map_err(|_| not_contiguous(name))?;
            return Ok(s.iter().map(|&v| v as i64).collect());
        }
        let dtype = arr.dtype().str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
        return Err(invalid_type(format!("{name} must have dtype int32 or int64, got {dtype}")));
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid_type(format!("{name} must be a sequence of integers, got {}", type_name(obj))));
    }
    // Fast path for lists/tuples of plain ints; on failure redo item by item for a precise error.
    if let Ok(v) = obj.extract::<Vec<i64>>() {
        if !obj.try_iter()?.any(|x| x.map(|x| x.is_instance_of::<PyBool>()).unwrap_or(false)) {
            return Ok(v);
        }
    }
    let iter = obj
        .try_iter()
        .map_err(|_| invalid_type(format!("{name} must be a sequence of integers, got {}", type_name(obj))))?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        out.push(int_arg(&item?, &format!("{name}[{i}]"))?);
    }
    Ok(out)
}

fn not_contiguous(name: &str) -> PyErr {
    invalid_argument(format!("{name} must be C-contiguous (pass numpy.ascontiguousarray(...))"))
}

/// Token ids: a 1-D integer sequence with every id in `0 ..= i32::MAX`.
pub fn token_ids_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let raw = int_list_arg(obj, name)?;
    check_token_ids(&raw).map_err(PyErr::from)
}

/// Token ids validated and narrowed to `u32`.
pub fn check_token_ids(raw: &[i64]) -> Result<Vec<u32>, CoreError> {
    raw.iter()
        .enumerate()
        .map(|(index, &t)| {
            if (0..=i32::MAX as i64).contains(&t) {
                Ok(t as u32)
            } else {
                Err(CoreError::InvalidToken { token: t, index })
            }
        })
        .collect()
}

/// An optional cache salt: `None` or a string.
pub fn salt_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => o
            .extract::<String>()
            .map(Some)
            .map_err(|_| invalid_type(format!("cache_salt must be a str or None, got {}", type_name(o)))),
    }
}
