//! `Precision::Fast` for dense weights: BF16 weights meet activations rounded to bf16, as
//! llama.cpp computes them, in AMX-BF16 tiles (`FastBf16::Amx`, where the CPU and OS allow)
//! or AVX512_BF16 dot products (`FastBf16::Dot`). F16 weights at `Fast` run in pair panels
//! (`amx_pair_panels`, where AMX-BF16 runs). F32 weights, F16 ones in rows, and BF16 on a CPU
//! without these extensions (or with them switched off, see `isa`), run the exact kernels.
//!
//! Measured on the 2-core Xeon (Sapphire-Rapids class) this was written on: `vdpbf16ps`
//! issues at half the rate of f32 FMAs there (114 vs 215 GFLOP/s per core), so `Dot` only
//! saves the widening work; AMX runs a 512x2048x2048 GEMM 4-5x faster than the exact path.
//! On CPUs where `vdpbf16ps` runs at the FMA rate (Zen 4/5) `Dot` doubles the peak.
//!
//! Numerics of `Dot` on the row layout (what `reference::matmul_fast_bf16` emulates bit for
//! bit; the pair panels of `bf16_pair_panels` add in another order, stated there):
//! - each activation is rounded to bf16 once (`vcvtne2ps2bf16`: round to nearest even,
//!   denormal inputs become signed zeros, NaN stays NaN);
//! - lane `l` (0..16) of one accumulator takes, for each block of 32 values of `k` in
//!   increasing order, the pair `(c, c + 1)` with `c = 32t + 2l`: `acc += x[c+1]·w[c+1]`, then
//!   `acc += x[c]·w[c]`, each product exact in f32 and each sum rounded (`vdpbf16ps`); a
//!   partial last block is zero-padded;
//! - then the canonical 16-lane tree of `lanes` and the bias add.
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

use super::columns::{Cols, PlainCols, SwigluCols};
use super::{check_isa, check_weight, execute, plan_items, Item, MatSeg};
use crate::isa::{self, Isa};
use crate::{DType, WeightMat};

/// The kernel that computes BF16 weights under `Precision::Fast`. Results differ between
/// kernels (as between ISAs), never between batches or threads with one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastBf16 {
    /// No bf16 arithmetic: the exact kernels.
    Off,
    /// AVX512_BF16 `vdpbf16ps` dot products (order in the module docs).
    Dot,
    /// AMX-BF16 tiles (`tdpbf16ps`): x rows as B tiles, 16 weight rows as A tiles, one tile
    /// product per 32 values of `k` in increasing order, accumulated in the hardware's order.
    Amx,
}

impl FastBf16 {
    /// The fastest kernel kernels may use here: AMX, else the dot products, else none.
    pub fn best() -> FastBf16 {
        if isa::amx_bf16() {
            FastBf16::Amx
        } else if isa::avx512bf16() {
            FastBf16::Dot
        } else {
            FastBf16::Off
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FastBf16::Off => "exact",
            FastBf16::Dot => "avx512bf16",
            FastBf16::Amx => "amx-bf16",
        }
    }

    /// Whether this kernel computes `dtype` weights in rows (else they run the exact
    /// kernels): BF16 with every kernel but `Off`. (F16 runs fast only in pair panels.)
    pub fn applies(self, dtype: DType) -> bool {
        dtype == DType::BF16 && self != FastBf16::Off
    }

    fn check(self) {
        let ok = match self {
            FastBf16::Off => true,
            FastBf16::Dot => isa::avx512bf16_detected(),
            FastBf16::Amx => isa::amx_bf16_detected(),
        };
        assert!(ok, "matmul_fast: the {} kernel needs an extension this CPU (or OS) does not offer", self.name());
    }
}

/// True when `matmul_fast` computes `dtype` weights with a bf16 kernel here (rather than
/// falling back to the exact kernels): `FastBf16::best().applies(dtype)`, and F16 where the
/// engine packs it into pair panels: for the AMX split kernel (`amx_pair_panels::applies`), or
/// rounded to BF16 for the `vdpbf16ps` kernel where that is the best (F16 left in rows still
/// runs the exact kernels). BF16 pair panels run where BF16 rows do.
pub fn fast_bf16_applies(dtype: DType) -> bool {
    let best = FastBf16::best();
    best.applies(dtype) || (dtype == DType::F16 && (super::amx_pair_panels::applies() || best == FastBf16::Dot))
}

