//! Paged attention with `aclnnFusedInferAttentionScore` (the newest of V4/V3/V2 present) and the KV
//! write with `aclnnScatterPaKvCache`.
//!
//! Layout (ascend-sys README, research §2.4):
//! - KV pools: each layer's K and V buffer is `[num_blocks, block_size, kv_heads, head_dim]`, which
//!   is FIA's BnBsH cache `[blocks, block_size, kv_heads·head_dim]` and ScatterPaKvCache's "Norm"
//!   cache at once; slot = block · block_size + offset; INT32 slot mapping and block tables (an unused
//!   block-table entry, `u32::MAX`, reads as -1).
//! - Query/out BSND. Decodes: every sequence of the run in one call, `[count, 1, heads, head_dim]`
//!   (Q_S == 1 is FIA's IncreFlashAttention branch; no mask). Prefill chunks: one call per sequence,
//!   `[1, q_len, heads, head_dim]` (BSND cannot hold sequences of different lengths without padding
//!   them into a copy), `sparseMode` 3 (rightDownCausal: row i sees keys j ≤ i + kv_len − q_len, which
//!   is chunked prefill over a cached prefix) with the optimized 2048×2048 causal mask.
//! - Lengths are host `aclIntArray`s from the host copy of the seq table `set_step` kept
//!   (`actualSeqLengths` = q_len, `actualSeqLengthsKv` = ctx_len); block ids are checked against the
//!   pool on the host before a kernel could read out of bounds.

use ascend_sys::aclnn::{self, FusedInferAttention};
use tboost_ops::{AttnParams, DType};

use super::memory::{Const, MASK_SIDE};
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{AttnKind, KvLayer, SeqRange, View};
use crate::Result;

