//! Linear layers on the CPU straight from GGUF's block-quantized weights:
//! `out[M, N] = x[M, K] W^T + bias`, `x` float32, `W` stored as GGUF blocks (Q4_0, Q4_1, Q8_0,
//! Q4_K), never dequantized to memory.
//!
//! Why: a batch-1 decode step reads every weight once, so it is bound by the bytes it reads.
//! A GGUF file's 4-bit blocks are 4.5-5 bits per weight; dequantized to float32 they are 32.
//!
//! The formats (each row of `W` is `K / V` blocks of `V` values, stored back to back):
//! - Q4_0: 32 values in 18 bytes: fp16 `d`, 16 bytes of nibbles; value `j < 16` is the low
//!   nibble of byte `j`, value `16 + j` its high nibble; `w = d * (q - 8)`.
//! - Q4_1: 32 values in 20 bytes: fp16 `d`, fp16 `m`, nibbles as Q4_0; `w = d * q + m`.
//! - Q8_0: 32 values in 34 bytes: fp16 `d`, 32 int8 `q`; `w = d * q`.
//! - Q4_K: 256 values in 144 bytes: fp16 `d`, fp16 `dmin`, 12 bytes packing eight 6-bit scales
//!   `sc` and mins `mn`, 128 bytes of nibbles; group `g` (32 values) of the block is the low
//!   (`g` even) or high (`g` odd) nibbles of bytes `32 * (g / 2) ..` and
//!   `w = (d * sc[g]) * q - dmin * mn[g]`.
//!
//! Every format is thus, per group of 32 values, small integers `q` with a float32 scale `s`
//! and offset `o`: `w = s * q + o`. The kernel computes a group's contribution to a dot product
//! as `s * (q . x) + o * sum(x)`, the sums of `x` over each group computed once per call; so
//! the integers are converted to float32 (exactly) and multiplied by `x` in registers, the
//! scale applied once per group, the offset once per group as a scalar.
//!
//! Summation order, fixed per instruction set: for each (weight row, input row) the groups in
//! order, each `p = q . x` over the group's lanes (8 lanes on AVX2 and the portable path, 16 on
//! AVX-512), `acc = s * p + acc` per lane, and a scalar `off = off + o * xsum`; at the end a
//! fixed horizontal sum of `acc` plus `off`, plus the bias. Nothing of it depends on the tile an
//! element falls in, the number of rows `M` or of threads: row `m` of a product of `M` rows is
//! bit for bit the product of that row alone, on one instruction set. The instruction sets
//! differ in the last bits (fused multiply-adds, 16 lanes against 8).
//!
//! With more input rows than one register tile (`M > MR`) a tile of weight rows is first
//! decoded (its integers, as float32, exactly) into an L1-resident buffer that every row tile
//! then reads, so the decoding is paid once per weight, not once per row tile; the same
//! values are multiplied in the same order, so the bits are the same.
//!
//! Threads: the crate's pool ([`crate::thread_pool`]), columns split in ranges of whole tiles
//! as in [`crate::cpu_linear`]. Every length is checked before any work: bad input is an error,
//! never a panic.

use crate::cpu_linear::{check_bias, run_in_column_ranges, LinearDims};
use crate::error::{CoreError, Result};

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;

/// Weight rows per register tile: the float32 kernel's, whose column ranges this kernel uses.
pub(crate) const NR: usize = crate::cpu_linear::NR;
/// Input rows per register tile.
pub(crate) const MR: usize = 3;
/// Values per group: one scale and offset each.
pub(crate) const GROUP: usize = 32;
/// How many tiles ahead a thread prefetches weight rows (as [`crate::cpu_linear`] does).
pub(crate) const PREFETCH_TILES: usize = 4;

/// A GGUF block format the kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    /// 32 values: fp16 scale, 4-bit values minus 8.
    Q4_0,
    /// 32 values: fp16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 values: fp16 scale, int8 values.
    Q8_0,
    /// 256 values: fp16 super-scales, eight 6-bit scales and mins, 4-bit values.
    Q4K,
}

