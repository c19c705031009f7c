//! Maps [`CoreError`] to the `pagedkv.errors` exception classes (python/pagedkv/errors.py).
//!
//! The classes are defined in Python so they can inherit from built-ins too (`ValueError`,
//! `LookupError`, `TypeError`); they are looked up once and cached. The mapping is one
//! exhaustive `match`: a new variant does not compile until it has a class.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::error::CoreError;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The `pagedkv.errors` class called `name`, falling back to `RuntimeError` only if the
/// Python package itself is broken (the module cannot be imported).
fn error_class<'py>(py: Python<'py>, name: &str) -> Bound<'py, PyType> {
    let module = ERRORS_MODULE.get_or_try_init(py, || py.import("pagedkv.errors").map(Bound::unbind));
    module
        .ok()
        .and_then(|m| m.bind(py).getattr(name).ok())
        .and_then(|c| c.cast_into::<PyType>().ok())
        .unwrap_or_else(|| py.get_type::<pyo3::exceptions::PyRuntimeError>())
}

/// A `pagedkv.errors.<class_name>` exception with `msg`.
pub fn py_error(class_name: &str, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| PyErr::from_type(error_class(py, class_name), msg))
}

/// `pagedkv.errors.InvalidArgumentError`.
pub fn invalid_argument(msg: impl Into<String>) -> PyErr {
    py_error("InvalidArgumentError", msg)
}

/// `pagedkv.errors.InvalidTypeError`.
pub fn invalid_type(msg: impl Into<String>) -> PyErr {
    py_error("InvalidTypeError", msg)
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        let class = match &e {
            CoreError::Config(_) => "ConfigError",
            CoreError::BlockOutOfRange { .. } => "InvalidBlockError",
            CoreError::BlockNotAllocated(_) => "InvalidBlockError",
            CoreError::InvalidArgument(_) => "InvalidArgumentError",
            CoreError::InvalidToken { .. } => "InvalidTokenError",
            CoreError::UnknownSequence(_) => "UnknownSequenceError",
            CoreError::UnknownRequest(_) => "UnknownRequestError",
            CoreError::DuplicateRequest(_) => "DuplicateRequestError",
            CoreError::PromptTooLong(_) => "PromptTooLongError",
            CoreError::StaleOutput(_) => "StaleOutputError",
            CoreError::InvariantViolation(_) => "InvariantViolationError",
        };
        py_error(class, e.to_string())
    }
}
