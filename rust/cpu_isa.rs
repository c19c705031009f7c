//! Which x86 instruction sets this CPU has, detected once at run time, and which path each of
//! the crate's CPU kernels takes on it.
//!
//! The crate is compiled for the baseline x86-64 (SSE2): every faster path is compiled into the
//! library with `#[target_feature]` and chosen here, per process, by what the CPU reports. One
//! place decides, so the start-up log and the benchmarks can say which path ran
//! (`pagedkv._core.cpu_isa()`), and tests can force a slower path to compare it with the
//! portable one ([`LinearIsa`]).
//!
//! Paths of [`crate::cpu_linear`] (float32, int8 and bfloat16 weights):
//! - `portable`: plain Rust, 8 lanes summed as the AVX2 path does but multiplied and added
//!   with two roundings;
//! - `avx2`: AVX2 + FMA, 8 float32 lanes (AMD EPYC before Zen 4, every x86 server since 2013);
//! - `avx512`: AVX-512 F + BW + VL, 16 float32 lanes, masked tails (Intel Xeon since Skylake-SP,
//!   AMD Zen 4). BW and VL are required too: the int8 and bfloat16 tails are masked byte and
//!   word loads;
//! - `avx512_bf16` (bfloat16 weights only): AVX512-BF16's `vdpbf16ps`, the input rows rounded
//!   to bfloat16 once per call (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4).
//!
//! Paths of [`crate::cpu_attention`]: `avx2` (AVX2 + FMA + F16C) or `portable`
//! ([`attention_path`]).
//!
//! AVX512-VNNI and AMX are reported but no kernel uses them yet: VNNI multiplies int8 by int8
//! (the int8 kernel multiplies its codes by float32 inputs, exactly, and would have to quantize
//! the inputs to use it), and AMX needs the kernel to ask Linux for the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and a machine to test it on.

use std::sync::OnceLock;

/// The instruction-set extensions the kernels care about, as this CPU (and its OS, for the
/// register state) reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// AVX2 (256-bit integer and float vectors).
    pub avx2: bool,
    /// FMA3 (fused multiply-add).
    pub fma: bool,
    /// F16C (half <-> float conversions).
    pub f16c: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 byte and word instructions (masked 8/16-bit loads).
    pub avx512bw: bool,
    /// AVX-512 vector-length extensions (the 128/256-bit forms of the masked instructions).
    pub avx512vl: bool,
    /// AVX512-BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`).
    pub avx512_bf16: bool,
    /// AVX512-VNNI (`vpdpbusd`: u8 x i8 dot products into int32).
    pub avx512_vnni: bool,
    /// AMX tiles (CPUID says so and the OS saves the tile state).
    pub amx_tile: bool,
    /// AMX bfloat16 tile products.
    pub amx_bf16: bool,
    /// AMX int8 tile products.
    pub amx_int8: bool,
}

impl CpuFeatures {
    /// The features of this CPU (detected on the first call, then remembered).
    pub fn get() -> &'static CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        FEATURES.get_or_init(detect)
    }

    /// The names of the features present, in a fixed order (`avx2`, `fma`, `f16c`, `avx512f`,
    /// `avx512bw`, `avx512vl`, `avx512_bf16`, `avx512_vnni`, `amx_tile`, `amx_bf16`,
    /// `amx_int8`).
    pub fn names(&self) -> Vec<&'static str> {
        [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512vl", self.avx512vl),
            ("avx512_bf16", self.avx512_bf16),
            ("avx512_vnni", self.avx512_vnni),
            ("amx_tile", self.amx_tile),
            ("amx_bf16", self.amx_bf16),
            ("amx_int8", self.amx_int8),
        ]
        .into_iter()
        .filter_map(|(name, has)| has.then_some(name))
        .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuFeatures {
    use std::arch::x86_64::__cpuid_count;
    // std's detection checks CPUID and that the OS saves the registers (XCR0) for everything
    // but AMX, whose detection is not stable Rust: CPUID leaf 7 EDX bits 22 (AMX-BF16),
    // 24 (AMX-TILE), 25 (AMX-INT8), and XCR0 bits 17-18 (XTILECFG, XTILEDATA).
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is only read when leaf 0 says it exists.
    let (amx_tile, amx_bf16, amx_int8) = unsafe {
        let max_leaf = __cpuid_count(0, 0).eax;
        let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
        if max_leaf >= 7 && osxsave {
            let edx = __cpuid_count(7, 0).edx;
            let tile_state = xcr0() & (0b11 << 17) == 0b11 << 17;
            let tile = edx & (1 << 24) != 0 && tile_state;
            (
                tile,
                tile && edx & (1 << 22) != 0,
                tile && edx & (1 << 25) != 0,
            )
        } else {
            (false, false, false)
        }
    };
    CpuFeatures {
        avx2: std::is_x86_feature_detected!("avx2"),
        fma: std::is_x86_feature_detected!("fma"),
        f16c: std::is_x86_feature_detected!("f16c"),
        avx512f: std::is_x86_feature_detected!("avx512f"),
        avx512bw: std::is_x86_feature_detected!("avx512bw"),
        avx512vl: std::is_x86_feature_detected!("avx512vl"),
        avx512_bf16: std::is_x86_feature_detected!("avx512bf16"),
        avx512_vnni: std::is_x86_feature_detected!("avx512vnni"),
        amx_tile,
        amx_bf16,
        amx_int8,
    }
}

