//! Linear layers on the CPU for the few rows of a decode step: `out = x W^T (* scale) + bias`.
//!
//! A decode step multiplies each weight matrix by one row per running sequence. At one row the
//! product is bound by reading the weights (SmolLM2-135M: 538 MB of float32 per token), and
//! torch's default CPU product (MKL, AVX2 path on AMD EPYC) streamed them at 13-15 GB/s where
//! the machine reads 21-27 GB/s (benches/RESULTS.md, "Decode step profile"). With int8 weights
//! the bytes are a quarter, and the product is then bound by converting and multiplying them.
//!
//! The kernel, for weights `W` `[N, K]` (float32, or int8 codes with one float32 scale per
//! output row `n`) and input rows `x` `[M, K]` float32:
//! 1. the output columns are split into contiguous ranges, one per thread (multiples of `NR`);
//! 2. a thread walks its columns `NR` weight rows at a time and the input `MR` rows at a time,
//!    and computes the `NR x MR` dot products of the tile in vector registers: 8 lanes per dot
//!    product, `acc[lane] += w[k] * x[k]` over `k` in steps of 8, then a fixed horizontal sum
//!    of the lanes, then the `K % 8` tail in order;
//! 3. `out[m, n] = dot * scale[n] + bias[n]` (no scale for float32 weights).
//!
//! Every output element is summed in the same order whatever the tile it falls in, the number
//! of rows `M` and the number of threads: row `m` of the product of `M` rows is bit for bit the
//! product of that row alone (tests/test_cpu_linear.py checks it). So a sequence's logits do not
//! depend on what else is in its batch (on one instruction set: the AVX2 + FMA path fuses the
//! multiply-add, the portable one rounds twice).
//!
//! Int8 codes become float32 exactly, so converting them in registers (few rows) or once per
//! tile into an L1-resident buffer that all row tiles then read (more rows: the conversion is
//! paid once per weight, not once per row tile) gives the same bits.
//!
//! Threads: the crate's pool ([`crate::thread_pool`]), the calling thread taking the first
//! range; each thread writes its own buffer, copied into `out` after the join, so no two
//! threads hold the same memory.
//! Every length is checked before any work starts: bad input is an error, never a panic.

use crate::error::{CoreError, Result};
use crate::thread_pool::run_jobs;

/// Output rows (weight rows) per register tile.
const NR: usize = 4;
/// Input rows per register tile: `NR * MR` = 12 accumulators of the 16 AVX2 registers.
const MR: usize = 3;
/// Below this many multiply-adds (`M * N * K`) one thread does the whole product: starting a
/// job to a pool worker costs a few microseconds, about as long as ~100k multiply-adds take.
const MIN_PARALLEL_MACS: usize = 1 << 17;
/// How many tiles ahead of the one it computes a thread prefetches weight rows (into L2): a
/// tile of SmolLM2's rows is 9 KB of float32, so 4 tiles are ~37 KB in flight. One tile ahead
/// (into L1) gained nothing, 4 into L2 took a batch-1 pass over SmolLM2's 538 MB of linears
/// from 27.4 to 17-22 ms, 8 were no better than 4 (benches/RESULTS.md, "Compiled forward: the
/// step's overhead").
const PREFETCH_TILES: usize = 4;

/// The weight matrix of a linear layer, `[out_features, in_features]` row-major.
#[derive(Debug, Clone, Copy)]
pub enum LinearWeight<'a> {
    /// Float32 weights.
    F32(&'a [f32]),
    /// Int8 codes with one float32 scale per output row: `W[n, k] = codes[n, k] * scales[n]`.
    Int8 {
        /// `[out_features, in_features]` codes.
        codes: &'a [i8],
        /// `[out_features]` scales.
        scales: &'a [f32],
    },
}

/// Shapes of a linear call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDims {
    /// Input rows `M` (tokens of the step).
    pub rows: usize,
    /// `K`, the reduction width.
    pub in_features: usize,
    /// `N`, the output width.
    pub out_features: usize,
}

