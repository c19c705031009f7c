//! `pagedkv._core.paged_decode_attention`: the CPU decode-attention kernel on numpy views of
//! torch tensors (`tensor.numpy()` shares memory, so nothing is copied).

use numpy::{PyUntypedArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3};
use pyo3::prelude::*;

use super::args::{contiguous_arg as contiguous, contiguous_mut_arg as contiguous_mut};
use super::errors::invalid_argument;
use crate::cpu_attention::{paged_decode_attention, AttentionDims, DecodeRow};

/// Attention of every sequence with one query row (a decode) over the paged caches, written
/// into `out`; rows of longer sequences are left untouched. `query`, `out`: float32 `[T, H, D]`;
/// caches: float32 `[num_blocks, block_size, Hkv, D]`; `block_tables` int32 `[B, W]`;
/// `seq_lens` int32 `[B]`; `cu_seqlens_q` int32 `[B + 1]`. Returns the number of rows written.
#[pyfunction]
#[pyo3(signature = (query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_cpu(
    py: Python<'_>,
    query: PyReadonlyArray3<'_, f32>,
    key_cache: PyReadonlyArray4<'_, f32>,
    value_cache: PyReadonlyArray4<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    cu_seqlens_q: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArray3<'_, f32>,
    scale: f32,
    num_threads: usize,
) -> PyResult<usize> {
    let qs = query.shape().to_vec();
    let ks = key_cache.shape().to_vec();
    if ks != value_cache.shape() || out.shape() != qs.as_slice() || ks[3] != qs[2] {
        return Err(invalid_argument(format!(
            "shapes do not agree: query {qs:?}, caches {ks:?} / {:?}, out {:?}",
            value_cache.shape(),
            out.shape()
        )));
    }
    let dims = AttentionDims { num_heads: qs[1], num_kv_heads: ks[2], head_dim: qs[2], block_size: ks[1], num_blocks: ks[0] };
    let (b, w) = (block_tables.shape()[0], block_tables.shape()[1]);
    let lens = contiguous(seq_lens.as_slice(), "seq_lens")?;
    let cu = contiguous(cu_seqlens_q.as_slice(), "cu_seqlens_q")?;
    let tables = contiguous(block_tables.as_slice(), "block_tables")?;
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
                return Err(invalid_argument(format!("sequence {i}: bad cu_seqlens_q {} or seq_len {}", cu[i], lens[i])));
            }
            rows.push(DecodeRow { row: cu[i] as usize, seq_len: lens[i] as usize, table: &tables[i * w..(i + 1) * w] });
        }
    }
    let q = contiguous(query.as_slice(), "query")?;
    let kc = contiguous(key_cache.as_slice(), "key_cache")?;
    let vc = contiguous(value_cache.as_slice(), "value_cache")?;
    let o = contiguous_mut(out.as_slice_mut(), "out")?;
    let n = rows.len();
    py.detach(|| paged_decode_attention(q, kc, vc, dims, &rows, scale, o, num_threads))?;
    Ok(n)
}
