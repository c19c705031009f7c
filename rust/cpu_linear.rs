//! Linear layers on the CPU for the few rows of a decode step: `out = x W^T (* scale) + bias`.
//!
//! A decode step multiplies each weight matrix by one row per running sequence. At one row the
//! product is bound by reading the weights (SmolLM2-135M: 538 MB of float32 per token), and
//! torch's default CPU product (MKL, AVX2 path on AMD EPYC) streamed them well below the
//! machine's read bandwidth (benches/RESULTS.md, "Decode step profile"). With int8 weights
//! the bytes are a quarter, and the product is then bound by converting and multiplying them.
//!
//! The kernel, for weights `W` `[N, K]` (float32; int8 codes with one float32 scale per output
//! row `n`; or bfloat16) and input rows `x` `[M, K]` float32:
//! 1. the output columns are split into contiguous ranges, one per thread (multiples of `NR`);
//! 2. a thread walks its columns `NR` weight rows at a time and the input `MR` rows at a time
//!    (`MR` per instruction set), and computes the `NR x MR` dot products of the tile in vector
//!    registers: `L` lanes per dot product, `acc[lane] += w[k] * x[k]` over `k` in steps of
//!    `L`, the `K % L` tail, and a fixed horizontal sum of the lanes;
//! 3. `out[m, n] = dot * scale[n] + bias[n]` (no scale for float32 and bfloat16 weights).
//!
//! Paths ([`LinearIsa`], chosen once per process by [`crate::cpu_isa`], or forced by the caller
//! to compare them):
//! - `portable`: 8 lanes, tail added in order after the horizontal sum, each multiply and add
//!   rounded (any CPU);
//! - `avx2`: the same order with fused multiply-adds (AVX2 + FMA), `MR` = 3;
//! - `avx512`: 16 lanes, the tail a masked step before the horizontal sum, fused (AVX-512 F +
//!   BW + VL), `MR` = 6 (its 32 registers);
//! - `avx512_bf16`, bfloat16 weights only: `vdpbf16ps` on the input rows rounded to bfloat16
//!   (once per call), 32 values per step into 16 float32 lanes ([`avx512`]'s docs).
//!
//! Every output element is summed in the same order whatever the tile it falls in, the number
//! of rows `M` and the number of threads: row `m` of the product of `M` rows is bit for bit the
//! product of that row alone (tests/kernels/test_cpu_linear.py checks it). So a sequence's logits do not
//! depend on what else is in its batch -- on one path: the paths differ from each other in the
//! last bits (fused or not, 8 or 16 lanes; `avx512_bf16` by the inputs' rounding to bfloat16).
//!
//! Int8 and bfloat16 weights become float32 exactly, so converting them in registers (few rows)
//! or once per tile into an L1-resident buffer that all row tiles then read (more rows: the
//! conversion is paid once per weight, not once per row tile) gives the same bits.
//!
//! Threads: the crate's pool ([`crate::thread_pool`]), the calling thread taking the first
//! range; each thread writes its own buffer, copied into `out` after the join, so no two
//! threads hold the same memory.
//! Every length is checked before any work starts: bad input is an error, never a panic.

use std::marker::PhantomData;

use crate::cpu_isa::CpuFeatures;
pub use crate::cpu_isa::LinearIsa;
use crate::error::{CoreError, Result};
use crate::thread_pool::run_jobs;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;
mod rows;
#[cfg(test)]
mod tests;

use portable::Portable;
use rows::{f32_to_bf16, WeightRow};

/// Output rows (weight rows) per register tile (every path).
pub(crate) const NR: usize = 4;
/// The most input rows per register tile of any path (AVX-512's).
const MAX_MR: usize = 6;
/// Below this many multiply-adds (`M * N * K`) one thread does the whole product: starting a
/// job to a pool worker costs a few microseconds, about as long as ~100k multiply-adds take.
const MIN_PARALLEL_MACS: usize = 1 << 17;
/// How many tiles ahead of the one it computes a thread prefetches weight rows (into L2): a
/// tile of SmolLM2's rows is 9 KB of float32, so 4 tiles are ~37 KB in flight. One tile ahead
/// (into L1) gained nothing, 4 into L2 made a batch-1 pass over SmolLM2's linears much faster,
/// 8 were no better than 4 (benches/RESULTS.md, "Compiled forward: the step's overhead").
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
    /// Bfloat16 weights, as their bit patterns (the top 16 bits of the float32 they stand for).
    Bf16(&'a [u16]),
}