/// How a product runs: on up to `threads` threads, with or without the prefetch of weight rows
/// ahead ([`PREFETCH_TILES`]; off only to measure what it gains, `benches/bench_step_overhead.py`:
/// the result is the same bits either way).
#[derive(Debug, Clone, Copy)]
pub struct LinearRun {
    /// The most threads the product may use (the caller's among them).
    pub threads: usize,
    /// Prefetch the weight rows ahead (the default).
    pub prefetch: bool,
}

impl LinearRun {
    /// Up to `threads` threads, with the prefetch.
    pub fn on(threads: usize) -> Self {
        Self {
            threads,
            prefetch: true,
        }
    }
}

/// `out[m, n] = sum_k x[m, k] * W[n, k] (* scale[n]) + bias[n]` for `x` `[M, K]`, `out`
/// `[M, N]` (both float32, row-major) and `bias` `[N]`, as `run` says.
/// Errors (before any work): a slice whose length is not its shape's, `K` or `N` of 0.
pub fn cpu_linear(
    x: &[f32],
    weight: LinearWeight<'_>,
    bias: Option<&[f32]>,
    dims: LinearDims,
    out: &mut [f32],
    run: LinearRun,
) -> Result<()> {
    validate(x, weight, bias, dims, out)?;
    let (m, n) = (dims.rows, dims.out_features);
    if m == 0 {
        return Ok(());
    }
    let prefetch = run.prefetch;
    let ranges = column_ranges(n, threads_for(dims, run.threads));
    let buffers = run_jobs(ranges.len(), |i| {
        let (a, b) = ranges[i];
        columns_dispatch(
            Product {
                x,
                weight,
                bias,
                dims,
                prefetch,
            },
            a,
            b,
        )
    });
    for (&(a, b), buf) in ranges.iter().zip(&buffers) {
        let width = b - a;
        if buf.len() != m * width {
            return Err(CoreError::InvariantViolation(
                "a CPU linear worker failed".into(),
            ));
        }
        for row in 0..m {
            out[row * n + a..row * n + b].copy_from_slice(&buf[row * width..(row + 1) * width]);
        }
    }
    Ok(())
}

fn validate(
    x: &[f32],
    weight: LinearWeight<'_>,
    bias: Option<&[f32]>,
    d: LinearDims,
    out: &[f32],
) -> Result<()> {
    let bad = |what: String| Err(CoreError::InvalidArgument(what));
    if d.in_features == 0 || d.out_features == 0 {
        return bad(format!(
            "a linear needs in_features and out_features >= 1, got {} and {}",
            d.in_features, d.out_features
        ));
    }
    let (Some(x_len), Some(w_len), Some(out_len)) = (
        d.rows.checked_mul(d.in_features),
        d.out_features.checked_mul(d.in_features),
        d.rows.checked_mul(d.out_features),
    ) else {
        return bad(format!("linear shapes overflow: {d:?}"));
    };
    let weight_len = match weight {
        LinearWeight::F32(w) => w.len(),
        LinearWeight::Int8 { codes, scales } => {
            if scales.len() != d.out_features {
                return bad(format!(
                    "{} weight scales for {} output rows",
                    scales.len(),
                    d.out_features
                ));
            }
            codes.len()
        }
    };
    if x.len() != x_len || weight_len != w_len || out.len() != out_len {
        return bad(format!(
            "linear slices do not match {d:?}: x {} (want {x_len}), weight {weight_len} (want {w_len}), \
             out {} (want {out_len})",
            x.len(),
            out.len()
        ));
    }
    if let Some(b) = bias {
        if b.len() != d.out_features {
            return bad(format!(
                "bias has {} values for {} output rows",
                b.len(),
                d.out_features
            ));
        }
    }
    Ok(())
}

fn threads_for(d: LinearDims, num_threads: usize) -> usize {
    let macs = d
        .rows
        .saturating_mul(d.out_features)
        .saturating_mul(d.in_features);
    if macs < MIN_PARALLEL_MACS {
        1
    } else {
        num_threads.max(1)
    }
}

