//! AMX-INT8 kernel for packed panels under `Precision::Fast` with many activation rows
//! (prefill, batched decode): the same integers and the same float steps as `panel_int_dot`'s
//! many-row walk, so the results are bit-identical to every other Fast kernel.
//!
//! One `tdpbssd` multiplies a tile of 16 activation rows × one 32-value group (signed
//! bytes, loaded straight from the quantized activations) with the group of a 16-row panel
//! (8 tile rows of 16 weight rows × 4 signed bytes: `panel_pack`'s quads, unpacked from nibbles
//! and un-biased once per panel into an L2 scratch), leaving `D_g` of 16 × 16 outputs in a
//! C tile: 8192 multiply-adds against 512 (`vpdpbusd` × 8) per row and group in the VNNI
//! kernel. The C tile goes to memory and each activation row takes `q8_activations`'s float step on
//! it, 16 outputs per vector: `fma(f32(D_g), fl(A_g X_g), acc[g mod 16])`. Q6_K's two
//! half scales need the two 16-value halves apart: two products of half the depth.
//!
//! Two loop nests:
//! - more than 16 rows (prefill): panels in blocks whose unpacked bytes (chain-major) stay in
//!   L2; for each block and 16-row tile of activations (the chain-major copy, from L3 once
//!   per block), each panel of the block chain by chain (the 16 accumulators of one chain in
//!   registers), the float steps of a group `LAG` groups behind its tile product so they
//!   never wait for its store;
//! - one tile of rows (batched decode): groups in natural order, each unpacked `LEAD` groups
//!   ahead of its product as the panel streams in once, the rows' chains in memory.
//!
//! Tile registers: C in tmm0 / tmm1, activations in tmm2 / tmm3, weights in tmm4 / tmm5
//! (one set per group of a pair; Q6_K: one set per half).

#![allow(clippy::needless_range_loop)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;

use super::panel_int_dot::{group_scales, put, tree, PJob, Scales, PF, PREFETCH_BYTES};
use super::panel_pack::PANEL;
use super::q8_activations::{ChainStarts, CHAINS, GROUP};
use crate::gemm::gguf::with_block;
use crate::simd::{Avx512, F32x16};
use crate::simd::{Avx512i, I32x16};
use crate::DType;

/// Activation rows from which the packed Fast path uses AMX (below, the VNNI walk): a tile
/// product costs the same for 1 or 16 rows. Kernel bench `batch` (`BATCH_M=`), two threads,
/// Q4_0 5632 x 2048, VNNI against AMX: 8 rows 530 / 594 us, 12 rows 688 / 620, 16 rows 830
/// / 658.
pub(super) const MIN_ROWS: usize = 12;

/// Bytes of unpacked panel groups a block keeps in L2 (half of a 2 MiB L2; the activation
/// tile, 16 rows of `k` bytes, and the outputs need far less).
const BLOCK_BYTES: usize = 1 << 20;

/// Unpacked bytes per group of a panel: 8 tile rows of 64.
const GB: usize = 8 * 64;

/// One 64-byte line (scratch unit, aligned for tile loads and stores).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Unpacked panels of the current block, reused across calls.
    static SCRATCH: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
}

/// The bias `panel_pack` adds to a format's weights (`u = w + bias`).
fn bias<F: PF>() -> i32 {
    match F::SCALES {
        Scales::D => 1 << F::OFF,
        Scales::K6 => 32,
        Scales::K4 => 0,
    }
}

/// Tile configuration: palette 1; C 16 × 64 bytes, A 16 rows × `ka` bytes, B `ka / 4`
/// rows × 64 bytes (`ka` 32, a group, or 16, a half group).
#[repr(C, align(64))]
struct Config([u8; 64]);

fn config(ka: u16) -> Config {
    let mut c = [0u8; 64];
    c[0] = 1;
    let set = |c: &mut [u8; 64], t: usize, rows: u8, colsb: u16| {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
        c[48 + t] = rows;
    };
    for t in 0..2 {
        set(&mut c, t, 16, 64);
        set(&mut c, 2 + t, 16, ka);
        set(&mut c, 4 + t, (ka / 4) as u8, 64);
    }
    Config(c)
}

// One instruction per function: tile registers are named in the instruction. The tile
// state lives across these asm blocks; the compiler never uses tile registers itself.

