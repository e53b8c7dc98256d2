//! Layer-by-layer data flow of one forward pass: turns a flattened batch into the ops the
//! plan chose, launched on the backend. Owns the device-resident weights, activation
//! buffers and KV pools; the scheduler and KV manager above it decide what goes in a batch.

use tboost_kernels::attention::{AttnParams, SeqSpan};
use tboost_kernels::rope;
use tboost_ops::DType;

use crate::backend::op::{ExpertIds, MatSegOp};
use crate::backend::{Backend, BufId, KvLayer, Op, View, WeightId};
use crate::kv::KvPools;
use crate::model::{Mlp, Model, ModelConfig};
use crate::plan::{self, LayerPlan, Plan, PlanOptions};
use crate::{Error, Result};

struct LayerIds {
    attn_norm: WeightId,
    q: WeightId,
    k: WeightId,
    v: WeightId,
    o: WeightId,
    q_bias: Option<WeightId>,
    k_bias: Option<WeightId>,
    v_bias: Option<WeightId>,
    ffn_norm: WeightId,
    mlp: MlpIds,
}

enum MlpIds {
    Dense { gate: WeightId, up: WeightId, down: WeightId },
    Moe { router: WeightId, experts: Vec<ExpertIds> },
}

struct WeightIds {
    embed: WeightId,
    layers: Vec<LayerIds>,
    norm: WeightId,
    lm_head: WeightId,
}

/// Activation buffers sized for up to `tokens` rows per forward and `rows` logit rows.
struct Acts {
    tokens: usize,
    rows: usize,
    bufs: Vec<BufId>,
    h: BufId,
    xn: BufId,
    q: BufId,
    k: BufId,
    v: BufId,
    attn: BufId,
    o: BufId,
    gate: BufId,
    up: BufId,
    act: BufId,
    cos: BufId,
    sin: BufId,
    sel: BufId,
    logits: BufId,
}

/// One forward pass's input: every scheduled sequence's new tokens, flattened.
pub struct StepBatch<'a> {
    pub tokens: &'a [u32],
    /// Absolute position of each token in its sequence.
    pub positions: &'a [u32],
    /// Cache slot (block * block_size + row) each token's K/V is written to.
    pub slots: &'a [u32],
    /// Per sequence: its rows in `tokens`, its context length and block table.
    pub seqs: &'a [SeqSpan<'a>],
    /// Rows of `tokens` whose logits are wanted, in output order.
    pub logit_rows: &'a [u32],
}

pub struct ModelRunner {
    pub cfg: ModelConfig,
    pub plan: Plan,
    backend: Box<dyn Backend>,
    ids: WeightIds,
    inv_freq: Vec<f64>,
    acts: Option<Acts>,
    kv: Option<KvPools>,
    weight_bytes: usize,
}

fn upload(be: &mut dyn Backend, t: &crate::model::Tensor) -> Result<WeightId> {
    be.upload_weight(t)
}

