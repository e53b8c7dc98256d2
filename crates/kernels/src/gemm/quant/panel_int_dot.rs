//! AVX-512 and AVX2 `Fast` kernels over packed panels (`panel_pack`'s layout), with and without
//! VNNI, instantiated like `int_dot`'s (the same [`I32x16`] lane types).
//!
//! Lane `r` of every integer and float vector is output row `r` of the panel; activation
//! bytes are broadcast 4 at a time. So the integer dot product of a group is 8 `vpdpbusd`
//! (4 bytes x 16 rows each) and no horizontal sum, and the float step of `q8_activations`'s canonical
//! order runs on the 16 rows at once.
//!
//! Two walks over a panel, both exactly the canonical order:
//! - one activation row (decode): groups in natural order, the 16 chain accumulators in
//!   registers (group `g` goes to accumulator `g mod 16`), one sequential pass over the
//!   panel (software prefetch into L2 ahead of the walk only where `isa::weight_prefetch`
//!   asks for it: elsewhere the hardware prefetchers do better);
//! - several rows: chain by chain (the chain's groups, 16 apart), `MR` rows sharing each
//!   unpacked group, one accumulator per row; panels in blocks of 512 KiB that stay in L2
//!   while every `MR`-row tile passes over the block, so activation rows come from L3 once per
//!   block rather than once per panel.

#![allow(clippy::needless_range_loop)]

use super::int_dot::{by_level, not_a_block, Level};
use super::panel_pack::{Geometry, PANEL};
use super::q8_activations::{ActRow, QAct, CHAINS, GROUP};
use crate::gemm::gguf::{Q4K, Q4_0, Q5K, Q5_0, Q6K, Q8_0};
pub(super) use crate::simd::chain_tree as tree;
use crate::simd::{unroll16, F32x16, F32x16Bytes};
use crate::simd::{Avx2x2i, Avx512i, I32x16};
use crate::DType;

/// How a format's group scales work (`panel_pack`'s layout doc).
#[derive(PartialEq, Eq)]
pub(super) enum Scales {
    /// `A = d` per group (16 f16); `D -= S << OFF`.
    D,
    /// Q4_K / Q5_K: `A = d * sc`, `M = dmin * m` per group from the super-block's scales.
    K4,
    /// Q6_K: `A = d` per super-block; two signed half scales per group; `D_h -= 32 H_h`.
    K6,
}

/// A packed format as the kernels read it.
pub(super) trait PF {
    /// Quant bytes per group of a panel.
    const QB: usize;
    const SCALES: Scales;
    /// `D = dot(unsigned bytes, q) - (S << OFF)` (`Scales::D` only).
    const OFF: u32 = 0;
    /// Bytes are `w + 128` (Q8_0): without VNNI they are flipped back to signed and multiplied
    /// sign-aware, with no offset.
    const SIGNED: bool = false;
    /// High bits after the nibbles: 0, 1 (Q5_0, Q5_K) or 2 (Q6_K).
    const HIGH: u32 = 0;
    /// The group's 8 quads (values `4t..4t + 4` of the 16 rows in lanes) at `q`.
    #[inline(always)]
    unsafe fn quads<I: I32x16, const VNNI: bool>(q: *const u8) -> [I; 8] {
        let mut o = [I::zero(); 8];
        for l in 0..4 {
            let v = I::load(q.add(64 * l));
            o[2 * l] = v.nib_lo();
            o[2 * l + 1] = v.nib_hi();
        }
        if Self::HIGH == 1 {
            let hb = I::load(q.add(256));
            for t in 0..8 {
                // Bit t of each byte to bit 4.
                o[t] = I::or(o[t], I::and8(I::shift16(hb, 4 - t as i32), 0x10));
            }
        } else if Self::HIGH == 2 {
            for h in 0..2 {
                let hb = I::load(q.add(256 + 64 * h));
                for t in 0..4 {
                    // Bits 2t, 2t + 1 of each byte to bits 4, 5.
                    let v = &mut o[4 * h + t];
                    *v = I::or(*v, I::and8(I::shift16(hb, 4 - 2 * t as i32), 0x30));
                }
            }
        }
        o
    }
}

