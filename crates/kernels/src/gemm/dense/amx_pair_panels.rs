//! F16 and BF16 weights under `Precision::Fast` on CPUs with AMX-BF16, in `bf16_pair_panels`'s
//! pair panels. F16: each weight and each activation split exactly into two bf16 parts,
//! three bf16 tile products per 32 values of `k`. BF16: the activations rounded to bf16, one
//! tile product per 32 values (the products the row layout's AMX kernel, `fast_bf16::amx`,
//! takes, so the same bits). Prefill runs them on the AMX tiles; decode (fewer than
//! [`amx_min_rows`]) replays the same arithmetic with vector FMAs, bit for bit, so a
//! row's result does not depend on which path ran it (batch invariance).
//!
//! Why BF16 moved here from the row layout: decode there loads 16 weight rows per tile,
//! 16 streams 4 KiB apart, and read 85% of the bandwidth roof in the model; here a panel is
//! one sequential stream, two at a time, prefetched, as F16's decode (102%).
//!
//! ## Numerics (F16; BF16 is the first product alone, `P(xh, w)`)
//! - `w = wh + wl` exactly: `wh` is the weight as f32 with its low 16 bits cleared (its top
//!   8 significant bits), `wl` the rest (at most 3 of an f16's 11 bits, exact in bf16).
//! - `x ≈ xh + xl`: `xh = bf16(x)`, `xl = bf16(x - xh)` (round to nearest even, denormal
//!   inputs to signed zero), so `|x - xh - xl| ≤ 2^-17 |x|`: 16 significant bits, more than
//!   llama.cpp's f16 activations (11).
//! - For each 32-value block of `k` in increasing order, each output takes three products in
//!   this order: `C += P(xh, wh)`, `C += P(xh, wl)`, `C += P(xl, wh)`. `P(a, b)` is what one
//!   `tdpbf16ps` adds (Intel SDM): `e = Σ a[2q]·b[2q]` and `o = Σ a[2q+1]·b[2q+1]` over the
//!   block's 16 pairs, each a chain from zero in pair order of single-rounded FMAs, then
//!   `C + (e + o)`; every step flushes denormal results to zero and reads denormals as zero.
//!   A throwaway program matched this model against `tdpbf16ps` on 512,000 of 512,000 random
//!   outputs, in each of two exponent ranges (the three other orders it tried differed on
//!   15,000-306,000); the tests here check
//!   the AMX path against the vector path and both against `reference::matmul_fast_pair_tiles`.
//! - `C` starts at zero; the bias is added after the last block. The dropped `wl·xl` is at
//!   most `2^-16 |w·x|`, so the error stays near the f32 path's: ≲ 2^-15 Σ|x·w|.
//!
//! ## Kernels
//! - AMX (a call of [`amx_min_rows`] or more): x rows are the A tiles (`xh` and `xl`
//!   rows as they are, once per call), the weights the B tiles, split from the panels into an
//!   L2 scratch once per task and group of up to four panel streams; the C tiles stay in
//!   registers over all of `k`: per block, 2 x tile loads, then per stream 2 weight tile
//!   loads and 3 tile products.
//! - Vector (fewer rows): one pass over a panel per row, or per 2 rows of F16; per pair,
//!   64 bytes of f16 widened, split, and six FMA chains per row (three products, rows 0-7 and
//!   8-15), even and odd values in neighbouring lanes; `MXCSR.FTZ/DAZ` set around the sums as the tiles flush. BF16: two
//!   chains per pair line (the even and the odd values of the 16 rows, widened by a shift
//!   and a mask).
//! - BF16 on AMX needs no split: a block of a panel (16 pairs of 64 bytes) is a B tile as
//!   stored, loaded straight from the panel.

#![allow(clippy::needless_range_loop)] // lane, row and stream indices address several arrays

use rayon::prelude::*;

use super::exact_panels::{Sink, PANEL};
use crate::DType;

