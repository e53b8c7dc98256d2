//! MatMul / GEMV: `y = x · Wᵀ (+ bias)` with f32 activations and f32/f16/bf16 weights
//! (quantized weights: see the `quant` work in a later issue).
//!
//! CONTRACT (the helpers implementing this module must keep it):
//! - `x` is `[m, k]` row-major f32, each weight is `[n, k]` row-major (HF layout), each
//!   output is `[m, n]` row-major f32.
//! - Batch invariance: `y[i, j]` is computed with one fixed reduction order over `k` that
//!   does not depend on `m`, on the other rows, on the thread count or on how the work was
//!   split. Threads split over `n` (and `m`), never over `k`. The same holds across ISAs
//!   only within one ISA (scalar and SIMD results may differ in the last bits).
//! - Several weight matrices sharing the same `x` may be computed in one call (`segs`),
//!   each writing its own output: this is the merged QKV projection without copying weights.
//! - `matmul_swiglu` computes `silu(x·Gᵀ) * (x·Uᵀ)` with the same dot products as two
//!   separate `matmul` calls followed by `activation::swiglu` (bit-identical result), but
//!   reads `x` once and never writes the gate/up intermediates.
//! - Runs on the current rayon pool.
//!
//! IMPLEMENTATION (stronger than the contract): every element is one dot product in the
//! canonical order described in `lanes` (16 lanes over `k`, fused multiply-adds, fixed tree),
//! which the scalar, AVX2 and AVX-512 paths all perform exactly, so results are
//! bit-identical across ISAs as well. The bias is added after the reduction.
//!
//! Speed: register tiles of 6 x-rows × 4 weight rows (AVX-512; 3×2 on AVX2) share loads;
//! with fewer rows left the tile widens to 8 weight rows (GEMV is the 1×8 tile). In the
//! packed (k-blocked) nest AVX2 runs 3×4 tiles as two passes over half the 16 chains each
//! (`F32x16::SPLIT`): the same 12 ymm accumulators, 7 loads per 12 FMAs instead of 10. bf16/f16
//! weights are widened in registers. Two loop nests around the tiles, chosen by the rows
//! of a work item (`BLOCKED_MIN_ROWS`): the direct one (`columns`, decode) runs each tile
//! over all of `k` and reads every weight row from memory once per call; the k-blocked one
//! (`register_blocked`, prefill) packs x and weight blocks so tiles work from L1. Work items split
//! `n` (and `m` when `n` alone gives too few items) across the current rayon pool.
//!
//! The split is tunable (`*_tiled` entry points, [`MatMulTiling`]: weight rows and activation
//! rows per item, items per thread); by the contract above no tiling changes a bit of the
//! result, only who computes what.

pub mod dense;
pub(crate) mod gguf;
pub mod quant;
pub mod reference;
#[cfg(test)]
pub(crate) mod tiling_tests;

pub use dense::fast_bf16::{
    fast_bf16_applies, matmul_fast, matmul_fast_with, matmul_swiglu_fast, matmul_swiglu_fast_with, FastBf16,
};

use crate::isa::{self, Isa};
use crate::simd::{F32x16, Scalar16};
use crate::{DType, Layout, WeightMat, WeightVec};
use dense::columns::{Cols, PlainCols, SwigluCols};
use dense::lanes::{WKind, WBF16, WF16, WF32};
use dense::{bf16_pair_panels, exact_panels, register_blocked};

/// One weight matrix of a (possibly merged) projection and where its result goes.
pub struct MatSeg<'a, 'o> {
    pub w: WeightMat<'a>,
    pub bias: Option<WeightVec<'a>>,
    /// `[m, w.rows]` row-major.
    pub out: &'o mut [f32],
}

pub use tboost_ops::{MatMulCase, MatMulTiling};
use tboost_ops::{Tiling, Unsupported};

/// Dense weights run here; block-quantized ones in `crate::quant`. Activations are f32.
pub fn supports(case: &MatMulCase) -> Result<(), Unsupported> {
    match case.dtype {
        DType::F32 | DType::F16 | DType::BF16 if case.act_dtype == DType::F32 => Ok(()),
        DType::F32 | DType::F16 | DType::BF16 => Err(Unsupported::new("act_dtype", case.act_dtype, "f32")),
        d if d.is_quantized() => quant::supports(case),
        other => Err(Unsupported::new("weight_dtype", other, "f32, f16, bf16 or a GGUF block type")),
    }
}