impl GgufType {
    /// The type called `name` as GGUF names it (`"Q4_0"`, `"Q4_1"`, `"Q8_0"`, `"Q4_K"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "Q4_0" => Some(Self::Q4_0),
            "Q4_1" => Some(Self::Q4_1),
            "Q8_0" => Some(Self::Q8_0),
            "Q4_K" => Some(Self::Q4K),
            _ => None,
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            Self::Q4K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
        }
    }

    /// Whether a group's offset can be non-zero (the product then needs the sums of `x`).
    fn has_offset(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q4K)
    }

    /// The kind constant the instruction sets' kernels are specialised on.
    fn kind(self) -> u8 {
        match self {
            Self::Q4_0 => KIND_Q4_0,
            Self::Q4_1 => KIND_Q4_1,
            Self::Q8_0 => KIND_Q8_0,
            Self::Q4K => KIND_Q4K,
        }
    }
}

/// Which instruction set runs the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufIsa {
    /// AVX2 + FMA where the CPU has them, else portable. Not AVX-512: on the Zen 4 this was
    /// measured on its path ran products of more than `MR` rows (the decoded-tile path) about
    /// twice as slow as AVX2's, and no faster at one row (benches/bench_gguf_linear.py); it
    /// stays selectable (`Avx512`) until it is tuned.
    Auto,
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA (x86-64).
    Avx2,
    /// AVX-512 F + BW (x86-64).
    Avx512,
}

impl GgufIsa {
    /// The set called `name`: `"auto"`, `"portable"`, `"avx2"` or `"avx512"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "auto" => Some(Self::Auto),
            "portable" => Some(Self::Portable),
            "avx2" => Some(Self::Avx2),
            "avx512" => Some(Self::Avx512),
            _ => None,
        }
    }

    /// Whether this CPU can run the set (`Auto` and `Portable` always can).
    pub fn available(self) -> bool {
        match self {
            Self::Auto | Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// `Auto` made concrete (AVX2, else portable); another set
    /// as it is, or an error if the CPU lacks it.
    pub fn resolve(self) -> Result<Self> {
        match self {
            Self::Auto => Ok(if Self::Avx2.available() {
                Self::Avx2
            } else {
                Self::Portable
            }),
            isa if isa.available() => Ok(isa),
            isa => Err(CoreError::InvalidArgument(format!(
                "this CPU cannot run the {isa:?} GGUF linear kernel"
            ))),
        }
    }

    /// The set's name as [`GgufIsa::from_name`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

/// A weight matrix `[N, K]` as GGUF blocks: row `n` is `bytes[n * row_bytes .. (n + 1) * row_bytes]`
/// with `row_bytes = K / block_values * block_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct GgufWeight<'a> {
    /// The block format.
    pub kind: GgufType,
    /// The rows' blocks, back to back.
    pub blocks: &'a [u8],
}

/// `out[m, n] = sum_k x[m, k] * W[n, k] + bias[n]` for `x` `[M, K]` and `out` `[M, N]` (float32,
/// row-major), `W` as GGUF blocks, on up to `threads` threads with the instruction set `isa`.
/// Errors (before any work): `K` not a multiple of the format's block, a slice whose length
/// is not its shape's, `K` or `N` of 0, an instruction set the CPU lacks.
pub fn cpu_linear_gguf(
    x: &[f32],
    weight: GgufWeight<'_>,
    bias: Option<&[f32]>,
    dims: LinearDims,
    out: &mut [f32],
    threads: usize,
    isa: GgufIsa,
) -> Result<()> {
    validate(x, weight, bias, dims, out)?;
    let isa = isa.resolve()?;
    let (m, k) = (dims.rows, dims.in_features);
    if m == 0 {
        return Ok(());
    }
    // Each input row's sums over its groups of 32, in order: the offsets' factors.
    let xsums: Vec<f32> = if weight.kind.has_offset() {
        x.chunks_exact(GROUP).map(|g| g.iter().sum()).collect()
    } else {
        Vec::new()
    };
    let p = Product {
        x,
        xsums: &xsums,
        weight,
        bias,
        dims,
        row_bytes: k / weight.kind.block_values() * weight.kind.block_bytes(),
    };
    run_in_column_ranges(dims, threads, out, "a GGUF linear worker failed", |a, b| {
        columns_dispatch(isa, p, a, b)
    })
}

fn validate(
    x: &[f32],
    weight: GgufWeight<'_>,
    bias: Option<&[f32]>,
    d: LinearDims,
    out: &[f32],
) -> Result<()> {
    let bad = |what: String| Err(CoreError::InvalidArgument(what));
    let kind = weight.kind;
    if d.in_features == 0 || d.out_features == 0 {
        return bad(format!(
            "a linear needs in_features and out_features >= 1, got {} and {}",
            d.in_features, d.out_features
        ));
    }
    if !d.in_features.is_multiple_of(kind.block_values()) {
        return bad(format!(
            "{kind:?} blocks hold {} values: in_features {} is not a multiple",
            kind.block_values(),
            d.in_features
        ));
    }
    let row_bytes = d.in_features / kind.block_values() * kind.block_bytes();
    let (Some(x_len), Some(w_len), Some(out_len)) = (
        d.rows.checked_mul(d.in_features),
        d.out_features.checked_mul(row_bytes),
        d.rows.checked_mul(d.out_features),
    ) else {
        return bad(format!("linear shapes overflow: {d:?}"));
    };
    if x.len() != x_len || weight.blocks.len() != w_len || out.len() != out_len {
        return bad(format!(
            "GGUF linear slices do not match {d:?} ({kind:?}): x {} (want {x_len}), weight bytes {} \
             (want {w_len}), out {} (want {out_len})",
            x.len(),
            weight.blocks.len(),
            out.len()
        ));
    }
    check_bias(bias, d.out_features)
}

/// A validated product's inputs.
#[derive(Clone, Copy)]
pub(crate) struct Product<'a> {
    x: &'a [f32],
    /// `[M, K / 32]` sums of `x` per group (empty for formats without offsets).
    xsums: &'a [f32],
    weight: GgufWeight<'a>,
    bias: Option<&'a [f32]>,
    dims: LinearDims,
    row_bytes: usize,
}

