//! Argument conversion at the Python boundary.
//!
//! Every value that crosses in is checked here, with the argument's name in the message:
//! integers (no floats, no bools, no overflow), counts, positive sizes, floats, strings, id
//! lists given as Python sequences or as 1-D C-contiguous int32/int64 numpy arrays (other
//! dtypes and strided views are refused rather than silently copied), token ids in
//! `0 ..= i32::MAX`, sequence and block ids, hash modes, and the pagedkv objects a method
//! takes (a `SchedulerConfig`, a `SchedulerOutput`). The binding modules call these helpers
//! and check nothing inline.

use numpy::ndarray::Dimension;
use numpy::{
    Element, PyArray1, PyArrayMethods, PyReadonlyArray, PyReadwriteArray, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::type_object::PyTypeCheck;
use pyo3::types::{PyBool, PyBytes, PyString};

use super::errors::{invalid_argument, invalid_type};
use crate::attention_span::AttentionSpan;
use crate::block_hash::HashMode;
use crate::error::CoreError;
use crate::eviction_queue::MAX_RETENTION_PRIORITY;
use crate::ids::SeqId;
use crate::kv_cache_manager::RetentionPolicy;
use crate::scheduler::{BeamParams, Wait, WaitSet};

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

/// A size of a configuration (`num_blocks`, `block_size`, `max_num_seqs`, ...): an integer
/// >= 1, else ConfigError.
pub fn positive_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = int_arg(obj, name)?;
    if v <= 0 {
        return Err(CoreError::Config(format!("{name} must be >= 1, got {v}")).into());
    }
    usize::try_from(v).map_err(|_| invalid_argument(format!("{name} is out of range: {v}")))
}

/// A sample index (`0 ..= u32::MAX`).
pub fn index_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    let v = count_arg(obj, name)?;
    u32::try_from(v).map_err(|_| CoreError::InvalidArgument(format!("{name} {v} is out of range")).into())
}

/// A float (a Python float or int, or a numpy scalar that converts).
pub fn float_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    obj.extract::<f64>()
        .map_err(|_| invalid_type(format!("{name} must be a float, got {}", type_name(obj))))
}

/// A `str`, kept as the Python object (interned ids are reused as they are).
pub fn str_obj_arg<'a, 'py>(obj: &'a Bound<'py, PyAny>, name: &str) -> PyResult<&'a Bound<'py, PyString>> {
    obj.cast::<PyString>()
        .map_err(|_| invalid_type(format!("{name} must be a str, got {}", type_name(obj))))
}

/// A `str`, copied.
pub fn str_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    Ok(str_obj_arg(obj, name)?.to_str()?.to_string())
}

/// An instance of the pagedkv class `T`; `what` says what was expected (e.g.
/// "update() needs the SchedulerOutput returned by schedule()").
pub fn object_arg<'a, 'py, T: PyTypeCheck>(obj: &'a Bound<'py, PyAny>, what: &str) -> PyResult<&'a Bound<'py, T>> {
    obj.cast::<T>().map_err(|_| invalid_type(format!("{what}, got {}", type_name(obj))))
}

/// KV cache groups: a sequence of `(kind, size)` pairs, one per column
/// ([`AttentionSpan::from_name`]); ConfigError for an empty one or a bad pair.
pub fn attention_spans_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<AttentionSpan>> {
    let what = "attention_spans must be a sequence of (kind, size) pairs";
    let items: Vec<Bound<'_, PyAny>> = obj
        .try_iter()
        .map_err(|_| invalid_type(format!("{what}, got {}", type_name(obj))))?
        .collect::<PyResult<_>>()?;
    if items.is_empty() {
        return Err(CoreError::Config("attention_spans needs at least one column".into()).into());
    }
    items
        .iter()
        .map(|item| {
            let (kind, size): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|_| invalid_type(format!("{what}, got an item {}", type_name(item))))?;
            let kind = str_arg(&kind, "an attention span's kind")?;
            let size = if size.is_none() { None } else { Some(positive_arg(&size, "an attention span's size")?) };
            Ok(AttentionSpan::from_name(&kind, size)?)
        })
        .collect()
}

