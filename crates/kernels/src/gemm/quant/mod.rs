//! GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, Q3_K, Q4_K,
//! Q5_K, Q6_K): scalar dequantize
//! references, and matmul kernels that read the blocks directly.
//!
//! Block layouts are ggml's (`ggml-common.h`); [`dequantize_row`] reproduces ggml's
//! `dequantize_row_*` value for value.
//!
//! [`matmul_quant`] and [`matmul_swiglu_quant`] keep the contract of `gemm::matmul`
//! (read its module doc): `y = x · Wᵀ + bias` with f32 activations, several weight
//! segments sharing `x`, threads splitting over `n` and `m` on the current rayon pool. The
//! weights are never dequantized whole: one block of a few rows is unpacked into registers
//! (few activation rows), or a few rows into an L1/L2 scratch that every activation row
//! reuses (many activation rows).
//!
//! Reduction order (what makes results batch-invariant): every output is
//! `hsum16(acc) + bias`, where lane `l` of `acc` accumulates `x[16c + l] * w[16c + l]` by
//! fused multiply-add for c = 0, 1, 2, ... and `w` is exactly the [`dequantize_row`] value.
//! All paths (scalar, AVX2, AVX-512; direct or tiled) follow it, so `y[i, j]` is
//! bit-identical whatever `m`, the other rows, the thread count, the split or the ISA.
//! Activations stay f32 (no int8 quantization of `x`), which keeps the error to that of
//! an f32 dot product over the dequantized weights.
//!
//! That is [`Precision::Exact`], the default. [`Precision::Fast`] ([`matmul_quant_prec`])
//! quantizes each activation row to 8 bits once per call (per 32-value group, shared by all
//! segments) and uses integer dot products (VNNI where the CPU has it); its arithmetic, its
//! error bound and why it is batch-invariant (and even ISA-invariant) are in `q8_activations`'s
//! module doc.
//!
//! The work split (`plan`) is tunable through the `*_tiled` entry points ([`MatMulTiling`]);
//! by the reduction order above, no tiling changes a bit of the result.

#[cfg(target_arch = "x86_64")]
mod dequant_fma;
#[cfg(target_arch = "x86_64")]
mod int_dot;
#[cfg(target_arch = "x86_64")]
mod panel_amx;
#[cfg(target_arch = "x86_64")]
mod panel_int_dot;
pub mod panel_pack;
pub mod panel_rows;
mod q8_activations;
#[cfg(test)]
mod tiling_tests;

use super::reference::quant as reference;
pub use reference::{dequantize_row, fast_reference, quantize_row_reference, FastReference};
pub use tboost_ops::Precision;

/// Group `g` (values `32g..32g + 32`) of a GGUF row of `dtype` as `(a, m, w)` with
/// `value = a · w − m` and integer `w` (Q4_0, Q5_0, Q8_0: signed, `m` = 0; Q4_1, Q4_K: 0..15;
/// Q5_1, Q5_K: 0..31), for the types whose 32-value groups have one scale and one min; `None`
/// for the others (Q2_K, Q3_K and Q6_K scale each 16 values, IQ4 maps through a table). A
/// device whose quantized matmul takes per-group scales and offsets holds these as they are.
pub fn affine_group(dtype: crate::DType, row: &[u8], g: usize) -> Option<(f32, f32, [i8; 32])> {
    use crate::DType::*;
    if !matches!(dtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4K | Q5K) {
        return None;
    }
    let gr = crate::gemm::gguf::group(dtype, row, g);
    debug_assert!(gr.sc == [1, 1] && gr.ms == [1, 1], "{dtype}: a group with sub-scales");
    Some((gr.a, gr.m, gr.w))
}

use crate::gemm::{check_tiling, MatMulCase, MatMulTiling, MatSeg};
use crate::isa::{self, Isa};
use crate::{Layout, WeightMat, WeightVec};
use tboost_ops::Unsupported;

/// The integer dot-product units a `Fast` call may use, each also capped at what this CPU
/// (and OS) offers: VNNI (`vpdpbusd`) and, for packed panels with many activation rows,
/// AMX-INT8 tiles (which need VNNI at the AVX-512 level). A `bool` converts to "VNNI or
/// not, no AMX". Every choice computes the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntDot {
    pub vnni: bool,
    pub amx: bool,
}

