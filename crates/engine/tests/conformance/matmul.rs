//! Matmuls (one projection per weight dtype, fast precision, fused QKV), the fused gate/up
//! matmul with SwiGLU, and SwiGLU alone.

use tboost_engine::backend::{DType, MatSegOp, Op, OpQuery, Segs};
use tboost_ops::Precision;
use tboost_testkit::golden::Rng;

use super::measure::{Measured, R};
use super::numbers::{matmul_ref, round_to, silu, swiglu_ref, tiny_act, u_act, Mat, MIN_NORMAL, U, WEIGHT_TYPES};
use super::suite::{Dev, Suite};

const TOL_MATMUL: &str = "(k + 4)·2⁻²⁴·(Σ|x·w| + |b|) per output: an f32 dot product over k terms in any order, \
                          plus the bias add; weights as stored (ggml dequantization). 16-bit activations \
                          (x rounded first): + 2u·(|want| + |b|) for the rounded product, the bias rounded to \
                          the activation dtype and the rounded sum; a block-type weight with 16-bit activations: \
                          + u·Σ|x·w| for the weight dequantized in the activation dtype (A16W8/A16W4 kernels: \
                          Ascend's aclnnWeightQuantBatchMatmulV2 computes (w + offset)·scale in x's dtype)";

/// `u·Σ_t |x[r, t]·w[j, t]|` per output `[m, rows]` for a block-type weight met by 16-bit activations
/// (zero otherwise): what dequantizing each weight to the activation dtype may move the output by.
fn dequant_rounding(act: DType, x: &[f32], m: usize, w: &Mat) -> Vec<f64> {
    let (n, k, ua) = (w.rows, w.cols, u_act(act));
    if !w.dtype.is_quantized() || ua == 0.0 {
        return vec![0.0; m * n];
    }
    let mut e = vec![0.0; m * n];
    for r in 0..m {
        for j in 0..n {
            e[r * n + j] = ua * (0..k).map(|t| (x[r * k + t] as f64 * w.vals[j * k + t] as f64).abs()).sum::<f64>();
        }
    }
    e
}

/// One projection of a (possibly fused) matmul case.
struct Seg {
    w: Mat,
    bias: Option<(DType, Vec<f32>)>,
}

fn seg(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, bias: Option<DType>) -> Seg {
    let w = Mat::random(rng, dtype, rows, cols, 1.0);
    let bias = bias.map(|bd| (bd, round_to(bd, &rng.vec(rows, 0.5))));
    Seg { w, bias }
}

/// Runs `segs` as one `Op::MatMul` on `x` (`[m, k]`, in `act`) and checks every output.
fn run_matmul(d: &mut Dev<'_>, act: DType, x: &[f32], m: usize, segs: &[Seg], precision: Precision) -> R<Measured> {
    let x = &round_to(act, x)[..];
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let mut ops = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        let w = d.mat(&format!("w{i}"), &s.w)?;
        let bias = match &s.bias {
            Some((bd, b)) => Some(d.vector(&format!("b{i}"), *bd, b)?),
            None => None,
        };
        ops.push(MatSegOp { w, bias, out: d.alloc(act, m * s.w.rows)? });
    }
    let xv = d.acts(act, x)?;
    d.launch(Op::MatMul { x: xv, m, segs: Segs::from_slice(&ops), precision, tiling: Default::default() })?;
    d.sync()?;
    let mut meas = Measured::default();
    for (i, (s, o)) in segs.iter().zip(&ops).enumerate() {
        let got = d.read_act(o.out)?;
        let (want, mut bound) = matmul_ref(x, m, &s.w, s.bias.as_ref().map(|b| b.1.as_slice()));
        let n = s.w.rows;
        let dq = dequant_rounding(act, x, m, &s.w);
        for (j, b) in bound.iter_mut().enumerate() {
            let bias = s.bias.as_ref().map_or(0.0, |bs| bs.1[j % n].abs() as f64);
            *b += 2.0 * ua * (want[j].abs() + bias) + tiny + dq[j];
        }
        if precision == Precision::Fast {
            // Fast may quantize x to 8 bits per 32-value block: each x moves by up to
            // amax(block)/127, which the weights carry into the output.
            let (n, k) = (s.w.rows, s.w.cols);
            for r in 0..m {
                for j in 0..n {
                    let e: f64 = (0..k)
                        .map(|c| {
                            let blk = &x[r * k + c / 32 * 32..r * k + (c / 32 * 32 + 32).min(k)];
                            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                            (s.w.vals[j * k + c] as f64).abs() * amax / 127.0
                        })
                        .sum();
                    bound[r * n + j] += e;
                }
            }
        }
        meas.close(&format!("segment {i} out"), &got, &want, |i| bound[i])?;
    }
    Ok(meas)
}