/// XCR0, the register state the OS saves (only called when CPUID says OSXSAVE).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures::default()
}

/// The path of [`crate::cpu_attention`]'s decode kernel on this CPU: `avx2` (AVX2 + FMA +
/// F16C: the fp8 caches' conversions use the half instructions) or `portable`.
pub fn attention_path() -> &'static str {
    let f = CpuFeatures::get();
    if f.avx2 && f.fma && f.f16c {
        "avx2"
    } else {
        "portable"
    }
}

/// A path of the CPU linear kernel ([`crate::cpu_linear`]), slowest first. Each sums every
/// output element in its own fixed order (lane count, fused or not), so results differ between
/// paths in the last bits but never within one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinearIsa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA, 8 lanes.
    Avx2,
    /// AVX-512 F + BW + VL, 16 lanes.
    Avx512,
    /// AVX512-BF16's dot products (bfloat16 weights only; other weights take [`Self::Avx512`]).
    Avx512Bf16,
}

impl LinearIsa {
    /// Every path, slowest first.
    pub const ALL: [LinearIsa; 4] = [
        LinearIsa::Portable,
        LinearIsa::Avx2,
        LinearIsa::Avx512,
        LinearIsa::Avx512Bf16,
    ];

    /// The path's name: `portable`, `avx2`, `avx512`, `avx512_bf16`.
    pub fn name(self) -> &'static str {
        match self {
            LinearIsa::Portable => "portable",
            LinearIsa::Avx2 => "avx2",
            LinearIsa::Avx512 => "avx512",
            LinearIsa::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// The path named `name` (see [`Self::name`]), if any.
    pub fn from_name(name: &str) -> Option<LinearIsa> {
        Self::ALL.into_iter().find(|isa| isa.name() == name)
    }

    /// The CPU features the path needs that `features` lacks (empty: it can run).
    pub fn missing(self, f: &CpuFeatures) -> Vec<&'static str> {
        let need: &[(&str, bool)] = match self {
            LinearIsa::Portable => &[],
            LinearIsa::Avx2 => &[("avx2", f.avx2), ("fma", f.fma)],
            LinearIsa::Avx512 => &[
                ("avx512f", f.avx512f),
                ("avx512bw", f.avx512bw),
                ("avx512vl", f.avx512vl),
            ],
            LinearIsa::Avx512Bf16 => &[
                ("avx512f", f.avx512f),
                ("avx512bw", f.avx512bw),
                ("avx512vl", f.avx512vl),
                ("avx512_bf16", f.avx512_bf16),
            ],
        };
        need.iter()
            .filter_map(|&(name, has)| (!has).then_some(name))
            .collect()
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        self.missing(CpuFeatures::get()).is_empty()
    }

    /// The fastest path this CPU has for float32 and int8 weights.
    pub fn best() -> LinearIsa {
        [LinearIsa::Avx512, LinearIsa::Avx2]
            .into_iter()
            .find(|isa| isa.available())
            .unwrap_or(LinearIsa::Portable)
    }

    /// The fastest path this CPU has for bfloat16 weights.
    pub fn best_bf16() -> LinearIsa {
        if LinearIsa::Avx512Bf16.available() {
            LinearIsa::Avx512Bf16
        } else {
            Self::best()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_best_path_is_available() {
        for isa in LinearIsa::ALL {
            assert_eq!(LinearIsa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(LinearIsa::from_name("sse9"), None);
        assert!(LinearIsa::Portable.available());
        assert!(LinearIsa::best().available());
        assert!(LinearIsa::best_bf16().available());
        assert!(LinearIsa::best() <= LinearIsa::Avx512);
        let none = CpuFeatures::default();
        assert_eq!(LinearIsa::Avx2.missing(&none), ["avx2", "fma"]);
        assert!(none.names().is_empty());
        let f = CpuFeatures::get();
        // A CPU with AVX-512 has AVX2 and FMA too.
        assert!(!f.avx512f || (f.avx2 && f.fma));
    }
}