/// `hash_bits` → hash mode (128: full xxh3; fewer: test hook forcing collisions).
pub fn hash_mode_arg(hash_bits: &Bound<'_, PyAny>) -> PyResult<HashMode> {
    let bits = int_arg(hash_bits, "hash_bits")?;
    match bits {
        128 => Ok(HashMode::Xxh3),
        0..=127 => Ok(HashMode::Truncated(bits as u8)),
        _ => Err(CoreError::Config(format!("hash_bits must be in 0..=128, got {bits}")).into()),
    }
}

/// A sequence id: a non-negative integer (a negative one names no sequence:
/// UnknownSequenceError, like a stale one).
pub fn seq_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<SeqId> {
    let v = int_arg(obj, "seq_id")?;
    u64::try_from(v).map(SeqId).map_err(|_| CoreError::UnknownSequence(v as u64).into())
}

/// Sequence ids: a 1-D integer sequence (see [`int_list_arg`] and [`seq_id_arg`]).
pub fn seq_ids_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<SeqId>> {
    int_list_arg(obj, name)?
        .into_iter()
        .map(|v| u64::try_from(v).map(SeqId).map_err(|_| CoreError::UnknownSequence(v as u64).into()))
        .collect()
}

/// The data of a numpy array, which must be C-contiguous. (numpy's `as_slice` alone also takes
/// a Fortran-order array, e.g. a transposed view, whose memory is not in the shape's row-major
/// order: a kernel would read the wrong elements.)
pub fn contiguous_arg<'a, T: Element, D: Dimension>(
    arr: &'a PyReadonlyArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a [T]> {
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(format!("{name} must be C-contiguous")));
    }
    arr.as_slice()
        .map_err(|_| invalid_argument(format!("{name} must be C-contiguous")))
}

/// The data of a numpy array written in place, which must be C-contiguous.
pub fn contiguous_mut_arg<'a, T: Element, D: Dimension>(
    arr: &'a mut PyReadwriteArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a mut [T]> {
    if !arr.is_c_contiguous() {
        return Err(invalid_argument(format!("{name} must be C-contiguous")));
    }
    arr.as_slice_mut()
        .map_err(|_| invalid_argument(format!("{name} must be C-contiguous")))
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

/// Token ids: a 1-D integer sequence with every id in `0 ..= i32::MAX`. A C-contiguous
/// int64/int32 numpy array is converted in one pass.
pub fn token_ids_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a.readonly();
        return Ok(check_token_ids(ro.as_slice().map_err(|_| not_contiguous(name))?)?);
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        let s = ro.as_slice().map_err(|_| not_contiguous(name))?;
        return Ok(check_token_ids(s)?);
    }
    let raw = int_list_arg(obj, name)?;
    check_token_ids(&raw).map_err(PyErr::from)
}

/// Token ids validated and narrowed to `u32`.
pub fn check_token_ids<T: Copy + Into<i64>>(raw: &[T]) -> Result<Vec<u32>, CoreError> {
    let mut out = Vec::with_capacity(raw.len());
    for (index, &t) in raw.iter().enumerate() {
        let t: i64 = t.into();
        if !(0..=i32::MAX as i64).contains(&t) {
            return Err(CoreError::InvalidToken { token: t, index });
        }
        out.push(t as u32);
    }
    Ok(out)
}

