//! Cache-blocked path for larger `m` (batched decode and prefill).
//!
//! The dot-product form needs both operands indexed by `k`, so a tile running over all of
//! `k` streams both from L2 and stalls on L2 bandwidth. Here `k` is cut into blocks of `KC`
//! so that the tile's x rows and weight rows are in L1; the 16-lane accumulators are kept in
//! a scratch buffer between blocks. Storing and reloading a vector is exact, so each
//! element is still one chain in the canonical order and the results are bit-identical to
//! the direct path (`kernel::run`), whatever `m`.
//!
//! Loop nest for one work item (rows `i0..i1`, columns `j0..j1`):
//! ```text
//! for each L2 block of x rows (MC2 rows, packed to f32 once)
//!   for each L2 block of weight rows (NC rows, read from memory once per x block; widened
//!                                     to f32 once when the item has >= 32 rows, else read
//!                                     in place by each tile)
//!     for each L1 block of x rows (MC = 12)
//!       for each k block (KC = 512)
//!         for each weight sub-tile (NRB rows)
//!           for each x tile (MRB rows): tile_acc
//!       reduce the accumulators, store
//! ```
//! Packed operands are laid out per k block (`[k block][row][kcl]`) so that a tile's rows
//! are contiguous: x rows at a large power-of-two stride would all map to the same L1 sets.

use super::columns::Cols;
use super::lanes::{WKind, WF32};
use crate::simd::F32x16;
use std::cell::Cell;

// Block sizes: tuned on Zen 5 (48 KiB L1d, 2 MiB L2) with m=512, n=2048, k=2048; within a
// few percent of each other over KC 256..768, MC 12..24, the L2 budgets 0.25..1.5 MiB.

/// k values per block: the 12-row x block is 24 KiB, a 4-row weight sub-tile 8 KiB.
const KC: usize = 512;
/// x rows per L1 block (a multiple of every ISA's tile height: 6 and 3).
const MC: usize = 12;
/// Bytes of packed x per block. Weights are widened once per x block, so a larger block
/// widens them fewer times; each L1 block of it is read once per weight block, a stream
/// that need not stay in L2 (768 KiB -> 2 MiB: +5-8% at m = 512 on the Xeon VM).
const X_L2_BYTES: usize = 2048 << 10;
/// x rows from which weight blocks are widened once into a packed f32 buffer instead of
/// being read in place by every x tile (measured on Zen 5).
const PACK_W_MIN_ROWS: usize = 32;
/// Bytes of packed (f32) weights kept in L2.
const W_L2_BYTES: usize = 1024 << 10;

/// One 64-byte aligned line of 16 f32: the unit of every scratch buffer, so each
/// accumulator and each packed row block starts on a cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

thread_local! {
    /// Per-thread scratch, reused across calls so large buffers are not faulted in again
    /// on every matmul.
    static SCRATCH: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
}

/// Computes output rows `i0..i1`, columns `j0..j1` of `cols` from `x` (`[*, k]`) with
/// `MRB x NRB` tiles when weights are read in place and `MRB x NRP` tiles on packed
/// weights (`MRB` divides `MC`; `NRP` differs where `V::SPLIT` halves the accumulators).
#[inline(always)]
pub(in crate::gemm) unsafe fn run<
    V: F32x16,
    W: WKind,
    C: Cols,
    const MRB: usize,
    const NRB: usize,
    const NRP: usize,