macro_rules! by_weight {
    ($($name:ident: $dtype:expr,)*) => {
        $(pub fn $name(s: &mut Suite<'_>, rng: &mut Rng) {
            matmul(s, rng, $dtype);
        })*
    };
}

by_weight! {
    f32: DType::F32,
    f16: DType::F16,
    bf16: DType::BF16,
    q4_0: DType::Q4_0,
    q4_1: DType::Q4_1,
    q5_0: DType::Q5_0,
    q5_1: DType::Q5_1,
    q8_0: DType::Q8_0,
    iq4_nl: DType::IQ4NL,
    iq4_xs: DType::IQ4XS,
    q2_k: DType::Q2K,
    q3_k: DType::Q3K,
    q4_k: DType::Q4K,
    q5_k: DType::Q5K,
    q6_k: DType::Q6K,
}

/// One projection with `dtype` weights: every k/m/bias combination, narrow outputs and wide
/// weights (for the dtypes those tables list).
fn matmul(s: &mut Suite<'_>, rng: &mut Rng, dtype: DType) {
    let act = s.act;
    let ks: [usize; 2] = match dtype.block_elems() {
        // 72: a tail that is not a whole 16-lane chunk.
        1 => [72, 256],
        // 96: three blocks, not a whole number of 64-value steps.
        32 => [96, 256],
        _ => [256, 512],
    };
    for k in ks {
        for m in [1usize, 3, 17, 64] {
            for bias in [false, true] {
                let sg = seg(rng, dtype, 37, k, bias.then_some(DType::F32));
                let x = rng.vec(m * k, 1.0);
                let name = format!("{dtype} m={m} k={k} n=37{}", if bias { " +bias" } else { "" });
                let q = [OpQuery::MatMul(sg.w.case(act))];
                s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| run_matmul(d, act, &x, m, &[sg], Precision::Exact));
            }
        }
    }
    // Narrow outputs: a single row (n = 1) and fewer rows than any register tile.
    if [DType::F32, DType::BF16, DType::Q8_0, DType::Q4K].contains(&dtype) {
        for n in [1usize, 5] {
            for m in [1usize, 17] {
                let sg = seg(rng, dtype, n, 256, Some(DType::F32));
                let x = rng.vec(m * 256, 1.0);
                let q = [OpQuery::MatMul(sg.w.case(act))];
                let name = format!("{dtype} m={m} k=256 n={n} +bias");
                s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| run_matmul(d, act, &x, m, &[sg], Precision::Exact));
            }
        }
    }
    // Wide weights: work split over many rows (several tasks per thread).
    if [DType::F16, DType::BF16, DType::Q8_0, DType::Q4K, DType::Q6K].contains(&dtype) {
        for m in [1usize, 64] {
            let sg = seg(rng, dtype, 1000, 512, None);
            let x = rng.vec(m * 512, 1.0);
            let q = [OpQuery::MatMul(sg.w.case(act))];
            let name = format!("{dtype} m={m} k=512 n=1000");
            s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| run_matmul(d, act, &x, m, &[sg], Precision::Exact));
        }
    }
}

