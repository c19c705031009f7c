//! `pagedkv._core.paged_decode_attention_cpu`: the CPU decode-attention kernel on numpy views
//! of torch tensors (`tensor.numpy()` shares memory, so nothing is copied; an fp8 cache is
//! passed as its bytes, `tensor.view(torch.uint8).numpy()`, and bfloat16 scales as their bits,
//! `scales.view(torch.int16).numpy()`).

use numpy::{
    Element, PyArray3, PyArray4, PyArrayMethods, PyReadonlyArray, PyReadonlyArray1,
    PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray3, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::args::{contiguous_arg as contiguous, contiguous_mut_arg as contiguous_mut};
use super::errors::{invalid_argument, invalid_type};
use crate::cpu_attention::{
    paged_decode_attention_layer, AttentionDims, DecodeRow, KvCaches, LayerVariant, Quantized,
};

/// The storage formats `kv_format` names (python/pagedkv/kernels/kv_quant.py spells them alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KvFormat {
    Float32,
    Int8,
    Fp8E4M3,
    Fp8E5M2,
}

impl KvFormat {
    const ALL: [KvFormat; 4] = [
        KvFormat::Float32,
        KvFormat::Int8,
        KvFormat::Fp8E4M3,
        KvFormat::Fp8E5M2,
    ];

    fn name(self) -> &'static str {
        match self {
            KvFormat::Float32 => "float32",
            KvFormat::Int8 => "int8",
            KvFormat::Fp8E4M3 => "fp8_e4m3",
            KvFormat::Fp8E5M2 => "fp8_e5m2",
        }
    }

    /// The numpy dtype of the caches in this format.
    fn cache_dtype(self) -> &'static str {
        match self {
            KvFormat::Float32 => "float32",
            KvFormat::Int8 => "int8",
            KvFormat::Fp8E4M3 | KvFormat::Fp8E5M2 => "uint8 (the fp8 bytes)",
        }
    }

    fn parse(name: &str) -> PyResult<KvFormat> {
        KvFormat::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = KvFormat::ALL.iter().map(|f| f.name()).collect();
                invalid_argument(format!("kv_format must be one of {names:?}, got {name:?}"))
            })
    }
}

