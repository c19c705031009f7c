//! `pagedkv._core.cpu_linear_gguf`: the GGUF block linear kernel (crate::cpu_linear_gguf) on
//! numpy views of torch tensors (nothing is copied).

use numpy::{
    PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::args::{contiguous_arg as contiguous, contiguous_mut_arg as contiguous_mut};
use super::errors::{invalid_argument, invalid_type};
use crate::cpu_linear::LinearDims;
use crate::cpu_linear_gguf::{cpu_linear_gguf as linear, GgufIsa, GgufType, GgufWeight};

/// `out = x @ W.T + bias` into `out`, `W` given as GGUF blocks, on up to `num_threads`
/// threads. `x`: float32 `[M, K]`; `blocks`: uint8 `[N, K / block_values * block_bytes]`, each
/// row one weight row's blocks; `kind`: `"Q4_0"`, `"Q4_1"`, `"Q8_0"` or `"Q4_K"`; `bias`:
/// float32 `[N]`; `out`: float32 `[M, N]`; `isa`: `"auto"`, `"portable"`, `"avx2"` or
/// `"avx512"` (one the CPU lacks is an error). Every array C-contiguous. Row `m` of the result
/// is bit for bit what `x[m:m+1]` alone gives (on one `isa`). The GIL is released while the
/// kernel runs.
#[pyfunction]
#[pyo3(signature = (x, blocks, kind, out, num_threads, bias = None, isa = "auto"))]
#[allow(clippy::too_many_arguments)] // a Python signature: keywords, not a struct
pub fn cpu_linear_gguf(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    blocks: &Bound<'_, PyAny>,
    kind: &str,
    mut out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    isa: &str,
) -> PyResult<()> {
    let Some(kind) = GgufType::from_name(kind) else {
        return Err(invalid_argument(format!(
            "kind must be 'Q4_0', 'Q4_1', 'Q8_0' or 'Q4_K', got {kind:?}"
        )));
    };
    let Some(isa) = GgufIsa::from_name(isa) else {
        return Err(invalid_argument(format!(
            "isa must be 'auto', 'portable', 'avx2' or 'avx512', got {isa:?}"
        )));
    };
    let Ok(arr) = blocks.cast::<PyArray2<u8>>() else {
        return Err(invalid_type("blocks must be a 2-D uint8 numpy array"));
    };
    let blocks = arr
        .try_readonly()
        .map_err(|e| invalid_argument(format!("blocks: {e}")))?;
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let (n, row_bytes) = (blocks.shape()[0], blocks.shape()[1]);
    if k % kind.block_values() != 0 || row_bytes != k / kind.block_values() * kind.block_bytes() {
        return Err(invalid_argument(format!(
            "blocks rows of {row_bytes} bytes do not hold {k} {kind:?} values (blocks of {} values in {} bytes)",
            kind.block_values(),
            kind.block_bytes()
        )));
    }
    let out_shape = out.shape().to_vec();
    if out_shape != [m, n] {
        return Err(invalid_argument(format!(
            "out has shape {out_shape:?}, want [{m}, {n}] for x [{m}, {k}] and {n} output rows"
        )));
    }
    let x_data = contiguous(&x, "x")?;
    let bias_data = match &bias {
        Some(b) => Some(contiguous(b, "bias")?),
        None => None,
    };
    let weight = GgufWeight {
        kind,
        blocks: contiguous(&blocks, "blocks")?,
    };
    let dims = LinearDims {
        rows: m,
        in_features: k,
        out_features: n,
    };
    let o = contiguous_mut(&mut out, "out")?;
    py.detach(|| linear(x_data, weight, bias_data, dims, o, num_threads, isa))?;
    Ok(())
}

/// The instruction sets this CPU runs the GGUF kernel on (`"avx512"`, `"avx2"`, then
/// `"portable"`, always last); `"auto"` picks `"avx2"` where the CPU has it.
#[pyfunction]
pub fn gguf_linear_isas() -> Vec<&'static str> {
    [GgufIsa::Avx512, GgufIsa::Avx2, GgufIsa::Portable]
        .into_iter()
        .filter(|isa| isa.available())
        .map(GgufIsa::name)
        .collect()
}