>(
    x: *const f32,
    k: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    cols: &C,
) {
    debug_assert!(MC.is_multiple_of(MRB) && NRB.is_multiple_of(C::ROWS_PER_COL));
    debug_assert!(NRP.is_multiple_of(C::ROWS_PER_COL));
    let kp = k.div_ceil(16) * 16;
    // Weight rows per L2 block: a whole number of sub-tiles, 16..=128 rows.
    let nc_rows = (W_L2_BYTES / (4 * kp.max(16))).clamp(16, 128) / NRP * NRP;
    let cb = NRP / C::ROWS_PER_COL;
    let nc_cols = nc_rows / C::ROWS_PER_COL;

    // Few x rows: read weights in place (widened in registers, prefetched) so the weight
    // stream overlaps the arithmetic; many: widen each weight block once into `wp`.
    let raw = i1 - i0 < PACK_W_MIN_ROWS;
    // x rows per L2 block; with weights read in place, all rows at once so that every
    // weight row is read from memory once per call.
    let all_rows = (i1 - i0).div_ceil(MC) * MC;
    let mc2 = if raw { all_rows } else { ((X_L2_BYTES / (4 * kp.max(16))) / MC * MC).clamp(MC, all_rows) };
    let xp_lines = mc2 * kp / 16;
    let wp_lines = if raw { 0 } else { nc_rows * kp / 16 };
    // Accumulators: an L1 block of x rows by an L2 block of weight rows (packed), or all
    // rows of the x block (< 32, at most 36 once rounded to MC) by one sub-tile (raw).
    let acc_lines = if raw { mc2 * NRB } else { MC * nc_rows };
    let need = xp_lines + wp_lines + acc_lines;
    // Taken out of the thread-local and put back (no closure: an outlined closure would
    // be compiled without the caller's target features).
    let mut buf = SCRATCH.with(Cell::take);
    if buf.len() < need {
        buf.resize(need, Line([0.0; 16]));
    }
    let xp = buf.as_mut_ptr() as *mut f32;
    let wp = xp.add(xp_lines * 16);
    let acc = wp.add(wp_lines * 16) as *mut V;
    let mut ib2 = i0;
    while ib2 < i1 {
        let ie2 = (ib2 + mc2).min(i1);
        pack_x(x, k, kp, (ib2, ie2), mc2, xp, V::SPLIT && !raw);
        if raw {
            raw_block::<V, W, C, MRB, NRB>(xp, mc2, k, (ib2, ie2), (j0, j1), cols, acc);
            ib2 = ie2;
            continue;
        }
        let mut jb = j0;
        while jb < j1 {
            let je = (jb + nc_cols).min(j1);
            let nsub = (je - jb).div_ceil(cb);
            for s in 0..nsub {
                let ws = cols.rows::<NRP>(jb + s * cb);
                pack_w::<V, W, NRP>(&ws, k, kp, nc_rows, wp, s * NRP);
            }
            let mut ib = ib2;
            while ib < ie2 {
                let ie = (ib + MC).min(ie2);
                let rows = ie - ib;
                let nfull = rows / MRB;
                let r = rows % MRB;
                // Accumulators of sub-tile s, x row t (within this block), weight row j:
                // acc[(s * MC + t) * NRP + j]; a tile's MR x NRP block is contiguous.
                let mut k0 = 0;
                while k0 < kp {
                    let kcl = KC.min(kp - k0);
                    let first = k0 == 0;
                    // This L1 block's x rows and the weight block in packed k block k0.
                    let xk = xp.add(k0 * mc2 + (ib - ib2) * kcl);
                    let wk = wp.add(k0 * nc_rows);
                    for s in 0..nsub {
                        let accs = acc.add(s * MC * NRP);
                        let w0 = wk.add(s * NRP * kcl);
                        if V::SPLIT {
                            split_tiles::<V, MRB, NRP>(xk, kcl, w0, kcl / 16, accs, (nfull, r), first);
                            continue;
                        }
                        let mut ws = [wk as *const u8; NRP];
                        for (j, w) in ws.iter_mut().enumerate() {
                            *w = w0.add(j * kcl) as *const u8;
                        }
                        tiles::<V, WF32, MRB, NRP, false>(xk, kcl, &ws, kcl / 16, None, accs, (nfull, r), first);
                    }
                    k0 += kcl;
                }
                if kp == 0 {
                    // No k blocks ran: every sum is the empty sum.
                    for a in 0..nsub * MC * NRP {
                        acc.add(a).write(V::zero());
                    }
                }
                for s in 0..nsub {
                    let (jj, accs) = (jb + s * cb, acc.add(s * MC * NRP));
                    for t in 0..nfull {
                        flush::<V, C, MRB, NRP>(accs.add(t * MRB * NRP), cols, ib + t * MRB, jj, je);
                    }
                    flush_tail::<V, C, NRP>(r, accs.add(nfull * MRB * NRP), cols, ib + nfull * MRB, jj, je);
                }
                ib = ie;
            }
            jb = je;
        }
        ib2 = ie2;
    }
    SCRATCH.with(|s| s.set(buf));
}

