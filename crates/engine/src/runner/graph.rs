//! The decoder's op sequence for one step, as the plan chose it:
//! embed (→ scale) → [norm → qkv (→ q/k norm) → rope → kv write → attention (decodes | prefill
//! chunks; full or sliding window) → o_proj (→ post norm) → norm → mlp | moe (→ post norm)] × N
//! → norm → gather → lm_head.

use tboost_ops::{AttnParams, RopeParams, RopeScaling};

use super::buffers::Buffers;
use super::exec::Exec;
use super::weights::{LayerIds, MlpIds};
use crate::backend::{BufId, KvLayer, MatSegOp, Op, Segs, SeqRange, StepViews, View, WeightId};
use crate::kv::StepLayout;
use crate::model::ModelConfig;
use crate::plan::{Choice, Decision, Placement, Plan, Slot};
use crate::{Error, Result};

/// Everything one forward pass reads.
pub(super) struct Graph<'g> {
    pub c: &'g ModelConfig,
    pub plan: &'g Plan,
    pub ids: &'g super::weights::WeightIds,
    pub bufs: &'g Buffers,
    pub caches: &'g [KvLayer],
    pub views: &'g StepViews,
    pub layout: &'g StepLayout,
    pub tokens: usize,
    pub rows: usize,
    /// The collectives of a tensor-parallel rank.
    pub tp: Option<super::tp::StepComm<'g>>,
}

fn need(d: Option<&Decision>, s: Slot) -> Result<&Decision> {
    d.ok_or_else(|| Error::invalid("plan", format!("no decision for slot {}", s.name())))
}

/// The step's sequences split into runs of one attention phase (decodes: one new token).
fn phase_runs(layout: &StepLayout) -> Vec<(bool, usize, usize)> {
    let mut runs: Vec<(bool, usize, usize)> = Vec::new();
    for (i, s) in layout.seqs.iter().enumerate() {
        let decode = s[1] == 1;
        match runs.last_mut() {
            Some((d, _, n)) if *d == decode => *n += 1,
            _ => runs.push((decode, i, 1)),
        }
    }
    runs
}