impl ModelRunner {
    /// Plans the model for the backend and makes its weights resident.
    pub fn new(model: &Model, mut backend: Box<dyn Backend>, opts: &PlanOptions) -> Result<ModelRunner> {
        let cfg = model.config.clone();
        let w = &model.weights;
        let plan = plan::build(&cfg, w, backend.as_ref(), opts)?;
        let be = backend.as_mut();
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let opt =
                |be: &mut dyn Backend, t: &Option<crate::model::Tensor>| t.as_ref().map(|t| upload(be, t)).transpose();
            layers.push(LayerIds {
                attn_norm: upload(be, &l.attn_norm)?,
                q: upload(be, &l.q)?,
                k: upload(be, &l.k)?,
                v: upload(be, &l.v)?,
                o: upload(be, &l.o)?,
                q_bias: opt(be, &l.q_bias)?,
                k_bias: opt(be, &l.k_bias)?,
                v_bias: opt(be, &l.v_bias)?,
                ffn_norm: upload(be, &l.ffn_norm)?,
                mlp: match &l.mlp {
                    Mlp::Dense { gate, up, down } => {
                        MlpIds::Dense { gate: upload(be, gate)?, up: upload(be, up)?, down: upload(be, down)? }
                    }
                    Mlp::Moe { router, experts } => MlpIds::Moe {
                        router: upload(be, router)?,
                        experts: experts
                            .iter()
                            .map(|e| {
                                Ok(ExpertIds {
                                    gate: upload(be, &e.gate)?,
                                    up: upload(be, &e.up)?,
                                    down: upload(be, &e.down)?,
                                })
                            })
                            .collect::<Result<Vec<_>>>()?,
                    },
                },
            });
        }
        let ids = WeightIds {
            embed: upload(be, &w.embed)?,
            layers,
            norm: upload(be, &w.norm)?,
            lm_head: upload(be, &w.lm_head)?,
        };
        let inv_freq = rope::inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling.as_ref());
        Ok(ModelRunner { weight_bytes: w.total_bytes(), cfg, plan, backend, ids, inv_freq, acts: None, kv: None })
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// Bytes of all weights (what one decode step streams from memory, for dense models).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Allocates the KV pools (replacing any previous ones).
    pub fn alloc_kv(&mut self, num_blocks: usize, block_size: usize, dtype: DType) -> Result<()> {
        if let Some(mut old) = self.kv.take() {
            old.free(self.backend.as_mut());
        }
        self.kv = Some(KvPools::new(self.backend.as_mut(), &self.cfg, num_blocks, block_size, dtype)?);
        Ok(())
    }

    pub fn kv(&self) -> Option<&KvPools> {
        self.kv.as_ref()
    }

    /// Bytes allocated on the device for activations and the KV cache.
    pub fn device_bytes(&self) -> usize {
        self.backend.allocated_bytes()
    }

    fn ensure_acts(&mut self, tokens: usize, rows: usize) -> Result<()> {
        if let Some(a) = &self.acts {
            if a.tokens >= tokens && a.rows >= rows {
                return Ok(());
            }
        }
        let (tokens, rows) = match &self.acts {
            Some(a) => (tokens.max(a.tokens), rows.max(a.rows)),
            None => (tokens, rows),
        };
        if let Some(old) = self.acts.take() {
            for b in old.bufs {
                self.backend.free(b);
            }
        }
        let c = &self.cfg;
        let inter = if c.arch.is_moe() { 0 } else { c.intermediate_size };
        let be = self.backend.as_mut();
        let mut bufs = Vec::new();
        let mut a = |n: usize| -> Result<BufId> {
            let b = be.alloc(DType::F32, n.max(1))?;
            bufs.push(b);
            Ok(b)
        };
        let t = tokens;
        let (h, xn) = (a(t * c.hidden_size)?, a(t * c.hidden_size)?);
        let q = a(t * c.num_heads * c.head_dim)?;
        let (k, v) = (a(t * c.num_kv_heads * c.head_dim)?, a(t * c.num_kv_heads * c.head_dim)?);
        let attn = a(t * c.num_heads * c.head_dim)?;
        let o = a(t * c.hidden_size)?;
        let (gate, up, act) = (a(t * inter)?, a(t * inter)?, a(t * inter)?);
        let (cos, sin) = (a(t * c.rope_dim / 2)?, a(t * c.rope_dim / 2)?);
        let sel = a(rows * c.hidden_size)?;
        let logits = a(rows * c.vocab_size)?;
        self.acts = Some(Acts { tokens, rows, bufs, h, xn, q, k, v, attn, o, gate, up, act, cos, sin, sel, logits });
        Ok(())
    }

    /// Checks a batch against the model and the cache before anything is launched, so that
    /// a bad batch is a clear error and leaves nothing half-done.
    fn validate(&self, b: &StepBatch<'_>) -> Result<()> {
        let n = b.tokens.len();
        if n == 0 {
            return Err(Error::invalid("tokens", "the batch is empty"));
        }
        if b.positions.len() != n || b.slots.len() != n {
            return Err(Error::invalid(
                "batch",
                format!("{n} tokens but {} positions and {} slots", b.positions.len(), b.slots.len()),
            ));
        }
        if let Some(&bad) = b.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::invalid(
                "token id",
                format!("{bad} is not below the vocabulary size {}", self.cfg.vocab_size),
            ));
        }
        if let Some(&bad) = b.logit_rows.iter().find(|&&r| r as usize >= n) {
            return Err(Error::invalid("logit_rows", format!("row {bad} is beyond the batch of {n} tokens")));
        }
        let mut covered = 0;
        for s in b.seqs {
            if s.q_start != covered || s.q_len == 0 || s.q_len > s.ctx_len {
                return Err(Error::invalid("batch", format!("sequence span {s:?} does not follow row {covered}")));
            }
            covered += s.q_len;
        }
        if covered != n {
            return Err(Error::invalid("batch", format!("sequences cover {covered} of {n} tokens")));
        }
        Ok(())
    }

    /// Runs the model on a batch; `logits` receives `[logit_rows.len(), vocab]`.
    pub fn forward(&mut self, b: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<()> {
        self.validate(b)?;
        let kv_layers: Vec<KvLayer> = match &self.kv {
            Some(kv) => kv.layers.clone(),
            None => return Err(Error::invalid("kv cache", "no KV cache allocated (call alloc_kv first)")),
        };
        let (t, r) = (b.tokens.len(), b.logit_rows.len());
        self.ensure_acts(t, r)?;
        let ModelRunner { cfg, plan, backend, ids, inv_freq, acts, .. } = self;
        let a = acts.as_ref().ok_or_else(|| Error::invalid("acts", "activation buffers missing"))?;
        let g = Graph { c: cfg, plan, ids, inv_freq, a, kv_layers: &kv_layers, b };
        // One stream for the whole pass: on the CPU, every op then runs on the pool's own
        // threads instead of paying a cross-thread hand-off per op.
        backend.with_stream(&mut |be| g.launch(be, logits))
    }
}