/// The kernels' format constants ([`GgufType::kind`]), and the decoded tile buffer's.
pub(crate) const KIND_Q4_0: u8 = 0;
pub(crate) const KIND_Q4_1: u8 = 1;
pub(crate) const KIND_Q8_0: u8 = 2;
pub(crate) const KIND_Q4K: u8 = 3;
/// Float32 values of the integers, `K` per row (a decoded tile).
pub(crate) const KIND_F32: u8 = 4;

/// The bytes of group `g` (counted along the row) of a row of `KIND`, from the row's start:
/// where its integers begin.
#[inline(always)]
pub(crate) fn group_data<const KIND: u8>(g: usize) -> usize {
    match KIND {
        KIND_Q4_0 => g * 18 + 2,
        KIND_Q4_1 => g * 20 + 4,
        KIND_Q8_0 => g * 34 + 2,
        KIND_Q4K => (g / 8) * 144 + 16 + (g % 8 / 2) * 32,
        _ => g * GROUP * 4,
    }
}

/// The instruction set's tile kernels.
pub(crate) trait Isa {
    /// The dot products of `NR` weight rows with `R` input rows over `groups` groups: rows of
    /// `KIND` at `w` (each `groups` groups long; readable), their groups' `[scale, offset]` in
    /// `scales` (`NR * groups`, row by row), input rows `x` (`groups * 32` values each) and
    /// their group sums `xs` (`groups` each, or empty when `has_offset` is false). `ahead`: rows
    /// read later, to prefetch (no effect on the result).
    ///
    /// # Safety
    /// Each `w[i]` (and `ahead[i]`) points at a full row of `KIND` of `groups` groups, and
    /// the CPU has the instruction set.
    unsafe fn dots<const KIND: u8, const R: usize>(
        w: [*const u8; NR],
        ahead: [*const u8; NR],
        scales: &[[f32; 2]],
        groups: usize,
        x: [&[f32]; R],
        xs: [&[f32]; R],
        has_offset: bool,
    ) -> [[f32; R]; NR];

    /// Writes the integers of a row of `KIND` (`groups` groups, at `w`) as float32 into `dst`
    /// (`groups * 32` values).
    ///
    /// # Safety
    /// As for [`Isa::dots`].
    unsafe fn decode<const KIND: u8>(w: *const u8, groups: usize, dst: &mut [f32]);
}