/// The one SiLU every fused and unfused path uses (see `activation::silu`).
pub use crate::activation::silu;

/// `seg.out = x · seg.wᵀ + seg.bias` for every segment. `x` is `[m, k]`.
///
/// # Panics
/// On shapes that disagree (segments with different `cols`, `x` not `[m, cols]`, an output
/// not `[m, rows]`, a bias not `rows` long) or a weight dtype `supports` rejects: the
/// orchestrator checks these when it builds the plan, so reaching one is a bug.
pub fn matmul(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    let quantized = segs.iter().filter(|s| s.w.dtype.is_quantized()).count();
    if quantized == 0 {
        matmul_with(isa::active(), x, m, segs)
    } else if quantized == segs.len() {
        quant::matmul_quant(x, m, segs)
    } else {
        // A merged projection mixing dense and quantized matrices: two calls, one per kind.
        let (mut q, mut d): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) = segs
            .iter_mut()
            .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
            .partition(|s| s.w.dtype.is_quantized());
        quant::matmul_quant(x, m, &mut q);
        matmul_with(isa::active(), x, m, &mut d)
    }
}

/// `matmul` on a given instruction set (tests run every path in one process).
///
/// # Panics
/// As `matmul`, and when this CPU lacks `isa`.
pub fn matmul_with(isa: Isa, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_with_tiled(isa, &MatMulTiling::default(), x, m, segs)
}

/// [`matmul_with`] with its work split by `tiling`.
///
/// # Panics
/// As `matmul_with`, and on a tiling value outside its range.
pub fn matmul_with_tiled(isa: Isa, tiling: &MatMulTiling, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    check_isa(isa);
    check_tiling("matmul", tiling);
    let Some(first) = segs.first() else { return };
    let k = first.w.cols;
    for (s, seg) in segs.iter().enumerate() {
        let w = &seg.w;
        check_weight(w, format_args!("matmul: segment {s}"));
        assert_eq!(w.cols, k, "matmul: segment {s} has {} columns but segment 0 has {k}", w.cols);
        assert_eq!(
            Some(seg.out.len()),
            m.checked_mul(w.rows),
            "matmul: segment {s} output has {} values, expected [m={m}, rows={}]",
            seg.out.len(),
            w.rows
        );
        if let Some(b) = &seg.bias {
            assert_eq!(b.len, w.rows, "matmul: segment {s} bias has {} values for {} rows", b.len, w.rows);
            // `WeightVec`'s fields are public: do not trust `len` alone.
            assert_eq!(
                Some(b.data.len()),
                b.dtype.bytes_for(b.len).filter(|_| !b.dtype.is_quantized()),
                "matmul: segment {s} bias is not {} dense {} values",
                b.len,
                b.dtype
            );
        }
    }
    assert_eq!(Some(x.len()), m.checked_mul(k), "matmul: x has {} values, expected [m={m}, k={k}]", x.len());
    if m == 0 {
        return;
    }
    if segs.iter().any(|s| s.w.layout == Layout::Panels) {
        // Packed segments take the panel kernels, the others the row kernels.
        let (mut p, mut r): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) = segs
            .iter_mut()
            .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
            .partition(|s| s.w.layout == Layout::Panels);
        run_packed(isa, tiling, x, m, &mut p);
        if !r.is_empty() {
            matmul_with_tiled(isa, tiling, x, m, &mut r);
        }
        return;
    }
    let rows: crate::Few<usize> = segs.iter().map(|s| s.w.rows).collect();
    let cols: crate::Few<PlainCols<'_>> = segs.iter_mut().map(PlainCols::of).collect();
    let dtypes: crate::Few<DType> = segs.iter().map(|s| s.w.dtype).collect();
    let items = plan_items_tiled(&rows, m, k, isa, tiling);
    // SAFETY: shapes were checked above; items cover disjoint output columns/rows.
    execute(&items, |it| unsafe { dispatch(isa, dtypes[it.seg], x.as_ptr(), k, it, &cols[it.seg]) });
}

/// `out = silu(x · gateᵀ) * (x · upᵀ)`, `out` is `[m, gate.rows]`.
///
/// # Panics
/// As `matmul`: `gate` and `up` must have the same shape and dtype.
pub fn matmul_swiglu(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    if gate.dtype.is_quantized() {
        quant::matmul_swiglu_quant(x, m, gate, up, out)
    } else {
        matmul_swiglu_with(isa::active(), x, m, gate, up, out)
    }
}