/// `seg.out = x · seg.wᵀ + seg.bias` with `Precision::Fast` numerics (module docs) for the
/// BF16 segments and the exact kernels for the other dense ones.
///
/// # Panics
/// As `matmul` (shapes, dtypes), and on quantized segments: those have their own `Fast`
/// path in `crate::gemm::quant`.
pub fn matmul_fast(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_fast_with(isa::active(), FastBf16::best(), x, m, segs)
}

/// `matmul_fast` on a given instruction set with a given BF16 kernel (`FastBf16::Off` is
/// exactly `matmul_with(isa, ..)`).
///
/// # Panics
/// As `matmul_fast`, and when this CPU lacks `isa` or the extension `kernel` needs.
pub fn matmul_fast_with(isa: Isa, kernel: FastBf16, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    check_isa(isa);
    for (s, seg) in segs.iter().enumerate() {
        assert!(
            !seg.w.dtype.is_quantized(),
            "matmul_fast: segment {s} is {}; quantized weights run in gemm::quant",
            seg.w.dtype
        );
    }
    if segs.iter().any(|s| s.w.layout == crate::Layout::PairPanels) {
        let (mut p, mut r): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) = segs
            .iter_mut()
            .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
            .partition(|s| s.w.layout == crate::Layout::PairPanels);
        // One call per dtype: the kernels split x for one.
        for dtype in [DType::F16, DType::BF16] {
            let (mut d, rest): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) =
                p.into_iter().partition(|s| s.w.dtype == dtype);
            p = rest;
            if !d.is_empty() {
                super::run_pair_panels(x, m, &mut d, pair_path(kernel, dtype, "matmul_fast"));
            }
        }
        if let Some(s) = p.first() {
            panic!("matmul_fast: pair panels hold f16 or bf16, not {}", s.w.dtype);
        }
        if !r.is_empty() {
            matmul_fast_with(isa, kernel, x, m, &mut r);
        }
        return;
    }
    if segs.iter().all(|s| !kernel.applies(s.w.dtype)) {
        return super::matmul_with(isa, x, m, segs);
    }
    assert!(
        segs.iter().all(|s| s.w.layout == crate::Layout::Rows),
        "matmul_fast: packed dense weights run the exact kernels"
    );
    kernel.check();
    // The exact kernels' checks cover every segment; BF16 segments are then recomputed here.
    // Only the shapes matter for the checks, so run them on all segments first.
    let Some(first) = segs.first() else { return };
    let k = first.w.cols;
    for (s, seg) in segs.iter().enumerate() {
        check_weight(&seg.w, format_args!("matmul_fast: segment {s}"));
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
    let (mut fast, mut exact): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) = segs
        .iter_mut()
        .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
        .partition(|s| kernel.applies(s.w.dtype));
    if !exact.is_empty() {
        super::matmul_with(isa, x, m, &mut exact);
    }
    if m == 0 {
        return;
    }
    let rows: crate::Few<usize> = fast.iter().map(|s| s.w.rows).collect();
    let cols: crate::Few<PlainCols<'_>> = fast.iter_mut().map(PlainCols::of).collect();
    run_kernel(kernel, x, m, k, k, &rows, &cols);
}

/// How pair panels of `dtype` run with `kernel`: F16 on `amx_pair_panels` with any kernel (`Amx`
/// runs its tiles, the others its vector path); BF16 on `amx_pair_panels` with `Amx` (the row
/// kernel's products, in tiles from two rows), on `bf16_pair_panels` with `Dot`.
///
/// # Panics
/// On BF16 pair panels with `Off`, and where AVX512_BF16 (or the kernel's extension) is
/// missing.
fn pair_path(kernel: FastBf16, dtype: DType, what: &str) -> super::PairPath {
    assert!(isa::avx512bf16_detected(), "{what}: {dtype} pair panels need AVX512_BF16");
    kernel.check();
    match (dtype, kernel) {
        (DType::F16, _) => super::PairPath::Tiles { amx: kernel == FastBf16::Amx },
        (_, FastBf16::Amx) => super::PairPath::Tiles { amx: true },
        (_, FastBf16::Dot) => super::PairPath::Dot,
        _ => panic!("{what}: {dtype} pair panels run with the avx512bf16 or amx-bf16 kernel, not {}", kernel.name()),
    }
}

