//! Paged attention with `aclnnFusedInferAttentionScore` (the newest of V4/V3/V2 present) and the KV
//! write with `aclnnScatterPaKvCache`.
//!
//! Layout (ascend-sys README, research §2.4):
//! - KV pools: each layer's K and V buffer is `[num_blocks, block_size, kv_heads, head_dim]`, which
//!   is FIA's BnBsH cache `[blocks, block_size, kv_heads·head_dim]` and ScatterPaKvCache's "Norm"
//!   cache at once; slot = block · block_size + offset; INT32 slot mapping and block tables (an unused
//!   block-table entry, `u32::MAX`, reads as -1).
//! - Query/out BSND. Decodes: every sequence of the run in one call, `[count, 1, heads, head_dim]`
//!   (Q_S == 1 is FIA's IncreFlashAttention branch; no mask without a window). Prefill chunks: one call per sequence,
//!   `[1, q_len, heads, head_dim]` (BSND cannot hold sequences of different lengths without padding
//!   them into a copy), `sparseMode` 3 (rightDownCausal: row i sees keys j ≤ i + kv_len − q_len, which
//!   is chunked prefill over a cached prefix) with the optimized 2048×2048 causal mask.
//! - Lengths are host `aclIntArray`s from the host copy of the seq table `set_step` kept
//!   (`actualSeqLengths` = q_len, `actualSeqLengthsKv` = ctx_len); block ids are checked against the
//!   pool on the host before a kernel could read out of bounds.
//! - Sliding window `W` (Gemma 3's sliding layers, Mistral): a query at position `p` sees keys
//!   `p-W+1..=p`. Prefill chunks: `sparseMode` 4 (band, "参数起点为右下角": row i sees key j when
//!   `-preTokens <= j - i - (kv_len - q_len) <= nextTokens`, OT `docs/context/sparse_mode参数说明.md`)
//!   with `preTokens = W-1`, `nextTokens = 0` and the same 2048×2048 mask. Decodes: Q_S == 1 ignores
//!   sparseMode and preTokens/nextTokens ("Q_S为1时该参数无效", FIA V4 doc), so the window is an
//!   `attenMask` `[B, 1, 1, maxBlocks·blockSize]` (UINT8, 1 = masked; with page attention its last dim
//!   must be at least the block table's width × blockSize, same doc) built on the host from the
//!   lengths and uploaded per call. Blocks wholly behind a sequence's first row's window may have been
//!   given back to the pool (one window in every layer): the block table passed starts after them and
//!   the KV length shrinks by as much, which moves nothing relative to the right-down corner.

use ascend_sys::aclnn::{self, FusedInferAttention};
use tboost_ops::{AttnParams, DType};