/// The in-place weight mode for x blocks of fewer than `PACK_W_MIN_ROWS` rows: each
/// weight sub-tile runs over all of `k` for all rows of the packed x block (`xp`, rows
/// `i0..i1`) before the next, so every weight row is one sequential, prefetched stream read
/// once from memory; x comes from L2.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn raw_block<V: F32x16, W: WKind, C: Cols, const MRB: usize, const NRB: usize>(
    xp: *const f32,
    mc2: usize,
    k: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    cols: &C,
    acc: *mut V,
) {
    let kp = k.div_ceil(16) * 16;
    let rows = i1 - i0;
    let (nfull, r) = (rows / MRB, rows % MRB);
    let cb = NRB / C::ROWS_PER_COL;
    let mut j = j0;
    while j < j1 {
        let base = cols.rows::<NRB>(j);
        let mut k0 = 0;
        while k0 < kp {
            let kcl = KC.min(kp - k0);
            // Whole 16-steps inside k, then at most one zero-padded step.
            let whole = (k - k0).min(kcl) / 16;
            let has_tail = whole * 16 < kcl;
            let mut ws = base;
            let mut tail = [[0f32; 16]; NRB];
            for (w, t) in ws.iter_mut().zip(tail.iter_mut()) {
                if has_tail {
                    for (l, v) in t.iter_mut().enumerate() {
                        let c = k0 + whole * 16 + l;
                        if c < k {
                            *v = W::get(*w, c);
                        }
                    }
                }
                *w = w.add(k0 * W::BYTES);
            }
            let tail = has_tail.then_some(&tail);
            tiles::<V, W, MRB, NRB, true>(xp.add(k0 * mc2), kcl, &ws, whole, tail, acc, (nfull, r), k0 == 0);
            k0 += kcl;
        }
        if kp == 0 {
            for a in 0..rows * NRB {
                acc.add(a).write(V::zero());
            }
        }
        for t in 0..nfull {
            flush::<V, C, MRB, NRB>(acc.add(t * MRB * NRB), cols, i0 + t * MRB, j, j1);
        }
        flush_tail::<V, C, NRB>(r, acc.add(nfull * MRB * NRB), cols, i0 + nfull * MRB, j, j1);
        j += cb;
    }
}

/// Copies x rows `i0..i1` into `xp`, zero-padded from `k` to `kp`, as one block per KC
/// columns: the block starting at column `k0` holds `kcl = min(KC, kp - k0)` values per row
/// at offset `k0 * mc2 + row * kcl`, so a tile's rows are contiguous in L1. With `split`
/// each row's block is stored half by half (`split_row`).
#[inline(always)]
unsafe fn pack_x(x: *const f32, k: usize, kp: usize, (i0, i1): (usize, usize), mc2: usize, xp: *mut f32, split: bool) {
    let mut k0 = 0;
    while k0 < kp {
        let kcl = KC.min(kp - k0);
        let valid = kcl.min(k - k0);
        for r in 0..i1 - i0 {
            let dst = xp.add(k0 * mc2 + r * kcl);
            std::ptr::copy_nonoverlapping(x.add((i0 + r) * k + k0), dst, valid);
            std::ptr::write_bytes(dst.add(valid), 0, kcl - valid);
            if split {
                split_row(dst, kcl);
            }
        }
        k0 += kcl;
    }
}

/// Reorders one packed row block of `kcl` values (a multiple of 16) in place: values
/// `16g..16g + 8` of every 16-block first (chains 0..8, in block order), then values
/// `16g + 8..16g + 16` (chains 8..16).
#[inline(always)]
unsafe fn split_row(row: *mut f32, kcl: usize) {
    let mut tmp = [0f32; KC];
    std::ptr::copy_nonoverlapping(row, tmp.as_mut_ptr(), kcl);
    let half = kcl / 2;
    for g in 0..kcl / 16 {
        std::ptr::copy_nonoverlapping(tmp.as_ptr().add(16 * g), row.add(8 * g), 8);
        std::ptr::copy_nonoverlapping(tmp.as_ptr().add(16 * g + 8), row.add(half + 8 * g), 8);
    }
}