/// `threads` contiguous column ranges covering `0..n`, each a multiple of `NR` wide (but the
/// last), none empty.
fn column_ranges(n: usize, threads: usize) -> Vec<(usize, usize)> {
    let tiles = n.div_ceil(NR);
    let threads = threads.clamp(1, tiles);
    let per = tiles / threads;
    let extra = tiles % threads;
    let mut out = Vec::with_capacity(threads);
    let mut start = 0;
    for t in 0..threads {
        let width = (per + usize::from(t < extra)) * NR;
        let end = (start + width).min(n);
        out.push((start, end));
        start = end;
    }
    out
}

/// A validated product's inputs.
#[derive(Clone, Copy)]
struct Product<'a> {
    x: &'a [f32],
    weight: LinearWeight<'a>,
    bias: Option<&'a [f32]>,
    dims: LinearDims,
    prefetch: bool,
}

/// One thread's columns `a..b` of the product, as an `[M, b - a]` buffer.
fn columns_dispatch(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { columns_avx2(p, a, b) };
        }
    }
    columns::<Portable>(p, a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn columns_avx2(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    columns::<avx2::Avx2>(p, a, b)
}

/// The dot products of a register tile, per instruction set. `w` holds `NR` rows and `x` `R`
/// rows (`R <= MR`) of `k` values each; every dot product is summed in the order the module
/// docs give.
///
/// `ahead` holds weight rows the thread reads later (a later tile's): an instruction set may
/// prefetch them while it computes this tile (see [`avx2`]); they change no result.
trait Isa {
    fn dots<W: WeightRow, const R: usize>(
        w: [W; NR],
        ahead: [W; NR],
        x: [&[f32]; R],
        k: usize,
    ) -> [[f32; R]; NR];
}

/// A weight row as the tile reads it: float32 values, or int8 codes converted on the fly.
trait WeightRow: Copy {
    /// Bytes per stored value.
    const BYTES: usize;
    /// The address of the first value.
    fn address(self) -> *const u8;
    /// The value at `i` as float32 (the tail past the last whole vector).
    fn at(self, i: usize) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// Eight values from `i` on, as float32 lanes.
    ///
    /// # Safety
    /// `i + 8 <= len` and the CPU has AVX2.
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256;
    /// Eight values from `i` on (`i + 8 <= len`).
    fn lanes8(self, i: usize) -> [f32; 8];
}

impl WeightRow for &[f32] {
    const BYTES: usize = 4;
    #[inline(always)]
    fn address(self) -> *const u8 {
        self.as_ptr().cast()
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self[i]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        debug_assert!(i + 8 <= self.len());
        std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i))
    }
    #[inline(always)]
    fn lanes8(self, i: usize) -> [f32; 8] {
        let mut v = [0.0; 8];
        v.copy_from_slice(&self[i..i + 8]);
        v
    }
}

impl WeightRow for &[i8] {
    const BYTES: usize = 1;
    #[inline(always)]
    fn address(self) -> *const u8 {
        self.as_ptr().cast()
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        f32::from(self[i])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        debug_assert!(i + 8 <= self.len());
        let bytes = _mm_loadl_epi64(self.as_ptr().add(i).cast());
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
    }
    #[inline(always)]
    fn lanes8(self, i: usize) -> [f32; 8] {
        std::array::from_fn(|j| f32::from(self[i + j]))
    }
}

