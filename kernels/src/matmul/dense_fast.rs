//! `Precision::Fast` for dense weights: BF16 weights meet activations rounded to bf16 in
//! AVX512_BF16 dot products (`vdpbf16ps`), as llama.cpp computes them. Other dense weight
//! types (and BF16 on a CPU without AVX512_BF16, or with it switched off, see `isa`) have no
//! faster arithmetic here and run the exact kernels, so `Fast` never means slower.
//!
//! Numerics (what `reference::matmul_fast_bf16` emulates bit for bit):
//! - each activation is rounded to bf16 once (`vcvtne2ps2bf16`: round to nearest even,
//!   denormal inputs become signed zeros, NaN stays NaN);
//! - lane `l` (0..16) of one accumulator takes, for each block of 32 values of `k` in
//!   increasing order, the pair `(c, c + 1)` with `c = 32t + 2l`: `acc += x[c+1]·w[c+1]`, then
//!   `acc += x[c]·w[c]`, each product exact in f32 and each sum rounded (`vdpbf16ps`); a
//!   partial last block is zero-padded;
//! - then the canonical 16-lane tree of `simd` and the bias add.
//!
//! The order is fixed per output element, so the batch-invariance contract holds: a row's
//! result does not depend on `m`, the other rows, the threads or the split. It differs from
//! the exact path's result (activations lose 16 bits): |error| ≲ 2^-8 Σ|x·w|.
//!
//! Loop nest of one work item: the item's x rows are rounded to bf16 once into a per-thread
//! buffer; then for each L2-sized block of weight rows, every x tile (6 rows, or fewer with
//! wider tiles for the last rows) runs over all of `k` against each 4-row (or 8-row) weight
//! sub-tile. The block's weights come from memory once, prefetched, while the first x tile
//! runs, and from L2 for the others; the x tile stays in L1.

use super::kernel::{Cols, PlainCols, SwigluCols};
use super::{check_isa, check_weight, execute, plan_items, Item, MatSeg};
use crate::isa::{self, Isa};
use crate::{DType, WeightMat};

/// True when `matmul_fast` computes `dtype` weights with the bf16 dot-product kernel here
/// (rather than falling back to the exact kernels): BF16 weights on a CPU whose AVX512_BF16
/// is available to kernels (`isa::avx512bf16`).
pub fn fast_bf16_applies(dtype: DType) -> bool {
    dtype == DType::BF16 && isa::avx512bf16()
}

/// `seg.out = x · seg.wᵀ + seg.bias` with `Precision::Fast` numerics (module docs) for the
/// BF16 segments and the exact kernels for the other dense ones.
///
/// # Panics
/// As `matmul` (shapes, dtypes), and on quantized segments: those have their own `Fast`
/// path in `crate::quant`.
pub fn matmul_fast(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_fast_with(isa::active(), isa::avx512bf16(), x, m, segs)
}

