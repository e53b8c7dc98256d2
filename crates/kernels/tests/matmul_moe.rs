//! MoE routing and the grouped expert FFN against naive references.
//!
//! Tolerance of `moe_ffn` (first order, u = 2^-24, stated not guessed): the gate/up sums
//! carry `e_g <= (hidden/16 + 6) u Σ|x·w|` (see tests/matmul.rs), silu' is bounded by 1.1
//! and silu(g)*u adds about 4u relative; the down sums add `(inter/16 + 6) u Σ|w·h|` on top
//! of `Σ|w_down| e_h`; the weighted sum adds `(k+1) u Σ_r |w_r y_r|`. The test computes this
//! bound per element in f64 and allows twice it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::reference::weight_at;
use tboost_kernels::moe::{self, Expert};
use tboost_kernels::{DType, WeightMat};

#[test]
fn route_topk_matches_hand_computed_example() {
    let l = |p: f32| p.ln();
    // Token 0: p = [0.1, 0.2, 0.3, 0.4]. Token 1: a tie between experts 1 and 3 at the top.
    // Token 2: all equal.
    let logits = [l(1.0), l(2.0), l(3.0), l(4.0), 1.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0];
    let (ids, w) = moe::route_topk(&logits, 4, 2, false);
    assert_eq!(ids, [3, 2, 1, 3, 0, 1]);
    let e1 = 1.0 / (2.0 + (-1f32).exp() + (-2f32).exp());
    for (got, want) in w.iter().zip([0.4, 0.3, e1, e1, 0.25, 0.25]) {
        assert!((got - want).abs() <= 1e-6, "weights {w:?}");
    }
    let (ids, w) = moe::route_topk(&logits, 4, 2, true);
    assert_eq!(ids, [3, 2, 1, 3, 0, 1]);
    for (got, want) in w.iter().zip([4.0 / 7.0, 3.0 / 7.0, 0.5, 0.5, 0.5, 0.5]) {
        assert!((got - want).abs() <= 1e-6, "renormalized weights {w:?}");
    }
    let (ids, w) = moe::route_topk(&logits[8..], 4, 3, true);
    assert_eq!(ids, [0, 1, 2]);
    assert!(w.iter().all(|&v| (v - 1.0 / 3.0).abs() <= 1e-7), "{w:?}");
}

#[test]
fn route_topk_survives_huge_logits() {
    // Max subtraction: exp(1000) would overflow without it.
    let (ids, w) = moe::route_topk(&[1000.0, 999.0, -1000.0], 3, 2, true);
    assert_eq!(ids, [0, 1]);
    let e = (-1f32).exp();
    assert!((w[0] - 1.0 / (1.0 + e)).abs() <= 1e-6 && (w[1] - e / (1.0 + e)).abs() <= 1e-6, "{w:?}");
}

#[test]
#[should_panic(expected = "k = 5 must be in 1..=4")]
fn route_topk_rejects_k_above_expert_count() {
    moe::route_topk(&[0.0; 8], 4, 5, true);
}

struct OwnedExpert {
    bytes: [Vec<u8>; 3],
    dtype: DType,
    hidden: usize,
    inter: usize,
}

impl OwnedExpert {
    fn random(rng: &mut StdRng, dtype: DType, hidden: usize, inter: usize) -> Self {
        let mut mat = |n: usize| -> Vec<u8> {
            (0..n)
                .flat_map(|_| {
                    let v: f32 = rng.random_range(-1.0..1.0);
                    match dtype {
                        DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                        DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                        _ => v.to_le_bytes().to_vec(),
                    }
                })
                .collect()
        };
        let bytes = [mat(hidden * inter), mat(hidden * inter), mat(hidden * inter)];
        OwnedExpert { bytes, dtype, hidden, inter }
    }
    fn view(&self) -> Expert<'_> {
        let (h, i, d) = (self.hidden, self.inter, self.dtype);
        Expert {
            gate: WeightMat::new(d, i, h, &self.bytes[0]).unwrap(),
            up: WeightMat::new(d, i, h, &self.bytes[1]).unwrap(),
            down: WeightMat::new(d, h, i, &self.bytes[2]).unwrap(),
        }
    }
}

