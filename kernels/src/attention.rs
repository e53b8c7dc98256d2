//! Attention over a paged KV cache: FlashAttention (tiled, online softmax) and standard
//! attention (materialized scores, any head_dim), plus the KV write ("reshape and cache").
//!
//! CONTRACT:
//! - Layout of one layer's cache pool (K and V each): `[num_blocks, block_size, kv_heads,
//!   head_dim]` in `KvPool::dtype` (f32, f16 or bf16). A sequence's position `p` lives in
//!   block `block_table[p / block_size]`, row `p % block_size`. The block table is just an
//!   index array here: kernels know nothing of allocation.
//! - `q` is `[tokens, n_heads, head_dim]` f32 (rope already applied); `out` likewise.
//!   Query row `i` of sequence `s` (global row `s.q_start + i`) is at absolute position
//!   `s.ctx_len - s.q_len + i` and attends causally to positions `0..=that` of its sequence.
//!   Its K/V (including the new tokens') are read from the pool: `write_kv` runs first.
//! - GQA: query head `h` uses kv head `h / (n_heads / kv_heads)`. Scale is given.
//! - Batch invariance: the result for one query row depends only on that row, its
//!   sequence's cache contents and its position: not on `q_len`, on other sequences or on
//!   thread count. FlashAttention tiles KV positions at fixed absolute boundaries so that a
//!   prompt prefilled in one go, in chunks, or decoded token by token gives identical bits.
//! - FlashAttention never materializes a `[q_len, ctx_len]` score matrix: scratch is bounded
//!   by the tile sizes (`flash_scratch_bytes`). Standard attention materializes scores.
//! - Decode (q_len = 1) must be fast: read each K/V row once per kv head for all the query
//!   heads of its group.

use crate::DType;

/// One layer's K and V pools, read-only.
#[derive(Clone, Copy)]
pub struct KvPool<'a> {
    pub dtype: DType,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub k: &'a [u8],
    pub v: &'a [u8],
}

/// One layer's K and V pools, for writing.
pub struct KvPoolMut<'a> {
    pub dtype: DType,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub k: &'a mut [u8],
    pub v: &'a mut [u8],
}

/// One sequence's slice of the batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqSpan<'a> {
    /// First row of this sequence in `q` / `out`.
    pub q_start: usize,
    /// Number of new query rows.
    pub q_len: usize,
    /// Positions in the cache after this step's write (cached + new).
    pub ctx_len: usize,
    pub block_table: &'a [u32],
}

#[derive(Clone, Copy, Debug)]
pub struct AttentionCase {
    pub head_dim: usize,
    pub n_heads: usize,
    pub kv_heads: usize,
    pub kv_dtype: DType,
}

/// Shape parameters shared by both kernels.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// FlashAttention supports head_dim a multiple of 16 (the ops-transformer rule; it is also
/// one AVX-512 register of f32).
pub fn flash_supports(case: &AttentionCase) -> Result<(), String> {
    let _ = case;
    unimplemented!()
}

/// Standard attention supports any head_dim.
pub fn standard_supports(case: &AttentionCase) -> Result<(), String> {
    let _ = case;
    unimplemented!()
}

/// Writes K/V rows (`[tokens, kv_heads, head_dim]` f32) into the pool at `slots`
/// (slot = block * block_size + row), converting to the pool dtype.
pub fn write_kv(k: &[f32], v: &[f32], slots: &[u32], pool: &mut KvPoolMut<'_>) {
    let _ = (k, v, slots, pool);
    unimplemented!()
}

pub fn flash_attention(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    let _ = (q, pool, seqs, p, out);
    unimplemented!()
}

pub fn standard_attention(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    let _ = (q, pool, seqs, p, out);
    unimplemented!()
}

/// Upper bound of the scratch bytes `flash_attention` allocates for a call, whatever the
/// sequence lengths (depends on tile sizes, head_dim, heads and thread count only).
pub fn flash_scratch_bytes(p: &AttnParams, threads: usize) -> usize {
    let _ = (p, threads);
    unimplemented!()
}