/// `C[r] = A[r] · B[r]` for the register set `r` (0: tmm0 = tmm2 · tmm4, 1: tmm1 = tmm3 ·
/// tmm5), A loaded from `a` (row stride `sa`), B from `b` (row stride 64).
#[inline(always)]
unsafe fn product(r: usize, a: *const u8, sa: usize, b: *const u8) {
    if r == 0 {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm2, [{a} + {sa} * 1]",
            "tileloadd tmm4, [{b} + {sb} * 1]",
            "tdpbssd tmm0, tmm2, tmm4",
            a = in(reg) a, sa = in(reg) sa, b = in(reg) b, sb = in(reg) 64usize,
            options(nostack, readonly)
        );
    } else {
        asm!(
            "tilezero tmm1",
            "tileloadd tmm3, [{a} + {sa} * 1]",
            "tileloadd tmm5, [{b} + {sb} * 1]",
            "tdpbssd tmm1, tmm3, tmm5",
            a = in(reg) a, sa = in(reg) sa, b = in(reg) b, sb = in(reg) 64usize,
            options(nostack, readonly)
        );
    }
}

/// Stores C register `r` (tmm0 or tmm1) as 16 rows of 16 i32 at `p`.
#[inline(always)]
unsafe fn store(r: usize, p: *mut Line) {
    if r == 0 {
        asm!("tilestored [{p} + {s} * 1], tmm0", p = in(reg) p, s = in(reg) 64usize, options(nostack));
    } else {
        asm!("tilestored [{p} + {s} * 1], tmm1", p = in(reg) p, s = in(reg) 64usize, options(nostack));
    }
}

/// Group `t`'s tile product (activations at `a`, row stride `sa`; unpacked weights at `b`)
/// stored as C tiles at `c`: K6 groups in two halves of 16 values (4 tile rows each), the
/// others in alternating register sets, so a product need not wait for the last store.
#[inline(always)]
unsafe fn product_store<F: PF>(t: usize, a: *const u8, sa: usize, b: *const u8, c: *mut Line) {
    if F::SCALES == Scales::K6 {
        product(0, a, sa, b);
        product(1, a.add(16), sa, b.add(256));
        store(0, c);
        store(1, c.add(16));
    } else {
        product(t % 2, a, sa, b);
        store(t % 2, c);
    }
}

/// Unpacks group `g` of the panel whose quants are at `q` into 8 lines of signed weights at
/// `dst` (line `t`: quad `t`, the 16 rows × 4 values).
#[inline(always)]
unsafe fn unpack_group<F: PF>(q: *const u8, g: usize, dst: *mut Line) {
    let b = _mm512_set1_epi8(bias::<F>() as u8 as i8);
    let w = F::quads::<Avx512i, true>(q.add(g * F::QB));
    for l in 0..8 {
        _mm512_store_si512(dst.add(l) as *mut _, _mm512_sub_epi8(w[l].0, b));
    }
}

/// Unpacks the `ng` groups of the panel whose quants are at `q` into signed weights, in
/// chain-major order (`ChainOrder`), 8 lines a group (line `t`: quad `t`, the 16 rows × 4
/// values), so that a chain's walk reads them in sequence.
#[inline(always)]
unsafe fn unpack<F: PF>(q: *const u8, ng: usize, dst: *mut Line) {
    let b = _mm512_set1_epi8(bias::<F>() as u8 as i8);
    let mut order = ChainOrder::new(ng);
    for t in 0..ng {
        let (g, _, _) = order.next();
        let w = F::quads::<Avx512i, true>(q.add(g * F::QB));
        for l in 0..8 {
            _mm512_store_si512(dst.add(8 * t + l) as *mut _, _mm512_sub_epi8(w[l].0, b));
        }
    }
}

/// The float steps of group `g` (C tile `c`, 16 rows of 16 `D_g`; Q6_K: `c` and `c2`, the
/// two halves) for 16 activation rows whose `X_g` are at `xs` and `Y_g` at `ys` (16 each):
/// `q8_activations`'s `fma(f32(D), fl(A X), acc)` (and `fma(-M, Y, .)`), as `panel_int_dot::float_step`.
#[inline(always)]
unsafe fn steps<F: PF>(
    acc: &mut [Avx512; 16],
    c: *const Line,
    c2: *const Line,
    s: *const u8,
    g: usize,
    xs: *const f32,
    ys: *const f32,
) {
    let sc = group_scales::<Avx512i, F>(s, g);
    for i in 0..16 {
        let mut d = Avx512i::load(c.add(i) as *const u8);
        if F::SCALES == Scales::K6 {
            let d2 = Avx512i::load(c2.add(i) as *const u8);
            d = Avx512i::add(Avx512i::mullo(d, sc.sc[0]), Avx512i::mullo(d2, sc.sc[1]));
        }
        let v = Avx512::fma(d.cvt(), Avx512::mul(sc.a, Avx512::splat(*xs.add(i))), acc[i]);
        acc[i] = if F::SCALES == Scales::K4 { Avx512::fma(sc.neg_m, Avx512::splat(*ys.add(i)), v) } else { v };
    }
}