/// Activation rows of a call from which it runs on the AMX tiles; below, the vector path.
/// Both give the same bits; this is only the faster one. F16: the tiles pay for splitting
/// the panels once per call, so 2 rows share one vector pass over them instead (kernel
/// bench `quant -- bf16 fast threads=2`, 5632 x 2048: m = 2 775-816 us against 942-977 on
/// the tiles; 3 rows in one pass took 938-983, level with the tiles); BF16 loads its tiles
/// as stored (m = 2 532-664 us, m = 1 527-595).
pub fn amx_min_rows(dtype: DType) -> usize {
    if dtype == DType::F16 {
        3
    } else {
        2
    }
}

/// `k` rounded up to whole 32-value blocks.
fn padded(k: usize) -> usize {
    k.div_ceil(32) * 32
}

/// Bytes of a packed `[rows, cols]` F16 matrix (`bf16_pair_panels`'s layout).
pub fn packed_bytes(rows: usize, cols: usize) -> usize {
    super::bf16_pair_panels::packed_bytes(rows, cols)
}

/// `src`, a row-major `[rows, cols]` F16 matrix, in the pair-panel layout.
pub fn pack(rows: usize, cols: usize, src: &[u8], dst: &mut [u8]) {
    super::bf16_pair_panels::pack(rows, cols, src, dst)
}

/// Whether F16 and BF16 weights run this kernel at `Fast` here: the CPU and OS allow
/// AMX-BF16 and it is not switched off (`isa`).
pub fn applies() -> bool {
    super::FastBf16::best() == super::FastBf16::Amx
}

/// Checks an F16 or BF16 pair-panel matrix's size (its fields are public).
pub(in crate::gemm) fn check(w: &crate::WeightMat<'_>, what: &str) {
    assert!(matches!(w.dtype, DType::F16 | DType::BF16), "{what}: pair panels hold f16 or bf16, not {}", w.dtype);
    assert_eq!(w.data.len(), packed_bytes(w.rows, w.cols), "{what}: {}x{} pair panels size", w.rows, w.cols);
}

/// 64 bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// Values added to the row stride of the A-tile rows: rows 4 KiB apart would share one L1
/// set, and a tile load reads 16 of them.
const SKEW: usize = 32;

/// [`SplitX`]'s buffer between calls (no allocation per step). One for the process, not
/// one per thread: the calling thread can be any pool worker, and a per-thread buffer left
/// a step on a worker not yet warmed at that size allocating 92 KB (`tests/step_alloc.rs`,
/// bf16 with 16 sequences). A call in flight while another holds it makes its own.
static SPLIT: std::sync::Mutex<Vec<Line>> = std::sync::Mutex::new(Vec::new());

/// A call's activations split into `xh + xl` (F16 weights) or rounded to `xh` alone (BF16)
/// once for all its tasks: for the AMX path as bf16 rows (`m + 16` rows, the last 16 zero,
/// so a tile of 16 rows never reads past), for the vector path as f32 rows.
pub(in crate::gemm) struct SplitX {
    lines: Vec<Line>,
    /// Rows of each part.
    rows: usize,
    /// Values per row (`k` padded, plus [`SKEW`] for bf16 rows).
    stride: usize,
    amx: bool,
    /// 2 (`xh`, `xl`: F16 weights) or 1 (`xh`: BF16).
    parts: usize,
}

impl Drop for SplitX {
    /// Returns the buffer; the slot keeps the larger of it and what another call in flight
    /// may have put back meanwhile.
    fn drop(&mut self) {
        let mut slot = SPLIT.lock().unwrap_or_else(|e| e.into_inner());
        if self.lines.capacity() > slot.capacity() {
            *slot = std::mem::take(&mut self.lines);
        }
    }
}

impl SplitX {
    fn elem(&self) -> usize {
        if self.amx {
            2
        } else {
            4
        }
    }