impl IntDot {
    /// What the kernels use by default here (`isa::vnni_active`, `isa::amx_int8`).
    pub fn active() -> IntDot {
        IntDot { vnni: isa::vnni_active(), amx: isa::amx_int8() }
    }

    pub fn name(self) -> &'static str {
        match (self.vnni, self.amx) {
            (true, true) => "vnni+amx",
            (true, false) => "vnni",
            (false, true) => "amx",
            (false, false) => "plain",
        }
    }
}

impl From<bool> for IntDot {
    fn from(vnni: bool) -> IntDot {
        IntDot { vnni, amx: false }
    }
}

/// Whether `matmul_quant` has a kernel for this weight matrix.
pub fn supports(case: &MatMulCase) -> Result<(), Unsupported> {
    if !case.dtype.is_quantized() {
        return Err(Unsupported::new("weight_dtype", case.dtype, "a block-quantized type"));
    }
    if !case.cols.is_multiple_of(case.dtype.block_elems()) {
        return Err(Unsupported::new(
            "cols",
            case.cols,
            format!("a multiple of the {} block ({} values)", case.dtype, case.dtype.block_elems()),
        ));
    }
    if case.act_dtype != crate::DType::F32 {
        return Err(Unsupported::new("act_dtype", case.act_dtype, "f32"));
    }
    Ok(())
}

/// `seg.out = x · seg.wᵀ + seg.bias` for every segment; `x` is `[m, k]`, every `seg.w` is a
/// block-quantized `[rows, k]` matrix. Panics when shapes disagree (a caller bug: shapes are
/// checked when the model is loaded).
pub fn matmul_quant(x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_quant_with(isa::active(), x, m, segs)
}

/// [`matmul_quant`] on at most `isa` (capped at what this CPU has).
pub fn matmul_quant_with(isa: Isa, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_quant_with_tiled(isa, &MatMulTiling::default(), x, m, segs)
}

/// [`matmul_quant_with`] with its work split by `tiling`.
fn matmul_quant_with_tiled(isa: Isa, tiling: &MatMulTiling, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    check_tiling("matmul_quant", tiling);
    let Some(k) = check_segs("matmul_quant", x, m, segs) else { return };
    assert!(segs.iter().all(|s| s.w.layout == Layout::Rows), "matmul_quant: packed weights need Precision::Fast");
    let isa = isa.min(isa::detected());
    let mats: crate::Few<(WeightMat<'_>, Option<WeightVec<'_>>, OutPtr)> =
        segs.iter_mut().map(|s| (s.w, s.bias, OutPtr(s.out.as_mut_ptr()))).collect();
    let ws: crate::Few<WeightMat<'_>> = mats.iter().map(|m| m.0).collect();
    let tasks = plan(&ws, m, tile_min_rows(isa), false, tiling);
    run_tasks(&tasks, |t| {
        let (w, bias, out) = &mats[t.mat];
        // SAFETY: tasks cover disjoint [i0, i1) x [j0, j1) rectangles of each output, which
        // stays mutably borrowed (through `segs`) until every task has finished.
        unsafe {
            let dst = out.get().add(t.i0 * w.rows + t.j0);
            dots(isa, w, t, x, k, dst, w.rows);
            add_bias(bias, t, dst, w.rows);
        }
    });
}

/// [`matmul_quant`] with the given precision: `Exact` is [`matmul_quant`] itself, `Fast`
/// quantizes the activations to 8 bits (see the module doc).
pub fn matmul_quant_prec(prec: Precision, x: &[f32], m: usize, segs: &mut [MatSeg<'_, '_>]) {
    matmul_quant_prec_with(isa::active(), IntDot::active(), prec, x, m, segs)
}

/// [`matmul_quant_prec`] on at most `isa`, with the integer units `dot` allows (all capped at
/// what this CPU has): tests select every kernel level this way.
pub fn matmul_quant_prec_with(
    isa: Isa,
    dot: impl Into<IntDot>,
    prec: Precision,
    x: &[f32],
    m: usize,
    segs: &mut [MatSeg<'_, '_>],
) {
    matmul_quant_prec_with_tiled(isa, dot, prec, x, m, segs, &MatMulTiling::default())
}