impl Graph<'_> {
    /// Launches the ops; returns the view the f32 logits are in.
    pub fn launch(&self, ex: &mut Exec<'_>) -> Result<View> {
        let Graph { c, plan, ids, bufs: a, caches, views, layout, tokens: t, rows: r, .. } = *self;
        let (hid, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let v = |buf: BufId, len: usize| View::new(buf, 0, len);
        let (h, xn, o) = (v(a.h, t * hid), v(a.xn, t * hid), v(a.o, t * hid));
        let (q, k, vv, attn) = (v(a.q, t * qd), v(a.k, t * kvd), v(a.v, t * kvd), v(a.attn, t * qd));
        let half = c.rope_dim / 2;
        let (cos, sin) = (v(a.cos, t * half), v(a.sin, t * half));
        let (cos_l, sin_l) = (v(a.cos_local, t * half), v(a.sin_local, t * half));
        let eps = c.rms_eps as f32;
        let mut params = AttnParams::new(c.num_heads, c.num_kv_heads, hd, c.attn_scale());
        params.tile_kv = plan.attention_tile_kv;
        let model = |s| need(plan.model_slot(s), s);
        let mm = |x, m, segs, precision| Op::MatMul { x, m, segs, precision, tiling: plan.matmul_tiling };

        let d = model(Slot::Embed)?;
        ex.launch(d.placement, &Op::Embed { ids: views.ids, table: ids.embed, out: h })?;
        if let Some(tp) = &self.tp {
            tp.all_reduce(ex, h, Some(c.hidden_size))?;
        }
        if d.choice == Choice::EmbedThenScale {
            let s = ids.embed_scale.ok_or_else(|| Error::invalid("plan", "embed_then_scale without a scale"))?;
            ex.launch(d.placement, &Op::Scale { x: h, s })?;
        }
        let d = model(Slot::RopeTables)?;
        self.rope_tables(ex, d, crate::plan::global_rope(c), cos, sin)?;
        if let Some(local) = crate::plan::local_rope(c) {
            self.rope_tables(ex, model(Slot::RopeTablesLocal)?, local, cos_l, sin_l)?;
        }

        // `pending` holds a sublayer output not yet added into `h` (after the first sublayer).
        let norm = |ex: &mut Exec<'_>, d: &Decision, w: WeightId, pending: View| -> Result<()> {
            let p = d.placement;
            match d.choice {
                Choice::RmsNorm => ex.launch(p, &Op::RmsNorm { x: h, w, eps, out: xn }),
                Choice::AddRmsNorm => ex.launch(p, &Op::AddRmsNorm { residual: h, x: pending, w, eps, out: xn }),
                Choice::AddThenRmsNorm => {
                    ex.launch(p, &Op::Add { dst: h, src: pending })?;
                    ex.launch(p, &Op::RmsNorm { x: h, w, eps, out: xn })
                }
                other => Err(Error::invalid("plan", format!("{} cannot fill a norm slot", other.name()))),
            }
        };
        // A sublayer's output, RMS-normed into `post` when the layer has a post-norm.
        let post = v(a.post, t * hid);
        let post_norm = |ex: &mut Exec<'_>, d: Option<&Decision>, w: Option<WeightId>| -> Result<View> {
            match (d, w) {
                (Some(d), Some(w)) => {
                    ex.launch(d.placement, &Op::RmsNorm { x: o, w, eps, out: post })?;
                    Ok(post)
                }
                _ => Ok(o),
            }
        };
        let mut pending = o;
        let runs = phase_runs(layout);
        for (i, ((lw, lp), &cache)) in ids.layers.iter().zip(&plan.layers).zip(caches).enumerate() {
            let d = |s| need(lp.get(s), s);
            norm(ex, d(Slot::AttnNorm)?, lw.attn_norm, pending)?;
            match lw.qk_norm {
                Some((qn, kn)) => {
                    let (qr, kr) = (v(a.q_raw, t * qd), v(a.k_raw, t * kvd));
                    self.qkv(ex, d(Slot::Qkv)?, lw, xn, [qr, kr, vv])?;
                    let dn = d(Slot::QkNorm)?;
                    ex.launch(dn.placement, &Op::RmsNorm { x: qr, w: qn, eps, out: q })?;
                    ex.launch(dn.placement, &Op::RmsNorm { x: kr, w: kn, eps, out: k })?;
                }
                None => self.qkv(ex, d(Slot::Qkv)?, lw, xn, [q, k, vv])?,
            }
            let dr = d(Slot::Rope)?;
            let style = c.rope_style;
            let (cos, sin) = if c.features.local_rope(i) { (cos_l, sin_l) } else { (cos, sin) };
            ex.launch(dr.placement, &Op::Rope { x: q, heads: c.num_heads, head_dim: hd, cos, sin, style })?;
            ex.launch(dr.placement, &Op::Rope { x: k, heads: c.num_kv_heads, head_dim: hd, cos, sin, style })?;
            let params = AttnParams { window: c.features.window(i), ..params };
            ex.launch(d(Slot::KvWrite)?.placement, &Op::WriteKv { k, v: vv, slots: views.slots, cache })?;
            for &(decode, first, count) in &runs {
                let da = d(if decode { Slot::AttentionDecode } else { Slot::AttentionPrefill })?;
                let kind = da
                    .choice
                    .attn_kind()
                    .ok_or_else(|| Error::invalid("plan", format!("{} is not attention", da.choice.name())))?;
                let row_start = layout.seqs[first][0] as usize;
                let last = layout.seqs[first + count - 1];
                let seqs = SeqRange {
                    seqs: views.seqs.sub(first * 3, count * 3),
                    block_tables: views.block_tables.sub(first * views.max_blocks, count * views.max_blocks),
                    max_blocks: views.max_blocks,
                    first,
                    count,
                    row_start,
                    rows: (last[0] + last[1]) as usize - row_start,
                };
                ex.launch(da.placement, &Op::Attention { kind, q, cache, seqs, params, out: attn })?;
            }
            let dp = d(Slot::OProj)?;
            if !self.fused_reduce(ex, dp, attn, lw.o, o)? {
                let seg = MatSegOp { w: lw.o, bias: None, out: o };
                ex.launch(dp.placement, &mm(attn, t, Segs::one(seg), dp.precision))?;
                if let Some(tp) = &self.tp {
                    tp.all_reduce(ex, o, None)?;
                }
            }
            pending = post_norm(ex, lp.get(Slot::PostAttnNorm), lw.post_attn_norm)?;

            norm(ex, d(Slot::FfnNorm)?, lw.ffn_norm, pending)?;
            let mut reduced = false;
            match &lw.mlp {
                MlpIds::Dense { gate, up, down } => {
                    reduced = self.dense_mlp(ex, d(Slot::Mlp)?, (*gate, *up, *down), xn, o, true)?
                }
                MlpIds::Moe { router, experts } => {
                    let dr = d(Slot::MoeRouting)?;
                    let e = c.num_experts;
                    let top_k = c.experts_per_token;
                    let rl = v(a.router, t * e);
                    let (rid, rw) = (v(a.route_ids, t * top_k), v(a.route_w, t * top_k));
                    let seg = MatSegOp { w: *router, bias: None, out: rl };
                    ex.launch(dr.placement, &mm(xn, t, Segs::one(seg), dr.precision))?;
                    ex.launch(
                        dr.placement,
                        &Op::MoeRoute { logits: rl, m: t, experts: e, top_k, ids: rid, weights: rw },
                    )?;
                    let dm = d(Slot::Mlp)?;
                    match dm.choice {
                        Choice::MoeGrouped => ex.launch(
                            dm.placement,
                            &Op::MoeGrouped {
                                x: xn,
                                m: t,
                                experts: *experts,
                                top_k,
                                ids: rid,
                                weights: rw,
                                out: o,
                                tiling: plan.moe_tiling,
                            },
                        )?,
                        Choice::MoePerExpert => {
                            let (y, ys) = (v(a.expert_y, t * hid), v(a.expert_ys, t * top_k * hid));
                            for ei in 0..experts.count {
                                self.dense_mlp(ex, dm, experts.expert(ei), xn, y, false)?;
                                let op = Op::MoeScatter { y, m: t, expert: ei as u32, top_k, ids: rid, ys };
                                ex.launch(dm.placement, &op)?;
                            }
                            ex.launch(dm.placement, &Op::MoeCombine { ys, m: t, top_k, weights: rw, out: o })?;
                        }
                        other => {
                            return Err(Error::invalid("plan", format!("{} cannot fill an MoE slot", other.name())))
                        }
                    }
                }
            }
            if let Some(tp) = self.tp.as_ref().filter(|_| !reduced) {
                tp.all_reduce(ex, o, None)?;
            }
            pending = post_norm(ex, lp.get(Slot::PostFfnNorm), lw.post_ffn_norm)?;
        }
        norm(ex, model(Slot::FinalNorm)?, ids.norm, pending)?;
        let dl = model(Slot::LmHead)?;
        let sel = v(a.sel, r * hid);
        let lg = v(a.logits, r * c.vocab_size);
        if r > 0 {
            ex.launch(dl.placement, &Op::GatherRows { x: xn, cols: hid, rows: views.logit_rows, out: sel })?;
            let seg = MatSegOp { w: ids.lm_head, bias: None, out: lg };
            ex.launch(dl.placement, &mm(sel, r, Segs::one(seg), dl.precision))?;
        }
        match a.logits_f32 {
            Some(f) => {
                let lf = v(f, r * c.vocab_size);
                if r > 0 {
                    ex.launch(dl.placement, &Op::Convert { src: lg, dst: lf })?;
                }
                Ok(lf)
            }
            None => Ok(lg),
        }
    }

    /// The cos/sin tables of `rope` for the step's positions. LongRoPE picks the short or long
    /// factors per sequence: long when the sequence's context (cached + new tokens) is beyond the
    /// original length, as transformers decides per forward call from the longest position
    /// (so a sequence prefilled past it rotates every token with the long factors; cached keys
    /// are not re-rotated when a sequence crosses it while decoding, as in transformers).
    fn rope_tables(&self, ex: &mut Exec<'_>, d: &Decision, rope: RopeParams, cos: View, sin: View) -> Result<()> {
        let positions = self.views.positions;
        let (Some(RopeScaling::LongRope { original_max_position_embeddings: orig, .. }), Some((short, long))) =
            (rope.scaling, self.ids.rope_factors)
        else {
            return ex.launch(d.placement, &Op::RopeTables { positions, rope, cos, sin });
        };
        let half = rope.dim / 2;
        // Runs of consecutive sequences in one regime, as (long, first row, rows).
        let mut runs: Vec<(bool, usize, usize)> = Vec::new();
        for s in &self.layout.seqs {
            let (start, rows, is_long) = (s[0] as usize, s[1] as usize, s[2] as f64 > orig);
            match runs.last_mut() {
                Some((l, r0, n)) if *l == is_long && *r0 + *n == start => *n += rows,
                _ => runs.push((is_long, start, rows)),
            }
        }
        for (is_long, r0, n) in runs {
            let factors = if is_long { long } else { short };
            let op = Op::RopeTablesScaled {
                positions: positions.sub(r0, n),
                rope,
                factors,
                cos: cos.sub(r0 * half, n * half),
                sin: sin.sub(r0 * half, n * half),
            };
            ex.launch(d.placement, &op)?;
        }
        Ok(())
    }

    fn qkv(&self, ex: &mut Exec<'_>, d: &Decision, lw: &LayerIds, x: View, outs: [View; 3]) -> Result<()> {
        let segs = [(lw.q, lw.q_bias), (lw.k, lw.k_bias), (lw.v, lw.v_bias)];
        let segs = [0, 1, 2].map(|i| MatSegOp { w: segs[i].0, bias: segs[i].1, out: outs[i] });
        let (m, p, precision, tiling) = (self.tokens, d.placement, d.precision, self.plan.matmul_tiling);
        match d.choice {
            Choice::FusedQkvMatmul => {
                ex.launch(p, &Op::MatMul { x, m, segs: Segs::from_slice(&segs), precision, tiling })
            }
            Choice::SeparateQkvMatmuls => {
                for s in segs {
                    ex.launch(p, &Op::MatMul { x, m, segs: Segs::one(s), precision, tiling })?;
                }
                Ok(())
            }
            other => Err(Error::invalid("plan", format!("{} cannot fill the qkv slot", other.name()))),
        }
    }

    /// `out = down(silu(gate(x)) * up(x))` as the decision says (fused or separate; the
    /// per-expert MoE path runs each expert through the separate form).
    /// `out = x · wᵀ` and its all-reduce as one fused device op (MC2) when this step, the slot's
    /// placement and the weight allow it; false when the caller runs them apart.
    fn fused_reduce(&self, ex: &mut Exec<'_>, d: &Decision, x: View, w: WeightId, out: View) -> Result<bool> {
        match &self.tp {
            Some(tp) if d.placement == Placement::Primary => tp.matmul_all_reduce(ex, x, self.tokens, w, out),
            _ => Ok(false),
        }
    }

    /// The MLP of one layer (or one expert) into `out`; with `reduce`, its down projection may fuse
    /// the tensor-parallel all-reduce ([`Self::fused_reduce`]): returns whether it did.
    fn dense_mlp(
        &self,
        ex: &mut Exec<'_>,
        d: &Decision,
        w: (WeightId, WeightId, WeightId),
        x: View,
        out: View,
        reduce: bool,
    ) -> Result<bool> {
        let (gate, up, down) = w;
        let a = self.bufs;
        let (m, inter) = (self.tokens, self.c.intermediate_size);
        let act = View::new(a.act, 0, m * inter);
        let (p, precision, tiling) = (d.placement, d.precision, self.plan.matmul_tiling);
        let one = |x, w, out| Op::MatMul { x, m, segs: Segs::one(MatSegOp { w, bias: None, out }), precision, tiling };
        match d.choice {
            Choice::FusedGateUpSwiglu => {
                ex.launch(p, &Op::MatMulSwiGlu { x, m, gate, up, out: act, precision, tiling })?
            }
            Choice::GateUpMatmulsThenSwiglu | Choice::MoePerExpert | Choice::GateUpMatmulsThenGeglu => {
                let (g, u) = (View::new(a.gate, 0, m * inter), View::new(a.up, 0, m * inter));
                ex.launch(p, &one(x, gate, g))?;
                ex.launch(p, &one(x, up, u))?;
                if d.choice == Choice::GateUpMatmulsThenGeglu {
                    ex.launch(p, &Op::GeGlu { gate: g, up: u, out: act })?;
                } else {
                    ex.launch(p, &Op::SwiGlu { gate: g, up: u, out: act })?;
                }
            }
            other => return Err(Error::invalid("plan", format!("{} cannot fill the mlp slot", other.name()))),
        }
        if reduce && self.fused_reduce(ex, d, act, down, out)? {
            return Ok(true);
        }
        ex.launch(p, &one(act, down, out))?;
        Ok(false)
    }
}