    /// Row `i` of the hi (`part` 0) or lo (1) values.
    fn row(&self, part: usize, i: usize) -> *const u8 {
        let base = self.lines.as_ptr() as *const u8;
        base.wrapping_add((part * self.rows + i) * self.stride * self.elem())
    }
}

/// `x` (`[m, k]`) split for weights of `dtype` (F16 or BF16) for a call that runs on AMX
/// (`amx`) or the vector path; rows in parallel on the current pool when there are many.
///
/// # Safety
/// The CPU has AVX512_BF16 ([`applies`] holds).
pub(in crate::gemm) unsafe fn split_x(x: &[f32], m: usize, k: usize, amx: bool, dtype: DType) -> SplitX {
    assert!(x.len() >= m * k, "split_x: {} values for {m}x{k}", x.len());
    let kp = padded(k);
    let (rows, stride, elem) = if amx { (m + 16, kp + SKEW, 2) } else { (m, kp, 4) };
    let parts = if dtype == DType::F16 { 2 } else { 1 };
    let mut lines = std::mem::take(&mut *SPLIT.lock().unwrap_or_else(|e| e.into_inner()));
    // Every row is written whole below but the 16 padding rows: only those are cleared.
    lines.resize((parts * rows * stride * elem).div_ceil(64).max(1), Line([0; 64]));
    let sx = SplitX { lines, rows, stride, amx, parts };
    #[cfg(target_arch = "x86_64")]
    {
        let base = sx.lines.as_ptr() as usize;
        if amx {
            for part in 0..parts {
                std::ptr::write_bytes(sx.row(part, m) as *mut u8, 0, 16 * stride * 2);
            }
        }
        let xp = x.as_ptr() as usize;
        let run = |(r0, r1): (usize, usize)| {
            for r in r0..r1 {
                let at = |part: usize| (base + ((part * rows + r) * stride * elem)) as *mut u8;
                // SAFETY: row r < m of x; its two destination rows lie in `lines` (sized for
                // 2 x rows x stride values) and no other part writes them; AVX512_BF16 is
                // there (the caller's contract).
                unsafe {
                    let lo = if parts == 2 { at(1) } else { std::ptr::null_mut() };
                    x86::split_row((xp as *const f32).add(r * k), k, kp, at(0), lo, amx)
                }
            }
        };
        if m * k >= 1 << 16 {
            let per = m.div_ceil(rayon::current_num_threads().max(1) * 4).max(1);
            (0..m.div_ceil(per)).into_par_iter().for_each(|c| run((c * per, ((c + 1) * per).min(m))));
        } else {
            run((0, m));
        }
    }
    sx
}