impl LinearWeight<'_> {
    /// The path [`LinearIsa::best`] (or, for bfloat16, [`LinearIsa::best_bf16`]) picks for
    /// this kind of weight on this CPU.
    pub fn best_isa(&self) -> LinearIsa {
        match self {
            LinearWeight::Bf16(_) => LinearIsa::best_bf16(),
            _ => LinearIsa::best(),
        }
    }
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
/// the result is the same bits either way), on the path `isa` (`None`: the fastest this CPU
/// has for the weights).
#[derive(Debug, Clone, Copy)]
pub struct LinearRun {
    /// The most threads the product may use (the caller's among them).
    pub threads: usize,
    /// Prefetch the weight rows ahead (the default).
    pub prefetch: bool,
    /// The path; `None` picks the fastest ([`LinearWeight::best_isa`]). A path the CPU lacks
    /// is an error; `avx512_bf16` with other than bfloat16 weights runs `avx512`.
    pub isa: Option<LinearIsa>,
}

impl LinearRun {
    /// Up to `threads` threads, with the prefetch, on the fastest path.
    pub fn on(threads: usize) -> Self {
        Self {
            threads,
            prefetch: true,
            isa: None,
        }
    }
}

/// `out[m, n] = sum_k x[m, k] * W[n, k] (* scale[n]) + bias[n]` for `x` `[M, K]`, `out`
/// `[M, N]` (both float32, row-major) and `bias` `[N]`, as `run` says.
/// Errors (before any work): a slice whose length is not its shape's, `K` or `N` of 0, a path
/// the CPU lacks.
pub fn cpu_linear(
    x: &[f32],
    weight: LinearWeight<'_>,
    bias: Option<&[f32]>,
    dims: LinearDims,
    out: &mut [f32],
    run: LinearRun,
) -> Result<()> {
    validate(x, weight, bias, dims, out)?;
    let isa = match run.isa {
        None => weight.best_isa(),
        Some(LinearIsa::Avx512Bf16) if !matches!(weight, LinearWeight::Bf16(_)) => {
            LinearIsa::Avx512
        }
        Some(isa) => isa,
    };
    let missing = isa.missing(CpuFeatures::get());
    if !missing.is_empty() {
        return Err(CoreError::InvalidArgument(format!(
            "the CPU linear path {:?} needs {}, which this CPU lacks",
            isa.name(),
            missing.join(", ")
        )));
    }
    let m = dims.rows;
    if m == 0 {
        return Ok(());
    }
    // The bfloat16 dot products read the input rows as bfloat16: rounded once, here.
    let x_bf16: Vec<u16> = if isa == LinearIsa::Avx512Bf16 {
        x.iter().map(|&v| f32_to_bf16(v)).collect()
    } else {
        Vec::new()
    };
    let product = Product {
        x,
        x_bf16: &x_bf16,
        weight,
        bias,
        dims,
        prefetch: run.prefetch,
        isa,
    };
    run_in_column_ranges(
        dims,
        run.threads,
        out,
        "a CPU linear worker failed",
        |a, b| columns_dispatch(product, a, b),
    )
}