/// `matmul_swiglu` on a given instruction set.
///
/// # Panics
/// As `matmul_swiglu`, and when this CPU lacks `isa`.
pub fn matmul_swiglu_with(isa: Isa, x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    matmul_swiglu_with_tiled(isa, &MatMulTiling::default(), x, m, gate, up, out)
}

/// [`matmul_swiglu_with`] with its work split by `tiling`.
///
/// # Panics
/// As `matmul_swiglu_with`, and on a tiling value outside its range.
pub fn matmul_swiglu_with_tiled(
    isa: Isa,
    tiling: &MatMulTiling,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    check_isa(isa);
    check_tiling("matmul_swiglu", tiling);
    check_weight(&gate, format_args!("matmul_swiglu: gate"));
    check_weight(&up, format_args!("matmul_swiglu: up"));
    assert!(
        gate.dtype == up.dtype && gate.rows == up.rows && gate.cols == up.cols,
        "matmul_swiglu: gate is {}x{} {} but up is {}x{} {}",
        gate.rows,
        gate.cols,
        gate.dtype,
        up.rows,
        up.cols,
        up.dtype
    );
    let (n, k) = (gate.rows, gate.cols);
    assert_eq!(Some(x.len()), m.checked_mul(k), "matmul_swiglu: x has {} values, expected [m={m}, k={k}]", x.len());
    assert_eq!(
        Some(out.len()),
        m.checked_mul(n),
        "matmul_swiglu: out has {} values, expected [m={m}, n={n}]",
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if gate.layout == Layout::Panels || up.layout == Layout::Panels {
        assert!(gate.layout == up.layout, "matmul_swiglu: gate and up must both be packed or both not");
        let sink = exact_panels::Sink::Swiglu { out: out.as_mut_ptr(), ld: n, up: up.data.as_ptr() };
        let tasks = packed_tasks(&[n], m, 2 * k, tiling, 1);
        let sink = SendSink(sink);
        // SAFETY: shapes were checked above; tasks cover disjoint outputs.
        execute_tasks(&tasks, |t| unsafe {
            exact_panels::task(
                isa,
                gate.dtype,
                gate.data.as_ptr(),
                (n, k),
                (t.p0, t.p1),
                x.as_ptr(),
                (t.i0, t.i1),
                sink.get(),
            )
        });
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
    let items = plan_items_tiled(&[n], m, 2 * k, isa, tiling);
    // SAFETY: shapes were checked above; items cover disjoint output columns/rows.
    execute(&items, |it| unsafe { dispatch(isa, gate.dtype, x.as_ptr(), k, it, &cols) });
}

/// A tiling the kernels take: every set value in its range (checked by the orchestrator first,
/// so reaching a bad one is a caller bug).
pub(crate) fn check_tiling(op: &str, tiling: &MatMulTiling) {
    if let Err(e) = tiling.check() {
        panic!("{op}: tiling: {e}");
    }
}

fn check_isa(isa: Isa) {
    let have = isa::detected();
    assert!(isa <= have, "matmul: {} kernels requested but this CPU supports only {}", isa.name(), have.name());
}

/// A supported dtype and exactly `rows * cols` elements of data (or the packed size):
/// `WeightMat`'s fields are public, and the kernels read rows through raw pointers.
/// `what` names the weight in a panic (`format_args!`: no string is built unless one fires).
fn check_weight(w: &WeightMat<'_>, what: std::fmt::Arguments<'_>) {
    if let Err(e) = supports(&MatMulCase::f32(w.dtype, w.rows, w.cols)) {
        panic!("{what}: {e}");
    }
    match w.layout {
        Layout::Panels => return exact_panels::check(w, what),
        Layout::PairPanels => panic!("{what}: pair panels run the fast kernels (Precision::Fast) only"),
        Layout::Rows => {}
    }
    let need = w.dtype.bytes_for(w.cols).and_then(|rb| rb.checked_mul(w.rows));
    assert_eq!(Some(w.data.len()), need, "{what}: {}x{} {} weight has {} bytes", w.rows, w.cols, w.dtype, w.data.len());
}

/// One task over packed panels: panels `p0..p1` of segment `seg`, activation rows `i0..i1`.
#[derive(Clone, Copy, Debug)]
struct PackedTask {
    seg: usize,
    p0: usize,
    p1: usize,
    i0: usize,
    i1: usize,
}

/// Weight bytes a decode task of packed dense panels reads at most.
const DECODE_TASK_BYTES: usize = 512 << 10;

/// Splits segments of `rows[s]` rows into whole-panel tasks, as `plan_items_tiled` splits
/// columns (`tasks_per_thread` per thread, and rows of `m` when panels alone give too few;
/// `panel_rows`, a multiple of 16, and `act_rows` where the tiling sets them). Above 16 rows
/// a task takes at least `min_panels` panels (unless the tiling sets `panel_rows`): the
/// width of the kernel's register tile, which a narrower task would leave part idle. In
/// decode the last tasks shrink (see the comment inside) unless the tiling sets the tasks.
fn packed_tasks(
    rows: &[usize],
    m: usize,
    k: usize,
    tiling: &MatMulTiling,
    min_panels: usize,
) -> crate::Items<PackedTask> {
    let panels: Vec<usize> = rows.iter().map(|r| r.div_ceil(exact_panels::PANEL)).collect();
    let total: usize = panels.iter().sum();
    let threads = rayon::current_num_threads().max(1);
    let work = m.saturating_mul(k.max(1)).saturating_mul(total * exact_panels::PANEL);
    let per_thread = tiling.tasks_per_thread_for(m <= 16);
    let target = if threads == 1 { 1 } else { (threads * per_thread).min((work / MIN_ITEM_WORK).max(1)) };
    let chunk = tiling
        .panel_rows
        .map_or_else(
            || {
                let even = total.div_ceil(target);
                // Decode: tasks of at most DECODE_TASK_BYTES (2-byte weights), claimed in order
                // (`par`), keep the threads' weight streams close to each other.
                let cap = DECODE_TASK_BYTES / (exact_panels::PANEL * 2 * k.max(1));
                if m <= 16 {
                    even.min(cap.max(1))
                } else {
                    even.max(min_panels)
                }
            },
            |r| r / exact_panels::PANEL,
        )
        .max(1);
    let n_tasks: usize = panels.iter().map(|p| p.div_ceil(chunk)).sum();
    let m_step = match tiling.act_rows {
        Some(r) => r,
        None if n_tasks < target && m > 8 => m.div_ceil(target.div_ceil(n_tasks.max(1))).next_multiple_of(8),
        None => m,
    };
    // Decode: the last tasks shrink (`par::guided_size`, here in panels, down to one) so the
    // threads finish together; a set panel or task count keeps even tasks.
    let guided = m <= 16 && tiling.panel_rows.is_none() && tiling.tasks_per_thread.is_none() && threads > 1;
    let mut left = total;
    let mut tasks = crate::Items::new();
    for (seg, &np) in panels.iter().enumerate() {
        let mut p0 = 0;
        while p0 < np {
            let size = if guided { crate::par::guided_size(left, threads, chunk, 1) } else { chunk };
            let p1 = (p0 + size).min(np);
            for i0 in (0..m).step_by(m_step.max(1)) {
                tasks.push(PackedTask { seg, p0, p1, i0, i1: (i0 + m_step).min(m) });
            }
            left = left.saturating_sub(p1 - p0);
            p0 = p1;
        }
    }
    tasks
}

fn execute_tasks(tasks: &[PackedTask], f: impl Fn(&PackedTask) + Sync + Send) {
    crate::par::for_each_in_order(tasks, f)
}

/// A sink shared by tasks that write disjoint outputs.
struct SendSink<'a>(exact_panels::Sink<'a>);
// SAFETY: the sink's pointers are read-only weights and outputs written at disjoint places.
unsafe impl Send for SendSink<'_> {}
unsafe impl Sync for SendSink<'_> {}

impl<'a> SendSink<'a> {
    /// A method (not the field) so closures capture the whole `Send + Sync` wrapper.
    fn get(&self) -> &exact_panels::Sink<'a> {
        &self.0
    }
}

