//! Backend conformance suite, after llama.cpp's `test-backend-ops`: every [`Op`] variant, over
//! a table of shapes, dtypes and edge cases, on every backend compiled into this build,
//! against an f64 scalar reference, within tolerances stated (with their reasons) next to
//! each case.
//!
//! Ops are driven exactly as the runner drives them (`src/runner/graph.rs`, `mod.rs`):
//! buffers from `Backend::alloc`, weights through `upload_weight`, inputs through
//! `write_typed`/`write`, the step's index arrays (token ids, positions, slots, the
//! `[q_start, q_len, ctx_len]` seq table, block tables, logit rows) through `set_step`, then
//! `launch`, `synchronize` and `read_typed`. Before a case runs, the suite asks `supports`
//! the `OpQuery` the plan would ask (`src/plan/table.rs`); a rejection lists the case as
//! skipped with the backend's reason, never as passed.
//!
//! The reference is plain f64 loops in this file over the values *as the device stores
//! them* (weights decoded from their bytes, K/V rounded to the cache dtype); it calls no
//! kernel. The only kernel-crate code it uses is the quantization reference: the test
//! quantizer to make valid GGUF blocks and ggml's dequantization (`dequantize_row`) to read
//! them, checked against the source values. The CPU's SIMD level is fixed per process (`TBOOST_ISA`), so the CPU backend's
//! fast paths are what is compared here; run with `TBOOST_ISA=scalar` (or `avx2`) to check
//! the other paths.
//!
//! The report (per op: cases run, passed, failed, skipped with the reason) is printed on
//! every run, also when the test passes; passing cases one by one with
//! `TBOOST_CONFORMANCE_VERBOSE=1`.
//!
//! Activations: each backend runs in its first activation dtype (f32 on the CPU, f16 on Ascend).
//! Inputs are rounded to it before the reference sees them, outputs are read back from it, and
//! for a 16-bit dtype every bound adds that dtype's roundings of the op's outputs and
//! intermediates (u = 2⁻¹¹ for f16, 2⁻⁸ for bf16 per rounding, plus half the smallest f16
//! subnormal), as each group's tolerance says; the f32 parts assume a device that accumulates in
//! f32 (the CANN SIMULATOR computes in f64, so it sits well inside them). The Ascend backend runs
//! on the CANN SIMULATOR (ascend-sim, not an NPU), found through `TBOOST_ASCEND_SIM`.

// The reference loops index several arrays in lockstep; explicit indices mirror the math.
#![allow(clippy::needless_range_loop)]

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use half::{bf16, f16};
use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::{
    AttnKind, Backend, BackendExt, BufId, DType, ExpertSet, KvLayer, MatSegOp, Op, OpQuery, Segs, SeqRange, StepHost,
    StepViews, View, WeightId,
};
use tboost_engine::model::Tensor;
use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
use tboost_ops::{AttentionCase, AttnParams, AttnPhase, Llama3Scaling, MatMulCase, Precision, RopeParams, RopeStyle};

use common::Rng;
use tboost_testkit::golden as common;

/// Every backend compiled into this build. A new backend adds one line here.
fn backends() -> Vec<(&'static str, Box<dyn Backend>)> {
    vec![
        ("cpu", Box::new(CpuBackend::new(2).expect("the CPU backend starts"))),
        #[cfg(feature = "ascend")]
        ("ascend", Box::new(ascend_on_the_simulator())),
    ]
}

/// The Ascend backend on the CANN SIMULATOR: `TBOOST_ASCEND_SIM` (scripts/test.sh builds it), else
/// scripts/build-ascend-sim.sh. Loaded from that directory only (no other CANN on the search path
/// is used), in this process: no other test of this binary touches CANN.
#[cfg(feature = "ascend")]
fn ascend_on_the_simulator() -> tboost_engine::backend::ascend::AscendBackend {
    use tboost_engine::backend::ascend::sys::{Cann, SearchOrder};
    let dir = match std::env::var_os("TBOOST_ASCEND_SIM") {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            let out = std::process::Command::new("bash")
                .arg(tboost_testkit::golden::repo_root().join("scripts/build-ascend-sim.sh"))
                .output()
                .expect("run scripts/build-ascend-sim.sh (the CANN simulator needs gcc)");
            assert!(
                out.status.success(),
                "building the CANN simulator failed; set TBOOST_ASCEND_SIM to the directory \
                 scripts/build-ascend-sim.sh prints:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    let cann = Cann::load_from(&SearchOrder::dirs_only([dir.join("lib64")])).unwrap_or_else(|e| {
        panic!(
            "the CANN simulator at {} does not load ({e}): rebuild it with scripts/build-ascend-sim.sh",
            dir.display()
        )
    });
    assert!(cann.is_simulator(), "{} is not the CANN simulator", dir.display());
    tboost_engine::backend::ascend::AscendBackend::open_on(&cann, 0).expect("the Ascend backend opens on the simulator")
}

// ---------------------------------------------------------------------------------------------
// Numbers

/// Unit roundoff of f32 (half an ulp of 1).
const U: f64 = 1.0 / (1u64 << 24) as f64;
/// Smallest normal f32: below it results are subnormal and lose relative precision.
const MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;

/// Unit roundoff of one rounding to a 16-bit activation dtype (0 for f32, whose roundings the
/// f32 bounds already count).
fn u_act(act: DType) -> f64 {
    match act {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// Absolute floor of one rounding to the activation dtype: half the smallest f16 subnormal, or
/// (bf16, which has f32's range) the smallest normal f32.
fn tiny_act(act: DType) -> f64 {
    match act {
        DType::F16 => 2f64.powi(-25),
        DType::BF16 => MIN_NORMAL,
        _ => 0.0,
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `v` stored as `dtype`: dense types round to nearest even, block types through the
/// kernels' reference quantizer (valid GGUF blocks).
fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => f32_bytes(v),
        DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        q if q.is_quantized() => quantize_row_reference(q, v).unwrap_or_else(|e| panic!("quantize {q}: {e}")),
        other => panic!("encode: {other} is not a weight type"),
    }
}

/// The values `n` elements of `dtype` in `b` stand for (block types: ggml's dequantization).
fn decode(dtype: DType, b: &[u8], n: usize) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        q if q.is_quantized() => {
            let mut out = vec![0f32; n];
            dequantize_row(q, b, &mut out).unwrap_or_else(|e| panic!("dequantize {q}: {e}"));
            out
        }
        other => panic!("decode: {other} is not a weight type"),
    }
}

/// Rounds `v` to `dtype` and back (what a cache or gain of that dtype holds).
fn round_to(dtype: DType, v: &[f32]) -> Vec<f32> {
    decode(dtype, &encode(dtype, v), v.len())
}

const WEIGHT_TYPES: [DType; 9] =
    [DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K];

/// A weight matrix `[rows, cols]`: its bytes, and the values they stand for.
struct Mat {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    vals: Vec<f32>,
}

impl Mat {
    fn random(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, amp: f32) -> Mat {
        let src = rng.vec(rows * cols, amp);
        let bytes = encode(dtype, &src);
        let vals = decode(dtype, &bytes, rows * cols);
        if dtype.is_quantized() {
            // The reference reads the weights through ggml's dequantization; check that the
            // blocks really carry the source values (within two quantization steps), so the
            // suite compares against real numbers and not, say, all zeros.
            let levels = match dtype {
                DType::Q4_0 => 7.0,
                DType::Q5_0 | DType::Q4K => 15.0,
                DType::Q5K | DType::Q6K => 31.0,
                _ => 127.0,
            };
            for r in 0..rows {
                let row = r * cols..(r + 1) * cols;
                let amax = src[row.clone()].iter().fold(0f32, |a, v| a.max(v.abs()));
                let err = src[row.clone()].iter().zip(&vals[row]).fold(0f32, |a, (s, v)| a.max((s - v).abs()));
                assert!(err <= 2.0 * amax / levels, "{dtype} row {r}: dequantized values off by {err} (amax {amax})");
            }
        }
        Mat { dtype, rows, cols, bytes, vals }
    }

    fn case(&self, act: DType) -> MatMulCase {
        MatMulCase { act_dtype: act, ..MatMulCase::f32(self.dtype, self.rows, self.cols) }
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Bound of |silu'| over the reals (its maximum, at g ≈ 2.4, is 1.0998).
const SILU_LIP: f64 = 1.1;

/// `x · wᵀ + b` in f64 for `x` `[m, k]` and `w` `[n, k]` (as stored), and per output the
/// error bound of an f32 dot product over k terms: `(k + 4)·2⁻²⁴·(Σ|x·w| + |b|)` (any
/// summation order, fused or not, plus the bias add).
fn matmul_ref(x: &[f32], m: usize, w: &Mat, bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.rows, w.cols);
    let (mut out, mut bound) = (vec![0f64; m * n], vec![0f64; m * n]);
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w.vals[j * k..(j + 1) * k];
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..k {
                let p = xr[c] as f64 * wr[c] as f64;
                s += p;
                a += p.abs();
            }
            let b = bias.map_or(0.0, |b| b[j] as f64);
            out[i * n + j] = s + b;
            bound[i * n + j] = (k + 4) as f64 * U * (a + b.abs());
        }
    }
    (out, bound)
}

/// `silu(g) * u` from the reference gate/up results and their bounds: |silu'| ≤ 1.1 carries
/// the gate's error, the up error scales with |silu(g)|, and the f32 silu and product add
/// 8·2⁻²⁴ relative.
fn swiglu_ref(g: &[f64], eg: &[f64], u: &[f64], eu: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut out = Vec::with_capacity(g.len());
    let mut bound = Vec::with_capacity(g.len());
    for i in 0..g.len() {
        let s = silu(g[i]);
        out.push(s * u[i]);
        let (sa, ua) = (s.abs() + SILU_LIP * eg[i], u[i].abs() + eu[i]);
        bound.push(SILU_LIP * eg[i] * ua + s.abs() * eu[i] + 8.0 * U * sa * ua + MIN_NORMAL);
    }
    (out, bound)
}

/// One token through a SwiGLU MLP (`down · (silu(gate · x) * (up · x))`) in f64, with the
/// bound that carries every stage's f32 error forward, plus (`ua` > 0) the activation dtype's
/// roundings of the gate/up, SwiGLU and down outputs.
fn mlp_ref(x: &[f32], gate: &Mat, up: &Mat, down: &Mat, ua: f64) -> (Vec<f64>, Vec<f64>) {
    let (g, mut eg) = matmul_ref(x, 1, gate, None);
    let (u, mut eu) = matmul_ref(x, 1, up, None);
    for i in 0..g.len() {
        eg[i] += ua * g[i].abs();
        eu[i] += ua * u[i].abs();
    }
    let (h, mut eh) = swiglu_ref(&g, &eg, &u, &eu);
    for i in 0..h.len() {
        eh[i] += ua * h[i].abs();
    }
    let (hid, inter) = (down.rows, down.cols);
    let (mut y, mut ey) = (vec![0f64; hid], vec![0f64; hid]);
    for j in 0..hid {
        let dr = &down.vals[j * inter..(j + 1) * inter];
        let (mut s, mut a, mut carried) = (0f64, 0f64, 0f64);
        for i in 0..inter {
            let d = dr[i] as f64;
            s += d * h[i];
            a += (d * h[i]).abs() + d.abs() * eh[i];
            carried += d.abs() * eh[i];
        }
        y[j] = s;
        ey[j] = carried + (inter + 4) as f64 * U * a + ua * s.abs();
    }
    (y, ey)
}

