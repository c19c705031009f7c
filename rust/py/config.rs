//! The scheduler's configuration table at the Python boundary: `config_fields()` describes
//! every setting's default and range (from `scheduler::config::FIELDS`, where each is written
//! once), `check_config_fields(**fields)` checks values against it, and
//! `resolve_speculative(**args)` turns a speculative-decoding config into its checked, complete
//! form. `pagedkv.config` builds its dataclasses' defaults from the first and validates with
//! the other two, so Python repeats none of these ranges. Every refusal is a `ConfigError`
//! naming the field, the accepted values and the value given (as Python shows it).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString};

use crate::error::CoreError;
use crate::scheduler::{field, FieldDefault, FieldRange, FieldSpec, SpeculativeArgs, FIELDS};
use crate::speculative::SpecMethod;

/// The Python repr of `obj`, for messages.
fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into())
}

/// The table entry of `name`; ConfigError naming the known ones otherwise.
fn spec_of(name: &str) -> PyResult<&'static FieldSpec> {
    field(name).ok_or_else(|| {
        let known: Vec<&str> = FIELDS.iter().map(|f| f.name).collect();
        CoreError::Config(format!("unknown scheduler setting {name:?}; known: {known:?}")).into()
    })
}

/// `obj` as the integer a field takes (no bools, no floats), checked against its range.
fn int_field(obj: &Bound<'_, PyAny>, spec: &FieldSpec) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(spec.refuse(&repr(obj)).into());
    }
    let v: i64 = obj.extract().map_err(|_| spec.refuse(&repr(obj)))?;
    spec.check_int(v)?;
    Ok(v)
}

/// `obj` as the number a field takes (an int or a float, no bools), checked against its range.
fn float_field(obj: &Bound<'_, PyAny>, spec: &FieldSpec) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(spec.refuse(&repr(obj)).into());
    }
    let v: f64 = obj.extract().map_err(|_| spec.refuse(&repr(obj)))?;
    spec.check_float(v).map_err(|_| spec.refuse(&repr(obj)))?;
    Ok(v)
}

/// Checks one value against its field's type and range.
fn check_field(obj: &Bound<'_, PyAny>, spec: &FieldSpec) -> PyResult<()> {
    match spec.range {
        FieldRange::Int { .. } => int_field(obj, spec).map(drop),
        FieldRange::Float { .. } => float_field(obj, spec).map(drop),
        FieldRange::Bool if obj.is_instance_of::<PyBool>() => Ok(()),
        FieldRange::Choice(_) => match obj.cast::<PyString>() {
            Ok(s) => Ok(spec.check_str(s.to_str()?)?),
            Err(_) => Err(spec.refuse(&repr(obj)).into()),
        },
        FieldRange::Bool => Err(spec.refuse(&repr(obj)).into()),
    }
}

/// `config_fields()`: `{name: {"default", "kind", "min", "max", "min_inclusive",
/// "max_inclusive", "choices"}}` for every scheduler and speculative-decoding setting
/// (`default` None where there is none; `kind` "int", "float", "bool" or "choice"; bounds and
/// choices None where they do not apply).
#[pyfunction]
pub fn config_fields(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for f in FIELDS {
        let d = PyDict::new(py);
        match f.default {
            FieldDefault::Unset => d.set_item("default", py.None())?,
            FieldDefault::Int(v) => d.set_item("default", v)?,
            FieldDefault::Float(v) => d.set_item("default", v)?,
            FieldDefault::Bool(v) => d.set_item("default", v)?,
            FieldDefault::Str(v) => d.set_item("default", v)?,
        }
        let none = py.None();
        let (kind, min, max, min_inclusive, max_inclusive, choices) = match f.range {
            FieldRange::Int { min, max } => {
                ("int", min.into_pyobject(py)?.into_any(), max.into_pyobject(py)?, true, true, none)
            }
            FieldRange::Float { min, min_inclusive, max, max_inclusive } => {
                ("float", min.into_pyobject(py)?.into_any(), max.into_pyobject(py)?, min_inclusive, max_inclusive, none)
            }
            FieldRange::Bool => ("bool", none.bind(py).clone(), none.bind(py).clone(), true, true, none),
            FieldRange::Choice(names) => {
                let names = pyo3::types::PyTuple::new(py, names)?.into_any().unbind();
                ("choice", none.bind(py).clone(), none.bind(py).clone(), true, true, names)
            }
        };
        d.set_item("kind", kind)?;
        d.set_item("min", min)?;
        d.set_item("max", max)?;
        d.set_item("min_inclusive", min_inclusive)?;
        d.set_item("max_inclusive", max_inclusive)?;
        d.set_item("choices", choices)?;
        d.set_item("expected", f.expected())?;
        out.set_item(f.name, d)?;
    }
    Ok(out)
}

