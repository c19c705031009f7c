//! A weight row as a register tile reads it: float32 values, int8 codes or bfloat16 bit
//! patterns, each made float32 exactly (an int8 code is an integer float32 holds; a bfloat16 is
//! the top half of a float32's bits).
//!
//! The vector loads are `#[inline(always)]` functions without `#[target_feature]`: they are
//! inlined into the kernel functions that have the feature (`columns_avx2`, `columns_avx512`),
//! so the intrinsics compile to single instructions there. Each one's safety contract: the CPU
//! has the instruction set its name says, and every lane it reads unmasked is inside the row.

/// A weight row (see the module docs).
pub(super) trait WeightRow: Copy {
    /// Bytes per stored value.
    const BYTES: usize;
    /// The address of the first value.
    fn address(self) -> *const u8;
    /// The value at `i` as float32 (the tail past the last whole vector).
    fn at(self, i: usize) -> f32;
    /// Eight values from `i` on (`i + 8 <= len`).
    fn lanes8(self, i: usize) -> [f32; 8];
    /// The row as float32 into `dst` (as long as the row).
    fn to_f32(self, dst: &mut [f32]);
    /// Eight values from `i` on, as float32 lanes.
    ///
    /// # Safety
    /// `i + 8 <= len` and the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256;
    /// Sixteen values from `i` on, as float32 lanes; the lanes of `mask`'s zero bits are 0.0 and
    /// not read.
    ///
    /// # Safety
    /// Every lane of `mask` is inside the row and the CPU has AVX-512 F + BW + VL.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(self, i: usize, mask: u16) -> std::arch::x86_64::__m512;
}

/// A bfloat16 bit pattern as float32 (exact: the pattern is the float32's top 16 bits).
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `v` rounded to the nearest bfloat16, ties to even (a NaN stays a NaN, quiet): what torch's
/// `tensor.bfloat16()` does.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
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
    #[inline(always)]
    fn lanes8(self, i: usize) -> [f32; 8] {
        let mut v = [0.0; 8];
        v.copy_from_slice(&self[i..i + 8]);
        v
    }
    #[inline(always)]
    fn to_f32(self, dst: &mut [f32]) {
        dst.copy_from_slice(self);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        debug_assert!(i + 8 <= self.len());
        std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        if mask == u16::MAX {
            debug_assert!(i + 16 <= self.len());
            _mm512_loadu_ps(self.as_ptr().add(i))
        } else {
            _mm512_maskz_loadu_ps(mask, self.as_ptr().add(i))
        }
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
    #[inline(always)]
    fn lanes8(self, i: usize) -> [f32; 8] {
        std::array::from_fn(|j| f32::from(self[i + j]))
    }
    #[inline(always)]
    fn to_f32(self, dst: &mut [f32]) {
        for (d, &c) in dst.iter_mut().zip(self) {
            *d = f32::from(c);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        debug_assert!(i + 8 <= self.len());
        let bytes = _mm_loadl_epi64(self.as_ptr().add(i).cast());
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bytes = if mask == u16::MAX {
            debug_assert!(i + 16 <= self.len());
            _mm_loadu_si128(self.as_ptr().add(i).cast())
        } else {
            _mm_maskz_loadu_epi8(mask, self.as_ptr().add(i))
        };
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
    }
}

/// Bfloat16 weights: the bit patterns (numpy has no bfloat16; torch's `view(torch.int16)`).
impl WeightRow for &[u16] {
    const BYTES: usize = 2;
    #[inline(always)]
    fn address(self) -> *const u8 {
        self.as_ptr().cast()
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        bf16_to_f32(self[i])
    }
    #[inline(always)]
    fn lanes8(self, i: usize) -> [f32; 8] {
        std::array::from_fn(|j| bf16_to_f32(self[i + j]))
    }
    #[inline(always)]
    fn to_f32(self, dst: &mut [f32]) {
        for (d, &c) in dst.iter_mut().zip(self) {
            *d = bf16_to_f32(c);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        debug_assert!(i + 8 <= self.len());
        let words = _mm_loadu_si128(self.as_ptr().add(i).cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(words)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let words = if mask == u16::MAX {
            debug_assert!(i + 16 <= self.len());
            _mm256_loadu_si256(self.as_ptr().add(i).cast())
        } else {
            _mm256_maskz_loadu_epi16(mask, self.as_ptr().add(i).cast())
        };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(words)))
    }
}

/// Sums eight lanes in the fixed order the AVX2 path uses: halves, then pairs, then the last
/// two (`((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`).
#[inline(always)]
pub(super) fn hsum8(l: [f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    let p = [h[0] + h[2], h[1] + h[3]];
    p[0] + p[1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            2f32.powi(100),
            2f32.powi(-130),
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            let b = f32_to_bf16(v);
            assert_eq!(bf16_to_f32(b), v, "{v} is a bfloat16 already");
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even one (1).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 2f32.powi(-8))), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
        let v = 1.0 + 3.0 * 2f32.powi(-8);
        assert_eq!(bf16_to_f32(f32_to_bf16(v)), 1.0 + 2f32.powi(-6));
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 2f32.powi(-9))), 1.0);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // The largest float32 rounds up to infinity, as torch's conversion does.
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
    }
}