/// Sums eight lanes in the fixed order the AVX2 path uses: halves, then pairs, then the last
/// two (`((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`).
#[inline(always)]
fn hsum8(l: [f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    let p = [h[0] + h[2], h[1] + h[3]];
    p[0] + p[1]
}

#[derive(Clone, Copy)]
struct Portable;

impl Isa for Portable {
    #[inline(always)]
    fn dots<W: WeightRow, const R: usize>(
        w: [W; NR],
        _ahead: [W; NR],
        x: [&[f32]; R],
        k: usize,
    ) -> [[f32; R]; NR] {
        let mut acc = [[[0.0f32; 8]; R]; NR];
        let whole = k / 8 * 8;
        for i in (0..whole).step_by(8) {
            for (wi, acc_w) in w.iter().zip(acc.iter_mut()) {
                let wv = wi.lanes8(i);
                for (xr, a) in x.iter().zip(acc_w.iter_mut()) {
                    for l in 0..8 {
                        a[l] += wv[l] * xr[i + l];
                    }
                }
            }
        }
        let mut out = [[0.0f32; R]; NR];
        for (ni, wi) in w.iter().enumerate() {
            for (ri, xr) in x.iter().enumerate() {
                let mut s = hsum8(acc[ni][ri]);
                for j in whole..k {
                    s += wi.at(j) * xr[j];
                }
                out[ni][ri] = s;
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 + FMA tile. Its functions are `#[inline(always)]` without `#[target_feature]`:
    //! they are inlined into `columns_avx2`, which has the feature, so the intrinsics compile
    //! to single instructions there.
    //!
    //! While it computes a tile it prefetches into L2 the weight rows of the tile
    //! [`super::PREFETCH_TILES`] tiles on, one cache line per row per 64 bytes it reads. At
    //! one input row the product is a stream of the weights, and a tile reads `NR` rows side
    //! by side, each only `K` values long (2.3 KB for K = 576): the hardware prefetcher met
    //! `NR` new short streams at every tile, and without this the kernel read SmolLM2's
    //! weights at 19.6 GB/s where `torch.sum` reads the same bytes at 32 (benches/RESULTS.md,
    //! "Compiled forward: the step's overhead").
    use super::{Isa, WeightRow, NR};
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    impl Isa for Avx2 {
        #[inline(always)]
        fn dots<W: WeightRow, const R: usize>(
            w: [W; NR],
            ahead: [W; NR],
            x: [&[f32]; R],
            k: usize,
        ) -> [[f32; R]; NR] {
            // SAFETY: only reached from `columns_avx2` (AVX2 + FMA present); every load reads
            // `i + 8 <= k` values of a row of `k` (the callers pass rows of exactly `k`, in
            // `ahead` too); a prefetch reads nothing and cannot fault, and its address is
            // inside a row of `ahead` anyway (`i < k`).
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); R]; NR];
                let whole = k / 8 * 8;
                let mut i = 0;
                while i < whole {
                    if (i * W::BYTES) % 64 == 0 {
                        for row in ahead {
                            _mm_prefetch::<_MM_HINT_T1>(row.address().add(i * W::BYTES).cast());
                        }
                    }
                    for (wi, acc_w) in w.iter().zip(acc.iter_mut()) {
                        let wv = wi.load8(i);
                        for (xr, a) in x.iter().zip(acc_w.iter_mut()) {
                            *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr.as_ptr().add(i)), *a);
                        }
                    }
                    i += 8;
                }
                let mut out = [[0.0f32; R]; NR];
                for (ni, wi) in w.iter().enumerate() {
                    for (ri, xr) in x.iter().enumerate() {
                        let mut s = hsum(acc[ni][ri]);
                        for j in whole..k {
                            s = wi.at(j).mul_add(xr[j], s);
                        }
                        out[ni][ri] = s;
                    }
                }
                out
            }
        }
    }

    /// [`super::hsum8`]'s order in registers.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
    }
}