/// Columns `a..b` of the product on `isa` (resolved: not `Auto`).
fn columns_dispatch(isa: GgufIsa, p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            // SAFETY: `isa` was resolved, so the CPU has the set.
            GgufIsa::Avx512 => return unsafe { x86::columns_avx512(p, a, b) },
            GgufIsa::Avx2 => return unsafe { x86::columns_avx2(p, a, b) },
            _ => {}
        }
    }
    let _ = isa;
    columns_by_kind::<portable::Portable>(p, a, b)
}

/// Columns `a..b`, the kernel specialised on the weight's format.
#[inline(always)]
pub(crate) fn columns_by_kind<I: Isa>(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    match p.weight.kind.kind() {
        KIND_Q4_0 => columns::<I, KIND_Q4_0>(p, a, b),
        KIND_Q4_1 => columns::<I, KIND_Q4_1>(p, a, b),
        KIND_Q8_0 => columns::<I, KIND_Q8_0>(p, a, b),
        _ => columns::<I, KIND_Q4K>(p, a, b),
    }
}

/// A half-precision float's value (exact: every fp16 is a float32). Branch-free: the scales
/// of every group of every weight row go through it, ~2 per 32 weights.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    // Exponent and mantissa moved into float32's fields, then scaled by 2^(127 - 15): exact
    // for normal and subnormal halves alike; infinities and NaNs get the all-ones exponent.
    let bits = u32::from(h & 0x7fff) << 13;
    let magnitude = if h & 0x7c00 == 0x7c00 {
        f32::from_bits(bits | 0x7f80_0000)
    } else {
        f32::from_bits(bits) * f32::from_bits(0x7780_0000)
    };
    f32::from_bits(magnitude.to_bits() | (u32::from(h & 0x8000) << 16))
}

#[inline(always)]
fn half_at(row: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([row[at], row[at + 1]]))
}

/// The `[scale, offset]` of every group of a row of `kind` (`w = scale * q + offset`), into
/// `dst` (`K / 32` pairs).
fn row_scales(kind: GgufType, row: &[u8], dst: &mut [[f32; 2]]) {
    match kind {
        GgufType::Q4_0 | GgufType::Q4_1 | GgufType::Q8_0 => {
            let bb = kind.block_bytes();
            for (g, d) in dst.iter_mut().enumerate() {
                let offset = if kind == GgufType::Q4_1 {
                    half_at(row, g * bb + 2)
                } else {
                    0.0
                };
                *d = [half_at(row, g * bb), offset];
            }
        }
        GgufType::Q4K => {
            for (b, d8) in dst.chunks_exact_mut(8).enumerate() {
                let block = &row[b * 144..(b + 1) * 144];
                let (d, dmin) = (half_at(block, 0), half_at(block, 2));
                let s = &block[4..16];
                for (j, dj) in d8.iter_mut().enumerate() {
                    let (sc, mn) = if j < 4 {
                        (s[j] & 63, s[j + 4] & 63)
                    } else {
                        (
                            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
                            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                        )
                    };
                    *dj = [d * f32::from(sc), -(dmin * f32::from(mn))];
                }
            }
        }
    }
}