/// Attention of every sequence with one query row (a decode) over the paged caches, written
/// into `out`; rows of longer sequences are left untouched. `query`, `out`: float32 `[T, H, D]`;
/// caches `[num_blocks, block_size, Hkv, D]`: float32 for `kv_format="float32"`, int8 for
/// `"int8"`, uint8 (the fp8 bytes) for `"fp8_e4m3"` / `"fp8_e5m2"`; `key_scales` /
/// `value_scales`: int16 `[num_blocks, block_size, Hkv]` holding bfloat16 bit patterns,
/// required for a quantized format and refused for float32; `block_tables` int32 `[B, W]`;
/// `seq_lens` int32 `[B]`; `cu_seqlens_q` int32 `[B + 1]`. A layer variant:
/// `sliding_window` / `chunk_size` (a row reads only the blocks from its first visible position
/// on), `logits_soft_cap`, `sinks` (float32 `[H]`). Returns the number of rows written.
/// The GIL is released while the kernel runs.
#[pyfunction]
#[pyo3(signature = (
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, num_threads,
    kv_format = "float32", key_scales = None, value_scales = None,
    sliding_window = None, chunk_size = None, logits_soft_cap = None, sinks = None
))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_cpu(
    py: Python<'_>,
    query: PyReadonlyArray3<'_, f32>,
    key_cache: &Bound<'_, PyAny>,
    value_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    cu_seqlens_q: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArray3<'_, f32>,
    scale: f32,
    num_threads: usize,
    kv_format: &str,
    key_scales: Option<&Bound<'_, PyAny>>,
    value_scales: Option<&Bound<'_, PyAny>>,
    sliding_window: Option<usize>,
    chunk_size: Option<usize>,
    logits_soft_cap: Option<f32>,
    sinks: Option<PyReadonlyArray1<'_, f32>>,
) -> PyResult<usize> {
    let format = KvFormat::parse(kv_format)?;
    let key_scales = key_scales.filter(|s| !s.is_none());
    let value_scales = value_scales.filter(|s| !s.is_none());
    if format == KvFormat::Float32 && (key_scales.is_some() || value_scales.is_some()) {
        return Err(invalid_argument(
            "float32 caches take no key_scales / value_scales",
        ));
    }
    let qs = query.shape().to_vec();
    let ks = untyped(key_cache, "key_cache")?.shape().to_vec();
    let vs = untyped(value_cache, "value_cache")?.shape().to_vec();
    if ks.len() != 4 || ks != vs || out.shape() != qs.as_slice() || ks[3] != qs[2] {
        return Err(invalid_argument(format!(
            "shapes do not agree: query {qs:?}, caches {ks:?} / {vs:?}, out {:?}",
            out.shape()
        )));
    }
    let dims = AttentionDims {
        num_heads: qs[1],
        num_kv_heads: ks[2],
        head_dim: qs[2],
        block_size: ks[1],
        num_blocks: ks[0],
    };

    // Every array is borrowed (read-only, or read-write for `out`) for the whole call, so the
    // slices below stay valid while the GIL is released.
    let (b, w) = (block_tables.shape()[0], block_tables.shape()[1]);
    let lens = contiguous(&seq_lens, "seq_lens")?;
    let cu = contiguous(&cu_seqlens_q, "cu_seqlens_q")?;
    let tables = contiguous(&block_tables, "block_tables")?;
    if lens.len() != b || cu.len() != b + 1 {
        return Err(invalid_argument(format!(
            "{b} block-table rows, {} seq_lens, {} cu_seqlens_q (want B and B + 1)",
            lens.len(),
            cu.len()
        )));
    }
    let mut rows = Vec::with_capacity(b);
    for i in 0..b {
        if cu[i + 1] - cu[i] == 1 {
            if cu[i] < 0 || lens[i] < 1 {
                return Err(invalid_argument(format!(
                    "sequence {i}: bad cu_seqlens_q {} or seq_len {}",
                    cu[i], lens[i]
                )));
            }
            rows.push(DecodeRow {
                row: cu[i] as usize,
                seq_len: lens[i] as usize,
                table: &tables[i * w..(i + 1) * w],
            });
        }
    }
    let q = contiguous(&query, "query")?;

    // The borrows of the arrays the format uses; they must outlive `caches`.
    let (kc_f32, vc_f32, kc_i8, vc_i8, kc_u8, vc_u8);
    let (k_scales, v_scales);
    let caches = if format == KvFormat::Float32 {
        kc_f32 = cache_array::<f32>(key_cache, "key_cache", format)?;
        vc_f32 = cache_array::<f32>(value_cache, "value_cache", format)?;
        KvCaches::F32 {
            key: contiguous(&kc_f32, "key_cache")?,
            value: contiguous(&vc_f32, "value_cache")?,
        }
    } else {
        let expected_scales = [ks[0], ks[1], ks[2]];
        k_scales = scales_array(key_scales, "key_scales", format, expected_scales)?;
        v_scales = scales_array(value_scales, "value_scales", format, expected_scales)?;
        let (k_bits, v_bits) = (
            bf16_bits(&k_scales, "key_scales")?,
            bf16_bits(&v_scales, "value_scales")?,
        );
        if format == KvFormat::Int8 {
            kc_i8 = cache_array::<i8>(key_cache, "key_cache", format)?;
            vc_i8 = cache_array::<i8>(value_cache, "value_cache", format)?;
            let key = Quantized {
                data: contiguous(&kc_i8, "key_cache")?,
                scales: k_bits,
            };
            let value = Quantized {
                data: contiguous(&vc_i8, "value_cache")?,
                scales: v_bits,
            };
            KvCaches::Int8 { key, value }
        } else {
            kc_u8 = cache_array::<u8>(key_cache, "key_cache", format)?;
            vc_u8 = cache_array::<u8>(value_cache, "value_cache", format)?;
            let key = Quantized {
                data: contiguous(&kc_u8, "key_cache")?,
                scales: k_bits,
            };
            let value = Quantized {
                data: contiguous(&vc_u8, "value_cache")?,
                scales: v_bits,
            };
            if format == KvFormat::Fp8E4M3 {
                KvCaches::Fp8E4M3 { key, value }
            } else {
                KvCaches::Fp8E5M2 { key, value }
            }
        }
    };
    let sinks = match &sinks {
        Some(array) => Some(contiguous(array, "sinks")?),
        None => None,
    };
    let variant = LayerVariant {
        sliding_window,
        chunk_size,
        logits_soft_cap,
        sinks,
    };
    let o = contiguous_mut(&mut out, "out")?;
    let n = rows.len();
    py.detach(|| {
        paged_decode_attention_layer(q, caches, dims, &rows, scale, variant, o, num_threads)
    })?;
    Ok(n)
}