/// Groups of one panel in chain-major order (chain 0's groups `0, 16, 32, ..`, then chain
/// 1's, ...), the order the float steps must take per chain.
struct ChainOrder {
    ng: usize,
    c: usize,
    g: usize,
}

impl ChainOrder {
    fn new(ng: usize) -> ChainOrder {
        ChainOrder { ng, c: 0, g: 0 }
    }

    /// The next group, its chain, and whether it is the chain's last.
    #[inline(always)]
    fn next(&mut self) -> (usize, usize, bool) {
        let (c, g) = (self.c, self.g);
        self.g += CHAINS;
        let last = self.g >= self.ng;
        if last {
            self.c += 1;
            self.g = self.c;
        }
        (g, c, last)
    }
}

/// C buffers in flight: the float steps of a group run `LAG` groups after its tile product
/// was stored, so they never wait for that store; `RING` buffers rotate (> `LAG`).
const LAG: usize = 2;
const RING: usize = 4;

/// 16 activation rows (chain-major quantized values at `xq`, row stride `sa`; `X_g` and
/// `Y_g` at `xs`, `ys` as `QAct::txs` lays them out) against one unpacked panel (`w`, chain-major; scales at `s`): the 16 chain sums of
/// each row into `chains`. `cbuf` holds `RING` C buffers of 32 lines.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<F: PF>(
    w: *const Line,
    s: *const u8,
    ng: usize,
    xq: *const u8,
    sa: usize,
    xs: *const f32,
    ys: *const f32,
    cbuf: *mut Line,
    chains: &mut [[Avx512; CHAINS]; 16],
) {
    // Chains past `ng` get no group: zero.
    for c in ng.min(CHAINS)..CHAINS {
        for row in chains.iter_mut() {
            row[c] = Avx512::zero();
        }
    }
    let buf = |t: usize| cbuf.add(32 * (t % RING));
    let mut take = ChainOrder::new(ng);
    let mut acc = [Avx512::zero(); 16];
    for t in 0..ng + LAG {
        if t < ng {
            let (a, b, c) = (xq.add(t * GROUP), w.add(8 * t) as *const u8, buf(t));
            product_store::<F>(t, a, sa, b, c);
        }
        if t >= LAG {
            let u = t - LAG;
            let (g, ch, last) = take.next();
            let c = buf(u);
            steps::<F>(&mut acc, c, c.add(16), s, g, xs.add(16 * u), ys.add(16 * u));
            if last {
                for i in 0..16 {
                    chains[i][ch] = acc[i];
                }
                acc = [Avx512::zero(); 16];
            }
        }
    }
}

/// Groups ahead of the product that the one-tile walk unpacks (its vector stores must reach
/// L1 before a tile load reads them: stores do not forward to tile loads), and the B slots.
const LEAD: usize = 6;
const BSLOTS: usize = 8;

