//! The operator API (`tboost_engine::op_api`): every op, called directly through `Operation`, equals
//! the kernel crate's f64 scalar reference (`tboost_kernels::*::reference`) within the bound
//! stated next to each comparison; every bad tensor is an `Err` naming the op and the tensor;
//! and `supports` answers what the plan records for the same case.
//!
//! Backends: the CPU backend always; the Ascend backend on the CANN SIMULATOR (ascend-sim, not
//! an NPU) when `TBOOST_ASCEND_SIM` names a built simulator (`scripts/build-ascend-sim.sh`);
//! its cases are labelled SIMULATOR. A case a backend's `supports` refuses is printed as
//! skipped with the backend's reason, never counted as passed.
//!
//! Bounds. f32 activations (the CPU): a dot product of k terms is within
//! `(k + 4)·2⁻²⁴·Σ|terms|` of the f64 value (any summation order); elementwise ops within a few
//! f32 roundings of the value. 16-bit activations (f16 on the simulator) add `4·2⁻¹¹` relative
//! for the roundings of inputs already rounded and of the output, plus half the smallest f16
//! subnormal. Fast precision adds `Σ|w|·amax(x block of 32)/127` for 8-bit activations (and
//! `Σ|w·x|·2⁻⁸` where bf16 activations are used).

#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::{AttnKind, DType, Precision};
use tboost_engine::op_api::{
    AttentionParams, EmbedParams, MatMulParams, Mem, MoeGroupedParams, MoeRouteParams, NormParams, OpBackend, OpParams,
    Operation, RopeOpParams, TensorRef,
};
use tboost_kernels::attention::{reference as attn_ref, AttnParams, KvPool, SeqSpan};
use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
use tboost_kernels::gemm::reference as mm_ref;
use tboost_kernels::moe::{reference as moe_ref, Expert};
use tboost_kernels::{activation, norm, rope, WeightMat, WeightVec};
use tboost_ops::{RopeParams, RopeStyle};

use common::Rng;
use tboost_testkit::golden as common;

const U: f64 = 1.0 / (1u64 << 24) as f64;

fn backends() -> Vec<(String, OpBackend)> {
    let mut v = vec![("cpu".to_string(), OpBackend::new(Box::new(CpuBackend::new(2).expect("cpu backend"))))];
    #[cfg(feature = "ascend")]
    if let Some(dir) = std::env::var_os("TBOOST_ASCEND_SIM") {
        use tboost_engine::backend::ascend::sys::{Cann, SearchOrder};
        let dir = std::path::PathBuf::from(dir);
        let cann = Cann::load_from(&SearchOrder::dirs_only([dir.join("lib64")]))
            .unwrap_or_else(|e| panic!("the CANN simulator at {} does not load: {e}", dir.display()));
        assert!(cann.is_simulator(), "{} is not the CANN simulator", dir.display());
        let be =
            tboost_engine::backend::ascend::AscendBackend::open_on(&cann, 0).expect("ascend backend on the simulator");
        v.push(("ascend (SIMULATOR)".to_string(), OpBackend::new(Box::new(be))));
    } else {
        eprintln!("op_api: TBOOST_ASCEND_SIM is unset: the Ascend backend (SIMULATOR) is not tested in this run");
    }
    v
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        q => quantize_row_reference(q, v).unwrap_or_else(|e| panic!("quantize {q}: {e}")),
    }
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => panic!("decode {other}"),
    }
}

/// The values `n` elements of `dtype` stand for (block types through ggml's dequantization,
/// the kernel crate's reference).
fn values(dtype: DType, b: &[u8], n: usize) -> Vec<f32> {
    if dtype.is_quantized() {
        let mut out = vec![0f32; n];
        dequantize_row(dtype, b, &mut out).unwrap_or_else(|e| panic!("dequantize {dtype}: {e}"));
        out
    } else {
        decode(dtype, b)
    }
}

/// One backend under test, in its activation dtype.
struct B {
    label: String,
    be: OpBackend,
    act: DType,
}

impl B {
    fn ua(&self) -> f64 {
        match self.act {
            DType::F16 => 4.0 * 2f64.powi(-11),
            DType::BF16 => 4.0 * 2f64.powi(-8),
            _ => 0.0,
        }
    }
    fn tiny(&self) -> f64 {
        if self.act == DType::F32 {
            1e-30
        } else {
            2f64.powi(-24)
        }
    }
    /// `v` as an activation tensor; returns the tensor and the values it holds.
    fn acts(&self, shape: &[usize], v: &[f32]) -> (TensorRef, Vec<f32>) {
        let t = self.be.alloc(self.act, shape).unwrap();
        let bytes = encode(self.act, v);
        self.be.write(&t, &bytes).unwrap();
        (t, decode(self.act, &bytes))
    }
    fn out(&self, shape: &[usize]) -> TensorRef {
        self.be.alloc(self.act, shape).unwrap()
    }
    fn get(&self, t: &TensorRef) -> Vec<f32> {
        let n: usize = t.shape.iter().product();
        let mut bytes = vec![0u8; self.act.bytes_for(n).unwrap()];
        self.be.read(t, &mut bytes).unwrap();
        decode(self.act, &bytes)
    }
    fn u32s(&self, shape: &[usize], v: &[u32]) -> TensorRef {
        let t = self.be.alloc(DType::U32, shape).unwrap();
        self.be.write_u32(&t, v).unwrap();
        t
    }
    /// A weight of `dtype` from `v`: the tensor and the values its bytes stand for.
    fn weight(&self, dtype: DType, shape: &[usize], v: &[f32]) -> (TensorRef, Vec<f32>) {
        let bytes = encode(dtype, v);
        let vals = values(dtype, &bytes, v.len());
        (self.be.upload_weight(dtype, shape, bytes).unwrap(), vals)
    }
    /// Creates `params` and checks `supports`; `None` (printed as skipped) when refused.
    fn op(&self, params: OpParams, case: &str) -> Option<Operation> {
        let op = Operation::new(&self.be, params).unwrap();
        match op.supports() {
            Ok(()) => Some(op),
            Err(why) => {
                eprintln!("op_api [{}] {} {case}: skipped, the backend says: {why}", self.label, op.name());
                None
            }
        }
    }
}

