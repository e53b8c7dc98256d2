//! Device buffers a forward pass works in: activations (in the plan's activation dtype) and
//! the step's index arrays (u32), sized for the largest step so far and reused.

use crate::backend::{Backend, BufId, DType, StepViews, View};
use crate::model::ModelConfig;
use crate::Result;

/// Capacity a set of buffers was sized for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Capacity {
    pub tokens: usize,
    pub rows: usize,
    pub seqs: usize,
    pub max_blocks: usize,
}

impl Capacity {
    fn covers(&self, o: &Capacity) -> bool {
        self.tokens >= o.tokens && self.rows >= o.rows && self.seqs >= o.seqs && self.max_blocks >= o.max_blocks
    }

    fn max(&self, o: &Capacity) -> Capacity {
        Capacity {
            tokens: self.tokens.max(o.tokens),
            rows: self.rows.max(o.rows),
            seqs: self.seqs.max(o.seqs),
            max_blocks: self.max_blocks.max(o.max_blocks),
        }
    }
}

pub(crate) struct Buffers {
    pub cap: Capacity,
    all: Vec<BufId>,
    pub h: BufId,
    pub xn: BufId,
    pub q: BufId,
    pub k: BufId,
    pub v: BufId,
    pub attn: BufId,
    pub o: BufId,
    pub gate: BufId,
    pub up: BufId,
    pub act: BufId,
    pub cos: BufId,
    pub sin: BufId,
    /// The sliding layers' tables (Gemma 3's local base; 1 element otherwise).
    pub cos_local: BufId,
    pub sin_local: BufId,
    /// q and k as projected, before the per-head norm writes them into `q` and `k`.
    pub q_raw: BufId,
    pub k_raw: BufId,
    /// A sublayer's output after its post-norm (Gemma 3).
    pub post: BufId,
    pub sel: BufId,
    pub logits: BufId,
    /// f32 logits when activations are not f32.
    pub logits_f32: Option<BufId>,
    // MoE: router logits, routing, and the per-expert path's rows.
    pub router: BufId,
    pub route_ids: BufId,
    pub route_w: BufId,
    pub expert_y: BufId,
    pub expert_ys: BufId,
    // The step's index arrays.
    pub ids: BufId,
    pub positions: BufId,
    pub slots: BufId,
    pub seq_table: BufId,
    pub block_tables: BufId,
    pub logit_rows: BufId,
}

impl Buffers {
    /// Buffers for at least `want` (growing past an earlier capacity, never shrinking).
    pub fn alloc(
        be: &mut dyn Backend,
        c: &ModelConfig,
        act: DType,
        want: Capacity,
        old: Option<&Capacity>,
    ) -> Result<Buffers> {
        let cap = old.map_or(want, |o| o.max(&want));
        let mut all = Vec::new();
        let r = Self::alloc_into(be, c, act, cap, &mut all);
        if r.is_err() {
            for b in all {
                be.free(b);
            }
        }
        r
    }

    fn alloc_into(
        be: &mut dyn Backend,
        c: &ModelConfig,
        act: DType,
        cap: Capacity,
        all: &mut Vec<BufId>,
    ) -> Result<Buffers> {
        let mut a = |dtype: DType, n: usize| -> Result<BufId> {
            let b = be.alloc(dtype, n.max(1))?;
            all.push(b);
            Ok(b)
        };
        let (t, r) = (cap.tokens, cap.rows);
        let (hid, qd, kvd) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let inter = c.intermediate_size;
        let k = c.experts_per_token.max(1);
        let moe = c.arch.is_moe();
        let f = &c.features;
        let local = crate::plan::local_rope(c).is_some();
        let b = Buffers {
            cap,
            h: a(act, t * hid)?,
            xn: a(act, t * hid)?,
            q: a(act, t * qd)?,
            k: a(act, t * kvd)?,
            v: a(act, t * kvd)?,
            attn: a(act, t * qd)?,
            o: a(act, t * hid)?,
            gate: a(act, t * inter)?,
            up: a(act, t * inter)?,
            act: a(act, t * inter)?,
            cos: a(act, t * c.rope_dim / 2)?,
            sin: a(act, t * c.rope_dim / 2)?,
            cos_local: a(act, if local { t * c.rope_dim / 2 } else { 1 })?,
            sin_local: a(act, if local { t * c.rope_dim / 2 } else { 1 })?,
            q_raw: a(act, if f.qk_norm { t * qd } else { 1 })?,
            k_raw: a(act, if f.qk_norm { t * kvd } else { 1 })?,
            post: a(act, if f.post_norms { t * hid } else { 1 })?,
            sel: a(act, r * hid)?,
            logits: a(act, r * c.vocab_size)?,
            logits_f32: if act == DType::F32 { None } else { Some(a(DType::F32, r * c.vocab_size)?) },
            router: a(act, if moe { t * c.num_experts } else { 1 })?,
            route_ids: a(DType::U32, if moe { t * k } else { 1 })?,
            route_w: a(act, if moe { t * k } else { 1 })?,
            expert_y: a(act, if moe { t * hid } else { 1 })?,
            expert_ys: a(act, if moe { t * k * hid } else { 1 })?,
            ids: a(DType::U32, t)?,
            positions: a(DType::U32, t)?,
            slots: a(DType::U32, t)?,
            seq_table: a(DType::U32, cap.seqs * 3)?,
            block_tables: a(DType::U32, cap.seqs * cap.max_blocks)?,
            logit_rows: a(DType::U32, r)?,
            all: Vec::new(),
        };
        Ok(Buffers { all: std::mem::take(all), ..b })
    }

    pub fn covers(&self, want: &Capacity) -> bool {
        self.cap.covers(want)
    }

    /// Views of this step's index arrays.
    pub fn step_views(&self, tokens: usize, seqs: usize, max_blocks: usize, rows: usize) -> StepViews {
        StepViews {
            ids: View::new(self.ids, 0, tokens),
            positions: View::new(self.positions, 0, tokens),
            slots: View::new(self.slots, 0, tokens),
            seqs: View::new(self.seq_table, 0, seqs * 3),
            block_tables: View::new(self.block_tables, 0, seqs * max_blocks),
            max_blocks,
            logit_rows: View::new(self.logit_rows, 0, rows),
        }
    }

    pub fn free(self, be: &mut dyn Backend) {
        for b in self.all {
            be.free(b);
        }
    }
}
