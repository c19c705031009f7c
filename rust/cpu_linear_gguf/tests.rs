use super::*;

/// A deterministic pseudo-random byte stream.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// An fp16 in [0.001, 0.06] (finite scales: random bytes would make infinities).
fn half(seed: u8) -> [u8; 2] {
    // exponent 5..10 (2^-10 .. 2^-5), any mantissa.
    let h: u16 = ((5 + u16::from(seed) % 6) << 10) | (u16::from(seed).wrapping_mul(37) & 0x3ff);
    h.to_le_bytes()
}

/// `n` random rows of `k` values of `kind`, with finite fp16 scales.
fn random_rows(kind: GgufType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut b = bytes(n * k / kind.block_values() * kind.block_bytes(), seed);
    for (i, block) in b.chunks_exact_mut(kind.block_bytes()).enumerate() {
        let halves = if matches!(kind, GgufType::Q4_1 | GgufType::Q4K) {
            2
        } else {
            1
        };
        for h in 0..halves {
            block[2 * h..2 * h + 2].copy_from_slice(&half((i * 7 + h * 3) as u8));
        }
    }
    b
}

/// A row dequantized from the format's definition (the module docs), written independently
/// of the kernel's decoding.
fn dequant(kind: GgufType, row: &[u8]) -> Vec<f64> {
    let h = |b: &[u8], at: usize| f64::from(f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]])));
    let mut out = Vec::new();
    for block in row.chunks_exact(kind.block_bytes()) {
        match kind {
            GgufType::Q4_0 | GgufType::Q4_1 => {
                let (d, m, qs) = if kind == GgufType::Q4_0 {
                    (h(block, 0), -8.0 * h(block, 0), &block[2..])
                } else {
                    (h(block, 0), h(block, 2), &block[4..])
                };
                out.extend(qs.iter().map(|&c| d * f64::from(c & 15) + m));
                out.extend(qs.iter().map(|&c| d * f64::from(c >> 4) + m));
            }
            GgufType::Q8_0 => {
                let d = h(block, 0);
                out.extend(block[2..].iter().map(|&c| d * f64::from(c as i8)));
            }
            GgufType::Q4K => {
                let (d, dmin, s, qs) = (h(block, 0), h(block, 2), &block[4..16], &block[16..]);
                let six = |j: usize| -> (u8, u8) {
                    if j < 4 {
                        (s[j] & 63, s[j + 4] & 63)
                    } else {
                        (
                            (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4),
                            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                        )
                    }
                };
                for j in 0..8 {
                    let (sc, mn) = six(j);
                    let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                    let shift = 4 * (j % 2);
                    out.extend(chunk.iter().map(|&c| {
                        d * f64::from(sc) * f64::from((c >> shift) & 15) - dmin * f64::from(mn)
                    }));
                }
            }
        }
    }
    out
}

fn isas() -> Vec<GgufIsa> {
    [GgufIsa::Portable, GgufIsa::Avx2, GgufIsa::Avx512]
        .into_iter()
        .filter(|isa| isa.available())
        .collect()
}

const KINDS: [GgufType; 4] = [
    GgufType::Q4_0,
    GgufType::Q4_1,
    GgufType::Q8_0,
    GgufType::Q4K,
];

#[test]
fn half_floats_convert_exactly() {
    for (h, want) in [
        (0x3c00u16, 1.0f32),
        (0xc000, -2.0),
        (0x0001, 5.960_464_5e-8),
        (0x8000, -0.0),
        (0x7bff, 65504.0),
        (0x3555, 0.333_251_95),
    ] {
        assert_eq!(f16_to_f32(h).to_bits(), want.to_bits(), "{h:#x}");
    }
    assert!(f16_to_f32(0x7c00).is_infinite() && f16_to_f32(0x7e00).is_nan());
}

