//! The x86-64 kernels: AVX2 + FMA (8 lanes) and AVX-512 F + BW (16 lanes). Their functions are
//! `#[inline(always)]` without `#[target_feature]`: they are inlined into `columns_avx2` /
//! `columns_avx512`, which have the features, so the intrinsics compile to single instructions
//! there.
//!
//! A group's integers are widened to 32-bit lanes (`vpmovzxbd` / `vpmovsxbd`; a nibble is
//! masked or shifted out first) and converted to float32, exactly; then multiplied by `x`.
//! While a tile computes, the weight rows [`super::PREFETCH_TILES`] tiles on are prefetched
//! into L2, about a cache line per group pair, as the float32 kernel does (rust/cpu_linear/).

use std::arch::x86_64::*;

use super::{
    columns_by_kind, group_data, Isa, Product, GROUP, KIND_F32, KIND_Q4K, KIND_Q4_0, KIND_Q4_1,
    KIND_Q8_0, NR,
};

/// Columns `a..b` on AVX2 + FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn columns_avx2(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    columns_by_kind::<Avx2>(p, a, b)
}

/// Columns `a..b` on AVX-512.
///
/// # Safety
/// The CPU has AVX-512 F and BW (and so AVX2 and FMA).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub(super) unsafe fn columns_avx512(p: Product<'_>, a: usize, b: usize) -> Vec<f32> {
    columns_by_kind::<Avx512>(p, a, b)
}

/// Prefetches the groups' bytes of the rows read later, about once per cache line.
#[inline(always)]
unsafe fn prefetch_ahead<const KIND: u8>(ahead: &[*const u8; NR], g: usize) {
    if KIND != KIND_F32 && (KIND == KIND_Q8_0 || g.is_multiple_of(2)) {
        for row in ahead {
            // A prefetch reads nothing and cannot fault; the address is inside the row.
            _mm_prefetch::<_MM_HINT_T1>(row.add(group_data::<KIND>(g)).cast());
        }
    }
}

/// The AVX2 + FMA kernels.
#[derive(Clone, Copy)]
pub(super) struct Avx2;

/// Group `g`'s integers as float32, 8 lanes a vector.
#[inline(always)]
unsafe fn q8<const KIND: u8>(row: *const u8, g: usize) -> [__m256; 4] {
    let p = row.add(group_data::<KIND>(g));
    let cvt = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    let mask = _mm_set1_epi8(15);
    match KIND {
        KIND_Q4_0 | KIND_Q4_1 => {
            let v = _mm_loadu_si128(p.cast());
            let (mut lo, mut hi) = (
                _mm_and_si128(v, mask),
                _mm_and_si128(_mm_srli_epi16::<4>(v), mask),
            );
            if KIND == KIND_Q4_0 {
                lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
                hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
            }
            [
                cvt(lo),
                cvt(_mm_srli_si128::<8>(lo)),
                cvt(hi),
                cvt(_mm_srli_si128::<8>(hi)),
            ]
        }
        KIND_Q8_0 => std::array::from_fn(|c| cvt(_mm_loadl_epi64(p.add(8 * c).cast()))),
        KIND_Q4K => {
            let v = _mm256_loadu_si256(p.cast());
            let mask = _mm256_set1_epi8(15);
            let n = if g % 2 == 1 {
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask)
            } else {
                _mm256_and_si256(v, mask)
            };
            let (l, h) = (_mm256_castsi256_si128(n), _mm256_extracti128_si256::<1>(n));
            [
                cvt(l),
                cvt(_mm_srli_si128::<8>(l)),
                cvt(h),
                cvt(_mm_srli_si128::<8>(h)),
            ]
        }
        _ => {
            let f = p.cast::<f32>();
            std::array::from_fn(|c| _mm256_loadu_ps(f.add(8 * c)))
        }
    }
}

/// Eight lanes summed in [`super::portable::hsum8`]'s order.
#[inline(always)]
unsafe fn hsum8(v: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps::<1>(p, p)))
}

impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn dots<const KIND: u8, const R: usize>(
        w: [*const u8; NR],
        ahead: [*const u8; NR],
        scales: &[[f32; 2]],
        groups: usize,
        x: [&[f32]; R],
        xs: [&[f32]; R],
        has_offset: bool,
    ) -> [[f32; R]; NR] {
        let mut acc = [[_mm256_setzero_ps(); R]; NR];
        let mut off = [[0.0f32; R]; NR];
        for g in 0..groups {
            prefetch_ahead::<KIND>(&ahead, g);
            for i in 0..NR {
                let q = q8::<KIND>(w[i], g);
                let [s, o] = *scales.get_unchecked(i * groups + g);
                let sv = _mm256_set1_ps(s);
                for r in 0..R {
                    let xp = x[r].as_ptr().add(g * GROUP);
                    let mut p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                    p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), p);
                    p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), p);
                    p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), p);
                    acc[i][r] = _mm256_fmadd_ps(sv, p, acc[i][r]);
                    if has_offset {
                        off[i][r] += o * *xs[r].get_unchecked(g);
                    }
                }
            }
        }
        std::array::from_fn(|i| std::array::from_fn(|r| hsum8(acc[i][r]) + off[i][r]))
    }

    #[inline(always)]
    unsafe fn decode<const KIND: u8>(w: *const u8, groups: usize, dst: &mut [f32]) {
        debug_assert!(dst.len() >= groups * GROUP);
        for g in 0..groups {
            let q = q8::<KIND>(w, g);
            for (c, v) in q.into_iter().enumerate() {
                _mm256_storeu_ps(dst.as_mut_ptr().add(g * GROUP + 8 * c), v);
            }
        }
    }
}

/// The AVX-512 kernels.
#[derive(Clone, Copy)]
pub(super) struct Avx512;

/// Group `g`'s integers as float32, 16 lanes a vector.
#[inline(always)]
unsafe fn q16<const KIND: u8>(row: *const u8, g: usize) -> [__m512; 2] {
    let p = row.add(group_data::<KIND>(g));
    let wide = |at: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(at).cast()));
    let mask = _mm512_set1_epi32(15);
    let cvt = _mm512_cvtepi32_ps;
    match KIND {
        KIND_Q4_0 | KIND_Q4_1 => {
            let v = wide(0);
            let (mut lo, mut hi) = (_mm512_and_si512(v, mask), _mm512_srli_epi32::<4>(v));
            if KIND == KIND_Q4_0 {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            }
            [cvt(lo), cvt(hi)]
        }
        KIND_Q8_0 => std::array::from_fn(|c| {
            cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16 * c).cast())))
        }),
        KIND_Q4K => {
            let (a, b) = (wide(0), wide(16));
            if g % 2 == 1 {
                [
                    cvt(_mm512_srli_epi32::<4>(a)),
                    cvt(_mm512_srli_epi32::<4>(b)),
                ]
            } else {
                [
                    cvt(_mm512_and_si512(a, mask)),
                    cvt(_mm512_and_si512(b, mask)),
                ]
            }
        }
        _ => {
            let f = p.cast::<f32>();
            [_mm512_loadu_ps(f), _mm512_loadu_ps(f.add(16))]
        }
    }
}

/// Sixteen lanes summed: the two halves lane by lane, then [`hsum8`].
#[inline(always)]
unsafe fn hsum16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    hsum8(_mm256_add_ps(lo, hi))
}

impl Isa for Avx512 {
    #[inline(always)]
    unsafe fn dots<const KIND: u8, const R: usize>(
        w: [*const u8; NR],
        ahead: [*const u8; NR],
        scales: &[[f32; 2]],
        groups: usize,
        x: [&[f32]; R],
        xs: [&[f32]; R],
        has_offset: bool,
    ) -> [[f32; R]; NR] {
        let mut acc = [[_mm512_setzero_ps(); R]; NR];
        let mut off = [[0.0f32; R]; NR];
        for g in 0..groups {
            prefetch_ahead::<KIND>(&ahead, g);
            for i in 0..NR {
                let q = q16::<KIND>(w[i], g);
                let [s, o] = *scales.get_unchecked(i * groups + g);
                let sv = _mm512_set1_ps(s);
                for r in 0..R {
                    let xp = x[r].as_ptr().add(g * GROUP);
                    let p = _mm512_mul_ps(q[0], _mm512_loadu_ps(xp));
                    let p = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xp.add(16)), p);
                    acc[i][r] = _mm512_fmadd_ps(sv, p, acc[i][r]);
                    if has_offset {
                        off[i][r] += o * *xs[r].get_unchecked(g);
                    }
                }
            }
        }
        std::array::from_fn(|i| std::array::from_fn(|r| hsum16(acc[i][r]) + off[i][r]))
    }

    #[inline(always)]
    unsafe fn decode<const KIND: u8>(w: *const u8, groups: usize, dst: &mut [f32]) {
        debug_assert!(dst.len() >= groups * GROUP);
        for g in 0..groups {
            let q = q16::<KIND>(w, g);
            for (c, v) in q.into_iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add(g * GROUP + 16 * c), v);
            }
        }
    }
}