/// Columns `a..b` of the product (see the module docs) as an `[M, b - a]` buffer.
#[inline(always)]
fn columns<I: Isa>(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    let Product {
        x,
        weight,
        bias,
        dims: d,
        prefetch,
    } = p;
    let (m, k) = (d.rows, d.in_features);
    let width = b - a;
    let mut out = vec![0.0f32; m * width];
    let x_rows: Vec<&[f32]> = x.chunks_exact(k).collect();
    // Int8 weights with more rows than one register tile: each weight tile is converted once
    // into this L1-resident buffer (NR rows of K float32) and read by every row tile.
    let mut converted = match weight {
        LinearWeight::Int8 { .. } if m > MR => vec![0.0f32; NR * k],
        _ => Vec::new(),
    };
    let mut n0 = a;
    while n0 < b {
        let nr = NR.min(b - n0);
        // A short last tile repeats its last row: the extra dot products are discarded.
        let rows: [usize; NR] = std::array::from_fn(|i| n0 + i.min(nr - 1));
        // The rows to prefetch while this tile computes: PREFETCH_TILES tiles on, clamped to the
        // thread's last row (without the prefetch: this tile's own rows, already in cache).
        let ahead_by = if prefetch { PREFETCH_TILES * NR } else { 0 };
        let next: [usize; NR] = std::array::from_fn(|i| (n0 + ahead_by + i).min(b - 1));
        let scale = |n: usize| match weight {
            LinearWeight::F32(_) => 1.0,
            LinearWeight::Int8 { scales, .. } => scales[n],
        };
        let mut store = |m0: usize, dots: &[[f32; MR]; NR], r: usize| {
            for (i, row_dots) in dots.iter().enumerate().take(nr) {
                let n = n0 + i;
                let (s, add) = (scale(n), bias.map_or(0.0, |bv| bv[n]));
                for (j, &dot) in row_dots.iter().enumerate().take(r) {
                    let v = if matches!(weight, LinearWeight::F32(_)) {
                        dot
                    } else {
                        dot * s
                    };
                    out[(m0 + j) * width + (n - a)] = v + add;
                }
            }
        };
        match weight {
            LinearWeight::F32(w) => {
                let wr: [&[f32]; NR] = rows.map(|n| &w[n * k..(n + 1) * k]);
                let ahead: [&[f32]; NR] = next.map(|n| &w[n * k..(n + 1) * k]);
                row_tiles::<I, _>(wr, ahead, &x_rows, k, &mut store);
            }
            LinearWeight::Int8 { codes, .. } if converted.is_empty() => {
                let wr: [&[i8]; NR] = rows.map(|n| &codes[n * k..(n + 1) * k]);
                let ahead: [&[i8]; NR] = next.map(|n| &codes[n * k..(n + 1) * k]);
                row_tiles::<I, _>(wr, ahead, &x_rows, k, &mut store);
            }
            LinearWeight::Int8 { codes, .. } => {
                for (i, &n) in rows.iter().enumerate() {
                    let dst = &mut converted[i * k..(i + 1) * k];
                    for (d, &c) in dst.iter_mut().zip(&codes[n * k..(n + 1) * k]) {
                        *d = f32::from(c);
                    }
                }
                let wr: [&[f32]; NR] = std::array::from_fn(|i| &converted[i * k..(i + 1) * k]);
                // Converted once, then read by every row tile from L1: nothing to prefetch.
                row_tiles::<I, _>(wr, wr, &x_rows, k, &mut store);
            }
        }
        n0 += nr;
    }
    out
}