/// `matmul_fast` on a given instruction set, with the bf16 dot-product kernel on or off
/// (`bf16_dot = false` is exactly `matmul_with(isa, ..)`).
///
/// # Panics
/// As `matmul_fast`, and when this CPU lacks `isa` or (with `bf16_dot`) AVX512_BF16.
pub fn matmul_fast_with(isa: Isa, bf16_dot: bool, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    check_isa(isa);
    for (s, seg) in segs.iter().enumerate() {
        assert!(
            !seg.w.dtype.is_quantized(),
            "matmul_fast: segment {s} is {}; quantized weights run in crate::quant",
            seg.w.dtype
        );
    }
    if !bf16_dot || segs.iter().all(|s| s.w.dtype != DType::BF16) {
        return super::matmul_with(isa, x, m, segs);
    }
    check_bf16_dot();
    // The exact kernels' checks cover every segment; BF16 segments are then recomputed here.
    // Only the shapes matter for the checks, so run them on all segments first.
    let Some(first) = segs.first() else { return };
    let k = first.w.cols;
    for (s, seg) in segs.iter().enumerate() {
        check_weight(&seg.w, &format!("matmul_fast: segment {s}"));
        assert_eq!(seg.w.cols, k, "matmul_fast: segment {s} has {} columns but segment 0 has {k}", seg.w.cols);
        assert_eq!(
            Some(seg.out.len()),
            m.checked_mul(seg.w.rows),
            "matmul_fast: segment {s} output has {} values, expected [m={m}, rows={}]",
            seg.out.len(),
            seg.w.rows
        );
        if let Some(b) = &seg.bias {
            assert_eq!(b.len, seg.w.rows, "matmul_fast: segment {s} bias has {} values for {} rows", b.len, seg.w.rows);
            assert_eq!(
                Some(b.data.len()),
                b.dtype.bytes_for(b.len).filter(|_| !b.dtype.is_quantized()),
                "matmul_fast: segment {s} bias is not {} dense {} values",
                b.len,
                b.dtype
            );
        }
    }
    assert_eq!(Some(x.len()), m.checked_mul(k), "matmul_fast: x has {} values, expected [m={m}, k={k}]", x.len());
    let (mut fast, mut exact): (Vec<MatSeg<'_, '_>>, Vec<MatSeg<'_, '_>>) = segs
        .iter_mut()
        .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
        .partition(|s| s.w.dtype == DType::BF16);
    if !exact.is_empty() {
        super::matmul_with(isa, x, m, &mut exact);
    }
    if m == 0 {
        return;
    }
    let rows: Vec<usize> = fast.iter().map(|s| s.w.rows).collect();
    let cols: Vec<PlainCols<'_>> = fast
        .iter_mut()
        .map(|s| PlainCols {
            w: s.w.data.as_ptr(),
            row_bytes: s.w.row_bytes(),
            n: s.w.rows,
            bias: s.bias,
            out: s.out.as_mut_ptr(),
        })
        .collect();
    let items = plan_items(&rows, m, k, Isa::Avx512);
    // SAFETY: shapes were checked above, items cover disjoint outputs, AVX512_BF16 is there.
    execute(&items, |it| unsafe { run_bf16(x.as_ptr(), k, it, &cols[it.seg]) });
}

/// `out = silu(x · gateᵀ) * (x · upᵀ)` with `Precision::Fast` numerics when the weights are
/// BF16 (the same dot products as two `matmul_fast` calls followed by `activation::swiglu`,
/// bit for bit), else `matmul_swiglu`'s exact kernels.
///
/// # Panics
/// As `matmul_swiglu`, and on quantized weights.
pub fn matmul_swiglu_fast(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    matmul_swiglu_fast_with(isa::active(), isa::avx512bf16(), x, m, gate, up, out)
}