impl AscendBackend {
    pub(super) fn write_kv(&mut self, k: View, v: View, slots: View, cache: &KvLayer) -> Result<()> {
        let row = cache.kv_heads * cache.head_dim;
        let t = slots.len;
        if k.len != t * row || v.len != t * row {
            return Err(be_err(format!("write_kv: {} / {} values for {t} slots of {row}", k.len, v.len)));
        }
        if t == 0 {
            return Ok(());
        }
        let capacity = cache.num_blocks * cache.block_size;
        if let Some(&bad) = self.step.slots.iter().find(|&&s| s as usize >= capacity) {
            if self.step.views.is_some_and(|sv| sv.slots == slots) {
                return Err(be_err(format!("write_kv: KV slot {bad} beyond the pool's {capacity} slots")));
            }
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (kd, cd) = (m.dtype(k)?, m.buf(cache.k)?.dtype);
        if kd != cd || m.dtype(v)? != cd || m.buf(cache.v)?.dtype != cd {
            return Err(be_err(format!(
                "write_kv: k/v are {kd} but the cache is {cd} (ScatterPaKvCache keeps one dtype)"
            )));
        }
        let pool = [cache.num_blocks, cache.block_size, cache.kv_heads, cache.head_dim];
        let n = capacity * row;
        let (kt, vt) =
            (m.tensor(k, &[t, cache.kv_heads, cache.head_dim])?, m.tensor(v, &[t, cache.kv_heads, cache.head_dim])?);
        let (kc, vc) = (m.tensor(View::new(cache.k, 0, n), &pool)?, m.tensor(View::new(cache.v, 0, n), &pool)?);
        let st = m.tensor(slots, &[t])?;
        aclnn::scatter_pa_kv_cache(ctx, &kt, &kc, &st, &vt, &vc).map_err(|e| acl_err("aclnnScatterPaKvCache", e))
    }

    pub(super) fn attention(
        &mut self,
        kind: AttnKind,
        q: View,
        cache: &KvLayer,
        seqs: &SeqRange,
        p: &AttnParams,
        out: View,
    ) -> Result<()> {
        if kind == AttnKind::Standard {
            return Err(be_err("standard attention has no aclnn mapping on Ascend (the plan runs it on the cpu)"));
        }
        if p.window > 0 {
            return Err(be_err("sliding-window attention is not mapped on Ascend (the plan runs it on the cpu)"));
        }
        let (nh, kvh, hd) = (p.n_heads, p.kv_heads, p.head_dim);
        let width = nh * hd;
        if q.len != out.len || width == 0 || !q.len.is_multiple_of(width) {
            return Err(be_err(format!("attention: q of {} and out of {} values for rows of {width}", q.len, out.len)));
        }
        if (kvh, hd) != (cache.kv_heads, cache.head_dim) {
            return Err(be_err("attention: the params disagree with the cache's kv_heads/head_dim"));
        }
        let table = self
            .step_host(seqs.seqs, |s| s.seqs, |s| s.seqs.as_flattened())
            .ok_or_else(|| {
                be_err("attention: the SeqRange does not name the seq table set_step uploaded (FIA takes lengths on the host)")
            })?
            .to_vec();
        let mb = seqs.max_blocks;
        let blocks = self
            .step_host(seqs.block_tables, |s| s.block_tables, |s| &s.block_tables)
            .ok_or_else(|| be_err("attention: the SeqRange does not name the block tables set_step uploaded"))?
            .to_vec();
        if table.len() != seqs.count * 3 || blocks.len() != seqs.count * mb {
            return Err(be_err("attention: the SeqRange's views do not hold its count of sequences"));
        }
        let total_rows = q.len / width;
        let bs = cache.block_size;
        let mut rows: Vec<(usize, usize, usize)> = Vec::with_capacity(seqs.count);
        for (i, s) in table.chunks_exact(3).enumerate() {
            let (q_start, q_len, ctx_len) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let used = ctx_len.div_ceil(bs.max(1));
            if q_len == 0 || q_len > ctx_len || used > mb || q_start + q_len > total_rows {
                return Err(be_err(format!(
                    "attention: sequence {i}: rows {q_start}+{q_len} of context {ctx_len} do not fit the step"
                )));
            }
            if let Some(&b) = blocks[i * mb..i * mb + used].iter().find(|&&b| b as usize >= cache.num_blocks) {
                return Err(be_err(format!(
                    "attention: sequence {i}: block {b} is beyond the pool's {} (the device would read out of bounds)",
                    cache.num_blocks
                )));
            }
            rows.push((q_start, q_len, ctx_len));
        }
        let act = self.mem.dtype(q)?;
        let kv = self.mem.buf(cache.k)?.dtype;
        if kv != act || self.mem.dtype(out)? != act || self.mem.buf(cache.v)?.dtype != kv {
            return Err(be_err(format!("attention: q/out {act} with a {kv} cache (FIA takes one dtype)")));
        }
        let decodes = rows.iter().all(|r| r.1 == 1) && rows.iter().enumerate().all(|(j, r)| r.0 == rows[0].0 + j);
        if rows.iter().any(|r| r.1 > 1) {
            self.mem.ensure_const(Const::CausalMask)?;
        }
        let scale = p.scale as f64;
        if decodes {
            // Every decode of the run in one call.
            let lkv: Vec<i64> = rows.iter().map(|r| r.2 as i64).collect();
            return self.fia(
                q,
                out,
                cache,
                seqs.block_tables,
                nh,
                kvh,
                hd,
                rows[0].0,
                rows.len(),
                1,
                None,
                &lkv,
                scale,
            );
        }
        for (j, &(q_start, q_len, ctx_len)) in rows.iter().enumerate() {
            let bt = seqs.block_tables.sub(j * mb, mb);
            let (lq, lkv) = ([q_len as i64], [ctx_len as i64]);
            let causal = (q_len > 1).then_some(&lq[..]);
            self.fia(q, out, cache, bt, nh, kvh, hd, q_start, 1, q_len, causal, &lkv, scale)?;
        }
        Ok(())
    }

    /// One FIA call over `b` sequences of `s` query rows from row `row` (`s > 1`: prefill with the
    /// causal mask and `lq`; `s == 1`: decode).
    #[allow(clippy::too_many_arguments)]
    fn fia(
        &mut self,
        q: View,
        out: View,
        cache: &KvLayer,
        block_tables: View,
        nh: usize,
        kvh: usize,
        hd: usize,
        row: usize,
        b: usize,
        s: usize,
        lq: Option<&[i64]>,
        lkv: &[i64],
        scale: f64,
    ) -> Result<()> {
        let width = nh * hd;
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let shape = [b, s, nh, hd];
        let qt = m.tensor(q.sub(row * width, b * s * width), &shape)?;
        let ot = m.tensor(out.sub(row * width, b * s * width), &shape)?;
        let n = cache.num_blocks * cache.block_size * kvh * hd;
        let pool = [cache.num_blocks, cache.block_size, kvh * hd];
        let (kc, vc) = (m.tensor(View::new(cache.k, 0, n), &pool)?, m.tensor(View::new(cache.v, 0, n), &pool)?);
        let mut a = FusedInferAttention::new(qt, kc, vc, ot, nh as i64, kvh as i64, scale);
        a.block_table = Some(m.tensor(block_tables, &[b, block_tables.len / b.max(1)])?);
        a.block_size = cache.block_size as i64;
        a.actual_seq_lengths_kv = Some(lkv);
        if s > 1 {
            a.actual_seq_lengths = lq;
            a.atten_mask = Some(m.constant(Const::CausalMask, DType::U8, &[MASK_SIDE, MASK_SIDE])?);
            a.sparse_mode = 3;
        }
        aclnn::fused_infer_attention_score(ctx, &a).map(|_| ()).map_err(|e| acl_err("aclnnFusedInferAttentionScore", e))
    }
}