/// Columns `a..b` of the product (see the module docs) as an `[M, b - a]` buffer.
#[inline(always)]
fn columns<I: Isa, const KIND: u8>(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    let (m, k) = (p.dims.rows, p.dims.in_features);
    let groups = k / GROUP;
    let rb = p.row_bytes;
    let kind = p.weight.kind;
    let blocks = p.weight.blocks;
    let has_offset = kind.has_offset();
    let width = b - a;
    let mut out = vec![0.0f32; m * width];
    let x_rows: Vec<&[f32]> = p.x.chunks_exact(k).collect();
    let xs_rows: Vec<&[f32]> = if has_offset {
        p.xsums.chunks_exact(groups).collect()
    } else {
        vec![&[][..]; m]
    };
    let mut scales = vec![[0.0f32; 2]; NR * groups];
    // More rows than one register tile: the tile's integers decoded once, read by every row tile.
    let mut decoded = if m > MR {
        vec![0.0f32; NR * k]
    } else {
        Vec::new()
    };
    let row = |n: usize| &blocks[n * rb..(n + 1) * rb];
    let mut n0 = a;
    while n0 < b {
        let nr = NR.min(b - n0);
        // A short last tile repeats its last row: the extra dot products are discarded.
        let rows: [usize; NR] = std::array::from_fn(|i| n0 + i.min(nr - 1));
        let next: [usize; NR] = std::array::from_fn(|i| (n0 + PREFETCH_TILES * NR + i).min(b - 1));
        for (i, &n) in rows.iter().enumerate() {
            row_scales(kind, row(n), &mut scales[i * groups..(i + 1) * groups]);
        }
        let mut store = |m0: usize, dots: &[[f32; MR]; NR], r: usize| {
            for (i, row_dots) in dots.iter().enumerate().take(nr) {
                let n = n0 + i;
                let add = p.bias.map_or(0.0, |bv| bv[n]);
                for (j, &dot) in row_dots.iter().enumerate().take(r) {
                    out[(m0 + j) * width + (n - a)] = dot + add;
                }
            }
        };
        let ahead = next.map(|n| row(n).as_ptr());
        if decoded.is_empty() {
            let w = rows.map(|n| row(n).as_ptr());
            row_tiles::<I, KIND>(
                w, ahead, &scales, groups, &x_rows, &xs_rows, has_offset, &mut store,
            );
        } else {
            for (i, &n) in rows.iter().enumerate() {
                // SAFETY: `row(n)` is a whole validated row of `groups` groups; `I` is the
                // set this thread was dispatched to, which the CPU has.
                unsafe {
                    I::decode::<KIND>(row(n).as_ptr(), groups, &mut decoded[i * k..(i + 1) * k])
                };
            }
            let w: [*const u8; NR] = std::array::from_fn(|i| decoded[i * k..].as_ptr().cast());
            // In L1 already: nothing to prefetch.
            row_tiles::<I, KIND_F32>(
                w, w, &scales, groups, &x_rows, &xs_rows, has_offset, &mut store,
            );
        }
        n0 += nr;
    }
    out
}

/// Every input row against one weight tile, `MR` rows at a time; `store(first row, dots, rows)`
/// takes each tile's dot products.
#[allow(clippy::too_many_arguments)] // the tile's parts, passed through to the kernel
#[inline(always)]
fn row_tiles<I: Isa, const KIND: u8>(
    w: [*const u8; NR],
    ahead: [*const u8; NR],
    scales: &[[f32; 2]],
    groups: usize,
    x_rows: &[&[f32]],
    xs_rows: &[&[f32]],
    has_offset: bool,
    store: &mut impl FnMut(usize, &[[f32; MR]; NR], usize),
) {
    let mut m0 = 0;
    while m0 < x_rows.len() {
        let r = MR.min(x_rows.len() - m0);
        let mut dots = [[0.0f32; MR]; NR];
        let (x, xs) = (&x_rows[m0..], &xs_rows[m0..]);
        // SAFETY: `w` and `ahead` point at whole rows of `KIND` of `groups` groups (validated
        // rows, or the decoded buffer of `groups * 32` float32 per row); the set is the CPU's.
        unsafe {
            match r {
                1 => {
                    let t =
                        I::dots::<KIND, 1>(w, ahead, scales, groups, [x[0]], [xs[0]], has_offset);
                    for (d, t) in dots.iter_mut().zip(t) {
                        d[0] = t[0];
                    }
                }
                2 => {
                    let t = I::dots::<KIND, 2>(
                        w,
                        ahead,
                        scales,
                        groups,
                        [x[0], x[1]],
                        [xs[0], xs[1]],
                        has_offset,
                    );
                    for (d, t) in dots.iter_mut().zip(t) {
                        d[..2].copy_from_slice(&t);
                    }
                }
                _ => {
                    dots = I::dots::<KIND, 3>(
                        w,
                        ahead,
                        scales,
                        groups,
                        [x[0], x[1], x[2]],
                        [xs[0], xs[1], xs[2]],
                        has_offset,
                    )
                }
            }
        }
        store(m0, &dots, r);
        m0 += r;
    }
}