/// One test at a time opens backends: the CANN SIMULATOR keeps one device per process, and a
/// backend dropped by one test would reset it under another.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn each_backend(mut f: impl FnMut(&B)) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (label, be) in backends() {
        let act = be.activation_dtype().unwrap();
        f(&B { label, be, act });
    }
}

/// `got` within `bound(i)` of `want`, with the worst case in the message.
fn close(what: &str, got: &[f32], want: &[f64], bound: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for i in 0..got.len() {
        let e = (got[i] as f64 - want[i]).abs();
        let b = bound(i);
        assert!(e <= b, "{what}: element {i}: got {} want {} (error {e:e} above the bound {b:e})", got[i], want[i]);
        if b > 0.0 && e / b > worst.0 {
            worst = (e / b, i);
        }
    }
    eprintln!("op_api {what}: {} values within bound (worst {:.3} of the bound at {})", got.len(), worst.0, worst.1);
}

const WEIGHT_TYPES: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

#[test]
fn matmul_every_weight_dtype_and_precision_equals_the_reference() {
    each_backend(|b| {
        let mut rng = Rng::new(1);
        let mut ran = 0;
        for dtype in WEIGHT_TYPES {
            for precision in [Precision::Exact, Precision::Fast] {
                for bias in [false, true] {
                    let (m, n, k) = (5, 19, 256);
                    let case =
                        format!("{dtype} {} m={m} n={n} k={k}{}", precision.name(), if bias { " +bias" } else { "" });
                    let p =
                        MatMulParams { weight: dtype, n, k, bias, precision, act: b.act, tiling: Default::default() };
                    let Some(op) = b.op(OpParams::MatMul(p), &case) else { continue };
                    let (x, xv) = b.acts(&[m, k], &rng.vec(m * k, 1.0));
                    let (w, wvals) = b.weight(dtype, &[n, k], &rng.vec(n * k, 0.5));
                    let bv = rng.vec(n, 0.5);
                    let mut ins = vec![x, w];
                    if bias {
                        ins.push(b.weight(DType::F32, &[n], &bv).0);
                    }
                    let y = b.out(&[m, n]);
                    op.execute(&ins, &mut [y.clone()], None).unwrap();
                    let got = b.get(&y);
                    let wm = WeightMat::from_f32(&wvals, n, k).unwrap();
                    let bvec = WeightVec::from_f32(&bv);
                    let want = mm_ref::matmul(&xv, m, &wm, bias.then_some(&bvec));
                    let bound = |i: usize| {
                        let (r, j) = (i / n, i % n);
                        let mut a = 0f64;
                        let mut q8 = 0f64;
                        for c in 0..k {
                            let wv = mm_ref::weight_at(&wm, j, c) as f64;
                            a += (xv[r * k + c] as f64 * wv).abs();
                            let blk = &xv[r * k + c / 32 * 32..r * k + c / 32 * 32 + 32];
                            q8 += wv.abs() * blk.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                        }
                        let bias_abs = if bias { bv[j].abs() as f64 } else { 0.0 };
                        let fast = if precision == Precision::Fast { q8 + a * 2f64.powi(-8) } else { 0.0 };
                        (k + 4) as f64 * U * (a + bias_abs) + b.ua() * (a + bias_abs) + fast + b.tiny()
                    };
                    close(&format!("[{}] matmul {case}", b.label), &got, &want, bound);
                    ran += 1;
                }
            }
        }
        // The CPU takes every weight dtype in exact precision (with and without bias); a device
        // at least one case.
        let want = if b.label == "cpu" { WEIGHT_TYPES.len() * 2 } else { 1 };
        assert!(ran >= want, "[{}] only {ran} matmul cases ran", b.label);
    });
}

#[test]
fn rmsnorm_and_add_rmsnorm_equal_the_reference() {
    each_backend(|b| {
        let mut rng = Rng::new(2);
        let (rows, dim, eps) = (3, 96, 1e-5f32);
        for gain in [DType::F32, DType::F16, DType::BF16] {
            let p = NormParams { dim, eps, gain, act: b.act };
            let g = rng.vec(dim, 1.0);
            let (gt, gv) = b.weight(gain, &[dim], &g);
            // Bound: the mean square over dim terms and the rsqrt, a few f32 roundings of each
            // output, relative.
            let rel = (dim + 8) as f64 * U + b.ua();
            if let Some(op) = b.op(OpParams::RmsNorm(p), &format!("gain {gain}")) {
                let (x, xv) = b.acts(&[rows, dim], &rng.vec(rows * dim, 2.0));
                let y = b.out(&[rows, dim]);
                op.execute(&[x, gt.clone()], &mut [y.clone()], None).unwrap();
                let want = norm::reference::rmsnorm(&xv, &gv, eps as f64);
                close(&format!("[{}] rmsnorm gain {gain}", b.label), &b.get(&y), &want, |i| {
                    rel * want[i].abs() + b.tiny()
                });
            }
            if let Some(op) = b.op(OpParams::AddRmsNorm(p), &format!("gain {gain}")) {
                let (x, xv) = b.acts(&[rows, dim], &rng.vec(rows * dim, 2.0));
                let (r, rv) = b.acts(&[rows, dim], &rng.vec(rows * dim, 2.0));
                let y = b.out(&[rows, dim]);
                op.execute(&[x, gt.clone()], &mut [r.clone(), y.clone()], None).unwrap();
                let sum: Vec<f32> = xv.iter().zip(&rv).map(|(a, c)| a + c).collect();
                let sum_want: Vec<f64> = xv.iter().zip(&rv).map(|(&a, &c)| a as f64 + c as f64).collect();
                close(&format!("[{}] add_rmsnorm residual, gain {gain}", b.label), &b.get(&r), &sum_want, |i| {
                    (U + b.ua()) * sum_want[i].abs() + b.tiny()
                });
                let want = norm::reference::rmsnorm(&sum, &gv, eps as f64);
                close(&format!("[{}] add_rmsnorm out, gain {gain}", b.label), &b.get(&y), &want, |i| {
                    (rel + 2.0 * b.ua()) * want[i].abs() + b.tiny()
                });
            }
        }
    });
}

