//! FlashAttention-2 on the CPU: online softmax over KV tiles at fixed absolute boundaries.

use rayon::prelude::*;

use super::simd::{Scalar, Simd, MASK};
use super::{elem_bytes, row_offset, AttnParams, KvPool, OutPtr, SeqSpan};
use crate::isa::Isa;
use crate::DType;

/// KV positions per tile. Tiles start at absolute multiples of this, whatever the call.
pub const FLASH_TILE: usize = 64;
/// Query rows per work item (each with all the query heads of its GQA group).
pub const FLASH_ROW_BLOCK: usize = 16;

/// Floats of one task's scratch: accumulators, running max and sum of every query in an
/// item, the staged K and V tile (converted from f16/bf16) and one zero row for padding.
pub(super) fn scratch_floats(p: &AttnParams) -> usize {
    let nq = FLASH_ROW_BLOCK * (p.n_heads / p.kv_heads.max(1));
    nq * (p.head_dim + 2) + 2 * FLASH_TILE * p.head_dim + p.head_dim
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
    esz: usize,
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
        esz: elem_bytes(pool.dtype),
        out: OutPtr(out.as_mut_ptr()),
    };
    let item: ItemFn = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => item_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => item_avx2,
        _ => item_scalar,
    };
    let kv_heads = p.kv_heads;
    let floats = scratch_floats(p);
    // No per-call index arrays: items are enumerated on the fly, so the only allocations
    // are the per-task scratch buffers counted by `flash_scratch_bytes`.
    seqs.par_iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            let nb = seq.q_len.div_ceil(FLASH_ROW_BLOCK);
            (0..kv_heads * nb).into_par_iter().map(move |i| (s, i / nb, i % nb))
        })
        .for_each_init(
            || vec![0.0f32; floats],
            |scratch, (s, g, b)| {
                let r0 = b * FLASH_ROW_BLOCK;
                let r1 = (r0 + FLASH_ROW_BLOCK).min(ctx.seqs[s].q_len);
                // SAFETY: the ISA was checked against the CPU; shapes by `check_call`.
                unsafe { item(&ctx, s, g, r0, r1, scratch) }
            },
        );
}

unsafe fn item_scalar(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<Scalar>(c, s, g, r0, r1, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<super::simd::Avx2>(c, s, g, r0, r1, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn item_avx512(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    process_item::<super::simd::Avx512>(c, s, g, r0, r1, scratch)
}

/// Online-softmax state of one query (row, head) of an item.
struct QState<'s> {
    acc: &'s mut [f32],
    m: &'s mut f32,
    l: &'s mut f32,
}

#[inline(always)]
unsafe fn process_item<S: Simd>(c: &Ctx<'_>, s: usize, g: usize, r0: usize, r1: usize, scratch: &mut [f32]) {
    let seq = &c.seqs[s];
    let hd = c.hd;
    let nq = (r1 - r0) * c.group;
    let (acc, rest) = scratch.split_at_mut(FLASH_ROW_BLOCK * c.group * hd);
    let (ml, rest) = rest.split_at_mut(2 * FLASH_ROW_BLOCK * c.group);
    let (m, l) = ml.split_at_mut(FLASH_ROW_BLOCK * c.group);
    let (kst, rest) = rest.split_at_mut(FLASH_TILE * hd);
    let (vst, zero) = rest.split_at_mut(FLASH_TILE * hd);
    zero.fill(0.0);

    let first_pos = seq.ctx_len - seq.q_len;
    let last_pos = first_pos + r1 - 1;
    let mut kp = [zero.as_ptr(); FLASH_TILE];
    let mut vp = [zero.as_ptr(); FLASH_TILE];
    for t in 0..=last_pos / FLASH_TILE {
        let t0 = t * FLASH_TILE;
        let loaded = (last_pos + 1 - t0).min(FLASH_TILE);
        stage::<S>(c, seq.block_table, g, t0, loaded, kst, vst, &mut kp, &mut vp);
        for j in loaded..FLASH_TILE {
            kp[j] = zero.as_ptr();
        }
        for r in r0..r1 {
            let pos = first_pos + r;
            if pos < t0 {
                continue;
            }
            let limit = (pos + 1 - t0).min(FLASH_TILE);
            for hh in 0..c.group {
                let qi = (r - r0) * c.group + hh;
                let qrow = c.q.as_ptr().add(((seq.q_start + r) * c.n_heads + g * c.group + hh) * hd);
                let st = QState { acc: &mut acc[qi * hd..(qi + 1) * hd], m: &mut m[qi], l: &mut l[qi] };
                update::<S>(qrow, &kp, &vp, limit, t == 0, hd, c.scale, st);
            }
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
            d += S::LANES;
        }
    }
}

/// Points `kp`/`vp[0..loaded]` at the K/V rows of positions `t0..t0+loaded`: straight into
/// an f32 pool, or into `kst`/`vst` after converting f16/bf16 (exact, so both agree).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn stage<S: Simd>(
    c: &Ctx<'_>,
    table: &[u32],
    g: usize,
    t0: usize,
    loaded: usize,
    kst: &mut [f32],
    vst: &mut [f32],
    kp: &mut [*const f32; FLASH_TILE],
    vp: &mut [*const f32; FLASH_TILE],
) {
    let hd = c.hd;
    let (kb, vb) = (c.pool.k.as_ptr(), c.pool.v.as_ptr());
    for j in 0..loaded {
        let off = row_offset(c.pool, table, t0 + j, g, c.esz);
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
            _ => {
                S::bf16_to_f32(kb.add(off), kst.as_mut_ptr().add(j * hd), hd);
                S::bf16_to_f32(vb.add(off), vst.as_mut_ptr().add(j * hd), hd);
                kp[j] = kst.as_ptr().add(j * hd);
                vp[j] = vst.as_ptr().add(j * hd);
            }
        }
    }
}

