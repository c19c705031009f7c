//! `pagedkv._core.cpu_linear`: the CPU linear kernel (crate::cpu_linear) on numpy views of
//! torch tensors (`tensor.numpy()` shares memory, so nothing is copied).

use numpy::{
    PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{contiguous_arg as contiguous, contiguous_mut_arg as contiguous_mut};
use super::errors::{invalid_argument, invalid_type};
use crate::cpu_isa::{attention_path, CpuFeatures};
use crate::cpu_linear::{cpu_linear as linear, LinearDims, LinearIsa, LinearRun, LinearWeight};

/// `out = x @ weight.T (* scales) + bias` into `out` on up to `num_threads` threads. `x`:
/// float32 `[M, K]`; `weight`: float32 `[N, K]`, int8 `[N, K]` codes with `scales` float32
/// `[N]` (required for int8, refused otherwise), or uint16 `[N, K]` bfloat16 bit patterns
/// (torch: `w.bfloat16().view(torch.int16).numpy().view(numpy.uint16)`); `bias`: float32
/// `[N]`; `out`: float32 `[M, N]`. Every array C-contiguous. Row `m` of the result is bit for
/// bit what `x[m:m+1]` alone gives. `prefetch=False` turns off the prefetch of weight rows
/// ahead (to measure it; same bits). `isa`: the kernel's path, `"auto"` (the fastest this CPU
/// has), `"portable"`, `"avx2"`, `"avx512"` or `"avx512_bf16"` (bfloat16 weights; others run
/// `"avx512"`): a path the CPU lacks is an `InvalidArgumentError` naming the missing features.
/// The GIL is released while the kernel runs.
#[pyfunction]
#[pyo3(signature = (x, weight, out, num_threads, scales = None, bias = None, prefetch = true, isa = "auto"))]
#[allow(clippy::too_many_arguments)] // a Python signature: keywords, not a struct
pub fn cpu_linear(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: &Bound<'_, PyAny>,
    mut out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
    scales: Option<PyReadonlyArray1<'_, f32>>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    prefetch: bool,
    isa: &str,
) -> PyResult<()> {
    let isa = match isa {
        "auto" => None,
        name => Some(LinearIsa::from_name(name).ok_or_else(|| {
            invalid_argument(format!(
                "isa must be 'auto', 'portable', 'avx2', 'avx512' or 'avx512_bf16', got {name:?}"
            ))
        })?),
    };
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let out_shape = out.shape().to_vec();
    let x_data = contiguous(&x, "x")?;
    let bias_data = match &bias {
        Some(b) => Some(contiguous(b, "bias")?),
        None => None,
    };
    // The borrows of the weight's array and scales; they must outlive `w`.
    let (w_f32, w_i8, w_bf16, scale_data);
    let (n, w) = if let Ok(arr) = weight.cast::<PyArray2<f32>>() {
        if scales.is_some() {
            return Err(invalid_argument("float32 weights take no scales"));
        }
        w_f32 = arr
            .try_readonly()
            .map_err(|e| invalid_argument(format!("weight: {e}")))?;
        let n = w_f32.shape()[0];
        (n, LinearWeight::F32(contiguous(&w_f32, "weight")?))
    } else if let Ok(arr) = weight.cast::<PyArray2<i8>>() {
        let Some(s) = &scales else {
            return Err(invalid_argument("int8 weights need their scales"));
        };
        w_i8 = arr
            .try_readonly()
            .map_err(|e| invalid_argument(format!("weight: {e}")))?;
        scale_data = contiguous(s, "scales")?;
        let n = w_i8.shape()[0];
        let codes = contiguous(&w_i8, "weight")?;
        (
            n,
            LinearWeight::Int8 {
                codes,
                scales: scale_data,
            },
        )
    } else if let Ok(arr) = weight.cast::<PyArray2<u16>>() {
        if scales.is_some() {
            return Err(invalid_argument("bfloat16 weights take no scales"));
        }
        w_bf16 = arr
            .try_readonly()
            .map_err(|e| invalid_argument(format!("weight: {e}")))?;
        let n = w_bf16.shape()[0];
        (n, LinearWeight::Bf16(contiguous(&w_bf16, "weight")?))
    } else {
        return Err(invalid_type(
            "weight must be a 2-D float32, int8 or uint16 (bfloat16 bits) numpy array",
        ));
    };
    if out_shape != [m, n] {
        return Err(invalid_argument(format!(
            "out has shape {out_shape:?}, want [{m}, {n}] for x [{m}, {k}] and {n} output rows"
        )));
    }
    let dims = LinearDims {
        rows: m,
        in_features: k,
        out_features: n,
    };
    let o = contiguous_mut(&mut out, "out")?;
    let run = LinearRun {
        threads: num_threads,
        prefetch,
        isa,
    };
    py.detach(|| linear(x_data, w, bias_data, dims, o, run))?;
    Ok(())
}

/// What this CPU has and which path each of pagedkv's CPU kernels takes on it: a dict with
/// `features` (the detected extensions: `avx2`, `fma`, `f16c`, `avx512f`, `avx512bw`,
/// `avx512vl`, `avx512_bf16`, `avx512_vnni`, `amx_tile`, `amx_bf16`, `amx_int8`),
/// `linear_paths` (every path of `cpu_linear` this CPU can run, slowest first), `linear`
/// (the path `isa="auto"` takes per weight format: `float32`, `int8`, `bfloat16`) and
/// `attention` (the decode attention kernel's path).
#[pyfunction]
pub fn cpu_isa(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("features", CpuFeatures::get().names())?;
    let paths: Vec<&str> = LinearIsa::ALL
        .into_iter()
        .filter(|isa| isa.available())
        .map(LinearIsa::name)
        .collect();
    out.set_item("linear_paths", paths)?;
    let per_format = PyDict::new(py);
    per_format.set_item("float32", LinearIsa::best().name())?;
    per_format.set_item("int8", LinearIsa::best().name())?;
    per_format.set_item("bfloat16", LinearIsa::best_bf16().name())?;
    out.set_item("linear", per_format)?;
    out.set_item("attention", attention_path())?;
    Ok(out)
}