/// `obj` as a numpy array of any dtype (InvalidTypeError otherwise).
fn untyped<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &str,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    obj.cast::<PyUntypedArray>()
        .map_err(|_| invalid_type(format!("{name} must be a numpy array")))
}

/// The numpy dtype's name (`float32`, `int16`, ...).
fn dtype_name(obj: &Bound<'_, PyAny>) -> String {
    obj.getattr("dtype")
        .and_then(|d| d.getattr("name"))
        .and_then(|n| n.extract::<String>())
        .unwrap_or_else(|_| "?".into())
}

/// A 4-D cache array of element type `T` (InvalidTypeError, a kind of InvalidArgumentError,
/// for another dtype).
fn cache_array<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    format: KvFormat,
) -> PyResult<PyReadonlyArray<'py, T, numpy::Ix4>> {
    let arr = obj.cast::<PyArray4<T>>().map_err(|_| {
        invalid_type(format!(
            "{name} must have dtype {} for kv_format {:?}, got {}",
            format.cache_dtype(),
            format.name(),
            dtype_name(obj)
        ))
    })?;
    // Not `readonly()`, which panics when the array is already borrowed mutably (`out`).
    arr.try_readonly()
        .map_err(|e| invalid_argument(format!("{name}: {e}")))
}

/// The scales of a quantized cache: a C-contiguous int16 `[num_blocks, block_size, Hkv]`
/// array (bfloat16 bit patterns), required.
fn scales_array<'py>(
    obj: Option<&Bound<'py, PyAny>>,
    name: &str,
    format: KvFormat,
    expected: [usize; 3],
) -> PyResult<PyReadonlyArray3<'py, i16>> {
    let Some(obj) = obj else {
        return Err(invalid_argument(format!(
            "kv_format {:?} needs {name} (int16 bfloat16 bits, shape {expected:?})",
            format.name()
        )));
    };
    let shape = untyped(obj, name)?.shape();
    if shape != expected {
        return Err(invalid_argument(format!(
            "{name} must have shape {expected:?} (one per slot and KV head), got {shape:?}"
        )));
    }
    let arr = obj.cast::<PyArray3<i16>>().map_err(|_| {
        invalid_type(format!(
            "{name} must have dtype int16 (bfloat16 bits), got {}",
            dtype_name(obj)
        ))
    })?;
    arr.try_readonly()
        .map_err(|e| invalid_argument(format!("{name}: {e}")))
}

/// The bfloat16 bit patterns of an int16 scales array, as `u16`.
fn bf16_bits<'a>(arr: &'a PyReadonlyArray3<'_, i16>, name: &str) -> PyResult<&'a [u16]> {
    let s = contiguous(arr, name)?;
    // SAFETY: i16 and u16 have the same size and alignment and every bit pattern is valid for
    // both; the slice borrows `arr`, so it lives no longer than the array's read-only borrow.
    Ok(unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) })
}
