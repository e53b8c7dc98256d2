//! BF16 weights for `Precision::Fast`'s `vdpbf16ps` kernel (`FastBf16::Dot`), repacked into
//! 16-row panels of value pairs: the decode GEMV is one sequential stream, one `vdpbf16ps`
//! per 64 bytes of weights, with the 16 output rows in lanes.
//!
//! ## Layout
//! Panel `p` holds rows `16p..16p + 16` (zero rows pad the last), `k` rounded up to a
//! multiple of 32 with zeros. For each pair `q` (values `2q, 2q + 1`), 64 bytes: row `r`'s two
//! bf16 at bytes `4r..4r + 4`, low value first. Pairs in order; panels follow each other.
//!
//! ## Arithmetic
//! `dense_fast`'s `Dot` order exactly: lane (chain) `l` of an output takes, for each block of
//! 32 values in increasing order, the pair `q = 16t + l` through one `vdpbf16ps` with the
//! activation pair (rounded to bf16 by the same `round_row`), the zero-padded last block
//! included; then the canonical tree. A pair's two products are the same instruction on the
//! same operands whether the row or the lane carries them, so results are bit-identical to
//! the row layout's for every batch and split.
//!
//! ## Many rows
//! From [`GEMM_MIN_ROWS`] activation rows a task transposes its panels back to rows, a
//! block of about 1 MiB at a time (in L2), and runs the row kernel's 6x4 register tiles
//! (`dense_fast::tile`) on them. A panel walk needs one activation broadcast per
//! `vdpbf16ps`; the row tile loads 10 vectors per 24 of them. The transposed rows and the
//! bf16 x rows get a 64-byte skew in their stride, so that rows 4 KiB apart do not share one
//! L1 set. Measured at m = 512, n = 5632, k = 2048, one Zen 4 thread
//! (`cargo bench -p tboost-kernels --bench quant -- peak bf16 fast threads=1`): the panel
//! walk ran at 134 GFLOP/s, 57% of the `vdpbf16ps` peak (233); the transposed row tiles at
//! 195 (84%), the file's row layout at 199. The transposition (64 shuffles per KiB) is paid
//! once per task, not per row. The bf16 x rows a GEMM task reads are rounded once per call
//! ([`round_x`]), not once per task: every task reads all of a call's rows, and eight tasks
//! re-rounding 512 rows of 5632 values cost about as much as a tenth of the down projection.

#![allow(clippy::needless_range_loop)] // lane, chain and row indices address several arrays at once

use rayon::prelude::*;

use super::packed::{Sink, PANEL};
use crate::DType;

/// Chains of the canonical order (pairs per 32-value block).
const CHAINS: usize = 16;

/// Activation rows of a task from which its panels are transposed back to rows for the row
/// kernel's register tiles (module docs); below, the panel walk is faster.
pub const GEMM_MIN_ROWS: usize = 32;

/// `k` rounded up to whole 32-value blocks.
fn padded(k: usize) -> usize {
    k.div_ceil(32) * 32
}

/// Bytes of a packed `[rows, cols]` BF16 matrix.
pub fn packed_bytes(rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL) * PANEL * padded(cols) * 2
}

/// `src`, a row-major `[rows, cols]` BF16 matrix, in the pair-panel layout (panels in parallel
/// on the current rayon pool). Panics when the sizes disagree (a caller bug).
pub fn pack(rows: usize, cols: usize, src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), rows * cols * 2, "{rows}x{cols} bf16 source size");
    assert_eq!(dst.len(), packed_bytes(rows, cols), "{rows}x{cols} bf16 pair-panel size");
    let pb = PANEL * padded(cols) * 2;
    if pb == 0 {
        return;
    }
    dst.par_chunks_mut(pb).enumerate().for_each(|(p, d)| {
        d.fill(0);
        for r in 0..PANEL.min(rows - p * PANEL) {
            let row = &src[(p * PANEL + r) * cols * 2..][..cols * 2];
            for e in 0..cols {
                let (q, h) = (e / 2, e % 2);
                d[q * 64 + 4 * r + 2 * h..][..2].copy_from_slice(&row[2 * e..2 * e + 2]);
            }
        }
    });
}

/// Whether this CPU runs BF16 `Fast` matmuls with the kernel these panels are for.
pub fn applies() -> bool {
    super::FastBf16::best() == super::FastBf16::Dot
}

