//! The AVX2 + FMA tile: 8 float32 lanes per dot product, fused multiply-adds. Its functions
//! are `#[inline(always)]` without `#[target_feature]`: they are inlined into `columns_avx2`,
//! which has the feature, so the intrinsics compile to single instructions there.
//!
//! While it computes a tile it prefetches into L2 the weight rows of the tile
//! [`super::PREFETCH_TILES`] tiles on, one cache line per row per 64 bytes it reads. At one
//! input row the product is a stream of the weights, and a tile reads `NR` rows side by side,
//! each only `K` values long (2.3 KB for K = 576): the hardware prefetcher met `NR` new short
//! streams at every tile, and without this the kernel read SmolLM2's weights well below the
//! rate `torch.sum` reads the same bytes at (benches/RESULTS.md, "Compiled forward: the step's
//! overhead").

use super::rows::WeightRow;
use super::{Isa, NR};
use std::arch::x86_64::*;

/// AVX2 + FMA.
#[derive(Clone, Copy)]
pub(super) struct Avx2;

impl Isa for Avx2 {
    const MR: usize = 3;

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

/// [`super::rows::hsum8`]'s order in registers.
///
/// # Safety
/// The CPU has AVX.
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
}