/// One tile of activation rows (at most 16: a batched decode step) against one packed panel
/// (quants at `q`, scales at `s`), groups in natural order: each group is unpacked just
/// ahead of its tile product, so the panel streams from memory once, beside the products
/// (unpacking a whole panel first left the walk waiting on memory), prefetched ahead like
/// the one-row walk. The 16 chains of each row wait in `chains` between their groups. `xq`
/// is the natural-order activation tile (row stride `sa`); `xs`, `ys` the tile's `X`, `Y`
/// in `QAct::txs`'s chain-major order. `cbuf`: `RING` C buffers of 32 lines, then `BSLOTS` B
/// slots of 8.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn one_tile<F: PF>(
    q: *const u8,
    s: *const u8,
    ng: usize,
    xq: *const u8,
    sa: usize,
    (xs, ys): (*const f32, *const f32),
    cbuf: *mut Line,
    chains: &mut [[Avx512; CHAINS]; 16],
) {
    *chains = [[Avx512::zero(); CHAINS]; 16];
    let starts = ChainStarts::new(ng);
    let buf = |t: usize| cbuf.add(32 * (t % RING));
    let slot = |t: usize| cbuf.add(32 * RING + 8 * (t % BSLOTS));
    for t in 0..LEAD.min(ng) {
        unpack_group::<F>(q, t, slot(t));
    }
    for t in 0..ng + LAG {
        if t < ng {
            let u = t + LEAD;
            if u < ng {
                // Into L1, quants only: the decode walk's `prefetch_ahead` (into L2, with the
                // scales) lost all of three alternations here (`BATCH_M=16 quant -- batch
                // fast threads=2`: Q4_0 5632x2048 592-618 against 599-635 us, Q4_K 896x4864
                // 280-287 against 288-297).
                let ahead = q.wrapping_add(u * F::QB + PREFETCH_BYTES);
                for l in 0..F::QB.div_ceil(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l) as *const i8);
                }
                unpack_group::<F>(q, u, slot(u));
            }
            let (a, b, c) = (xq.add(t * GROUP), slot(t) as *const u8, buf(t));
            product_store::<F>(t, a, sa, b, c);
        }
        if t >= LAG {
            let g = t - LAG;
            let (ch, pos) = (g % CHAINS, starts.pos(g));
            let mut acc = [Avx512::zero(); 16];
            for i in 0..16 {
                acc[i] = chains[i][ch];
            }
            let c = buf(g);
            steps::<F>(&mut acc, c, c.add(16), s, g, xs.add(16 * pos), ys.add(16 * pos));
            for i in 0..16 {
                chains[i][ch] = acc[i];
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn run<F: PF>(job: &PJob<'_>) {
    let act = job.act;
    let (ng, np) = (act.ng, job.n.div_ceil(PANEL));
    if ng == 0 || np == 0 || job.m == 0 {
        return;
    }
    let cfg = config(if F::SCALES == Scales::K6 { 16 } else { 32 });
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    if job.m <= 16 {
        let mut scratch = SCRATCH.with(Cell::take);
        if scratch.len() < 32 * RING + 8 * BSLOTS {
            scratch.resize(32 * RING + 8 * BSLOTS, Line([0; 64]));
        }
        let sa = act.ngp * GROUP;
        let xq = act.xq.as_ptr().add(job.i0 * sa) as *const u8;
        let x = (act.txs.as_ptr().add(job.i0 * ng), act.tys.as_ptr().add(job.i0 * ng));
        let mut chains = [[Avx512::zero(); CHAINS]; 16];
        for p in 0..np {
            let (qo, so) = job.geo.offsets(job.p0 + p);
            one_tile::<F>(job.w.add(qo), job.w.add(so), ng, xq, sa, x, scratch.as_mut_ptr(), &mut chains);
            let (j0, rows) = (p * PANEL, (job.n - p * PANEL).min(PANEL));
            for i in 0..job.m {
                put(tree(&chains[i]), job.dst.add(i * job.ld + j0), rows);
            }
        }
        asm!("tilerelease", options(nostack, nomem));
        SCRATCH.with(|c| c.set(scratch));
        return;
    }

    let per_block = (BLOCK_BYTES / (ng * GB)).clamp(1, np);
    let mut scratch = SCRATCH.with(Cell::take);
    let lines = per_block * ng * 8 + 32 * RING;
    if scratch.len() < lines {
        scratch.resize(lines, Line([0; 64]));
    }
    let (wbuf, cbuf) = (scratch.as_mut_ptr(), scratch.as_mut_ptr().add(per_block * ng * 8));
    // The chain-major copy: row stride `ng` groups.
    let sa = ng * GROUP;
    let mut chains = [[Avx512::zero(); CHAINS]; 16];
    let mut pa = 0;
    while pa < np {
        let pe = (pa + per_block).min(np);
        for p in pa..pe {
            let (qo, _) = job.geo.offsets(job.p0 + p);
            unpack::<F>(job.w.add(qo), ng, wbuf.add((p - pa) * ng * 8));
        }
        let mut ib = 0;
        while ib < job.m {
            // Rows past the call's last are the zero padding of `QAct` (`PAD_ROWS`).
            let r0 = job.i0 + ib;
            let (xs, ys) = (act.txs.as_ptr().add(r0 * ng), act.tys.as_ptr().add(r0 * ng));
            let xq = act.cq.as_ptr().add(r0 * sa);
            let valid = (job.m - ib).min(16);
            for p in pa..pe {
                let (_, so) = job.geo.offsets(job.p0 + p);
                tile::<F>(wbuf.add((p - pa) * ng * 8), job.w.add(so), ng, xq, sa, xs, ys, cbuf, &mut chains);
                let (j0, rows) = (p * PANEL, (job.n - p * PANEL).min(PANEL));
                for i in 0..valid {
                    put(tree(&chains[i]), job.dst.add((ib + i) * job.ld + j0), rows);
                }
            }
            ib += 16;
        }
        pa = pe;
    }
    asm!("tilerelease", options(nostack, nomem));
    SCRATCH.with(|s| s.set(scratch));
}

/// Raw Fast dot products of `job` over packed panels of `dtype`, in AMX-INT8 tiles.
///
/// # Safety
/// The CPU has AMX-INT8 and AVX512-VNNI and this process may use AMX
/// (`isa::amx_int8_detected`); `job` describes valid memory as for `panel_int_dot::dots`, and
/// its activations were quantized by `QAct::fill` with the unbiased chain-major copies
/// (and its padding rows), and `job.i0` is a multiple of 16.
pub(super) unsafe fn dots(dtype: DType, job: &PJob<'_>) {
    with_block!(packed: dtype, F => run::<F>(job), _ => unreachable!("packed layout is only defined for packable types"))
}
