//! The portable tile: plain Rust for any CPU, in the AVX2 path's order (8 lanes, the same
//! horizontal sum, the tail in order) but with a rounding after each multiply and each add.

use super::rows::{hsum8, WeightRow};
use super::{Isa, NR};

/// The portable instruction set.
#[derive(Clone, Copy)]
pub(super) struct Portable;

impl Isa for Portable {
    const MR: usize = 3;

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