// ---------------------------------------------------------------------------------------------
// Comparison

type R<T> = Result<T, String>;

fn be_err(e: tboost_engine::Error) -> String {
    format!("backend error: {e}")
}

/// What the checks of one case measured (for the report).
#[derive(Default)]
struct Measured {
    max_abs: f64,
    max_want: f64,
    /// The largest `|err| / tol` of the toleranced checks (how much room the bound left).
    worst: f64,
    values: usize,
    exact: bool,
}

impl Measured {
    /// `|got - want| ≤ bound(i)` for every element; infinities and NaN must match exactly.
    fn close(&mut self, what: &str, got: &[f32], want: &[f64], bound: impl Fn(usize) -> f64) -> R<()> {
        if got.len() != want.len() {
            return Err(format!("{what}: {} values, the reference has {}", got.len(), want.len()));
        }
        let mut bad = 0usize;
        let mut first = None;
        for i in 0..got.len() {
            let (g, w, b) = (got[i] as f64, want[i], bound(i));
            let err = (g - w).abs();
            let ok = if w.is_nan() {
                g.is_nan()
            } else if w.is_infinite() {
                g == w
            } else {
                err <= b
            };
            if !ok {
                bad += 1;
                first.get_or_insert((i, g, w, err, b));
            } else if w.is_finite() {
                self.max_abs = self.max_abs.max(err);
                self.max_want = self.max_want.max(w.abs());
                if b > 0.0 {
                    self.worst = self.worst.max(err / b);
                }
            }
        }
        self.values += got.len();
        match first {
            None => Ok(()),
            Some((i, g, w, err, b)) => Err(format!(
                "{what}[{i}]: got {g:e}, want {w:e}, |err| {err:.3e} > tol {b:.3e} ({bad} of {} values out of tolerance)",
                got.len()
            )),
        }
    }

    /// Bit-exact f32 (NaN matches any NaN).
    fn exact(&mut self, what: &str, got: &[f32], want: &[f32]) -> R<()> {
        self.exact = true;
        if got.len() != want.len() {
            return Err(format!("{what}: {} values, the reference has {}", got.len(), want.len()));
        }
        let bad: Vec<usize> = (0..got.len())
            .filter(|&i| !(got[i].to_bits() == want[i].to_bits() || got[i].is_nan() && want[i].is_nan()))
            .collect();
        self.values += got.len();
        match bad.first() {
            None => Ok(()),
            Some(&i) => Err(format!(
                "{what}[{i}]: got {:e} ({:#010x}), want {:e} ({:#010x}) ({} of {} values differ)",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits(),
                bad.len(),
                got.len()
            )),
        }
    }