/// Everything one forward pass reads, so the op sequence can run as one stream.
struct Graph<'g> {
    c: &'g ModelConfig,
    plan: &'g Plan,
    ids: &'g WeightIds,
    inv_freq: &'g [f64],
    a: &'g Acts,
    kv_layers: &'g [KvLayer],
    b: &'g StepBatch<'g>,
}

impl Graph<'_> {
    /// Launches the plan's ops for the batch; `logits` receives the wanted rows.
    fn launch(&self, be: &mut dyn Backend, logits: &mut Vec<f32>) -> Result<()> {
        let Graph { c, plan, ids, inv_freq, a, kv_layers, b } = *self;
        let (t, r) = (b.tokens.len(), b.logit_rows.len());
        let (hid, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let inter = c.intermediate_size;
        let v = |buf: BufId, len: usize| View::new(buf, 0, len);
        let (h, xn, o) = (v(a.h, t * hid), v(a.xn, t * hid), v(a.o, t * hid));
        let (q, k, vv, attn) = (v(a.q, t * qd), v(a.k, t * kvd), v(a.v, t * kvd), v(a.attn, t * qd));
        let half = c.rope_dim / 2;
        let (cos, sin) = (v(a.cos, t * half), v(a.sin, t * half));
        let eps = c.rms_eps as f32;
        let params = AttnParams {
            n_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };

        be.launch(&Op::Embed { ids: b.tokens, table: ids.embed, out: h })?;
        be.launch(&Op::RopeTables { positions: b.positions, inv_freq, cos, sin })?;
        let mut pending_residual = false; // `o` holds a sublayer output not yet added into `h`
        let norm = |be: &mut dyn Backend, lp: &LayerPlan, pending: bool, w: WeightId| -> Result<()> {
            if !pending {
                be.launch(&Op::RmsNorm { x: h, w, eps, out: xn })
            } else if lp.fuse_add_norm {
                be.launch(&Op::AddRmsNorm { residual: h, x: o, w, eps, out: xn })
            } else {
                be.launch(&Op::Add { dst: h, src: o })?;
                be.launch(&Op::RmsNorm { x: h, w, eps, out: xn })
            }
        };
        for ((lw, lp), cache) in ids.layers.iter().zip(&plan.layers).zip(kv_layers) {
            // Attention block.
            norm(be, lp, pending_residual, lw.attn_norm)?;
            let segs = [(lw.q, lw.q_bias, q), (lw.k, lw.k_bias, k), (lw.v, lw.v_bias, vv)]
                .map(|(w, bias, out)| MatSegOp { w, bias, out });
            if lp.fuse_qkv {
                be.launch(&Op::MatMul { x: xn, m: t, segs: &segs })?;
            } else {
                for s in &segs {
                    be.launch(&Op::MatMul { x: xn, m: t, segs: std::slice::from_ref(s) })?;
                }
            }
            be.launch(&Op::Rope { x: q, heads: c.num_heads, head_dim: hd, cos, sin, style: c.rope_style })?;
            be.launch(&Op::Rope { x: k, heads: c.num_kv_heads, head_dim: hd, cos, sin, style: c.rope_style })?;
            be.launch(&Op::WriteKv { k, v: vv, slots: b.slots, cache: *cache })?;
            be.launch(&Op::Attention { kind: lp.attention, q, cache: *cache, seqs: b.seqs, params, out: attn })?;
            be.launch(&Op::MatMul { x: attn, m: t, segs: &[MatSegOp { w: lw.o, bias: None, out: o }] })?;
            pending_residual = true;

            // Feed-forward block.
            norm(be, lp, pending_residual, lw.ffn_norm)?;
            match &lw.mlp {
                MlpIds::Dense { gate, up, down } => {
                    let act = v(a.act, t * inter);
                    if lp.fuse_gate_up {
                        be.launch(&Op::MatMulSwiGlu { x: xn, m: t, gate: *gate, up: *up, out: act })?;
                    } else {
                        let (g, u) = (v(a.gate, t * inter), v(a.up, t * inter));
                        be.launch(&Op::MatMul { x: xn, m: t, segs: &[MatSegOp { w: *gate, bias: None, out: g }] })?;
                        be.launch(&Op::MatMul { x: xn, m: t, segs: &[MatSegOp { w: *up, bias: None, out: u }] })?;
                        be.launch(&Op::SwiGlu { gate: g, up: u, out: act })?;
                    }
                    be.launch(&Op::MatMul { x: act, m: t, segs: &[MatSegOp { w: *down, bias: None, out: o }] })?;
                }
                MlpIds::Moe { router, experts } => {
                    be.launch(&Op::Moe { x: xn, m: t, router: *router, experts, top_k: c.experts_per_token, out: o })?;
                }
            }
        }
        // Final norm (the last residual add fused in as the plan says), then the LM head on
        // the wanted rows only.
        let last = plan.layers.last().ok_or_else(|| Error::invalid("model", "no layers"))?;
        norm(be, last, pending_residual, ids.norm)?;
        if r > 0 {
            let sel = v(a.sel, r * hid);
            let lg = v(a.logits, r * c.vocab_size);
            be.launch(&Op::GatherRows { x: xn, cols: hid, rows: b.logit_rows, out: sel })?;
            be.launch(&Op::MatMul { x: sel, m: r, segs: &[MatSegOp { w: ids.lm_head, bias: None, out: lg }] })?;
            be.synchronize()?;
            logits.resize(r * c.vocab_size, 0.0);
            be.read(lg, logits)?;
        } else {
            be.synchronize()?;
            logits.clear();
        }
        Ok(())
    }
}

impl Drop for ModelRunner {
    fn drop(&mut self) {
        if let Some(a) = self.acts.take() {
            for b in a.bufs {
                self.backend.free(b);
            }
        }
        if let Some(mut kv) = self.kv.take() {
            kv.free(self.backend.as_mut());
        }
    }
}
