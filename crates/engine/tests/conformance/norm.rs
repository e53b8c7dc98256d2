//! The residual stream's ops: RMSNorm, RMSNorm fused with the residual add, and the add.

use tboost_engine::backend::{DType, Op, OpQuery};
use tboost_testkit::golden::Rng;

use super::measure::Measured;
use super::numbers::{round_to, tiny_act, u_act, U};
use super::suite::Suite;

/// Rows of `n` values for a norm: random, small (where eps matters), and all zero.
fn norm_rows(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = rng.vec(n, 2.0);
    x.extend(rng.vec(n, 1e-3));
    x.extend(vec![0.0; n]);
    x
}

/// f64 RMSNorm of each row of `w.len()` values with the bound (n/2 + 4)·2⁻²⁴·|want|: the f32
/// sum of n squares is within n·2⁻²⁴ relative, the inverse square root halves that, and
/// rounding it and the two products add 3·2⁻²⁴.
fn rmsnorm_ref(x: &[f32], w: &[f32], eps: f32) -> (Vec<f64>, Vec<f64>) {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * inv * g as f64));
    }
    let bound = out.iter().map(|y| (n as f64 / 2.0 + 4.0) * U * y.abs()).collect();
    (out, bound)
}

const TOL_NORM: &str = "(n/2 + 4)·2⁻²⁴·|want|: f32 sum of n squares (n·2⁻²⁴ rel), halved by the rsqrt, \
                        plus 3 roundings; the residual of add_rmsnorm is one f32 add, exact. 16-bit \
                        activations: + u·|want| for the output (add_rmsnorm: 2u·|want|, the norm may read the \
                        rounded sum), the residual exact against the rounded sum";

pub fn rmsnorm(s: &mut Suite<'_>, rng: &mut Rng) {
    norms(s, rng, false);
}

pub fn add_rmsnorm(s: &mut Suite<'_>, rng: &mut Rng) {
    norms(s, rng, true);
}

/// RMSNorm cases over gain dtypes, widths and eps; `fused_add`: with the residual add first.
fn norms(s: &mut Suite<'_>, rng: &mut Rng, fused_add: bool) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for gain in [DType::F32, DType::F16, DType::BF16] {
        // 100: a row that is not a whole number of SIMD vectors.
        for n in [64, 100, 896] {
            for eps in [1e-5f32, 1e-6] {
                let x = round_to(act, &norm_rows(rng, n));
                let w = round_to(gain, &(0..n).map(|_| 1.0 + 0.5 * rng.unit()).collect::<Vec<_>>());
                let name = format!("gain {gain}, hidden {n}, eps {eps:e}, rows: random, small, zero");
                if !fused_add {
                    let q = [OpQuery::RmsNorm { gain, act, fused_add: false }];
                    s.case("rmsnorm", TOL_NORM, name.clone(), &q, &[1], |d| {
                        let wid = d.vector("norm", gain, &w)?;
                        let (xv, out) = (d.acts(act, &x)?, d.alloc(act, x.len())?);
                        d.launch(Op::RmsNorm { x: xv, w: wid, eps, out })?;
                        d.sync()?;
                        let got = d.read_act(out)?;
                        let (want, bound) = rmsnorm_ref(&x, &w, eps);
                        let mut m = Measured::default();
                        m.close("out", &got, &want, |i| bound[i] + ua * want[i].abs() + tiny)?;
                        Ok(m)
                    });
                    continue;
                }
                let res = round_to(act, &norm_rows(rng, n));
                let q = [OpQuery::RmsNorm { gain, act, fused_add: true }];
                s.case("add_rmsnorm", TOL_NORM, name, &q, &[2], |d| {
                    let wid = d.vector("norm", gain, &w)?;
                    let (r, xv, out) = (d.acts(act, &res)?, d.acts(act, &x)?, d.alloc(act, x.len())?);
                    d.launch(Op::AddRmsNorm { residual: r, x: xv, w: wid, eps, out })?;
                    d.sync()?;
                    let (got_r, got) = (d.read_act(r)?, d.read_act(out)?);
                    let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| a + b).collect();
                    let (want, bound) = rmsnorm_ref(&sum, &w, eps);
                    let mut m = Measured::default();
                    m.exact("residual", &got_r, &round_to(act, &sum))?;
                    m.close("out", &got, &want, |i| bound[i] + 2.0 * ua * want[i].abs() + tiny)?;
                    Ok(m)
                });
            }
        }
    }
}

/// Values whose sums are edge cases: signed zeros, subnormals, infinities, a rounding tie.
fn edge_values() -> Vec<f32> {
    vec![0.0, -0.0, 1e-40, -1e-40, f32::MAX, f32::MIN_POSITIVE, 1.0, 1.0 + f32::EPSILON, f32::INFINITY, 3.0]
}

pub fn add(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "exact: one f32 addition per element is correctly rounded (16-bit activations: the f32 \
                       sum of the rounded inputs, rounded once more)";
    let act = s.act;
    for n in [1usize, 37, 4096, 70_000] {
        let mut a = rng.vec(n, 10.0);
        let mut b = rng.vec(n, 10.0);
        if n >= 10 {
            a[..10].copy_from_slice(&edge_values());
            b[..10].copy_from_slice(&[
                -0.0,
                -0.0,
                1e-40,
                1e-40,
                f32::MAX,
                -f32::MIN_POSITIVE,
                1.0,
                f32::EPSILON / 2.0,
                1.0,
                0.1,
            ]);
        }
        let (a, b) = (round_to(act, &a), round_to(act, &b));
        // dst and src at offsets inside larger buffers, as the runner's views are.
        let q = [OpQuery::Add { act }];
        s.case("add", TOL, format!("{n} values at offsets 3 / 5, edge values"), &q, &[3], |d| {
            let mut da = vec![7.0f32; 3];
            da.extend(&a);
            da.extend([7.0; 4]);
            let mut sb = vec![9.0f32; 5];
            sb.extend(&b);
            let (dv, sv) = (d.acts(act, &da)?, d.acts(act, &sb)?);
            let (dst, src) = (dv.sub(3, n), sv.sub(5, n));
            d.launch(Op::Add { dst, src })?;
            d.sync()?;
            let got = d.read_act(dv)?;
            let mut want = da.clone();
            for i in 0..n {
                want[3 + i] = round_to(act, &[a[i] + b[i]])[0];
            }
            let mut m = Measured::default();
            m.exact("dst (with the untouched margins)", &got, &want)?;
            Ok(m)
        });
    }
}