/// Plans (as `plan_k` multiply-adds per output) and runs the items of one call with
/// `kernel` on BF16 weights in rows (the caller checked that it applies).
fn run_kernel<C: AmxCols>(kernel: FastBf16, x: &[f32], m: usize, k: usize, plan_k: usize, rows: &[usize], cols: &[C]) {
    match kernel {
        FastBf16::Amx => {
            #[cfg(target_arch = "x86_64")]
            {
                let xp = amx::pack_x(x, m, k);
                let items = amx::plan(rows, m, plan_k);
                // SAFETY: shapes were checked by the caller, items cover disjoint outputs in
                // whole 16-row blocks of x, AMX-BF16 is there (checked).
                execute(&items, |it| unsafe { amx::run(&xp, k, it, &cols[it.seg]) });
                xp.release();
            }
        }
        _ => {
            let items = plan_items(rows, m, plan_k, Isa::Avx512);
            // SAFETY: shapes were checked by the caller, items cover disjoint outputs,
            // AVX512_BF16 is there (checked).
            execute(&items, |it| unsafe { run_bf16(x.as_ptr(), k, it, &cols[it.seg]) });
        }
    }
}

/// `out = silu(x · gateᵀ) * (x · upᵀ)` with `Precision::Fast` numerics when the weights are
/// BF16 (the same dot products as two `matmul_fast` calls followed by `activation::swiglu`,
/// bit for bit), else `matmul_swiglu`'s exact kernels.
///
/// # Panics
/// As `matmul_swiglu`, and on quantized weights.
pub fn matmul_swiglu_fast(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    matmul_swiglu_fast_with(isa::active(), FastBf16::best(), x, m, gate, up, out)
}

/// `matmul_swiglu_fast` on a given instruction set with a given BF16 kernel.
///
/// # Panics
/// As `matmul_swiglu_fast`, and when this CPU lacks `isa` or the extension `kernel` needs.
#[allow(clippy::too_many_arguments)]
pub fn matmul_swiglu_fast_with(
    isa: Isa,
    kernel: FastBf16,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    check_isa(isa);
    assert!(
        !gate.dtype.is_quantized(),
        "matmul_swiglu_fast: gate is {}; quantized weights run in gemm::quant",
        gate.dtype
    );
    if gate.layout == crate::Layout::PairPanels || up.layout == crate::Layout::PairPanels {
        let path = pair_path(kernel, gate.dtype, "matmul_swiglu_fast");
        return super::swiglu_pair_panels(x, m, gate, up, out, path);
    }
    if !kernel.applies(gate.dtype) || up.dtype != gate.dtype {
        return super::matmul_swiglu_with(isa, x, m, gate, up, out);
    }
    kernel.check();
    check_weight(&gate, format_args!("matmul_swiglu_fast: gate"));
    check_weight(&up, format_args!("matmul_swiglu_fast: up"));
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
    // Two weight rows per output column: plan with the work of 2n rows, split on n.
    run_kernel(kernel, x, m, k, 2 * k, &[n], std::slice::from_ref(&cols));
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
    use super::super::bf16_round::round_row;
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
    const PF: usize = super::super::columns::PF;
    /// Bytes of weight rows per L2 block.
    const W_L2_BYTES: usize = 1 << 20;

    /// The canonical tree sum of the 16 lanes (`lanes`'s order).
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
    }

    /// Sums of `MR` bf16 x rows (`xb`, 64-byte aligned, stride `xs` values, zero-padded)
    /// against `NR` BF16 weight rows: `steps` whole 32-blocks, then one block of `tail` (< 32)
    /// values; the weight rows come from memory, prefetched [`PF`] bytes ahead.
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
            if NR.is_multiple_of(4) {
                for j in (0..NR).step_by(4) {
                    s[j..j + 4].copy_from_slice(&reduce4([a[j], a[j + 1], a[j + 2], a[j + 3]]));
                }
            } else {
                for (s, a) in s.iter_mut().zip(a) {
                    *s = reduce(*a);
                }
            }
        }
        sums
    }

    /// [`reduce`] of four vectors at once, the same additions on the same operands (so the
    /// same bits) with the lanes shuffled across vectors: 13 instructions instead of 32.
    #[inline(always)]
    unsafe fn reduce4(v: [__m512; 4]) -> [f32; 4] {
        // s8 = low half + high half, two vectors per register.
        let ab = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(v[0], v[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(v[0], v[1]),
        );
        let cd = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(v[2], v[3]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(v[2], v[3]),
        );
        // s4 = low + high 128 bits of each s8: one vector's s4 per 128-bit chunk.
        let s4 =
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd), _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd));
        // s2 = s4 + its high pair; s = s2[0] + s2[1]: lane 0 of each chunk.
        let s2 = _mm512_add_ps(s4, _mm512_permute_ps::<0b11_10_11_10>(s4));
        let s1 = _mm512_add_ps(s2, _mm512_permute_ps::<0b01_01_01_01>(s2));
        let mut l = [0f32; 16];
        _mm512_storeu_ps(l.as_mut_ptr(), s1);
        [l[0], l[4], l[8], l[12]]
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
    pub(in crate::gemm) unsafe fn run<C: Cols>(
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

/// What the AMX kernel needs of a `Cols` besides storing: the weight matrices whose rows
/// give an output column (one for a projection, gate and up for SwiGLU), which it reads as
/// 16-row tiles with the row stride.
trait AmxCols: Cols {
    fn matrices(&self) -> [*const u8; 2];
    fn row_bytes(&self) -> usize;
    fn n(&self) -> usize;
}

impl AmxCols for PlainCols<'_> {
    fn matrices(&self) -> [*const u8; 2] {
        [self.w, self.w]
    }
    fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    fn n(&self) -> usize {
        self.n
    }
}