#[test]
fn rope_equals_the_reference_with_and_without_a_workspace() {
    each_backend(|b| {
        let mut rng = Rng::new(3);
        let (rows, heads, head_dim) = (4, 3, 32);
        for (style, rot) in [(RopeStyle::HalfSplit, 32), (RopeStyle::Adjacent, 32), (RopeStyle::HalfSplit, 16)] {
            let rp = RopeParams { dim: rot, theta: 10000.0, scaling: None, style };
            let p = RopeOpParams { heads, head_dim, rope: rp, act: b.act };
            let case = format!("{style:?} rot_dim={rot}");
            let Some(op) = b.op(OpParams::Rope(p), &case) else { continue };
            let positions: Vec<u32> = vec![0, 7, 300, 4095];
            for with_ws in [false, true] {
                let pos = b.u32s(&[rows], &positions);
                let (x, xv) = b.acts(&[rows, heads, head_dim], &rng.vec(rows * heads * head_dim, 1.0));
                let mut outs = [x.clone()];
                let ws_bytes = op.workspace_size(std::slice::from_ref(&pos), &outs).unwrap();
                let e = b.act.block_bytes();
                assert_eq!(ws_bytes, 2 * rows * (rot / 2) * e, "cos and sin tables in the activation dtype");
                assert_eq!(op.workspace_dtype(), b.act);
                let ws = with_ws.then(|| b.be.alloc(b.act, &[ws_bytes / e]).unwrap());
                op.execute(&[pos], &mut outs, ws.as_ref()).unwrap();
                let inv = rp.inv_freq();
                let mut want = Vec::new();
                for r in 0..rows {
                    for h in 0..heads {
                        let o = (r * heads + h) * head_dim;
                        let mut head = xv[o..o + head_dim].to_vec();
                        let rotated = rope::reference::rotate(&head[..rot], positions[r], &inv, style);
                        let mut full: Vec<f64> = head.drain(..).map(|v| v as f64).collect();
                        if style == RopeStyle::HalfSplit || rot == head_dim {
                            full[..rot].copy_from_slice(&rotated);
                        }
                        want.extend(full);
                    }
                }
                // cos/sin in f32 at positions up to 4095: the angle carries pos·2⁻²⁴ absolute
                // error into each table entry, then two products and a sum.
                let got = b.get(&x);
                close(&format!("[{}] rope {case} workspace={with_ws}", b.label), &got, &want, |i| {
                    let pos = positions[i / (heads * head_dim)] as f64;
                    (4096.0 + pos * 4.0) * U * 2.0 + b.ua() * 2.0 + b.tiny()
                });
            }
        }
    });
}

#[test]
fn swiglu_embed_and_moe_route_equal_the_reference() {
    each_backend(|b| {
        let mut rng = Rng::new(4);
        if let Some(op) = b.op(OpParams::SwiGlu { act: b.act }, "") {
            let (g, gv) = b.acts(&[3, 40], &rng.vec(120, 4.0));
            let (u, uv) = b.acts(&[3, 40], &rng.vec(120, 4.0));
            let y = b.out(&[3, 40]);
            op.execute(&[g, u], &mut [y.clone()], None).unwrap();
            let want = activation::reference::swiglu(&gv, &uv);
            close(&format!("[{}] swiglu", b.label), &b.get(&y), &want, |i| {
                (8.0 * U + b.ua()) * want[i].abs() + 1e-30 + b.tiny()
            });
        }
        for table in [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4K] {
            let (vocab, hidden) = (11, 256);
            let p = EmbedParams { table, vocab, hidden, act: b.act };
            let Some(op) = b.op(OpParams::Embed(p), &format!("table {table}")) else { continue };
            let (t, tv) = b.weight(table, &[vocab, hidden], &rng.vec(vocab * hidden, 1.0));
            let ids = [3u32, 0, 10, 3];
            let idt = b.u32s(&[4], &ids);
            let y = b.out(&[4, hidden]);
            op.execute(&[idt, t], &mut [y.clone()], None).unwrap();
            let want: Vec<f64> = ids
                .iter()
                .flat_map(|&id| tv[id as usize * hidden..(id as usize + 1) * hidden].iter().map(|&v| v as f64))
                .collect();
            // A gather: exact in f32; one rounding to a 16-bit activation dtype.
            close(&format!("[{}] embed table {table}", b.label), &b.get(&y), &want, |i| {
                b.ua() * want[i].abs() + if b.act == DType::F32 { 0.0 } else { b.tiny() }
            });
        }
        let (m, experts, top_k) = (5, 8, 2);
        let route = MoeRouteParams { experts, top_k, act: b.act };
        if let Some(op) = b.op(OpParams::MoeRoute(route), "8 experts top-2") {
            let (l, logits_v) = b.acts(&[m, experts], &rng.vec(m * experts, 3.0));
            let ids = b.be.alloc(DType::U32, &[m, top_k]).unwrap();
            let w = b.out(&[m, top_k]);
            op.execute(&[l], &mut [ids.clone(), w.clone()], None).unwrap();
            let (gi, gw) = (b.be.read_u32(&ids).unwrap(), b.get(&w));
            for r in 0..m {
                let row = &logits_v[r * experts..(r + 1) * experts];
                let mut order: Vec<usize> = (0..experts).collect();
                order.sort_by(|&a, &c| row[c].total_cmp(&row[a]));
                let top = &order[..top_k];
                assert_eq!(&gi[r * top_k..(r + 1) * top_k], &top.iter().map(|&e| e as u32).collect::<Vec<_>>()[..]);
                // Renormalized softmax over the top k, in f64.
                let e: Vec<f64> = top.iter().map(|&j| ((row[j] - row[top[0]]) as f64).exp()).collect();
                let s: f64 = e.iter().sum();
                for j in 0..top_k {
                    let want = e[j] / s;
                    let got = gw[r * top_k + j] as f64;
                    // f32: a few roundings of the exp and the sum; f16: the stored weight's rounding.
                    assert!(
                        (got - want).abs() <= 32.0 * U + b.ua(),
                        "[{}] moe_route row {r} rank {j}: {got} vs {want}",
                        b.label
                    );
                }
            }
        }
    });
}