/// [`matmul_quant_prec_with`] with its work split by `tiling` (same bits as the default split).
///
/// # Panics
/// As `matmul_quant`, and on a tiling value outside its range.
pub fn matmul_quant_prec_with_tiled(
    isa: Isa,
    dot: impl Into<IntDot>,
    prec: Precision,
    x: &[f32],
    m: usize,
    segs: &mut [MatSeg<'_, '_>],
    tiling: &MatMulTiling,
) {
    if prec == Precision::Exact {
        return matmul_quant_with_tiled(isa, tiling, x, m, segs);
    }
    check_tiling("matmul_quant", tiling);
    let Some(k) = check_segs("matmul_quant", x, m, segs) else { return };
    let level = FastLevel::new(isa, dot.into());
    let mats: crate::Few<(WeightMat<'_>, Option<WeightVec<'_>>, OutPtr)> =
        segs.iter_mut().map(|s| (s.w, s.bias, OutPtr(s.out.as_mut_ptr()))).collect();
    let ws: crate::Few<WeightMat<'_>> = mats.iter().map(|m| m.0).collect();
    let tasks = plan(&ws, m, level.tile_min_rows(), true, tiling);
    q8_activations::with_act(|act| {
        act.fill(x, m, k, level.chain_layout(&ws, &tasks), level.quantizer());
        run_tasks(&tasks, |t| {
            let (w, bias, out) = &mats[t.mat];
            // SAFETY: as in `matmul_quant_with`.
            unsafe {
                let dst = out.get().add(t.i0 * w.rows + t.j0);
                dots_fast(level, w, t, act, dst, w.rows);
                add_bias(bias, t, dst, w.rows);
            }
        });
    })
}

/// Checks the shapes of a (multi-segment) call; `None` when there is nothing to do, else `k`.
fn check_segs(op: &str, x: &[f32], m: usize, segs: &[MatSeg<'_, '_>]) -> Option<usize> {
    let first = segs.first()?;
    let k = first.w.cols;
    assert_eq!(x.len(), m * k, "{op}: x has {} values, expected [m={m}, k={k}]", x.len());
    for (s, seg) in segs.iter().enumerate() {
        check_weight(op, format_args!("segment {s}"), &seg.w, k);
        let n = seg.w.rows;
        assert_eq!(
            seg.out.len(),
            m * n,
            "{op}: segment {s} output has {} values, expected [m={m}, rows={n}]",
            seg.out.len()
        );
        if let Some(b) = &seg.bias {
            assert_eq!(b.len, n, "{op}: segment {s} bias has {} values, expected {n}", b.len);
        }
    }
    Some(k)
}

/// Adds `bias` (if any) to the task's rectangle of raw dot products at `dst` (row stride `ld`).
///
/// # Safety
/// `dst` is writable for the task's rectangle.
unsafe fn add_bias(bias: &Option<WeightVec<'_>>, t: &Task, dst: *mut f32, ld: usize) {
    if let Some(b) = bias {
        for i in 0..t.i1 - t.i0 {
            for j in 0..t.j1 - t.j0 {
                *dst.add(i * ld + j) += b.get(t.j0 + j);
            }
        }
    }
}

/// `out = silu(x · gateᵀ) * (x · upᵀ)`, `out` is `[m, gate.rows]`: the same dot products as two
/// `matmul_quant` calls followed by the elementwise `silu(g) * u`, without writing the
/// gate/up intermediates of the whole batch.
pub fn matmul_swiglu_quant(x: &[f32], m: usize, gate: WeightMat<'_>, up: WeightMat<'_>, out: &mut [f32]) {
    matmul_swiglu_quant_with(isa::active(), x, m, gate, up, out)
}

/// [`matmul_swiglu_quant`] on at most `isa` (capped at what this CPU has).
pub fn matmul_swiglu_quant_with(
    isa: Isa,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    matmul_swiglu_quant_prec_with(isa, false, Precision::Exact, x, m, gate, up, out)
}

/// [`matmul_swiglu_quant`] with the given precision (`Fast`: see [`matmul_quant_prec`]).
pub fn matmul_swiglu_quant_prec(
    prec: Precision,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    matmul_swiglu_quant_prec_with(isa::active(), IntDot::active(), prec, x, m, gate, up, out)
}

