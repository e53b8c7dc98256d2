//! BF16 weights for `Precision::Fast`'s `vdpbf16ps` kernel (`FastBf16::Dot`), repacked into
//! 16-row panels of value pairs: the decode GEMV is one sequential stream, one `vdpbf16ps`
//! per 64 bytes of weights, with the 16 output rows in lanes. Where AMX-BF16 runs
//! (`FastBf16::Amx`), BF16 and F16 weights take the same layout for `amx_pair_panels`'s tile
//! arithmetic instead (a block of a panel is a B tile as stored).
//!
//! ## Layout
//! Panel `p` holds rows `16p..16p + 16` (zero rows pad the last), `k` rounded up to a
//! multiple of 32 with zeros. For each pair `q` (values `2q, 2q + 1`), 64 bytes: row `r`'s two
//! bf16 at bytes `4r..4r + 4`, low value first. Pairs in order; panels follow each other.
//!
//! ## Arithmetic
//! Each output is one chain over the value pairs in increasing order: per pair `q` one
//! `vdpbf16ps` lane, `acc += x[2q+1]·w[2q+1]`, then `acc += x[2q]·w[2q]` (each product exact
//! in f32, each sum rounded; the activations rounded to bf16 by `fast_bf16`'s `round_row`),
//! over the zero pairs that pad `k` too, then the bias. `reference::matmul_fast_bf16_pairs`
//! emulates it bit for bit. Every batch size, split and thread count runs this one order,
//! so a row's result does not depend on them (batch invariance). It is not the row
//! layout's order (`fast_bf16`: 16 chains per output and a tree): the two layouts give
//! results equal within the bf16 bound, not bit-identical; a weight keeps one layout for
//! its lifetime, so the invariance holds per weight.
//!
//! ## Kernel
//! One register tile is up to 6 activation rows by 4 panels (64 outputs): per pair, 4 weight
//! loads and 6 activation broadcasts feed 24 `vdpbf16ps`, with the 24 chains in registers from
//! the first pair to the last (no reduction, no transposition). Decode (1 or 2 rows) takes 8
//! panels per tile: 8 independent chains (4 measured the same in the model's decode, which
//! memory bounds). A task walks its panels in blocks of about 768 KiB (L2), every x tile over
//! one block, so a block comes from memory once. Measured at m = 512, n = 5632, k = 2048, one
//! Zen 4 thread (`cargo bench -p tboost-kernels --bench quant -- bf16 fast threads=1`): about
//! 215 GFLOP/s, 92-98% of the one-thread `vdpbf16ps` peak (233 and 219 in two sessions); the
//! earlier 16-chain order needed its panels transposed back to rows for 6x4 dot-product tiles
//! and ran at 195. From [`GEMM_MIN_ROWS`] activation rows, a call's x rows are rounded to bf16
//! once for all its tasks ([`round_x`]): every task reads all of them, and eight tasks
//! re-rounding 512 rows of 5632 values cost about as much as a tenth of the down projection.

#![allow(clippy::needless_range_loop)] // lane, chain and row indices address several arrays at once

use rayon::prelude::*;

use super::exact_panels::{Sink, PANEL};
use crate::DType;

/// Activation rows of a task from which the call's x rows are rounded to bf16 once for all
/// tasks (module docs); below, each task rounds its own.
pub const GEMM_MIN_ROWS: usize = 32;

/// Panel streams of the many-row register tile (a gate and an up panel are two): a task
/// of fewer panels would leave part of the tile idle.
pub(in crate::gemm) const GEMM_PANELS: usize = 4;

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
    pack_panels(rows, cols, src, dst, 0..rows.div_ceil(PANEL))
}