    fn exact_u32(&mut self, what: &str, got: &[u32], want: &[u32]) -> R<()> {
        self.exact = true;
        self.values += got.len();
        match (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{what}[{i}]: got {:?}, want {:?} (all: got {got:?}, want {want:?})",
                got.get(i),
                want.get(i)
            )),
        }
    }

    fn exact_bytes(&mut self, what: &str, got: &[u8], want: &[u8], elem: usize) -> R<()> {
        self.exact = true;
        self.values += got.len() / elem.max(1);
        if got.len() != want.len() {
            return Err(format!("{what}: {} bytes, the reference has {}", got.len(), want.len()));
        }
        match (0..got.len()).find(|&i| got[i] != want[i]) {
            None => Ok(()),
            Some(i) => {
                let e = i / elem;
                Err(format!(
                    "{what} element {e}: got bytes {:02x?}, want {:02x?}",
                    &got[e * elem..(e + 1) * elem],
                    &want[e * elem..(e + 1) * elem]
                ))
            }
        }
    }

    fn summary(&self) -> String {
        if self.exact && self.max_want == 0.0 {
            format!("{} values, exact", self.values)
        } else {
            let rel = if self.max_want > 0.0 { self.max_abs / self.max_want } else { 0.0 };
            format!(
                "{} values, max|err| {:.2e}, max|err|/max|want| {:.2e}, worst |err|/tol {:.3}",
                self.values, self.max_abs, rel, self.worst
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Driving a backend

/// Every `Op` variant: the exhaustive match makes a new variant a compile error here until
/// the suite covers it.
const OP_NAMES: [&str; 18] = [
    "embed",
    "rmsnorm",
    "add_rmsnorm",
    "add",
    "matmul",
    "matmul_swiglu",
    "swiglu",
    "rope_tables",
    "rope",
    "write_kv",
    "attention",
    "moe_route",
    "moe_grouped",
    "moe_scatter",
    "moe_combine",
    "gather_rows",
    "convert",
    "zero",
];

fn variant(op: &Op) -> usize {
    match op {
        Op::Embed { .. } => 0,
        Op::RmsNorm { .. } => 1,
        Op::AddRmsNorm { .. } => 2,
        Op::Add { .. } => 3,
        Op::MatMul { .. } => 4,
        Op::MatMulSwiGlu { .. } => 5,
        Op::SwiGlu { .. } => 6,
        Op::RopeTables { .. } => 7,
        Op::Rope { .. } => 8,
        Op::WriteKv { .. } => 9,
        Op::Attention { .. } => 10,
        Op::MoeRoute { .. } => 11,
        Op::MoeGrouped { .. } => 12,
        Op::MoeScatter { .. } => 13,
        Op::MoeCombine { .. } => 14,
        Op::GatherRows { .. } => 15,
        Op::Convert { .. } => 16,
        Op::Zero { .. } => 17,
    }
}

/// One case's hold on a backend: the buffers it allocated (freed when the case ends) and the
/// op variants it launched.
struct Dev<'a> {
    be: &'a mut dyn Backend,
    live: Vec<BufId>,
    launched: &'a mut [bool; 18],
}

fn empty_host<'a>() -> StepHost<'a> {
    StepHost { ids: &[], positions: &[], slots: &[], seqs: &[], block_tables: &[], logit_rows: &[] }
}

impl Dev<'_> {
    fn alloc(&mut self, dtype: DType, len: usize) -> R<View> {
        let b = self.be.alloc(dtype, len.max(1)).map_err(be_err)?;
        self.live.push(b);
        Ok(View::new(b, 0, len))
    }

    /// A buffer of activations: `data` stored in `act` (round it with `round_to` first for an exact
    /// reference).
    fn acts(&mut self, act: DType, data: &[f32]) -> R<View> {
        let v = self.alloc(act, data.len())?;
        if !data.is_empty() {
            self.be.write(v, &encode(act, data)).map_err(be_err)?;
        }
        Ok(v)
    }

    /// A float buffer's values (f32, f16 or bf16) as f32.
    fn read_act(&mut self, v: View) -> R<Vec<f32>> {
        let (dtype, _) = self.be.buffer(v.buf).ok_or("read of an unknown buffer")?;
        let b = self.read_bytes(v)?;
        Ok(decode(dtype, &b, v.len))
    }

    fn u32s(&mut self, data: &[u32]) -> R<View> {
        let v = self.alloc(DType::U32, data.len())?;
        if !data.is_empty() {
            self.be.write_typed(v, data).map_err(be_err)?;
        }
        Ok(v)
    }

    /// A buffer of `len` elements of `dtype` holding `bytes`.
    fn raw(&mut self, dtype: DType, len: usize, bytes: &[u8]) -> R<View> {
        let v = self.alloc(dtype, len)?;
        self.be.write(v, bytes).map_err(be_err)?;
        Ok(v)
    }

    fn upload(&mut self, name: &str, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> R<WeightId> {
        let t = Tensor::owned(name, dtype, shape, bytes).map_err(|e| format!("tensor {name}: {e}"))?;
        self.be.upload_weight(&t).map_err(be_err)
    }

    fn mat(&mut self, name: &str, m: &Mat) -> R<WeightId> {
        self.upload(name, m.dtype, vec![m.rows, m.cols], m.bytes.clone())
    }

    fn vector(&mut self, name: &str, dtype: DType, v: &[f32]) -> R<WeightId> {
        self.upload(name, dtype, vec![v.len()], encode(dtype, v))
    }

    /// The step's index arrays in fresh buffers, made resident with `set_step`.
    fn step(&mut self, host: &StepHost<'_>, max_blocks: usize) -> R<StepViews> {
        let views = StepViews {
            ids: self.alloc(DType::U32, host.ids.len())?,
            positions: self.alloc(DType::U32, host.positions.len())?,
            slots: self.alloc(DType::U32, host.slots.len())?,
            seqs: self.alloc(DType::U32, host.seqs.len() * 3)?,
            block_tables: self.alloc(DType::U32, host.block_tables.len())?,
            max_blocks,
            logit_rows: self.alloc(DType::U32, host.logit_rows.len())?,
        };
        self.be.set_step(host, &views).map_err(be_err)?;
        Ok(views)
    }

    fn launch(&mut self, op: Op) -> R<()> {
        self.launched[variant(&op)] = true;
        self.be.launch(&op).map_err(be_err)
    }

    fn sync(&mut self) -> R<()> {
        self.be.synchronize().map_err(be_err)
    }

    fn read_u32(&mut self, v: View) -> R<Vec<u32>> {
        let mut out = vec![0u32; v.len];
        self.be.read_typed(v, &mut out).map_err(be_err)?;
        Ok(out)
    }

    fn read_bytes(&mut self, v: View) -> R<Vec<u8>> {
        let (dtype, _) = self.be.buffer(v.buf).ok_or("read of an unknown buffer")?;
        let n = dtype.bytes_for(v.len).ok_or("view splits a block")?;
        let mut out = vec![0u8; n];
        self.be.read(v, &mut out).map_err(be_err)?;
        Ok(out)
    }
}

#[derive(Default)]
struct Group {
    name: String,
    tolerance: &'static str,
    lines: Vec<String>,
    run: usize,
    failed: usize,
    skipped: usize,
}

/// The suite on one backend: the report so far.
struct Suite<'b> {
    backend: &'static str,
    be: &'b mut dyn Backend,
    /// The activation dtype the backend computes in (its first choice).
    act: DType,
    /// Tokens per KV block of the attention cases: the CPU's table (8..32), or the backend's
    /// preferred size when it wants larger blocks (Ascend's FIA: 128).
    min_block: usize,
    groups: Vec<Group>,
    launched: [bool; 18],
    /// Op variants some case of the table launches, and those of cases that ran.
    wanted: [bool; 18],
    ran: [bool; 18],
    failures: Vec<String>,
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

impl<'b> Suite<'b> {
    fn new(backend: &'static str, be: &'b mut dyn Backend, act: DType) -> Suite<'b> {
        let min_block = be.preferred_block_size();
        Suite {
            backend,
            be,
            act,
            min_block,
            groups: Vec::new(),
            launched: [false; 18],
            wanted: [false; 18],
            ran: [false; 18],
            failures: Vec::new(),
        }
    }

    fn group(&mut self, name: &str, tolerance: &'static str) -> &mut Group {
        let i = match self.groups.iter().position(|g| g.name == name) {
            Some(i) => i,
            None => {
                self.groups.push(Group { name: name.into(), tolerance, ..Default::default() });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[i];
        if g.tolerance.is_empty() {
            g.tolerance = tolerance;
        }
        g
    }

    /// A failure that is not a case's result (a broken plan-level rule).
    fn fail(&mut self, group: &str, case: &str, why: String) {
        let g = self.group(group, "");
        g.failed += 1;
        g.lines.push(format!("  FAIL {case}: {why}"));
        self.failures.push(format!("[{}] {group} / {case}: {why}", self.backend));
    }

    /// One case: every query the plan would ask must be supported, or the case is listed as
    /// skipped with the backend's reason; otherwise `body` runs it on the backend and checks
    /// the result. `ops` are the op variants the case launches (for the coverage check).
    fn case(
        &mut self,
        group: &str,
        tolerance: &'static str,
        case: String,
        queries: &[OpQuery],
        ops: &[usize],
        body: impl FnOnce(&mut Dev<'_>) -> R<Measured>,
    ) {
        for &o in ops {
            self.wanted[o] = true;
        }
        for q in queries {
            if let Err(why) = self.be.supports(q) {
                let g = self.group(group, tolerance);
                g.skipped += 1;
                g.lines.push(format!("  skip {case}: {why}  (query {})", query_name(q)));
                return;
            }
        }
        for &o in ops {
            self.ran[o] = true;
        }
        let mut dev = Dev { be: &mut *self.be, live: Vec::new(), launched: &mut self.launched };
        let r = match catch_unwind(AssertUnwindSafe(|| body(&mut dev))) {
            Ok(r) => r,
            Err(p) => Err(format!("panicked: {}", panic_text(p.as_ref()))),
        };
        // A failed case may leave work queued: drain it before freeing its buffers.
        let _ = dev.be.synchronize();
        for b in std::mem::take(&mut dev.live) {
            dev.be.free(b);
        }
        let backend = self.backend;
        let g = self.group(group, tolerance);
        g.run += 1;
        match r {
            Ok(m) => g.lines.push(format!("  ok   {case}: {}", m.summary())),
            Err(why) => {
                g.failed += 1;
                g.lines.push(format!("  FAIL {case}: {why}"));
                self.failures.push(format!("[{backend}] {group} / {case}: {why}"));
            }
        }
    }

    fn report(&self, secs: f64) -> String {
        let mut s = format!(
            "\n=== backend conformance: {} ({}), activations {} ===\n",
            self.backend,
            self.be.device().device,
            self.act
        );
        let (mut run, mut failed, mut skipped) = (0, 0, 0);
        for g in &self.groups {
            s += &format!(
                "{} [{}]: {} run, {} passed, {} failed, {} skipped\n",
                g.name,
                self.backend,
                g.run,
                g.run - g.failed,
                g.failed,
                g.skipped
            );
            if !g.tolerance.is_empty() {
                s += &format!("  tolerance: {}\n", g.tolerance);
            }
            // Passing cases in full only on request; skips, failures and notes always.
            let verbose = std::env::var_os("TBOOST_CONFORMANCE_VERBOSE").is_some();
            for l in g.lines.iter().filter(|l| verbose || !l.starts_with("  ok ")) {
                s += l;
                s.push('\n');
            }
            run += g.run;
            failed += g.failed;
            skipped += g.skipped;
        }
        s += &format!(
            "=== {}: {run} cases run, {} passed, {failed} failed, {skipped} skipped, in {secs:.1} s ===\n",
            self.backend,
            run - failed.min(run)
        );
        s
    }
}

fn query_name(q: &OpQuery) -> String {
    serde_json::to_value(q)
        .ok()
        .and_then(|v| v.get("op").and_then(|o| o.as_str().map(String::from)))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// The case table

const EXACT_COPY: &str = "exact: the op copies or converts values (a correctly rounded conversion has one answer)";

fn embed(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let vocab = 50;
    for dtype in WEIGHT_TYPES {
        // K-quant rows are whole 256-value super-blocks.
        let cols = if dtype.block_elems() == 256 { 256 } else { 96 };
        let table = Mat::random(rng, dtype, vocab, cols, 1.0);
        let ids: Vec<u32> = vec![0, vocab as u32 - 1, 7, 7, 23, 0, 48];
        let q = [OpQuery::Embed { table: dtype, act }];
        s.case("embed", EXACT_COPY, format!("{dtype} table {vocab}x{cols}, ids {ids:?}"), &q, &[0], |d| {
            let w = d.mat("embed", &table)?;
            let sv = d.step(&StepHost { ids: &ids, ..empty_host() }, 0)?;
            let out = d.alloc(act, ids.len() * cols)?;
            d.launch(Op::Embed { ids: sv.ids, table: w, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let want: Vec<f32> = ids.iter().flat_map(|&i| table.vals[i as usize * cols..][..cols].to_vec()).collect();
            let mut m = Measured::default();
            m.exact("out", &got, &want)?;
            Ok(m)
        });
    }
}

/// Rows of `n` values for a norm: random, small (where eps matters), and all zero.
fn norm_rows(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = rng.vec(n, 2.0);
    x.extend(rng.vec(n, 1e-3));
    x.extend(vec![0.0; n]);
    x
}

/// f64 RMSNorm of each row of `w.len()` values with the bound (n/2 + 4)·2⁻²⁴·|want|: the f32
/// sum of n squares is within n·2⁻²⁴ relative, the inverse square root halves that, and
/// rounding it and the two products add 3·2⁻²⁴.
fn rmsnorm_ref(x: &[f32], w: &[f32], eps: f32) -> (Vec<f64>, Vec<f64>) {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * inv * g as f64));
    }
    let bound = out.iter().map(|y| (n as f64 / 2.0 + 4.0) * U * y.abs()).collect();
    (out, bound)
}

const TOL_NORM: &str = "(n/2 + 4)·2⁻²⁴·|want|: f32 sum of n squares (n·2⁻²⁴ rel), halved by the rsqrt, \
                        plus 3 roundings; the residual of add_rmsnorm is one f32 add, exact. 16-bit \
                        activations: + u·|want| for the output (add_rmsnorm: 2u·|want|, the norm may read the \
                        rounded sum), the residual exact against the rounded sum";

fn norms(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for gain in [DType::F32, DType::F16, DType::BF16] {
        // 100: a row that is not a whole number of SIMD vectors.
        for n in [64, 100, 896] {
            for eps in [1e-5f32, 1e-6] {
                let x = round_to(act, &norm_rows(rng, n));
                let w = round_to(gain, &(0..n).map(|_| 1.0 + 0.5 * rng.unit()).collect::<Vec<_>>());
                let name = format!("gain {gain}, hidden {n}, eps {eps:e}, rows: random, small, zero");
                let q = [OpQuery::RmsNorm { gain, act, fused_add: false }];
                s.case("rmsnorm", TOL_NORM, name.clone(), &q, &[1], |d| {
                    let wid = d.vector("norm", gain, &w)?;
                    let (xv, out) = (d.acts(act, &x)?, d.alloc(act, x.len())?);
                    d.launch(Op::RmsNorm { x: xv, w: wid, eps, out })?;
                    d.sync()?;
                    let got = d.read_act(out)?;
                    let (want, bound) = rmsnorm_ref(&x, &w, eps);
                    let mut m = Measured::default();
                    m.close("out", &got, &want, |i| bound[i] + ua * want[i].abs() + tiny)?;
                    Ok(m)
                });
                let res = round_to(act, &norm_rows(rng, n));
                let q = [OpQuery::RmsNorm { gain, act, fused_add: true }];
                s.case("add_rmsnorm", TOL_NORM, name, &q, &[2], |d| {
                    let wid = d.vector("norm", gain, &w)?;
                    let (r, xv, out) = (d.acts(act, &res)?, d.acts(act, &x)?, d.alloc(act, x.len())?);
                    d.launch(Op::AddRmsNorm { residual: r, x: xv, w: wid, eps, out })?;
                    d.sync()?;
                    let (got_r, got) = (d.read_act(r)?, d.read_act(out)?);
                    let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| a + b).collect();
                    let (want, bound) = rmsnorm_ref(&sum, &w, eps);
                    let mut m = Measured::default();
                    m.exact("residual", &got_r, &round_to(act, &sum))?;
                    m.close("out", &got, &want, |i| bound[i] + 2.0 * ua * want[i].abs() + tiny)?;
                    Ok(m)
                });
            }
        }
    }
}

/// Values whose sums are edge cases: signed zeros, subnormals, infinities, a rounding tie.
fn edge_values() -> Vec<f32> {
    vec![0.0, -0.0, 1e-40, -1e-40, f32::MAX, f32::MIN_POSITIVE, 1.0, 1.0 + f32::EPSILON, f32::INFINITY, 3.0]
}

fn add(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "exact: one f32 addition per element is correctly rounded (16-bit activations: the f32 \
                       sum of the rounded inputs, rounded once more)";
    let act = s.act;
    for n in [1usize, 37, 4096, 70_000] {
        let mut a = rng.vec(n, 10.0);
        let mut b = rng.vec(n, 10.0);
        if n >= 10 {
            a[..10].copy_from_slice(&edge_values());
            b[..10].copy_from_slice(&[
                -0.0,
                -0.0,
                1e-40,
                1e-40,
                f32::MAX,
                -f32::MIN_POSITIVE,
                1.0,
                f32::EPSILON / 2.0,
                1.0,
                0.1,
            ]);
        }
        let (a, b) = (round_to(act, &a), round_to(act, &b));
        // dst and src at offsets inside larger buffers, as the runner's views are.
        let q = [OpQuery::Add { act }];
        s.case("add", TOL, format!("{n} values at offsets 3 / 5, edge values"), &q, &[3], |d| {
            let mut da = vec![7.0f32; 3];
            da.extend(&a);
            da.extend([7.0; 4]);
            let mut sb = vec![9.0f32; 5];
            sb.extend(&b);
            let (dv, sv) = (d.acts(act, &da)?, d.acts(act, &sb)?);
            let (dst, src) = (dv.sub(3, n), sv.sub(5, n));
            d.launch(Op::Add { dst, src })?;
            d.sync()?;
            let got = d.read_act(dv)?;
            let mut want = da.clone();
            for i in 0..n {
                want[3 + i] = round_to(act, &[a[i] + b[i]])[0];
            }
            let mut m = Measured::default();
            m.exact("dst (with the untouched margins)", &got, &want)?;
            Ok(m)
        });
    }
}

const TOL_MATMUL: &str = "(k + 4)·2⁻²⁴·(Σ|x·w| + |b|) per output: an f32 dot product over k terms in any order, \
                          plus the bias add; weights as stored (ggml dequantization). 16-bit activations \
                          (x rounded first): + 2u·(|want| + |b|) for the rounded product, the bias rounded to \
                          the activation dtype and the rounded sum";

/// One projection of a (possibly fused) matmul case.
struct Seg {
    w: Mat,
    bias: Option<(DType, Vec<f32>)>,
}

fn seg(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, bias: Option<DType>) -> Seg {
    let w = Mat::random(rng, dtype, rows, cols, 1.0);
    let bias = bias.map(|bd| (bd, round_to(bd, &rng.vec(rows, 0.5))));
    Seg { w, bias }
}

/// Runs `segs` as one `Op::MatMul` on `x` (`[m, k]`, in `act`) and checks every output.
fn run_matmul(d: &mut Dev<'_>, act: DType, x: &[f32], m: usize, segs: &[Seg], precision: Precision) -> R<Measured> {
    let x = &round_to(act, x)[..];
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let mut ops = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        let w = d.mat(&format!("w{i}"), &s.w)?;
        let bias = match &s.bias {
            Some((bd, b)) => Some(d.vector(&format!("b{i}"), *bd, b)?),
            None => None,
        };
        ops.push(MatSegOp { w, bias, out: d.alloc(act, m * s.w.rows)? });
    }
    let xv = d.acts(act, x)?;
    d.launch(Op::MatMul { x: xv, m, segs: Segs::from_slice(&ops), precision, tiling: Default::default() })?;
    d.sync()?;
    let mut meas = Measured::default();
    for (i, (s, o)) in segs.iter().zip(&ops).enumerate() {
        let got = d.read_act(o.out)?;
        let (want, mut bound) = matmul_ref(x, m, &s.w, s.bias.as_ref().map(|b| b.1.as_slice()));
        let n = s.w.rows;
        for (j, b) in bound.iter_mut().enumerate() {
            let bias = s.bias.as_ref().map_or(0.0, |bs| bs.1[j % n].abs() as f64);
            *b += 2.0 * ua * (want[j].abs() + bias) + tiny;
        }
        if precision == Precision::Fast {
            // Fast may quantize x to 8 bits per 32-value block: each x moves by up to
            // amax(block)/127, which the weights carry into the output.
            let (n, k) = (s.w.rows, s.w.cols);
            for r in 0..m {
                for j in 0..n {
                    let e: f64 = (0..k)
                        .map(|c| {
                            let blk = &x[r * k + c / 32 * 32..r * k + (c / 32 * 32 + 32).min(k)];
                            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                            (s.w.vals[j * k + c] as f64).abs() * amax / 127.0
                        })
                        .sum();
                    bound[r * n + j] += e;
                }
            }
        }
        meas.close(&format!("segment {i} out"), &got, &want, |i| bound[i])?;
    }
    Ok(meas)
}

fn matmul(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    for dtype in WEIGHT_TYPES {
        let ks: [usize; 2] = match dtype.block_elems() {
            // 72: a tail that is not a whole 16-lane chunk.
            1 => [72, 256],
            // 96: three blocks, not a whole number of 64-value steps.
            32 => [96, 256],
            _ => [256, 512],
        };
        for k in ks {
            for m in [1usize, 3, 17, 64] {
                for bias in [false, true] {
                    let sg = seg(rng, dtype, 37, k, bias.then_some(DType::F32));
                    let x = rng.vec(m * k, 1.0);
                    let name = format!("{dtype} m={m} k={k} n=37{}", if bias { " +bias" } else { "" });
                    let q = [OpQuery::MatMul(sg.w.case(act))];
                    s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| {
                        run_matmul(d, act, &x, m, &[sg], Precision::Exact)
                    });
                }
            }
        }
    }
    // Narrow outputs: a single row (n = 1) and fewer rows than any register tile.
    for dtype in [DType::F32, DType::BF16, DType::Q8_0, DType::Q4K] {
        for n in [1usize, 5] {
            for m in [1usize, 17] {
                let sg = seg(rng, dtype, n, 256, Some(DType::F32));
                let x = rng.vec(m * 256, 1.0);
                let q = [OpQuery::MatMul(sg.w.case(act))];
                let name = format!("{dtype} m={m} k=256 n={n} +bias");
                s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| run_matmul(d, act, &x, m, &[sg], Precision::Exact));
            }
        }
    }
    // Wide weights: work split over many rows (several tasks per thread).
    for dtype in [DType::F16, DType::BF16, DType::Q8_0, DType::Q4K, DType::Q6K] {
        for m in [1usize, 64] {
            let sg = seg(rng, dtype, 1000, 512, None);
            let x = rng.vec(m * 512, 1.0);
            let q = [OpQuery::MatMul(sg.w.case(act))];
            let name = format!("{dtype} m={m} k=512 n=1000");
            s.case("matmul", TOL_MATMUL, name, &q, &[4], |d| run_matmul(d, act, &x, m, &[sg], Precision::Exact));
        }
    }
    // Fast precision (8-bit activations), as `--precision fast` asks.
    {
        let sg = seg(rng, DType::Q8_0, 37, 256, None);
        let x = rng.vec(3 * 256, 1.0);
        let mut case = sg.w.case(act);
        case.precision = Precision::Fast;
        let q = [OpQuery::MatMul(case)];
        let tol = "as exact, plus Σ|w|·amax(x block)/127 for 8-bit activations";
        s.case("matmul (fast precision)", tol, "q8_0 m=3 k=256 n=37".into(), &q, &[4], |d| {
            run_matmul(d, act, &x, 3, &[sg], Precision::Fast)
        });
    }
    // Fused QKV: three segments sharing x, GQA widths (8 query heads, 2 kv heads of 8).
    let fused: [(&str, [DType; 3], bool); 7] = [
        ("f32", [DType::F32; 3], true),
        ("bf16", [DType::BF16; 3], true),
        ("f16", [DType::F16; 3], false),
        ("q8_0", [DType::Q8_0; 3], true),
        ("q4_k", [DType::Q4K; 3], false),
        // Q4_K_M files keep some V projections in Q6_K.
        ("q4_k/q4_k/q6_k", [DType::Q4K, DType::Q4K, DType::Q6K], true),
        // A projection mixing dense and block-quantized matrices.
        ("f16/q8_0/q4_0", [DType::F16, DType::Q8_0, DType::Q4_0], false),
    ];
    for (label, dts, bias) in fused {
        for m in [1usize, 3, 17, 64] {
            let k = 256;
            let segs: Vec<Seg> = dts
                .iter()
                .zip([64, 16, 16])
                .map(|(&dt, rows)| seg(rng, dt, rows, k, bias.then_some(DType::BF16)))
                .collect();
            let x = rng.vec(m * k, 1.0);
            let cases = [Some(segs[0].w.case(act)), Some(segs[1].w.case(act)), Some(segs[2].w.case(act))];
            let q = [OpQuery::MatMulFused { cases }];
            let name = format!("qkv {label} m={m} k={k} n=64+16+16{}", if bias { " +bf16 bias" } else { "" });
            s.case("matmul (fused qkv)", TOL_MATMUL, name, &q, &[4], |d| {
                run_matmul(d, act, &x, m, &segs, Precision::Exact)
            });
        }
    }
}

