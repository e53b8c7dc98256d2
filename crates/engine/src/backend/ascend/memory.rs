//! Device memory of the Ascend backend: the orchestrator's buffers (`BufId`), the weights
//! (`WeightId`), the backend's own scratch and constants, and the rule that nothing queued work
//! may still read is freed before the stream ran it (freed buffers wait in `retired` until the
//! next synchronize).
//!
//! Every allocation is an `aclrtMalloc` through `ascend_sys::Device` (`DeviceBuffer` frees on
//! drop). Views become `TensorRef`s here, bounds-checked against the view *and* the buffer, so an
//! op never builds an aclTensor that reaches outside what the orchestrator named.
//!
//! Index buffers: the orchestrator's `u32` buffers (token ids, positions, slots, block tables,
//! logit rows, expert ids) are handed to aclnn as `INT32` tensors — the same bytes for every id
//! below 2^31, which `set_step` checks for the step arrays. `u32::MAX` (an unused block-table
//! entry) reads as -1, ATB's "no block" marker.
//!
//! Copies between device buffers go through [`Memory::copy`]: `aclrtMemcpyAsync` requires both
//! addresses 64-byte aligned ("The source address and destination address passed to this call must
//! be 64-byte aligned", aclrtMemcpyAsync in the CANN 8.0.0 API reference,
//! https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0106.html),
//! and views sit at any element offset, so a copy at an unaligned address runs as a kernel instead.

use std::collections::HashMap;

use ascend_sys::{aclnn, Context, DType as Acl, Device, DeviceBuffer, TensorRef};
use tboost_ops::DType;

use super::supports::{quant_kept, quant_layout, QUANT_GROUP};
use super::{acl_err, be_err};
use crate::backend::{BufId, View, WeightId};
use crate::model::Tensor;
use crate::Result;
use tboost_kernels::gemm::quant::affine_group;

/// The aclnn element type of a buffer of `d` (u32 index buffers as INT32: see the module docs).
pub(super) fn acl_dtype(d: DType) -> Result<Acl> {
    Ok(match d {
        DType::F32 => Acl::F32,
        DType::F16 => Acl::F16,
        DType::BF16 => Acl::Bf16,
        DType::I64 => Acl::I64,
        DType::I32 | DType::U32 => Acl::I32,
        DType::I8 => Acl::I8,
        DType::U8 => Acl::U8,
        q => return Err(be_err(format!("{q} is a GGUF block type: aclnn has no tensor of it"))),
    })
}

/// One orchestrator buffer.
pub(super) struct DevBuf {
    pub buf: DeviceBuffer,
    pub dtype: DType,
    pub len: usize,
}

/// Where a weight lives: a byte range of one of the weight stores (experts of an MoE layer are
/// moved into one stacked store at their first grouped use).
#[derive(Clone, Debug)]
pub(super) struct Weight {
    pub store: usize,
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub numel: usize,
    pub name: String,
    /// A GGUF block type kept quantized (INT8 or INT4 `[rows, cols]`, see [`repack_quant`]): the byte
    /// offset in the same store of its f16 scales `[rows, cols / 32]`.
    pub scales: Option<usize>,
    /// Of a kept type with mins: the byte offset of its f16 antiquant offsets, shaped as the scales.
    pub offsets: Option<usize>,
}

/// A GGUF weight repacked for aclnnWeightQuantBatchMatmulV2 ([`repack_quant`]): the values, then the
/// per-group f16 scales `[rows, cols / 32]` at `scales`, then (types with mins) the per-group f16
/// antiquant offsets `[rows, cols / 32]` at `offsets`.
pub(super) struct Repacked {
    pub bytes: Vec<u8>,
    pub scales: usize,
    pub offsets: Option<usize>,
}

