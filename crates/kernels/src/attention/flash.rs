//! FlashAttention-2 on the CPU: online softmax over KV tiles at fixed absolute boundaries.

// Register arrays are indexed explicitly: it keeps the (query, vector) layout readable.
#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;
use std::cell::Cell;

use super::{kv_q8, row_bytes, row_offset, AttnParams, KvPool, OutPtr, SeqSpan};
use crate::isa::Isa;
use crate::simd::{Native, Scalar, MASK};
use crate::DType;

/// KV positions per tile by default (`AttnParams::tile_kv`). Tiles start at absolute
/// multiples of the tile, whatever the call.
pub const FLASH_TILE: usize = tboost_ops::DEFAULT_TILE_KV;
/// The tiles the kernel is compiled for (`AttnParams::tile_kv` takes one of these).
pub const FLASH_TILES: [usize; 5] = tboost_ops::TILE_KV_CHOICES;
/// Query rows per work item (each with all the query heads of its GQA group).
pub const FLASH_ROW_BLOCK: usize = 16;

/// Floats of one task's scratch: accumulators, running max and sum of every query in an
/// item, the staged K and V tile (converted from f16/bf16), K transposed, one zero row.
pub(super) fn scratch_floats(p: &AttnParams) -> usize {
    let nq = FLASH_ROW_BLOCK * (p.n_heads / p.kv_heads.max(1));
    nq * (p.head_dim + 2) + 3 * p.tile_kv * p.head_dim + p.head_dim
}

/// Everything a work item reads, shared by all items of a call.
struct Ctx<'a> {
    q: &'a [f32],
    pool: &'a KvPool<'a>,
    seqs: &'a [SeqSpan<'a>],
    n_heads: usize,
    group: usize,
    hd: usize,
    scale: f32,
    /// Sliding window (0: none), see `AttnParams::window`.
    window: usize,
    /// Bytes of one head row in the pool.
    rb: usize,
    out: OutPtr,
}

/// One work item: rows `r0..r1` of sequence `s`, kv head `g`.
type ItemFn = unsafe fn(&Ctx<'_>, usize, usize, usize, usize, &mut [f32]);

pub(super) fn run(isa: Isa, q: &[f32], pool: &KvPool<'_>, seqs: &[SeqSpan<'_>], p: &AttnParams, out: &mut [f32]) {
    let ctx = Ctx {
        q,
        pool,
        seqs,
        n_heads: p.n_heads,
        group: p.n_heads / p.kv_heads,
        hd: p.head_dim,
        scale: p.scale,
        window: p.window,
        rb: row_bytes(pool.dtype, p.head_dim),
        out: OutPtr(out.as_mut_ptr()),
    };
    let item: ItemFn = match p.tile_kv {
        16 => item_fn::<16>(isa),
        32 => item_fn::<32>(isa),
        128 => item_fn::<128>(isa),
        256 => item_fn::<256>(isa),
        // 64, the default (`flash_tile_supports` rejected every other value before the call).
        _ => item_fn::<FLASH_TILE>(isa),
    };
    let kv_heads = p.kv_heads;
    let floats = scratch_floats(p);
    // No per-call index arrays: items are enumerated on the fly, and each thread reuses
    // one scratch buffer across items and calls (`SCRATCH`), so a call allocates nothing
    // once every pool thread has run one of this size. (Allocating it per rayon split, as
    // `for_each_init` does, cost a decode step of 16 sequences about 125 zeroed 66 KiB
    // buffers on the small synthetic model.)
    seqs.par_iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            let nb = seq.q_len.div_ceil(FLASH_ROW_BLOCK);
            (0..kv_heads * nb).into_par_iter().map(move |i| (s, i / nb, i % nb))
        })
        .for_each(|(s, g, b)| {
            let mut scratch = SCRATCH.with(Cell::take);
            if scratch.len() < floats {
                scratch.resize(floats, 0.0);
            }
            let r0 = b * FLASH_ROW_BLOCK;
            let r1 = (r0 + FLASH_ROW_BLOCK).min(ctx.seqs[s].q_len);
            // SAFETY: the ISA was checked against the CPU; shapes by `check_call`. The
            // item writes every scratch value before reading it (left over from an earlier
            // item or call otherwise).
            unsafe { item(&ctx, s, g, r0, r1, &mut scratch[..floats]) };
            SCRATCH.with(|c| c.set(scratch));
        });
}