const TOL_SWIGLU_MM: &str = "gate/up bounds as matmul, carried through |silu'| ≤ 1.1 and |silu(g)|, \
                             plus 8·2⁻²⁴ relative for the f32 silu and product. 16-bit activations: gate and \
                             up rounded (u·|g|, u·|u| carried the same way) and the output rounded (u·|want|)";

fn matmul_swiglu(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for dtype in WEIGHT_TYPES {
        for m in [1usize, 3, 17] {
            let k = 256;
            let (g, u) = (Mat::random(rng, dtype, 37, k, 1.0), Mat::random(rng, dtype, 37, k, 1.0));
            let x = round_to(act, &rng.vec(m * k, 1.0));
            let q = [OpQuery::MatMulSwiGlu { gate: g.case(act), up: u.case(act) }];
            s.case("matmul_swiglu", TOL_SWIGLU_MM, format!("{dtype} m={m} k={k} n=37"), &q, &[5], |d| {
                let (gw, uw) = (d.mat("gate", &g)?, d.mat("up", &u)?);
                let (xv, out) = (d.acts(act, &x)?, d.alloc(act, m * 37)?);
                let (precision, tiling) = (Precision::Exact, Default::default());
                d.launch(Op::MatMulSwiGlu { x: xv, m, gate: gw, up: uw, out, precision, tiling })?;
                d.sync()?;
                let got = d.read_act(out)?;
                let ((gr, mut eg), (ur, mut eu)) = (matmul_ref(&x, m, &g, None), matmul_ref(&x, m, &u, None));
                for i in 0..gr.len() {
                    eg[i] += ua * gr[i].abs();
                    eu[i] += ua * ur[i].abs();
                }
                let (want, bound) = swiglu_ref(&gr, &eg, &ur, &eu);
                let mut meas = Measured::default();
                meas.close("out", &got, &want, |i| bound[i] + ua * want[i].abs() + tiny)?;
                Ok(meas)
            });
        }
    }
}

fn swiglu(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "8·2⁻²⁴·|want| + 2⁻¹²⁶·(|up| + 1): f32 exp, add, divide and multiply; \
                       results below the normal range are subnormal. 16-bit activations (inputs rounded): \
                       + u·|want| + half the smallest f16 subnormal for the rounded output";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for n in [5usize, 4099, 40_000] {
        let mut g = rng.vec(n, 8.0);
        let u = round_to(act, &rng.vec(n, 4.0));
        let edges = [0.0, -0.0, 50.0, -30.0, -88.0, -100.0, 1e-30, 20.0];
        for (i, e) in edges.iter().enumerate().take(n) {
            g[i] = *e;
        }
        let g = round_to(act, &g);
        let q = [OpQuery::SwiGlu { act }];
        s.case("swiglu", TOL, format!("{n} values, gate edges {edges:?}"), &q, &[6], |d| {
            let (gv, uv, out) = (d.acts(act, &g)?, d.acts(act, &u)?, d.alloc(act, n)?);
            d.launch(Op::SwiGlu { gate: gv, up: uv, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let want: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g as f64) * u as f64).collect();
            let mut m = Measured::default();
            m.close("out", &got, &want, |i| {
                8.0 * U * want[i].abs() + MIN_NORMAL * (u[i].abs() as f64 + 1.0) + ua * want[i].abs() + tiny
            })?;
            Ok(m)
        });
    }
}

/// Inverse frequencies written from transformers' `_compute_llama3_parameters` (and the
/// plain `theta^(-2i/dim)`), independently of `RopeParams::inv_freq`.
fn inv_freq_ref(p: &RopeParams) -> Vec<f64> {
    (0..p.dim / 2)
        .map(|i| {
            let inv = 1.0 / p.theta.powf((2 * i) as f64 / p.dim as f64);
            let Some(s) = p.scaling else { return inv };
            let (low_wl, high_wl) = (
                s.original_max_position_embeddings / s.low_freq_factor,
                s.original_max_position_embeddings / s.high_freq_factor,
            );
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            let scaled = if wavelen > low_wl { inv / s.factor } else { inv };
            if wavelen < high_wl || wavelen > low_wl {
                scaled
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            }
        })
        .collect()
}