#[test]
fn moe_grouped_equals_the_reference() {
    each_backend(|b| {
        let mut rng = Rng::new(5);
        let (m, experts, top_k, hidden, inter) = (4, 4, 2, 64, 96);
        for dtype in [DType::F32, DType::F16, DType::Q8_0] {
            let p = MoeGroupedParams {
                experts,
                top_k,
                hidden,
                inter,
                weight: dtype,
                act: b.act,
                tiling: Default::default(),
            };
            let Some(op) = b.op(OpParams::MoeGrouped(p), &format!("{dtype}")) else { continue };
            let (x, xv) = b.acts(&[m, hidden], &rng.vec(m * hidden, 1.0));
            let ids_v: Vec<u32> = vec![0, 3, 2, 0, 1, 3, 3, 2];
            let wts_v: Vec<f32> = vec![0.6, 0.4, 0.7, 0.3, 0.5, 0.5, 0.9, 0.1];
            let ids = b.u32s(&[m, top_k], &ids_v);
            let (wts, wts_v) = b.acts(&[m, top_k], &wts_v);
            let mut ins = vec![x, ids, wts];
            let mut bytes = Vec::new();
            for _ in 0..experts {
                for shape in [[inter, hidden], [inter, hidden], [hidden, inter]] {
                    let (t, tv) = b.weight(dtype, &shape, &rng.vec(shape[0] * shape[1], 0.3));
                    ins.push(t);
                    bytes.push((shape, tv));
                }
            }
            let y = b.out(&[m, hidden]);
            op.execute(&ins, &mut [y.clone()], None).unwrap();
            let mats: Vec<WeightMat<'_>> =
                bytes.iter().map(|(s, tv)| WeightMat::from_f32(tv, s[0], s[1]).unwrap()).collect();
            let ex: Vec<Expert<'_>> = (0..experts)
                .map(|e| Expert { gate: mats[3 * e], up: mats[3 * e + 1], down: mats[3 * e + 2] })
                .collect();
            let got = b.get(&y);
            for r in 0..m {
                let want = moe_ref::moe_token(
                    &xv[r * hidden..(r + 1) * hidden],
                    &ex,
                    &ids_v[r * top_k..(r + 1) * top_k],
                    &wts_v[r * top_k..(r + 1) * top_k],
                );
                // Two f32 dot products in a row (hidden then inter terms) through silu: bounded
                // relative to the output's scale (max |want| of the row).
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                let tol = ((hidden + inter + 16) as f64 * U * 8.0 + 4.0 * b.ua()) * scale + b.tiny();
                close(
                    &format!("[{}] moe_grouped {dtype} row {r}", b.label),
                    &got[r * hidden..(r + 1) * hidden],
                    &want,
                    |_| tol,
                );
            }
        }
    });
}

/// A paged KV cache filled with random values, its host bytes, and the seq table.
#[allow(clippy::type_complexity)]
fn attention_case(b: &B, kind: AttnKind, head_dim: usize, block_size: usize, rng: &mut Rng) -> Option<()> {
    let (heads, kv_heads, blocks) = (4, 2, 12);
    let kv = b.act;
    let p = AttentionParams {
        kind,
        heads,
        kv_heads,
        head_dim,
        scale: None,
        block_size,
        kv_dtype: kv,
        max_context: 4096,
        act: b.act,
        tile_kv: None,
    };
    let op = b.op(OpParams::Attention(p), &format!("head_dim={head_dim} block_size={block_size}"))?;
    // Prefill: two sequences (a fresh one of 20 rows, one of 5 new rows over 40 cached); decode:
    // three sequences of one row.
    let seqs: Vec<[u32; 3]> = if kind == AttnKind::PagedDecode {
        vec![[0, 1, 17], [1, 1, 33], [2, 1, 1]]
    } else {
        vec![[0, 20, 20], [20, 5, 45]]
    };
    let rows: usize = seqs.iter().map(|s| s[1] as usize).sum();
    let max_blocks = 4;
    // Block tables: a permutation of the pool's blocks.
    let order = [7u32, 2, 9, 0, 11, 4, 1, 5, 3, 8, 6, 10];
    let bt: Vec<u32> = (0..seqs.len()).flat_map(|i| order[i * max_blocks..(i + 1) * max_blocks].to_vec()).collect();
    let pool_len = blocks * block_size * kv_heads * head_dim;
    let (k, kh) = b.acts(&[blocks, block_size, kv_heads, head_dim], &rng.vec(pool_len, 1.0));
    let (v, vh) = b.acts(&[blocks, block_size, kv_heads, head_dim], &rng.vec(pool_len, 1.0));
    let (q, qv) = b.acts(&[rows, heads * head_dim], &rng.vec(rows * heads * head_dim, 1.0));
    let st = b.u32s(&[seqs.len(), 3], seqs.as_flattened());
    let btt = b.u32s(&[seqs.len(), max_blocks], &bt);
    let out = b.out(&[rows, heads * head_dim]);
    op.execute(&[q, k, v, st, btt], &mut [out.clone()], None).unwrap();
    let got = b.get(&out);
    let (kb, vb) = (encode(DType::F32, &kh), encode(DType::F32, &vh));
    let pool = KvPool { dtype: DType::F32, block_size, kv_heads, head_dim, k: &kb, v: &vb };
    let spans = spans_of(&seqs, &bt, max_blocks);
    let ap = AttnParams::new(heads, kv_heads, head_dim, 1.0 / (head_dim as f32).sqrt());
    let want = attn_ref::attention(&qv, &pool, &spans, &ap);
    // Output is a convex combination of V rows (|v| ≤ 1): scores' f32 dot products over
    // head_dim terms (|q·k| ≤ head_dim) carry into the softmax weights; 64 f32 roundings of the
    // unit scale cover the exp, the running rescale and the weighted sum over ≤ 45 positions.
    let tol = (head_dim as f64 / (head_dim as f64).sqrt() + 64.0) * 8.0 * U + 8.0 * b.ua() + b.tiny();
    close(&format!("[{}] {} head_dim={head_dim} block_size={block_size}", b.label, kind.name()), &got, &want, |_| tol);
    Some(())
}