/// `check_config_fields(**fields)`: checks each value against its setting's type and range
/// (`config_fields()`); ConfigError for the first that is refused, or for an unknown name.
#[pyfunction]
#[pyo3(signature = (**fields))]
pub fn check_config_fields(fields: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let Some(fields) = fields else { return Ok(()) };
    for (name, value) in fields.iter() {
        let name = name.cast::<PyString>()?.to_str()?.to_string();
        check_field(&value, spec_of(&name)?)?;
    }
    Ok(())
}

/// The speculative-decoding arguments of a keyword mapping (`None` values are "not given"),
/// each checked for its type; keys are the `SchedulerConfig` keyword names.
pub fn speculative_args<'py>(get: impl Fn(&str) -> Option<Bound<'py, PyAny>>) -> PyResult<SpeculativeArgs> {
    let given = |name: &str| get(name).filter(|o| !o.is_none());
    let int = |name: &str| -> PyResult<Option<i64>> {
        given(name)
            .map(|o| {
                let spec = spec_of(name)?;
                if o.is_instance_of::<PyBool>() {
                    return Err(spec.refuse(&repr(&o)).into());
                }
                o.extract::<i64>().map_err(|_| PyErr::from(spec.refuse(&repr(&o))))
            })
            .transpose()
    };
    let float = |name: &str| -> PyResult<Option<f64>> {
        given(name)
            .map(|o| {
                let spec = spec_of(name)?;
                if o.is_instance_of::<PyBool>() {
                    return Err(spec.refuse(&repr(&o)).into());
                }
                o.extract::<f64>().map_err(|_| PyErr::from(spec.refuse(&repr(&o))))
            })
            .transpose()
    };
    let adaptive = given("speculative_adaptive")
        .map(|o| {
            if o.is_instance_of::<PyBool>() {
                Ok(o.extract::<bool>()?)
            } else {
                Err(PyErr::from(spec_of("speculative_adaptive")?.refuse(&repr(&o))))
            }
        })
        .transpose()?;
    let method = given("speculative_method")
        .map(|o| match o.cast::<PyString>() {
            Ok(s) => Ok(s.to_str()?.to_string()),
            Err(_) => Err(PyErr::from(spec_of("speculative_method")?.refuse(&repr(&o)))),
        })
        .transpose()?;
    Ok(SpeculativeArgs {
        method,
        num_speculative_tokens: int("num_speculative_tokens")?,
        prompt_lookup_min: int("prompt_lookup_min")?,
        prompt_lookup_max: int("prompt_lookup_max")?,
        adaptive,
        suffix_decoding_max_tree_depth: int("suffix_decoding_max_tree_depth")?,
        suffix_decoding_max_spec_factor: float("suffix_decoding_max_spec_factor")?,
        suffix_decoding_min_token_prob: float("suffix_decoding_min_token_prob")?,
        suffix_decoding_max_cached_requests: int("suffix_decoding_max_cached_requests")?,
    })
}

/// `resolve_speculative(**args)`: the complete, checked speculative-decoding config of
/// `SchedulerConfig`'s speculative keywords (`speculative_method`, `num_speculative_tokens`,
/// `prompt_lookup_min`, ...; None: not given) as a dict of the same keywords, every default
/// filled in (only the chosen method's parameters). ConfigError for a bad one.
#[pyfunction]
#[pyo3(signature = (**args))]
pub fn resolve_speculative<'py>(py: Python<'py>, args: Option<&Bound<'py, PyDict>>) -> PyResult<Bound<'py, PyDict>> {
    if let Some(args) = args {
        for key in args.keys() {
            spec_of(key.cast::<PyString>()?.to_str()?)?;
        }
    }
    let parsed = speculative_args(|name| args.and_then(|a| a.get_item(name).ok().flatten()))?;
    let config = parsed.resolve()?;
    let out = PyDict::new(py);
    out.set_item("speculative_method", config.method.name())?;
    out.set_item("num_speculative_tokens", config.num_speculative_tokens)?;
    out.set_item("speculative_adaptive", config.adaptive)?;
    match config.method {
        SpecMethod::Ngram { min, max } => {
            out.set_item("prompt_lookup_min", min)?;
            out.set_item("prompt_lookup_max", max)?;
        }
        SpecMethod::Suffix(p) => {
            out.set_item("suffix_decoding_max_tree_depth", p.max_depth)?;
            out.set_item("suffix_decoding_max_spec_factor", p.max_spec_factor)?;
            out.set_item("suffix_decoding_min_token_prob", p.min_token_prob)?;
            out.set_item("suffix_decoding_max_cached_requests", p.max_cached_requests)?;
        }
        SpecMethod::Provided => {}
    }
    Ok(out)
}
