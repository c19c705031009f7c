//! Maps [`CoreError`] to the `pagedkv.errors` exception classes (python/pagedkv/errors.py).
//!
//! The classes are defined in Python so they can inherit from built-ins too (`ValueError`,
//! `LookupError`, `TypeError`); they are looked up once and cached. The mapping is one
//! exhaustive `match`: a new variant does not compile until it has a class, and a class can
//! only be named through `ErrorClass`, whose names are tested to exist in errors.py.

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

/// Declares the `pagedkv.errors` classes the bindings raise: `ErrorClass` has one variant
/// per class, named like it, and `ERROR_CLASS_NAMES` lists them. A class is raised only
/// through `ErrorClass`, so every name the bindings can use is in the list, which
/// tests/core/test_errors_mapping.py checks against python/pagedkv/errors.py (exported as
/// `pagedkv._core.ERROR_CLASS_NAMES`).
macro_rules! error_classes {
    ($($class:ident),* $(,)?) => {
        /// A class of `pagedkv.errors` (see `error_classes!`), named exactly like it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[allow(clippy::enum_variant_names)]
        pub enum ErrorClass {
            $(
                #[doc = concat!("`pagedkv.errors.", stringify!($class), "`.")]
                $class,
            )*
        }

        impl ErrorClass {
            /// The class name in `pagedkv.errors`.
            pub fn name(self) -> &'static str {
                match self {
                    $(ErrorClass::$class => stringify!($class),)*
                }
            }
        }

        /// Every class name `ErrorClass` can raise.
        pub const ERROR_CLASS_NAMES: &[&str] = &[$(stringify!($class)),*];
    };
}

error_classes!(
    ConfigError,
    InvalidArgumentError,
    InvalidTypeError,
    InvalidBlockError,
    InvalidTokenError,
    UnknownSequenceError,
    UnknownRequestError,
    DuplicateRequestError,
    PromptTooLongError,
    StaleOutputError,
    InvariantViolationError,
);

/// A `pagedkv.errors` exception of `class` with `msg`.
pub fn py_error(class: ErrorClass, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| PyErr::from_type(error_class(py, class.name()), msg))
}

/// `pagedkv.errors.InvalidArgumentError`.
pub fn invalid_argument(msg: impl Into<String>) -> PyErr {
    py_error(ErrorClass::InvalidArgumentError, msg)
}

/// `pagedkv.errors.InvalidTypeError`.
pub fn invalid_type(msg: impl Into<String>) -> PyErr {
    py_error(ErrorClass::InvalidTypeError, msg)
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        let class = match &e {
            CoreError::Config(_) => ErrorClass::ConfigError,
            CoreError::BlockOutOfRange { .. } => ErrorClass::InvalidBlockError,
            CoreError::BlockNotAllocated(_) => ErrorClass::InvalidBlockError,
            CoreError::InvalidArgument(_) => ErrorClass::InvalidArgumentError,
            CoreError::InvalidToken { .. } => ErrorClass::InvalidTokenError,
            CoreError::UnknownSequence(_) => ErrorClass::UnknownSequenceError,
            CoreError::UnknownRequest(_) => ErrorClass::UnknownRequestError,
            CoreError::DuplicateRequest(_) => ErrorClass::DuplicateRequestError,
            CoreError::PromptTooLong(_) => ErrorClass::PromptTooLongError,
            CoreError::StaleOutput(_) => ErrorClass::StaleOutputError,
            CoreError::InvariantViolation(_) => ErrorClass::InvariantViolationError,
        };
        py_error(class, e.to_string())
    }
}