/// Repacks GGUF rows for aclnnWeightQuantBatchMatmulV2, whose weight is `(w + offset) · scale` per
/// group of 32 (`supports::quant_layout` says INT4 or INT8 and whether there is an offset). A group
/// `value = a · w − m` (`affine_group`) becomes `w' = w − c` in the signed range, `scale = a` and
/// `offset = c − m / a` (c = 8 for 4-bit and 16 for 5-bit unsigned values, 0 for the signed types,
/// which need no offset). Q8_0 and Q4_0 keep their bytes (their scales are the file's f16); a group
/// whose `a` is 0 (every value `−m`) stores `w' = 0`, `scale = −m`, `offset = 1`. INT4 holds element
/// 2i in the low nibble of byte i.
pub(super) fn repack_quant(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Result<Repacked> {
    let (int4, with_offset) =
        quant_layout(dtype).ok_or_else(|| be_err(format!("repack: {dtype} is not kept quantized on Ascend")))?;
    let row_bytes = dtype.bytes_for(cols).filter(|_| cols.is_multiple_of(QUANT_GROUP));
    if row_bytes.map(|rb| rb * rows) != Some(bytes.len()) {
        return Err(be_err(format!("repack {dtype}: {} bytes for {rows} x {cols} values", bytes.len())));
    }
    let (row_bytes, groups) = (row_bytes.unwrap_or(0), cols / QUANT_GROUP);
    let qbytes = if int4 { rows * cols / 2 } else { rows * cols };
    let n = rows * groups;
    let mut out = vec![0u8; qbytes + 2 * n * if with_offset { 2 } else { 1 }];
    let (q, rest) = out.split_at_mut(qbytes);
    let (sc, of) = rest.split_at_mut(2 * n);
    let c = match (with_offset, int4) {
        (false, _) => 0,
        (true, true) => 8,
        (true, false) => 16,
    };
    for r in 0..rows {
        let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
        for g in 0..groups {
            let (a, m, w) = affine_group(dtype, row, g)
                .ok_or_else(|| be_err(format!("repack: {dtype} has no per-group scale and min")))?;
            let mut wq = w.map(|v| v - c);
            let (mut scale, mut offset) = (a, c as f32 - m / a);
            if with_offset && (a == 0.0 || !offset.is_finite()) {
                wq = [0; 32];
                (scale, offset) = if m == 0.0 { (0.0, 0.0) } else { (-m, 1.0) };
            }
            let at = 2 * (r * groups + g);
            sc[at..at + 2].copy_from_slice(&half::f16::from_f32(scale).to_le_bytes());
            if with_offset {
                of[at..at + 2].copy_from_slice(&half::f16::from_f32(offset).to_le_bytes());
            }
            let base = r * cols + g * QUANT_GROUP;
            if int4 {
                for i in 0..QUANT_GROUP / 2 {
                    q[base / 2 + i] = (wq[2 * i] as u8 & 0xf) | ((wq[2 * i + 1] as u8 & 0xf) << 4);
                }
            } else {
                for (d, v) in q[base..base + QUANT_GROUP].iter_mut().zip(wq) {
                    *d = v as u8;
                }
            }
        }
    }
    Ok(Repacked { bytes: out, scales: qbytes, offsets: with_offset.then_some(qbytes + 2 * n) })
}

/// What aclnnWeightQuantBatchMatmulV2 takes of a kept weight ([`Memory::quant_operands`]).
pub(super) struct QuantOperands<'m> {
    pub weight: TensorRef<'m>,
    pub scales: TensorRef<'m>,
    pub offsets: Option<TensorRef<'m>>,
}

/// An MoE layer's experts stacked for GroupedMatmul: `gate_up` is `[experts, 2·inter, hidden]`
/// (expert e's gate rows, then its up rows), `down` is `[experts, hidden, inter]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct MoeStack {
    pub gate_up: usize,
    pub down: usize,
    pub experts: usize,
    pub inter: usize,
    pub hidden: usize,
    pub dtype: DType,
}

/// The backend's own working buffers, one per purpose, grown on demand and reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Scratch {
    Rstd,
    NormOut,
    RopeCos,
    RopeSin,
    RopeOut,
    GateUp,
    RouteLogits,
    RouteProbs,
    RouteRowIdx,
    RouteSum,
    RouteNorm,
    MoeExpanded,
    MoeRowIdx,
    MoeCounts,
    MoeCounts64,
    MoeGateUp,
    MoeAct,
    MoeDown,
    /// A decode run's sliding-window mask (UINT8).
    AttnMask,
    /// The embedding scale as a one-element tensor.
    EmbedScale,
    /// An op's output before it is copied over its input (no output aliases an input).
    InPlace,
    /// GELU of the gate (GeGLU).
    GeluOut,
}