use super::memory::{Const, Scratch, MASK_SIDE};
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
        let window = p.window;
        let mut rows: Vec<Row> = Vec::with_capacity(seqs.count);
        for (i, s) in table.chunks_exact(3).enumerate() {
            let (q_start, q_len, ctx_len) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let used = ctx_len.div_ceil(bs.max(1));
            if q_len == 0 || q_len > ctx_len || used > mb || q_start + q_len > total_rows {
                return Err(be_err(format!(
                    "attention: sequence {i}: rows {q_start}+{q_len} of context {ctx_len} do not fit the step"
                )));
            }
            // Blocks wholly behind the first row's window are never read (and may be given back).
            let skip = match window {
                0 => 0,
                w => ((ctx_len - q_len + 1).saturating_sub(w) / bs.max(1)).min(used),
            };
            if let Some(&b) = blocks[i * mb + skip..i * mb + used].iter().find(|&&b| b as usize >= cache.num_blocks) {
                return Err(be_err(format!(
                    "attention: sequence {i}: block {b} is beyond the pool's {} (the device would read out of bounds)",
                    cache.num_blocks
                )));
            }
            rows.push(Row { q_start, q_len, kv_len: ctx_len - skip * bs, skip });
        }
        let act = self.mem.dtype(q)?;
        let kv = self.mem.buf(cache.k)?.dtype;
        if kv != act || self.mem.dtype(out)? != act || self.mem.buf(cache.v)?.dtype != kv {
            return Err(be_err(format!("attention: q/out {act} with a {kv} cache (FIA takes one dtype)")));
        }
        let consecutive = rows.iter().enumerate().all(|(j, r)| r.q_start == rows[0].q_start + j);
        let decodes = rows.iter().all(|r| r.q_len == 1) && consecutive;
        if rows.iter().any(|r| r.q_len > 1) {
            self.mem.ensure_const(Const::CausalMask)?;
        }
        let scale = p.scale as f64;
        let geo = Geometry { nh, kvh, hd, scale, window };
        if decodes && rows.iter().all(|r| r.skip == 0) {
            // Every decode of the run in one call.
            return self.fia(q, out, cache, seqs.block_tables, &geo, &rows);
        }
        for (j, r) in rows.iter().enumerate() {
            // A window's trimmed table: the row's blocks from `skip` on (the rest of its width unused).
            let bt = seqs.block_tables.sub(j * mb + r.skip, mb - r.skip);
            self.fia(q, out, cache, bt, &geo, std::slice::from_ref(r))?;
        }
        Ok(())
    }

    /// One FIA call over the sequences `rows` (consecutive rows of `q`; several only for decodes),
    /// whose block tables are `block_tables` (`rows.len()` rows of equal width): prefill (one
    /// sequence of q_len > 1) with the causal mask, or the band of a sliding window; decodes with
    /// no mask, or the window's mask.
    fn fia(
        &mut self,
        q: View,
        out: View,
        cache: &KvLayer,
        block_tables: View,
        g: &Geometry,
        rows: &[Row],
    ) -> Result<()> {
        let (nh, kvh, hd) = (g.nh, g.kvh, g.hd);
        let b = rows.len();
        let s = rows.iter().map(|r| r.q_len).max().unwrap_or(1);
        if b == 0 || (s > 1 && b > 1) {
            return Err(be_err("attention: one prefill sequence or a run of decodes per FIA call"));
        }
        let width = nh * hd;
        let bw = block_tables.len / b;
        let (lq, lkv): (Vec<i64>, Vec<i64>) = rows.iter().map(|r| (r.q_len as i64, r.kv_len as i64)).unzip();
        // A decode's window: key j of the (trimmed) table is masked when j < kv_len - W.
        let decode_mask = (s == 1 && g.window > 0).then(|| {
            let cols = bw * cache.block_size;
            let mut m = vec![0u8; b * cols];
            for (i, r) in rows.iter().enumerate() {
                m[i * cols..i * cols + r.kv_len.saturating_sub(g.window)].fill(1);
            }
            m
        });
        if let Some(m) = &decode_mask {
            self.mem.ensure(Scratch::AttnMask, m.len())?;
            let buf = self.mem.scratch_buf(Scratch::AttnMask)?;
            // staged: ordered on the stream before this call, and before the next call overwrites it
            self.ctx.upload(m, buf, 0).map_err(|e| acl_err("attention: window mask upload", e))?;
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let row = rows[0].q_start;
        let shape = [b, s, nh, hd];
        let qt = m.tensor(q.sub(row * width, b * s * width), &shape)?;
        let ot = m.tensor(out.sub(row * width, b * s * width), &shape)?;
        let n = cache.num_blocks * cache.block_size * kvh * hd;
        let pool = [cache.num_blocks, cache.block_size, kvh * hd];
        let (kc, vc) = (m.tensor(View::new(cache.k, 0, n), &pool)?, m.tensor(View::new(cache.v, 0, n), &pool)?);
        let mut a = FusedInferAttention::new(qt, kc, vc, ot, nh as i64, kvh as i64, g.scale);
        a.block_table = Some(m.tensor(block_tables, &[b, bw])?);
        a.block_size = cache.block_size as i64;
        a.actual_seq_lengths_kv = Some(&lkv);
        if s > 1 {
            a.actual_seq_lengths = Some(&lq);
            a.atten_mask = Some(m.constant(Const::CausalMask, DType::U8, &[MASK_SIDE, MASK_SIDE])?);
            if g.window > 0 {
                a.sparse_mode = 4;
                a.pre_tokens = g.window as i64 - 1;
                a.next_tokens = 0;
            } else {
                a.sparse_mode = 3;
            }
        } else if decode_mask.is_some() {
            a.atten_mask = Some(m.scratch(Scratch::AttnMask, DType::U8, 0, &[b, 1, 1, bw * cache.block_size])?);
        }
        aclnn::fused_infer_attention_score(ctx, &a).map(|_| ()).map_err(|e| acl_err("aclnnFusedInferAttentionScore", e))
    }
}

/// One sequence of an attention call: its query rows, its KV length from the first block passed
/// (`skip` blocks behind a sliding window left out).
#[derive(Clone, Copy)]
struct Row {
    q_start: usize,
    q_len: usize,
    kv_len: usize,
    skip: usize,
}

/// What every FIA call of one attention op shares.
struct Geometry {
    nh: usize,
    kvh: usize,
    hd: usize,
    scale: f64,
    /// Sliding window (0: none).
    window: usize,
}