#[test]
fn matches_a_float64_reference_and_each_row_alone() {
    for kind in KINDS {
        let bv = kind.block_values();
        for (m, blocks_per_row, n, threads) in
            [(1, 1, 5, 1), (4, 3, 9, 2), (7, 2, 33, 3), (17, 1, 64, 2)]
        {
            let k = bv * blocks_per_row;
            let d = LinearDims {
                rows: m,
                in_features: k,
                out_features: n,
            };
            let x = values(m * k, 1);
            let w = random_rows(kind, n, k, (m * 31 + n) as u64);
            let bias = values(n, 4);
            let rb = k / bv * kind.block_bytes();
            let want: Vec<f64> = (0..m * n)
                .map(|i| {
                    let (row, col) = (i / n, i % n);
                    let wr = dequant(kind, &w[col * rb..(col + 1) * rb]);
                    let dot: f64 = wr
                        .iter()
                        .zip(&x[row * k..(row + 1) * k])
                        .map(|(a, &b)| a * f64::from(b))
                        .sum();
                    dot + f64::from(bias[col])
                })
                .collect();
            let scale: f64 = want.iter().map(|v| v.abs()).fold(1.0, f64::max);
            let weight = GgufWeight { kind, blocks: &w };
            for isa in isas() {
                let mut out = vec![0.0; m * n];
                cpu_linear_gguf(&x, weight, Some(&bias), d, &mut out, threads, isa).unwrap();
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(got) - want).abs() <= 2e-6 * scale * (k as f64).sqrt(),
                        "{kind:?} {isa:?} {d:?} [{i}]: {got} vs {want}"
                    );
                }
                let mut one_thread = vec![0.0; m * n];
                cpu_linear_gguf(&x, weight, Some(&bias), d, &mut one_thread, 1, isa).unwrap();
                assert_eq!(
                    out, one_thread,
                    "{kind:?} {isa:?}: threads changed the bits"
                );
                for row in 0..m {
                    let mut alone = vec![0.0; n];
                    let one = LinearDims { rows: 1, ..d };
                    cpu_linear_gguf(
                        &x[row * k..(row + 1) * k],
                        weight,
                        Some(&bias),
                        one,
                        &mut alone,
                        1,
                        isa,
                    )
                    .unwrap();
                    assert_eq!(
                        alone.as_slice(),
                        &out[row * n..(row + 1) * n],
                        "{kind:?} {isa:?} row {row} of {d:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_input_is_an_error() {
    let d = LinearDims {
        rows: 2,
        in_features: 64,
        out_features: 3,
    };
    let w = random_rows(GgufType::Q4_1, 3, 64, 1);
    let weight = GgufWeight {
        kind: GgufType::Q4_1,
        blocks: &w,
    };
    let (x, mut out) = (vec![0.0; 128], vec![0.0; 6]);
    let auto = GgufIsa::Auto;
    assert!(cpu_linear_gguf(&x, weight, None, d, &mut out, 1, auto).is_ok());
    assert!(cpu_linear_gguf(&x[..127], weight, None, d, &mut out, 1, auto).is_err());
    let short = GgufWeight {
        blocks: &w[..w.len() - 1],
        ..weight
    };
    assert!(cpu_linear_gguf(&x, short, None, d, &mut out, 1, auto).is_err());
    assert!(cpu_linear_gguf(&x, weight, Some(&[0.0; 2]), d, &mut out, 1, auto).is_err());
    let q4k = GgufWeight {
        kind: GgufType::Q4K,
        ..weight
    };
    assert!(
        cpu_linear_gguf(&x, q4k, None, d, &mut out, 1, auto).is_err(),
        "64 is not a multiple of 256"
    );
    let odd = LinearDims {
        in_features: 48,
        rows: 1,
        ..d
    };
    assert!(cpu_linear_gguf(&[0.0; 48], weight, None, odd, &mut [0.0; 3], 1, auto).is_err());
    let empty = LinearDims { rows: 0, ..d };
    assert!(cpu_linear_gguf(&[], weight, None, empty, &mut [], 2, auto).is_ok());
    for isa in [GgufIsa::Avx2, GgufIsa::Avx512] {
        if !isa.available() {
            assert!(cpu_linear_gguf(&x, weight, None, d, &mut out, 1, isa).is_err());
        }
    }
}