fn rope_tables(s: &mut Suite<'_>) {
    const TOL: &str = "2⁻²⁵ + 2⁻³²: the tables are f32 roundings of f64 cos/sin (½ ulp of values ≤ 1), \
                       with room for f64 angle rounding; tables in a 16-bit activation dtype (as the runner \
                       allocates them): + u·|want| + half the smallest f16 subnormal";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let llama3 = |factor| Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let params = [
        ("theta 1e4, dim 64", RopeParams { dim: 64, theta: 1e4, scaling: None, style: RopeStyle::HalfSplit }),
        ("theta 1e6, dim 128", RopeParams { dim: 128, theta: 1e6, scaling: None, style: RopeStyle::HalfSplit }),
        ("theta 1e4, dim 32 (partial)", RopeParams { dim: 32, theta: 1e4, scaling: None, style: RopeStyle::Adjacent }),
        (
            "llama3 factor 8, theta 5e5, dim 128",
            RopeParams { dim: 128, theta: 5e5, scaling: Some(llama3(8.0)), style: RopeStyle::HalfSplit },
        ),
        (
            "llama3 factor 32, theta 5e5, dim 64",
            RopeParams { dim: 64, theta: 5e5, scaling: Some(llama3(32.0)), style: RopeStyle::HalfSplit },
        ),
    ];
    let positions: Vec<u32> = vec![0, 1, 2, 17, 4095, 8191, 8192, 30_000, 131_071, 1_000_000];
    for (label, rope) in params {
        let q = [OpQuery::RopeTables { rope }];
        s.case("rope_tables", TOL, format!("{label}, positions {positions:?}"), &q, &[7], |d| {
            let inv = inv_freq_ref(&rope);
            let half = rope.dim / 2;
            let mut m = Measured::default();
            // The vocabulary's definition must agree with transformers' formula (in f64).
            let def = rope.inv_freq();
            let worst = def.iter().zip(&inv).map(|(a, b)| ((a - b) / b).abs()).fold(0f64, f64::max);
            if def.len() != inv.len() || worst > 1e-12 {
                return Err(format!("RopeParams::inv_freq differs from the reference by {worst:e} relative"));
            }
            let sv = d.step(&StepHost { positions: &positions, ..empty_host() }, 0)?;
            let n = positions.len() * half;
            let (cos, sin) = (d.alloc(act, n)?, d.alloc(act, n)?);
            d.launch(Op::RopeTables { positions: sv.positions, rope, cos, sin })?;
            d.sync()?;
            let (gc, gs) = (d.read_act(cos)?, d.read_act(sin)?);
            let (mut wc, mut ws) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for &p in &positions {
                for &f in &inv {
                    let (sn, cs) = (p as f64 * f).sin_cos();
                    wc.push(cs);
                    ws.push(sn);
                }
            }
            let tol = 2f64.powi(-25) + 2f64.powi(-32) + tiny;
            m.close("cos", &gc, &wc, |i| tol + ua * wc[i].abs())?;
            m.close("sin", &gs, &ws, |i| tol + ua * ws[i].abs())?;
            Ok(m)
        });
    }
}

fn rope(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "3·2⁻²⁴·(|x0·c| + |x1·s|) per rotated value (two f32 products and a sum, \
                       against the same f32 tables); pass-through dims and the margins exact. 16-bit \
                       activations (x and the tables rounded): + u·|want| for the rounded output";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let positions: [u32; 5] = [0, 1, 100, 8191, 30_000];
    let shapes: [(usize, usize, usize); 6] =
        [(1, 64, 64), (8, 64, 64), (8, 128, 128), (8, 64, 32), (1, 24, 16), (8, 80, 32)];
    for style in [RopeStyle::HalfSplit, RopeStyle::Adjacent] {
        for (heads, hd, rot) in shapes {
            let rows = positions.len();
            let x = round_to(act, &rng.vec(rows * heads * hd, 2.0));
            let inv = inv_freq_ref(&RopeParams { dim: rot, theta: 1e4, scaling: None, style });
            let half = rot / 2;
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for &p in &positions {
                for &f in &inv {
                    let (sn, cs) = (p as f64 * f).sin_cos();
                    cos.push(cs as f32);
                    sin.push(sn as f32);
                }
            }
            let (cos, sin) = (round_to(act, &cos), round_to(act, &sin));
            let q = [OpQuery::Rope { head_dim: hd, rot_dim: rot, style, act }];
            let name = format!("{style:?} heads {heads} head_dim {hd} rot_dim {rot}, positions {positions:?}");
            s.case("rope", TOL, name, &q, &[8], |d| {
                let pad = 3;
                let mut buf = vec![5.0f32; pad];
                buf.extend(&x);
                buf.extend([5.0f32; 3]);
                let xb = d.acts(act, &buf)?;
                let (cv, sv) = (d.acts(act, &cos)?, d.acts(act, &sin)?);
                d.launch(Op::Rope { x: xb.sub(pad, x.len()), heads, head_dim: hd, cos: cv, sin: sv, style })?;
                d.sync()?;
                let got = d.read_act(xb)?;
                let mut want: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
                let mut bound = vec![0f64; buf.len()];
                for r in 0..rows {
                    for h in 0..heads {
                        let o = pad + (r * heads + h) * hd;
                        for i in 0..half {
                            let (i0, i1) = match style {
                                RopeStyle::HalfSplit => (i, i + half),
                                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                            };
                            let (x0, x1) = (buf[o + i0] as f64, buf[o + i1] as f64);
                            let (c, sn) = (cos[r * half + i] as f64, sin[r * half + i] as f64);
                            want[o + i0] = x0 * c - x1 * sn;
                            want[o + i1] = x0 * sn + x1 * c;
                            bound[o + i0] =
                                3.0 * U * ((x0 * c).abs() + (x1 * sn).abs()) + ua * want[o + i0].abs() + tiny;
                            bound[o + i1] =
                                3.0 * U * ((x0 * sn).abs() + (x1 * c).abs()) + ua * want[o + i1].abs() + tiny;
                        }
                    }
                }
                let mut m = Measured::default();
                m.close("x (with margins)", &got, &want, |i| bound[i])?;
                Ok(m)
            });
        }
    }
}

/// Values that round in interesting ways to f16/bf16 (ties to even, subnormals, the top of
/// the f16 range, signed zero).
fn kv_edges() -> Vec<f32> {
    vec![
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        65504.0,
        6.0e-8,
        -1.0e-6,
        -0.0,
    ]
}