/// How pair panels run (`dense::fast_bf16::pair_path` picks it from the kernel and dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PairPath {
    /// `bf16_pair_panels`'s `vdpbf16ps` chains (BF16 with the `Dot` kernel).
    Dot,
    /// `amx_pair_panels`'s tile arithmetic (F16; BF16 with the `Amx` kernel), on its AMX tiles
    /// from `amx_min_rows` rows when `amx`, else always on its vector path.
    Tiles { amx: bool },
}

/// Segments in pair panels of one dtype (`matmul_fast`'s caller checked the kernel), run on
/// `path`; shapes checked here, tasks split as packed panels' (default tiling: these
/// kernels keep their split).
fn run_pair_panels(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>], path: PairPath) {
    let Some(first) = segs.first() else { return };
    let (k, dtype) = (first.w.cols, first.w.dtype);
    let tiles = path != PairPath::Dot;
    for (s, seg) in segs.iter().enumerate() {
        let what = format!("matmul_fast: segment {s}");
        assert_eq!(seg.w.dtype, dtype, "{what}: one call's pair panels share a dtype");
        if tiles {
            dense::amx_pair_panels::check(&seg.w, &what);
        } else {
            bf16_pair_panels::check(&seg.w, &what);
        }
        assert_eq!(seg.w.cols, k, "matmul_fast: segment {s} has {} columns but segment 0 has {k}", seg.w.cols);
        assert_eq!(Some(seg.out.len()), m.checked_mul(seg.w.rows), "matmul_fast: segment {s} output size");
        if let Some(b) = &seg.bias {
            assert_eq!(b.len, seg.w.rows, "matmul_fast: segment {s} bias has {} values for {} rows", b.len, seg.w.rows);
        }
    }
    assert_eq!(Some(x.len()), m.checked_mul(k), "matmul_fast: x has {} values, expected [m={m}, k={k}]", x.len());
    let rows: crate::Few<usize> = segs.iter().map(|s| s.w.rows).collect();
    let sinks: Vec<SendSink<'_>> = segs
        .iter_mut()
        .map(|s| SendSink(exact_panels::Sink::Plain { out: s.out.as_mut_ptr(), ld: s.w.rows, bias: s.bias }))
        .collect();
    let ws: Vec<(usize, usize)> = segs.iter().map(|s| (s.w.data.as_ptr() as usize, s.w.rows)).collect();
    let tasks = packed_tasks(&rows, m, k, &MatMulTiling::default(), bf16_pair_panels::GEMM_PANELS);
    if let PairPath::Tiles { amx } = path {
        // SAFETY: the caller checked AVX512_BF16 (and AMX for `amx`).
        let sx = unsafe {
            dense::amx_pair_panels::split_x(x, m, k, amx && m >= dense::amx_pair_panels::amx_min_rows(dtype), dtype)
        };
        execute_tasks(&tasks, |t| {
            let (w, n) = ws[t.seg];
            // SAFETY: shapes checked above; tasks cover disjoint outputs; `sx` splits this x;
            // the caller checked the CPU.
            unsafe {
                dense::amx_pair_panels::task(
                    w as *const u8,
                    (n, k),
                    (t.p0, t.p1),
                    &sx,
                    (t.i0, t.i1),
                    sinks[t.seg].get(),
                )
            }
        });
        return;
    }
    // SAFETY: the caller checked that the avx512bf16 kernel runs here.
    let pre = unsafe { round_x_once(&tasks, x, m, k) };
    execute_tasks(&tasks, |t| {
        let (w, n) = ws[t.seg];
        // SAFETY: shapes checked above; tasks cover disjoint outputs; `pre` rounds this x;
        // the caller checked that the avx512bf16 kernel runs here.
        unsafe {
            bf16_pair_panels::task(
                w as *const u8,
                (n, k),
                (t.p0, t.p1),
                x.as_ptr(),
                (t.i0, t.i1),
                sinks[t.seg].get(),
                pre.as_ref(),
            )
        }
    });
}

