//! Attention over a paged KV cache: FlashAttention (tiled, online softmax) and standard
//! attention (materialized scores, any head_dim), plus the KV write ("reshape and cache").
//!
//! CONTRACT:
//! - Layout of one layer's cache pool (K and V each): `[num_blocks, block_size, kv_heads,
//!   head_dim]` in `KvPool::dtype` (f32, f16, bf16, or q8_0: each head row as `head_dim / 32`
//!   GGUF Q8_0 blocks, an f16 scale and 32 signed bytes, see [`kv_q8`]). A sequence's position `p` lives in
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
//!
//! Shapes are built by the orchestrator, so a mismatch is a bug there: the kernels check
//! every shape, slot and block id up front and panic naming it (before touching memory).
//!
//! FlashAttention tiling: KV positions in tiles of `AttnParams::tile_kv` (default [`FLASH_TILE`];
//! any of [`FLASH_TILES`]) at absolute multiples of
//! it; work items are (sequence, kv head, block of [`FLASH_ROW_BLOCK`] query rows), each
//! running all the query heads of the GQA group over one staged tile at a time (K converted
//! to f32 and transposed, so each K/V row is read from the cache once per item). Queries run
//! 4 at a time on AVX-512 (2 on AVX2/scalar) to share K/V loads, but a query's arithmetic
//! never mixes with its neighbours': tile `t` covers positions `t*tile_kv ..` up to the
//! row's own position, each score is one FMA chain over head_dim in order, the online
//! softmax (exp: Cephes polynomial on SIMD, libm on scalar) and the P·V sum go in position
//! order. Results may differ between ISAs, never between batches or thread counts.

mod flash;
pub mod kv_q8;
pub mod reference;
mod standard;

use crate::isa::{self, Isa};
use crate::DType;

pub use flash::{FLASH_ROW_BLOCK, FLASH_TILE, FLASH_TILES};

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

use tboost_ops::Unsupported;
pub use tboost_ops::{AttentionCase, AttnParams};

/// FlashAttention supports head_dim a multiple of 16 (the ops-transformer rule; it is also
/// one AVX-512 register of f32).
pub fn flash_supports(case: &AttentionCase) -> Result<(), Unsupported> {
    shape_supports(case.head_dim, case.n_heads, case.kv_heads, case.kv_dtype)?;
    if case.act_dtype != DType::F32 {
        return Err(Unsupported::new("act_dtype", case.act_dtype, "f32"));
    }
    flash_head_dim(case.head_dim)
}

/// FlashAttention's KV tile (`AttnParams::tile_kv`): one it is compiled for, a power of two
/// in 16..=256.
pub fn flash_tile_supports(tile_kv: usize) -> Result<(), Unsupported> {
    tboost_ops::check_tile_kv(tile_kv)
}

fn flash_head_dim(head_dim: usize) -> Result<(), Unsupported> {
    if !head_dim.is_multiple_of(16) {
        return Err(Unsupported::new("head_dim", head_dim, "a multiple of 16"));
    }
    Ok(())
}

/// Standard attention supports any head_dim.
pub fn standard_supports(case: &AttentionCase) -> Result<(), Unsupported> {
    shape_supports(case.head_dim, case.n_heads, case.kv_heads, case.kv_dtype)?;
    if case.act_dtype != DType::F32 {
        return Err(Unsupported::new("act_dtype", case.act_dtype, "f32"));
    }
    Ok(())
}

fn shape_supports(head_dim: usize, n_heads: usize, kv_heads: usize, kv_dtype: DType) -> Result<(), Unsupported> {
    if head_dim == 0 {
        return Err(Unsupported::new("head_dim", 0, "at least 1"));
    }
    if n_heads == 0 || kv_heads == 0 || !n_heads.is_multiple_of(kv_heads) {
        return Err(Unsupported::new("n_heads", n_heads, format!("a non-zero multiple of kv_heads={kv_heads}")));
    }
    match kv_dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        // Q8_0 blocks must not straddle two heads' rows.
        DType::Q8_0 if head_dim.is_multiple_of(kv_q8::BLOCK) => Ok(()),
        DType::Q8_0 => Err(Unsupported::new("head_dim", head_dim, "a multiple of 32 for a q8_0 KV cache")),
        other => Err(Unsupported::new("kv_dtype", other, "f32, f16, bf16 or q8_0")),
    }
}