/// [`pack`] of panels `panels` only (the rest of `dst` untouched). `src` holds the stored
/// rows of those panels only (rows `panels.start * PANEL` up to `panels.end * PANEL` or
/// `rows`), so a caller can read a large matrix in parts into a buffer of its own.
pub fn pack_panels(rows: usize, cols: usize, src: &[u8], dst: &mut [u8], panels: std::ops::Range<usize>) {
    let part_rows = (panels.end * PANEL).min(rows).saturating_sub(panels.start * PANEL);
    assert_eq!(src.len(), part_rows * cols * 2, "{rows}x{cols} bf16 source size of panels {panels:?}");
    assert_eq!(dst.len(), packed_bytes(rows, cols), "{rows}x{cols} bf16 pair-panel size");
    let pb = PANEL * padded(cols) * 2;
    if pb == 0 {
        return;
    }
    let first = panels.start;
    dst[panels.start * pb..panels.end * pb].par_chunks_mut(pb).enumerate().for_each(|(i, d)| {
        let p = first + i;
        d.fill(0);
        for r in 0..PANEL.min(rows - p * PANEL) {
            let row = &src[(i * PANEL + r) * cols * 2..][..cols * 2];
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

/// 64 bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// Values added to the row stride of x rounded once per call: at k = 2048 rows 4 KiB apart
/// all fall in one L1 set, and a tile's 6 rows and 4 weight streams exceed its 8 ways.
const SKEW: usize = 32;

/// A call's activation rows rounded to bf16 once for all its GEMM tasks ([`round_x`]).
pub(in crate::gemm) struct RoundedX {
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
pub(in crate::gemm) unsafe fn round_x(x: &[f32], m: usize, k: usize) -> Option<RoundedX> {
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
pub(in crate::gemm) unsafe fn task(
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
pub(in crate::gemm) fn check(w: &crate::WeightMat<'_>, what: &str) {
    assert_eq!(w.dtype, DType::BF16, "{what}: pair panels hold bf16, not {}", w.dtype);
    assert_eq!(w.data.len(), packed_bytes(w.rows, w.cols), "{what}: {}x{} bf16 pair panels size", w.rows, w.cols);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::bf16_round::round_row;
    use super::{padded, Line, Sink, PANEL, SKEW};
    use std::arch::x86_64::*;
    use std::cell::Cell;

    thread_local! {
        /// The bf16 copy of a task's x rows, reused across calls.
        static XB: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
    }

    /// Rows `r0..r1` of `x` (`k` values each) rounded to bf16 rows `xs` values apart at `dst`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::gemm) unsafe fn round_rows(
        x: *const f32,
        k: usize,
        xs: usize,
        (r0, r1): (usize, usize),
        dst: *mut u16,
    ) {
        for r in r0..r1 {
            round_row(x.add(r * k), k, padded(k), dst.add(r * xs));
        }
    }

    /// Bytes of weight panels (gate and up together) per block: every x tile of a task passes
    /// over one block, which therefore comes from memory once and from L2 after.
    const BLOCK_BYTES: usize = 768 << 10;

    /// Sums of `MR` bf16 x rows (`xb`, rows `xs` values apart) against `NR` panels (`ws`):
    /// per pair `q`, one weight load per panel and one activation broadcast per row, so a
    /// 6x4 tile loads 10 vectors per 24 `vdpbf16ps`. Each accumulator is one output's only
    /// chain, in pair order (module docs).
    #[inline(always)]
    unsafe fn micro<const MR: usize, const NR: usize>(
        xb: *const u16,
        xs: usize,
        pairs: usize,
        ws: &[*const u8; NR],
    ) -> [[__m512; NR]; MR] {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        for q in 0..pairs {
            let mut wv = [_mm512_setzero_si512(); NR];
            for j in 0..NR {
                wv[j] = _mm512_loadu_si512(ws[j].add(64 * q) as *const __m512i);
            }
            for i in 0..MR {
                let xv = _mm512_set1_epi32((xb.add(i * xs) as *const i32).add(q).read_unaligned());
                for j in 0..NR {
                    acc[i][j] = _mm512_dpbf16_ps(
                        acc[i][j],
                        std::mem::transmute::<__m512i, __m512bh>(xv),
                        std::mem::transmute::<__m512i, __m512bh>(wv[j]),
                    );
                }
            }
        }
        acc
    }

    /// Rows `i..i + MR` (bf16 at `xb`) against panels `pa..pe`, at most `NR` panel streams
    /// per register tile (with up, a gate and an up panel make two; a group of fewer panels
    /// at the end takes a narrower tile), stored through the sink.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_tile<const MR: usize, const NR: usize>(
        xb: *const u16,
        dims: (usize, usize),
        ws: (*const u8, Option<*const u8>),
        (pa, pe): (usize, usize),
        n: usize,
        i: usize,
        sink: &Sink<'_>,
    ) {
        let streams = if ws.1.is_some() { 2 } else { 1 };
        let mut p = pa;
        while p < pe {
            let left = (pe - p) * streams;
            p += if left >= NR {
                group::<MR, NR>(xb, dims, ws, p, n, i, sink)
            } else if left >= 4 && NR > 4 {
                group::<MR, 4>(xb, dims, ws, p, n, i, sink)
            } else if left >= 2 {
                group::<MR, 2>(xb, dims, ws, p, n, i, sink)
            } else {
                group::<MR, 1>(xb, dims, ws, p, n, i, sink)
            };
        }
    }

    /// One register tile: rows `i..i + MR` against the `NR` streams of the panels from `p`
    /// (`NR` panels, or `NR / 2` gate and up pairs); returns the panels done.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group<const MR: usize, const NR: usize>(
        xb: *const u16,
        (xs, kp): (usize, usize),
        (w, up): (*const u8, Option<*const u8>),
        p: usize,
        n: usize,
        i: usize,
        sink: &Sink<'_>,
    ) -> usize {
        let pb = PANEL * kp * 2;
        let ws: [*const u8; NR] = std::array::from_fn(|s| match up {
            Some(u) => (if s % 2 == 0 { w } else { u }).add((p + s / 2) * pb),
            None => w.add((p + s) * pb),
        });
        let acc = micro::<MR, NR>(xb, xs, kp / 2, &ws);
        let panels = if up.is_some() { NR / 2 } else { NR };
        debug_assert!(panels > 0, "a gate-and-up tile needs an even number of streams");
        for t in 0..MR {
            for c in 0..panels {
                let (g, u) = match up {
                    Some(_) => (acc[t][2 * c], Some(acc[t][2 * c + 1])),
                    None => (acc[t][c], None),
                };
                let j0 = (p + c) * PANEL;
                put(g, u, sink, i + t, j0, (n - j0).min(PANEL));
            }
        }
        panels
    }

    #[inline(always)]
    unsafe fn put(v: __m512, up: Option<__m512>, sink: &Sink<'_>, i: usize, j0: usize, rows: usize) {
        super::super::exact_panels::put_lanes(
            |p| _mm512_storeu_ps(p, v),
            up.map(|u| move |p: *mut f32| _mm512_storeu_ps(p, u)),
            sink,
            i,
            j0,
            rows,
        )
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(in crate::gemm) unsafe fn run(
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
        let mut buf = XB.with(Cell::take);
        let (xb, xs) = match pre {
            Some(pre) if rows >= super::GEMM_MIN_ROWS => (pre.add(i0 * (kp + SKEW)), kp + SKEW),
            _ => {
                let lines = (rows * kp).div_ceil(32).max(1);
                if buf.len() < lines {
                    buf.resize(lines, Line([0; 64]));
                }
                let xb = buf.as_mut_ptr() as *mut u16;
                for r in 0..rows {
                    round_row(x.add((i0 + r) * k), k, kp, xb.add(r * kp));
                }
                (xb as *const u16, kp)
            }
        };
        let up = sink.up();
        // Bytes of one panel with its up panel; k = 0 makes empty panels (max(1)).
        let panel_bytes = PANEL * kp * 2 * if up.is_some() { 2 } else { 1 };
        let per_block = (BLOCK_BYTES / panel_bytes.max(1)).clamp(1, (p1 - p0).max(1));
        let (nfull, r) = (rows / 6, rows % 6);
        let mut pa = p0;
        while pa < p1 {
            let pe = (pa + per_block).min(p1);
            let ws = (w, up);
            let dims = (xs, kp);
            for t in 0..nfull {
                row_tile::<6, { super::GEMM_PANELS }>(xb.add(t * 6 * xs), dims, ws, (pa, pe), n, i0 + t * 6, sink);
            }
            let (xr, ir) = (xb.add(nfull * 6 * xs), i0 + nfull * 6);
            match r {
                0 => {}
                1 => row_tile::<1, 8>(xr, dims, ws, (pa, pe), n, ir, sink),
                2 => row_tile::<2, 8>(xr, dims, ws, (pa, pe), n, ir, sink),
                3 => row_tile::<3, 6>(xr, dims, ws, (pa, pe), n, ir, sink),
                4 => row_tile::<4, 4>(xr, dims, ws, (pa, pe), n, ir, sink),
                5 => row_tile::<5, 4>(xr, dims, ws, (pa, pe), n, ir, sink),
                _ => unreachable!("r < 6"),
            }
            pa = pe;
        }
        XB.with(|s| s.set(buf));
    }
}