/// The error bound stated at the top of this file for one token, per output element.
fn bound(x: &[f32], experts: &[Expert<'_>], ids: &[u32], weights: &[f32]) -> Vec<f64> {
    let u = 2f64.powi(-24);
    let hidden = x.len();
    let k = ids.len();
    let mut out = vec![0f64; hidden];
    for (&e, &w) in ids.iter().zip(weights) {
        let ex = &experts[e as usize];
        let inter = ex.gate.rows;
        let g1 = (hidden as f64 / 16.0 + 6.0) * u;
        let g2 = (inter as f64 / 16.0 + 6.0) * u;
        let mut eh = vec![0f64; inter];
        let mut h = vec![0f64; inter];
        for i in 0..inter {
            let (mut g, mut gu, mut uu, mut ua) = (0f64, 0f64, 0f64, 0f64);
            for (c, &xc) in x.iter().enumerate() {
                let (wg, wu) = (weight_at(&ex.gate, i, c) as f64, weight_at(&ex.up, i, c) as f64);
                g += xc as f64 * wg;
                gu += (xc as f64 * wg).abs();
                uu += xc as f64 * wu;
                ua += (xc as f64 * wu).abs();
            }
            let s = g / (1.0 + (-g).exp());
            h[i] = s * uu;
            eh[i] = 1.1 * g1 * gu * uu.abs() + s.abs() * g1 * ua + 4.0 * u * h[i].abs();
        }
        for (j, o) in out.iter_mut().enumerate() {
            let (mut prop, mut mag) = (0f64, 0f64);
            for i in 0..inter {
                let wd = (weight_at(&ex.down, j, i) as f64).abs();
                prop += wd * eh[i];
                mag += wd * h[i].abs();
            }
            *o += w as f64 * (prop + g2 * mag) + (k as f64 + 1.0) * u * w as f64 * mag;
        }
    }
    out
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

#[test]
fn moe_ffn_matches_naive_reference_and_is_batch_invariant() {
    let mut rng = StdRng::seed_from_u64(11);
    let (hidden, inter, n_exp) = (72, 40, 6);
    for (dtype, k, tokens) in [(DType::BF16, 2, 21), (DType::F32, 1, 9), (DType::F16, 3, 17)] {
        let owned: Vec<OwnedExpert> = (0..n_exp).map(|_| OwnedExpert::random(&mut rng, dtype, hidden, inter)).collect();
        let experts: Vec<Expert<'_>> = owned.iter().map(|o| o.view()).collect();
        let x: Vec<f32> = (0..tokens * hidden).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        // Router logits avoid expert 5 entirely: an expert with no tokens must be skipped.
        let logits: Vec<f32> =
            (0..tokens * n_exp).map(|i| if i % n_exp == 5 { -100.0 } else { rng.random_range(-2.0f32..2.0) }).collect();
        let (ids, w) = moe::route_topk(&logits, n_exp, k, true);
        assert!(!ids.contains(&5));
        let mut out = vec![f32::NAN; tokens * hidden];
        moe::moe_ffn(&x, tokens, &experts, &ids, &w, k, &mut out, &Default::default());
        for t in 0..tokens {
            let (xt, it, wt) = (&x[t * hidden..(t + 1) * hidden], &ids[t * k..(t + 1) * k], &w[t * k..(t + 1) * k]);
            let want = moe::reference::moe_token(xt, &experts, it, wt);
            let tol = bound(xt, &experts, it, wt);
            for j in 0..hidden {
                let got = out[t * hidden + j] as f64;
                assert!(
                    (got - want[j]).abs() <= 2.0 * tol[j],
                    "{dtype} k={k} token {t} [{j}]: {got} vs {}, bound {}",
                    want[j],
                    2.0 * tol[j]
                );
            }
            // The same token alone (its experts see one row) and under other pools: same bits.
            for threads in [1, 2, 3] {
                let mut alone = vec![0f32; hidden];
                pool(threads).install(|| moe::moe_ffn(xt, 1, &experts, it, wt, k, &mut alone, &Default::default()));
                let same = alone.iter().zip(&out[t * hidden..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype} k={k}: token {t} alone on {threads} threads differs from the batch");
            }
        }
    }
}

#[test]
#[should_panic(expected = "routes to expert 7 of 2")]
fn moe_ffn_rejects_unknown_expert() {
    let mut rng = StdRng::seed_from_u64(12);
    let owned: Vec<OwnedExpert> = (0..2).map(|_| OwnedExpert::random(&mut rng, DType::F32, 4, 3)).collect();
    let experts: Vec<Expert<'_>> = owned.iter().map(|o| o.view()).collect();
    let mut out = [0f32; 4];
    moe::moe_ffn(&[0.0; 4], 1, &experts, &[7], &[1.0], 1, &mut out, &Default::default());
}