/// Bytes of one head's row (`head_dim` values) in a cache pool of `dtype`.
fn row_bytes(dtype: DType, head_dim: usize) -> usize {
    match dtype {
        DType::F32 => 4 * head_dim,
        DType::F16 | DType::BF16 => 2 * head_dim,
        DType::Q8_0 if head_dim.is_multiple_of(kv_q8::BLOCK) => kv_q8::row_bytes(head_dim),
        other => {
            panic!("attention: kv cache dtype {other} with head_dim {head_dim} is not supported (f32, f16, bf16, q8_0)")
        }
    }
}

/// Number of blocks in a pool of `bytes`, checking that the size is whole.
fn pool_blocks(what: &str, dtype: DType, block_size: usize, kv_heads: usize, head_dim: usize, bytes: usize) -> usize {
    assert!(block_size > 0 && kv_heads > 0 && head_dim > 0, "{what}: block_size, kv_heads and head_dim must be > 0");
    let block_bytes = block_size * kv_heads * row_bytes(dtype, head_dim);
    assert!(
        bytes.is_multiple_of(block_bytes),
        "{what}: pool of {bytes} bytes is not a whole number of {block_bytes}-byte blocks \
         ({block_size} x {kv_heads} kv heads x {head_dim} x {dtype})"
    );
    bytes / block_bytes
}

/// Writes K/V rows (`[tokens, kv_heads, head_dim]` f32) into the pool at `slots`
/// (slot = block * block_size + row), converting to the pool dtype with round-to-nearest-even.
pub fn write_kv(k: &[f32], v: &[f32], slots: &[u32], pool: &mut KvPoolMut<'_>) {
    let row = pool.kv_heads * pool.head_dim;
    assert_eq!(pool.k.len(), pool.v.len(), "write_kv: K pool has {} bytes, V pool {}", pool.k.len(), pool.v.len());
    let blocks = pool_blocks("write_kv", pool.dtype, pool.block_size, pool.kv_heads, pool.head_dim, pool.k.len());
    let n_slots = blocks * pool.block_size;
    assert!(
        k.len() == slots.len() * row && v.len() == k.len(),
        "write_kv: {} slots of {} kv heads x {} need {} values, got k {} v {}",
        slots.len(),
        pool.kv_heads,
        pool.head_dim,
        slots.len() * row,
        k.len(),
        v.len()
    );
    let slot_bytes = pool.kv_heads * row_bytes(pool.dtype, pool.head_dim);
    for (t, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        assert!(slot < n_slots, "write_kv: slot {slot} is outside the pool ({n_slots} slots)");
        let dst = slot * slot_bytes..(slot + 1) * slot_bytes;
        let src = t * row..(t + 1) * row;
        store_row(pool.dtype, &k[src.clone()], &mut pool.k[dst.clone()]);
        store_row(pool.dtype, &v[src], &mut pool.v[dst]);
    }
}

fn store_row(dtype: DType, src: &[f32], dst: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        // `half` rounds to nearest, ties to even, for both.
        DType::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes());
            }
        }
        // Whole rows of all kv heads: blocks never straddle heads (head_dim % 32 == 0).
        DType::Q8_0 => kv_q8::quantize_row(src, dst),
        other => unreachable!("row_bytes rejected {other}"),
    }
}

/// FlashAttention with the active ISA (see the module docs for the contract).
pub fn flash_attention(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    flash_attention_with(isa::active(), q, pool, seqs, p, out)
}