/// [`matmul_swiglu_quant_prec`] on at most `isa`, with the integer units `dot` allows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_swiglu_quant_prec_with(
    isa: Isa,
    dot: impl Into<IntDot>,
    prec: Precision,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
) {
    matmul_swiglu_quant_prec_with_tiled(isa, dot, prec, x, m, gate, up, out, &MatMulTiling::default())
}

/// [`matmul_swiglu_quant_prec_with`] with its work split by `tiling` (same bits as the default
/// split).
///
/// # Panics
/// As `matmul_swiglu_quant`, and on a tiling value outside its range.
#[allow(clippy::too_many_arguments)]
pub fn matmul_swiglu_quant_prec_with_tiled(
    isa: Isa,
    dot: impl Into<IntDot>,
    prec: Precision,
    x: &[f32],
    m: usize,
    gate: WeightMat<'_>,
    up: WeightMat<'_>,
    out: &mut [f32],
    tiling: &MatMulTiling,
) {
    check_tiling("matmul_swiglu_quant", tiling);
    let (n, k) = (gate.rows, gate.cols);
    assert!(
        up.rows == n && up.cols == k,
        "matmul_swiglu_quant: gate is {n}x{k} {} but up is {}x{} {}",
        gate.dtype,
        up.rows,
        up.cols,
        up.dtype
    );
    check_weight("matmul_swiglu_quant", format_args!("gate"), &gate, k);
    check_weight("matmul_swiglu_quant", format_args!("up"), &up, k);
    assert_eq!(x.len(), m * k, "matmul_swiglu_quant: x has {} values, expected [m={m}, k={k}]", x.len());
    assert_eq!(out.len(), m * n, "matmul_swiglu_quant: out has {} values, expected [m={m}, n={n}]", out.len());
    let out = OutPtr(out.as_mut_ptr());
    // Gate and up into per-task scratch, then silu(g) * u into the task's rectangle.
    let fused = |t: &Task, dots2: &dyn Fn(&WeightMat<'_>, *mut f32)| {
        let (mi, nj) = (t.i1 - t.i0, t.j1 - t.j0);
        with_scratch(2 * mi * nj, |gu| {
            let (g, u) = gu.split_at_mut(mi * nj);
            dots2(&gate, g.as_mut_ptr());
            dots2(&up, u.as_mut_ptr());
            for i in 0..mi {
                // SAFETY: tasks write disjoint rectangles of `out`, which stays mutably
                // borrowed until every task has finished.
                let o = unsafe { std::slice::from_raw_parts_mut(out.get().add((t.i0 + i) * n + t.j0), nj) };
                crate::activation::swiglu_serial(&g[i * nj..(i + 1) * nj], &u[i * nj..(i + 1) * nj], o);
            }
        })
    };
    if prec == Precision::Exact {
        assert!(
            gate.layout == Layout::Rows && up.layout == Layout::Rows,
            "matmul_swiglu_quant: packed weights need Precision::Fast"
        );
        let isa = isa.min(isa::detected());
        let tasks = plan(&[gate], m, tile_min_rows(isa), false, tiling);
        // SAFETY (both closures): the scratch holds the task's [mi, nj] rectangle.
        run_tasks(&tasks, |t| fused(t, &|w, dst| unsafe { dots(isa, w, t, x, k, dst, t.j1 - t.j0) }));
    } else {
        let level = FastLevel::new(isa, dot.into());
        let tasks = plan(&[gate], m, level.tile_min_rows(), true, tiling);
        q8_activations::with_act(|act| {
            act.fill(x, m, k, level.chain_layout(&[gate], &tasks), level.quantizer());
            run_tasks(&tasks, |t| fused(t, &|w, dst| unsafe { dots_fast(level, w, t, act, dst, t.j1 - t.j0) }));
        })
    }
}

