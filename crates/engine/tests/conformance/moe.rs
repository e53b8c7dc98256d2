//! Mixture of experts: routing, the grouped experts, the per-expert path (which must give the
//! grouped path's bits), and its scatter and combine ops.

use tboost_engine::backend::{DType, ExpertSet, MatSegOp, Op, OpQuery, Segs};
use tboost_ops::Precision;
use tboost_testkit::golden::Rng;

use super::measure::{Measured, EXACT_COPY, R};
use super::numbers::{mlp_ref, round_to, tiny_act, u_act, Mat, MIN_NORMAL, U};
use super::suite::{Dev, Suite};

/// Router top-k in f64: softmax, the k largest (ties: lower expert first), renormalized.
fn route_ref(logits: &[f32], experts: usize, k: usize) -> (Vec<u32>, Vec<f64>) {
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks(experts) {
        let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let p: Vec<f64> = row.iter().map(|&l| (l as f64 - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top: f64 = order[..k].iter().map(|&e| p[e] / sum).sum();
        for &e in &order[..k] {
            ids.push(e as u32);
            ws.push(p[e] / sum / top);
        }
    }
    (ids, ws)
}

pub fn moe_route(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "ids exact (ties: lower expert first); weights (2E + k + 8)·2⁻²⁴·|w|: f32 softmax over E \
                       experts and the renormalization over k; logits and weights in a 16-bit activation \
                       dtype (the runner's buffers): + u·|w| for the rounded weights (the logits are exact in it)";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for (experts, top_k) in [(8usize, 1usize), (8, 2), (8, 8), (64, 6)] {
        // Distinct logits 0.25 apart (no near-ties that rounding could flip), then rows of
        // exact ties: all equal, the top two, the second and third; a peaked row; all negative.
        let mut logits = Vec::new();
        for _ in 0..3 {
            let mut perm: Vec<usize> = (0..experts).collect();
            rng.shuffle(&mut perm);
            logits.extend(perm.iter().map(|&p| p as f32 * 0.25 - 1.0));
        }
        let tie = |vals: &[f32]| -> Vec<f32> {
            (0..experts).map(|e| vals.get(e).copied().unwrap_or(-3.0 - e as f32 * 0.25)).collect()
        };
        logits.extend(vec![0.5; experts]);
        logits.extend(tie(&[-3.5, 2.0, -4.0, 2.0]));
        logits.extend(tie(&[3.0, -5.0, 1.0, -6.0, 1.0]));
        logits.extend(tie(&[-5.0, -6.0, 30.0, 20.0]));
        logits.extend((0..experts).map(|e| -20.0 - e as f32 * 0.5));
        let m = logits.len() / experts;
        let q = [OpQuery::MoeRoute { experts, top_k }];
        let name = format!("experts {experts} top_k {top_k}, {m} rows incl. 3 with exact ties");
        s.case("moe_route", TOL, name, &q, &[11], |d| {
            if round_to(act, &logits) != logits {
                return Err(format!("the case's logits are not exact in {act}"));
            }
            let lv = d.acts(act, &logits)?;
            let (ids, weights) = (d.alloc(DType::U32, m * top_k)?, d.alloc(act, m * top_k)?);
            d.launch(Op::MoeRoute { logits: lv, m, experts, top_k, ids, weights })?;
            d.sync()?;
            let (gi, gw) = (d.read_u32(ids)?, d.read_act(weights)?);
            let (wi, ww) = route_ref(&logits, experts, top_k);
            let mut meas = Measured::default();
            meas.exact_u32("ids", &gi, &wi)?;
            let tol = (2 * experts + top_k + 8) as f64 * U + ua;
            meas.close("weights", &gw, &ww, |i| tol * ww[i] + MIN_NORMAL + tiny)?;
            Ok(meas)
        });
    }
}

/// An MoE layer's experts and a routing of `m` tokens over them.
struct Moe {
    experts: Vec<(Mat, Mat, Mat)>,
    hidden: usize,
    x: Vec<f32>,
    m: usize,
    top_k: usize,
    ids: Vec<u32>,
    weights: Vec<f32>,
    /// The activation dtype `x`, the routing weights and the outputs are held in.
    act: DType,
}

impl Moe {
    /// The same layer with `x` and the routing weights as `act` holds them.
    fn in_act(mut self, act: DType) -> Moe {
        self.x = round_to(act, &self.x);
        self.weights = round_to(act, &self.weights);
        self.act = act;
        self
    }

    fn random(rng: &mut Rng, dtype: DType, n_exp: usize, m: usize, top_k: usize) -> Moe {
        let hidden = 256;
        // The down projection's rows are `inter` long: whole K-quant super-blocks.
        let inter = if dtype.block_elems() == 256 { 256 } else { 64 };
        let experts = (0..n_exp)
            .map(|_| {
                (
                    Mat::random(rng, dtype, inter, hidden, 0.5),
                    Mat::random(rng, dtype, inter, hidden, 0.5),
                    Mat::random(rng, dtype, hidden, inter, 0.5),
                )
            })
            .collect();
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        for t in 0..m {
            // Token 0 always goes to expert 0 first, so one expert serves several tokens;
            // the rest are distinct random experts, and some experts get no token at all.
            let mut e: Vec<u32> = (0..n_exp as u32).collect();
            rng.shuffle(&mut e);
            if t == 0 {
                let at = e.iter().position(|&x| x == 0).unwrap_or(0);
                e.swap(0, at);
            }
            ids.extend_from_slice(&e[..top_k]);
            let w: Vec<f32> = (0..top_k).map(|_| 0.2 + rng.unit().abs()).collect();
            let sum: f32 = w.iter().sum();
            weights.extend(w.iter().map(|v| v / sum));
        }
        Moe { experts, hidden, x: rng.vec(m * hidden, 1.0), m, top_k, ids, weights, act: DType::F32 }
    }

    /// The layer in f64: `Σ_r w_r · expert_r(x)`, with each expert's bound (`mlp_ref`) and
    /// the f32 weighted sum's `(k + 2)·2⁻²⁴·Σ|w·y|` (16-bit activations: plus the output's rounding).
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let (ua, tiny) = (u_act(self.act), tiny_act(self.act));
        let hid = self.hidden;
        let (mut out, mut bound) = (vec![0f64; self.m * hid], vec![0f64; self.m * hid]);
        for t in 0..self.m {
            let x = &self.x[t * hid..(t + 1) * hid];
            for r in 0..self.top_k {
                let (g, u, dn) = &self.experts[self.ids[t * self.top_k + r] as usize];
                let w = self.weights[t * self.top_k + r] as f64;
                let (y, ey) = mlp_ref(x, g, u, dn, ua);
                for j in 0..hid {
                    out[t * hid + j] += w * y[j];
                    bound[t * hid + j] += w.abs() * ey[j] + (self.top_k + 2) as f64 * U * (w * y[j]).abs();
                }
            }
        }
        for (b, o) in bound.iter_mut().zip(&out) {
            *b += ua * o.abs() + tiny;
        }
        (out, bound)
    }

    /// Uploads the experts consecutively (`gate_0, up_0, down_0, gate_1, ...`).
    fn upload(&self, d: &mut Dev<'_>) -> R<ExpertSet> {
        let mut first = None;
        for (e, (g, u, dn)) in self.experts.iter().enumerate() {
            for (i, w) in [g, u, dn].into_iter().enumerate() {
                let id = d.mat(&format!("expert{e}.{i}"), w)?;
                let f = *first.get_or_insert(id);
                if id.0 != f.0 + (3 * e + i) as u32 {
                    return Err(format!("upload_weight handed out id {} for weight {} of the layer", id.0, 3 * e + i));
                }
            }
        }
        Ok(ExpertSet { first: first.ok_or("no experts")?, count: self.experts.len() })
    }

    fn grouped(&self, d: &mut Dev<'_>) -> R<Vec<f32>> {
        let experts = self.upload(d)?;
        let a = self.act;
        let (x, ids, w) = (d.acts(a, &self.x)?, d.u32s(&self.ids)?, d.acts(a, &self.weights)?);
        let out = d.alloc(a, self.m * self.hidden)?;
        let tiling = Default::default();
        d.launch(Op::MoeGrouped { x, m: self.m, experts, top_k: self.top_k, ids, weights: w, out, tiling })?;
        d.sync()?;
        d.read_act(out)
    }

    /// The per-expert path exactly as the runner's `MoePerExpert` launches it: every expert
    /// as a dense MLP over every token (gate and up matmuls, swiglu, down), its rows scattered
    /// into the routed slots, then the weighted combine.
    fn per_expert(&self, d: &mut Dev<'_>) -> R<Vec<f32>> {
        let experts = self.upload(d)?;
        let (m, hid, k) = (self.m, self.hidden, self.top_k);
        let inter = self.experts[0].0.rows;
        let a = self.act;
        let (x, ids, w) = (d.acts(a, &self.x)?, d.u32s(&self.ids)?, d.acts(a, &self.weights)?);
        let (g, u, act) = (d.alloc(a, m * inter)?, d.alloc(a, m * inter)?, d.alloc(a, m * inter)?);
        let (y, ys, out) = (d.alloc(a, m * hid)?, d.acts(a, &vec![f32::NAN; m * k * hid])?, d.alloc(a, m * hid)?);
        // Every slot is routed to exactly one expert, so the scatters cover `ys`; zero it
        // first all the same, as a stale buffer would otherwise leak NaN into the combine.
        d.launch(Op::Zero { dst: ys })?;
        let mm = |x, w, out| Op::MatMul {
            x,
            m,
            segs: Segs::one(MatSegOp { w, bias: None, out }),
            precision: Precision::Exact,
            tiling: Default::default(),
        };
        for e in 0..experts.count {
            let (gw, uw, dw) = experts.expert(e);
            d.launch(mm(x, gw, g))?;
            d.launch(mm(x, uw, u))?;
            d.launch(Op::SwiGlu { gate: g, up: u, out: act })?;
            d.launch(mm(act, dw, y))?;
            d.launch(Op::MoeScatter { y, m, expert: e as u32, top_k: k, ids, ys })?;
        }
        d.launch(Op::MoeCombine { ys, m, top_k: k, weights: w, out })?;
        d.sync()?;
        d.read_act(out)
    }
}

const TOL_MOE: &str = "each expert's gate/up/down matmul bounds carried through silu and the down projection \
                       (Σ|d|·err(h) + (inter + 4)·2⁻²⁴·Σ|d·h|), then (k + 2)·2⁻²⁴·Σ|w·y| for the weighted sum. \
                       16-bit activations (x and the routing weights rounded): + u·|·| for the rounded gate, up, \
                       SwiGLU and down outputs (carried the same way) and for the rounded result";

pub fn moe_grouped(s: &mut Suite<'_>, rng: &mut Rng) {
    grouped_layers(s, rng, false);
}

pub fn moe_per_expert(s: &mut Suite<'_>, rng: &mut Rng) {
    grouped_layers(s, rng, true);
}

/// MoE layers over weight dtypes and routings: through `MoeGrouped` against the reference, or
/// (`per_expert`) through the runner's per-expert ops, which must give the grouped path's bits.
fn grouped_layers(s: &mut Suite<'_>, rng: &mut Rng, per_expert: bool) {
    let act = s.act;
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4K, DType::Q6K];
    for dtype in dtypes {
        // top_k 4: with one or two ranks the sum's order cannot show (a + b = b + a).
        for (m, top_k) in [(1usize, 2usize), (7, 2), (5, 1), (6, 4)] {
            let moe = Moe::random(rng, dtype, 8, m, top_k).in_act(act);
            let (g, dn) = (&moe.experts[0].0, &moe.experts[0].2);
            let grouped_q = OpQuery::MoeGrouped { experts: 8, top_k, gate: g.case(act), down: dn.case(act) };
            let name = format!("{dtype} experts 8 top_k {top_k} m={m} hidden 256 inter {}", g.rows);
            if !per_expert {
                s.case("moe_grouped", TOL_MOE, name, &[grouped_q], &[12], |d| {
                    let got = moe.grouped(d)?;
                    let (want, bound) = moe.reference();
                    let mut meas = Measured::default();
                    meas.close("out", &got, &want, |i| bound[i])?;
                    Ok(meas)
                });
                continue;
            }
            // The per-expert path must give the grouped path's bits (the ops' contract: both
            // sum in rank order, and a matmul row does not depend on the other rows).
            let q = [
                OpQuery::MatMul(g.case(act)),
                OpQuery::MatMul(moe.experts[0].1.case(act)),
                OpQuery::SwiGlu { act },
                OpQuery::MatMul(dn.case(act)),
                OpQuery::MoeScatterCombine { act },
                grouped_q,
            ];
            let tol = "as moe_grouped against the reference; bit-identical to moe_grouped";
            s.case("moe per expert (scatter+combine) = grouped", tol, name, &q, &[4, 6, 12, 13, 14, 17], |d| {
                let per = moe.per_expert(d)?;
                let grouped = moe.grouped(d)?;
                let (want, bound) = moe.reference();
                let mut meas = Measured::default();
                meas.close("per-expert out", &per, &want, |i| bound[i])?;
                meas.exact("per-expert out vs grouped out", &per, &grouped)?;
                Ok(meas)
            });
        }
    }
}