/// Constants made once: the 2048×2048 causal mask FIA's sparse mode 3 takes, zeros for
/// broadcast copies, ones for row sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Const {
    CausalMask,
    Zeros,
    OnesF32,
}

pub(super) const MASK_SIDE: usize = 2048;
const ZEROS_BYTES: usize = 64;
/// aclrtMemcpyAsync's address alignment (see the module docs).
pub(super) const D2D_ALIGN: usize = 64;
const ONES: usize = 1024;

pub(super) struct Memory {
    dev: Device,
    bufs: Vec<Option<DevBuf>>,
    free_ids: Vec<u32>,
    allocated: usize,
    weights: Vec<Weight>,
    stores: Vec<Option<DeviceBuffer>>,
    /// Weights in another dtype, made once on the device (`aclnnCast`): biases as stored in the
    /// file meeting f16/bf16 activations.
    casts: HashMap<(u32, DType), Weight>,
    /// The bf16 copy (a store) of a quantized weight's f16 scales, and of its offsets, made at its
    /// first bf16 use.
    scale_casts: HashMap<u32, usize>,
    offset_casts: HashMap<u32, usize>,
    /// Device bytes of the uploaded weights per stored dtype, in first-upload order.
    weight_bytes: Vec<(DType, usize)>,
    stacks: HashMap<u32, MoeStack>,
    scratch: HashMap<Scratch, DeviceBuffer>,
    consts: HashMap<Const, DeviceBuffer>,
    /// Small f32 weights the host computes with (LongRoPE's factors for the host RoPE tables),
    /// read back once.
    host_f32: HashMap<u32, Vec<f32>>,
    /// Buffers freed while queued work may still use them; dropped after the next synchronize.
    retired: Vec<DeviceBuffer>,
}

impl Memory {
    pub fn new(dev: &Device) -> Memory {
        Memory {
            dev: dev.clone(),
            bufs: Vec::new(),
            free_ids: Vec::new(),
            allocated: 0,
            weights: Vec::new(),
            stores: Vec::new(),
            casts: HashMap::new(),
            scale_casts: HashMap::new(),
            offset_casts: HashMap::new(),
            weight_bytes: Vec::new(),
            stacks: HashMap::new(),
            scratch: HashMap::new(),
            consts: HashMap::new(),
            host_f32: HashMap::new(),
            retired: Vec::new(),
        }
    }

    fn malloc(&self, what: &str, bytes: usize) -> Result<DeviceBuffer> {
        self.dev.alloc(bytes.max(1)).map_err(|e| acl_err(&format!("{what} ({bytes} bytes)"), e))
    }

    // ------------------------------------------------------------------ orchestrator buffers

    pub fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId> {
        let bytes = dtype
            .bytes_for(len)
            .ok_or_else(|| be_err(format!("alloc: {len} elements are not whole {dtype} blocks")))?;
        let buf = self.malloc(&format!("alloc of {len} x {dtype}"), bytes)?;
        // The trait promises zeros (a fresh allocation holds whatever the device had).
        buf.fill_bytes(0).map_err(|e| acl_err("alloc: zero-fill", e))?;
        self.allocated += bytes;
        let b = DevBuf { buf, dtype, len };
        Ok(BufId(match self.free_ids.pop() {
            Some(id) => {
                self.bufs[id as usize] = Some(b);
                id
            }
            None => {
                self.bufs.push(Some(b));
                (self.bufs.len() - 1) as u32
            }
        }))
    }

    pub fn free(&mut self, id: BufId) {
        if let Some(b) = self.bufs.get_mut(id.0 as usize).and_then(Option::take) {
            self.allocated -= b.dtype.bytes_for(b.len).unwrap_or(0);
            self.free_ids.push(id.0);
            self.retired.push(b.buf);
        }
    }