/// `matmul_swiglu_fast` on a given instruction set, with the bf16 dot-product kernel on or off.
///
/// # Panics
/// As `matmul_swiglu_fast`, and when this CPU lacks `isa` or (with `bf16_dot`) AVX512_BF16.
#[allow(clippy::too_many_arguments)]
pub fn matmul_swiglu_fast_with(
    isa: Isa,
    bf16_dot: bool,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    check_isa(isa);
    assert!(
        !gate.dtype.is_quantized(),
        "matmul_swiglu_fast: gate is {}; quantized weights run in crate::quant",
        gate.dtype
    );
    if !bf16_dot || gate.dtype != DType::BF16 || up.dtype != DType::BF16 {
        return super::matmul_swiglu_with(isa, x, m, gate, up, out);
    }
    check_bf16_dot();
    check_weight(&gate, "matmul_swiglu_fast: gate");
    check_weight(&up, "matmul_swiglu_fast: up");
    assert!(
        gate.rows == up.rows && gate.cols == up.cols,
        "matmul_swiglu_fast: gate is {}x{} but up is {}x{}",
        gate.rows,
        gate.cols,
        up.rows,
        up.cols
    );
    let (n, k) = (gate.rows, gate.cols);
    assert_eq!(
        Some(x.len()),
        m.checked_mul(k),
        "matmul_swiglu_fast: x has {} values, expected [m={m}, k={k}]",
        x.len()
    );
    assert_eq!(
        Some(out.len()),
        m.checked_mul(n),
        "matmul_swiglu_fast: out has {} values, expected [m={m}, n={n}]",
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    let cols = SwigluCols {
        gate: gate.data.as_ptr(),
        up: up.data.as_ptr(),
        row_bytes: gate.row_bytes(),
        n,
        out: out.as_mut_ptr(),
    };
    let items = plan_items(&[n], m, 2 * k, Isa::Avx512);
    // SAFETY: shapes were checked above, items cover disjoint outputs, AVX512_BF16 is there.
    execute(&items, |it| unsafe { run_bf16(x.as_ptr(), k, it, &cols) });
}

fn check_bf16_dot() {
    assert!(
        isa::avx512bf16_detected(),
        "matmul_fast: the bf16 dot-product kernel needs AVX512_BF16, which this CPU lacks"
    );
}

/// Runs one item of BF16 weights with the bf16 dot-product kernel.
///
/// # Safety
/// As `super::dispatch`, and the CPU has AVX512_BF16 (`isa::avx512bf16_detected`).
unsafe fn run_bf16<C: Cols>(x: *const f32, k: usize, it: &Item, cols: &C) {
    #[cfg(target_arch = "x86_64")]
    x86::run::<C>(x, k, (it.i0, it.i1), (it.j0, it.j1), cols);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AVX512_BF16 was checked: {x:?} {k} {it:?} {}", C::ROWS_PER_COL);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Cols;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// 32 bf16: one packed x row block, 64-byte aligned.
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u16; 32]);

    thread_local! {
        /// The bf16 copy of an item's x rows, reused across calls.
        static XB: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
    }

    /// Bytes ahead of the current weight load to prefetch (as the exact GEMV).
    const PF: usize = super::super::kernel::PF;
    /// Bytes of weight rows per L2 block.
    const W_L2_BYTES: usize = 1 << 20;

    /// Rounds `n` f32 at `src` to bf16 at `dst` (RNE, DAZ), zero-padding to `padded`
    /// (a multiple of 32).
    #[inline(always)]
    unsafe fn round_row(src: *const f32, n: usize, padded: usize, dst: *mut u16) {
        let mut c = 0;
        while c < padded {
            let left = n.saturating_sub(c);
            let (lo, hi) = if left >= 32 {
                (_mm512_loadu_ps(src.add(c)), _mm512_loadu_ps(src.add(c + 16)))
            } else {
                let ml = if left >= 16 { 0xffff } else { (1u32 << left) as u16 - 1 };
                let mh = if left > 16 { ((1u32 << (left - 16)) - 1) as u16 } else { 0 };
                // Masked-off lanes are neither read nor faulted; they load as +0.0.
                (_mm512_maskz_loadu_ps(ml, src.add(c)), _mm512_maskz_loadu_ps(mh, src.add(c + 16)))
            };
            let b = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_store_si512(dst.add(c) as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(b));
            c += 32;
        }
    }

    /// The canonical tree sum of the 16 lanes (`simd`'s order).
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
    }

    /// Sums of `MR` bf16 x rows (`xb`, stride `xs` values, zero-padded) against `NR` BF16
    /// weight rows: `steps` whole 32-blocks, then one block of `tail` (< 32) values.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[i][j] is indexed by both loops
    unsafe fn tile<const MR: usize, const NR: usize>(
        xb: *const u16,
        xs: usize,
        steps: usize,
        tail: usize,
        ws: &[*const u8; NR],
    ) -> [[f32; NR]; MR] {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut xv = [_mm512_setzero_si512(); MR];
        for s in 0..steps {
            let c = s * 32;
            for (i, v) in xv.iter_mut().enumerate() {
                *v = _mm512_load_si512(xb.add(i * xs + c) as *const __m512i);
            }
            for j in 0..NR {
                let wp = ws[j].add(2 * c);
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(PF) as *const i8);
                let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp as *const __m512i));
                for i in 0..MR {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], std::mem::transmute::<__m512i, __m512bh>(xv[i]), wv);
                }
            }
        }
        if tail > 0 {
            let c = steps * 32;
            let mask = (1u32 << tail) - 1;
            for (i, v) in xv.iter_mut().enumerate() {
                *v = _mm512_load_si512(xb.add(i * xs + c) as *const __m512i);
            }
            for j in 0..NR {
                // Masked-off values load as zero and are not read.
                let wv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ws[j].add(2 * c) as *const i16));
                for i in 0..MR {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], std::mem::transmute::<__m512i, __m512bh>(xv[i]), wv);
                }
            }
        }
        let mut sums = [[0f32; NR]; MR];
        for (s, a) in sums.iter_mut().zip(&acc) {
            for (s, a) in s.iter_mut().zip(a) {
                *s = reduce(*a);
            }
        }
        sums
    }

    /// One x tile of `MR` rows (bf16 at `xb`) against weight columns `j0..j1` in sub-tiles of
    /// `NR` rows, results stored at rows `i..`, skipping columns `>= jend`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_tile<C: Cols, const MR: usize, const NR: usize>(
        xb: *const u16,
        kp: usize,
        k: usize,
        i: usize,
        (j0, j1): (usize, usize),
        jend: usize,
        cols: &C,
    ) {
        let step = NR / C::ROWS_PER_COL;
        let mut j = j0;
        while j < j1 {
            let ws = cols.rows::<NR>(j);
            let s = tile::<MR, NR>(xb, kp, k / 32, k % 32, &ws);
            cols.store::<MR, NR>(i, j, jend, &s);
            j += step;
        }
    }

    /// Computes output rows `i0..i1`, columns `j0..j1` of `cols` (BF16 weights) from the f32
    /// rows of `x` (`[*, k]`).
    ///
    /// # Safety
    /// As `super::super::dispatch`, and the CPU has AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    pub(super) unsafe fn run<C: Cols>(
        x: *const f32,
        k: usize,
        (i0, i1): (usize, usize),
        (j0, j1): (usize, usize),
        cols: &C,
    ) {
        let kp = k.div_ceil(32) * 32;
        let rows = i1 - i0;
        let lines = rows * kp / 32;
        let mut buf = XB.with(Cell::take);
        if buf.len() < lines.max(1) {
            buf.resize(lines.max(1), Line([0; 32]));
        }
        let xb = buf.as_mut_ptr() as *mut u16;
        for r in 0..rows {
            round_row(x.add((i0 + r) * k), k, kp, xb.add(r * kp));
        }
        // Weight columns per L2 block: a multiple of 8 (whole wide sub-tiles).
        let per_col = (2 * kp * C::ROWS_PER_COL).max(1);
        let nc = ((W_L2_BYTES / per_col) / 8 * 8).max(8);
        let (nfull, r) = (rows / 6, rows % 6);
        let mut jb = j0;
        while jb < j1 {
            let je = (jb + nc).min(j1);
            for t in 0..nfull {
                row_tile::<C, 6, 4>(xb.add(t * 6 * kp), kp, k, i0 + t * 6, (jb, je), je, cols);
            }
            let (xr, ir) = (xb.add(nfull * 6 * kp), i0 + nfull * 6);
            match r {
                0 => {}
                1 => row_tile::<C, 1, 8>(xr, kp, k, ir, (jb, je), je, cols),
                2 => row_tile::<C, 2, 8>(xr, kp, k, ir, (jb, je), je, cols),
                3 => row_tile::<C, 3, 8>(xr, kp, k, ir, (jb, je), je, cols),
                4 => row_tile::<C, 4, 4>(xr, kp, k, ir, (jb, je), je, cols),
                5 => row_tile::<C, 5, 4>(xr, kp, k, ir, (jb, je), je, cols),
                _ => unreachable!("r < 6"),
            }
            jb = je;
        }
        XB.with(|s| s.set(buf));
    }
}