fn write_kv(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (kvh, hd) in [(2usize, 64usize), (1, 24), (8, 128)] {
            let (bs, blocks, tokens) = (16usize, 12usize, 20usize);
            let row = kvh * hd;
            let mut all: Vec<u32> = (0..(bs * blocks) as u32).collect();
            rng.shuffle(&mut all);
            // The pool's first and last slots among them, wherever the shuffle put them.
            for (i, edge) in [0u32, (bs * blocks - 1) as u32].into_iter().enumerate() {
                if let Some(at) = all.iter().position(|&x| x == edge) {
                    all.swap(i, at);
                }
            }
            // Reversed: the last tokens of the step write the pool edges.
            all[..tokens].reverse();
            let slots: Vec<u32> = all[..tokens].to_vec();
            let mut k = rng.vec(tokens * row, 3.0);
            let v = round_to(act, &rng.vec(tokens * row, 3.0));
            k[..8].copy_from_slice(&kv_edges());
            // K/V arrive as the activation dtype holds them.
            let k = round_to(act, &k);
            let q = [OpQuery::WriteKv { act, kv_dtype: dtype, block_size: bs, kv_heads: kvh, head_dim: hd }];
            let name =
                format!("kv {dtype}, {kvh} kv heads x {hd}, {tokens} slots scattered over {blocks} blocks of {bs}");
            s.case("write_kv", EXACT_COPY, name, &q, &[9], |d| {
                let n = blocks * bs * row;
                // Sentinels everywhere: slots not written must keep them.
                let sentinel = encode(dtype, &vec![-777.0; n]);
                let (kp, vp) = (d.raw(dtype, n, &sentinel)?, d.raw(dtype, n, &sentinel)?);
                let cache = KvLayer {
                    k: kp.buf,
                    v: vp.buf,
                    dtype,
                    num_blocks: blocks,
                    block_size: bs,
                    kv_heads: kvh,
                    head_dim: hd,
                };
                let sv = d.step(&StepHost { slots: &slots, ..empty_host() }, 0)?;
                let (kv_, vv) = (d.acts(act, &k)?, d.acts(act, &v)?);
                d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
                d.sync()?;
                let esz = dtype.block_bytes();
                let mut m = Measured::default();
                for (what, pool, src) in [("K pool", kp, &k), ("V pool", vp, &v)] {
                    let got = d.read_bytes(pool)?;
                    let mut want = sentinel.clone();
                    for (t, &sl) in slots.iter().enumerate() {
                        let at = sl as usize * row * esz;
                        want[at..at + row * esz].copy_from_slice(&encode(dtype, &src[t * row..(t + 1) * row]));
                    }
                    m.exact_bytes(what, &got, &want, esz)?;
                }
                Ok(m)
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Whole prompts: q_len = ctx_len.
    Prefill,
    /// Later chunks of prompts: q_len < ctx_len, earlier positions already in the cache.
    Chunked,
    /// One new token for several sequences at different lengths.
    Decode,
    /// A step as the scheduler builds it: decodes first, then prefill chunks (two launches).
    Mixed,
}

impl Phase {
    /// `(ctx_len, q_len)` of each sequence, and the block size of the case.
    fn seqs(self) -> (Vec<(usize, usize)>, usize) {
        match self {
            // 70 crosses a 64-position flash tile, 16 is exactly one query row block.
            Phase::Prefill => (vec![(37, 37), (70, 70), (16, 16)], 16),
            Phase::Chunked => (vec![(100, 30), (65, 17), (20, 3)], 32),
            // 1: a one-token context; 16/17: either side of a block edge; 64: exactly one
            // flash tile; 130: three tiles.
            Phase::Decode => (vec![(1, 1), (16, 1), (17, 1), (63, 1), (64, 1), (130, 1)], 16),
            Phase::Mixed => (vec![(40, 1), (5, 1), (80, 20), (9, 9)], 8),
        }
    }
}

const TOL_ATTN: &str =
    "per output (e^{2Δ} − 1 + (3·ctx + 32)·2⁻²⁴)·Σ_j p_j·|v_j|, Δ = max_j (hd + 2)·2⁻²⁴·scale·Σ|q·k_j|: \
                        f32 score error perturbs each softmax weight by at most e^{2Δ}, exp/sum/P·V roundings add \
                        O(ctx) ulps; reference reads K/V rounded to the kv dtype. 16-bit activations (q, k, v \
                        rounded first): + 2u·Σ_j p_j·|v_j| for P·V with P in the activation dtype (as flash \
                        kernels on NPUs feed it) and the rounded output";

struct AttnCase {
    kind: AttnKind,
    hd: usize,
    heads: usize,
    kv_heads: usize,
    kv: DType,
    phase: Phase,
    /// The backend's activation dtype.
    act: DType,
    /// Tokens per KV block: the phase's, or the backend's preferred size when it is larger than
    /// the CPU's 16 (FIA's paged prefill takes multiples of 128).
    block: usize,
}

/// Causal attention in f64 over `k`/`v` given per sequence in position order (`[ctx,
/// kv_heads, hd]`, values as stored), with the bound of `TOL_ATTN`.
fn attention_ref(
    q: &[f32],
    seqs: &[(usize, usize, usize)],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    c: &AttnCase,
    scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    let (hd, nh, kvh) = (c.hd, c.heads, c.kv_heads);
    let group = nh / kvh;
    let scale = scale as f64;
    let (mut out, mut bound) = (vec![0f64; q.len()], vec![0f64; q.len()]);
    for (s, &(q_start, q_len, ctx)) in seqs.iter().enumerate() {
        for r in 0..q_len {
            let pos = ctx - q_len + r;
            for h in 0..nh {
                let g = h / group;
                let qo = ((q_start + r) * nh + h) * hd;
                let mut scores = Vec::with_capacity(pos + 1);
                let mut delta = 0f64;
                for j in 0..=pos {
                    let ko = (j * kvh + g) * hd;
                    let (mut dot, mut abs) = (0f64, 0f64);
                    for dd in 0..hd {
                        let p = q[qo + dd] as f64 * k[s][ko + dd] as f64;
                        dot += p;
                        abs += p.abs();
                    }
                    scores.push(dot * scale);
                    delta = delta.max((hd + 2) as f64 * U * scale * abs);
                }
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                let eps = (2.0 * delta).exp_m1() + (3 * (pos + 1) + 32) as f64 * U;
                for dd in 0..hd {
                    let (mut acc, mut abs) = (0f64, 0f64);
                    for j in 0..=pos {
                        let vv = v[s][(j * kvh + g) * hd + dd] as f64;
                        acc += e[j] * vv;
                        abs += e[j] * vv.abs();
                    }
                    out[qo + dd] = acc / sum;
                    bound[qo + dd] = (eps + 2.0 * u_act(c.act)) * abs / sum + MIN_NORMAL + tiny_act(c.act);
                }
            }
        }
    }
    (out, bound)
}

fn attention_case(d: &mut Dev<'_>, c: &AttnCase, runs: &[(AttnKind, usize, usize)], rng: &mut Rng) -> R<Measured> {
    let (lens, _) = c.phase.seqs();
    let (bs, act) = (c.block, c.act);
    let (hd, kvh, nh) = (c.hd, c.kv_heads, c.heads);
    let row = kvh * hd;
    // Block tables with holes: the pool has twice the blocks needed plus three, handed out
    // in shuffled order, so tables are non-contiguous, unordered, and skip unused blocks.
    let need: Vec<usize> = lens.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).collect();
    let num_blocks = 2 * need.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let max_blocks = need.iter().max().copied().unwrap_or(0) + 1;
    let mut tables = vec![u32::MAX; lens.len() * max_blocks];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        let t = &mut tables[s * max_blocks..s * max_blocks + n];
        t.copy_from_slice(&ids[next..next + n]);
        // Never in ascending order, whatever the shuffle gave.
        if n >= 2 && t[0] < t[1] {
            t.swap(0, 1);
        }
        next += n;
    }
    let slot = |s: usize, p: usize| tables[s * max_blocks + p / bs] * bs as u32 + (p % bs) as u32;
    // K/V of every position, and the values the cache holds after rounding to its dtype.
    // (As the activation dtype holds them: the K/V written come from activation buffers.)
    let kf: Vec<Vec<f32>> = lens.iter().map(|&(ctx, _)| round_to(act, &rng.vec(ctx * row, 1.5))).collect();
    let vf: Vec<Vec<f32>> = lens.iter().map(|&(ctx, _)| round_to(act, &rng.vec(ctx * row, 1.5))).collect();
    let ks: Vec<Vec<f32>> = kf.iter().map(|k| round_to(c.kv, k)).collect();
    let vs: Vec<Vec<f32>> = vf.iter().map(|v| round_to(c.kv, v)).collect();

    let n = num_blocks * bs * row;
    // Unused slots hold large garbage: reading one outside the causal window shows.
    let garbage = encode(c.kv, &(0..n).map(|i| if i % 2 == 0 { 300.0 } else { -250.0 }).collect::<Vec<_>>());
    let (kp, vp) = (d.raw(c.kv, n, &garbage)?, d.raw(c.kv, n, &garbage)?);
    let cache = KvLayer { k: kp.buf, v: vp.buf, dtype: c.kv, num_blocks, block_size: bs, kv_heads: kvh, head_dim: hd };

    // An earlier step wrote the cached positions (chunked prefill's earlier chunks, the
    // decodes' contexts).
    let (mut slots0, mut k0, mut v0) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &(ctx, q_len)) in lens.iter().enumerate() {
        for p in 0..ctx - q_len {
            slots0.push(slot(s, p));
            k0.extend_from_slice(&kf[s][p * row..(p + 1) * row]);
            v0.extend_from_slice(&vf[s][p * row..(p + 1) * row]);
        }
    }
    if !slots0.is_empty() {
        let sv = d.step(&StepHost { slots: &slots0, ..empty_host() }, 0)?;
        let (kv_, vv) = (d.acts(act, &k0)?, d.acts(act, &v0)?);
        d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
        d.sync()?;
    }

    // This step: the new tokens of every sequence.
    let (mut positions, mut slots, mut seq_table, mut k1, mut v1) = (vec![], vec![], vec![], vec![], vec![]);
    let mut spans = Vec::new();
    let mut rows = 0usize;
    for (s, &(ctx, q_len)) in lens.iter().enumerate() {
        seq_table.push([rows as u32, q_len as u32, ctx as u32]);
        spans.push((rows, q_len, ctx));
        for p in ctx - q_len..ctx {
            positions.push(p as u32);
            slots.push(slot(s, p));
            k1.extend_from_slice(&kf[s][p * row..(p + 1) * row]);
            v1.extend_from_slice(&vf[s][p * row..(p + 1) * row]);
        }
        rows += q_len;
    }
    let host =
        StepHost { positions: &positions, slots: &slots, seqs: &seq_table, block_tables: &tables, ..empty_host() };
    let sv = d.step(&host, max_blocks)?;
    let q = round_to(act, &rng.vec(rows * nh * hd, 1.5));
    let qv = d.acts(act, &q)?;
    let out = d.acts(act, &vec![12344.0; q.len()])?;
    let (kv_, vv) = (d.acts(act, &k1)?, d.acts(act, &v1)?);
    d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
    let scale = 1.0 / (hd as f32).sqrt();
    let params = AttnParams::new(nh, kvh, hd, scale);
    for &(kind, first, count) in runs {
        let row_start = seq_table[first][0] as usize;
        let last = seq_table[first + count - 1];
        let seqs = SeqRange {
            seqs: sv.seqs.sub(first * 3, count * 3),
            block_tables: sv.block_tables.sub(first * max_blocks, count * max_blocks),
            max_blocks,
            first,
            count,
            row_start,
            rows: (last[0] + last[1]) as usize - row_start,
        };
        d.launch(Op::Attention { kind, q: qv, cache, seqs, params, out })?;
    }
    d.sync()?;
    let got = d.read_act(out)?;
    let (want, bound) = attention_ref(&q, &spans, &ks, &vs, c, scale);
    let mut m = Measured::default();
    m.close("out", &got, &want, |i| bound[i])?;
    Ok(m)
}