    pub fn allocated(&self) -> usize {
        self.allocated
    }

    pub fn buffer(&self, id: BufId) -> Option<(DType, usize)> {
        self.bufs.get(id.0 as usize).and_then(|b| b.as_ref()).map(|b| (b.dtype, b.len))
    }

    pub fn buf(&self, id: BufId) -> Result<&DevBuf> {
        self.bufs.get(id.0 as usize).and_then(|b| b.as_ref()).ok_or_else(|| be_err(format!("unknown buffer {}", id.0)))
    }

    pub fn dtype(&self, v: View) -> Result<DType> {
        Ok(self.buf(v.buf)?.dtype)
    }

    /// The view's buffer and byte range, checked.
    pub fn bytes_of(&self, v: View) -> Result<(&DeviceBuffer, usize, usize)> {
        let b = self.buf(v.buf)?;
        let end = v.offset.checked_add(v.len).filter(|&e| e <= b.len).ok_or_else(|| {
            be_err(format!("view {}+{} out of buffer {} of {} elements", v.offset, v.len, v.buf.0, b.len))
        })?;
        match (b.dtype.bytes_for(v.offset), b.dtype.bytes_for(end)) {
            (Some(s), Some(e)) => Ok((&b.buf, s, e - s)),
            _ => Err(be_err(format!("view {}+{} splits a {} block", v.offset, v.len, b.dtype))),
        }
    }