impl AmxCols for SwigluCols {
    fn matrices(&self) -> [*const u8; 2] {
        [self.gate, self.up]
    }
    fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    fn n(&self) -> usize {
        self.n
    }
}

#[cfg(target_arch = "x86_64")]
mod amx {
    //! AMX-BF16: `C[j][i] += A[j][k] · B[k][i]` on 16×16 f32 tiles, A = 16 weight rows ×
    //! 32 bf16 values of `k` loaded straight from the weights (row stride), B = the same 32
    //! values of 16 x rows, rounded to bf16 once per call and stored as B tiles (pairs of
    //! consecutive `k` values per x row, 16 x rows per tile row). Each output element is the
    //! same sequence of tile products over `k` whatever `m`, the split or the threads.
    //! Register blocking: 2 A tiles × 2 B tiles into 4 C tiles (tmm0-3), operands in tmm4-7.

    use super::super::amx_tiles::{configure, load, release, store, zero};
    use super::{AmxCols, Item};
    use rayon::prelude::*;
    use std::arch::asm;
    use std::cell::Cell;

    /// One 1 KiB tile (16 rows of 64 bytes).
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    pub(in crate::gemm) struct Tile([u8; 1024]);

    const ZERO: Tile = Tile([0; 1024]);

    /// x as B tiles: block `b` (x rows 16b..16b+16, zero past `m`), k tile `t` at
    /// `tiles[b * kt + t]`; tile row `kk`, bytes `4i..4i+4`: x[16b + i][32t + 2kk .. + 2].
    pub(in crate::gemm) struct PackedX {
        tiles: Vec<Tile>,
        kt: usize,
    }

    impl PackedX {
        fn tile(&self, b: usize, t: usize) -> *const u8 {
            self.tiles[b * self.kt + t].0.as_ptr()
        }
    }

    /// Rounds x (`[m, k]`) to bf16 and lays it out as B tiles, in a buffer taken from a
    /// process-wide slot (`PackedX::release` returns it), so a steady decode step allocates
    /// none whichever pool thread runs the call.
    pub(in crate::gemm) fn pack_x(x: &[f32], m: usize, k: usize) -> PackedX {
        let kt = k.div_ceil(32);
        let blocks = m.div_ceil(16);
        let mut tiles = std::mem::take(&mut *X_TILES.lock().unwrap_or_else(|e| e.into_inner()));
        tiles.clear();
        tiles.resize(blocks * kt, ZERO);
        if kt > 0 {
            tiles.par_chunks_mut(kt).enumerate().for_each(|(b, tl)| {
                // Rows past `m` stay zero.
                for i in 0..16.min(m - 16 * b) {
                    let row = x.as_ptr().wrapping_add((16 * b + i) * k);
                    for (t, tile) in tl.iter_mut().enumerate() {
                        let mut v = [0u16; 32];
                        // SAFETY: values 32t..min(32t + 32, k) of row 16b + i < m of x
                        // (`[m, k]`), the rest zero; the caller checked AVX512_BF16 (AMX
                        // implies it).
                        unsafe { round(row.add(32 * t), k - 32 * t, 32, v.as_mut_ptr()) };
                        for kk in 0..16 {
                            let o = kk * 64 + 4 * i;
                            tile.0[o..o + 2].copy_from_slice(&v[2 * kk].to_le_bytes());
                            tile.0[o + 2..o + 4].copy_from_slice(&v[2 * kk + 1].to_le_bytes());
                        }
                    }
                }
            });
        }
        PackedX { tiles, kt }
    }