#[test]
fn attention_prefill_and_paged_decode_equal_the_reference() {
    each_backend(|b| {
        let mut rng = Rng::new(6);
        for kind in [AttnKind::Flash, AttnKind::Standard, AttnKind::PagedDecode] {
            for head_dim in [32, 64] {
                // 16: the CPU's block size; 128: what aclnn's paged prefill (FIA) takes.
                for block_size in [16, 128] {
                    attention_case(b, kind, head_dim, block_size, &mut rng);
                }
            }
        }
        // Standard attention takes head_dim 24 (flash does not: see the plan test below).
        attention_case(b, AttnKind::Standard, 24, 16, &mut rng);
    });
}

#[test]
fn flash_attention_head_dim_24_is_refused_with_the_plans_reason() {
    let r = common::runner(&common::golden_dir("llama_hd24"));
    let d = r.plan.layers[0].get(tboost_engine::plan::Slot::AttentionPrefill).expect("attention_prefill decision");
    let (query, why) = d
        .tried
        .iter()
        .find_map(|t| match &t.verdict {
            tboost_engine::plan::Verdict::Rejected { query, why }
                if t.candidate == tboost_engine::plan::Choice::FlashAttention =>
            {
                Some((*query, why.clone()))
            }
            _ => None,
        })
        .expect("the plan records flash attention's rejection");
    let c = &r.cfg;
    let be = OpBackend::new(Box::new(CpuBackend::new(1).unwrap()));
    let p = AttentionParams {
        kind: AttnKind::Flash,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        scale: None,
        block_size: r.plan.block_size,
        kv_dtype: r.plan.kv_dtype,
        max_context: c.max_position_embeddings,
        act: r.plan.act_dtype,
        tile_kv: None,
    };
    let op = Operation::new(&be, OpParams::Attention(p)).unwrap();
    assert_eq!(OpParams::Attention(p).queries(), vec![query], "the op asks the very query the plan asked");
    let got = op.supports().expect_err("flash attention with head_dim 24 is refused on the cpu");
    assert_eq!(got, why);
    assert_eq!(got.to_string(), "head_dim=24 is not a multiple of 16");
    // Executing it anyway is that error, not a kernel's panic.
    let t = |dt, shape: &[usize]| be.alloc(dt, shape).unwrap();
    let (hd, h, kvh) = (c.head_dim, c.num_heads, c.num_kv_heads);
    let ins = [
        t(DType::F32, &[1, h * hd]),
        t(DType::F32, &[1, p.block_size, kvh, hd]),
        t(DType::F32, &[1, p.block_size, kvh, hd]),
        t(DType::U32, &[1, 3]),
        t(DType::U32, &[1, 1]),
    ];
    let e = err_text(op.execute(&ins, &mut [t(DType::F32, &[1, h * hd])], None));
    assert_eq!(e, "unsupported: flash_attention on cpu: head_dim=24 is not a multiple of 16");
}

/// The reference's view of a seq table (`[q_start, q_len, ctx_len]` per sequence) and its
/// block tables (`max_blocks` per sequence).
fn spans_of<'a>(seqs: &[[u32; 3]], bt: &'a [u32], max_blocks: usize) -> Vec<SeqSpan<'a>> {
    seqs.iter()
        .enumerate()
        .map(|(i, s)| SeqSpan {
            q_start: s[0] as usize,
            q_len: s[1] as usize,
            ctx_len: s[2] as usize,
            block_table: &bt[i * max_blocks..(i + 1) * max_blocks],
        })
        .collect()
}