/// 64 bytes, 64-byte aligned (the row tiles load x aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// Values added to the row stride of the transposed weights and of x in the GEMM path: at
/// k = 2048 rows 4 KiB apart all fall in one L1 set, and a 6x4 tile's 10 streams exceed its
/// 8 ways.
const SKEW: usize = 32;

/// A call's activation rows rounded to bf16 once for all its GEMM tasks ([`round_x`]).
pub(super) struct RoundedX {
    lines: Vec<Line>,
}

std::thread_local! {
    /// The caller's [`RoundedX`] buffer, reused across calls (no allocation per step).
    static ROUNDED: std::cell::Cell<Vec<Line>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Drop for RoundedX {
    fn drop(&mut self) {
        ROUNDED.with(|s| s.set(std::mem::take(&mut self.lines)));
    }
}

impl RoundedX {
    fn rows(&self) -> *const u16 {
        self.lines.as_ptr() as *const u16
    }
}

/// `x` (`m` rows of `k`) rounded to bf16 in the GEMM path's skewed row layout, the rows split
/// over the current pool; the caller asks when some task takes that path (at least
/// [`GEMM_MIN_ROWS`] rows). `None` where no pair-panel kernel exists (not x86-64).
///
/// # Safety
/// [`applies`] holds.
pub(super) unsafe fn round_x(x: &[f32], m: usize, k: usize) -> Option<RoundedX> {
    assert!(x.len() >= m * k, "round_x: {} values for {m}x{k}", x.len());
    #[cfg(target_arch = "x86_64")]
    {
        let xs = padded(k) + SKEW;
        let mut lines = ROUNDED.with(std::cell::Cell::take);
        lines.resize((m * xs).div_ceil(32).max(1), Line([0; 64]));
        let dst = lines.as_mut_ptr() as usize;
        let xp = x.as_ptr() as usize;
        let per = m.div_ceil(rayon::current_num_threads().max(1) * 4).max(1);
        (0..m.div_ceil(per)).into_par_iter().for_each(|c| {
            let (r0, r1) = (c * per, ((c + 1) * per).min(m));
            // SAFETY: rows `r0..r1` of x are inside it (asserted); their bf16 rows lie inside
            // `lines` (sized for m rows of `xs`) and no other part writes them.
            unsafe { x86::round_rows(xp as *const f32, k, xs, (r0, r1), dst as *mut u16) }
        });
        Some(RoundedX { lines })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Runs one task: panels `p0..p1` of the pair-panel matrix at `w` (`n` rows, `k` columns)
/// against activation rows `i0..i1` of `x` (already rounded in `pre`, when given).
///
/// # Safety
/// `w` is a packed `[n, k]` matrix, `x` covers rows `ir`, `pre` (if any) is [`round_x`] of
/// the same `x`, the sink covers the task's outputs, and [`applies`] holds.
pub(super) unsafe fn task(
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    x: *const f32,
    ir: (usize, usize),
    sink: &Sink<'_>,
    pre: Option<&RoundedX>,
) {
    #[cfg(target_arch = "x86_64")]
    x86::run(w, nk, pr, x, ir, sink, pre.map(RoundedX::rows));
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "bf16 pair panels are only made where AVX512_BF16 runs: {w:?} {nk:?} {pr:?} {x:?} {ir:?} {}",
        pre.is_some()
    );
}

/// Checks a pair-panel matrix's size (its fields are public).
pub(super) fn check(w: &crate::WeightMat<'_>, what: &str) {
    assert_eq!(w.dtype, DType::BF16, "{what}: pair panels hold bf16, not {}", w.dtype);
    assert_eq!(w.data.len(), packed_bytes(w.rows, w.cols), "{what}: {}x{} bf16 pair panels size", w.rows, w.cols);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::dense_fast::{round_row, tile};
    use super::{padded, Line, Sink, CHAINS, PANEL, SKEW};
    use std::arch::x86_64::*;
    use std::cell::Cell;

    thread_local! {
        /// The bf16 copy of a task's x rows, reused across calls.
        static XB: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
        /// A block of panels transposed back to rows (gate, then up), reused across calls.
        static WT: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
    }

    /// Bytes of transposed weight rows per block (gate and up together): L2-sized.
    const BLOCK_BYTES: usize = 1 << 20;

    /// Rows `r0..r1` of `x` (`k` values each) rounded to bf16 rows `xs` values apart at `dst`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(super) unsafe fn round_rows(x: *const f32, k: usize, xs: usize, (r0, r1): (usize, usize), dst: *mut u16) {
        for r in r0..r1 {
            round_row(x.add(r * k), k, padded(k), dst.add(r * xs));
        }
    }

    /// Registered activation rows walked together through a block of [`KB`] pairs.
    const MR: usize = 4;
    /// Pairs per block of the several-row walk (8 KiB of panel).
    const KB: usize = 128;

    #[inline(always)]
    unsafe fn dot(acc: __m512, x: *const u16, q: usize, w: *const u8) -> __m512 {
        let xv = _mm512_set1_epi32((x as *const i32).add(q).read_unaligned());
        let wv = _mm512_loadu_si512(w.add(64 * q) as *const __m512i);
        _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512i, __m512bh>(xv),
            std::mem::transmute::<__m512i, __m512bh>(wv),
        )
    }

    #[inline(always)]
    unsafe fn tree(acc: &[__m512; CHAINS]) -> __m512 {
        let mut s8 = [_mm512_setzero_ps(); 8];
        for l in 0..8 {
            s8[l] = _mm512_add_ps(acc[l], acc[l + 8]);
        }
        let mut s4 = [_mm512_setzero_ps(); 4];
        for l in 0..4 {
            s4[l] = _mm512_add_ps(s8[l], s8[l + 4]);
        }
        _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]))
    }

    /// One bf16 row `x` (padded) against a panel: the 16 rows' sums.
    #[inline(always)]
    unsafe fn panel_one(w: *const u8, kp: usize, x: *const u16) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let mut q = 0;
        while q < kp / 2 {
            for l in 0..CHAINS {
                acc[l] = dot(acc[l], x, q + l, w);
            }
            q += CHAINS;
        }
        tree(&acc)
    }

    /// `MR` bf16 rows against a panel: per block of pairs, two chains at a time, the rows
    /// sharing each weight load; chains wait in memory between blocks (exact).
    #[inline(always)]
    unsafe fn panel_many(w: *const u8, kp: usize, x: &[*const u16; MR]) -> [__m512; MR] {
        let mut chains = [[_mm512_setzero_ps(); CHAINS]; MR];
        let pairs = kp / 2;
        let mut qb = 0;
        while qb < pairs {
            let qe = (qb + KB).min(pairs);
            for l in (0..CHAINS).step_by(2) {
                let (mut a, mut b) = ([_mm512_setzero_ps(); MR], [_mm512_setzero_ps(); MR]);
                for i in 0..MR {
                    (a[i], b[i]) = (chains[i][l], chains[i][l + 1]);
                }
                let mut q = qb + l;
                while q < qe {
                    for i in 0..MR {
                        a[i] = dot(a[i], x[i], q, w);
                        b[i] = dot(b[i], x[i], q + 1, w);
                    }
                    q += CHAINS;
                }
                for i in 0..MR {
                    (chains[i][l], chains[i][l + 1]) = (a[i], b[i]);
                }
            }
            qb = qe;
        }
        let mut out = [_mm512_setzero_ps(); MR];
        for i in 0..MR {
            out[i] = tree(&chains[i]);
        }
        out
    }

    #[inline(always)]
    unsafe fn put(v: __m512, up: Option<__m512>, sink: &Sink<'_>, i: usize, j0: usize, rows: usize) {
        super::super::packed::put_lanes(
            |p| _mm512_storeu_ps(p, v),
            up.map(|u| move |p: *mut f32| _mm512_storeu_ps(p, u)),
            sink,
            i,
            j0,
            rows,
        )
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(super) unsafe fn run(
        w: *const u8,
        (n, k): (usize, usize),
        (p0, p1): (usize, usize),
        x: *const f32,
        (i0, i1): (usize, usize),
        sink: &Sink<'_>,
        pre: Option<*const u16>,
    ) {
        let kp = padded(k);
        let rows = i1 - i0;
        let gemm_rows = rows >= super::GEMM_MIN_ROWS;
        if let (true, Some(pre)) = (gemm_rows, pre) {
            let xs = kp + SKEW;
            gemm(w, n, (kp, xs), (p0, p1), pre.add(i0 * xs), (i0, rows), sink);
            return;
        }
        let mut buf = XB.with(Cell::take);
        let xs = if gemm_rows { kp + SKEW } else { kp };
        let lines = (rows * xs).div_ceil(32).max(1);
        if buf.len() < lines {
            buf.resize(lines, Line([0; 64]));
        }
        let xb = buf.as_mut_ptr() as *mut u16;
        for r in 0..rows {
            round_row(x.add((i0 + r) * k), k, kp, xb.add(r * xs));
        }
        let pb = PANEL * kp * 2;
        let up = sink.up();
        if gemm_rows {
            gemm(w, n, (kp, xs), (p0, p1), xb, (i0, rows), sink);
            XB.with(|s| s.set(buf));
            return;
        }
        for p in p0..p1 {
            let (wp, j0) = (w.add(p * pb), p * PANEL);
            let nr = (n - j0).min(PANEL);
            if rows == 1 {
                let g = panel_one(wp, kp, xb);
                let u = up.map(|u| panel_one(u.add(p * pb), kp, xb));
                put(g, u, sink, i0, j0, nr);
                continue;
            }
            let mut i = 0;
            while i < rows {
                // A short last block repeats its last row (results dropped).
                let mut xs = [xb as *const u16; MR];
                for t in 0..MR {
                    xs[t] = xb.add((i + t).min(rows - 1) * kp);
                }
                let g = panel_many(wp, kp, &xs);
                let u = up.map(|u| panel_many(u.add(p * pb), kp, &xs));
                for t in 0..MR.min(rows - i) {
                    put(g[t], u.map(|u| u[t]), sink, i0 + i + t, j0, nr);
                }
                i += MR;
            }
        }
        XB.with(|s| s.set(buf));
    }

    /// Panel `src` (pairs of 16 rows, `kp` values) as 16 rows of `kp` bf16 at `dst`, `rs`
    /// values apart: 16x16 blocks of 32-bit pairs transposed in registers.
    #[inline(always)]
    unsafe fn transpose_panel(src: *const u8, kp: usize, dst: *mut u8, rs: usize) {
        let mut q = 0;
        while q < kp / 2 {
            let mut r = [_mm512_setzero_si512(); 16];
            for (t, v) in r.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(src.add(64 * (q + t)) as *const __m512i);
            }
            let r = transpose16(r);
            for (l, v) in r.iter().enumerate() {
                _mm512_storeu_si512(dst.add(l * rs * 2 + 4 * q) as *mut __m512i, *v);
            }
            q += 16;
        }
    }

    /// The 16x16 transpose of 32-bit elements: lane `l` of `r[t]` goes to lane `t` of `out[l]`.
    #[inline(always)]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for b in 0..8 {
            t[2 * b] = _mm512_unpacklo_epi32(r[2 * b], r[2 * b + 1]);
            t[2 * b + 1] = _mm512_unpackhi_epi32(r[2 * b], r[2 * b + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for b in 0..4 {
            let o = 4 * b;
            u[o] = _mm512_unpacklo_epi64(t[o], t[o + 2]);
            u[o + 1] = _mm512_unpackhi_epi64(t[o], t[o + 2]);
            u[o + 2] = _mm512_unpacklo_epi64(t[o + 1], t[o + 3]);
            u[o + 3] = _mm512_unpackhi_epi64(t[o + 1], t[o + 3]);
        }
        // u[4b + c], 128-bit lane h: element c of rows 4b..4b+4 of source block h.
        for h in 0..2 {
            for c in 0..4 {
                let (a, b) = (u[8 * h + c], u[8 * h + 4 + c]);
                t[8 * h + c] = _mm512_shuffle_i32x4::<0x88>(a, b);
                t[8 * h + 4 + c] = _mm512_shuffle_i32x4::<0xdd>(a, b);
            }
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..8 {
            out[c] = _mm512_shuffle_i32x4::<0x88>(t[c], t[8 + c]);
            out[8 + c] = _mm512_shuffle_i32x4::<0xdd>(t[c], t[8 + c]);
        }
        out
    }

    /// Rows `i..i + MR` of bf16 `xb` against transposed panels `pa..pe` (rows at `wt`, up's
    /// at `ut`), stored through the sink; `NR` weight rows per register tile. x rows and
    /// weight rows are `rs` values apart, `kp` of them used.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_tiles<const MR: usize, const NR: usize>(
        xb: *const u16,
        (kp, rs): (usize, usize),
        (wt, ut): (*const u8, Option<*const u8>),
        (pa, pe): (usize, usize),
        n: usize,
        i: usize,
        sink: &Sink<'_>,
    ) {
        let rb = rs * 2;
        for p in pa..pe {
            let mut g = [[0f32; PANEL]; MR];
            let mut u = [[0f32; PANEL]; MR];
            for j in (0..PANEL).step_by(NR) {
                let at = |m: *const u8| -> [*const u8; NR] {
                    let base = m.add(((p - pa) * PANEL + j) * rb);
                    std::array::from_fn(|c| base.add(c * rb))
                };
                let s = tile::<MR, NR, false>(xb, rs, kp / 32, 0, &at(wt));
                for t in 0..MR {
                    g[t][j..j + NR].copy_from_slice(&s[t]);
                }
                if let Some(ut) = ut {
                    let s = tile::<MR, NR, false>(xb, rs, kp / 32, 0, &at(ut));
                    for t in 0..MR {
                        u[t][j..j + NR].copy_from_slice(&s[t]);
                    }
                }
            }
            let (j0, nr) = (p * PANEL, (n - p * PANEL).min(PANEL));
            for t in 0..MR {
                let store_u = ut.map(|_| |d: *mut f32| std::ptr::copy_nonoverlapping(u[t].as_ptr(), d, PANEL));
                super::super::packed::put_lanes(
                    |d| std::ptr::copy_nonoverlapping(g[t].as_ptr(), d, PANEL),
                    store_u,
                    sink,
                    i + t,
                    j0,
                    nr,
                );
            }
        }
    }

    /// A task of [`super::GEMM_MIN_ROWS`] or more rows (`rows` bf16 rows at `xb`, `rs`
    /// values apart, the first being x's row `i0`): blocks of panels transposed back to
    /// rows, then every x tile of 6 rows (fewer, with wider weight tiles, for the last)
    /// against the block.
    #[inline(always)]
    unsafe fn gemm(
        w: *const u8,
        n: usize,
        (kp, rs): (usize, usize),
        (p0, p1): (usize, usize),
        xb: *const u16,
        (i0, rows): (usize, usize),
        sink: &Sink<'_>,
    ) {
        let (pb, tb) = (PANEL * kp * 2, PANEL * rs * 2);
        let up = sink.up();
        let mats = if up.is_some() { 2 } else { 1 };
        let per_block = (BLOCK_BYTES / (tb * mats)).max(1).min(p1 - p0);
        let mut buf = WT.with(Cell::take);
        let lines = (per_block * tb * mats).div_ceil(64);
        if buf.len() < lines {
            buf.resize(lines, Line([0; 64]));
        }
        let wt = buf.as_mut_ptr() as *mut u8;
        let ut = up.map(|_| wt.add(per_block * tb) as *const u8);
        let (nfull, r) = (rows / 6, rows % 6);
        let mut pa = p0;
        while pa < p1 {
            let pe = (pa + per_block).min(p1);
            for p in pa..pe {
                transpose_panel(w.add(p * pb), kp, wt.add((p - pa) * tb), rs);
                if let Some(u) = up {
                    transpose_panel(u.add(p * pb), kp, wt.add((per_block + p - pa) * tb), rs);
                }
            }
            let ws = (wt as *const u8, ut);
            for t in 0..nfull {
                row_tiles::<6, 4>(xb.add(t * 6 * rs), (kp, rs), ws, (pa, pe), n, i0 + t * 6, sink);
            }
            let (xr, ir) = (xb.add(nfull * 6 * rs), i0 + nfull * 6);
            match r {
                0 => {}
                1 => row_tiles::<1, 8>(xr, (kp, rs), ws, (pa, pe), n, ir, sink),
                2 => row_tiles::<2, 8>(xr, (kp, rs), ws, (pa, pe), n, ir, sink),
                3 => row_tiles::<3, 8>(xr, (kp, rs), ws, (pa, pe), n, ir, sink),
                4 => row_tiles::<4, 4>(xr, (kp, rs), ws, (pa, pe), n, ir, sink),
                5 => row_tiles::<5, 4>(xr, (kp, rs), ws, (pa, pe), n, ir, sink),
                _ => unreachable!("r < 6"),
            }
            pa = pe;
        }
        WT.with(|s| s.set(buf));
    }
}