/// Fast precision (8-bit activations), as `--precision fast` asks.
pub fn fast_precision(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let sg = seg(rng, DType::Q8_0, 37, 256, None);
    let x = rng.vec(3 * 256, 1.0);
    let mut case = sg.w.case(act);
    case.precision = Precision::Fast;
    let q = [OpQuery::MatMul(case)];
    let tol = "as exact, plus Σ|w|·amax(x block)/127 for 8-bit activations";
    s.case("matmul (fast precision)", tol, "q8_0 m=3 k=256 n=37".into(), &q, &[4], |d| {
        run_matmul(d, act, &x, 3, &[sg], Precision::Fast)
    });
}

/// Fused QKV: three segments sharing x, GQA widths (8 query heads, 2 kv heads of 8).
pub fn fused_qkv(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let fused: [(&str, [DType; 3], bool); 7] = [
        ("f32", [DType::F32; 3], true),
        ("bf16", [DType::BF16; 3], true),
        ("f16", [DType::F16; 3], false),
        ("q8_0", [DType::Q8_0; 3], true),
        ("q4_k", [DType::Q4K; 3], false),
        // Q4_K_M files keep some V projections in Q6_K.
        ("q4_k/q4_k/q6_k", [DType::Q4K, DType::Q4K, DType::Q6K], true),
        // A projection mixing dense and block-quantized matrices.
        ("f16/q8_0/q4_0", [DType::F16, DType::Q8_0, DType::Q4_0], false),
    ];
    for (label, dts, bias) in fused {
        for m in [1usize, 3, 17, 64] {
            let k = 256;
            let segs: Vec<Seg> = dts
                .iter()
                .zip([64, 16, 16])
                .map(|(&dt, rows)| seg(rng, dt, rows, k, bias.then_some(DType::BF16)))
                .collect();
            let x = rng.vec(m * k, 1.0);
            let cases = [Some(segs[0].w.case(act)), Some(segs[1].w.case(act)), Some(segs[2].w.case(act))];
            let q = [OpQuery::MatMulFused { cases }];
            let name = format!("qkv {label} m={m} k={k} n=64+16+16{}", if bias { " +bf16 bias" } else { "" });
            s.case("matmul (fused qkv)", TOL_MATMUL, name, &q, &[4], |d| {
                run_matmul(d, act, &x, m, &segs, Precision::Exact)
            });
        }
    }
}

const TOL_SWIGLU_MM: &str =
    "gate/up bounds as matmul (with its dequantization term), carried through |silu'| ≤ 1.1 and |silu(g)|, \
                             plus 8·2⁻²⁴ relative for the f32 silu and product. 16-bit activations: gate and \
                             up rounded (u·|g|, u·|u| carried the same way) and the output rounded (u·|want|)";

pub fn matmul_swiglu(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for dtype in WEIGHT_TYPES {
        for m in [1usize, 3, 17] {
            let k = 256;
            let (g, u) = (Mat::random(rng, dtype, 37, k, 1.0), Mat::random(rng, dtype, 37, k, 1.0));
            let x = round_to(act, &rng.vec(m * k, 1.0));
            let q = [OpQuery::MatMulSwiGlu { gate: g.case(act), up: u.case(act) }];
            s.case("matmul_swiglu", TOL_SWIGLU_MM, format!("{dtype} m={m} k={k} n=37"), &q, &[5], |d| {
                let (gw, uw) = (d.mat("gate", &g)?, d.mat("up", &u)?);
                let (xv, out) = (d.acts(act, &x)?, d.alloc(act, m * 37)?);
                let (precision, tiling) = (Precision::Exact, Default::default());
                d.launch(Op::MatMulSwiGlu { x: xv, m, gate: gw, up: uw, out, precision, tiling })?;
                d.sync()?;
                let got = d.read_act(out)?;
                let ((gr, mut eg), (ur, mut eu)) = (matmul_ref(&x, m, &g, None), matmul_ref(&x, m, &u, None));
                let (dg, du) = (dequant_rounding(act, &x, m, &g), dequant_rounding(act, &x, m, &u));
                for i in 0..gr.len() {
                    eg[i] += ua * gr[i].abs() + dg[i];
                    eu[i] += ua * ur[i].abs() + du[i];
                }
                let (want, bound) = swiglu_ref(&gr, &eg, &ur, &eu);
                let mut meas = Measured::default();
                meas.close("out", &got, &want, |i| bound[i] + ua * want[i].abs() + tiny)?;
                Ok(meas)
            });
        }
    }
}