/// The product's output columns split across threads ([`column_ranges`], [`threads_for`]):
/// `columns(a, b)` computes columns `a..b` of every row into its own `[rows, b - a]` buffer on a
/// pool thread, and each buffer is copied into `out` (`[rows, out_features]`) after the join. A
/// buffer of the wrong size (a job that panicked) is `InvariantViolation(failed)`. The GGUF
/// kernel runs its products through it too.
pub(crate) fn run_in_column_ranges(
    dims: LinearDims,
    threads: usize,
    out: &mut [f32],
    failed: &str,
    columns: impl Fn(usize, usize) -> Vec<f32> + Sync,
) -> Result<()> {
    let (m, n) = (dims.rows, dims.out_features);
    let ranges = column_ranges(n, threads_for(dims, threads));
    let buffers = run_jobs(ranges.len(), |i| {
        let (a, b) = ranges[i];
        columns(a, b)
    });
    for (&(a, b), buf) in ranges.iter().zip(&buffers) {
        let width = b - a;
        if buf.len() != m * width {
            return Err(CoreError::InvariantViolation(failed.into()));
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
        LinearWeight::Bf16(w) => w.len(),
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
    check_bias(bias, d.out_features)
}

/// A bias, when there is one, has one value per output row (both kernels' check).
pub(crate) fn check_bias(bias: Option<&[f32]>, out_features: usize) -> Result<()> {
    match bias {
        Some(b) if b.len() != out_features => Err(CoreError::InvalidArgument(format!(
            "bias has {} values for {} output rows",
            b.len(),
            out_features
        ))),
        _ => Ok(()),
    }
}

/// How many threads a product of `d` takes: one below [`MIN_PARALLEL_MACS`] multiply-adds (a
/// pool job costs more than it saves), else `num_threads` (at least one).
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
    /// `x` rounded to bfloat16 (only for [`LinearIsa::Avx512Bf16`]; empty otherwise).
    x_bf16: &'a [u16],
    weight: LinearWeight<'a>,
    bias: Option<&'a [f32]>,
    dims: LinearDims,
    prefetch: bool,
    /// The path, available on this CPU (checked by [`cpu_linear`]).
    isa: LinearIsa,
}

/// One thread's columns `a..b` of the product, as an `[M, b - a]` buffer.
fn columns_dispatch(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (each arm): `cpu_linear` checked that the CPU has the path's features.
        match (p.isa, p.weight) {
            (LinearIsa::Avx512Bf16, LinearWeight::Bf16(w)) => {
                return unsafe { columns_avx512_bf16(p, w, a, b) }
            }
            (LinearIsa::Avx512 | LinearIsa::Avx512Bf16, _) => {
                return unsafe { columns_avx512(p, a, b) }
            }
            (LinearIsa::Avx2, _) => return unsafe { columns_avx2(p, a, b) },
            (LinearIsa::Portable, _) => {}
        }
    }
    columns::<Portable>(p, a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn columns_avx2(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    columns::<avx2::Avx2>(p, a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
unsafe fn columns_avx512(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    columns::<avx512::Avx512>(p, a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn columns_avx512_bf16(p: Product<'_>, w: &[u16], a: usize, b: usize) -> Vec<f32> {
    let k = p.dims.in_features;
    let x_rows: Vec<&[u16]> = p.x_bf16.chunks_exact(k).collect();
    walk(p, a, b, &mut Bf16Tiles { w, x_rows, k })
}

/// The AVX512-BF16 kernel's weight tiles: bfloat16 weights, bfloat16-rounded inputs.
#[cfg(target_arch = "x86_64")]
struct Bf16Tiles<'a> {
    w: &'a [u16],
    x_rows: Vec<&'a [u16]>,
    k: usize,
}

#[cfg(target_arch = "x86_64")]
impl WeightTiles for Bf16Tiles<'_> {
    #[inline(always)]
    fn tile(&mut self, rows: [usize; NR], next: [usize; NR], store: &mut Store<'_>) {
        let k = self.k;
        let wr = slices(self.w, rows, k);
        let ahead = slices(self.w, next, k);
        row_tiles::<avx512::Bf16Dot<'_>>(wr, ahead, &self.x_rows, k, store);
    }
}

/// The dot products of a register tile, per instruction set, for any weight row. `w` holds
/// `NR` rows and `x` `R` rows (`R <= MR`) of `k` values each; every dot product is summed in
/// the path's order (the module docs).
///
/// `ahead` holds weight rows the thread reads later (a later tile's): an instruction set may
/// prefetch them while it computes this tile (see `avx2.rs`); they change no result.
trait Isa {
    /// Input rows per register tile (at most [`MAX_MR`]).
    const MR: usize;
    fn dots<W: WeightRow, const R: usize>(
        w: [W; NR],
        ahead: [W; NR],
        x: [&[f32]; R],
        k: usize,
    ) -> [[f32; R]; NR];
}

/// A register tile's dot products for one kind of weight row `W` and input row `X`: an
/// [`Isa`] for a weight type ([`IsaDots`]), or a kernel of its own (AVX512-BF16's).
trait TileDots {
    type W: Copy;
    type X: Copy;
    /// Input rows per register tile (at most [`MAX_MR`]).
    const MR: usize;
    fn dots<const R: usize>(
        w: [Self::W; NR],
        ahead: [Self::W; NR],
        x: [Self::X; R],
        k: usize,
    ) -> [[f32; R]; NR];
}

/// An [`Isa`]'s tile on weight rows `W` and float32 inputs.
struct IsaDots<'a, I, W>(PhantomData<(&'a (), I, W)>);

impl<'a, I: Isa, W: WeightRow> TileDots for IsaDots<'a, I, W> {
    type W = W;
    type X = &'a [f32];
    const MR: usize = I::MR;
    #[inline(always)]
    fn dots<const R: usize>(
        w: [W; NR],
        ahead: [W; NR],
        x: [&'a [f32]; R],
        k: usize,
    ) -> [[f32; R]; NR] {
        I::dots(w, ahead, x, k)
    }
}

/// Takes a row tile's dot products: `(first input row, dots[weight row][input row], rows)`.
type Store<'s> = dyn FnMut(usize, &[[f32; MAX_MR]; NR], usize) + 's;

/// Columns `a..b` of the product (see the module docs) as an `[M, b - a]` buffer.
#[inline(always)]
fn columns<I: Isa>(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    let (m, k) = (p.dims.rows, p.dims.in_features);
    // Int8 or bfloat16 weights with more rows than one register tile: each weight tile is
    // converted once into this L1-resident buffer (NR rows of K float32) and read by every
    // row tile.
    let converted = match p.weight {
        LinearWeight::Int8 { .. } | LinearWeight::Bf16(_) if m > I::MR => vec![0.0f32; NR * k],
        _ => Vec::new(),
    };
    let mut tiles = IsaTiles::<I> {
        weight: p.weight,
        x_rows: p.x.chunks_exact(k).collect(),
        k,
        converted,
        isa: PhantomData,
    };
    walk(p, a, b, &mut tiles)
}

/// What [`walk`] does with each weight tile: computes every input row against the weight rows
/// `rows`, prefetching `next`, and hands each row tile's dot products to `store`.
///
/// A trait and not a closure: the tiles' intrinsics must be inlined into the
/// `#[target_feature]` function at the top (`columns_avx2`, ...), and a closure defined in a
/// generic function is a function of its own, without the features, that LLVM did not inline
/// (the AVX2 path ran several times slower than with this trait).
trait WeightTiles {
    fn tile(&mut self, rows: [usize; NR], next: [usize; NR], store: &mut Store<'_>);
}

/// An [`Isa`]'s weight tiles, for every weight format.
struct IsaTiles<'a, I> {
    weight: LinearWeight<'a>,
    x_rows: Vec<&'a [f32]>,
    k: usize,
    /// `NR` weight rows converted to float32 (int8 and bfloat16 weights at more than `I::MR`
    /// input rows; empty otherwise).
    converted: Vec<f32>,
    isa: PhantomData<I>,
}

impl<I: Isa> WeightTiles for IsaTiles<'_, I> {
    #[inline(always)]
    fn tile(&mut self, rows: [usize; NR], next: [usize; NR], store: &mut Store<'_>) {
        let (k, x_rows) = (self.k, &self.x_rows);
        match self.weight {
            LinearWeight::F32(w) => {
                let (wr, ahead) = (slices(w, rows, k), slices(w, next, k));
                row_tiles::<IsaDots<'_, I, &[f32]>>(wr, ahead, x_rows, k, store);
            }
            LinearWeight::Int8 { codes, .. } if self.converted.is_empty() => {
                let (wr, ahead) = (slices(codes, rows, k), slices(codes, next, k));
                row_tiles::<IsaDots<'_, I, &[i8]>>(wr, ahead, x_rows, k, store);
            }
            LinearWeight::Bf16(w) if self.converted.is_empty() => {
                let (wr, ahead) = (slices(w, rows, k), slices(w, next, k));
                row_tiles::<IsaDots<'_, I, &[u16]>>(wr, ahead, x_rows, k, store);
            }
            LinearWeight::Int8 { codes, .. } => {
                convert(slices(codes, rows, k), &mut self.converted);
                let c = &self.converted;
                let wr: [&[f32]; NR] = [0, 1, 2, 3].map(|i| &c[i * k..(i + 1) * k]);
                // Converted once, then read by every row tile from L1: nothing to prefetch.
                row_tiles::<IsaDots<'_, I, &[f32]>>(wr, wr, x_rows, k, store);
            }
            LinearWeight::Bf16(w) => {
                convert(slices(w, rows, k), &mut self.converted);
                let c = &self.converted;
                let wr: [&[f32]; NR] = [0, 1, 2, 3].map(|i| &c[i * k..(i + 1) * k]);
                row_tiles::<IsaDots<'_, I, &[f32]>>(wr, wr, x_rows, k, store);
            }
        }
    }
}

/// The rows `rows` of a `[N, k]` matrix.
#[inline(always)]
fn slices<T>(w: &[T], rows: [usize; NR], k: usize) -> [&[T]; NR] {
    rows.map(|n| &w[n * k..(n + 1) * k])
}

/// The weight rows `w` as float32, one after the other, into `dst` (exact).
#[inline(always)]
fn convert<W: WeightRow>(w: [W; NR], dst: &mut [f32]) {
    let k = dst.len() / NR;
    for (row, chunk) in w.iter().zip(dst.chunks_exact_mut(k)) {
        row.to_f32(chunk);
    }
}

/// Walks columns `a..b` a weight tile (`NR` rows) at a time, handing each to `tiles` with a
/// `store` that scales the dot products, adds the bias and writes them.
#[inline(always)]
fn walk(p: Product<'_>, a: usize, b: usize, tiles: &mut impl WeightTiles) -> Vec<f32> {
    let Product {
        weight,
        bias,
        dims: d,
        prefetch,
        ..
    } = p;
    let width = b - a;
    let mut out = vec![0.0f32; d.rows * width];
    let mut n0 = a;
    while n0 < b {
        let nr = NR.min(b - n0);
        // A short last tile repeats its last row: the extra dot products are discarded.
        let rows: [usize; NR] = std::array::from_fn(|i| n0 + i.min(nr - 1));
        // The rows to prefetch while this tile computes: PREFETCH_TILES tiles on, clamped to the
        // thread's last row (without the prefetch: this tile's own rows, already in cache).
        let ahead_by = if prefetch { PREFETCH_TILES * NR } else { 0 };
        let next: [usize; NR] = std::array::from_fn(|i| (n0 + ahead_by + i).min(b - 1));
        let mut store = |m0: usize, dots: &[[f32; MAX_MR]; NR], r: usize| {
            for (i, row_dots) in dots.iter().enumerate().take(nr) {
                let n = n0 + i;
                let add = bias.map_or(0.0, |bv| bv[n]);
                for (j, &dot) in row_dots.iter().enumerate().take(r) {
                    let v = match weight {
                        LinearWeight::Int8 { scales, .. } => dot * scales[n],
                        _ => dot,
                    };
                    out[(m0 + j) * width + (n - a)] = v + add;
                }
            }
        };
        tiles.tile(rows, next, &mut store);
        n0 += nr;
    }
    out
}

/// Every input row against one weight tile, `T::MR` rows at a time; `store(first row, dots,
/// rows)` takes each tile's dot products.
#[inline(always)]
fn row_tiles<T: TileDots>(
    w: [T::W; NR],
    ahead: [T::W; NR],
    x_rows: &[T::X],
    k: usize,
    store: &mut Store<'_>,
) {
    const { assert!(T::MR >= 1 && T::MR <= MAX_MR) };
    let mut m0 = 0;
    while m0 < x_rows.len() {
        let r = T::MR.min(x_rows.len() - m0);
        let mut dots = [[0.0f32; MAX_MR]; NR];
        // One instantiation per tile height, so a lone row does one dot product per weight
        // row, not MR of them.
        macro_rules! heights {
            ($($h:literal)*) => {
                match r {
                    $($h => {
                        let x: [T::X; $h] = std::array::from_fn(|j| x_rows[m0 + j]);
                        for (d, t) in dots.iter_mut().zip(T::dots::<$h>(w, ahead, x, k)) {
                            d[..$h].copy_from_slice(&t);
                        }
                    })*
                    _ => {
                        let x: [T::X; MAX_MR] = std::array::from_fn(|j| x_rows[m0 + j]);
                        dots = T::dots::<MAX_MR>(w, ahead, x, k);
                    }
                }
            };
        }
        heights!(1 2 3 4 5);
        store(m0, &dots, r);
        m0 += r;
    }
}