    impl PackedX {
        /// Returns the tiles' buffer for the next `pack_x`: the slot keeps the larger of it
        /// and what another call in flight may have put back meanwhile.
        pub(in crate::gemm) fn release(self) {
            let mut slot = X_TILES.lock().unwrap_or_else(|e| e.into_inner());
            if self.tiles.capacity() > slot.capacity() {
                *slot = self.tiles;
            }
        }
    }

    /// `pack_x`'s buffer between calls (a call in flight while another holds it makes its
    /// own: MoE experts running at once).
    static X_TILES: std::sync::Mutex<Vec<Tile>> = std::sync::Mutex::new(Vec::new());

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")]
    unsafe fn round(src: *const f32, n: usize, padded: usize, dst: *mut u16) {
        super::super::bf16_round::round_row(src, n, padded, dst)
    }

    /// Work items: columns in multiples of 32 (two A tiles), x rows in whole 16-row blocks.
    pub(in crate::gemm) fn plan(rows: &[usize], m: usize, k: usize) -> crate::Items<Item> {
        let total: usize = rows.iter().sum();
        let threads = rayon::current_num_threads().max(1);
        let work = m.saturating_mul(k.max(1)).saturating_mul(total);
        let target = if threads == 1 { 1 } else { (threads * 4).min((work / crate::gemm::MIN_ITEM_WORK).max(1)) };
        let chunk = total.div_ceil(target).div_ceil(32).max(1) * 32;
        let n_items: usize = rows.iter().map(|r| r.div_ceil(chunk)).sum();
        let m_step = if n_items < target && m > 32 {
            let parts = target.div_ceil(n_items.max(1)).min(m.div_ceil(32));
            m.div_ceil(parts).div_ceil(32) * 32
        } else {
            m.div_ceil(16) * 16
        };
        let mut items = crate::Items::new();
        for (seg, &n) in rows.iter().enumerate() {
            for j0 in (0..n).step_by(chunk) {
                for i0 in (0..m).step_by(m_step.max(16)) {
                    items.push(Item { seg, i0, i1: (i0 + m_step).min(m), j0, j1: (j0 + chunk).min(n) });
                }
            }
        }
        items
    }

    thread_local! {
        /// Zero-padded copies of partial tiles (rows past `n`, values past `k`), reused.
        static PAD: Cell<Vec<Tile>> = const { Cell::new(Vec::new()) };
    }