/// x rounded to bf16 once for the call, when some task takes the GEMM path (which reads all
/// its rows rounded).
///
/// # Safety
/// The avx512bf16 kernel runs here (`bf16_pair_panels::applies`).
unsafe fn round_x_once(tasks: &[PackedTask], x: &[f32], m: usize, k: usize) -> Option<bf16_pair_panels::RoundedX> {
    if tasks.iter().any(|t| t.i1 - t.i0 >= bf16_pair_panels::GEMM_MIN_ROWS) {
        bf16_pair_panels::round_x(x, m, k)
    } else {
        None
    }
}

/// Fused SwiGLU over pair panels (`matmul_swiglu_fast`'s caller checked the kernel), on
/// `path` as `run_pair_panels`.
fn swiglu_pair_panels(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32], path: PairPath) {
    assert_eq!(gate.dtype, up.dtype, "matmul_swiglu_fast: gate is {} but up is {}", gate.dtype, up.dtype);
    if path != PairPath::Dot {
        dense::amx_pair_panels::check(&gate, "matmul_swiglu_fast: gate");
        dense::amx_pair_panels::check(&up, "matmul_swiglu_fast: up");
    } else {
        bf16_pair_panels::check(&gate, "matmul_swiglu_fast: gate");
        bf16_pair_panels::check(&up, "matmul_swiglu_fast: up");
    }
    let (n, k) = (gate.rows, gate.cols);
    assert!(up.rows == n && up.cols == k, "matmul_swiglu_fast: gate is {n}x{k} but up is {}x{}", up.rows, up.cols);
    assert_eq!(
        Some(x.len()),
        m.checked_mul(k),
        "matmul_swiglu_fast: x has {} values, expected [m={m}, k={k}]",
        x.len()
    );
    assert_eq!(Some(out.len()), m.checked_mul(n), "matmul_swiglu_fast: out size");
    if m == 0 || n == 0 {
        return;
    }
    let sink = SendSink(exact_panels::Sink::Swiglu { out: out.as_mut_ptr(), ld: n, up: up.data.as_ptr() });
    let tasks = packed_tasks(&[n], m, 2 * k, &MatMulTiling::default(), bf16_pair_panels::GEMM_PANELS / 2);
    if let PairPath::Tiles { amx } = path {
        // SAFETY: as in `run_pair_panels`.
        let sx = unsafe {
            dense::amx_pair_panels::split_x(
                x,
                m,
                k,
                amx && m >= dense::amx_pair_panels::amx_min_rows(gate.dtype),
                gate.dtype,
            )
        };
        // SAFETY: as in `run_pair_panels`.
        execute_tasks(&tasks, |t| unsafe {
            dense::amx_pair_panels::task(gate.data.as_ptr(), (n, k), (t.p0, t.p1), &sx, (t.i0, t.i1), sink.get())
        });
        return;
    }
    // SAFETY: as in `run_pair_panels`.
    let pre = unsafe { round_x_once(&tasks, x, m, k) };
    // SAFETY: as in `run_pair_panels`.
    execute_tasks(&tasks, |t| unsafe {
        bf16_pair_panels::task(
            gate.data.as_ptr(),
            (n, k),
            (t.p0, t.p1),
            x.as_ptr(),
            (t.i0, t.i1),
            sink.get(),
            pre.as_ref(),
        )
    });
}