impl PF for Q4_0 {
    const QB: usize = 256;
    const SCALES: Scales = Scales::D;
    const OFF: u32 = 3;
}

impl PF for Q5_0 {
    const QB: usize = 320;
    const SCALES: Scales = Scales::D;
    const OFF: u32 = 4;
    const HIGH: u32 = 1;
}

impl PF for Q8_0 {
    const QB: usize = 512;
    const SCALES: Scales = Scales::D;
    const OFF: u32 = 7;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn quads<I: I32x16, const VNNI: bool>(q: *const u8) -> [I; 8] {
        let mut o = [I::zero(); 8];
        for t in 0..8 {
            let v = I::load(q.add(64 * t));
            o[t] = if VNNI { v } else { v.xor80() };
        }
        o
    }
}

impl PF for Q4K {
    const QB: usize = 256;
    const SCALES: Scales = Scales::K4;
}

impl PF for Q5K {
    const QB: usize = 320;
    const SCALES: Scales = Scales::K4;
    const HIGH: u32 = 1;
}

impl PF for Q6K {
    const QB: usize = 384;
    const SCALES: Scales = Scales::K6;
    const HIGH: u32 = 2;
}

/// Scale bytes per group of the `Scales::D` formats (16 f16).
const SB: usize = 32;

/// `v` in every lane.
#[inline(always)]
unsafe fn splat_i32<I: I32x16>(v: i32) -> I {
    I::bcast32(&v as *const i32 as *const u8)
}

/// A group's scales for the float step (lanes = panel rows).
pub(super) struct GroupScales<I: I32x16> {
    /// `A`.
    pub a: I::F,
    /// `-M` (`Scales::K4`).
    pub neg_m: I::F,
    /// The half scales (`Scales::K6`).
    pub sc: [I; 2],
}

/// The scales of group `g` of a panel whose scales start at `s`.
#[inline(always)]
pub(super) unsafe fn group_scales<I: I32x16, F: PF>(s: *const u8, g: usize) -> GroupScales<I> {
    use super::panel_pack::{K4, K6, SUPER};
    let block = if F::SCALES == Scales::K4 { K4::BYTES } else { K6::BYTES };
    let (sbk, j) = (s.add(g / SUPER * block), g % SUPER);
    match F::SCALES {
        Scales::D => GroupScales { a: I::F::load_f16(s.add(g * SB)), neg_m: I::F::zero(), sc: [I::zero(); 2] },
        Scales::K4 => {
            let a = I::F::mul(I::F::load_f16(sbk.add(K4::D)), I::F::from_u8x16(sbk.add(K4::SC + PANEL * j)));
            let m = I::F::mul(I::F::load_f16(sbk.add(K4::DMIN)), I::F::from_u8x16(sbk.add(K4::M + PANEL * j)));
            GroupScales { a, neg_m: m.neg(), sc: [I::zero(); 2] }
        }
        Scales::K6 => GroupScales {
            a: I::F::load_f16(sbk.add(K6::D)),
            neg_m: I::F::zero(),
            sc: [I::from_i8x16(sbk.add(K6::SC + PANEL * 2 * j)), I::from_i8x16(sbk.add(K6::SC + PANEL * (2 * j + 1)))],
        },
    }
}

