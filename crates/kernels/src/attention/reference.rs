//! Plain f64 references for the attention kernels' tests.

use super::{AttnParams, KvPool, SeqSpan};
use crate::DType;

/// Value `d` of the K (`v = false`) or V row of position `pos`, kv head `g`, as f64.
pub fn pool_value(pool: &KvPool<'_>, v: bool, table: &[u32], pos: usize, g: usize, d: usize) -> f64 {
    let bytes = if v { pool.v } else { pool.k };
    let slot = table[pos / pool.block_size] as usize * pool.block_size + pos % pool.block_size;
    let i = (slot * pool.kv_heads + g) * pool.head_dim + d;
    if pool.dtype == DType::Q8_0 {
        // Block `i / 32` of the row-major Q8_0 stream (f16 scale, then 32 signed bytes) holds
        // `H x`; `H` is symmetric, so value `j` of `x` is row `j` of `H` against the block.
        let b = i / 32 * 34;
        let scale = half::f16::from_le_bytes([bytes[b], bytes[b + 1]]).to_f64();
        let j = i % 32;
        let hx = (0..32).map(|c| {
            let sign = if (j & c).count_ones().is_multiple_of(2) { 1.0 } else { -1.0 };
            sign * scale * (bytes[b + 2 + c] as i8) as f64
        });
        return hx.sum::<f64>() / 32f64.sqrt();
    }
    match pool.dtype {
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()) as f64,
        DType::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f64(),
        other => panic!("reference attention: kv dtype {other} is not supported"),
    }
}

/// Causal (and, with `p.window`, sliding-window) attention of every query row, in f64 (`[tokens, n_heads, head_dim]`; rows that no
/// sequence covers stay 0).
pub fn attention(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams) -> Vec<f64> {
    let hd = p.head_dim;
    let group = p.n_heads / p.kv_heads;
    let mut out = vec![0.0f64; q.len()];
    for s in seqs {
        for r in 0..s.q_len {
            let pos = s.ctx_len - s.q_len + r;
            for h in 0..p.n_heads {
                let g = h / group;
                let qo = ((s.q_start + r) * p.n_heads + h) * hd;
                let lo = p.first_visible(pos);
                let scores: Vec<f64> = (lo..=pos)
                    .map(|j| {
                        let dot: f64 =
                            (0..hd).map(|d| q[qo + d] as f64 * pool_value(pool, false, s.block_table, j, g, d)).sum();
                        dot * p.scale as f64
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    out[qo + d] =
                        (lo..=pos).map(|j| e[j - lo] * pool_value(pool, true, s.block_table, j, g, d)).sum::<f64>()
                            / sum;
                }
            }
        }
    }
    out
}