/// The packed segments of a checked `matmul_with_tiled` call.
fn run_packed(isa: Isa, tiling: &MatMulTiling, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    let k = segs.first().map_or(0, |s| s.w.cols);
    let rows: crate::Few<usize> = segs.iter().map(|s| s.w.rows).collect();
    let sinks: Vec<SendSink<'_>> = segs
        .iter_mut()
        .map(|s| SendSink(exact_panels::Sink::Plain { out: s.out.as_mut_ptr(), ld: s.w.rows, bias: s.bias }))
        .collect();
    let ws: Vec<(DType, usize, usize)> =
        segs.iter().map(|s| (s.w.dtype, s.w.data.as_ptr() as usize, s.w.rows)).collect();
    let tasks = packed_tasks(&rows, m, k, tiling, 1);
    execute_tasks(&tasks, |t| {
        let (dtype, w, n) = ws[t.seg];
        // SAFETY: shapes were checked by `matmul_with`; tasks cover disjoint outputs.
        unsafe {
            exact_panels::task(
                isa,
                dtype,
                w as *const u8,
                (n, k),
                (t.p0, t.p1),
                x.as_ptr(),
                (t.i0, t.i1),
                sinks[t.seg].get(),
            )
        }
    });
}

/// One unit of parallel work: output rows `i0..i1`, columns `j0..j1` of segment `seg`.
#[derive(Clone, Copy, Debug)]
struct Item {
    seg: usize,
    i0: usize,
    i1: usize,
    j0: usize,
    j1: usize,
}

/// Rows of x per full register tile on `isa` (m splits are multiples of it).
fn tile_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 6,
        Isa::Avx2 | Isa::Scalar => 3,
    }
}

/// Multiply-adds below which splitting further costs more than it gains.
const MIN_ITEM_WORK: usize = 1 << 18;

