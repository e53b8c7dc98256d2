//! RoPE: the cos/sin tables (plain and llama3-scaled frequencies) and the rotation.

use tboost_engine::backend::{Op, OpQuery, StepHost};
use tboost_ops::{Llama3Scaling, RopeParams, RopeScaling, RopeStyle, YarnScaling};
use tboost_testkit::golden::Rng;

use super::measure::Measured;
use super::numbers::{round_to, tiny_act, u_act, U};
use super::suite::{empty_host, Suite};

/// Inverse frequencies written from transformers' `_compute_llama3_parameters` (and the
/// plain `theta^(-2i/dim)`), independently of `RopeParams::inv_freq`.
fn inv_freq_ref(p: &RopeParams) -> Vec<f64> {
    (0..p.dim / 2)
        .map(|i| {
            let inv = 1.0 / p.theta.powf((2 * i) as f64 / p.dim as f64);
            let s = match p.scaling {
                None | Some(RopeScaling::LongRope { .. }) => return inv,
                Some(RopeScaling::Linear { factor }) => return inv / factor,
                Some(RopeScaling::Yarn(y)) => return yarn_ref(inv, i, p.dim, p.theta, &y),
                Some(RopeScaling::Llama3(s)) => s,
            };
            let (low_wl, high_wl) = (
                s.original_max_position_embeddings / s.low_freq_factor,
                s.original_max_position_embeddings / s.high_freq_factor,
            );
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            let scaled = if wavelen > low_wl { inv / s.factor } else { inv };
            if wavelen < high_wl || wavelen > low_wl {
                scaled
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            }
        })
        .collect()
}