thread_local! {
    /// Per-thread f32 scratch of the fused SwiGLU (gate and up of one task), reused.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` f32 of this thread's scratch (fresh memory if it is already in use).
fn with_scratch<T>(len: usize, f: impl FnOnce(&mut [f32]) -> T) -> T {
    SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// `what` names the weight in a panic (`format_args!`: no string is built unless one fires).
fn check_weight(op: &str, what: std::fmt::Arguments<'_>, w: &WeightMat<'_>, k: usize) {
    let case = MatMulCase::f32(w.dtype, w.rows, w.cols);
    if let Err(e) = supports(&case) {
        panic!("{op}: {what}: {e}");
    }
    assert_eq!(w.cols, k, "{op}: {what} has {} columns, expected k={k}", w.cols);
    let bytes = match w.layout {
        Layout::Rows => w.dtype.bytes_for(w.cols).and_then(|rb| rb.checked_mul(w.rows)),
        Layout::Panels => panel_pack::packable(w.dtype).then(|| panel_pack::packed_bytes(w.dtype, w.rows, w.cols)),
        Layout::PairPanels => None,
    };
    assert_eq!(Some(w.data.len()), bytes, "{op}: {what}: {}x{} {} has {} bytes", w.rows, w.cols, w.dtype, w.data.len());
}

/// Output base pointer shared by tasks that write disjoint parts of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used for disjoint writes while the owning slice is mutably borrowed.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not the field) so closures capture the whole `Send + Sync` wrapper.
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Weight rows `[j0, j1)` of matrix `mat` against activation rows `[i0, i1)`.
#[derive(Clone, Copy, Debug)]
struct Task {
    mat: usize,
    j0: usize,
    j1: usize,
    i0: usize,
    i1: usize,
}

/// Weight bytes a decode task aims at: big enough to hide scheduling cost, small enough
/// that idle threads can steal the rest (the least is `MatMulTiling::decode_task_min_bytes`).
const TASK_MIN_BYTES: usize = tboost_ops::DEFAULT_DECODE_TASK_MIN_BYTES;
const TASK_MAX_BYTES: usize = 1 << 20;
/// Tiled tasks: weight rows per task (whole 6-row Exact tiles and 16-row Fast panels), and
/// the activation bytes a task keeps hot in L2 (each group of weight rows is multiplied with
/// all its activation rows; 1 MiB measured better than 512 KiB for k >= 4864).
const TILE_TASK_N: usize = 48;
const TILE_TASK_X_BYTES: usize = 1 << 20;

/// Activation rows per tiled task: a multiple of 12 (whole micro-tiles of 4 or 2 rows).
fn tile_task_m(k: usize) -> usize {
    (TILE_TASK_X_BYTES / (4 * k.max(1))).clamp(12, 96) / 12 * 12
}

/// Activation rows from which the tiled kernels are used.
fn tile_min_rows(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => dequant_fma::TILE_MIN_ROWS,
        _ => usize::MAX,
    }
}

/// Splits the work over weight rows (and activation rows for large `m`); from `tile_min`
/// activation rows on, tasks are tiled. `tiling` overrides the panel (weight rows per task),
/// the activation rows per task, the tasks per thread and the least decode task bytes where
/// it sets them. The split never changes a result, only who computes it.
fn plan(ws: &[WeightMat<'_>], m: usize, tile_min: usize, fast: bool, tiling: &MatMulTiling) -> crate::Items<Task> {
    let mut tasks = crate::Items::new();
    if m == 0 {
        return tasks;
    }
    let threads = rayon::current_num_threads();
    // Weight rows [j0, j1) of `mat` against all activation rows, `mc` at a time.
    let span = |tasks: &mut crate::Items<Task>, mat: usize, j0: usize, j1: usize, mc: usize| {
        for i0 in (0..m).step_by(mc.max(1)) {
            tasks.push(Task { mat, j0, j1, i0, i1: (i0 + mc.max(1)).min(m) });
        }
    };
    let push = |tasks: &mut crate::Items<Task>, mat: usize, n: usize, rows: usize, mc: usize| {
        for j0 in (0..n).step_by(rows.max(1)) {
            span(tasks, mat, j0, (j0 + rows.max(1)).min(n), mc);
        }
    };
    if m < tile_min {
        let total: usize = ws.iter().map(|w| w.data.len()).sum();
        let per_thread = tiling.tasks_per_thread_for(true);
        let target = if threads > 1 { total / (threads * per_thread) } else { total };
        let min_bytes = tiling.decode_task_min_bytes.unwrap_or(TASK_MIN_BYTES);
        let task_bytes = target.clamp(min_bytes, TASK_MAX_BYTES.max(min_bytes));
        let mut left = total;
        for (mat, w) in ws.iter().enumerate() {
            // Whole packed panels per task (the kernels' unit of work; `panel_rows` is a
            // multiple of 16); 4-row tiles otherwise.
            let unit = if w.layout == Layout::Panels { panel_pack::PANEL } else { 4 };
            let row_bytes = w.row_bytes().max(1);
            if let Some(rows) = tiling.panel_rows {
                push(&mut tasks, mat, w.rows, rows, tiling.act_rows.unwrap_or(m));
                continue;
            }
            let mc = tiling.act_rows.unwrap_or(m);
            // A set `tasks_per_thread` asks for even tasks of that count.
            let guided = tiling.tasks_per_thread.is_none();
            let mut j0 = 0;
            while j0 < w.rows {
                let bytes =
                    if guided { crate::par::guided_size(left, threads, task_bytes, min_bytes) } else { task_bytes };
                let j1 = (j0 + (bytes / row_bytes).max(1).next_multiple_of(unit)).min(w.rows);
                span(&mut tasks, mat, j0, j1, mc);
                left = left.saturating_sub((j1 - j0) * row_bytes);
                j0 = j1;
            }
        }
    } else {
        for (mat, w) in ws.iter().enumerate() {
            let mc = if fast { FAST_TASK_M } else { tile_task_m(w.cols) };
            push(&mut tasks, mat, w.rows, tiling.panel_rows.unwrap_or(TILE_TASK_N), tiling.act_rows.unwrap_or(mc));
        }
    }
    tasks
}

fn run_tasks<F: Fn(&Task) + Sync + Send>(tasks: &[Task], f: F) {
    crate::par::for_each_in_order(tasks, f)
}

/// Raw dot products of task `t`: `dst[(i - i0) * ld + (j - j0)] = x[i] · w[j]`.
///
/// # Safety
/// `dst` must be writable for that rectangle; `isa` must be supported by this CPU.
unsafe fn dots(isa: Isa, w: &WeightMat<'_>, t: &Task, x: &[f32], k: usize, dst: *mut f32, ld: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => {
            let job = dequant_fma::Job {
                w: w.data.as_ptr().add(t.j0 * w.row_bytes()),
                row_bytes: w.row_bytes(),
                n: t.j1 - t.j0,
                x: x.as_ptr().add(t.i0 * k),
                m: t.i1 - t.i0,
                k,
                dst,
                ld,
            };
            dequant_fma::dots(isa == Isa::Avx512, w.dtype, &job)
        }
        _ => dots_scalar(w, t, x, k, dst, ld),
    }
}

