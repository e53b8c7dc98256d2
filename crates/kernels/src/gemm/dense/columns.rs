//! Register-tiled dot-product kernel and the cache-blocked loop around it.
//!
//! Every output element is one 16-lane accumulator chain over `k` (see `lanes`), so the
//! tile shape chosen for a given `m` never changes a result: `m = 1` (GEMV), batched decode
//! and prefill all compute `y[i, j]` with the same operations.

use super::lanes::WKind;
use crate::simd::F32x16;
use crate::WeightVec;

/// The weight rows a tile reads and where its sums go. Implemented by the plain
/// projection (one row per output column) and by the fused SwiGLU (gate row + up row per
/// output column).
pub(in crate::gemm) trait Cols: Sync {
    /// Weight rows consumed per output column.
    const ROWS_PER_COL: usize;
    /// Row pointers of the `NR / ROWS_PER_COL` output columns starting at `j`. Columns
    /// past the end repeat the last valid row (their sums are discarded by `store`).
    unsafe fn rows<const NR: usize>(&self, j: usize) -> [*const u8; NR];
    /// Writes the sums of x rows `i..i+MR` for the columns starting at `j`, skipping
    /// columns `>= jend`.
    unsafe fn store<const MR: usize, const NR: usize>(&self, i: usize, j: usize, jend: usize, s: &[[f32; NR]; MR]);
}

/// `out[i, j] = x[i] · w[j] (+ bias[j])`.
pub(in crate::gemm) struct PlainCols<'a> {
    pub w: *const u8,
    pub row_bytes: usize,
    pub n: usize,
    pub bias: Option<WeightVec<'a>>,
    pub out: *mut f32,
}

impl<'a> PlainCols<'a> {
    /// The columns of one segment: its weight rows, bias and output.
    pub(in crate::gemm) fn of(seg: &mut super::MatSeg<'a, '_>) -> PlainCols<'a> {
        PlainCols {
            w: seg.w.data.as_ptr(),
            row_bytes: seg.w.row_bytes(),
            n: seg.w.rows,
            bias: seg.bias,
            out: seg.out.as_mut_ptr(),
        }
    }
}

// SAFETY: the pointers are read-only weights and disjoint output columns per work item.
unsafe impl Sync for PlainCols<'_> {}
unsafe impl Send for PlainCols<'_> {}

impl Cols for PlainCols<'_> {
    const ROWS_PER_COL: usize = 1;

    #[inline(always)]
    unsafe fn rows<const NR: usize>(&self, j: usize) -> [*const u8; NR] {
        let mut r = [self.w; NR];
        for (c, p) in r.iter_mut().enumerate() {
            *p = self.w.add((j + c).min(self.n - 1) * self.row_bytes);
        }
        r
    }

    #[inline(always)]
    unsafe fn store<const MR: usize, const NR: usize>(&self, i: usize, j: usize, jend: usize, s: &[[f32; NR]; MR]) {
        for (r, row) in s.iter().enumerate() {
            let o = self.out.add((i + r) * self.n);
            for (c, &v) in row.iter().enumerate() {
                if j + c < jend {
                    // No bias means no `+ 0.0`: that would turn a -0.0 sum into +0.0.
                    *o.add(j + c) = match &self.bias {
                        Some(b) => v + b.get(j + c),
                        None => v,
                    };
                }
            }
        }
    }
}

/// `out[i, j] = silu(x[i] · gate[j]) * (x[i] · up[j])`.
pub(in crate::gemm) struct SwigluCols {
    pub gate: *const u8,
    pub up: *const u8,
    pub row_bytes: usize,
    pub n: usize,
    pub out: *mut f32,
}

// SAFETY: as for `PlainCols`.
unsafe impl Sync for SwigluCols {}
unsafe impl Send for SwigluCols {}

impl Cols for SwigluCols {
    const ROWS_PER_COL: usize = 2;

    #[inline(always)]
    unsafe fn rows<const NR: usize>(&self, j: usize) -> [*const u8; NR] {
        let h = NR / 2;
        let mut r = [self.gate; NR];
        for (c, p) in r.iter_mut().enumerate() {
            let (base, col) = if c < h { (self.gate, c) } else { (self.up, c - h) };
            *p = base.add((j + col).min(self.n - 1) * self.row_bytes);
        }
        r
    }

    #[inline(always)]
    unsafe fn store<const MR: usize, const NR: usize>(&self, i: usize, j: usize, jend: usize, s: &[[f32; NR]; MR]) {
        let h = NR / 2;
        for (r, row) in s.iter().enumerate() {
            let o = self.out.add((i + r) * self.n);
            for c in 0..h {
                if j + c < jend {
                    *o.add(j + c) = super::silu(row[c]) * row[h + c];
                }
            }
        }
    }
}

/// Bytes ahead of the current weight load to prefetch: about 15% more GEMV bandwidth on
/// Zen 5 than the hardware prefetchers alone give with 8 concurrent row streams.
pub(in crate::gemm) const PF: usize = 1024;