/// Runs one task: panels `p0..p1` of the pair-panel matrix at `w` (`n` rows, `k` columns)
/// against activation rows `i0..i1` of the call's split x, on the path `sx` was split for.
///
/// # Safety
/// `w` is a packed `[n, k]` matrix of the dtype `sx` was split for, `sx` is [`split_x`] of the call's x (rows `ir`
/// inside it), the sink covers the task's outputs, [`applies`] holds and, for the AMX path,
/// this process has the AMX permission (`isa::amx_bf16_detected`).
pub(in crate::gemm) unsafe fn task(
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    sx: &SplitX,
    ir: (usize, usize),
    sink: &Sink<'_>,
) {
    #[cfg(target_arch = "x86_64")]
    if sx.amx {
        x86::amx_task(w, nk, pr, sx, ir, sink)
    } else {
        x86::vector_task(w, nk, pr, sx, ir, sink)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("f16 pair panels are only made where AMX runs: {w:?} {nk:?} {pr:?} {ir:?} {}", sx.amx);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::amx_tiles::{configure, load, release, store, zero};
    use super::{padded, Line, Sink, SplitX, PANEL};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// Splits `k` values at `x` into hi and lo parts (zeros up to `kp`): bf16 at `hi`/`lo`
    /// (`amx`) or the same values as f32; `lo` null: the hi part alone.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    pub(in crate::gemm) unsafe fn split_row(x: *const f32, k: usize, kp: usize, hi: *mut u8, lo: *mut u8, amx: bool) {
        let mut c = 0;
        while c < kp {
            let left = k.saturating_sub(c);
            let mask = if left >= 16 { 0xffff } else { ((1u32 << left) - 1) as u16 };
            // Masked-off lanes are neither read nor faulted; they load as +0.0.
            let v = _mm512_maskz_loadu_ps(mask, x.add(c));
            let h = _mm512_cvtneps_pbh(v);
            let hf = widen(h);
            // Exact: hf is v rounded, within a factor of two of it.
            let l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
            if amx {
                _mm256_storeu_si256(hi.add(2 * c) as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(h));
                if !lo.is_null() {
                    _mm256_storeu_si256(lo.add(2 * c) as *mut __m256i, std::mem::transmute::<__m256bh, __m256i>(l));
                }
            } else {
                _mm512_storeu_ps(hi.add(4 * c) as *mut f32, hf);
                if !lo.is_null() {
                    _mm512_storeu_ps(lo.add(4 * c) as *mut f32, widen(l));
                }
            }
            c += 16;
        }
    }

    #[inline(always)]
    unsafe fn widen(h: __m256bh) -> __m512 {
        let w = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(h));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
    }

    /// The f32 values of one 64-byte pair line (16 rows' two f16 each): rows 0-7 and 8-15,
    /// even and odd values in neighbouring lanes.
    #[inline(always)]
    unsafe fn widen_line(p: *const u8) -> (__m512, __m512) {
        let v = _mm512_loadu_si512(p as *const __m512i);
        (_mm512_cvtph_ps(_mm512_castsi512_si256(v)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v)))
    }

    /// The top 8 significant bits of f32 values (low 16 bits cleared).
    #[inline(always)]
    unsafe fn hi_part(v: __m512) -> __m512 {
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0xffff_0000u32 as i32)))
    }

    /// Writes the 16 sums at `g` (and the up sums at `u`, fused SwiGLU) of activation row
    /// `i`, weight rows from `j0` (of `n`), through the sink.
    #[inline(always)]
    unsafe fn put_row(g: *const f32, u: Option<*const f32>, sink: &Sink<'_>, (i, j0): (usize, usize), n: usize) {
        super::super::exact_panels::put_lanes(
            |d| std::ptr::copy_nonoverlapping(g, d, PANEL),
            u.map(|u| move |d: *mut f32| std::ptr::copy_nonoverlapping(u, d, PANEL)),
            sink,
            i,
            j0,
            (n - j0).min(PANEL),
        )
    }

    // ---- Vector path ----

    /// Bytes ahead of the weight stream that each step prefetches: without it one panel's
    /// single stream read 20.6 GB/s on two threads, with 2 KiB 31 (1 and 4 KiB: 28.6).
    const PF: usize = 2048;

    /// Each lane plus its neighbour (even + odd of one row, the same in both lanes).
    #[inline(always)]
    unsafe fn pair_sum(z: __m512) -> __m512 {
        _mm512_add_ps(z, _mm512_permute_ps::<0b10_11_00_01>(z))
    }

    /// Values `2q` and `2q + 1` at `v` in every pair of lanes.
    #[inline(always)]
    unsafe fn pair_bcast(v: *const f32, q: usize) -> __m512 {
        _mm512_castpd_ps(_mm512_set1_pd((v.add(2 * q) as *const f64).read_unaligned()))
    }

    /// Sets `MXCSR.FTZ/DAZ` (the tiles flush denormals) and returns the control word to
    /// restore. The callers are not inlined, and their sums reach memory before they restore
    /// it, so no float operation of theirs runs outside the flushing mode.
    #[inline(always)]
    unsafe fn flush_denormals() -> u32 {
        let mut saved = 0u32;
        asm!("stmxcsr [{}]", in(reg) &mut saved as *mut u32, options(nostack));
        let flush = saved | (1 << 15) | (1 << 6);
        asm!("ldmxcsr [{}]", in(reg) &flush as *const u32, options(nostack));
        saved
    }

    #[inline(always)]
    unsafe fn restore_mxcsr(saved: u32) {
        asm!("ldmxcsr [{}]", in(reg) &saved as *const u32, options(nostack));
    }

    /// The 16 sums of each of `NS` F16 panel streams (`kt` blocks at `wp[s]`) with each of
    /// `R` rows of split x (f32 hi and lo at `xh[r]`, `xl[r]`), stored at `out[s][r]`, under
    /// `MXCSR.FTZ/DAZ` as the tiles compute them; each pair line is widened and split once
    /// for all the rows. Two streams at once (a gate and its up panel, or two panels) keep
    /// two weight streams in flight: tinyllama-1.1b F16 decode 11.35 / 11.39 -> 13.51 / 13.13
    /// tokens/s against one stream (exact kernels in the same runs: 12.4 / 12.5). Callers
    /// take 2 streams of 1 row or 1 stream of 2 rows (12 chains either way).
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    unsafe fn panel_sums<const NS: usize, const R: usize>(
        wp: [*const u8; NS],
        kt: usize,
        (xh, xl): ([*const f32; R], [*const f32; R]),
        out: [[*mut f32; R]; NS],
    ) {
        let saved = flush_denormals();
        let mut c = [[[_mm512_setzero_ps(); 2]; R]; NS];
        for t in 0..kt {
            // Per stream and row, chains of the three products (hi·hi, lo·hi, hi·lo) for
            // rows 0-7 (0..3) and 8-15 (3..6).
            let mut z = [[[_mm512_setzero_ps(); 6]; R]; NS];
            for q in 16 * t..16 * t + 16 {
                // No closures here: they would not inherit this function's target features.
                let (mut xhv, mut xlv) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
                for r in 0..R {
                    xhv[r] = pair_bcast(xh[r], q);
                    xlv[r] = pair_bcast(xl[r], q);
                }
                for s in 0..NS {
                    _mm_prefetch::<_MM_HINT_T0>(wp[s].wrapping_add(64 * q + PF) as *const i8);
                    let (wa, wb) = widen_line(wp[s].add(64 * q));
                    let (ha, hb) = (hi_part(wa), hi_part(wb));
                    let (la, lb) = (_mm512_sub_ps(wa, ha), _mm512_sub_ps(wb, hb));
                    for r in 0..R {
                        let (xhv, xlv, z) = (xhv[r], xlv[r], &mut z[s][r]);
                        z[0] = _mm512_fmadd_ps(ha, xhv, z[0]);
                        z[1] = _mm512_fmadd_ps(la, xhv, z[1]);
                        z[2] = _mm512_fmadd_ps(ha, xlv, z[2]);
                        z[3] = _mm512_fmadd_ps(hb, xhv, z[3]);
                        z[4] = _mm512_fmadd_ps(lb, xhv, z[4]);
                        z[5] = _mm512_fmadd_ps(hb, xlv, z[5]);
                    }
                }
            }
            for s in 0..NS {
                for r in 0..R {
                    for p in 0..3 {
                        c[s][r][0] = _mm512_add_ps(c[s][r][0], pair_sum(z[s][r][p]));
                        c[s][r][1] = _mm512_add_ps(c[s][r][1], pair_sum(z[s][r][p + 3]));
                    }
                }
            }
        }
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        for s in 0..NS {
            for r in 0..R {
                _mm512_storeu_ps(out[s][r], _mm512_permutex2var_ps(c[s][r][0], even, c[s][r][1]));
            }
        }
        restore_mxcsr(saved);
    }

    /// [`panel_sums`] of rows `i` and `i + 1` of `sx` (F16) against each of the streams in
    /// `wp` (1 or 2) in turn, sums at `out[stream][row]`.
    #[inline(always)]
    unsafe fn row_pair_sums(wp: &[*const u8], kt: usize, sx: &SplitX, i: usize, out: &mut [[[f32; PANEL]; 2]; 2]) {
        let xh: [*const f32; 2] = std::array::from_fn(|r| sx.row(0, i + r) as *const f32);
        let xl: [*const f32; 2] = std::array::from_fn(|r| sx.row(1, i + r) as *const f32);
        for (s, &w) in wp.iter().enumerate() {
            let o: [*mut f32; 2] = std::array::from_fn(|r| out[s][r].as_mut_ptr());
            panel_sums::<1, 2>([w], kt, (xh, xl), [o]);
        }
    }

    /// [`panel_sums`] for BF16 panels and one row of `xh` (f32 at `xh`): one product per
    /// block, so per pair line two chains, the even values of the 16 rows (`w << 16`) and the
    /// odd ones (`w & 0xffff0000`), rows in lanes; per block `C + (e + o)`.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
    unsafe fn panel_sums_bf16<const NS: usize>(wp: [*const u8; NS], kt: usize, xh: *const f32, out: [*mut f32; NS]) {
        let saved = flush_denormals();
        let odd = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let mut c = [_mm512_setzero_ps(); NS];
        for t in 0..kt {
            let mut e = [_mm512_setzero_ps(); NS];
            let mut o = [_mm512_setzero_ps(); NS];
            for q in 16 * t..16 * t + 16 {
                let xe = _mm512_set1_ps(*xh.add(2 * q));
                let xo = _mm512_set1_ps(*xh.add(2 * q + 1));
                for s in 0..NS {
                    _mm_prefetch::<_MM_HINT_T0>(wp[s].wrapping_add(64 * q + PF) as *const i8);
                    let v = _mm512_loadu_si512(wp[s].add(64 * q) as *const __m512i);
                    let we = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                    let wo = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
                    e[s] = _mm512_fmadd_ps(we, xe, e[s]);
                    o[s] = _mm512_fmadd_ps(wo, xo, o[s]);
                }
            }
            for s in 0..NS {
                c[s] = _mm512_add_ps(c[s], _mm512_add_ps(e[s], o[s]));
            }
        }
        for s in 0..NS {
            _mm512_storeu_ps(out[s], c[s]);
        }
        restore_mxcsr(saved);
    }

    /// The sums of `NS` panel streams with row `i` of `sx`, F16 or BF16 as `sx` was split.
    #[inline(always)]
    unsafe fn row_sums<const NS: usize>(wp: [*const u8; NS], kt: usize, sx: &SplitX, i: usize, out: [*mut f32; NS]) {
        if sx.parts == 2 {
            let x = ([sx.row(0, i) as *const f32], [sx.row(1, i) as *const f32]);
            panel_sums::<NS, 1>(wp, kt, x, out.map(|o| [o]))
        } else {
            panel_sums_bf16::<NS>(wp, kt, sx.row(0, i) as *const f32, out)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    pub(in crate::gemm) unsafe fn vector_task(
        w: *const u8,
        (n, k): (usize, usize),
        (p0, p1): (usize, usize),
        sx: &SplitX,
        (i0, i1): (usize, usize),
        sink: &Sink<'_>,
    ) {
        let kp = padded(k);
        let (kt, pb) = (kp / 32, PANEL * kp * 2);
        let up = sink.up();
        // F16 rows in pairs: one pass over each panel stream per 2 rows, sharing the widening
        // and split of each pair line (3 rows measured no faster than the tiles). A row left
        // over takes the one-row walk below, with its two streams at once.
        let pairs_end = if sx.parts == 2 { i0 + (i1 - i0) / 2 * 2 } else { i0 };
        if pairs_end > i0 {
            let mut sums = [[[0f32; PANEL]; 2]; 2];
            for p in p0..p1 {
                let wp = [w.add(p * pb), up.unwrap_or(w).add(p * pb)];
                let wp = if up.is_some() { &wp[..] } else { &wp[..1] };
                for i in (i0..pairs_end).step_by(2) {
                    row_pair_sums(wp, kt, sx, i, &mut sums);
                    for d in 0..2 {
                        put_row(sums[0][d].as_ptr(), up.map(|_| sums[1][d].as_ptr()), sink, (i + d, p * PANEL), n);
                    }
                }
            }
        }
        let mut sums = [[0f32; PANEL]; 2];
        let [s0, s1] = &mut sums;
        let out = [s0.as_mut_ptr(), s1.as_mut_ptr()];
        let mut p = p0;
        while p < p1 {
            // Two streams: this panel's gate and up, else this panel and the next.
            let two = up.is_some() || p + 1 < p1;
            for i in pairs_end..i1 {
                match up {
                    Some(u) => row_sums::<2>([w.add(p * pb), u.add(p * pb)], kt, sx, i, out),
                    None if two => row_sums::<2>([w.add(p * pb), w.add((p + 1) * pb)], kt, sx, i, out),
                    None => row_sums::<1>([w.add(p * pb)], kt, sx, i, [out[0]]),
                }
                let panels = if two && up.is_none() { 2 } else { 1 };
                for d in 0..panels {
                    let j0 = (p + d) * PANEL;
                    put_row(out[d], up.map(|_| out[1] as *const f32), sink, (i, j0), n);
                }
            }
            p += if two && up.is_none() { 2 } else { 1 };
        }
    }

    // ---- AMX path ----

    /// Bytes of split weight tiles a task keeps for one group of panel streams (each stream
    /// takes `2 KiB` per 32 values of `k`): they are read once per 16 x rows, from L2.
    const SCRATCH_BYTES: usize = 1 << 20;

    thread_local! {
        /// Split weight tiles and the C tiles' copy, reused across calls.
        static SCRATCH: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
    }

    /// The three products of one block into C tile `c`, in the module's order:
    /// `xh·wh`, `xh·wl`, `xl·wh`.
    #[inline(always)]
    unsafe fn products(c: usize) {
        match c {
            0 => asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm0, tmm4, tmm7",
                "tdpbf16ps tmm0, tmm5, tmm6",
                options(nostack, nomem)
            ),
            1 => asm!(
                "tdpbf16ps tmm1, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm1, tmm5, tmm6",
                options(nostack, nomem)
            ),
            2 => asm!(
                "tdpbf16ps tmm2, tmm4, tmm6",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                options(nostack, nomem)
            ),
            _ => asm!(
                "tdpbf16ps tmm3, tmm4, tmm6",
                "tdpbf16ps tmm3, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm6",
                options(nostack, nomem)
            ),
        }
    }

    /// The one product of a BF16 block into C tile `c`: `xh·w`.
    #[inline(always)]
    unsafe fn product(c: usize) {
        match c {
            0 => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
            1 => asm!("tdpbf16ps tmm1, tmm4, tmm6", options(nostack, nomem)),
            2 => asm!("tdpbf16ps tmm2, tmm4, tmm6", options(nostack, nomem)),
            _ => asm!("tdpbf16ps tmm3, tmm4, tmm6", options(nostack, nomem)),
        }
    }

    /// One panel stream (`kt` blocks at `wp`) split into B tiles: per block a 1 KiB hi tile
    /// then a 1 KiB lo tile at `dst`, row `q` holding pair `q`'s 16 bf16 pairs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c")]
    unsafe fn split_panel(wp: *const u8, kt: usize, dst: *mut u8) {
        for q in 0..16 * kt {
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(64 * q + PF) as *const i8);
            let (wa, wb) = widen_line(wp.add(64 * q));
            let (ha, hb) = (hi_part(wa), hi_part(wb));
            let (la, lb) = (_mm512_sub_ps(wa, ha), _mm512_sub_ps(wb, hb));
            // Both parts are exact in bf16, so the conversion's rounding changes nothing.
            let h = _mm512_cvtne2ps_pbh(hb, ha);
            let l = _mm512_cvtne2ps_pbh(lb, la);
            let at = dst.add((q / 16) * 2048 + (q % 16) * 64);
            _mm512_storeu_si512(at as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(h));
            _mm512_storeu_si512(at.add(1024) as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(l));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c")]
    pub(in crate::gemm) unsafe fn amx_task(
        w: *const u8,
        (n, k): (usize, usize),
        (p0, p1): (usize, usize),
        sx: &SplitX,
        (i0, i1): (usize, usize),
        sink: &Sink<'_>,
    ) {
        let kp = padded(k);
        let (kt, pb) = (kp / 32, PANEL * kp * 2);
        if kt == 0 || p0 >= p1 || i0 >= i1 {
            // k = 0: every sum is zero, as the vector path gives.
            if kt == 0 {
                vector_task(w, (n, k), (p0, p1), sx, (i0, i1), sink);
            }
            return;
        }
        let up = sink.up();
        let per_panel = if up.is_some() { 2 } else { 1 };
        // F16 splits its panels into an L2 scratch; BF16 loads its B tiles from the panels,
        // which stay in L2 across the x tiles (4 streams at k = 5632: 704 KiB).
        let f16 = sx.parts == 2;
        let streams_fit = if f16 { (SCRATCH_BYTES / (kt * 2048)).clamp(per_panel, 4) } else { 4 };
        let group = streams_fit / per_panel;
        let mut scratch = SCRATCH.with(Cell::take);
        let need = (if f16 { group * per_panel * kt * 2048 } else { 0 } + 2 * 1024) / 64;
        if scratch.len() < need {
            scratch.resize(need, Line([0; 64]));
        }
        let split = scratch.as_mut_ptr() as *mut u8;
        let cbuf = split.add(need * 64 - 2 * 1024);
        configure();
        let xstride = sx.stride * 2;
        let mut pa = p0;
        while pa < p1 {
            let pe = (pa + group).min(p1);
            let ns = (pe - pa) * per_panel;
            let stream = |s: usize| {
                (if s.is_multiple_of(per_panel) { w } else { up.unwrap_or(w) }).add((pa + s / per_panel) * pb)
            };
            if f16 {
                for s in 0..ns {
                    split_panel(stream(s), kt, split.add(s * kt * 2048));
                }
            }
            let mut i = i0;
            while i < i1 {
                for c in 0..ns {
                    zero(c);
                }
                let xh = sx.row(0, i);
                if f16 {
                    let xl = sx.row(1, i);
                    for t in 0..kt {
                        load(4, xh.add(64 * t), xstride);
                        load(5, xl.add(64 * t), xstride);
                        for c in 0..ns {
                            let b = split.add((c * kt + t) * 2048);
                            load(6, b, 64);
                            load(7, b.add(1024), 64);
                            products(c);
                        }
                    }
                } else {
                    for t in 0..kt {
                        load(4, xh.add(64 * t), xstride);
                        for c in 0..ns {
                            load(6, stream(c).add(1024 * t), 64);
                            product(c);
                        }
                    }
                }
                let rows = (i1 - i).min(16);
                for pp in 0..pe - pa {
                    let c = pp * per_panel;
                    store(c, cbuf);
                    if up.is_some() {
                        store(c + 1, cbuf.add(1024));
                    }
                    let j0 = (pa + pp) * PANEL;
                    for r in 0..rows {
                        let u = up.map(|_| cbuf.add(1024 + 64 * r) as *const f32);
                        put_row(cbuf.add(64 * r) as *const f32, u, sink, (i + r, j0), n);
                    }
                }
                i += 16;
            }
            pa = pe;
        }
        release();
        SCRATCH.with(|s| s.set(scratch));
    }
}
