//! Paged decode attention on the CPU, read straight from the block-structured cache.
//!
//! The torch fallback gathers each decode sequence's K and V into a contiguous padded copy and
//! then runs SDPA: the KV bytes cross memory three times (read, write, read again). On the CPU
//! decode attention is bound by memory bandwidth, so this kernel reads every K and V row once,
//! through the block table, and never copies the cache.
//!
//! For one decode row (the last token of its sequence, which sees every key), with query head
//! `h` reading KV head `h / G` (`G = num_heads / num_kv_heads`):
//! 1. scores `s[h][p] = scale * q[h] · K[p][h / G]`, streaming the K row of each position
//!    (all KV heads, contiguous) once for all query heads;
//! 2. per query head, `m = max s`, `e = exp(s - m)` (a vectorisable polynomial exp), `z = Σ e`;
//! 3. `out[h] = Σ_p e[h][p] V[p][h / G] / z`, streaming each V row once.
//!
//! Work is split across threads by rows, balanced by sequence length; each thread writes its
//! own rows into a private buffer that is copied into `out` after the join, so no two threads
//! ever hold the same output memory. Every index is checked before any work starts: bad input
//! is an error, never a panic or an out-of-bounds read.

use crate::error::{CoreError, Result};

/// Shapes of a paged-attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in each cache.
    pub num_blocks: usize,
}

/// One decode row: query row `row` of the packed batch attends the `seq_len` KV tokens of the
/// sequence whose block table is `table`.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    /// Row index into `query` / `out` (`[T, H, D]`).
    pub row: usize,
    /// KV tokens of the sequence (>= 1), the new one included.
    pub seq_len: usize,
    /// The sequence's block table (at least `ceil(seq_len / block_size)` entries).
    pub table: &'a [i32],
}