/// `D_g` of row `x` against the unpacked group `w` (lanes = panel rows).
#[inline(always)]
unsafe fn group_dot<I: I32x16, F: PF, const VNNI: bool>(w: &[I; 8], sc: &GroupScales<I>, x: ActRow, g: usize) -> I {
    let xq = x.xq.add(g * GROUP);
    let (mut d0, mut d1) = (I::zero(), I::zero());
    if F::SCALES == Scales::K6 {
        // -32 H_h per half: the unsigned bytes carry +32.
        d0 = splat_i32(-((*x.h.add(2 * g) as i32) << 5));
        d1 = splat_i32(-((*x.h.add(2 * g + 1) as i32) << 5));
    } else if F::OFF > 0 && (VNNI || !F::SIGNED) {
        d0 = splat_i32(-(*x.s.add(g) << F::OFF));
    }
    if !VNNI && !F::SIGNED {
        // vpmaddubsw pair sums (at most 2 * 2^(4 + HIGH) * 128 for 4 + HIGH bit weights) are
        // added in i16 while they stay below 2^15: 8 of them for 4 bits, 4 for 5, 2 for 6.
        // Then one vpmaddwd widens each run: the integer-multiply pipe does 8 + 8 / run
        // instructions a group instead of 16 (it is the non-VNNI kernels' bottleneck). The
        // integers are the same, so the result is the same.
        let run = 8 >> F::HIGH;
        let mut q = I::zero();
        // Quad t of the group (t < 4: first half) is values 4t..4t + 4 in both halves' order.
        for t in 0..8 {
            let p = I::ubs(w[t], I::bcast32(xq.add(4 * t)));
            q = if t % run == 0 { p } else { I::add16(q, p) };
            if t % run == run - 1 {
                // Runs of the first half go to d0, of the second to d1 (Q6_K scales each half).
                if t < 4 {
                    d0 = I::add(d0, q.widen16());
                } else {
                    d1 = I::add(d1, q.widen16());
                }
            }
        }
    } else {
        for t in 0..4 {
            let (xa, xb) = (I::bcast32(xq.add(4 * t)), I::bcast32(xq.add(16 + 4 * t)));
            if F::SIGNED && !VNNI {
                d0 = I::dot_ss(d0, w[t], xa);
                d1 = I::dot_ss(d1, w[t + 4], xb);
            } else {
                d0 = I::dot::<VNNI>(d0, w[t], xa);
                d1 = I::dot::<VNNI>(d1, w[t + 4], xb);
            }
        }
    }
    if F::SCALES == Scales::K6 {
        I::add(I::mullo(d0, sc.sc[0]), I::mullo(d1, sc.sc[1]))
    } else {
        I::add(d0, d1)
    }
}

/// The float step of group `g` for row `x`: `acc` after `fma(D, A X, acc)` (and, with mins,
/// `fma(-M, Y, .)`).
#[inline(always)]
pub(super) unsafe fn float_step<I: I32x16, F: PF>(acc: I::F, d: I, sc: &GroupScales<I>, x: ActRow, g: usize) -> I::F {
    let s = I::F::mul(sc.a, I::F::splat(*x.xs.add(g)));
    let v = I::F::fma(d.cvt(), s, acc);
    if F::SCALES == Scales::K4 {
        I::F::fma(sc.neg_m, I::F::splat(*x.ys.add(g)), v)
    } else {
        v
    }
}

/// `acc` after group `g` of one activation row (a closure here would not inherit the
/// caller's target features, and would not be inlined).
#[inline(always)]
unsafe fn group_step<I: I32x16, F: PF, const VNNI: bool, const PREFETCH: bool>(
    acc: I::F,
    q: *const u8,
    s: *const u8,
    x: ActRow,
    g: usize,
) -> I::F {
    if PREFETCH {
        prefetch_ahead::<F>(q, s, g);
    }
    let w = F::quads::<I, VNNI>(q.add(g * F::QB));
    let sc = group_scales::<I, F>(s, g);
    let d = group_dot::<I, F, VNNI>(&w, &sc, x, g);
    float_step::<I, F>(acc, d, &sc, x, g)
}

/// Bytes ahead of the group being read that the decode walk prefetches into L2 (where
/// `PJob::prefetch` asks for it): the distance that came closest to the streaming-read roof,
/// shorter ones leave DRAM latency exposed, longer ones and prefetching into L1 evict what
/// the walk still needs.
pub(super) const PREFETCH_BYTES: usize = 3 << 10;