/// Scalar path: each weight row dequantized by the reference, then `dot_ordered`.
unsafe fn dots_scalar(w: &WeightMat<'_>, t: &Task, x: &[f32], k: usize, dst: *mut f32, ld: usize) {
    let mut row = vec![0f32; k];
    for j in t.j0..t.j1 {
        for (b, y) in w.row(j).chunks_exact(w.dtype.block_bytes()).zip(row.chunks_exact_mut(w.dtype.block_elems())) {
            reference::dequantize_block(w.dtype, b, y);
        }
        for i in t.i0..t.i1 {
            *dst.add((i - t.i0) * ld + (j - t.j0)) = reference::dot_ordered(&x[i * k..(i + 1) * k], &row);
        }
    }
}

/// Activation rows from which the Fast path packs weight panels for an integer GEMM
/// (measured, one thread, Q5_0 / Q4_K / Q8_0: direct wins at 4 rows, tiled from 6).
const FAST_TILE_MIN_ROWS: usize = 6;
/// Activation rows per tiled Fast task: packing a panel costs about as much as multiplying
/// it with a few dozen rows, so a task takes (nearly) all of them.
const FAST_TASK_M: usize = 1024;

/// The kernels a Fast call runs on: scalar, one of the four x86 instantiations, and AMX for
/// packed panels with many rows.
#[derive(Clone, Copy, Debug)]
struct FastLevel {
    isa: Isa,
    vnni: bool,
    amx: bool,
}

impl FastLevel {
    /// At most `isa` and `dot`, capped at what this CPU has.
    fn new(isa: Isa, dot: IntDot) -> FastLevel {
        let isa = isa.min(isa::detected());
        let vnni = dot.vnni && isa::vnni_detected(isa);
        let amx = dot.amx && vnni && isa == Isa::Avx512 && isa::amx_int8_detected();
        FastLevel { isa, vnni, amx }
    }