/// Widens the `NR` weight rows at `ws` to f32 as rows `row0..row0 + NR` of the packed
/// block `wp` (`[k block][nc rows][kcl]`), zero-padding `k..kp`.
#[inline(always)]
unsafe fn pack_w<V: F32x16, W: WKind, const NR: usize>(
    ws: &[*const u8; NR],
    k: usize,
    kp: usize,
    nc: usize,
    wp: *mut f32,
    row0: usize,
) {
    // Row by row, so each weight row is one sequential stream for the prefetchers.
    for (j, &w) in ws.iter().enumerate() {
        let mut k0 = 0;
        while k0 < kp {
            let kcl = KC.min(kp - k0);
            let whole = (k - k0).min(kcl) / 16 * 16;
            let dst = wp.add(k0 * nc + (row0 + j) * kcl);
            let mut c = 0;
            while c < whole {
                W::load::<V>(w.add((k0 + c) * W::BYTES)).store(dst.add(c));
                c += 16;
            }
            while c < kcl {
                *dst.add(c) = if k0 + c < k { W::get(w, k0 + c) } else { 0.0 };
                c += 1;
            }
            if V::SPLIT {
                split_row(dst, kcl);
            }
            k0 += kcl;
        }
    }
}

/// Runs the `nfull` full `MRB`-row tiles and the `r`-row remainder tile of one L1 block
/// of x rows (`xk`, row stride `xs`) against one weight sub-tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<V: F32x16, W: WKind, const MRB: usize, const NR: usize, const PF: bool>(
    xk: *const f32,
    xs: usize,
    ws: &[*const u8; NR],
    steps: usize,
    tail: Option<&[[f32; 16]; NR]>,
    acc: *mut V,
    (nfull, r): (usize, usize),
    first: bool,
) {
    for t in 0..nfull {
        let (xt, at) = (xk.add(t * MRB * xs), acc.add(t * MRB * NR));
        tile_acc::<V, W, MRB, NR, PF>(xt, xs, ws, steps, tail, at, first);
    }
    let (xr, ar) = (xk.add(nfull * MRB * xs), acc.add(nfull * MRB * NR));
    match r {
        0 => {}
        1 => tile_acc::<V, W, 1, NR, PF>(xr, xs, ws, steps, tail, ar, first),
        2 => tile_acc::<V, W, 2, NR, PF>(xr, xs, ws, steps, tail, ar, first),
        3 => tile_acc::<V, W, 3, NR, PF>(xr, xs, ws, steps, tail, ar, first),
        4 => tile_acc::<V, W, 4, NR, PF>(xr, xs, ws, steps, tail, ar, first),
        5 => tile_acc::<V, W, 5, NR, PF>(xr, xs, ws, steps, tail, ar, first),
        _ => unreachable!("MRB is at most 6"),
    }
}

/// `tiles` for `V::SPLIT` types on packed, split blocks: each tile runs both halves of its
/// chains (`F32x16::split_tile`), weight rows `NR` consecutive packed rows from `w`.
#[inline(always)]
unsafe fn split_tiles<V: F32x16, const MRB: usize, const NR: usize>(
    xk: *const f32,
    xs: usize,
    w: *const f32,
    steps: usize,
    acc: *mut V,
    (nfull, r): (usize, usize),
    first: bool,
) {
    #[inline(always)]
    unsafe fn both<V: F32x16, const MR: usize, const NR: usize>(
        x: *const f32,
        xs: usize,
        w: *const f32,
        steps: usize,
        acc: *mut V,
        first: bool,
    ) {
        for h in 0..2 {
            let off = h * xs / 2;
            let ws: [*const f32; NR] = std::array::from_fn(|j| w.add(j * xs + off));
            V::split_tile::<MR, NR>(x.add(off), xs, &ws, steps, acc, h, first);
        }
    }
    for t in 0..nfull {
        both::<V, MRB, NR>(xk.add(t * MRB * xs), xs, w, steps, acc.add(t * MRB * NR), first);
    }
    let (xr, ar) = (xk.add(nfull * MRB * xs), acc.add(nfull * MRB * NR));
    match r {
        0 => {}
        1 => both::<V, 1, NR>(xr, xs, w, steps, ar, first),
        2 => both::<V, 2, NR>(xr, xs, w, steps, ar, first),
        3 => both::<V, 3, NR>(xr, xs, w, steps, ar, first),
        4 => both::<V, 4, NR>(xr, xs, w, steps, ar, first),
        5 => both::<V, 5, NR>(xr, xs, w, steps, ar, first),
        _ => unreachable!("MRB is at most 6"),
    }
}

