//! The AVX-512 tiles: 16 float32 lanes per dot product, and 32 vector registers, so a tile
//! holds `NR x 6` accumulators (24) where AVX2's 16 registers hold `NR x 3`.
//!
//! - [`Avx512`] (AVX-512 F + BW + VL): `acc[lane] += w[k] * x[k]` fused, over `k` in steps of
//!   16; the `K % 16` tail is one more step with masked loads (the masked-off lanes load 0.0
//!   and add `0 * 0`); then [`hsum16`]. Int8 and bfloat16 weights are made float32 in registers
//!   (exactly) as for AVX2.
//! - [`Bf16Dot`] (AVX512-BF16, bfloat16 weights): `vdpbf16ps` multiplies 32 bfloat16 weights
//!   by 32 bfloat16 inputs (the input rows rounded to bfloat16 once per call) and adds each
//!   lane's pair of products to a float32 lane; the tail a masked step; then [`hsum16`].
//!   Products of two bfloat16 are exact in float32; the error against the float32 product is
//!   the inputs' rounding (2^-9 relative each) and the float32 sums.
//!
//! The functions are `#[inline(always)]` without `#[target_feature]`, inlined into
//! `columns_avx512` / `columns_avx512_bf16`, which have the features; they prefetch the rows of
//! a later tile as the AVX2 tile does (see `avx2.rs`).

use super::rows::WeightRow;
use super::{avx2, Isa, TileDots, NR};
use std::arch::x86_64::*;
use std::marker::PhantomData;

/// AVX-512 F + BW + VL.
#[derive(Clone, Copy)]
pub(super) struct Avx512;

/// Input rows per AVX-512 register tile: `NR x 6` = 24 accumulators of the 32 registers.
const MR: usize = 6;

impl Isa for Avx512 {
    const MR: usize = MR;

    #[inline(always)]
    fn dots<W: WeightRow, const R: usize>(
        w: [W; NR],
        ahead: [W; NR],
        x: [&[f32]; R],
        k: usize,
    ) -> [[f32; R]; NR] {
        // SAFETY: only reached from `columns_avx512` (AVX-512 F + BW + VL present); the whole
        // steps read `i + 16 <= k` values of rows of exactly `k` (the callers pass such rows,
        // in `ahead` too), the tail's loads are masked to `i..k`; a prefetch cannot fault.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); R]; NR];
            let whole = k / 16 * 16;
            let mut i = 0;
            while i < whole {
                if (i * W::BYTES) % 64 == 0 {
                    for row in ahead {
                        _mm_prefetch::<_MM_HINT_T1>(row.address().add(i * W::BYTES).cast());
                    }
                }
                step(&w, &x, &mut acc, i, u16::MAX);
                i += 16;
            }
            if whole < k {
                step(&w, &x, &mut acc, whole, (1u16 << (k - whole)) - 1);
            }
            sums(&acc)
        }
    }
}

/// The horizontal sums of a tile's accumulators (loops, not closures: a closure would be a
/// function without the target features, its intrinsics not inlined).
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
unsafe fn sums<const R: usize>(acc: &[[__m512; R]; NR]) -> [[f32; R]; NR] {
    let mut out = [[0.0f32; R]; NR];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, &v) in o.iter_mut().zip(a) {
            *o = hsum16(v);
        }
    }
    out
}

/// One step of 16 values from `i` on (the lanes of `mask`) of every dot product of the tile.
///
/// # Safety
/// AVX-512 F + BW + VL; the lanes of `mask` are inside every row.
#[inline(always)]
unsafe fn step<W: WeightRow, const R: usize>(
    w: &[W; NR],
    x: &[&[f32]; R],
    acc: &mut [[__m512; R]; NR],
    i: usize,
    mask: u16,
) {
    for (wi, acc_w) in w.iter().zip(acc.iter_mut()) {
        let wv = wi.load16(i, mask);
        for (xr, a) in x.iter().zip(acc_w.iter_mut()) {
            *a = _mm512_fmadd_ps(wv, xr.load16(i, mask), *a);
        }
    }
}

/// Sums sixteen lanes in a fixed order: `l[j] + l[j + 8]`, then [`super::rows::hsum8`]'s order.
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
unsafe fn hsum16(v: __m512) -> f32 {
    let low = _mm512_castps512_ps256(v);
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    avx2::hsum(_mm256_add_ps(low, high))
}

/// The AVX512-BF16 tile of bfloat16 weights and bfloat16-rounded inputs (see the module docs).
#[derive(Clone, Copy)]
pub(super) struct Bf16Dot<'a>(PhantomData<&'a ()>);

impl<'a> TileDots for Bf16Dot<'a> {
    type W = &'a [u16];
    type X = &'a [u16];
    const MR: usize = MR;

    #[inline(always)]
    fn dots<const R: usize>(
        w: [&'a [u16]; NR],
        ahead: [&'a [u16]; NR],
        x: [&'a [u16]; R],
        k: usize,
    ) -> [[f32; R]; NR] {
        // SAFETY: only reached from `columns_avx512_bf16` (AVX-512 F + BW + VL + BF16
        // present); the whole steps read `i + 32 <= k` values of rows of exactly `k` (weights,
        // `ahead` and inputs alike), the tail's loads are masked to `i..k`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); R]; NR];
            let whole = k / 32 * 32;
            let mut i = 0;
            while i < whole {
                for row in ahead {
                    _mm_prefetch::<_MM_HINT_T1>(row.as_ptr().add(i).cast());
                }
                dot_step(&w, &x, &mut acc, i, u32::MAX);
                i += 32;
            }
            if whole < k {
                dot_step(&w, &x, &mut acc, whole, (1u32 << (k - whole)) - 1);
            }
            sums(&acc)
        }
    }
}

/// One `vdpbf16ps` step of 32 values from `i` on (the lanes of `mask`).
///
/// # Safety
/// AVX-512 F + BW + BF16; the lanes of `mask` are inside every row.
#[inline(always)]
unsafe fn dot_step<const R: usize>(
    w: &[&[u16]; NR],
    x: &[&[u16]; R],
    acc: &mut [[__m512; R]; NR],
    i: usize,
    mask: u32,
) {
    for (wi, acc_w) in w.iter().zip(acc.iter_mut()) {
        let wv = load_bf16(wi, i, mask);
        for (xr, a) in x.iter().zip(acc_w.iter_mut()) {
            *a = _mm512_dpbf16_ps(*a, wv, load_bf16(xr, i, mask));
        }
    }
}

/// 32 bfloat16 values of `row` from `i` on (the lanes of `mask`; the others 0).
///
/// # Safety
/// AVX-512 F + BW; the lanes of `mask` are inside the row.
#[inline(always)]
unsafe fn load_bf16(row: &[u16], i: usize, mask: u32) -> __m512bh {
    let v = if mask == u32::MAX {
        _mm512_loadu_si512(row.as_ptr().add(i).cast())
    } else {
        _mm512_maskz_loadu_epi16(mask, row.as_ptr().add(i).cast())
    };
    // SAFETY: both are 64 bytes of plain lanes; the BF16 instructions read the 32 16-bit lanes
    // as bfloat16.
    std::mem::transmute::<__m512i, __m512bh>(v)
}
