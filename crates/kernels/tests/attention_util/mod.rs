//! Shared by the attention test binaries: a paged cache filled with random sequences, and
//! helpers that run one kernel call over any mix of (sequence, cached, new) rows.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tboost_kernels::attention::{write_kv, AttnParams, KvPool, KvPoolMut, SeqSpan};
use tboost_kernels::DType;

/// Bytes of one head row of `head_dim` values in a `dtype` pool (q8_0: 34 per 32 values).
pub fn row_bytes(dtype: DType, head_dim: usize) -> usize {
    dtype.bytes_for(head_dim).expect("a head_dim the cache dtype can hold")
}

/// One sequence: its block table and the f32 Q/K/V of every position.
pub struct Seq {
    pub len: usize,
    pub table: Vec<u32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// A cache pool holding several sequences in shuffled blocks.
pub struct World {
    pub dtype: DType,
    pub block_size: usize,
    pub p: AttnParams,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    pub seqs: Vec<Seq>,
}

impl World {
    /// `lens` sequences; Q scaled by `q_amp` (large values make softmax peaky and force
    /// the online max to move between tiles).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        seed: u64,
        dtype: DType,
        block_size: usize,
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        lens: &[usize],
        q_amp: f32,
    ) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let blocks_needed: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum();
        // A few spare blocks so ids do not simply count up.
        let num_blocks = blocks_needed + 3;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        free.shuffle(&mut rng);
        let pool_bytes = num_blocks * block_size * kv_heads * row_bytes(dtype, head_dim);
        let p = AttnParams::new(n_heads, kv_heads, head_dim, 1.0 / (head_dim as f32).sqrt());
        let mut w = World { dtype, block_size, p, k: vec![0u8; pool_bytes], v: vec![0u8; pool_bytes], seqs: vec![] };
        for &len in lens {
            let table: Vec<u32> = (0..len.div_ceil(block_size)).map(|_| free.pop().unwrap()).collect();
            let mut rnd = |n: usize, amp: f32| (0..n).map(|_| rng.random_range(-1.0f32..1.0) * amp).collect::<Vec<_>>();
            let q = rnd(len * n_heads * head_dim, q_amp);
            let k = rnd(len * kv_heads * head_dim, 1.0);
            let v = rnd(len * kv_heads * head_dim, 1.0);
            let slots: Vec<u32> =
                (0..len).map(|pos| table[pos / block_size] * block_size as u32 + (pos % block_size) as u32).collect();
            let mut pm = KvPoolMut { dtype, block_size, kv_heads, head_dim, k: &mut w.k, v: &mut w.v };
            write_kv(&k, &v, &slots, &mut pm);
            w.seqs.push(Seq { len, table, q, k, v });
        }
        w
    }

    pub fn pool(&self) -> KvPool<'_> {
        KvPool {
            dtype: self.dtype,
            block_size: self.block_size,
            kv_heads: self.p.kv_heads,
            head_dim: self.p.head_dim,
            k: &self.k,
            v: &self.v,
        }
    }

    pub fn row_len(&self) -> usize {
        self.p.n_heads * self.p.head_dim
    }

    /// Builds one call: each `(seq, ctx_len, q_len)` contributes its last `q_len` rows up to
    /// `ctx_len`, laid out after the previous one with `gap` unused rows in between. Runs
    /// `kernel` and returns, per part, its output rows.
    pub fn call<F>(&self, parts: &[(usize, usize, usize)], gap: usize, kernel: F) -> Vec<Vec<f32>>
    where
        F: FnOnce(&[f32], &KvPool<'_>, &[SeqSpan<'_>], &AttnParams, &mut [f32]),
    {
        let rl = self.row_len();
        let mut q = Vec::new();
        let mut spans = Vec::new();
        for &(s, ctx, ql) in parts {
            q.extend(std::iter::repeat_n(0.5f32, gap * rl));
            let seq = &self.seqs[s];
            spans.push(SeqSpan {
                q_start: q.len() / rl,
                q_len: ql,
                ctx_len: ctx,
                // Only the blocks the context needs: reading past it would panic.
                block_table: &seq.table[..ctx.div_ceil(self.block_size)],
            });
            q.extend_from_slice(&seq.q[(ctx - ql) * rl..ctx * rl]);
        }
        let mut out = vec![f32::NAN; q.len()];
        kernel(&q, &self.pool(), &spans, &self.p, &mut out);
        spans.iter().map(|s| out[s.q_start * rl..(s.q_start + s.q_len) * rl].to_vec()).collect()
    }
}

/// Bit patterns, for exact comparisons that also tell NaN apart.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