/// Splits the outputs of segments with `rows[s]` rows into work items for the current pool:
/// about 4 per thread (for balance), columns in multiples of 8 (whole wide tiles), and also
/// rows of `m` (in whole tiles) when the columns alone give too few items. Only the
/// partition depends on the pool; no result does.
fn plan_items(rows: &[usize], m: usize, k: usize, isa: Isa) -> crate::Items<Item> {
    plan_items_tiled(rows, m, k, isa, &MatMulTiling::default())
}

/// [`plan_items`] with `tiling`'s choices where it sets them: `tasks_per_thread` items per
/// thread, `panel_rows` columns and `act_rows` rows per item.
fn plan_items_tiled(rows: &[usize], m: usize, k: usize, isa: Isa, tiling: &MatMulTiling) -> crate::Items<Item> {
    let total: usize = rows.iter().sum();
    let threads = rayon::current_num_threads().max(1);
    let work = m.saturating_mul(k.max(1)).saturating_mul(total);
    let per_thread = tiling.tasks_per_thread_for(m < tile_rows(isa));
    let target = if threads == 1 { 1 } else { (threads * per_thread).min((work / MIN_ITEM_WORK).max(1)) };
    let chunk = tiling.panel_rows.unwrap_or_else(|| total.div_ceil(target).div_ceil(8).max(1) * 8).max(1);
    let n_items: usize = rows.iter().map(|r| r.div_ceil(chunk)).sum();
    let mrb = tile_rows(isa);
    let m_step = match tiling.act_rows {
        Some(r) => r.max(1),
        None if n_items < target && m > mrb => {
            let parts = target.div_ceil(n_items.max(1)).min(m.div_ceil(mrb));
            m.div_ceil(parts).div_ceil(mrb) * mrb
        }
        None => m.max(1),
    };
    let mut items = crate::Items::new();
    for (seg, &n) in rows.iter().enumerate() {
        for j0 in (0..n).step_by(chunk) {
            for i0 in (0..m).step_by(m_step) {
                items.push(Item { seg, i0, i1: (i0 + m_step).min(m), j0, j1: (j0 + chunk).min(n) });
            }
        }
    }
    items
}

fn execute(items: &[Item], f: impl Fn(&Item) + Sync + Send) {
    crate::par::for_each_in_order(items, f)
}

/// Runs one item with the kernel for (`isa`, `dtype`).
///
/// # Safety
/// `x` is `[*, k]` covering rows `it.i0..it.i1`, `cols` describes valid weights and an
/// output covering the item, `isa` is supported by this CPU, `dtype` is dense.
unsafe fn dispatch<C: Cols>(isa: Isa, dtype: DType, x: *const f32, k: usize, it: &Item, cols: &C) {
    match dtype {
        DType::F32 => by_isa::<WF32, C>(isa, x, k, it, cols),
        DType::F16 => by_isa::<WF16, C>(isa, x, k, it, cols),
        DType::BF16 => by_isa::<WBF16, C>(isa, x, k, it, cols),
        other => unreachable!("matmul checked that {other} is supported"),
    }
}

#[inline(always)]
unsafe fn by_isa<W: WKind, C: Cols>(isa: Isa, x: *const f32, k: usize, it: &Item, cols: &C) {
    let (ir, jr) = ((it.i0, it.i1), (it.j0, it.j1));
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => run_avx512::<W, C>(x, k, ir, jr, cols),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => run_avx2::<W, C>(x, k, ir, jr, cols),
        _ => run_generic::<Scalar16, W, C>(x, k, ir, jr, cols),
    }
}

/// Rows of x from which the k-blocked path (`register_blocked`) beats the direct one (`columns`):
/// below it, packing costs more than the L1 reuse gains (measured on Zen 5, m = 1..16).
const BLOCKED_MIN_ROWS: usize = 16;