pub fn moe_scatter(s: &mut Suite<'_>, rng: &mut Rng) {
    scatter_combine(s, rng, false);
}

pub fn moe_combine(s: &mut Suite<'_>, rng: &mut Rng) {
    scatter_combine(s, rng, true);
}

/// The per-expert path's data ops: `MoeScatter` of one expert's rows into the routed slots, or
/// (`combine`) the weighted `MoeCombine` of the slots.
fn scatter_combine(s: &mut Suite<'_>, rng: &mut Rng, combine: bool) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let q = [OpQuery::MoeScatterCombine { act }];
    for (m, top_k, hid) in [(1usize, 2usize, 64usize), (9, 2, 96), (6, 4, 33)] {
        let n_exp = 8;
        let mut ids = Vec::new();
        for _ in 0..m {
            let mut e: Vec<u32> = (0..n_exp).collect();
            rng.shuffle(&mut e);
            ids.extend_from_slice(&e[..top_k]);
        }
        let y = round_to(act, &rng.vec(m * hid, 2.0));
        let expert = ids[0];
        if !combine {
            s.case(
                "moe_scatter",
                EXACT_COPY,
                format!("expert {expert} of {n_exp}, m={m} top_k {top_k} hidden {hid}"),
                &q,
                &[13],
                |d| {
                    let (yv, iv) = (d.acts(act, &y)?, d.u32s(&ids)?);
                    let ys = d.acts(act, &vec![-3.0; m * top_k * hid])?;
                    d.launch(Op::MoeScatter { y: yv, m, expert, top_k, ids: iv, ys })?;
                    d.sync()?;
                    let got = d.read_act(ys)?;
                    let mut want = vec![-3.0f32; m * top_k * hid];
                    for (slot, &e) in ids.iter().enumerate() {
                        if e == expert {
                            let t = slot / top_k;
                            want[slot * hid..(slot + 1) * hid].copy_from_slice(&y[t * hid..(t + 1) * hid]);
                        }
                    }
                    let mut meas = Measured::default();
                    meas.exact("ys (other slots untouched)", &got, &want)?;
                    Ok(meas)
                },
            );
            continue;
        }
        let ys = round_to(act, &rng.vec(m * top_k * hid, 2.0));
        let w = round_to(act, &rng.vec(m * top_k, 1.0));
        let tol = "(k + 2)·2⁻²⁴·Σ_r |w_r·y_r|: k f32 products and sums (16-bit activations: + u·|want|)";
        s.case("moe_combine", tol, format!("m={m} top_k {top_k} hidden {hid}"), &q, &[14], |d| {
            let (yv, wv, out) = (d.acts(act, &ys)?, d.acts(act, &w)?, d.acts(act, &vec![9.0; m * hid])?);
            d.launch(Op::MoeCombine { ys: yv, m, top_k, weights: wv, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let (mut want, mut bound) = (vec![0f64; m * hid], vec![0f64; m * hid]);
            for t in 0..m {
                for r in 0..top_k {
                    let wr = w[t * top_k + r] as f64;
                    for j in 0..hid {
                        let p = wr * ys[(t * top_k + r) * hid + j] as f64;
                        want[t * hid + j] += p;
                        bound[t * hid + j] += (top_k + 2) as f64 * U * p.abs();
                    }
                }
            }
            let mut meas = Measured::default();
            meas.close("out", &got, &want, |i| bound[i] + MIN_NORMAL + ua * want[i].abs() + tiny)?;
            Ok(meas)
        });
    }
}