/// Sums of `MR` x rows (stride `k`) against `NR` weight rows, each in the canonical order.
#[inline(always)]
unsafe fn tile<V: F32x16, W: WKind, const MR: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    ws: &[*const u8; NR],
) -> [[f32; NR]; MR] {
    let mut acc = [[V::zero(); NR]; MR];
    let full = k / 16 * 16;
    let mut c = 0;
    while c < full {
        // Weights first, each x row beside its NR FMAs: MR·NR + NR + 1 live vectors (see
        // `blocked::tile_acc`: all x rows first made LLVM spill accumulators).
        let mut wv = [V::zero(); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let wp = ws[j].add(c * W::BYTES);
            V::prefetch(wp.wrapping_add(PF));
            *v = W::load::<V>(wp);
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let xv = V::load(x.add(i * k + c));
            for (a, w) in row.iter_mut().zip(&wv) {
                *a = V::fma(xv, *w, *a);
            }
        }
        c += 16;
    }
    if full < k {
        // Zero-padded copies of the tail: padded lanes do fma(0, 0, acc), as in every ISA.
        let rem = k - full;
        let mut xt = [[0f32; 16]; MR];
        for (i, t) in xt.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(x.add(i * k + full), t.as_mut_ptr(), rem);
        }
        let mut xv = [V::zero(); MR];
        for (v, t) in xv.iter_mut().zip(&xt) {
            *v = V::load(t.as_ptr());
        }
        for j in 0..NR {
            let mut wt = [0f32; 16];
            for (l, t) in wt.iter_mut().enumerate().take(rem) {
                *t = W::get(ws[j], full + l);
            }
            let wv = V::load(wt.as_ptr());
            for i in 0..MR {
                acc[i][j] = V::fma(xv[i], wv, acc[i][j]);
            }
        }
    }
    // Plain loops, not `array::from_fn`: its closures are not always inlined, and an
    // outlined copy would lose the caller's target features.
    let mut sums = [[0f32; NR]; MR];
    for (s, a) in sums.iter_mut().zip(&acc) {
        for (s, a) in s.iter_mut().zip(a) {
            *s = a.reduce();
        }
    }
    sums
}

/// Rows of `x` processed together so that they stay in L2 (~1 MiB) while a weight
/// sub-tile is reused from L1 against all of them; a multiple of `mrb`.
#[inline(always)]
fn x_block_rows(k: usize, mrb: usize) -> usize {
    let rows = (1usize << 20) / (4 * k.max(1));
    (rows / mrb * mrb).max(mrb)
}

/// Computes output rows `i0..i1`, columns `j0..j1` of `cols` from `x` (`[*, k]`).
///
/// Tiles: `MRB x NRB` for full groups of `MRB` rows; the remaining `r < MRB` rows use
/// `r x NRW` (`NRW = 2 * NRB`, more weight rows per x row when there are few x rows) when
/// `2r <= MRB`, else two `r x NRB` tiles. Each weight row is read from memory once per
/// block of `x_block_rows` rows, i.e. once per call for small `m`.
#[inline(always)]
pub(in crate::gemm) unsafe fn run<
    V: F32x16,
    W: WKind,
    C: Cols,
    const MRB: usize,
    const NRB: usize,
    const NRW: usize,
>(
    x: *const f32,
    k: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    cols: &C,
) {
    debug_assert!(NRW == 2 * NRB && NRB.is_multiple_of(C::ROWS_PER_COL));
    let cb = NRB / C::ROWS_PER_COL;
    let cw = NRW / C::ROWS_PER_COL;
    let mc = x_block_rows(k, MRB);
    let mut ib = i0;
    while ib < i1 {
        let ie = (ib + mc).min(i1);
        let nfull = (ie - ib) / MRB;
        let r = (ie - ib) % MRB;
        let ir = ib + nfull * MRB;
        let mut j = j0;
        while j < j1 {
            for h in 0..2 {
                let jj = j + h * cb;
                if jj >= j1 || nfull == 0 {
                    break;
                }
                let ws = cols.rows::<NRB>(jj);
                for t in 0..nfull {
                    let i = ib + t * MRB;
                    let s = tile::<V, W, MRB, NRB>(x.add(i * k), k, &ws);
                    cols.store::<MRB, NRB>(i, jj, j1, &s);
                }
            }
            match r {
                0 => {}
                1 => rem::<V, W, C, 1, MRB, NRB, NRW>(x, k, ir, j, j1, cols),
                2 => rem::<V, W, C, 2, MRB, NRB, NRW>(x, k, ir, j, j1, cols),
                3 => rem::<V, W, C, 3, MRB, NRB, NRW>(x, k, ir, j, j1, cols),
                4 => rem::<V, W, C, 4, MRB, NRB, NRW>(x, k, ir, j, j1, cols),
                5 => rem::<V, W, C, 5, MRB, NRB, NRW>(x, k, ir, j, j1, cols),
                _ => unreachable!("MRB is at most 6"),
            }
            j += cw;
        }
        ib = ie;
    }
}

#[inline(always)]
unsafe fn rem<V: F32x16, W: WKind, C: Cols, const R: usize, const MRB: usize, const NRB: usize, const NRW: usize>(
    x: *const f32,
    k: usize,
    i: usize,
    j: usize,
    j1: usize,
    cols: &C,
) {
    let xr = x.add(i * k);
    if 2 * R <= MRB {
        let ws = cols.rows::<NRW>(j);
        let s = tile::<V, W, R, NRW>(xr, k, &ws);
        cols.store::<R, NRW>(i, j, j1, &s);
    } else {
        let cb = NRB / C::ROWS_PER_COL;
        for h in 0..2 {
            let jj = j + h * cb;
            if jj >= j1 {
                break;
            }
            let ws = cols.rows::<NRB>(jj);
            let s = tile::<V, W, R, NRB>(xr, k, &ws);
            cols.store::<R, NRB>(i, jj, j1, &s);
        }
    }
}