    /// `C[c] += A · B` for the fixed pairs (c, A, B): 0 = (4, 6), 1 = (4, 7), 2 = (5, 6), 3 = (5, 7).
    #[inline(always)]
    unsafe fn dot(c: usize) {
        match c {
            0 => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
            1 => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem)),
            2 => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem)),
            _ => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem)),
        }
    }

    /// Computes output rows `i0..i1` (`i0` a multiple of 16), columns `j0..j1` of `cols`.
    ///
    /// # Safety
    /// `cols` describes valid BF16 weights (`n` rows of `row_bytes` bytes, `k` values each)
    /// and an output covering the item; `xp` is `pack_x` of the call's x; the CPU has
    /// AMX-BF16 and this process the permission (`isa::amx_bf16_detected`).
    pub(in crate::gemm) unsafe fn run<C: AmxCols>(xp: &PackedX, k: usize, it: &Item, cols: &C) {
        let (i0, i1, j0, j1) = (it.i0, it.i1, it.j0, it.j1);
        debug_assert!(i0 % 16 == 0);
        configure();
        let (rb, n, kt, kfull) = (cols.row_bytes(), cols.n(), xp.kt, k / 32);
        let groups = C::ROWS_PER_COL;
        let mats = cols.matrices();
        // Scratch: per (group, A tile) a zero-padded copy of a partial row group (kt tiles
        // laid out as one [16][32 kt] block) and of the last partial k tile; 8 C tiles.
        let mut pad = PAD.with(Cell::take);
        let per = kt + 1;
        if pad.len() < 4 * per + 8 {
            pad.resize(4 * per + 8, ZERO);
        }
        let pad_ptr = pad.as_mut_ptr();
        let cbuf = pad_ptr.add(4 * per);
        // One x block (decode): one A tile per step, so the weights stream as 16 rows at a
        // time (fewer concurrent row streams for the prefetchers). The blocking changes no
        // result: every C element is the same sequence of tile products over k.
        let (jstep, two_a) = if i1 - i0 > 16 { (32, true) } else { (16, false) };
        let mut jt = j0;
        while jt < j1 {
            let na = if two_a && jt + 16 < j1 { 2 } else { 1 };
            // A sources: (pointer to k tile 0, row stride) per (group, tile).
            let mut src = [[(std::ptr::null::<u8>(), 0usize); 2]; 2];
            for g in 0..groups {
                for (t, s) in src[g].iter_mut().enumerate().take(na) {
                    let j = jt + 16 * t;
                    let valid = 16.min(n - j);
                    let base = mats[g].add(j * rb);
                    let block = pad_ptr.add((g * 2 + t) * per);
                    if valid == 16 {
                        *s = (base, rb);
                    } else {
                        // Rows past `n`: a zero-padded copy, 64 * kt bytes per row.
                        let dst = block as *mut u8;
                        std::ptr::write_bytes(dst, 0, 1024 * kt);
                        for r in 0..valid {
                            std::ptr::copy_nonoverlapping(base.add(r * rb), dst.add(r * 64 * kt), 2 * k);
                        }
                        *s = (dst as *const u8, 64 * kt);
                    }
                    if kfull < kt {
                        // The last k tile, zero-padded past `k`.
                        let tail = block.add(kt) as *mut u8;
                        std::ptr::write_bytes(tail, 0, 1024);
                        for r in 0..valid {
                            let from = s.0.add(r * s.1 + 64 * kfull);
                            std::ptr::copy_nonoverlapping(from, tail.add(64 * r), 2 * (k - 32 * kfull));
                        }
                    }
                }
            }
            let mut ib = i0;
            while ib < i1 {
                let nb = if ib + 16 < i1 { 2 } else { 1 };
                let b0 = ib / 16;
                #[allow(clippy::needless_range_loop)] // g also indexes the C buffers
                for g in 0..groups {
                    let cs = |ta: usize, tb: usize| ta * 2 + tb;
                    for ta in 0..na {
                        for tb in 0..nb {
                            zero(cs(ta, tb));
                        }
                    }
                    for t in 0..kt {
                        for (ta, &(p, stride)) in src[g].iter().enumerate().take(na) {
                            if t < kfull {
                                // No software prefetch: the hardware's alone streamed the
                                // 16 rows faster (`quant -- bf16 fast threads=2`, 5632 x 2048,
                                // 1 KiB ahead in L1 against none: m = 1 24.7-25.5 against
                                // 28.4-29.8 GB/s, m = 16 361 against 416-422 GFLOP/s).
                                load(4 + ta, p.add(64 * t), stride);
                            } else {
                                load(4 + ta, pad_ptr.add((g * 2 + ta) * per + kt) as *const u8, 64);
                            }
                        }
                        for tb in 0..nb {
                            load(6 + tb, xp.tile(b0 + tb, t), 64);
                        }
                        for ta in 0..na {
                            for tb in 0..nb {
                                dot(cs(ta, tb));
                            }
                        }
                    }
                    for ta in 0..na {
                        for tb in 0..nb {
                            store(cs(ta, tb), cbuf.add(g * 4 + cs(ta, tb)) as *mut u8);
                        }
                    }
                }
                // C tile [j][i] (f32, 16 per row) to the outputs, row by row of x.
                for ta in 0..na {
                    let j = jt + 16 * ta;
                    for tb in 0..nb {
                        let c = |g: usize| cbuf.add(g * 4 + ta * 2 + tb) as *const f32;
                        for i in 0..16 {
                            let row = ib + 16 * tb + i;
                            if row >= i1 {
                                break;
                            }
                            if groups == 1 {
                                let mut s = [[0f32; 16]; 1];
                                for (jj, v) in s[0].iter_mut().enumerate() {
                                    *v = *c(0).add(jj * 16 + i);
                                }
                                cols.store::<1, 16>(row, j, j1, &s);
                            } else {
                                let mut s = [[0f32; 32]; 1];
                                for jj in 0..16 {
                                    s[0][jj] = *c(0).add(jj * 16 + i);
                                    s[0][16 + jj] = *c(1).add(jj * 16 + i);
                                }
                                cols.store::<1, 32>(row, j, j1, &s);
                            }
                        }
                    }
                }
                ib += 32;
            }
            jt += jstep;
        }
        release();
        PAD.with(|s| s.set(pad));
    }
}