/// One query against the first `limit` positions of a tile: scores, online-softmax
/// rescale, P·V accumulation. Every step depends only on this query, the tile and `limit`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn update<S: Simd>(
    q: *const f32,
    kp: &[*const f32; FLASH_TILE],
    vp: &[*const f32; FLASH_TILE],
    limit: usize,
    first: bool,
    hd: usize,
    scale: f32,
    st: QState<'_>,
) {
    let lanes = S::LANES;
    let groups = limit.div_ceil(lanes);
    let full = limit / lanes;
    let mut sc = [0.0f32; FLASH_TILE];
    let scp = sc.as_mut_ptr();
    let vscale = S::splat(scale);
    let mut vmax = S::splat(f32::NEG_INFINITY);
    for gi in 0..groups {
        let o = gi * lanes;
        S::dots(q, kp.as_ptr().add(o), hd, scp.add(o));
        let x = S::mul(S::load(scp.add(o)), vscale);
        S::store(scp.add(o), x);
        if gi < full {
            vmax = S::max(vmax, x);
        }
    }
    let mut mx = S::reduce_max(vmax);
    for &x in &sc[full * lanes..limit] {
        mx = mx.max(x);
    }
    let m_new = if first { mx } else { st.m.max(mx) };
    let vm = S::splat(m_new);
    let mut vsum = S::zero();
    for gi in 0..groups {
        let o = gi * lanes;
        let mut p = S::exp_neg(S::sub(S::load(scp.add(o)), vm));
        if gi == full {
            // Tail group: positions past `limit` contribute exactly nothing.
            p = S::mul(p, S::load(MASK.as_ptr().add(16 - (limit - o))));
        }
        S::store(scp.add(o), p);
        vsum = S::add(vsum, p);
    }
    let lt = S::reduce_add(vsum);
    let alpha = if first { 0.0 } else { S::exp_neg1(*st.m - m_new) };
    *st.l = if first { lt } else { *st.l * alpha + lt };
    *st.m = m_new;

    // acc = acc * alpha + sum_j p_j v_j, each element accumulated in position order.
    let acc = st.acc.as_mut_ptr();
    let nv = hd / lanes;
    let mut cv = 0;
    while cv + 8 <= nv {
        pv::<S, 8>(acc, &sc, vp, limit, first, alpha, cv * lanes);
        cv += 8;
    }
    while cv + 4 <= nv {
        pv::<S, 4>(acc, &sc, vp, limit, first, alpha, cv * lanes);
        cv += 4;
    }
    while cv < nv {
        pv::<S, 1>(acc, &sc, vp, limit, first, alpha, cv * lanes);
        cv += 1;
    }
}

/// `N` vectors of the accumulator starting at dim `d0`, kept in registers over the tile.
#[inline(always)]
unsafe fn pv<S: Simd, const N: usize>(
    acc: *mut f32,
    p: &[f32; FLASH_TILE],
    vp: &[*const f32; FLASH_TILE],
    limit: usize,
    first: bool,
    alpha: f32,
    d0: usize,
) {
    let lanes = S::LANES;
    let mut a = [S::zero(); N];
    if !first {
        let va = S::splat(alpha);
        for (i, ai) in a.iter_mut().enumerate() {
            *ai = S::mul(S::load(acc.add(d0 + i * lanes)), va);
        }
    }
    for j in 0..limit {
        let pj = S::splat(p[j]);
        let v = vp[j].add(d0);
        for (i, ai) in a.iter_mut().enumerate() {
            *ai = S::fma(pj, S::load(v.add(i * lanes)), *ai);
        }
    }
    for (i, ai) in a.iter().enumerate() {
        S::store(acc.add(d0 + i * lanes), *ai);
    }
}