/// `out[row] = softmax(scale * q K^T) V` for every decode row, reading K/V through the block
/// tables. `query`, `out`: `[T, H, D]`; caches: `[num_blocks, block_size, Hkv, D]`; all f32,
/// row-major. Rows not listed are left untouched.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    query: &[f32],
    key_cache: &[f32],
    value_cache: &[f32],
    dims: AttentionDims,
    rows: &[DecodeRow<'_>],
    scale: f32,
    out: &mut [f32],
    num_threads: usize,
) -> Result<()> {
    validate(query, key_cache, value_cache, dims, rows, out)?;
    let row_elems = dims.num_heads * dims.head_dim;
    let chunks = balance(rows, num_threads.max(1));
    let results: Vec<Vec<f32>> = if chunks.len() <= 1 {
        vec![attend_rows_dispatch(query, key_cache, value_cache, dims, rows, scale)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = chunks
                .iter()
                .map(|&(a, b)| {
                    s.spawn(move || attend_rows_dispatch(query, key_cache, value_cache, dims, &rows[a..b], scale))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
        })
    };
    let mut produced = 0;
    for ((a, b), buf) in chunks.iter().zip(&results) {
        if buf.len() != (b - a) * row_elems {
            return Err(CoreError::InvariantViolation("a CPU attention worker failed".into()));
        }
        for (k, r) in rows[*a..*b].iter().enumerate() {
            out[r.row * row_elems..(r.row + 1) * row_elems].copy_from_slice(&buf[k * row_elems..(k + 1) * row_elems]);
        }
        produced += b - a;
    }
    debug_assert_eq!(produced, rows.len());
    Ok(())
}

fn validate(
    query: &[f32],
    key_cache: &[f32],
    value_cache: &[f32],
    d: AttentionDims,
    rows: &[DecodeRow<'_>],
    out: &[f32],
) -> Result<()> {
    let bad = |m: String| Err(CoreError::InvalidArgument(m));
    if d.num_kv_heads == 0 || d.head_dim == 0 || d.block_size == 0 || d.num_heads % d.num_kv_heads != 0 {
        return bad(format!("invalid attention shape {d:?}"));
    }
    let cache_len = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
    if key_cache.len() != cache_len || value_cache.len() != cache_len {
        return bad(format!("caches hold {} / {} values, expected {cache_len}", key_cache.len(), value_cache.len()));
    }
    let row_elems = d.num_heads * d.head_dim;
    if query.len() % row_elems != 0 || out.len() != query.len() {
        return bad(format!("query ({}) and out ({}) must be [T, {}, {}]", query.len(), out.len(), d.num_heads, d.head_dim));
    }
    let num_rows = query.len() / row_elems;
    for r in rows {
        if r.row >= num_rows {
            return bad(format!("decode row {} is outside the {num_rows} query rows", r.row));
        }
        let blocks = r.seq_len.div_ceil(d.block_size);
        if r.seq_len == 0 || blocks > r.table.len() {
            return bad(format!(
                "row {}: seq_len {} needs {blocks} blocks, the block table has {}",
                r.row,
                r.seq_len,
                r.table.len()
            ));
        }
        if let Some(&b) = r.table[..blocks].iter().find(|&&b| b < 0 || b as usize >= d.num_blocks) {
            return bad(format!("row {}: block id {b} is outside the cache's {} blocks", r.row, d.num_blocks));
        }
    }
    Ok(())
}

/// Contiguous row ranges, one per thread, with about equal total sequence length.
fn balance(rows: &[DecodeRow<'_>], threads: usize) -> Vec<(usize, usize)> {
    let total: usize = rows.iter().map(|r| r.seq_len).sum();
    let threads = threads.min(rows.len()).max(1);
    let target = total.div_ceil(threads).max(1);
    let mut out = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, r) in rows.iter().enumerate() {
        acc += r.seq_len;
        if acc >= target && out.len() + 1 < threads {
            out.push((start, i + 1));
            start = i + 1;
            acc = 0;
        }
    }
    if start < rows.len() || out.is_empty() {
        out.push((start, rows.len()));
    }
    out
}

/// [`attend_rows`] compiled for AVX2 + FMA when the CPU has them (runtime check), else for
/// the baseline target. The wheel targets baseline x86-64, whose SSE2 has no vector `floor`
/// (the exp) and no FMA; the AVX2 build is ~2-3x faster on the arithmetic.
fn attend_rows_dispatch(q: &[f32], kc: &[f32], vc: &[f32], d: AttentionDims, rows: &[DecodeRow<'_>], scale: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features this function is compiled for were just detected at runtime.
            return unsafe { attend_rows_avx2(q, kc, vc, d, rows, scale) };
        }
    }
    attend_rows(q, kc, vc, d, rows, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_rows_avx2(q: &[f32], kc: &[f32], vc: &[f32], d: AttentionDims, rows: &[DecodeRow<'_>], scale: f32) -> Vec<f32> {
    attend_rows(q, kc, vc, d, rows, scale)
}

/// Attention of `rows` (validated) into a new `[rows, H, D]` buffer.
///
/// Position-major: the K (then V) row of one position holds all KV heads contiguously
/// (`[Hkv, D]`), so each is streamed once, in order, and serves every query head.
#[inline(always)]
fn attend_rows(q: &[f32], kc: &[f32], vc: &[f32], d: AttentionDims, rows: &[DecodeRow<'_>], scale: f32) -> Vec<f32> {
    let (h_all, hkv, dim, bs) = (d.num_heads, d.num_kv_heads, d.head_dim, d.block_size);
    let groups = h_all / hkv;
    let row_elems = h_all * dim;
    let kv_row = hkv * dim;
    let mut out = vec![0f32; rows.len() * row_elems];
    // scores[h][p] for the row being processed.
    let mut scores: Vec<f32> = Vec::new();
    let mut norms = vec![0f32; h_all];
    for (k, r) in rows.iter().enumerate() {
        let len = r.seq_len;
        scores.clear();
        scores.resize(h_all * len, 0.0);
        let qr = &q[r.row * row_elems..(r.row + 1) * row_elems];
        // 1. Scores: stream K position by position.
        for p in 0..len {
            let base = (r.table[p / bs] as usize * bs + p % bs) * kv_row;
            let krow = &kc[base..base + kv_row];
            for h in 0..h_all {
                let kh = &krow[(h / groups) * dim..(h / groups + 1) * dim];
                scores[h * len + p] = dot(&qr[h * dim..(h + 1) * dim], kh) * scale;
            }
        }
        // 2. Softmax numerators and normalisers per query head.
        for (h, z) in norms.iter_mut().enumerate() {
            let s = &mut scores[h * len..(h + 1) * len];
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.iter_mut().for_each(|x| *x = fast_exp(*x - m));
            *z = s.iter().sum();
        }
        // 3. Weighted sum: stream V position by position into the row's output.
        let acc = &mut out[k * row_elems..(k + 1) * row_elems];
        for p in 0..len {
            let base = (r.table[p / bs] as usize * bs + p % bs) * kv_row;
            let vrow = &vc[base..base + kv_row];
            for h in 0..h_all {
                let vh = &vrow[(h / groups) * dim..(h / groups + 1) * dim];
                axpy(scores[h * len + p], vh, &mut acc[h * dim..(h + 1) * dim]);
            }
        }
        for (h, z) in norms.iter().enumerate() {
            let inv = 1.0 / z;
            acc[h * dim..(h + 1) * dim].iter_mut().for_each(|x| *x *= inv);
        }
    }
    out
}

/// Dot product with 8 independent partial sums (lets the compiler use vector registers
/// without reassociating a single float sum).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// `acc += w * v`.
#[inline(always)]
fn axpy(w: f32, v: &[f32], acc: &mut [f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// `e^x` for `x <= 0` (softmax numerators), relative error below 2e-7: `2^k * p(r)` with
/// `x = k ln2 + r`, `|r| <= ln2 / 2`, and Cephes' degree-7 polynomial for `e^r`. Branch-free,
/// so loops over it vectorise. Inputs below -87 give 0 (the true value underflows f32 anyway).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 0.0);
    let k = (x * LOG2E + 0.5).floor();
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits(((k as i32 + 127) as u32) << 23);
    if underflow {
        0.0
    } else {
        e * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f32;
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.0;
            let (got, want) = (fast_exp(x), x.exp());
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    /// Naive attention over contiguous K/V for one row.
    fn naive(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let s: Vec<f32> = k.iter().map(|kr| q.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        (0..q.len()).map(|j| e.iter().zip(v).map(|(w, vr)| w * vr[j]).sum::<f32>() / z).collect()
    }

    #[test]
    fn matches_naive_attention_through_shuffled_blocks() {
        let d = AttentionDims { num_heads: 6, num_kv_heads: 2, head_dim: 8, block_size: 4, num_blocks: 10 };
        let cache_len = d.num_blocks * d.block_size * d.num_kv_heads * d.head_dim;
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        let kc: Vec<f32> = (0..cache_len).map(|i| val(i, 1)).collect();
        let vc: Vec<f32> = (0..cache_len).map(|i| val(i, 2)).collect();
        let q: Vec<f32> = (0..3 * d.num_heads * d.head_dim).map(|i| val(i, 3)).collect();
        let tables: [Vec<i32>; 2] = [vec![7, 2, 9], vec![4]];
        let rows = [
            DecodeRow { row: 2, seq_len: 10, table: &tables[0] },
            DecodeRow { row: 0, seq_len: 3, table: &tables[1] },
        ];
        for threads in [1, 2, 3] {
            let mut out = vec![f32::NAN; q.len()];
            paged_decode_attention(&q, &kc, &vc, d, &rows, 0.3, &mut out, threads).unwrap();
            for r in &rows {
                for h in 0..d.num_heads {
                    let kvh = h / (d.num_heads / d.num_kv_heads);
                    let pick = |c: &[f32], p: usize| {
                        let b = r.table[p / d.block_size] as usize;
                        let base = ((b * d.block_size + p % d.block_size) * d.num_kv_heads + kvh) * d.head_dim;
                        c[base..base + d.head_dim].to_vec()
                    };
                    let ks: Vec<Vec<f32>> = (0..r.seq_len).map(|p| pick(&kc, p)).collect();
                    let vs: Vec<Vec<f32>> = (0..r.seq_len).map(|p| pick(&vc, p)).collect();
                    let qh = &q[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                    let want = naive(qh, &ks, &vs, 0.3);
                    let got = &out[(r.row * d.num_heads + h) * d.head_dim..][..d.head_dim];
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() < 1e-5, "{g} vs {w}");
                    }
                }
            }
            // Row 1 was not a decode row: untouched.
            assert!(out[d.num_heads * d.head_dim..2 * d.num_heads * d.head_dim].iter().all(|x| x.is_nan()));
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        let d = AttentionDims { num_heads: 2, num_kv_heads: 1, head_dim: 4, block_size: 2, num_blocks: 2 };
        let cache = vec![0f32; 2 * 2 * 4];
        let q = vec![0f32; 8];
        let mut out = vec![0f32; 8];
        let table = [0i32, 5];
        let bad_block = [DecodeRow { row: 0, seq_len: 3, table: &table }];
        assert!(paged_decode_attention(&q, &cache, &cache, d, &bad_block, 1.0, &mut out, 1).is_err());
        let short = [DecodeRow { row: 0, seq_len: 5, table: &table }];
        assert!(paged_decode_attention(&q, &cache, &cache, d, &short, 1.0, &mut out, 1).is_err());
        let bad_row = [DecodeRow { row: 1, seq_len: 1, table: &table }];
        assert!(paged_decode_attention(&q, &cache, &cache, d, &bad_row, 1.0, &mut out, 1).is_err());
    }
}