/// An optional retention policy of a request's prompt blocks: a priority in `0 ..= 100`
/// (default 35), a duration in seconds (`None`: for good) and the leading prompt tokens it
/// covers (`None`: all).
pub fn retention_arg(
    priority: Option<&Bound<'_, PyAny>>,
    duration: Option<&Bound<'_, PyAny>>,
    num_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<RetentionPolicy> {
    let mut r = RetentionPolicy::default();
    if let Some(o) = num_tokens.filter(|o| !o.is_none()) {
        r.num_tokens = Some(count_arg(o, "retention_tokens")?);
    }
    if let Some(o) = priority.filter(|o| !o.is_none()) {
        let p = int_arg(o, "retention_priority")?;
        r.priority = u8::try_from(p)
            .ok()
            .filter(|&p| p <= MAX_RETENTION_PRIORITY)
            .ok_or_else(|| CoreError::InvalidArgument(format!("retention_priority must be in 0..={MAX_RETENTION_PRIORITY}, got {p}")))?;
    }
    if let Some(o) = duration.filter(|o| !o.is_none()) {
        let secs = float_arg(o, "retention_duration")?;
        if !(secs.is_finite() && secs >= 0.0) {
            return Err(CoreError::InvalidArgument(format!(
                "retention_duration must be a finite number of seconds >= 0, got {secs}"
            ))
            .into());
        }
        r.duration_us = Some((secs * 1e6).min(u64::MAX as f64) as u64);
    }
    Ok(r)
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

/// Optional beam-search parameters of a request: `beam_width` (None: not a beam search) and
/// `length_penalty` (default 1.0; only with a width).
pub fn beam_arg(width: Option<&Bound<'_, PyAny>>, length_penalty: Option<&Bound<'_, PyAny>>) -> PyResult<Option<BeamParams>> {
    let penalty = match length_penalty.filter(|o| !o.is_none()) {
        Some(o) => Some(float_arg(o, "length_penalty")?),
        None => None,
    };
    match width.filter(|o| !o.is_none()) {
        Some(o) => Ok(Some(BeamParams { width: count_arg(o, "beam_width")?, length_penalty: penalty.unwrap_or(1.0) })),
        None if penalty.is_some() => Err(invalid_argument("length_penalty is a beam-search parameter: give beam_width too")),
        None => Ok(None),
    }
}

/// A step's beam candidates: token ids and log-probabilities as two `[R, k]` tables (lists of
/// rows or 2-D arrays, anything that iterates as rows of numbers), flattened row-major, and
/// `k`. Both absent: none.
pub fn beam_candidates_arg(
    token_ids: Option<&Bound<'_, PyAny>>,
    logprobs: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<u32>, Vec<f32>, usize)> {
    let (token_ids, logprobs) = match (token_ids.filter(|o| !o.is_none()), logprobs.filter(|o| !o.is_none())) {
        (None, None) => return Ok((Vec::new(), Vec::new(), 0)),
        (Some(t), Some(l)) => (t, l),
        _ => return Err(invalid_argument("beam_token_ids and beam_logprobs go together")),
    };
    let rows: Vec<Bound<'_, PyAny>> = token_ids
        .try_iter()
        .map_err(|_| invalid_type(format!("beam_token_ids must be a 2-D table of ints, got {}", type_name(token_ids))))?
        .collect::<PyResult<_>>()?;
    let lp_rows: Vec<Bound<'_, PyAny>> = logprobs
        .try_iter()
        .map_err(|_| invalid_type(format!("beam_logprobs must be a 2-D table of floats, got {}", type_name(logprobs))))?
        .collect::<PyResult<_>>()?;
    if rows.len() != lp_rows.len() {
        return Err(invalid_argument(format!("beam_token_ids has {} rows but beam_logprobs {}", rows.len(), lp_rows.len())));
    }
    let (mut ids, mut lps, mut k) = (Vec::new(), Vec::new(), None);
    for (r, (row, lp_row)) in rows.iter().zip(&lp_rows).enumerate() {
        let row_ids = token_ids_arg(row, "beam_token_ids")?;
        let row_lps: Vec<f64> = lp_row
            .extract()
            .map_err(|_| invalid_type(format!("beam_logprobs row {r} must be a sequence of floats, got {}", type_name(lp_row))))?;
        if row_ids.len() != row_lps.len() || k.is_some_and(|k| k != row_ids.len()) {
            return Err(invalid_argument(format!("beam candidate row {r} has {} ids and {} logprobs (rows must all have k entries)", row_ids.len(), row_lps.len())));
        }
        k = Some(row_ids.len());
        ids.extend(row_ids);
        lps.extend(row_lps.into_iter().map(|x| x as f32));
    }
    Ok((ids, lps, k.unwrap_or(0)))
}

/// A request's wait reasons: an iterable of "grammar" / "remote_kv" (a bare str is refused:
/// its characters are no reasons).
pub fn wait_set_arg(obj: &Bound<'_, PyAny>) -> PyResult<WaitSet> {
    if obj.is_none() {
        return Ok(WaitSet::NONE);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(invalid_type(format!("wait_for must be an iterable of str, got str {obj}")));
    }
    let iter = obj
        .try_iter()
        .map_err(|_| invalid_type(format!("wait_for must be an iterable of str, got {}", type_name(obj))))?;
    let mut set = WaitSet::NONE;
    for item in iter {
        let item = item?;
        set = set.with(Wait::parse(str_obj_arg(&item, "wait_for's items")?.to_str()?)?);
    }
    Ok(set)
}