fn attention(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let block = |phase: Phase| if s.min_block > 16 { s.min_block } else { phase.seqs().1 };
    let mut cases = Vec::new();
    for kind in [AttnKind::Flash, AttnKind::PagedDecode, AttnKind::Standard] {
        for hd in [24usize, 64, 128] {
            for (heads, kv_heads) in [(4usize, 4usize), (8, 2)] {
                for phase in [Phase::Prefill, Phase::Chunked, Phase::Decode, Phase::Mixed] {
                    for kv in [DType::F32, DType::F16] {
                        cases.push(AttnCase { kind, hd, heads, kv_heads, kv, phase, act, block: block(phase) });
                    }
                }
            }
        }
    }
    for kind in [AttnKind::Flash, AttnKind::Standard] {
        let phase = Phase::Chunked;
        cases.push(AttnCase { kind, hd: 64, heads: 8, kv_heads: 2, kv: DType::BF16, phase, act, block: block(phase) });
    }
    // An odd GQA group: Qwen2.5-0.5B's 14 query heads over 2 kv heads of 64.
    for kind in [AttnKind::Flash, AttnKind::PagedDecode, AttnKind::Standard] {
        for phase in [Phase::Prefill, Phase::Chunked, Phase::Decode, Phase::Mixed] {
            cases.push(AttnCase {
                kind,
                hd: 64,
                heads: 14,
                kv_heads: 2,
                kv: DType::F16,
                phase,
                act,
                block: block(phase),
            });
        }
    }
    for c in cases {
        let (lens, _) = c.phase.seqs();
        let bs = c.block;
        let case = |phase| AttentionCase {
            phase,
            head_dim: c.hd,
            n_heads: c.heads,
            kv_heads: c.kv_heads,
            act_dtype: act,
            kv_dtype: c.kv,
            block_size: bs,
            max_context: 4096,
        };
        // The launches of the step (kind, first sequence, count) and what the plan asks.
        let runs: Vec<(AttnKind, usize, usize)> = match c.phase {
            Phase::Prefill | Phase::Chunked | Phase::Decode => vec![(c.kind, 0, lens.len())],
            // Decodes with the case's kind; the prefill run with flash when the case is the
            // decode-only kernel (as a plan would pair them).
            Phase::Mixed => {
                let pk = if c.kind == AttnKind::PagedDecode { AttnKind::Flash } else { c.kind };
                vec![(c.kind, 0, 2), (pk, 2, 2)]
            }
        };
        let queries: Vec<OpQuery> = runs
            .iter()
            .map(|&(kind, first, _)| {
                let phase = if lens[first].1 == 1 { AttnPhase::Decode } else { AttnPhase::Prefill };
                OpQuery::Attention { kind, case: case(phase) }
            })
            .collect();
        let group = format!("attention {}", c.kind.name());
        let ratio = c.heads / c.kv_heads;
        let name = format!(
            "{:?} hd={} heads {}/{} (gqa {ratio}) kv {} bs={bs} seqs(ctx,q)={lens:?}",
            c.phase, c.hd, c.heads, c.kv_heads, c.kv
        );
        // The plan-level rule: a paged decode kernel takes decodes only, and says so through
        // the `phase` parameter (the case is then listed as skipped).
        if c.kind == AttnKind::PagedDecode && matches!(c.phase, Phase::Prefill | Phase::Chunked) {
            match s.be.supports(&queries[0]) {
                Err(u) if u.param == "phase" => {}
                other => s.fail(
                    &group,
                    &name,
                    format!("paged decode attention must be rejected for a prefill with param `phase`, got {other:?}"),
                ),
            }
        }
        let seed = rng.u64();
        s.case(&group, TOL_ATTN, name, &queries, &[9, 10], |d| attention_case(d, &c, &runs, &mut Rng::new(seed)));
    }
    let g = s.group("attention paged_decode_attention", TOL_ATTN);
    g.lines.push(
        "  rule checked: paged decode is rejected for every prefill and chunked-prefill case, with param \
         `phase` (those cases are among the skips above)"
            .into(),
    );
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts

/// Router top-k in f64: softmax, the k largest (ties: lower expert first), renormalized.
fn route_ref(logits: &[f32], experts: usize, k: usize) -> (Vec<u32>, Vec<f64>) {
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks(experts) {
        let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let p: Vec<f64> = row.iter().map(|&l| (l as f64 - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top: f64 = order[..k].iter().map(|&e| p[e] / sum).sum();
        for &e in &order[..k] {
            ids.push(e as u32);
            ws.push(p[e] / sum / top);
        }
    }
    (ids, ws)
}

fn moe_route(s: &mut Suite<'_>, rng: &mut Rng) {
    const TOL: &str = "ids exact (ties: lower expert first); weights (2E + k + 8)·2⁻²⁴·|w|: f32 softmax over E \
                       experts and the renormalization over k; logits and weights in a 16-bit activation \
                       dtype (the runner's buffers): + u·|w| for the rounded weights (the logits are exact in it)";
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    for (experts, top_k) in [(8usize, 1usize), (8, 2), (8, 8), (64, 6)] {
        // Distinct logits 0.25 apart (no near-ties that rounding could flip), then rows of
        // exact ties: all equal, the top two, the second and third; a peaked row; all negative.
        let mut logits = Vec::new();
        for _ in 0..3 {
            let mut perm: Vec<usize> = (0..experts).collect();
            rng.shuffle(&mut perm);
            logits.extend(perm.iter().map(|&p| p as f32 * 0.25 - 1.0));
        }
        let tie = |vals: &[f32]| -> Vec<f32> {
            (0..experts).map(|e| vals.get(e).copied().unwrap_or(-3.0 - e as f32 * 0.25)).collect()
        };
        logits.extend(vec![0.5; experts]);
        logits.extend(tie(&[-3.5, 2.0, -4.0, 2.0]));
        logits.extend(tie(&[3.0, -5.0, 1.0, -6.0, 1.0]));
        logits.extend(tie(&[-5.0, -6.0, 30.0, 20.0]));
        logits.extend((0..experts).map(|e| -20.0 - e as f32 * 0.5));
        let m = logits.len() / experts;
        let q = [OpQuery::MoeRoute { experts, top_k }];
        let name = format!("experts {experts} top_k {top_k}, {m} rows incl. 3 with exact ties");
        s.case("moe_route", TOL, name, &q, &[11], |d| {
            if round_to(act, &logits) != logits {
                return Err(format!("the case's logits are not exact in {act}"));
            }
            let lv = d.acts(act, &logits)?;
            let (ids, weights) = (d.alloc(DType::U32, m * top_k)?, d.alloc(act, m * top_k)?);
            d.launch(Op::MoeRoute { logits: lv, m, experts, top_k, ids, weights })?;
            d.sync()?;
            let (gi, gw) = (d.read_u32(ids)?, d.read_act(weights)?);
            let (wi, ww) = route_ref(&logits, experts, top_k);
            let mut meas = Measured::default();
            meas.exact_u32("ids", &gi, &wi)?;
            let tol = (2 * experts + top_k + 8) as f64 * U + ua;
            meas.close("weights", &gw, &ww, |i| tol * ww[i] + MIN_NORMAL + tiny)?;
            Ok(meas)
        });
    }
}

/// An MoE layer's experts and a routing of `m` tokens over them.
struct Moe {
    experts: Vec<(Mat, Mat, Mat)>,
    hidden: usize,
    x: Vec<f32>,
    m: usize,
    top_k: usize,
    ids: Vec<u32>,
    weights: Vec<f32>,
    /// The activation dtype `x`, the routing weights and the outputs are held in.
    act: DType,
}

impl Moe {
    /// The same layer with `x` and the routing weights as `act` holds them.
    fn in_act(mut self, act: DType) -> Moe {
        self.x = round_to(act, &self.x);
        self.weights = round_to(act, &self.weights);
        self.act = act;
        self
    }

    fn random(rng: &mut Rng, dtype: DType, n_exp: usize, m: usize, top_k: usize) -> Moe {
        let hidden = 256;
        // The down projection's rows are `inter` long: whole K-quant super-blocks.
        let inter = if dtype.block_elems() == 256 { 256 } else { 64 };
        let experts = (0..n_exp)
            .map(|_| {
                (
                    Mat::random(rng, dtype, inter, hidden, 0.5),
                    Mat::random(rng, dtype, inter, hidden, 0.5),
                    Mat::random(rng, dtype, hidden, inter, 0.5),
                )
            })
            .collect();
        let (mut ids, mut weights) = (Vec::new(), Vec::new());
        for t in 0..m {
            // Token 0 always goes to expert 0 first, so one expert serves several tokens;
            // the rest are distinct random experts, and some experts get no token at all.
            let mut e: Vec<u32> = (0..n_exp as u32).collect();
            rng.shuffle(&mut e);
            if t == 0 {
                let at = e.iter().position(|&x| x == 0).unwrap_or(0);
                e.swap(0, at);
            }
            ids.extend_from_slice(&e[..top_k]);
            let w: Vec<f32> = (0..top_k).map(|_| 0.2 + rng.unit().abs()).collect();
            let sum: f32 = w.iter().sum();
            weights.extend(w.iter().map(|v| v / sum));
        }
        Moe { experts, hidden, x: rng.vec(m * hidden, 1.0), m, top_k, ids, weights, act: DType::F32 }
    }

    /// The layer in f64: `Σ_r w_r · expert_r(x)`, with each expert's bound (`mlp_ref`) and
    /// the f32 weighted sum's `(k + 2)·2⁻²⁴·Σ|w·y|` (16-bit activations: plus the output's rounding).
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let (ua, tiny) = (u_act(self.act), tiny_act(self.act));
        let hid = self.hidden;
        let (mut out, mut bound) = (vec![0f64; self.m * hid], vec![0f64; self.m * hid]);
        for t in 0..self.m {
            let x = &self.x[t * hid..(t + 1) * hid];
            for r in 0..self.top_k {
                let (g, u, dn) = &self.experts[self.ids[t * self.top_k + r] as usize];
                let w = self.weights[t * self.top_k + r] as f64;
                let (y, ey) = mlp_ref(x, g, u, dn, ua);
                for j in 0..hid {
                    out[t * hid + j] += w * y[j];
                    bound[t * hid + j] += w.abs() * ey[j] + (self.top_k + 2) as f64 * U * (w * y[j]).abs();
                }
            }
        }
        for (b, o) in bound.iter_mut().zip(&out) {
            *b += ua * o.abs() + tiny;
        }
        (out, bound)
    }

    /// Uploads the experts consecutively (`gate_0, up_0, down_0, gate_1, ...`).
    fn upload(&self, d: &mut Dev<'_>) -> R<ExpertSet> {
        let mut first = None;
        for (e, (g, u, dn)) in self.experts.iter().enumerate() {
            for (i, w) in [g, u, dn].into_iter().enumerate() {
                let id = d.mat(&format!("expert{e}.{i}"), w)?;
                let f = *first.get_or_insert(id);
                if id.0 != f.0 + (3 * e + i) as u32 {
                    return Err(format!("upload_weight handed out id {} for weight {} of the layer", id.0, 3 * e + i));
                }
            }
        }
        Ok(ExpertSet { first: first.ok_or("no experts")?, count: self.experts.len() })
    }

    fn grouped(&self, d: &mut Dev<'_>) -> R<Vec<f32>> {
        let experts = self.upload(d)?;
        let a = self.act;
        let (x, ids, w) = (d.acts(a, &self.x)?, d.u32s(&self.ids)?, d.acts(a, &self.weights)?);
        let out = d.alloc(a, self.m * self.hidden)?;
        let tiling = Default::default();
        d.launch(Op::MoeGrouped { x, m: self.m, experts, top_k: self.top_k, ids, weights: w, out, tiling })?;
        d.sync()?;
        d.read_act(out)
    }

    /// The per-expert path exactly as the runner's `MoePerExpert` launches it: every expert
    /// as a dense MLP over every token (gate and up matmuls, swiglu, down), its rows scattered
    /// into the routed slots, then the weighted combine.
    fn per_expert(&self, d: &mut Dev<'_>) -> R<Vec<f32>> {
        let experts = self.upload(d)?;
        let (m, hid, k) = (self.m, self.hidden, self.top_k);
        let inter = self.experts[0].0.rows;
        let a = self.act;
        let (x, ids, w) = (d.acts(a, &self.x)?, d.u32s(&self.ids)?, d.acts(a, &self.weights)?);
        let (g, u, act) = (d.alloc(a, m * inter)?, d.alloc(a, m * inter)?, d.alloc(a, m * inter)?);
        let (y, ys, out) = (d.alloc(a, m * hid)?, d.acts(a, &vec![f32::NAN; m * k * hid])?, d.alloc(a, m * hid)?);
        // Every slot is routed to exactly one expert, so the scatters cover `ys`; zero it
        // first all the same, as a stale buffer would otherwise leak NaN into the combine.
        d.launch(Op::Zero { dst: ys })?;
        let mm = |x, w, out| Op::MatMul {
            x,
            m,
            segs: Segs::one(MatSegOp { w, bias: None, out }),
            precision: Precision::Exact,
            tiling: Default::default(),
        };
        for e in 0..experts.count {
            let (gw, uw, dw) = experts.expert(e);
            d.launch(mm(x, gw, g))?;
            d.launch(mm(x, uw, u))?;
            d.launch(Op::SwiGlu { gate: g, up: u, out: act })?;
            d.launch(mm(act, dw, y))?;
            d.launch(Op::MoeScatter { y, m, expert: e as u32, top_k: k, ids, ys })?;
        }
        d.launch(Op::MoeCombine { ys, m, top_k: k, weights: w, out })?;
        d.sync()?;
        d.read_act(out)
    }
}

const TOL_MOE: &str = "each expert's gate/up/down matmul bounds carried through silu and the down projection \
                       (Σ|d|·err(h) + (inter + 4)·2⁻²⁴·Σ|d·h|), then (k + 2)·2⁻²⁴·Σ|w·y| for the weighted sum. \
                       16-bit activations (x and the routing weights rounded): + u·|·| for the rounded gate, up, \
                       SwiGLU and down outputs (carried the same way) and for the rounded result";

fn moe_grouped(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4K, DType::Q6K];
    for dtype in dtypes {
        // top_k 4: with one or two ranks the sum's order cannot show (a + b = b + a).
        for (m, top_k) in [(1usize, 2usize), (7, 2), (5, 1), (6, 4)] {
            let moe = Moe::random(rng, dtype, 8, m, top_k).in_act(act);
            let (g, dn) = (&moe.experts[0].0, &moe.experts[0].2);
            let grouped_q = OpQuery::MoeGrouped { experts: 8, top_k, gate: g.case(act), down: dn.case(act) };
            let name = format!("{dtype} experts 8 top_k {top_k} m={m} hidden 256 inter {}", g.rows);
            s.case("moe_grouped", TOL_MOE, name.clone(), &[grouped_q], &[12], |d| {
                let got = moe.grouped(d)?;
                let (want, bound) = moe.reference();
                let mut meas = Measured::default();
                meas.close("out", &got, &want, |i| bound[i])?;
                Ok(meas)
            });
            // The per-expert path must give the grouped path's bits (the ops' contract: both
            // sum in rank order, and a matmul row does not depend on the other rows).
            let q = [
                OpQuery::MatMul(g.case(act)),
                OpQuery::MatMul(moe.experts[0].1.case(act)),
                OpQuery::SwiGlu { act },
                OpQuery::MatMul(dn.case(act)),
                OpQuery::MoeScatterCombine { act },
                grouped_q,
            ];
            let tol = "as moe_grouped against the reference; bit-identical to moe_grouped";
            s.case("moe per expert (scatter+combine) = grouped", tol, name, &q, &[4, 6, 12, 13, 14, 17], |d| {
                let per = moe.per_expert(d)?;
                let grouped = moe.grouped(d)?;
                let (want, bound) = moe.reference();
                let mut meas = Measured::default();
                meas.close("per-expert out", &per, &want, |i| bound[i])?;
                meas.exact("per-expert out vs grouped out", &per, &grouped)?;
                Ok(meas)
            });
        }
    }
}

fn moe_scatter_combine(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let (ua, tiny) = (u_act(act), tiny_act(act));
    let q = [OpQuery::MoeScatterCombine { act }];
    for (m, top_k, hid) in [(1usize, 2usize, 64usize), (9, 2, 96), (6, 4, 33)] {
        let n_exp = 8;
        let mut ids = Vec::new();
        for _ in 0..m {
            let mut e: Vec<u32> = (0..n_exp).collect();
            rng.shuffle(&mut e);
            ids.extend_from_slice(&e[..top_k]);
        }
        let y = round_to(act, &rng.vec(m * hid, 2.0));
        let expert = ids[0];
        s.case(
            "moe_scatter",
            EXACT_COPY,
            format!("expert {expert} of {n_exp}, m={m} top_k {top_k} hidden {hid}"),
            &q,
            &[13],
            |d| {
                let (yv, iv) = (d.acts(act, &y)?, d.u32s(&ids)?);
                let ys = d.acts(act, &vec![-3.0; m * top_k * hid])?;
                d.launch(Op::MoeScatter { y: yv, m, expert, top_k, ids: iv, ys })?;
                d.sync()?;
                let got = d.read_act(ys)?;
                let mut want = vec![-3.0f32; m * top_k * hid];
                for (slot, &e) in ids.iter().enumerate() {
                    if e == expert {
                        let t = slot / top_k;
                        want[slot * hid..(slot + 1) * hid].copy_from_slice(&y[t * hid..(t + 1) * hid]);
                    }
                }
                let mut meas = Measured::default();
                meas.exact("ys (other slots untouched)", &got, &want)?;
                Ok(meas)
            },
        );
        let ys = round_to(act, &rng.vec(m * top_k * hid, 2.0));
        let w = round_to(act, &rng.vec(m * top_k, 1.0));
        let tol = "(k + 2)·2⁻²⁴·Σ_r |w_r·y_r|: k f32 products and sums (16-bit activations: + u·|want|)";
        s.case("moe_combine", tol, format!("m={m} top_k {top_k} hidden {hid}"), &q, &[14], |d| {
            let (yv, wv, out) = (d.acts(act, &ys)?, d.acts(act, &w)?, d.acts(act, &vec![9.0; m * hid])?);
            d.launch(Op::MoeCombine { ys: yv, m, top_k, weights: wv, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let (mut want, mut bound) = (vec![0f64; m * hid], vec![0f64; m * hid]);
            for t in 0..m {
                for r in 0..top_k {
                    let wr = w[t * top_k + r] as f64;
                    for j in 0..hid {
                        let p = wr * ys[(t * top_k + r) * hid + j] as f64;
                        want[t * hid + j] += p;
                        bound[t * hid + j] += (top_k + 2) as f64 * U * p.abs();
                    }
                }
            }
            let mut meas = Measured::default();
            meas.close("out", &got, &want, |i| bound[i] + MIN_NORMAL + ua * want[i].abs() + tiny)?;
            Ok(meas)
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Data movement

fn gather_rows(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let q = [OpQuery::GatherRows { act }];
    for (n, cols, rows) in
        [(10usize, 37usize, vec![9u32, 0, 3, 3, 9]), (64, 896, vec![63]), (5, 1, vec![4, 3, 2, 1, 0])]
    {
        let x = round_to(act, &rng.vec(n * cols, 1.0));
        s.case(
            "gather_rows",
            EXACT_COPY,
            format!("{n}x{cols}, rows {rows:?} (the step's logit rows)"),
            &q,
            &[15],
            |d| {
                let xv = d.acts(act, &x)?;
                let sv = d.step(&StepHost { logit_rows: &rows, ..empty_host() }, 0)?;
                let out = d.alloc(act, rows.len() * cols)?;
                d.launch(Op::GatherRows { x: xv, cols, rows: sv.logit_rows, out })?;
                d.sync()?;
                let got = d.read_act(out)?;
                let want: Vec<f32> = rows.iter().flat_map(|&r| x[r as usize * cols..][..cols].to_vec()).collect();
                let mut m = Measured::default();
                m.exact("out", &got, &want)?;
                Ok(m)
            },
        );
    }
}

fn convert(s: &mut Suite<'_>, rng: &mut Rng) {
    let mut vals = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1.0 + 2f32.powi(-11),       // f16 tie: to even (1.0)
        1.0 + 3.0 * 2f32.powi(-11), // f16 tie: to even (up)
        1.0 + 2f32.powi(-8),        // bf16 tie: to even (1.0)
        1.0 + 3.0 * 2f32.powi(-8),  // bf16 tie: to even (up)
        65504.0,                    // f16 max
        65520.0,                    // halfway to the next f16 binade: rounds to inf
        1.0e6,                      // beyond f16: inf; bf16 keeps it
        2f32.powi(-24),             // smallest f16 subnormal
        1.0e-10,                    // below f16: 0
        1.0e-40,                    // f32 subnormal
        f32::MAX,                   // rounds to bf16 inf
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    vals.extend(rng.vec(1000, 100.0));
    let n = vals.len();
    let dts = [DType::F32, DType::F16, DType::BF16];
    for from in dts {
        for to in dts {
            let q = [OpQuery::Convert { from, to }];
            let tol = "exact: round to nearest even, through f32 (NaN stays NaN)";
            s.case(
                "convert",
                tol,
                format!("{from} -> {to}, {n} values incl. ties, overflow, subnormals, inf, NaN"),
                &q,
                &[16],
                |d| {
                    // The source holds what `from` can represent of the values.
                    let src_bytes = encode(from, &vals);
                    let src_vals = decode(from, &src_bytes, n);
                    // At an offset inside both buffers, as views are.
                    let mut sb = encode(from, &[2.0; 4]);
                    sb.extend(&src_bytes);
                    let src = d.raw(from, n + 4, &sb)?;
                    let dst = d.raw(to, n + 2, &encode(to, &vec![7.0; n + 2]))?;
                    d.launch(Op::Convert { src: src.sub(4, n), dst: dst.sub(2, n) })?;
                    d.sync()?;
                    let got = d.read_bytes(dst)?;
                    let mut want_vals = vec![7.0f32; 2];
                    want_vals.extend(&src_vals);
                    let want = encode(to, &want_vals);
                    // Widening to f32 is exact and one-to-one, so comparing the f32 bits compares
                    // the stored bits (NaN payloads may differ: NaN matches NaN).
                    let mut m = Measured::default();
                    m.exact("dst (with margins)", &decode(to, &got, n + 2), &decode(to, &want, n + 2))?;
                    Ok(m)
                },
            );
        }
    }
}

fn zero(s: &mut Suite<'_>) {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::U32] {
        let (n, start, len) = (100usize, 10usize, 50usize);
        // No OpQuery exists for Zero: every backend must take it.
        s.case("zero", EXACT_COPY, format!("{dtype}: elements {start}..{} of {n}", start + len), &[], &[17], |d| {
            let ones: Vec<u8> = match dtype {
                DType::U32 => (0..n as u32).flat_map(|i| (i + 1).to_le_bytes()).collect(),
                _ => encode(dtype, &vec![1.5; n]),
            };
            let b = d.raw(dtype, n, &ones)?;
            d.launch(Op::Zero { dst: b.sub(start, len) })?;
            d.sync()?;
            let got = d.read_bytes(b)?;
            let esz = dtype.block_bytes();
            let mut want = ones.clone();
            want[start * esz..(start + len) * esz].fill(0);
            let mut m = Measured::default();
            m.exact_bytes("buffer", &got, &want, esz)?;
            Ok(m)
        });
    }
}

// ---------------------------------------------------------------------------------------------

fn run_suite(name: &'static str, be: &mut dyn Backend, act: DType) -> (String, Vec<String>) {
    let t0 = Instant::now();
    let mut s = Suite::new(name, be, act);
    let mut rng = Rng::new(0x7b00_57c0_f041);
    embed(&mut s, &mut rng);
    norms(&mut s, &mut rng);
    add(&mut s, &mut rng);
    matmul(&mut s, &mut rng);
    matmul_swiglu(&mut s, &mut rng);
    swiglu(&mut s, &mut rng);
    rope_tables(&mut s);
    rope(&mut s, &mut rng);
    write_kv(&mut s, &mut rng);
    attention(&mut s, &mut rng);
    moe_route(&mut s, &mut rng);
    moe_grouped(&mut s, &mut rng);
    moe_scatter_combine(&mut s, &mut rng);
    gather_rows(&mut s, &mut rng);
    convert(&mut s, &mut rng);
    zero(&mut s);
    // Coverage: every Op variant is in the table, and launched unless every case that
    // launches it was skipped (and so listed).
    for (i, op) in OP_NAMES.iter().enumerate() {
        if !s.wanted[i] {
            s.fail("coverage", op, "no case of the table launches this op".into());
        } else if s.ran[i] && !s.launched[i] {
            s.fail("coverage", op, "cases that launch it ran, but it was never launched".into());
        } else if !s.launched[i] {
            let g = s.group("coverage", "");
            g.lines
                .push(format!("  note {op}: never launched on this backend (every case that launches it was skipped)"));
        }
    }
    let report = s.report(t0.elapsed().as_secs_f64());
    (report, s.failures)
}

#[test]
fn every_op_on_every_backend_matches_the_reference() {
    let mut failures = Vec::new();
    for (name, mut be) in backends() {
        // Once per activation dtype the backend computes in (the CPU: f32; Ascend: f16, bf16).
        for act in be.activation_dtypes().to_vec() {
            let (report, f) = run_suite(name, be.as_mut(), act);
            // Straight to the process's stdout (past the test harness's capture): the report is
            // the point of the suite, also when it passes.
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(report.as_bytes());
            let _ = out.flush();
            failures.extend(f.into_iter().map(|x| format!("({act}) {x}")));
        }
    }
    assert!(failures.is_empty(), "{} conformance failures:\n{}", failures.len(), failures.join("\n"));
}