/// Continues (or, when `first`, starts) the chains of an `MR x NR` tile over one k
/// block: x rows at `xp` (stride `xs`), `steps` 16-steps of weights read from `ws` as `W`,
/// then one more step from the zero-padded `tail` if given; accumulators at `acc`.
/// `PF` prefetches the weight rows ahead (for weights read from memory in place).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // a[i][j] is indexed by both loops
unsafe fn tile_acc<V: F32x16, W: WKind, const MR: usize, const NR: usize, const PF: bool>(
    xp: *const f32,
    xs: usize,
    ws: &[*const u8; NR],
    steps: usize,
    tail: Option<&[[f32; 16]; NR]>,
    acc: *mut V,
    first: bool,
) {
    let mut a = [[V::zero(); NR]; MR];
    if !first {
        for (i, row) in a.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = acc.add(i * NR + j).read();
            }
        }
    }
    // The NR weight vectors are loaded first and each x row is loaded next to its NR
    // FMAs: MR·NR + NR + 1 live vectors (29 of AVX-512's 32 at 6x4). Loading the MR x rows
    // first let LLVM hoist all the loads and spill accumulators every step (measured on a
    // Sapphire-Rapids Xeon: 40% of the FMA peak, against 9x% on Zen 4 with the same code).
    for st in 0..steps {
        let c = st * 16;
        let mut wv = [V::zero(); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let wp = ws[j].add(c * W::BYTES);
            if PF {
                V::prefetch(wp.wrapping_add(super::columns::PF));
            }
            *v = W::load::<V>(wp);
        }
        for i in 0..MR {
            let xv = V::load(xp.add(i * xs + c));
            for j in 0..NR {
                a[i][j] = V::fma(xv, wv[j], a[i][j]);
            }
        }
    }
    if let Some(tail) = tail {
        let c = steps * 16;
        let mut xv = [V::zero(); MR];
        for (i, v) in xv.iter_mut().enumerate() {
            *v = V::load(xp.add(i * xs + c));
        }
        for j in 0..NR {
            let wv = V::load(tail[j].as_ptr());
            for i in 0..MR {
                a[i][j] = V::fma(xv[i], wv, a[i][j]);
            }
        }
    }
    for (i, row) in a.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            acc.add(i * NR + j).write(*v);
        }
    }
}

/// `flush` for the last `r < MRB` rows of a row block (the row count must be a constant).
#[inline(always)]
unsafe fn flush_tail<V: F32x16, C: Cols, const NR: usize>(
    r: usize,
    acc: *const V,
    cols: &C,
    i: usize,
    j: usize,
    je: usize,
) {
    match r {
        0 => {}
        1 => flush::<V, C, 1, NR>(acc, cols, i, j, je),
        2 => flush::<V, C, 2, NR>(acc, cols, i, j, je),
        3 => flush::<V, C, 3, NR>(acc, cols, i, j, je),
        4 => flush::<V, C, 4, NR>(acc, cols, i, j, je),
        5 => flush::<V, C, 5, NR>(acc, cols, i, j, je),
        _ => unreachable!("MRB is at most 6"),
    }
}

/// Reduces an `MR x NR` tile of accumulators and stores it at rows `i..`, columns `j..`.
#[inline(always)]
unsafe fn flush<V: F32x16, C: Cols, const MR: usize, const NR: usize>(
    acc: *const V,
    cols: &C,
    i: usize,
    j: usize,
    je: usize,
) {
    let mut sums = [[0f32; NR]; MR];
    for (r, row) in sums.iter_mut().enumerate() {
        for (c, s) in row.iter_mut().enumerate() {
            *s = acc.add(r * NR + c).read().reduce();
        }
    }
    cols.store::<MR, NR>(i, j, je, &sums);
}