thread_local! {
    /// Each thread's scratch (`scratch_floats` of the largest call it has run), kept
    /// between calls: the steady decode step allocates none.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// The work-item function for tile `T` on `isa`.
fn item_fn<const T: usize>(isa: Isa) -> ItemFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => item_avx512::<T>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => item_avx2::<T>,
        _ => item_scalar::<T>,
    }
}

unsafe fn item_scalar<const T: usize>(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<Scalar, T>(c, s, g, r0, r1, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2<const T: usize>(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<crate::simd::Avx2, T>(c, s, g, r0, r1, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn item_avx512<const T: usize>(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<crate::simd::Avx512, T>(c, s, g, r0, r1, scratch)
}

/// Score vectors per chunk of positions: four, or as many as a tile narrower than four
/// vectors holds (a compile-time constant per `S` and `T`; 4 for the default tile).
#[inline(always)]
fn chunk_vectors<S: Native, const T: usize>() -> usize {
    (T / S::LANES).clamp(1, 4)
}

#[inline(always)]
unsafe fn process_item<S: Native, const T: usize>(
    c: &Ctx<'_>,
    s: usize,
    g: usize,
    r0: usize,
    r1: usize,
    scratch: &mut [f32],
) {
    let seq = &c.seqs[s];
    let hd = c.hd;
    let lanes = S::LANES;
    let nq = (r1 - r0) * c.group;
    let nq_max = FLASH_ROW_BLOCK * c.group;
    let (acc, rest) = scratch.split_at_mut(nq_max * hd);
    let (m, rest) = rest.split_at_mut(nq_max);
    let (l, rest) = rest.split_at_mut(nq_max);
    let (kst, rest) = rest.split_at_mut(T * hd);
    let (vst, rest) = rest.split_at_mut(T * hd);
    let (kt, zero) = rest.split_at_mut(T * hd);
    zero.fill(0.0);

    let first_pos = seq.ctx_len - seq.q_len;
    let last_pos = first_pos + r1 - 1;
    let mut kp = [zero.as_ptr(); T];
    let mut vp = [zero.as_ptr(); T];
    let item = Item { c, seq, g, r0, first_pos };
    // With a sliding window, tiles wholly before the first row's window are skipped.
    let lo_first = if c.window == 0 { 0 } else { (first_pos + r0 + 1).saturating_sub(c.window) };
    for t in lo_first / T..=last_pos / T {
        let t0 = t * T;
        let loaded = (last_pos + 1 - t0).min(T);
        stage::<S, T>(c, seq.block_table, g, t0, loaded, (lo_first, zero.as_ptr()), kst, vst, &mut kp, &mut vp);
        // Decode is bound by reading the cache: fetch the next tile while this one computes.
        prefetch_tile::<S, T>(c, seq.block_table, g, t0 + T, last_pos + 1);
        // K transposed to [head_dim][T]: scores then need no horizontal sums. Columns
        // past `loaded` are zero up to the score kernel's chunk so they stay finite (masked).
        let padded = loaded.next_multiple_of(lanes);
        for p in &mut kp[loaded..padded] {
            *p = zero.as_ptr();
        }
        for jb in (0..padded).step_by(lanes) {
            for db in (0..hd).step_by(lanes) {
                S::transpose(kp.as_ptr().add(jb), db, kt.as_mut_ptr().add(db * T + jb), T);
            }
        }
        let chunk_end = loaded.next_multiple_of(chunk_vectors::<S, T>() * lanes).min(T);
        if padded < chunk_end {
            for d in 0..hd {
                kt[d * T + padded..d * T + chunk_end].fill(0.0);
            }
        }
        // Rows before the tile's first position skip it.
        let first_row = r0.max(t0.saturating_sub(first_pos));
        // Rows whose window starts after this tile skip it (later rows, windows move on).
        let end_row = if c.window == 0 { r1 } else { r1.min((t0 + T + c.window - 1).saturating_sub(first_pos)) };
        let mut qi = (first_row - r0) * c.group;
        let nq_tile = (end_row.max(first_row) - r0) * c.group;
        // With a window each query has its own first tile (`group` finds it).
        let tile = Tile { t0, first: c.window == 0 && t == 0, kt: kt.as_ptr(), vp: &vp };
        while qi < nq_tile {
            let nb = (nq_tile - qi).min(S::QUERY_GROUP);
            match nb {
                1 => group::<S, T, 1>(&item, &tile, qi, acc, m, l),
                2 => group::<S, T, 2>(&item, &tile, qi, acc, m, l),
                3 => group::<S, T, 3>(&item, &tile, qi, acc, m, l),
                4 => group::<S, T, 4>(&item, &tile, qi, acc, m, l),
                5 => group::<S, T, 5>(&item, &tile, qi, acc, m, l),
                _ => group::<S, T, 6>(&item, &tile, qi, acc, m, l),
            }
            qi += nb;
        }
    }
    for qi in 0..nq {
        let (r, hh) = (r0 + qi / c.group, qi % c.group);
        let dst = c.out.0.add(((seq.q_start + r) * c.n_heads + g * c.group + hh) * hd);
        let inv = S::splat(1.0 / l[qi]);
        let a = acc.as_ptr().add(qi * hd);
        let mut d = 0;
        while d < hd {
            S::store(dst.add(d), S::mul(S::load(a.add(d)), inv));
            d += lanes;
        }
    }
}

/// The work item's fixed parts.
struct Item<'a> {
    c: &'a Ctx<'a>,
    seq: &'a SeqSpan<'a>,
    g: usize,
    r0: usize,
    first_pos: usize,
}

/// The staged tile: K transposed, pointers to the V rows.
struct Tile<'a, const T: usize> {
    t0: usize,
    first: bool,
    kt: *const f32,
    vp: &'a [*const f32; T],
}

/// Points `kp`/`vp[0..loaded]` at the K/V rows of positions `t0..t0+loaded`: straight into
/// an f32 pool, or into `kst`/`vst` after converting f16/bf16 (exact, so both agree).
/// Positions before `lo` (behind every row's sliding window, their blocks maybe given back)
/// are not read: they point at the zero row (and are masked).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn stage<S: Native, const T: usize>(
    c: &Ctx<'_>,
    table: &[u32],
    g: usize,
    t0: usize,
    loaded: usize,
    (lo, zero): (usize, *const f32),
    kst: &mut [f32],
    vst: &mut [f32],
    kp: &mut [*const f32; T],
    vp: &mut [*const f32; T],
) {
    let hd = c.hd;
    let (kb, vb) = (c.pool.k.as_ptr(), c.pool.v.as_ptr());
    for j in 0..loaded {
        if t0 + j < lo {
            kp[j] = zero;
            vp[j] = zero;
            continue;
        }
        let off = row_offset(c.pool, table, t0 + j, g, c.rb);
        match c.pool.dtype {
            DType::F32 => {
                kp[j] = kb.add(off) as *const f32;
                vp[j] = vb.add(off) as *const f32;
            }
            DType::F16 => {
                S::f16_to_f32(kb.add(off), kst.as_mut_ptr().add(j * hd), hd);
                S::f16_to_f32(vb.add(off), vst.as_mut_ptr().add(j * hd), hd);
                kp[j] = kst.as_ptr().add(j * hd);
                vp[j] = vst.as_ptr().add(j * hd);
            }
            DType::BF16 => {
                S::bf16_to_f32(kb.add(off), kst.as_mut_ptr().add(j * hd), hd);
                S::bf16_to_f32(vb.add(off), vst.as_mut_ptr().add(j * hd), hd);
                kp[j] = kst.as_ptr().add(j * hd);
                vp[j] = vst.as_ptr().add(j * hd);
            }
            // Q8_0 (`check_call` admitted nothing else): dequantized into the stage, so the
            // cache is read as int8 and the arithmetic after it is the f32 path's.
            _ => {
                kv_q8::dequantize_row(kb.add(off), kst.as_mut_ptr().add(j * hd), hd);
                kv_q8::dequantize_row(vb.add(off), vst.as_mut_ptr().add(j * hd), hd);
                kp[j] = kst.as_ptr().add(j * hd);
                vp[j] = vst.as_ptr().add(j * hd);
            }
        }
    }
}

/// Prefetches the K/V rows of positions `t0..min(t0 + T, end)` (`T`: the tile).
#[inline(always)]
unsafe fn prefetch_tile<S: Native, const T: usize>(c: &Ctx<'_>, table: &[u32], g: usize, t0: usize, end: usize) {
    let row_bytes = c.rb;
    let (kb, vb) = (c.pool.k.as_ptr(), c.pool.v.as_ptr());
    for pos in t0..end.min(t0 + T) {
        let off = row_offset(c.pool, table, pos, g, c.rb);
        let mut b = 0;
        while b < row_bytes {
            S::prefetch(kb.add(off + b));
            S::prefetch(vb.add(off + b));
            b += 64;
        }
    }
}

/// `NB` queries (consecutive indices from `qi0`) against one tile: scores, online-softmax
/// update, P·V. Queries only share loads: every value of one query is computed by the same
/// operations in the same order whatever its group, so results do not depend on grouping.
#[inline(always)]
unsafe fn group<S: Native, const T: usize, const NB: usize>(
    it: &Item<'_>,
    tile: &Tile<'_, T>,
    qi0: usize,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let c = it.c;
    let (hd, lanes) = (c.hd, S::LANES);
    let mut qp = [std::ptr::null::<f32>(); NB];
    let mut lim = [0usize; NB];
    for n in 0..NB {
        let qi = qi0 + n;
        let (r, hh) = (it.r0 + qi / c.group, qi % c.group);
        qp[n] = c.q.as_ptr().add(((it.seq.q_start + r) * c.n_heads + it.g * c.group + hh) * hd);
        lim[n] = (it.first_pos + r + 1 - tile.t0).min(T);
    }
    // Sliding window: a query whose window starts in this tile starts here (`qfirst`), and its
    // positions before the window's start (`lo[n]` of the tile) are masked.
    let mut qfirst = [tile.first; NB];
    let mut lo = [0usize; NB];
    if c.window > 0 {
        for n in 0..NB {
            let r = it.r0 + (qi0 + n) / c.group;
            let start = (it.first_pos + r + 1).saturating_sub(c.window);
            if start >= tile.t0 {
                qfirst[n] = true;
                lo[n] = start - tile.t0;
            }
        }
    }
    let max_lim = lim.iter().copied().max().unwrap_or(0);
    let min_lim = lim.iter().copied().min().unwrap_or(0);

    // Scores: sc[n][j] = (sum over d in order of q[d] * k_j[d]) * scale, four vectors of
    // positions at a time.
    let mut sc = [[0.0f32; T]; NB];
    let vscale = S::splat(c.scale);
    // A tile narrower than four vectors takes chunks of fewer (`cw`, a constant here).
    let cw = chunk_vectors::<S, T>();
    let mut cb = 0;
    while cb < max_lim {
        let mut a = [[S::zero(); 4]; NB];
        for d in 0..hd {
            let kr = tile.kt.add(d * T + cb);
            let mut k = [S::zero(); 4];
            for (v, kv) in k.iter_mut().enumerate().take(cw) {
                *kv = S::load(kr.add(v * lanes));
            }
            for n in 0..NB {
                let b = S::splat(*qp[n].add(d));
                for v in 0..cw {
                    a[n][v] = S::fma(b, k[v], a[n][v]);
                }
            }
        }
        for n in 0..NB {
            for v in 0..cw {
                S::store(sc[n].as_mut_ptr().add(cb + v * lanes), S::mul(a[n][v], vscale));
            }
        }
        cb += cw * lanes;
    }

    // Online softmax per query over its own `lim` positions.
    let mut alpha = [0.0f32; NB];
    for n in 0..NB {
        let qi = qi0 + n;
        let (limit, scp) = (lim[n], sc[n].as_mut_ptr());
        let groups = limit.div_ceil(lanes);
        let full = limit / lanes;
        let skip = lo[n];
        let mx = if skip == 0 {
            let mut vmax = S::splat(f32::NEG_INFINITY);
            for gi in 0..full {
                vmax = S::max(vmax, S::load(scp.add(gi * lanes)));
            }
            let mut mx = S::reduce_max(vmax);
            for &x in &sc[n][full * lanes..limit] {
                mx = mx.max(x);
            }
            mx
        } else {
            sc[n][skip..limit].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
        };
        let m_new = if qfirst[n] { mx } else { m[qi].max(mx) };
        // Masked positions: a finite score for the exponential, zeroed after it.
        for j in 0..skip {
            *scp.add(j) = m_new;
        }
        let vm = S::splat(m_new);
        let mut vsum = S::zero();
        for gi in 0..groups {
            let o = gi * lanes;
            let mut p = S::exp_neg(S::sub(S::load(scp.add(o)), vm));
            if gi == full {
                // Tail: positions past `limit` contribute exactly nothing.
                p = S::mul(p, S::load(MASK.as_ptr().add(16 - (limit - o))));
            }
            S::store(scp.add(o), p);
            vsum = S::add(vsum, p);
        }
        if skip > 0 {
            for j in 0..skip {
                *scp.add(j) = 0.0;
            }
            vsum = S::zero();
            for gi in 0..groups {
                vsum = S::add(vsum, S::load(scp.add(gi * lanes)));
            }
        }
        let lt = S::reduce_add(vsum);
        if qfirst[n] {
            l[qi] = lt;
            if !tile.first {
                // The P·V pass scales the accumulator by alpha: start it from zero.
                acc[qi * hd..(qi + 1) * hd].fill(0.0);
                alpha[n] = 0.0;
            }
        } else {
            alpha[n] = S::exp_neg1(m[qi] - m_new);
            l[qi] = l[qi] * alpha[n] + lt;
        }
        m[qi] = m_new;
    }

    // acc = acc * alpha + sum_j p_j v_j, each element accumulated in position order.
    let accp = acc.as_mut_ptr().add(qi0 * hd);
    let pv = PvArgs { acc: accp, hd, sc: &sc, vp: tile.vp, lim: &lim, min_lim, first: tile.first, alpha: &alpha };
    let nv = hd / lanes;
    let mut cv = 0;
    while cv + 4 <= nv {
        pv_group::<S, T, NB, 4>(&pv, cv * lanes);
        cv += 4;
    }
    while cv < nv {
        pv_group::<S, T, NB, 1>(&pv, cv * lanes);
        cv += 1;
    }
}

struct PvArgs<'a, const T: usize, const NB: usize> {
    acc: *mut f32,
    hd: usize,
    sc: &'a [[f32; T]; NB],
    vp: &'a [*const f32; T],
    lim: &'a [usize; NB],
    min_lim: usize,
    first: bool,
    alpha: &'a [f32; NB],
}

