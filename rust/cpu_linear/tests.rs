//! The kernel against a float64 reference on every path this CPU has, each row alone against
//! the batch, and bad shapes.

use super::rows::bf16_to_f32;
use super::*;

fn reference(x: &[f32], w: &[f32], scales: Option<&[f32]>, d: LinearDims) -> Vec<f64> {
    let mut out = vec![0.0; d.rows * d.out_features];
    for m in 0..d.rows {
        for n in 0..d.out_features {
            let s: f64 = (0..d.in_features)
                .map(|k| f64::from(x[m * d.in_features + k]) * f64::from(w[n * d.in_features + k]))
                .sum();
            out[m * d.out_features + n] = s * scales.map_or(1.0, |sc| f64::from(sc[n]));
        }
    }
    out
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The paths this CPU can run.
fn paths() -> Vec<LinearIsa> {
    LinearIsa::ALL
        .into_iter()
        .filter(|isa| isa.available())
        .collect()
}

#[test]
fn matches_a_float64_reference_and_each_row_alone_on_every_path() {
    for (m, k, n, threads) in [
        (1, 8, 4, 1),
        (5, 37, 9, 2),
        (7, 64, 130, 3),
        (3, 1, 1, 2),
        (13, 47, 11, 2),
        (16, 576, 64, 2),
    ] {
        let d = LinearDims {
            rows: m,
            in_features: k,
            out_features: n,
        };
        let x = values(m * k, 1);
        let w = values(n * k, 2);
        let codes: Vec<i8> = w.iter().map(|v| (v * 127.0).round() as i8).collect();
        let bf16: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
        let scales = values(n, 3)
            .iter()
            .map(|v| v.abs() + 0.01)
            .collect::<Vec<_>>();
        let bias = values(n, 4);
        for isa in paths() {
            for weight in [
                LinearWeight::F32(&w),
                LinearWeight::Int8 {
                    codes: &codes,
                    scales: &scales,
                },
                LinearWeight::Bf16(&bf16),
            ] {
                let run = |threads: usize, prefetch: bool| LinearRun {
                    threads,
                    prefetch,
                    isa: Some(isa),
                };
                let mut out = vec![0.0; m * n];
                cpu_linear(&x, weight, Some(&bias), d, &mut out, run(threads, true)).unwrap();
                let mut unprefetched = vec![0.0; m * n];
                cpu_linear(
                    &x,
                    weight,
                    Some(&bias),
                    d,
                    &mut unprefetched,
                    run(threads, false),
                )
                .unwrap();
                assert_eq!(out, unprefetched, "prefetch changed {d:?} on {isa:?}");
                let (wf, sc): (Vec<f32>, Option<&[f32]>) = match weight {
                    LinearWeight::F32(w) => (w.to_vec(), None),
                    LinearWeight::Int8 { codes, scales } => {
                        (codes.iter().map(|&c| f32::from(c)).collect(), Some(scales))
                    }
                    LinearWeight::Bf16(w) => (w.iter().map(|&b| bf16_to_f32(b)).collect(), None),
                };
                // The bfloat16 dot products multiply the inputs rounded to bfloat16.
                let xr: Vec<f32> =
                    if isa == LinearIsa::Avx512Bf16 && matches!(weight, LinearWeight::Bf16(_)) {
                        x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect()
                    } else {
                        x.clone()
                    };
                let want = reference(&xr, &wf, sc, d);
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let want = want + f64::from(bias[i % n]);
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()) * k as f64,
                        "{isa:?} {i}: {got} vs {want}"
                    );
                }
                for row in 0..m {
                    let one = LinearDims { rows: 1, ..d };
                    let mut alone = vec![0.0; n];
                    cpu_linear(
                        &x[row * k..(row + 1) * k],
                        weight,
                        Some(&bias),
                        one,
                        &mut alone,
                        run(1, true),
                    )
                    .unwrap();
                    assert_eq!(
                        alone.as_slice(),
                        &out[row * n..(row + 1) * n],
                        "row {row} of {d:?} on {isa:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_default_path_is_the_best_one() {
    let d = LinearDims {
        rows: 2,
        in_features: 40,
        out_features: 9,
    };
    let (x, w) = (values(80, 5), values(360, 6));
    let bf16: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
    for (weight, best) in [
        (LinearWeight::F32(&w), LinearIsa::best()),
        (LinearWeight::Bf16(&bf16), LinearIsa::best_bf16()),
    ] {
        let (mut auto, mut forced) = (vec![0.0; 18], vec![0.0; 18]);
        cpu_linear(&x, weight, None, d, &mut auto, LinearRun::on(1)).unwrap();
        let run = LinearRun {
            isa: Some(best),
            ..LinearRun::on(1)
        };
        cpu_linear(&x, weight, None, d, &mut forced, run).unwrap();
        assert_eq!(auto, forced);
    }
}

#[test]
fn bad_shapes_are_errors() {
    let d = LinearDims {
        rows: 2,
        in_features: 4,
        out_features: 3,
    };
    let (x, w, mut out) = (vec![0.0; 8], vec![0.0; 12], vec![0.0; 6]);
    let one = LinearRun::on(1);
    assert!(cpu_linear(&x[..7], LinearWeight::F32(&w), None, d, &mut out, one).is_err());
    assert!(cpu_linear(&x, LinearWeight::F32(&w[..11]), None, d, &mut out, one).is_err());
    assert!(cpu_linear(&x, LinearWeight::F32(&w), Some(&[0.0; 2]), d, &mut out, one).is_err());
    assert!(cpu_linear(&x, LinearWeight::Bf16(&[0; 11]), None, d, &mut out, one).is_err());
    let codes = vec![0i8; 12];
    let int8 = LinearWeight::Int8 {
        codes: &codes,
        scales: &[1.0; 2],
    };
    assert!(cpu_linear(&x, int8, None, d, &mut out, one).is_err());
    let empty = LinearDims {
        in_features: 0,
        ..d
    };
    assert!(cpu_linear(&[], LinearWeight::F32(&[]), None, empty, &mut [0.0; 6], one).is_err());
    assert!(cpu_linear(
        &[],
        LinearWeight::F32(&w),
        None,
        LinearDims { rows: 0, ..d },
        &mut [],
        LinearRun::on(2)
    )
    .is_ok());
    // A path the CPU lacks is an error, not an illegal instruction.
    for isa in LinearIsa::ALL.into_iter().filter(|isa| !isa.available()) {
        let run = LinearRun {
            isa: Some(isa),
            ..one
        };
        let err = cpu_linear(&x, LinearWeight::F32(&w), None, d, &mut out, run).unwrap_err();
        assert!(err.to_string().contains("lacks"), "{err}");
    }
}
