//! Tiling (the work split of the matmul and MoE kernels, `MatMulTiling` / `MoeTiling`) never
//! changes a result: every valid tiling gives the bits of the default split, on every ISA path,
//! both precisions, dense and block-quantized weights, plain, multi-segment and fused SwiGLU
//! calls, on 1 and 3 threads; and a value outside its range is a panic naming the parameter (the
//! orchestrator refuses it first). That each setting really moves the split is checked on the
//! plans themselves (`kernels/src/quant/tiling_tests.rs`).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::quant::{self, Precision};
use tboost_kernels::gemm::{self, MatMulTiling, MatSeg};
use tboost_kernels::isa::Isa;
use tboost_kernels::moe::{self, Expert, MoeTiling};
use tboost_kernels::{DType, WeightMat, WeightVec};

mod quant_util;
use quant_util::*;

/// Valid tilings that cut the work very differently from the default and from each other.
fn tilings() -> Vec<MatMulTiling> {
    let t = |panel_rows, act_rows, tasks_per_thread, decode_task_min_bytes| MatMulTiling {
        panel_rows,
        act_rows,
        tasks_per_thread,
        decode_task_min_bytes,
    };
    vec![
        t(Some(16), Some(1), None, None),
        t(Some(32), Some(5), None, None),
        t(Some(48), Some(7), Some(1), None),
        t(Some(4096), None, None, None),
        t(None, Some(65536), None, None),
        t(None, Some(2), Some(64), Some(4096)),
        t(None, None, Some(1), Some(16 << 20)),
        t(Some(64), Some(13), Some(3), Some(8192)),
    ]
}