/// FlashAttention with an explicit ISA (tests of every path). Panics if the CPU lacks `isa`.
pub fn flash_attention_with(
    isa: Isa,
    q: &[f32],
    pool: &KvPool<'_>,
    seqs: &[SeqSpan<'_>],
    p: &AttnParams,
    out: &mut [f32],
) {
    if let Err(e) = shape_supports(p.head_dim, p.n_heads, p.kv_heads, pool.dtype)
        .and(flash_head_dim(p.head_dim))
        .and(flash_tile_supports(p.tile_kv))
    {
        panic!("flash_attention: {e}");
    }
    check_isa(isa);
    check_call("flash_attention", q, pool, seqs, p, out);
    in_rotated(q, pool, seqs, p, out, |q, out| flash::run(isa, q, pool, seqs, p, out));
}

/// Standard attention (materialized scores; any head_dim).
pub fn standard_attention(q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    if let Err(e) = shape_supports(p.head_dim, p.n_heads, p.kv_heads, pool.dtype) {
        panic!("standard_attention: {e}");
    }
    check_call("standard_attention", q, pool, seqs, p, out);
    in_rotated(q, pool, seqs, p, out, |q, out| standard::run(q, pool, seqs, p, out));
}

/// Runs `kernel` in the basis the pool's rows are stored in: a Q8_0 pool holds `H k` and
/// `H v` ([`kv_q8`]), so the kernel gets `H q` and its output rows (those of `seqs` only:
/// the caller may own the others) are rotated back. Other pools run as they are.
fn in_rotated(
    q: &[f32],
    pool: &KvPool<'_>,
    seqs: &[SeqSpan<'_>],
    p: &AttnParams,
    out: &mut [f32],
    kernel: impl FnOnce(&[f32], &mut [f32]),
) {
    if pool.dtype != DType::Q8_0 {
        return kernel(q, out);
    }
    let mut hq = q.to_vec();
    kv_q8::rotate(&mut hq);
    kernel(&hq, out);
    let row = p.n_heads * p.head_dim;
    for s in seqs {
        kv_q8::rotate(&mut out[s.q_start * row..(s.q_start + s.q_len) * row]);
    }
}

/// Upper bound of the scratch bytes `flash_attention` holds for a call, whatever the
/// sequence lengths (depends on tile sizes, head_dim, heads and thread count only): one
/// buffer per pool thread, allocated by its first call of this size and kept for later ones.
pub fn flash_scratch_bytes(p: &AttnParams, threads: usize) -> usize {
    flash::scratch_floats(p) * 4 * threads.max(1)
}

fn check_isa(isa: Isa) {
    assert!(
        isa <= isa::detected(),
        "attention: ISA {} requested but this CPU supports {}",
        isa.name(),
        isa::detected().name()
    );
}

/// Checks every shape, block id and row range the kernels rely on. Query rows of different sequences must not overlap (they are written in
/// parallel).
fn check_call(what: &str, q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    assert!(
        pool.kv_heads == p.kv_heads && pool.head_dim == p.head_dim,
        "{what}: pool has {} kv heads x {}, params say {} x {}",
        pool.kv_heads,
        pool.head_dim,
        p.kv_heads,
        p.head_dim
    );
    assert_eq!(pool.k.len(), pool.v.len(), "{what}: K pool has {} bytes, V pool {}", pool.k.len(), pool.v.len());
    let blocks = pool_blocks(what, pool.dtype, pool.block_size, pool.kv_heads, pool.head_dim, pool.k.len());
    let row = p.n_heads * p.head_dim;
    assert!(
        q.len().is_multiple_of(row) && out.len() == q.len(),
        "{what}: q has {} values and out {}, expected equal multiples of {} heads x {}",
        q.len(),
        out.len(),
        p.n_heads,
        p.head_dim
    );
    let tokens = q.len() / row;
    let mut sorted = true;
    let mut prev_end = 0;
    for (i, s) in seqs.iter().enumerate() {
        assert!(
            s.q_len <= s.ctx_len && s.q_start + s.q_len <= tokens,
            "{what}: sequence {i} (rows {}..{} of {tokens}, q_len {}, ctx_len {}) must fit in q and have q_len <= ctx_len",
            s.q_start,
            s.q_start + s.q_len,
            s.q_len,
            s.ctx_len
        );
        let need = s.ctx_len.div_ceil(pool.block_size);
        assert!(
            s.block_table.len() >= need,
            "{what}: sequence {i} has {} positions but its block table lists {} blocks of {}",
            s.ctx_len,
            s.block_table.len(),
            pool.block_size
        );
        // Blocks wholly behind the first row's sliding window are never read (and may have
        // been given back).
        let skip = (p.first_visible(s.ctx_len - s.q_len) / pool.block_size).min(need);
        if let Some(&b) = s.block_table[skip..need].iter().find(|&&b| b as usize >= blocks) {
            panic!("{what}: sequence {i} uses block {b} of a pool of {blocks}");
        }
        if s.q_len > 0 {
            sorted &= s.q_start >= prev_end;
            prev_end = s.q_start + s.q_len;
        }
    }
    if !sorted {
        let mut spans: Vec<(usize, usize)> =
            seqs.iter().filter(|s| s.q_len > 0).map(|s| (s.q_start, s.q_start + s.q_len)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{what}: query rows {:?} and {:?} of two sequences overlap", w[0], w[1]);
        }
    }
}

/// `*mut f32` that parallel work items share; each writes disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: items write disjoint ranges (checked by `check_call`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Where a sequence's position `pos` of kv head `g` starts in a pool, in bytes (`rb`: one
/// head row's bytes, [`row_bytes`]).
#[inline(always)]
fn row_offset(pool: &KvPool<'_>, table: &[u32], pos: usize, g: usize, rb: usize) -> usize {
    let bs = pool.block_size;
    let slot = table[pos / bs] as usize * bs + pos % bs;
    (slot * pool.kv_heads + g) * rb
}