    /// The view as a contiguous tensor of `shape` (whose element count must be the view's).
    pub fn tensor(&self, v: View, shape: &[usize]) -> Result<TensorRef<'_>> {
        let n: usize = shape.iter().product();
        if n != v.len {
            return Err(be_err(format!(
                "a view of {} elements of buffer {} cannot be a {shape:?} tensor (a bug in the caller)",
                v.len, v.buf.0
            )));
        }
        let (buf, at, _) = self.bytes_of(v)?;
        let dt = acl_dtype(self.buf(v.buf)?.dtype)?;
        TensorRef::new(buf, at, dt, &i64s(shape)).map_err(|e| acl_err("tensor view", e))
    }

    // ------------------------------------------------------------------ weights

    pub fn upload_weight(&mut self, t: &Tensor) -> Result<WeightId> {
        let numel = t.numel();
        let (rows, cols) = t.rows_cols();
        let (repacked, scales, offsets) = if quant_kept(t.dtype) && cols.is_multiple_of(QUANT_GROUP) {
            let r = repack_quant(t.dtype, t.bytes(), rows, cols)
                .map_err(|e| be_err(format!("weight `{}`: {e}", t.name)))?;
            (Some(r.bytes), Some(r.scales), r.offsets)
        } else {
            (None, None, None)
        };
        let bytes = repacked.as_deref().unwrap_or(t.bytes());
        if repacked.is_none() && t.dtype.bytes_for(numel) != Some(bytes.len()) {
            return Err(be_err(format!(
                "weight `{}`: {} bytes do not hold {numel} x {}",
                t.name,
                bytes.len(),
                t.dtype
            )));
        }
        let buf = self.malloc(&format!("upload_weight `{}`", t.name), bytes.len())?;
        buf.write(0, bytes).map_err(|e| acl_err(&format!("upload_weight `{}`", t.name), e))?;
        self.stores.push(Some(buf));
        self.weights.push(Weight {
            store: self.stores.len() - 1,
            offset: 0,
            dtype: t.dtype,
            rows,
            cols,
            numel,
            name: t.name.clone(),
            scales,
            offsets,
        });
        match self.weight_bytes.iter_mut().find(|(d, _)| *d == t.dtype) {
            Some((_, b)) => *b += bytes.len(),
            None => self.weight_bytes.push((t.dtype, bytes.len())),
        }
        Ok(WeightId((self.weights.len() - 1) as u32))
    }

    pub fn weight(&self, id: WeightId) -> Result<&Weight> {
        self.weights.get(id.0 as usize).ok_or_else(|| be_err(format!("unknown weight {}", id.0)))
    }

    /// An f32 weight's values on the host, read back at first use (its store was written
    /// synchronously at upload and never changes): LongRoPE's factors, which the host RoPE
    /// tables divide the frequencies by.
    pub fn weight_host_f32(&mut self, id: WeightId) -> Result<&[f32]> {
        if !self.host_f32.contains_key(&id.0) {
            let w = self.weight(id)?;
            if w.dtype != DType::F32 {
                return Err(be_err(format!("weight `{}` is {}, not f32 (a host-side weight)", w.name, w.dtype)));
            }
            let mut v = vec![0f32; w.numel];
            self.store(w.store)?.read(w.offset, &mut v).map_err(|e| acl_err(&format!("reading `{}`", w.name), e))?;
            self.host_f32.insert(id.0, v);
        }
        Ok(self.host_f32.get(&id.0).map(Vec::as_slice).unwrap_or_default())
    }

    fn store(&self, i: usize) -> Result<&DeviceBuffer> {
        self.stores.get(i).and_then(|s| s.as_ref()).ok_or_else(|| be_err(format!("weight store {i} is gone")))
    }

    /// A weight as a contiguous tensor of `shape` (element count checked).
    pub fn weight_tensor(&self, w: &Weight, shape: &[usize]) -> Result<TensorRef<'_>> {
        if shape.iter().product::<usize>() != w.numel {
            return Err(be_err(format!("weight `{}` of {} values cannot be a {shape:?} tensor", w.name, w.numel)));
        }
        TensorRef::new(self.store(w.store)?, w.offset, acl_dtype(w.dtype)?, &i64s(shape))
            .map_err(|e| acl_err(&format!("weight `{}`", w.name), e))
    }

    /// Device bytes of the uploaded weights per stored dtype (Q8_0 / Q4_0 kept quantized count their
    /// INT8 / INT4 values and scales; one-time casts of biases or scales are not counted).
    pub fn weight_bytes(&self) -> Vec<(DType, usize)> {
        self.weight_bytes.clone()
    }

    /// Makes the scales of quantized weight `id` available in `act`: the stored f16 ones, or a bf16 copy
    /// cast on the device once (queued on `ctx`).
    pub fn ensure_quant_scales(&mut self, ctx: &mut ascend_sys::Context, id: WeightId, act: DType) -> Result<()> {
        let w = self.weight(id)?.clone();
        let at = w.scales.ok_or_else(|| be_err(format!("weight `{}` is not kept quantized", w.name)))?;
        match act {
            DType::F16 => Ok(()),
            DType::BF16 => {
                if !self.scale_casts.contains_key(&id.0) {
                    let s = self.cast_groups(ctx, &w, at, "scales")?;
                    self.scale_casts.insert(id.0, s);
                }
                if let Some(of) = w.offsets.filter(|_| !self.offset_casts.contains_key(&id.0)) {
                    let s = self.cast_groups(ctx, &w, of, "offsets")?;
                    self.offset_casts.insert(id.0, s);
                }
                Ok(())
            }
            other => Err(be_err(format!("weight `{}`: activations {other} (f16 or bf16)", w.name))),
        }
    }

    /// A bf16 copy (a new store) of the per-group f16 values at byte `at` of `w`'s store, cast on
    /// `ctx`.
    fn cast_groups(&mut self, ctx: &mut ascend_sys::Context, w: &Weight, at: usize, what: &str) -> Result<usize> {
        let len = (w.rows * (w.cols / QUANT_GROUP)) as i64;
        let buf = self.malloc(&format!("weight `{}` {what} as bf16", w.name), 2 * len as usize)?;
        self.stores.push(Some(buf));
        let s = self.stores.len() - 1;
        let what = format!("weight `{}` {what}", w.name);
        let src = TensorRef::new(self.store(w.store)?, at, Acl::F16, &[len]).map_err(|e| acl_err(&what, e))?;
        let dst = TensorRef::new(self.store(s)?, 0, Acl::Bf16, &[len]).map_err(|e| acl_err(&what, e))?;
        aclnn::cast(ctx, &src, &dst).map_err(|e| acl_err(&format!("{what} cast"), e))?;
        Ok(s)
    }

    /// A weight kept quantized as aclnnWeightQuantBatchMatmulV2 takes it: the weight `[cols, rows]` (a
    /// transposed view of the `[rows, cols]` store, INT8 or INT4), its per-group scales `[cols / 32, rows]`
    /// in `act` (a transposed view; [`Memory::ensure_quant_scales`] first) and, for a type with mins, its
    /// antiquant offsets alike.
    pub fn quant_operands(&self, id: WeightId, act: DType) -> Result<QuantOperands<'_>> {
        let w = self.weight(id)?;
        let at = w.scales.ok_or_else(|| be_err(format!("weight `{}` is not kept quantized", w.name)))?;
        let (n, k, groups) = (w.rows as i64, w.cols as i64, (w.cols / QUANT_GROUP) as i64);
        let what = format!("weight `{}`", w.name);
        let groups_of = |stored: usize, casts: &HashMap<u32, usize>| -> Result<TensorRef<'_>> {
            let (store, at) = match act {
                DType::BF16 => {
                    let s = casts.get(&id.0).ok_or_else(|| {
                        be_err(format!("weight `{}`: bf16 scales not made (a bug in the caller)", w.name))
                    })?;
                    (*s, 0)
                }
                _ => (w.store, stored),
            };
            TensorRef::new(self.store(store)?, at, acl_dtype(act)?, &[n, groups])
                .and_then(|t| t.transpose(0, 1))
                .map_err(|e| acl_err(&what, e))
        };
        let (int4, _) = quant_layout(w.dtype).ok_or_else(|| be_err(format!("{what}: {} is not kept", w.dtype)))?;
        let qt = if int4 { Acl::I4 } else { Acl::I8 };
        let weight = TensorRef::new(self.store(w.store)?, w.offset, qt, &[n, k])
            .and_then(|t| t.transpose(0, 1))
            .map_err(|e| acl_err(&what, e))?;
        let scales = groups_of(at, &self.scale_casts)?;
        let offsets = w.offsets.map(|of| groups_of(of, &self.offset_casts)).transpose()?;
        Ok(QuantOperands { weight, scales, offsets })
    }

    /// `id` in `dtype`: itself, or a copy cast on the device once (queued on `ctx`).
    pub fn weight_as(&mut self, ctx: &mut ascend_sys::Context, id: WeightId, dtype: DType) -> Result<Weight> {
        let w = self.weight(id)?.clone();
        if w.dtype == dtype {
            return Ok(w);
        }
        if let Some(c) = self.casts.get(&(id.0, dtype)) {
            return Ok(c.clone());
        }
        if !w.dtype.is_float() || !dtype.is_float() {
            return Err(be_err(format!("weight `{}`: cannot cast {} to {dtype} on the device", w.name, w.dtype)));
        }
        let bytes = dtype.bytes_for(w.numel).unwrap_or(0);
        let buf = self.malloc(&format!("weight `{}` as {dtype}", w.name), bytes)?;
        self.stores.push(Some(buf));
        let c = Weight { store: self.stores.len() - 1, offset: 0, dtype, ..w.clone() };
        {
            let src = self.weight_tensor(&w, &[w.numel])?;
            let dst = self.weight_tensor(&c, &[c.numel])?;
            ascend_sys::aclnn::cast(ctx, &src, &dst).map_err(|e| acl_err(&format!("weight `{}` cast", w.name), e))?;
        }
        self.casts.insert((id.0, dtype), c.clone());
        Ok(c)
    }

    /// The experts of `first..first + 3·count` stacked for GroupedMatmul (made at the first call:
    /// device-to-device copies queued on `ctx`, after which the experts' ids name the stack and
    /// their own stores are freed after the next synchronize).
    pub fn moe_stack(&mut self, ctx: &mut ascend_sys::Context, first: WeightId, count: usize) -> Result<MoeStack> {
        if let Some(s) = self.stacks.get(&first.0) {
            if s.experts == count {
                return Ok(*s);
            }
        }
        let ids = |e: usize| (first.0 as usize + 3 * e, first.0 as usize + 3 * e + 1, first.0 as usize + 3 * e + 2);
        let (g0, _, d0) = ids(0);
        let (gw, dw) = (self.weight(WeightId(g0 as u32))?.clone(), self.weight(WeightId(d0 as u32))?.clone());
        let (inter, hidden, dtype) = (gw.rows, gw.cols, gw.dtype);
        let esz = dtype.block_bytes();
        if dtype.block_elems() != 1 || (dw.rows, dw.cols) != (hidden, inter) {
            return Err(be_err(format!(
                "moe: expert weights {} {}x{} / down {}x{} cannot be stacked",
                dtype, gw.rows, gw.cols, dw.rows, dw.cols
            )));
        }
        for e in 0..count {
            let (g, u, d) = ids(e);
            for (i, want) in [(g, (inter, hidden)), (u, (inter, hidden)), (d, (hidden, inter))] {
                let w = self.weight(WeightId(i as u32))?;
                if (w.rows, w.cols) != want || w.dtype != dtype {
                    return Err(be_err(format!(
                        "moe: expert {e} weight `{}` is {} {}x{}, the layer's experts are {dtype} {}x{}",
                        w.name, w.dtype, w.rows, w.cols, want.0, want.1
                    )));
                }
            }
        }
        let mat = inter * hidden * esz;
        self.ensure_const(Const::Zeros)?;
        let gu = self.malloc("moe gate/up stack", count * 2 * mat)?;
        let dn = self.malloc("moe down stack", count * mat)?;
        for e in 0..count {
            let (g, u, d) = ids(e);
            for (i, dst, at) in [(g, &gu, 2 * e * mat), (u, &gu, (2 * e + 1) * mat), (d, &dn, e * mat)] {
                let w = &self.weights[i];
                let src = self.store(w.store)?;
                // every store lives until after the next synchronize (retired, not dropped)
                self.copy(ctx, dtype, (src, w.offset), (dst, at), mat, "moe: stacking expert weights")?;
            }
        }
        self.stores.push(Some(gu));
        self.stores.push(Some(dn));
        let (gs, ds) = (self.stores.len() - 2, self.stores.len() - 1);
        for e in 0..count {
            let (g, u, d) = ids(e);
            for (i, store, at) in [(g, gs, 2 * e * mat), (u, gs, (2 * e + 1) * mat), (d, ds, e * mat)] {
                let old = self.weights[i].store;
                self.weights[i].store = store;
                self.weights[i].offset = at;
                if !self.weights.iter().any(|w| w.store == old) {
                    if let Some(b) = self.stores[old].take() {
                        self.retired.push(b);
                    }
                }
            }
        }
        let s = MoeStack { gate_up: gs, down: ds, experts: count, inter, hidden, dtype };
        self.stacks.insert(first.0, s);
        Ok(s)
    }

    /// A stacked store as a tensor.
    pub fn store_tensor(&self, store: usize, dtype: DType, shape: &[usize]) -> Result<TensorRef<'_>> {
        TensorRef::new(self.store(store)?, 0, acl_dtype(dtype)?, &i64s(shape)).map_err(|e| acl_err("moe stack", e))
    }

    // ------------------------------------------------------------------ scratch and constants

    /// Makes scratch `s` hold at least `bytes`.
    pub fn ensure(&mut self, s: Scratch, bytes: usize) -> Result<()> {
        if self.scratch.get(&s).is_some_and(|b| b.len() >= bytes) {
            return Ok(());
        }
        let b = self.malloc(&format!("scratch {s:?}"), bytes.next_power_of_two().max(4096))?;
        if let Some(old) = self.scratch.insert(s, b) {
            self.retired.push(old); // queued work may still use it
        }
        Ok(())
    }

    /// `shape` elements of `dtype` from byte `at` of scratch `s` (ensured before).
    pub fn scratch(&self, s: Scratch, dtype: DType, at: usize, shape: &[usize]) -> Result<TensorRef<'_>> {
        let b = self.scratch.get(&s).ok_or_else(|| be_err(format!("scratch {s:?} was not made")))?;
        TensorRef::new(b, at, acl_dtype(dtype)?, &i64s(shape)).map_err(|e| acl_err(&format!("scratch {s:?}"), e))
    }

    pub fn scratch_buf(&self, s: Scratch) -> Result<&DeviceBuffer> {
        self.scratch.get(&s).ok_or_else(|| be_err(format!("scratch {s:?} was not made")))
    }

    /// Makes constant `c` (synchronous copies into fresh memory: no queued work touches it).
    pub fn ensure_const(&mut self, c: Const) -> Result<()> {
        if self.consts.contains_key(&c) {
            return Ok(());
        }
        let b = match c {
            Const::CausalMask => {
                // 1 strictly above the diagonal: key j masked out for query i when j > i
                // (ascend-sys README: sparse mode 3 with the optimized 2048x2048 mask).
                let m: Vec<u8> = (0..MASK_SIDE * MASK_SIDE).map(|i| (i % MASK_SIDE > i / MASK_SIDE) as u8).collect();
                let b = self.malloc("causal mask", m.len())?;
                b.write(0, &m).map_err(|e| acl_err("causal mask", e))?;
                b
            }
            Const::Zeros => {
                let b = self.malloc("zeros", ZEROS_BYTES)?;
                b.fill_bytes(0).map_err(|e| acl_err("zeros", e))?;
                b
            }
            Const::OnesF32 => {
                let b = self.malloc("ones", ONES * 4)?;
                b.write(0, &[1.0f32; ONES]).map_err(|e| acl_err("ones", e))?;
                b
            }
        };
        self.consts.insert(c, b);
        Ok(())
    }

    pub fn constant(&self, c: Const, dtype: DType, shape: &[usize]) -> Result<TensorRef<'_>> {
        let b = self.consts.get(&c).ok_or_else(|| be_err(format!("constant {c:?} was not made")))?;
        TensorRef::new(b, 0, acl_dtype(dtype)?, &i64s(shape)).map_err(|e| acl_err(&format!("constant {c:?}"), e))
    }

    /// Queues a copy of `bytes` bytes of `dtype` (a float type) from `src` to `dst` (buffer, byte
    /// offset): `aclrtMemcpyAsync` when both addresses are 64-byte aligned, else `aclnnAdd(src, 0)`,
    /// which copies exactly (x + 0 = x; only -0 becomes +0) at any element offset. Needs
    /// `ensure_const(Const::Zeros)` first. Both buffers must outlive the queued work.
    pub fn copy(
        &self,
        ctx: &mut Context,
        dtype: DType,
        src: (&DeviceBuffer, usize),
        dst: (&DeviceBuffer, usize),
        bytes: usize,
        what: &str,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let aligned = |b: &DeviceBuffer, at: usize| (b.as_ptr() as usize).wrapping_add(at).is_multiple_of(D2D_ALIGN);
        if aligned(src.0, src.1) && aligned(dst.0, dst.1) {
            // SAFETY: the caller keeps both buffers alive until the stream ran the copy.
            return unsafe { ctx.stream().copy_device_async(src.0, src.1, dst.0, dst.1, bytes) }
                .map_err(|e| acl_err(what, e));
        }
        let esz = dtype.block_bytes();
        if !dtype.is_float() || esz == 0 || !bytes.is_multiple_of(esz) {
            return Err(be_err(format!("{what}: {bytes} bytes of {dtype} cannot be copied by a kernel")));
        }
        let (n, adt) = ([(bytes / esz) as i64], acl_dtype(dtype)?);
        let s = TensorRef::new(src.0, src.1, adt, &n).map_err(|e| acl_err(what, e))?;
        let d = TensorRef::new(dst.0, dst.1, adt, &n).map_err(|e| acl_err(what, e))?;
        let z = self.constant(Const::Zeros, dtype, &[1])?;
        aclnn::add(ctx, &s, &z, 1.0, &d).map_err(|e| acl_err(&format!("{what} (aclnnAdd copy)"), e))
    }

    /// Drops what waited for the stream (call after a synchronize returned, whatever it returned:
    /// the stream has then run or abandoned every task).
    pub fn release_retired(&mut self) {
        self.retired.clear();
    }
}

pub(super) fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}