fn err_text(r: tboost_engine::Result<()>) -> String {
    match r {
        Ok(()) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_tensors_are_errors_naming_op_tensor_and_expectation() {
    let be = OpBackend::new(Box::new(CpuBackend::new(1).unwrap()));
    let (precision, tiling) = (Precision::Exact, Default::default());
    let p = MatMulParams { weight: DType::F32, n: 4, k: 8, bias: false, precision, act: DType::F32, tiling };
    let op = Operation::new(&be, OpParams::MatMul(p)).unwrap();
    let x = be.alloc(DType::F32, &[2, 8]).unwrap();
    let w = be.upload_weight(DType::F32, &[4, 8], vec![0u8; 4 * 8 * 4]).unwrap();
    let y = be.alloc(DType::F32, &[2, 4]).unwrap();

    let e = err_text(op.execute(std::slice::from_ref(&x), &mut [y.clone()], None));
    assert!(e.contains("matmul.inputs") && e.contains("got 1 tensors, expected 2 (x, weight)"), "{e}");
    let bad_x = be.alloc(DType::F32, &[2, 7]).unwrap();
    let e = err_text(op.execute(&[bad_x, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.x") && e.contains("shape [2, 7]: expected [*, 8]"), "{e}");
    let f16_x = be.alloc(DType::F16, &[2, 8]).unwrap();
    let e = err_text(op.execute(&[f16_x, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.x") && e.contains("dtype f16: expected f32"), "{e}");
    let e = err_text(op.execute(&[x.clone(), w.clone()], &mut [be.alloc(DType::F32, &[3, 4]).unwrap()], None));
    assert!(e.contains("matmul.y") && e.contains("expected [2, 4]"), "{e}");
    // A weight where a buffer belongs, and the other way round.
    let wx = be.upload_weight(DType::F32, &[2, 8], vec![0u8; 2 * 8 * 4]).unwrap();
    let e = err_text(op.execute(&[wx, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("`matmul.x`: is a weight; a buffer (alloc) is needed here"), "{e}");
    let e = err_text(op.execute(&[x.clone(), x.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.weight") && e.contains("expected [4, 8]"), "{e}");
    let xb = be.alloc(DType::F32, &[4, 8]).unwrap();
    let e = err_text(op.execute(&[x.clone(), xb], &mut [y.clone()], None));
    assert!(e.contains("`matmul.weight`: is a buffer; a weight (upload_weight) is needed here"), "{e}");
    // Non-contiguous strides: named with the stride.
    let mut strided = x.clone();
    strided.strides = vec![16, 1];
    let e = err_text(op.execute(&[strided, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.x") && e.contains("stride 16 of dimension 0 is not the contiguous 8"), "{e}");
    // A buffer too small for the shape it claims.
    let Mem::Buffer { buf, .. } = x.mem else { unreachable!() };
    let past = TensorRef::new(Mem::Buffer { buf, offset: 4 }, DType::F32, &[2, 8]);
    let e = err_text(op.execute(&[past, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.x") && e.contains("run past its buffer"), "{e}");
    // A freed buffer.
    let gone = be.alloc(DType::F32, &[2, 8]).unwrap();
    be.free(&gone).unwrap();
    let e = err_text(op.execute(&[gone, w.clone()], &mut [y.clone()], None));
    assert!(e.contains("matmul.x") && e.contains("not live"), "{e}");
    // Zero-sized params are refused at creation.
    let zero = MatMulParams { n: 0, ..p };
    let e = Operation::new(&be, OpParams::MatMul(zero)).err().expect("n = 0 is refused").to_string();
    assert!(e.contains("matmul.n") && e.contains("positive"), "{e}");

    // Embedding ids out of range, attention tables out of range: errors, not wild reads.
    let ep = EmbedParams { table: DType::F32, vocab: 4, hidden: 8, act: DType::F32 };
    let emb = Operation::new(&be, OpParams::Embed(ep)).unwrap();
    let table = be.upload_weight(DType::F32, &[4, 8], vec![0u8; 4 * 8 * 4]).unwrap();
    let ids = be.alloc(DType::U32, &[2]).unwrap();
    be.write_u32(&ids, &[1, 4]).unwrap();
    let e = err_text(emb.execute(&[ids, table], &mut [be.alloc(DType::F32, &[2, 8]).unwrap()], None));
    assert!(e.contains("embed.ids") && e.contains("ids[1] = 4 is not below vocab 4"), "{e}");

    let ap = AttentionParams {
        kind: AttnKind::Flash,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        scale: None,
        block_size: 4,
        kv_dtype: DType::F32,
        max_context: 64,
        act: DType::F32,
        tile_kv: None,
    };
    let att = Operation::new(&be, OpParams::Attention(ap)).unwrap();
    let q = be.alloc(DType::F32, &[2, 32]).unwrap();
    let k = be.alloc(DType::F32, &[3, 4, 1, 16]).unwrap();
    let v = be.alloc(DType::F32, &[3, 4, 1, 16]).unwrap();
    let seqs = be.alloc(DType::U32, &[1, 3]).unwrap();
    be.write_u32(&seqs, &[0, 2, 6]).unwrap();
    let bt = be.alloc(DType::U32, &[1, 2]).unwrap();
    be.write_u32(&bt, &[0, 3]).unwrap();
    let out = be.alloc(DType::F32, &[2, 32]).unwrap();
    let e =
        err_text(att.execute(&[q.clone(), k.clone(), v.clone(), seqs.clone(), bt.clone()], &mut [out.clone()], None));
    assert!(e.contains("flash_attention.block_tables") && e.contains("names block 3; the pools have 3 blocks"), "{e}");
    be.write_u32(&seqs, &[0, 2, 9]).unwrap();
    be.write_u32(&bt, &[0, 2]).unwrap();
    let e = err_text(att.execute(&[q, k, v, seqs, bt], &mut [out], None));
    assert!(e.contains("flash_attention.seqs") && e.contains("do not fit"), "{e}");
}

/// FlashAttention's KV tile through the API: every accepted `tile_kv` equals the reference on
/// contexts spanning many tiles (prefill rows that start mid-tile, decode rows), the default
/// is bit-identical to `tile_kv = 64`, and a value outside the accepted set is an error naming
/// the op, the parameter and the accepted values.
#[test]
fn flash_attention_tile_kv_is_a_parameter() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let be = OpBackend::new(Box::new(CpuBackend::new(2).unwrap()));
    let b = B { label: "cpu".into(), be: be.clone(), act: DType::F32 };
    let mut rng = Rng::new(7);
    let (heads, kv_heads, head_dim, block_size, blocks, max_blocks) = (4, 2, 64, 16, 48, 24);
    let pool_len = blocks * block_size * kv_heads * head_dim;
    let (k, kh) = b.acts(&[blocks, block_size, kv_heads, head_dim], &rng.vec(pool_len, 1.0));
    let (v, vh) = b.acts(&[blocks, block_size, kv_heads, head_dim], &rng.vec(pool_len, 1.0));
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    order.reverse();
    for kind in [AttnKind::Flash, AttnKind::PagedDecode] {
        // 377 = 5 tiles of 64 and a partial one; rows start at position 300 (mid-tile).
        let seqs: Vec<[u32; 3]> =
            if kind == AttnKind::Flash { vec![[0, 40, 40], [40, 77, 377]] } else { vec![[0, 1, 377], [1, 1, 129]] };
        let rows: usize = seqs.iter().map(|s| s[1] as usize).sum();
        let bt: Vec<u32> = (0..seqs.len()).flat_map(|i| order[i * max_blocks..(i + 1) * max_blocks].to_vec()).collect();
        let (q, qv) = b.acts(&[rows, heads * head_dim], &rng.vec(rows * heads * head_dim, 1.0));
        let st = b.u32s(&[seqs.len(), 3], seqs.as_flattened());
        let btt = b.u32s(&[seqs.len(), max_blocks], &bt);
        let (kb, vb) = (encode(DType::F32, &kh), encode(DType::F32, &vh));
        let pool = KvPool { dtype: DType::F32, block_size, kv_heads, head_dim, k: &kb, v: &vb };
        let spans = spans_of(&seqs, &bt, max_blocks);
        let want = attn_ref::attention(&qv, &pool, &spans, &AttnParams::new(heads, kv_heads, head_dim, 0.125));
        let mut outs = Vec::new();
        for tile in [None, Some(16), Some(32), Some(64), Some(128), Some(256)] {
            let p = AttentionParams {
                kind,
                heads,
                kv_heads,
                head_dim,
                scale: Some(0.125),
                block_size,
                kv_dtype: DType::F32,
                max_context: 4096,
                act: DType::F32,
                tile_kv: tile,
            };
            let op = Operation::new(&be, OpParams::Attention(p)).unwrap();
            op.supports().unwrap();
            let out = b.out(&[rows, heads * head_dim]);
            let ins = [q.clone(), k.clone(), v.clone(), st.clone(), btt.clone()];
            op.execute(&ins, &mut [out.clone()], None).unwrap();
            let got = b.get(&out);
            // As the attention test: a convex combination of |v| <= 1 rows; the online
            // softmax rescales once per tile (at most 24 tiles of 16 here), a few roundings each.
            let tol = (head_dim as f64).sqrt() * 8.0 * U + 64.0 * 8.0 * U + 24.0 * 4.0 * U;
            close(&format!("[cpu] {} tile_kv={tile:?}", kind.name()), &got, &want, |_| tol);
            outs.push(got);
        }
        assert_eq!(outs[0], outs[3], "{}: the default tile is tile_kv = 64, bit for bit", kind.name());
    }
    // Refused values, named with the op, the parameter and what it takes.
    let tiled = |kind, tile| AttentionParams {
        kind,
        heads,
        kv_heads,
        head_dim,
        scale: None,
        block_size,
        kv_dtype: DType::F32,
        max_context: 4096,
        act: DType::F32,
        tile_kv: Some(tile),
    };
    for bad in [0usize, 8, 48, 512] {
        let p = tiled(AttnKind::Flash, bad);
        let e = Operation::new(&be, OpParams::Attention(p)).err().expect("refused").to_string();
        assert_eq!(
            e,
            format!(
                "invalid argument `flash_attention.tile_kv`: {bad} is not a power of two in 16..=256 (accepted: 16, \
                 32, 64, 128, 256)"
            )
        );
    }
    let p = tiled(AttnKind::Standard, 128);
    let e = Operation::new(&be, OpParams::Attention(p)).err().expect("refused").to_string();
    assert!(e.contains("standard_attention.tile_kv") && e.contains("no KV tile"), "{e}");
}

/// `x · wᵀ` (or the fused `silu(x · gateᵀ) * (x · upᵀ)` when `up` is given) through one
/// operation with `tiling`, on `m` rows of `x`.
fn run_matmul(
    be: &OpBackend,
    p: MatMulParams,
    swiglu: bool,
    ws: &[TensorRef],
    x: &TensorRef,
) -> Result<Vec<f32>, tboost_ops::Unsupported> {
    let params = if swiglu { OpParams::MatMulSwiGlu(p) } else { OpParams::MatMul(p) };
    let op = Operation::new(be, params).unwrap();
    op.supports()?;
    let y = be.alloc(DType::F32, &[x.shape[0], p.n]).unwrap();
    let mut ins = vec![x.clone()];
    ins.extend_from_slice(ws);
    op.execute(&ins, &mut [y.clone()], None).unwrap();
    Ok(be.read_f32(&y).unwrap())
}

/// The work-split tunables through the operator API. Out of range: an error at creation naming
/// the op, the parameter and the accepted range (each tunable of matmul, matmul_swiglu and
/// moe_grouped). In range, on the CPU: the default's bits for every weight type tried, both
/// precisions, decode and prefill rows — except where the bf16 kernels of fast precision run
/// (bf16 weights; f16 ones where AMX-BF16 splits them),
/// which `supports` refuses with its reason (they keep their own split). On a backend whose
/// kernels tile themselves (Ascend on the simulator), `supports` refuses with the reason and
/// `execute` is `Unsupported`.
#[test]
fn tiling_tunables_are_range_checked_and_change_no_bit() {
    use tboost_engine::backend::{MatMulTiling, MoeTiling};
    let cpu = OpBackend::new(Box::new(CpuBackend::new(2).unwrap()));
    let mm = |tiling| MatMulParams {
        weight: DType::F32,
        n: 48,
        k: 64,
        bias: false,
        precision: Precision::Exact,
        act: DType::F32,
        tiling,
    };
    let refuse = |p: OpParams| Operation::new(&cpu, p).err().expect("refused at creation").to_string();
    let d = MatMulTiling::default();
    for (t, text) in [
        (MatMulTiling { panel_rows: Some(20), ..d }, "panel_rows`: 20 is not a multiple of 16 in 16..=4096"),
        (MatMulTiling { panel_rows: Some(8192), ..d }, "panel_rows`: 8192 is not a multiple of 16 in 16..=4096"),
        (MatMulTiling { act_rows: Some(0), ..d }, "act_rows`: 0 is not in 1..=65536"),
        (MatMulTiling { tasks_per_thread: Some(65), ..d }, "tasks_per_thread`: 65 is not in 1..=64"),
        (
            MatMulTiling { decode_task_min_bytes: Some(1000), ..d },
            "decode_task_min_bytes`: 1000 is not a multiple of 1024 in 4096..=16777216",
        ),
    ] {
        assert_eq!(refuse(OpParams::MatMul(mm(t))), format!("invalid argument `matmul.{text}"));
        assert_eq!(refuse(OpParams::MatMulSwiGlu(mm(t))), format!("invalid argument `matmul_swiglu.{text}"));
    }
    let moe = |tiling| MoeGroupedParams {
        experts: 4,
        top_k: 2,
        hidden: 64,
        inter: 96,
        weight: DType::F32,
        act: DType::F32,
        tiling,
    };
    for (t, text) in [
        (
            MoeTiling { expert_batch_tokens: Some(0), ..Default::default() },
            "expert_batch_tokens`: 0 is not in 1..=65536",
        ),
        (
            MoeTiling { parallel_expert_batches: Some(65), ..Default::default() },
            "parallel_expert_batches`: 65 is not in 1..=64",
        ),
    ] {
        assert_eq!(refuse(OpParams::MoeGrouped(moe(t))), format!("invalid argument `moe_grouped.{text}"));
    }

    // In range on the CPU: the default's bits.
    let tilings = [
        MatMulTiling {
            panel_rows: Some(16),
            act_rows: Some(1),
            tasks_per_thread: Some(1),
            decode_task_min_bytes: Some(4096),
        },
        MatMulTiling { panel_rows: Some(32), act_rows: Some(7), ..d },
        MatMulTiling { panel_rows: Some(4096), act_rows: Some(65536), tasks_per_thread: Some(64), ..d },
    ];
    let mut rng = Rng::new(9);
    let (n, k) = (48, 256);
    let (mut bf16_refusals, mut cases) = (0, 0);
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q8_0, DType::Q4K, DType::Q6K] {
        let w: Vec<TensorRef> =
            (0..2).map(|_| cpu.upload_weight(dtype, &[n, k], encode(dtype, &rng.vec(n * k, 0.5))).unwrap()).collect();
        for precision in [Precision::Exact, Precision::Fast] {
            for m in [1, 9, 40] {
                let x = cpu.alloc(DType::F32, &[m, k]).unwrap();
                cpu.write_f32(&x, &rng.vec(m * k, 1.0)).unwrap();
                for swiglu in [false, true] {
                    let p = MatMulParams { weight: dtype, n, k, bias: false, precision, act: DType::F32, tiling: d };
                    let ws = if swiglu { &w[..] } else { &w[..1] };
                    // Fast precision on f32/f16 weights is no case of the CPU (`supports` says why).
                    let Ok(want) = run_matmul(&cpu, p, swiglu, ws, &x) else { continue };
                    cases += 1;
                    for t in tilings {
                        let case = format!("{dtype} {} m={m} swiglu={swiglu} {t:?}", precision.name());
                        match run_matmul(&cpu, MatMulParams { tiling: t, ..p }, swiglu, ws, &x) {
                            Ok(got) => {
                                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(same, "{case}: other bits than the default tiling");
                            }
                            Err(why) => {
                                // Only the bf16 kernels of fast precision (on bf16 weights, and
                                // on f16 ones with AMX-BF16) keep their own split.
                                let bf16_kernel = dtype == DType::BF16 || dtype == DType::F16;
                                assert!(bf16_kernel && precision == Precision::Fast, "{case}: refused: {why}");
                                let need = format!("the default (unset) for {dtype} weights at fast precision: the");
                                assert!(why.to_string().contains(&need), "{case}: {why}");
                                bf16_refusals += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("op_api tiling: {cases} cases x 3 tilings; {bf16_refusals} bf16 fast refusals (0 without a bf16 kernel)");
    // Every type in exact precision and the block types in fast, plain and fused, 3 row counts.
    assert!(cases >= (7 + 4) * 2 * 3, "only {cases} matmul cases ran");

    let (m, experts, top_k, hidden, inter) = (24, 4, 2, 64, 96);
    for dtype in [DType::F32, DType::Q8_0] {
        let x = cpu.alloc(DType::F32, &[m, hidden]).unwrap();
        cpu.write_f32(&x, &rng.vec(m * hidden, 1.0)).unwrap();
        let ids = cpu.alloc(DType::U32, &[m, top_k]).unwrap();
        cpu.write_u32(&ids, &(0..m * top_k).map(|i| ((i * 7 + i / 2) % experts) as u32).collect::<Vec<_>>()).unwrap();
        let wts = cpu.alloc(DType::F32, &[m, top_k]).unwrap();
        cpu.write_f32(&wts, &rng.vec(m * top_k, 1.0)).unwrap();
        let mut ins = vec![x, ids, wts];
        for _ in 0..experts {
            for shape in [[inter, hidden], [inter, hidden], [hidden, inter]] {
                let v = rng.vec(shape[0] * shape[1], 0.3);
                ins.push(cpu.upload_weight(dtype, &shape, encode(dtype, &v)).unwrap());
            }
        }
        let run = |tiling| {
            let op =
                Operation::new(&cpu, OpParams::MoeGrouped(MoeGroupedParams { weight: dtype, ..moe(tiling) })).unwrap();
            op.supports().unwrap();
            let y = cpu.alloc(DType::F32, &[m, hidden]).unwrap();
            op.execute(&ins, &mut [y.clone()], None).unwrap();
            cpu.read_f32(&y).unwrap()
        };
        let want = run(MoeTiling::default());
        for t in [
            MoeTiling { expert_batch_tokens: Some(1), parallel_expert_batches: Some(3) },
            MoeTiling { expert_batch_tokens: Some(5), parallel_expert_batches: None },
            MoeTiling { expert_batch_tokens: None, parallel_expert_batches: Some(64) },
        ] {
            let got = run(t);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "moe_grouped {dtype} {t:?}");
        }
    }

    // A backend whose kernels tile themselves takes only the defaults, and says so.
    each_backend(|b| {
        if b.label == "cpu" {
            return;
        }
        let t = MatMulTiling { panel_rows: Some(32), ..d };
        let p = MatMulParams { weight: b.act, act: b.act, ..mm(t) };
        let op = Operation::new(&b.be, OpParams::MatMul(p)).unwrap();
        let why = op.supports().expect_err("refused").to_string();
        let need = "panel_rows=32 is not the default (unset) on ascend, whose kernels choose their own tiling";
        assert_eq!(why, need, "[{}]", b.label);
        let x = b.out(&[2, 64]);
        let w = b.weight(b.act, &[48, 64], &vec![0.0; 48 * 64]).0;
        let e = err_text(op.execute(&[x, w], &mut [b.out(&[2, 48])], None));
        assert_eq!(e, format!("unsupported: matmul on ascend: {need}"), "[{}]", b.label);
        let op = Operation::new(&b.be, OpParams::MatMulSwiGlu(p)).unwrap();
        assert_eq!(op.supports().expect_err("refused").to_string(), need, "[{}]", b.label);
        let t = MoeTiling { expert_batch_tokens: Some(4), ..Default::default() };
        let p = MoeGroupedParams { weight: b.act, act: b.act, ..moe(t) };
        let why = Operation::new(&b.be, OpParams::MoeGrouped(p)).unwrap().supports().expect_err("refused");
        let need = "expert_batch_tokens=4 is not the default (unset) on ascend, whose kernels choose their own tiling";
        assert_eq!(why.to_string(), need, "[{}]", b.label);
    });
}