/// `RV` vectors of dims from `d0` for `NB` queries, held in registers over the tile. V
/// loads are shared up to the smallest limit; each query then finishes its own positions.
#[inline(always)]
unsafe fn pv_group<S: Native, const T: usize, const NB: usize, const RV: usize>(a: &PvArgs<'_, T, NB>, d0: usize) {
    let lanes = S::LANES;
    let mut r = [[S::zero(); RV]; NB];
    if !a.first {
        for n in 0..NB {
            let va = S::splat(a.alpha[n]);
            for v in 0..RV {
                r[n][v] = S::mul(S::load(a.acc.add(n * a.hd + d0 + v * lanes)), va);
            }
        }
    }
    for j in 0..a.min_lim {
        let vr = a.vp[j].add(d0);
        let mut vv = [S::zero(); RV];
        for v in 0..RV {
            vv[v] = S::load(vr.add(v * lanes));
        }
        for n in 0..NB {
            let p = S::splat(a.sc[n][j]);
            for v in 0..RV {
                r[n][v] = S::fma(p, vv[v], r[n][v]);
            }
        }
    }
    for n in 0..NB {
        for j in a.min_lim..a.lim[n] {
            let vr = a.vp[j].add(d0);
            let p = S::splat(a.sc[n][j]);
            for v in 0..RV {
                r[n][v] = S::fma(p, S::load(vr.add(v * lanes)), r[n][v]);
            }
        }
        for v in 0..RV {
            S::store(a.acc.add(n * a.hd + d0 + v * lanes), r[n][v]);
        }
    }
}