/// Prefetches, into L2, the quants `PREFETCH_BYTES` ahead of group `g` (a panel's quants
/// run on into the next panel's, which the walk reads next) and the scales as far ahead in
/// groups. Hints only: an address past the matrix is never dereferenced.
#[inline(always)]
unsafe fn prefetch_ahead<F: PF>(q: *const u8, s: *const u8, g: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let ahead = q.wrapping_add(g * F::QB + PREFETCH_BYTES);
    let mut o = 0;
    while o < F::QB {
        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(o) as *const i8);
        o += 64;
    }
    // Scales take `SB` (32-40) bytes a group on average: one line every other group.
    if g.is_multiple_of(2) {
        let sb = if F::SCALES == Scales::D { SB } else { 40 };
        _mm_prefetch::<_MM_HINT_T1>(s.wrapping_add((g + PREFETCH_BYTES / F::QB) * sb) as *const i8);
    }
}

/// One activation row against one panel (quants at `q`, scales at `s`), groups in natural
/// order; `PREFETCH`: with software prefetch ahead of the walk.
#[inline(always)]
unsafe fn panel_one<I: I32x16, F: PF, const VNNI: bool, const PREFETCH: bool>(
    q: *const u8,
    s: *const u8,
    ng: usize,
    x: ActRow,
) -> I::F {
    let mut acc = [I::F::zero(); CHAINS];
    // Whole rounds of 16 groups with no bounds test inside: with one per group the compiler
    // laid the round out as a chain of branches into scattered blocks, well below the read
    // bandwidth.
    let mut g0 = 0;
    while g0 + CHAINS <= ng {
        unroll16!(c => { acc[c] = group_step::<I, F, VNNI, PREFETCH>(acc[c], q, s, x, g0 + c); });
        g0 += CHAINS;
    }
    // The last `ng mod 16` groups take one float step each, on accumulators `0..`, in a
    // plain loop (with one tested branch per accumulator, a tail of 8 or 12 groups took as
    // long as a whole round of 16).
    for c in 0..ng - g0 {
        acc[c] = group_step::<I, F, VNNI, PREFETCH>(acc[c], q, s, x, g0 + c);
    }
    tree(&acc)
}

/// `MR` activation rows against one panel, chain by chain: the 16 chain accumulators of
/// each row (zero for chains past `ng`), all written.
#[inline(always)]
unsafe fn panel_many<I: I32x16, F: PF, const VNNI: bool, const MR: usize>(
    q: *const u8,
    s: *const u8,
    ng: usize,
    x: &[ActRow; MR],
) -> [[I::F; CHAINS]; MR] {
    // Every element is written below: no zeroing first (a 4 KiB memset per panel and row
    // block is a visible share of a batched decode step).
    let mut chains = std::mem::MaybeUninit::<[[I::F; CHAINS]; MR]>::uninit();
    let out = chains.as_mut_ptr() as *mut I::F;
    for c in 0..CHAINS {
        let mut acc = [I::F::zero(); MR];
        let mut g = c;
        while g < ng {
            let w = F::quads::<I, VNNI>(q.add(g * F::QB));
            let sc = group_scales::<I, F>(s, g);
            for i in 0..MR {
                let d = group_dot::<I, F, VNNI>(&w, &sc, x[i], g);
                acc[i] = float_step::<I, F>(acc[i], d, &sc, x[i], g);
            }
            g += CHAINS;
        }
        for i in 0..MR {
            out.add(i * CHAINS + c).write(acc[i]);
        }
    }
    // SAFETY: the loops above wrote all MR x CHAINS elements.
    chains.assume_init()
}

/// One call: panels `p0..` of the packed matrix at `w` (laid out as `geo` says) hold weight
/// rows `0..n` of the task; activation rows `i0..i0 + m` of `act`; raw dot products to
/// `dst[(i - i0) * ld + j]`.
pub(super) struct PJob<'a> {
    pub w: *const u8,
    pub geo: Geometry,
    pub p0: usize,
    pub n: usize,
    pub act: &'a QAct,
    pub i0: usize,
    pub m: usize,
    pub dst: *mut f32,
    pub ld: usize,
    /// Software prefetch in the one-row walk (`isa::weight_prefetch`): same results.
    pub prefetch: bool,
}

/// Stores lanes `0..rows` of `v` at `dst`.
#[inline(always)]
pub(super) unsafe fn put<V: F32x16Bytes>(v: V, dst: *mut f32, rows: usize) {
    if rows == PANEL {
        v.store(dst);
    } else {
        let mut t = [0f32; PANEL];
        v.store(t.as_mut_ptr());
        std::ptr::copy_nonoverlapping(t.as_ptr(), dst, rows);
    }
}