    /// Activation rows from which Fast tasks are tiled (packed GEMM).
    fn tile_min_rows(self) -> usize {
        match self.isa {
            Isa::Scalar => usize::MAX,
            _ => FAST_TILE_MIN_ROWS,
        }
    }

    /// Whether the activations need the chain-major copy, and biased: tiled tasks over
    /// row-major weights read it (biased with VNNI), and so do AMX tasks over packed panels
    /// (unbiased; in a call that has both, the packed tasks take the VNNI walk instead).
    fn chain_layout(self, ws: &[WeightMat<'_>], tasks: &[Task]) -> Option<bool> {
        let rows = tasks.iter().any(|t| t.i1 - t.i0 >= self.tile_min_rows() && ws[t.mat].layout == Layout::Rows);
        if rows {
            return Some(self.vnni);
        }
        #[cfg(target_arch = "x86_64")]
        if self.amx && tasks.iter().any(|t| t.i1 - t.i0 >= panel_amx::MIN_ROWS && ws[t.mat].layout == Layout::Panels) {
            return Some(false);
        }
        None
    }

    fn quantizer(self) -> q8_activations::GroupQuantizer {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => int_dot::quantize_group_avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => int_dot::quantize_group_avx2,
            _ => q8_activations::quantize_group_scalar,
        }
    }
}

/// Raw Fast dot products of task `t` into `dst` (row stride `ld`).
///
/// # Safety
/// `dst` must be writable for the task's rectangle; `act` holds the quantized activations of
/// every row of the call.
unsafe fn dots_fast(
    level: FastLevel,
    w: &WeightMat<'_>,
    t: &Task,
    act: &q8_activations::QAct,
    dst: *mut f32,
    ld: usize,
) {
    if w.layout == Layout::Panels {
        return dots_packed(level, w, t, act, dst, ld);
    }
    match level.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => {
            let job = int_dot::FJob {
                w: w.data.as_ptr().add(t.j0 * w.row_bytes()),
                row_bytes: w.row_bytes(),
                n: t.j1 - t.j0,
                act,
                i0: t.i0,
                m: t.i1 - t.i0,
                dst,
                ld,
            };
            let l = int_dot::Level { avx512: level.isa == Isa::Avx512, vnni: level.vnni };
            if job.m >= level.tile_min_rows() {
                int_dot::dots_tiled(l, w.dtype, &job)
            } else {
                int_dot::dots_direct(l, w.dtype, &job)
            }
        }
        _ => q8_activations::dots_scalar(w.dtype, w, (t.j0, t.j1), act, (t.i0, t.i1), dst, ld),
    }
}

/// [`dots_fast`] for packed panels (`t.j0` is a multiple of [`panel_pack::PANEL`]).
///
/// # Safety
/// As [`dots_fast`].
unsafe fn dots_packed(
    level: FastLevel,
    w: &WeightMat<'_>,
    t: &Task,
    act: &q8_activations::QAct,
    dst: *mut f32,
    ld: usize,
) {
    debug_assert!(t.j0.is_multiple_of(panel_pack::PANEL));
    match level.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => {
            let job = panel_int_dot::PJob {
                w: w.data.as_ptr(),
                geo: panel_pack::Geometry::of(w.dtype, w.rows, w.cols),
                p0: t.j0 / panel_pack::PANEL,
                n: t.j1 - t.j0,
                act,
                i0: t.i0,
                m: t.i1 - t.i0,
                dst,
                ld,
                prefetch: isa::weight_prefetch(),
            };
            if level.amx && job.m >= panel_amx::MIN_ROWS && act.chain == Some(false) && t.i0.is_multiple_of(16) {
                // SAFETY: `level.amx` was checked against the CPU and OS (`FastLevel::new`);
                // `act` comes from `QAct::fill`, with the unbiased chain-major copy.
                return panel_amx::dots(w.dtype, &job);
            }
            panel_int_dot::dots(int_dot::Level { avx512: level.isa == Isa::Avx512, vnni: level.vnni }, w.dtype, &job)
        }
        _ => panel_pack::dots_scalar(w, (t.j0, t.j1), act, (t.i0, t.i1), dst, ld),
    }
}