/// YaRN's inverse frequency `i` as `_compute_yarn_parameters` writes it: extrapolated below the
/// correction range, interpolated (÷ factor) above it, a linear ramp in between.
fn yarn_ref(inv: f64, i: usize, dim: usize, base: f64, y: &YarnScaling) -> f64 {
    let corr = |rot: f64| {
        (dim as f64 * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    let extrapolation = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
    (inv / y.factor) * (1.0 - extrapolation) + inv * extrapolation
}

/// The tables take no random values (`_rng` keeps the suite's signature).
pub fn rope_tables(s: &mut Suite<'_>, _rng: &mut Rng) {
    const TOL: &str = "max(2⁻²⁵, 2⁻²⁴·|want|) + 2⁻³²·attention factor: the tables are f32 roundings of f64 \
                       cos/sin (½ ulp: 2⁻²⁵ for values ≤ 1, 2⁻²⁴·|want| for YaRN's scaled values above 1), \
                       with room for f64 angle rounding; tables in a 16-bit activation dtype (as the runner \
                       allocates them): + u·|want| + half the smallest f16 subnormal";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let llama3 = |factor| Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let params = [
        ("theta 1e4, dim 64", RopeParams { dim: 64, theta: 1e4, scaling: None, style: RopeStyle::HalfSplit }),
        ("theta 1e6, dim 128", RopeParams { dim: 128, theta: 1e6, scaling: None, style: RopeStyle::HalfSplit }),
        ("theta 1e4, dim 32 (partial)", RopeParams { dim: 32, theta: 1e4, scaling: None, style: RopeStyle::Adjacent }),
        (
            "llama3 factor 8, theta 5e5, dim 128",
            RopeParams {
                dim: 128,
                theta: 5e5,
                scaling: Some(RopeScaling::Llama3(llama3(8.0))),
                style: RopeStyle::HalfSplit,
            },
        ),
        (
            "llama3 factor 32, theta 5e5, dim 64",
            RopeParams {
                dim: 64,
                theta: 5e5,
                scaling: Some(RopeScaling::Llama3(llama3(32.0))),
                style: RopeStyle::HalfSplit,
            },
        ),
        (
            "linear factor 2.5, theta 1e4, dim 64",
            RopeParams {
                dim: 64,
                theta: 1e4,
                scaling: Some(RopeScaling::Linear { factor: 2.5 }),
                style: RopeStyle::HalfSplit,
            },
        ),
        (
            "yarn factor 4 (original 4096, attention factor 1.1386), theta 1e6, dim 128",
            RopeParams { dim: 128, theta: 1e6, scaling: Some(yarn(4.0, 4096.0)), style: RopeStyle::HalfSplit },
        ),
    ];
    let positions: Vec<u32> = vec![0, 1, 2, 17, 4095, 8191, 8192, 30_000, 131_071, 1_000_000];
    rope_table_cases(s, &params, None, &positions, TOL, ua, tiny);
}

fn yarn(factor: f64, orig: f64) -> RopeScaling {
    RopeScaling::Yarn(YarnScaling {
        factor,
        original_max_position_embeddings: orig,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 0.1 * factor.ln() + 1.0,
        truncate: true,
    })
}

/// LongRoPE's tables: each frequency divided by its factor (a weight), both tables times the
/// attention factor.
pub fn rope_tables_scaled(s: &mut Suite<'_>, _rng: &mut Rng) {
    const TOL: &str = "max(2⁻²⁵, 2⁻²⁴·|want|) + 2⁻³²·attention factor: f32 roundings (½ ulp) of the f64 tables, \
                       whose values reach the attention factor (> 1); 16-bit activations: + u·|want| + half the \
                       smallest f16 subnormal";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let att = (1.0 + (256f64 / 32.0).ln() / 32f64.ln()).sqrt();
    let longrope = RopeScaling::LongRope { original_max_position_embeddings: 32.0, attention_factor: att };
    let factors: Vec<f32> = (0..16).map(|i| 1.0 + 0.7 * i as f32).collect();
    let params = [(
        "longrope, theta 1e4, dim 32, attention factor 1.2649",
        RopeParams { dim: 32, theta: 1e4, scaling: Some(longrope), style: RopeStyle::HalfSplit },
    )];
    let positions: Vec<u32> = vec![0, 1, 5, 31, 32, 33, 200, 4095];
    rope_table_cases(s, &params, Some(&factors), &positions, TOL, ua, tiny);
}

/// One case per `params`: the tables of `positions` against the independent reference.
fn rope_table_cases(
    s: &mut Suite<'_>,
    params: &[(&str, RopeParams)],
    factors: Option<&[f32]>,
    positions: &[u32],
    tol_text: &'static str,
    ua: f64,
    tiny: f64,
) {
    let act = s.act;
    for &(label, rope) in params {
        let q = [OpQuery::RopeTables { rope }];
        let (name, variant) = if factors.is_some() { ("rope_tables_scaled", 20) } else { ("rope_tables", 7) };
        s.case(name, tol_text, format!("{label}, positions {positions:?}"), &q, &[variant], |d| {
            let mut inv = inv_freq_ref(&rope);
            if let Some(f) = factors {
                for (v, &e) in inv.iter_mut().zip(f) {
                    *v /= e as f64;
                }
            }
            let att = match rope.scaling {
                Some(RopeScaling::Yarn(y)) => y.attention_factor,
                Some(RopeScaling::LongRope { attention_factor, .. }) => attention_factor,
                _ => 1.0,
            };
            let half = rope.dim / 2;
            let mut m = Measured::default();
            // The vocabulary's definition must agree with transformers' formula (in f64).
            let def = rope.inv_freq_with(factors);
            let worst = def.iter().zip(&inv).map(|(a, b)| ((a - b) / b).abs()).fold(0f64, f64::max);
            if def.len() != inv.len() || worst > 1e-12 {
                return Err(format!("RopeParams::inv_freq differs from the reference by {worst:e} relative"));
            }
            let sv = d.step(&StepHost { positions, ..empty_host() }, 0)?;
            let n = positions.len() * half;
            let (cos, sin) = (d.alloc(act, n)?, d.alloc(act, n)?);
            match factors {
                Some(f) => {
                    let w = d.vector("factors", tboost_ops::DType::F32, f)?;
                    d.launch(Op::RopeTablesScaled { positions: sv.positions, rope, factors: w, cos, sin })?
                }
                None => d.launch(Op::RopeTables { positions: sv.positions, rope, cos, sin })?,
            }
            d.sync()?;
            let (gc, gs) = (d.read_act(cos)?, d.read_act(sin)?);
            let (mut wc, mut ws) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for &p in positions {
                for &f in &inv {
                    let (sn, cs) = (p as f64 * f).sin_cos();
                    wc.push(cs * att);
                    ws.push(sn * att);
                }
            }
            // ½ ulp of the f32 value: 2⁻²⁵ below 1, 2⁻²⁴·|want| for the scaled values in [1, 2).
            let tol =
                |w: f64| 2f64.powi(-25).max(2f64.powi(-24) * w.abs()) + 2f64.powi(-32) * att + tiny + ua * w.abs();
            m.close("cos", &gc, &wc, |i| tol(wc[i]))?;
            m.close("sin", &gs, &ws, |i| tol(ws[i]))?;
            Ok(m)
        });
    }
}

pub fn rope(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "3·2⁻²⁴·(|x0·c| + |x1·s|) per rotated value (two f32 products and a sum, \
                       against the same f32 tables); pass-through dims and the margins exact. 16-bit \
                       activations (x and the tables rounded): + u·|want| for the rounded output";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let positions: [u32; 5] = [0, 1, 100, 8191, 30_000];
    let shapes: [(usize, usize, usize); 6] =
        [(1, 64, 64), (8, 64, 64), (8, 128, 128), (8, 64, 32), (1, 24, 16), (8, 80, 32)];
    for style in [RopeStyle::HalfSplit, RopeStyle::Adjacent] {
        for (heads, hd, rot) in shapes {
            let rows = positions.len();
            let x = round_to(act, &rng.vec(rows * heads * hd, 2.0));
            let inv = inv_freq_ref(&RopeParams { dim: rot, theta: 1e4, scaling: None, style });
            let half = rot / 2;
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for &p in &positions {
                for &f in &inv {
                    let (sn, cs) = (p as f64 * f).sin_cos();
                    cos.push(cs as f32);
                    sin.push(sn as f32);
                }
            }
            let (cos, sin) = (round_to(act, &cos), round_to(act, &sin));
            let q = [OpQuery::Rope { head_dim: hd, rot_dim: rot, style, act }];
            let name = format!("{style:?} heads {heads} head_dim {hd} rot_dim {rot}, positions {positions:?}");
            s.case("rope", TOL, name, &q, &[8], |d| {
                let pad = 3;
                let mut buf = vec![5.0f32; pad];
                buf.extend(&x);
                buf.extend([5.0f32; 3]);
                let xb = d.acts(act, &buf)?;
                let (cv, sv) = (d.acts(act, &cos)?, d.acts(act, &sin)?);
                d.launch(Op::Rope { x: xb.sub(pad, x.len()), heads, head_dim: hd, cos: cv, sin: sv, style })?;
                d.sync()?;
                let got = d.read_act(xb)?;
                let mut want: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
                let mut bound = vec![0f64; buf.len()];
                for r in 0..rows {
                    for h in 0..heads {
                        let o = pad + (r * heads + h) * hd;
                        for i in 0..half {
                            let (i0, i1) = match style {
                                RopeStyle::HalfSplit => (i, i + half),
                                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                            };
                            let (x0, x1) = (buf[o + i0] as f64, buf[o + i1] as f64);
                            let (c, sn) = (cos[r * half + i] as f64, sin[r * half + i] as f64);
                            want[o + i0] = x0 * c - x1 * sn;
                            want[o + i1] = x0 * sn + x1 * c;
                            bound[o + i0] =
                                3.0 * U * ((x0 * c).abs() + (x1 * sn).abs()) + ua * want[o + i0].abs() + tiny;
                            bound[o + i1] =
                                3.0 * U * ((x0 * sn).abs() + (x1 * c).abs()) + ua * want[o + i1].abs() + tiny;
                        }
                    }
                }
                let mut m = Measured::default();
                m.close("x (with margins)", &got, &want, |i| bound[i])?;
                Ok(m)
            });
        }
    }
}
