//! Standard attention: materialized `[q_len, ctx_len]` scores per (sequence, head), any
//! head_dim. The fallback when FlashAttention does not support the case.

use rayon::prelude::*;

use super::{kv_q8, row_bytes, row_offset, AttnParams, KvPool, OutPtr, SeqSpan};
use crate::DType;

pub(super) fn run(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    let out = OutPtr(out.as_mut_ptr());
    let n_heads = p.n_heads;
    (0..seqs.len() * n_heads).into_par_iter().for_each(|i| {
        let (s, h) = (i / n_heads, i % n_heads);
        if seqs[s].q_len > 0 {
            // SAFETY: (sequence, head) items write disjoint rows/heads of `out`.
            unsafe { head(q, pool, &seqs[s], p, h, out) }
        }
    });
}

/// Dot product with 8 independent partial sums and a fixed final tree: one order for
/// every call, whatever the batch.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, at) = a.split_at(a.len() / 8 * 8);
    let (bc, bt) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in at.iter().zip(bt) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

fn load_row(dtype: DType, bytes: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        // Q8_0, the only other type `check_call` admits.
        // SAFETY: `bytes` holds one head row of `dst.len()` values (the caller sliced it).
        _ => unsafe { kv_q8::dequantize_row(bytes.as_ptr(), dst.as_mut_ptr(), dst.len()) },
    }
}

/// Floats of one work item's score block: query rows are processed in blocks of at most
/// `max(1, SCORE_BLOCK_FLOATS / ctx_len)` rows, so the scores materialized at once stay at
/// 16 MiB per item however long the prompt chunk and the context are (a whole
/// `[q_len, ctx_len]` matrix could be gigabytes). Every value is computed exactly as
/// without blocking (a row's scores, softmax and P·V depend only on that row), so blocking
/// changes no bit.
const SCORE_BLOCK_FLOATS: usize = 1 << 22;

/// All query rows of one sequence for query head `h`.
unsafe fn head(q: &[f32], pool: &KvPool<'_>, seq: &SeqSpan<'_>, p: &AttnParams, h: usize, out: OutPtr) {
    let hd = p.head_dim;
    let g = h / (p.n_heads / p.kv_heads);
    let rb = row_bytes(pool.dtype, hd);
    let (q_len, ctx) = (seq.q_len, seq.ctx_len);
    let first = ctx - q_len;
    let qrow = |r: usize| &q[((seq.q_start + r) * p.n_heads + h) * hd..][..hd];
    let rows_per_block = (SCORE_BLOCK_FLOATS / ctx.max(1)).clamp(1, q_len.max(1));
    let mut scores = vec![0.0f32; rows_per_block * ctx];
    let mut acc = vec![0.0f32; rows_per_block * hd];
    let mut kv = vec![0.0f32; hd];
    // Rows of query positions `first + r` see positions `lo(r) ..= first + r` (`lo` is 0
    // without a sliding window).
    let lo = |r: usize| p.first_visible(first + r);
    // The rows that see position j: from the first whose position reaches j to the last whose
    // window still holds it.
    let rows_of = |j: usize, r0: usize, r1: usize| {
        let from = r0.max(j.saturating_sub(first));
        let to = if p.window == 0 { r1 } else { r1.min((j + p.window).saturating_sub(first)) };
        from..to.max(from)
    };
    for r0 in (0..q_len).step_by(rows_per_block) {
        let r1 = (r0 + rows_per_block).min(q_len);
        // Rows r0..r1 (positions first + r) see positions lo(r0)..first + r1 at most.
        let (start, end) = (lo(r0), first + r1);
        // Loop over positions outside so each K/V row is converted once per block; each row
        // still sums in position order.
        for j in start..end {
            let off = row_offset(pool, seq.block_table, j, g, rb);
            load_row(pool.dtype, &pool.k[off..off + rb], &mut kv);
            for r in rows_of(j, r0, r1) {
                scores[(r - r0) * ctx + j] = dot(qrow(r), &kv) * p.scale;
            }
        }
        for r in r0..r1 {
            let row = &mut scores[(r - r0) * ctx + lo(r)..(r - r0) * ctx + first + r + 1];
            let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0f32;
            for x in row.iter_mut() {
                *x = (*x - mx).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
        acc[..(r1 - r0) * hd].fill(0.0);
        for j in start..end {
            let off = row_offset(pool, seq.block_table, j, g, rb);
            load_row(pool.dtype, &pool.v[off..off + rb], &mut kv);
            for r in rows_of(j, r0, r1) {
                let pj = scores[(r - r0) * ctx + j];
                for (a, v) in acc[(r - r0) * hd..(r - r0 + 1) * hd].iter_mut().zip(&kv) {
                    *a += pj * v;
                }
            }
        }
        for r in r0..r1 {
            let dst = out.0.add(((seq.q_start + r) * p.n_heads + h) * hd);
            std::ptr::copy_nonoverlapping(acc.as_ptr().add((r - r0) * hd), dst, hd);
        }
    }
}