fn dense_bytes(dtype: DType, vals: &[f32]) -> Vec<u8> {
    vals.iter()
        .flat_map(|&v| match dtype {
            DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

/// Two segments (the second with a bias) through `run`, one output each.
fn two_segs(
    x: &[f32],
    m: usize,
    ws: [WeightMat<'_>; 2],
    bias: &[f32],
    run: impl FnOnce(&[f32], usize, &mut [MatSeg<'_, '_>]),
) -> Vec<f32> {
    let (mut a, mut b) = (vec![f32::NAN; m * ws[0].rows], vec![f32::NAN; m * ws[1].rows]);
    run(
        x,
        m,
        &mut [
            MatSeg { w: ws[0], bias: None, out: &mut a },
            MatSeg { w: ws[1], bias: Some(WeightVec::from_f32(bias)), out: &mut b },
        ],
    );
    a.extend(b);
    a
}

#[test]
fn dense_matmul_and_swiglu_give_the_default_bits_under_every_tiling() {
    let mut rng = StdRng::seed_from_u64(31);
    let (n, k) = (45, 200);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (gb, ub) = (dense_bytes(dtype, &random_x(n, k, &mut rng)), dense_bytes(dtype, &random_x(n, k, &mut rng)));
        let (g, u) = (WeightMat::new(dtype, n, k, &gb).unwrap(), WeightMat::new(dtype, n, k, &ub).unwrap());
        let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for m in [1, 4, 7, 40] {
            let x = random_x(m, k, &mut rng);
            for isa in isas() {
                let what = format!("{dtype} {} m={m}", isa.name());
                let want = two_segs(&x, m, [g, u], &bias, |x, m, s| gemm::matmul_with(isa, x, m, s));
                let mut want_sw = vec![0f32; m * n];
                gemm::matmul_swiglu_with(isa, &x, m, g, u, &mut want_sw);
                for t in tilings() {
                    for threads in [1, 3] {
                        let what = format!("{what} threads={threads} {t:?}");
                        let got = in_pool(threads, || {
                            two_segs(&x, m, [g, u], &bias, |x, m, s| gemm::matmul_with_tiled(isa, &t, x, m, s))
                        });
                        assert_bits_eq(&got, &want, &what);
                        let mut sw = vec![f32::NAN; m * n];
                        in_pool(threads, || gemm::matmul_swiglu_with_tiled(isa, &t, &x, m, g, u, &mut sw));
                        assert_bits_eq(&sw, &want_sw, &format!("swiglu {what}"));
                    }
                }
            }
            // The dispatching entry points: f32/f16 at fast precision run the exact kernels and
            // take the tiling too.
            if dtype != DType::BF16 {
                for prec in [Precision::Exact, Precision::Fast] {
                    let want = two_segs(&x, m, [g, u], &bias, |x, m, s| gemm::matmul_prec(prec, x, m, s));
                    let t = tilings()[1];
                    let got = in_pool(3, || {
                        two_segs(&x, m, [g, u], &bias, |x, m, s| gemm::matmul_prec_tiled(prec, &t, x, m, s))
                    });
                    assert_bits_eq(&got, &want, &format!("{dtype} {prec:?} m={m} matmul_prec_tiled"));
                }
            }
        }
    }
}

#[test]
fn quantized_matmul_and_swiglu_give_the_default_bits_under_every_tiling() {
    let mut rng = StdRng::seed_from_u64(32);
    // k = 512: default tiled tasks take 96 activation rows; m = 97 crosses it, m = 5 and 6 are
    // the first tiled rows of the exact and fast paths, m = 1 is decode, and m = 9 cut in 7 + 2
    // rows mixes packed and direct fast tasks in one call.
    let (n, k) = (45, 512);
    for dt in QUANT {
        let (gb, ub) = (random_weights(dt, n, k, &mut rng), random_weights(dt, n, k, &mut rng));
        let (g, u) = (WeightMat::new(dt, n, k, &gb).unwrap(), WeightMat::new(dt, n, k, &ub).unwrap());
        let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for m in [1, 5, 6, 9, 97] {
            let x = random_x(m, k, &mut rng);
            for isa in isas() {
                for prec in [Precision::Exact, Precision::Fast] {
                    let what = format!("{dt} {} {prec:?} m={m}", isa.name());
                    let run = |x: &[f32], m, s: &mut [MatSeg<'_, '_>], t: &MatMulTiling| {
                        quant::matmul_quant_prec_with_tiled(isa, quant::IntDot::active(), prec, x, m, s, t)
                    };
                    let def = MatMulTiling::default();
                    let want = in_pool(1, || two_segs(&x, m, [g, u], &bias, |x, m, s| run(x, m, s, &def)));
                    let mut want_sw = vec![0f32; m * n];
                    in_pool(1, || {
                        quant::matmul_swiglu_quant_prec_with(isa, true, prec, &x, m, g, u, &mut want_sw);
                    });
                    for t in tilings() {
                        for threads in [1, 3] {
                            let what = format!("{what} threads={threads} {t:?}");
                            let got = in_pool(threads, || two_segs(&x, m, [g, u], &bias, |x, m, s| run(x, m, s, &t)));
                            assert_bits_eq(&got, &want, &what);
                            let mut sw = vec![f32::NAN; m * n];
                            in_pool(threads, || {
                                quant::matmul_swiglu_quant_prec_with_tiled(
                                    isa,
                                    quant::IntDot::active(),
                                    prec,
                                    &x,
                                    m,
                                    g,
                                    u,
                                    &mut sw,
                                    &t,
                                )
                            });
                            assert_bits_eq(&sw, &want_sw, &format!("swiglu {what}"));
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn moe_expert_batching_gives_the_default_bits() {
    let mut rng = StdRng::seed_from_u64(33);
    let (hidden, inter, n_exp, tokens, k) = (64, 96, 6, 21, 2);
    for dtype in [DType::F32, DType::BF16, DType::Q8_0] {
        let mats: Vec<[Vec<u8>; 3]> = (0..n_exp)
            .map(|_| {
                let mut mat = |rows: usize, cols: usize| match dtype {
                    DType::Q8_0 => random_weights(dtype, rows, cols, &mut rng),
                    _ => dense_bytes(dtype, &random_x(rows, cols, &mut rng)),
                };
                [mat(inter, hidden), mat(inter, hidden), mat(hidden, inter)]
            })
            .collect();
        let experts: Vec<Expert<'_>> = mats
            .iter()
            .map(|b| Expert {
                gate: WeightMat::new(dtype, inter, hidden, &b[0]).unwrap(),
                up: WeightMat::new(dtype, inter, hidden, &b[1]).unwrap(),
                down: WeightMat::new(dtype, hidden, inter, &b[2]).unwrap(),
            })
            .collect();
        let x = random_x(tokens, hidden, &mut rng);
        let logits: Vec<f32> = (0..tokens * n_exp).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let (ids, w) = moe::route_topk(&logits, n_exp, k, true);
        let mut want = vec![0f32; tokens * hidden];
        in_pool(1, || moe::moe_ffn(&x, tokens, &experts, &ids, &w, k, &mut want, &MoeTiling::default()));
        for batch in [None, Some(1), Some(2), Some(5), Some(65536)] {
            for parallel in [None, Some(1), Some(2), Some(3), Some(64)] {
                let t = MoeTiling { expert_batch_tokens: batch, parallel_expert_batches: parallel };
                for threads in [1, 3] {
                    let mut got = vec![f32::NAN; tokens * hidden];
                    in_pool(threads, || moe::moe_ffn(&x, tokens, &experts, &ids, &w, k, &mut got, &t));
                    assert_bits_eq(&got, &want, &format!("{dtype} threads={threads} {t:?}"));
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "matmul: tiling: panel_rows=20 is not a multiple of 16 in 16..=4096")]
fn a_tiling_outside_its_range_is_a_named_panic() {
    let wb = vec![0u8; 4 * 8 * 4];
    let w = WeightMat::new(DType::F32, 4, 8, &wb).unwrap();
    let mut out = vec![0f32; 4];
    let t = MatMulTiling { panel_rows: Some(20), ..Default::default() };
    gemm::matmul_with_tiled(Isa::Scalar, &t, &[0.0; 8], 1, &mut [MatSeg { w, bias: None, out: &mut out }]);
}

#[test]
#[should_panic(expected = "moe_ffn: tiling: parallel_expert_batches=0 is not in 1..=64")]
fn a_moe_tiling_outside_its_range_is_a_named_panic() {
    let wb = vec![0u8; 4 * 4 * 4];
    let w = WeightMat::new(DType::F32, 4, 4, &wb).unwrap();
    let e = [Expert { gate: w, up: w, down: w }];
    let t = MoeTiling { parallel_expert_batches: Some(0), ..Default::default() };
    moe::moe_ffn(&[0.0; 4], 1, &e, &[0], &[1.0], 1, &mut [0.0; 4], &t);
}

#[test]
fn packed_panels_give_the_default_bits_under_every_tiling() {
    let mut rng = StdRng::seed_from_u64(34);
    let (n, k) = (45, 512);
    // Dense panels run the exact kernels, block-type panels the fast ones.
    for (dt, prec) in [
        (DType::F16, Precision::Exact),
        (DType::BF16, Precision::Exact),
        (DType::Q4_0, Precision::Fast),
        (DType::Q6K, Precision::Fast),
    ] {
        let (gb, ub) = if dt.is_quantized() {
            (random_weights(dt, n, k, &mut rng), random_weights(dt, n, k, &mut rng))
        } else {
            (dense_bytes(dt, &random_x(n, k, &mut rng)), dense_bytes(dt, &random_x(n, k, &mut rng)))
        };
        let pack = |b: &[u8]| {
            let mut p;
            if dt.is_quantized() {
                p = vec![0u8; tboost_kernels::gemm::quant::panel_pack::packed_bytes(dt, n, k)];
                tboost_kernels::gemm::quant::panel_pack::pack(dt, n, k, b, &mut p);
            } else {
                p = vec![0u8; tboost_kernels::gemm::dense::exact_panels::packed_bytes(dt, n, k)];
                tboost_kernels::gemm::dense::exact_panels::pack(dt, n, k, b, &mut p);
            }
            p
        };
        let (gp, up) = (pack(&gb), pack(&ub));
        let (g, u) = (WeightMat::new(dt, n, k, &gb).unwrap(), WeightMat::new(dt, n, k, &ub).unwrap());
        let (pg, pu) = (WeightMat::packed(dt, n, k, &gp).unwrap(), WeightMat::packed(dt, n, k, &up).unwrap());
        let bias: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for m in [1, 6, 33] {
            let x = random_x(m, k, &mut rng);
            for isa in isas() {
                let run = |ws: [WeightMat<'_>; 2], t: &MatMulTiling| {
                    two_segs(&x, m, ws, &bias, |x, m, s| {
                        if dt.is_quantized() {
                            quant::matmul_quant_prec_with_tiled(isa, quant::IntDot::active(), prec, x, m, s, t)
                        } else {
                            gemm::matmul_with_tiled(isa, t, x, m, s)
                        }
                    })
                };
                let want = in_pool(1, || run([g, u], &MatMulTiling::default()));
                for t in tilings() {
                    for threads in [1, 3] {
                        let what = format!("{dt} packed {} m={m} threads={threads} {t:?}", isa.name());
                        assert_bits_eq(&in_pool(threads, || run([pg, pu], &t)), &want, &what);
                    }
                }
            }
        }
    }
}