/// Rows `ib..ib + MR` of the job against panel `p` (rows `j0..j0 + rows`).
#[inline(always)]
unsafe fn tile<I: I32x16, F: PF, const VNNI: bool, const MR: usize>(job: &PJob<'_>, p: usize, ib: usize) {
    let ng = job.act.ng;
    let mut x = [ActRow::of(job.act, job.i0 + ib); MR];
    for t in 0..MR {
        x[t] = ActRow::of(job.act, job.i0 + ib + t);
    }
    let (j0, rows) = (p * PANEL, (job.n - p * PANEL).min(PANEL));
    let (qo, so) = job.geo.offsets(job.p0 + p);
    let chains = panel_many::<I, F, VNNI, MR>(job.w.add(qo), job.w.add(so), ng, &x);
    for t in 0..MR {
        put(tree(&chains[t]), job.dst.add((ib + t) * job.ld + j0), rows);
    }
}

#[inline(always)]
unsafe fn run<I: I32x16, F: PF, const VNNI: bool, const MR: usize>(job: &PJob<'_>) {
    let ng = job.act.ng;
    let np = job.n.div_ceil(PANEL);
    if job.m == 1 {
        for p in 0..np {
            let (j0, rows) = (p * PANEL, (job.n - p * PANEL).min(PANEL));
            let (qo, so) = job.geo.offsets(job.p0 + p);
            let x = ActRow::of(job.act, job.i0);
            let y = if job.prefetch {
                panel_one::<I, F, VNNI, true>(job.w.add(qo), job.w.add(so), ng, x)
            } else {
                panel_one::<I, F, VNNI, false>(job.w.add(qo), job.w.add(so), ng, x)
            };
            put(y, job.dst.add(j0), rows);
        }
        return;
    }
    // Panels in blocks that stay in L2 while every row tile passes over them, so each
    // tile's activation rows are read once per block, not once per panel (from L3: 512 rows
    // of k = 2048 are 1 MiB of int8).
    let panel_bytes = job.geo.q_stride + job.geo.s_stride;
    let per_block = (BLOCK_BYTES / panel_bytes.max(1)).clamp(1, np.max(1));
    let mut pa = 0;
    while pa < np {
        let pe = (pa + per_block).min(np);
        let mut ib = 0;
        while ib < job.m {
            for p in pa..pe {
                match job.m - ib {
                    1 => tile::<I, F, VNNI, 1>(job, p, ib),
                    2 => tile::<I, F, VNNI, 2>(job, p, ib),
                    3 => tile::<I, F, VNNI, 3>(job, p, ib),
                    _ => tile::<I, F, VNNI, MR>(job, p, ib),
                }
            }
            ib += (job.m - ib).min(MR);
        }
        pa = pe;
    }
}

/// Bytes of panels a many-row walk keeps in L2 (half of a 1 MiB L2: the activation rows and
/// the outputs need the rest).
const BLOCK_BYTES: usize = 512 << 10;

macro_rules! entry {
    ($name:ident, $i:ty, $mr:expr, $vnni:literal, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<F: PF>(job: &PJob<'_>) {
            run::<$i, F, $vnni, { $mr }>(job)
        }
    };
}

entry!(z_vnni, Avx512i, 4, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c");
entry!(z_plain, Avx512i, 4, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c");
entry!(y_vnni, Avx2x2i, 4, true, "avx2,fma,f16c,avxvnni");
entry!(y_plain, Avx2x2i, 4, false, "avx2,fma,f16c");

/// Raw Fast dot products of `job` over packed panels of `dtype`.
///
/// # Safety
/// The CPU supports `level`; `job` describes valid memory (whole panels of `dtype` for the
/// `n` rows, activation rows `i0..i0 + m` of `act`, a writable `dst`).
pub(super) unsafe fn dots(level: Level, dtype: DType, job: &PJob<'_>) {
    by_level!(@packed level, dtype, [z_vnni, z_plain, y_vnni, y_plain](job))
}