pub fn swiglu(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "8·2⁻²⁴·|want| + 2⁻¹²⁶·(|up| + 1): f32 exp, add, divide and multiply; \
                       results below the normal range are subnormal. 16-bit activations (inputs rounded): \
                       + u·|want| + half the smallest f16 subnormal for the rounded output";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for n in [5usize, 4099, 40_000] {
        let mut g = rng.vec(n, 8.0);
        let u = round_to(act, &rng.vec(n, 4.0));
        let edges = [0.0, -0.0, 50.0, -30.0, -88.0, -100.0, 1e-30, 20.0];
        for (i, e) in edges.iter().enumerate().take(n) {
            g[i] = *e;
        }
        let g = round_to(act, &g);
        let q = [OpQuery::SwiGlu { act }];
        s.case("swiglu", TOL, format!("{n} values, gate edges {edges:?}"), &q, &[6], |d| {
            let (gv, uv, out) = (d.acts(act, &g)?, d.acts(act, &u)?, d.alloc(act, n)?);
            d.launch(Op::SwiGlu { gate: gv, up: uv, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let want: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g as f64) * u as f64).collect();
            let mut m = Measured::default();
            m.close("out", &got, &want, |i| {
                8.0 * U * want[i].abs() + MIN_NORMAL * (u[i].abs() as f64 + 1.0) + ua * want[i].abs() + tiny
            })?;
            Ok(m)
        });
    }
}

/// GeGLU (Gemma's MLP): `gelu_tanh(gate) * up` against the f64 formula.
pub fn geglu(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "2⁻¹⁹·(|want| + |up|): f32 tanh (a few ulp), products and sums; 16-bit activations \
                       (inputs rounded): + u·|want| + half the smallest f16 subnormal";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for n in [5usize, 4099, 40_000] {
        let mut g = rng.vec(n, 8.0);
        let u = round_to(act, &rng.vec(n, 4.0));
        let edges = [0.0, -0.0, 50.0, -30.0, 1e-30, 3.0, -3.0, 20.0];
        for (i, e) in edges.iter().enumerate().take(n) {
            g[i] = *e;
        }
        let g = round_to(act, &g);
        let q = [OpQuery::GeGlu { act }];
        s.case("geglu", TOL, format!("{n} values, gate edges {edges:?}"), &q, &[18], |d| {
            let (gv, uv, out) = (d.acts(act, &g)?, d.acts(act, &u)?, d.alloc(act, n)?);
            d.launch(Op::GeGlu { gate: gv, up: uv, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let want: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| {
                    let g = g as f64;
                    0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u as f64
                })
                .collect();
            let mut m = Measured::default();
            m.close("out", &got, &want, |i| {
                2f64.powi(-19) * (want[i].abs() + u[i].abs() as f64) + ua * want[i].abs() + tiny
            })?;
            Ok(m)
        });
    }
}

/// `x *= s` (Gemma's embedding scale): one rounding of the product.
pub fn scale(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "½ ulp of the f32 product; 16-bit activations: + u·|want|";
    let act = s.act;
    let ua = u_act(act);
    for (n, k) in [(7usize, 11.313_708_f32), (4096, 0.5), (33_000, 33.941_124)] {
        let x = round_to(act, &rng.vec(n, 3.0));
        let q = [OpQuery::Scale { act }];
        s.case("scale", TOL, format!("{n} values times {k}"), &q, &[19], |d| {
            let xv = d.acts(act, &x)?;
            d.launch(Op::Scale { x: xv, s: k })?;
            d.sync()?;
            let got = d.read_act(xv)?;
            let want: Vec<f64> = x.iter().map(|&v| v as f64 * k as f64).collect();
            let mut m = Measured::default();
            m.close("x", &got, &want, |i| 2f64.powi(-24) * want[i].abs() + ua * want[i].abs())?;
            Ok(m)
        });
    }
}
