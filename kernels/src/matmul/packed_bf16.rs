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

#![allow(clippy::needless_range_loop)] // lane, chain and row indices address several arrays at once

use rayon::prelude::*;

use super::packed::{Sink, PANEL};
use crate::DType;

/// Chains of the canonical order (pairs per 32-value block).
const CHAINS: usize = 16;

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

/// Runs one task: panels `p0..p1` of the pair-panel matrix at `w` (`n` rows, `k` columns)
/// against activation rows `i0..i1` of `x`.
///
/// # Safety
/// `w` is a packed `[n, k]` matrix, `x` covers rows `ir`, the sink covers the task's outputs,
/// and [`applies`] holds.
pub(super) unsafe fn task(
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    x: *const f32,
    ir: (usize, usize),
    sink: &Sink<'_>,
) {
    #[cfg(target_arch = "x86_64")]
    x86::run(w, nk, pr, x, ir, sink);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 pair panels are only made where AVX512_BF16 runs: {w:?} {nk:?} {pr:?} {x:?} {ir:?}");
}

/// Checks a pair-panel matrix's size (its fields are public).
pub(super) fn check(w: &crate::WeightMat<'_>, what: &str) {
    assert_eq!(w.dtype, DType::BF16, "{what}: pair panels hold bf16, not {}", w.dtype);
    assert_eq!(w.data.len(), packed_bytes(w.rows, w.cols), "{what}: {}x{} bf16 pair panels size", w.rows, w.cols);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::dense_fast::round_row;
    use super::{padded, Sink, CHAINS, PANEL};
    use std::arch::x86_64::*;
    use std::cell::Cell;

    thread_local! {
        /// The bf16 copy of a task's x rows, reused across calls.
        static XB: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
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
    ) {
        let kp = padded(k);
        let rows = i1 - i0;
        let mut buf = XB.with(Cell::take);
        let words = (rows * kp).div_ceil(4).max(1);
        if buf.len() < words {
            buf.resize(words, 0);
        }
        let xb = buf.as_mut_ptr() as *mut u16;
        for r in 0..rows {
            round_row(x.add((i0 + r) * k), k, kp, xb.add(r * kp));
        }
        let pb = PANEL * kp * 2;
        let up = sink.up();
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
}
