//! The portable kernels: plain Rust, 8 lanes per dot product in the order the AVX2 path uses
//! (each multiply and add rounded on its own, where AVX2 fuses them).

use super::{group_data, Isa, GROUP, KIND_F32, KIND_Q4K, KIND_Q4_0, KIND_Q8_0, NR};

/// The portable instruction set.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

/// The integers of group `g` of a row of `KIND` at `row`, as float32.
///
/// # Safety
/// `row` points at a row of `KIND` with more than `g` groups.
#[inline(always)]
pub(crate) unsafe fn group_q<const KIND: u8>(row: *const u8, g: usize) -> [f32; GROUP] {
    let p = row.add(group_data::<KIND>(g));
    let mut q = [0.0f32; GROUP];
    match KIND {
        KIND_F32 => {
            let v = std::slice::from_raw_parts(p.cast::<f32>(), GROUP);
            q.copy_from_slice(v);
        }
        KIND_Q8_0 => {
            let v = std::slice::from_raw_parts(p.cast::<i8>(), GROUP);
            for (d, &c) in q.iter_mut().zip(v) {
                *d = f32::from(c);
            }
        }
        KIND_Q4K => {
            let v = std::slice::from_raw_parts(p, GROUP);
            let shift = if g % 2 == 1 { 4 } else { 0 };
            for (d, &c) in q.iter_mut().zip(v) {
                *d = f32::from((c >> shift) & 15);
            }
        }
        _ => {
            // Q4_0 / Q4_1: low nibbles are values 0..16, high nibbles 16..32.
            let v = std::slice::from_raw_parts(p, GROUP / 2);
            let bias = if KIND == KIND_Q4_0 { 8.0 } else { 0.0 };
            for (j, &c) in v.iter().enumerate() {
                q[j] = f32::from(c & 15) - bias;
                q[j + GROUP / 2] = f32::from(c >> 4) - bias;
            }
        }
    }
    q
}

/// Sums eight lanes in the AVX2 path's order: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
pub(crate) fn hsum8(l: [f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    (h[0] + h[2]) + (h[1] + h[3])
}

impl Isa for Portable {
    #[inline(always)]
    unsafe fn dots<const KIND: u8, const R: usize>(
        w: [*const u8; NR],
        _ahead: [*const u8; NR],
        scales: &[[f32; 2]],
        groups: usize,
        x: [&[f32]; R],
        xs: [&[f32]; R],
        has_offset: bool,
    ) -> [[f32; R]; NR] {
        let mut acc = [[[0.0f32; 8]; R]; NR];
        let mut off = [[0.0f32; R]; NR];
        for g in 0..groups {
            for i in 0..NR {
                let q = group_q::<KIND>(w[i], g);
                let [s, o] = scales[i * groups + g];
                for r in 0..R {
                    let xg = &x[r][g * GROUP..(g + 1) * GROUP];
                    let mut p: [f32; 8] = std::array::from_fn(|l| q[l] * xg[l]);
                    for c in 1..GROUP / 8 {
                        for (l, pl) in p.iter_mut().enumerate() {
                            *pl += q[c * 8 + l] * xg[c * 8 + l];
                        }
                    }
                    for (a, pl) in acc[i][r].iter_mut().zip(p) {
                        *a += s * pl;
                    }
                    if has_offset {
                        off[i][r] += o * xs[r][g];
                    }
                }
            }
        }
        std::array::from_fn(|i| std::array::from_fn(|r| hsum8(acc[i][r]) + off[i][r]))
    }

    #[inline(always)]
    unsafe fn decode<const KIND: u8>(w: *const u8, groups: usize, dst: &mut [f32]) {
        for (g, d) in dst.chunks_exact_mut(GROUP).take(groups).enumerate() {
            d.copy_from_slice(&group_q::<KIND>(w, g));
        }
    }
}
