//! `pagedkv._core.cpu_linear`: the CPU linear kernel (crate::cpu_linear) on numpy views of
//! torch tensors (`tensor.numpy()` shares memory, so nothing is copied).

use numpy::{
    PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::args::{contiguous_arg as contiguous, contiguous_mut_arg as contiguous_mut};
use super::errors::{invalid_argument, invalid_type};
use crate::cpu_linear::{cpu_linear as linear, LinearDims, LinearRun, LinearWeight};

/// `out = x @ weight.T (* scales) + bias` into `out` on up to `num_threads` threads. `x`:
/// float32 `[M, K]`; `weight`: float32 `[N, K]`, or int8 `[N, K]` codes with `scales` float32
/// `[N]` (required for int8, refused for float32); `bias`: float32 `[N]`; `out`: float32
/// `[M, N]`. Every array C-contiguous. Row `m` of the result is bit for bit what `x[m:m+1]`
/// alone gives. `prefetch=False` turns off the prefetch of weight rows ahead (to measure it;
/// same bits). The GIL is released while the kernel runs.
#[pyfunction]
#[pyo3(signature = (x, weight, out, num_threads, scales = None, bias = None, prefetch = true))]
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
) -> PyResult<()> {
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let out_shape = out.shape().to_vec();
    let x_data = contiguous(&x, "x")?;
    let bias_data = match &bias {
        Some(b) => Some(contiguous(b, "bias")?),
        None => None,
    };
    // The borrows of the weight's array and scales; they must outlive `w`.
    let (w_f32, w_i8, scale_data);
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
    } else {
        return Err(invalid_type(
            "weight must be a 2-D float32 or int8 numpy array",
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
    };
    py.detach(|| linear(x_data, w, bias_data, dims, o, run))?;
    Ok(())
}