/// Every input row against one weight tile, `MR` rows at a time; `store(first row, dots, rows)`
/// takes each tile's dot products.
#[inline(always)]
fn row_tiles<I: Isa, W: WeightRow>(
    w: [W; NR],
    ahead: [W; NR],
    x_rows: &[&[f32]],
    k: usize,
    store: &mut impl FnMut(usize, &[[f32; MR]; NR], usize),
) {
    let mut m0 = 0;
    while m0 < x_rows.len() {
        let r = MR.min(x_rows.len() - m0);
        let mut dots = [[0.0f32; MR]; NR];
        // One instantiation per tile height, so a lone row does one dot product per weight
        // row, not MR of them.
        match r {
            1 => {
                let t = I::dots(w, ahead, [x_rows[m0]], k);
                for (d, t) in dots.iter_mut().zip(t) {
                    d[0] = t[0];
                }
            }
            2 => {
                let t = I::dots(w, ahead, [x_rows[m0], x_rows[m0 + 1]], k);
                for (d, t) in dots.iter_mut().zip(t) {
                    d[..2].copy_from_slice(&t);
                }
            }
            _ => dots = I::dots(w, ahead, [x_rows[m0], x_rows[m0 + 1], x_rows[m0 + 2]], k),
        }
        store(m0, &dots, r);
        m0 += r;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], scales: Option<&[f32]>, d: LinearDims) -> Vec<f64> {
        let mut out = vec![0.0; d.rows * d.out_features];
        for m in 0..d.rows {
            for n in 0..d.out_features {
                let s: f64 = (0..d.in_features)
                    .map(|k| {
                        f64::from(x[m * d.in_features + k]) * f64::from(w[n * d.in_features + k])
                    })
                    .sum();
                out[m * d.out_features + n] = s * scales.map_or(1.0, |sc| f64::from(sc[n]));
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_a_float64_reference_and_each_row_alone() {
        for (m, k, n, threads) in [
            (1, 8, 4, 1),
            (5, 37, 9, 2),
            (7, 64, 130, 3),
            (3, 1, 1, 2),
            (16, 576, 64, 2),
        ] {
            let d = LinearDims {
                rows: m,
                in_features: k,
                out_features: n,
            };
            let x = values(m * k, 1);
            let w = values(n * k, 2);
            let codes: Vec<i8> = w.iter().map(|v| (v * 127.0).round() as i8).collect();
            let scales = values(n, 3)
                .iter()
                .map(|v| v.abs() + 0.01)
                .collect::<Vec<_>>();
            let bias = values(n, 4);
            for weight in [
                LinearWeight::F32(&w),
                LinearWeight::Int8 {
                    codes: &codes,
                    scales: &scales,
                },
            ] {
                let mut out = vec![0.0; m * n];
                cpu_linear(&x, weight, Some(&bias), d, &mut out, LinearRun::on(threads)).unwrap();
                let mut unprefetched = vec![0.0; m * n];
                let no_prefetch = LinearRun {
                    threads,
                    prefetch: false,
                };
                cpu_linear(&x, weight, Some(&bias), d, &mut unprefetched, no_prefetch).unwrap();
                assert_eq!(out, unprefetched, "prefetch changed {d:?}");
                let (wf, sc): (Vec<f32>, Option<&[f32]>) = match weight {
                    LinearWeight::F32(w) => (w.to_vec(), None),
                    LinearWeight::Int8 { codes, scales } => {
                        (codes.iter().map(|&c| f32::from(c)).collect(), Some(scales))
                    }
                };
                let want = reference(&x, &wf, sc, d);
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let want = want + f64::from(bias[i % n]);
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()) * k as f64,
                        "{i}: {got} vs {want}"
                    );
                }
                for row in 0..m {
                    let one = LinearDims { rows: 1, ..d };
                    let mut alone = vec![0.0; n];
                    cpu_linear(
                        &x[row * k..(row + 1) * k],
                        weight,
                        Some(&bias),
                        one,
                        &mut alone,
                        LinearRun::on(1),
                    )
                    .unwrap();
                    assert_eq!(
                        alone.as_slice(),
                        &out[row * n..(row + 1) * n],
                        "row {row} of {d:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let d = LinearDims {
            rows: 2,
            in_features: 4,
            out_features: 3,
        };
        let (x, w, mut out) = (vec![0.0; 8], vec![0.0; 12], vec![0.0; 6]);
        let one = LinearRun::on(1);
        assert!(cpu_linear(&x[..7], LinearWeight::F32(&w), None, d, &mut out, one).is_err());
        assert!(cpu_linear(&x, LinearWeight::F32(&w[..11]), None, d, &mut out, one).is_err());
        assert!(cpu_linear(&x, LinearWeight::F32(&w), Some(&[0.0; 2]), d, &mut out, one).is_err());
        let codes = vec![0i8; 12];
        let int8 = LinearWeight::Int8 {
            codes: &codes,
            scales: &[1.0; 2],
        };
        assert!(cpu_linear(&x, int8, None, d, &mut out, one).is_err());
        let empty = LinearDims {
            in_features: 0,
            ..d
        };
        assert!(cpu_linear(&[], LinearWeight::F32(&[]), None, empty, &mut [0.0; 6], one).is_err());
        assert!(cpu_linear(
            &[],
            LinearWeight::F32(&w),
            None,
            LinearDims { rows: 0, ..d },
            &mut [],
            LinearRun::on(2)
        )
        .is_ok());
    }
}