/// Which path runs an item. Both compute identical bits; only speed differs.
fn use_blocked((i0, i1): (usize, usize)) -> bool {
    i1 - i0 >= BLOCKED_MIN_ROWS
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn run_avx512<W: WKind, C: Cols>(x: *const f32, k: usize, ir: (usize, usize), jr: (usize, usize), cols: &C) {
    if use_blocked(ir) {
        register_blocked::run::<crate::simd::Avx512, W, C, 6, 4, 4>(x, k, ir, jr, cols)
    } else {
        dense::columns::run::<crate::simd::Avx512, W, C, 6, 4, 8>(x, k, ir, jr, cols)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<W: WKind, C: Cols>(x: *const f32, k: usize, ir: (usize, usize), jr: (usize, usize), cols: &C) {
    if use_blocked(ir) {
        register_blocked::run::<crate::simd::Avx2x2, W, C, 3, 2, 4>(x, k, ir, jr, cols)
    } else {
        dense::columns::run::<crate::simd::Avx2x2, W, C, 3, 2, 4>(x, k, ir, jr, cols)
    }
}

unsafe fn run_generic<V: F32x16, W: WKind, C: Cols>(
    x: *const f32,
    k: usize,
    ir: (usize, usize),
    jr: (usize, usize),
    cols: &C,
) {
    if use_blocked(ir) {
        register_blocked::run::<V, W, C, 3, 2, 2>(x, k, ir, jr, cols)
    } else {
        dense::columns::run::<V, W, C, 3, 2, 4>(x, k, ir, jr, cols)
    }
}

/// [`matmul`] with the given precision. `Exact` is [`matmul`]; with `Fast`, block-quantized
/// segments quantize the activations to 8 bits and use integer dot products
/// (`quant::matmul_quant_prec`), dense segments take [`matmul_fast`] (bf16 dot products where
/// the CPU has them, exact otherwise).
///
/// # Panics
/// As `matmul`.
pub fn matmul_prec(prec: tboost_ops::Precision, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_prec_tiled(prec, &MatMulTiling::default(), x, m, segs)
}

/// [`matmul_prec`] with its work split by `tiling` (same bits as the default split). The bf16
/// kernels of `Fast` (`fast_bf16_applies`) keep their own split: a non-default tiling there is
/// refused by the orchestrator (the CPU backend's `supports_tiling`) before it gets here.
///
/// # Panics
/// As `matmul`, and on a tiling value outside its range.
pub fn matmul_prec_tiled(
    prec: tboost_ops::Precision,
    tiling: &MatMulTiling,
    x: &[f32],
    m: usize,
    segs: &mut [MatSeg<'_, '_>],
) {
    let (mut q, rest): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) = segs
        .iter_mut()
        .map(|s| MatSeg { w: s.w, bias: s.bias, out: &mut *s.out })
        .partition(|s| s.w.dtype.is_quantized());
    // Dense weights no bf16 kernel takes run the exact kernels, which take the tiling.
    let fast = prec == tboost_ops::Precision::Fast;
    let (mut bf, mut d): (crate::Few<MatSeg<'_, '_>>, crate::Few<MatSeg<'_, '_>>) =
        rest.into_iter().partition(|s| fast && fast_bf16_applies(s.w.dtype));
    if !q.is_empty() {
        quant::matmul_quant_prec_with_tiled(isa::active(), quant::IntDot::active(), prec, x, m, &mut q, tiling);
    }
    if !bf.is_empty() {
        matmul_fast(x, m, &mut bf)
    }
    if !d.is_empty() {
        matmul_with_tiled(isa::active(), tiling, x, m, &mut d)
    }
}

/// [`matmul_swiglu`] with the given precision (as [`matmul_prec`]).
///
/// # Panics
/// As `matmul_swiglu`.
pub fn matmul_swiglu_prec(
    prec: tboost_ops::Precision,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    matmul_swiglu_prec_tiled(prec, &MatMulTiling::default(), x, m, gate, up, out)
}

/// [`matmul_swiglu_prec`] with its work split by `tiling` (the bf16 `Fast` kernels keep their
/// own, as in [`matmul_prec_tiled`]).
///
/// # Panics
/// As `matmul_swiglu`, and on a tiling value outside its range.
pub fn matmul_swiglu_prec_tiled(
    prec: tboost_ops::Precision,
    tiling: &MatMulTiling,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    let isa = isa::active();
    match prec {
        _ if gate.dtype.is_quantized() => {
            let dot = quant::IntDot::active();
            quant::matmul_swiglu_quant_prec_with_tiled(isa, dot, prec, x, m, gate, up, out, tiling)
        }
        tboost_ops::Precision::Fast if fast_bf16_applies(gate.dtype) && up.dtype == gate.dtype => {
            matmul_swiglu_fast(x, m, gate, up, out)
        }
        _ => matmul_swiglu_with_tiled(isa, tiling, x, m, gate, up, out),
    }
}
