//! Projections (`aclnnMm`), the fused QKV (one `aclnnMm` per segment over the same input),
//! SwiGLU (`aclnnSwiGlu`) and the fused gate/up + SwiGLU.
//!
//! Layout: `x` `[m, k]`, each weight `[n, k]` as stored (HF layout) passed as its transposed view
//! `[k, n]` (no copy), out `[m, n]`; cubeMathType KEEP_DTYPE. Weights must be in the activation
//! dtype (f16/bf16: the plan converts f32 and GGUF block types at upload), except Q8_0 / Q4_0 weights the
//! plan keeps quantized: those run through `aclnnWeightQuantBatchMatmulV2` (INT8 / INT4 weight, per-32
//! scales in the activation dtype, antiquantGroupSize 32; see `supports.rs`). A bias (stored as in the
//! file, often f32) is cast once on the device to the activation dtype and added with a broadcast
//! `aclnnInplaceAdd`.
//!
//! SwiGLU: `aclnnSwiGlu` splits its input in two halves along a dim: the gate and up results are
//! placed in the two halves of a `[2, m, inter]` scratch (dim 0), by the two matmuls themselves in
//! `MatMulSwiGlu` (one read of the scratch, no separate activation pass) or by two stream copies
//! in `SwiGlu`.
//!
//! GeGLU (Gemma 3's `gelu_pytorch_tanh`): the gate cast to FLOAT, `aclnnGeluV2(approximate = 1
//! (tanh))` in FLOAT, `aclnnMul` by up (the FLOAT × f16/bf16 pair promotes to FLOAT), `aclnnCast`
//! into the output: one rounding to the activation dtype, as the CPU's f32 GeGLU has (NN
//! `activation/gelu_v2/docs/aclnnGeluV2.md` lists FLOAT32 on every SoC that has the op).

use ascend_sys::aclnn::{self, CubeMathType, GeluApproximate};
use ascend_sys::TensorRef;
use tboost_ops::{DType, Precision};

use super::memory::{Const, Memory, Scratch};
use super::supports::{QUANT_GROUP, WQBMM};
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{Segs, View, WeightId};
use crate::Result;

fn exact(p: Precision) -> Result<()> {
    if p != Precision::Exact {
        return Err(be_err("precision fast has no aclnn path on Ascend (the plan asks exact)"));
    }
    Ok(())
}

impl AscendBackend {
    /// `out = x · wᵀ` for one weight (`x` `[m, k]`), queued.
    fn mm(&mut self, x: View, m: usize, w: WeightId, out: View, what: &str) -> Result<()> {
        let wt = self.mem.weight(w)?.clone();
        let (n, k) = (wt.rows, wt.cols);
        let act = self.mem.dtype(x)?;
        if x.len != m * k || out.len != m * n {
            return Err(be_err(format!(
                "{what}: x of {} and out of {} values do not fit m={m} and weight `{}` {n}x{k}",
                x.len, out.len, wt.name
            )));
        }
        if self.mem.dtype(out)? == act && wt.scales.is_some() {
            return self.quant_mm(w, act, |mem| Ok((mem.tensor(x, &[m, k])?, mem.tensor(out, &[m, n])?)));
        }
        if wt.dtype != act || self.mem.dtype(out)? != act {
            return Err(be_err(format!(
                "{what}: weight `{}` is {}, activations {act} (the plan converts weights at upload)",
                wt.name, wt.dtype
            )));
        }
        let (ctx, mem) = (&mut self.ctx, &self.mem);
        let wv = mem.weight_tensor(&wt, &[n, k])?.transpose(0, 1).map_err(|e| acl_err(what, e))?;
        let (xt, ot) = (mem.tensor(x, &[m, k])?, mem.tensor(out, &[m, n])?);
        aclnn::mm(ctx, &xt, &wv, &ot, CubeMathType::KeepDtype).map_err(|e| acl_err("aclnnMm", e))
    }

    /// `out = x · wᵀ` for a weight kept quantized (A16W8 / A16W4 per group of 32), queued; `x` `[m, k]`
    /// and `out` `[m, n]` are made by `views` from the memory.
    fn quant_mm(
        &mut self,
        w: WeightId,
        act: DType,
        views: impl for<'m> FnOnce(&'m Memory) -> Result<(TensorRef<'m>, TensorRef<'m>)>,
    ) -> Result<()> {
        self.mem.ensure_quant_scales(&mut self.ctx, w, act)?;
        let (ctx, mem) = (&mut self.ctx, &self.mem);
        let q = mem.quant_operands(w, act)?;
        let (xt, ot) = views(mem)?;
        aclnn::weight_quant_batch_matmul_v2(ctx, &xt, &q.weight, &q.scales, q.offsets.as_ref(), QUANT_GROUP as i32, &ot)
            .map_err(|e| acl_err(WQBMM, e))
    }

    pub(super) fn matmul(&mut self, x: View, m: usize, segs: &Segs, precision: Precision) -> Result<()> {
        exact(precision)?;
        let mut cols = None;
        for s in segs.iter() {
            let k = self.mem.weight(s.w)?.cols;
            if *cols.get_or_insert(k) != k {
                return Err(be_err("matmul: fused weights of different widths"));
            }
        }
        for s in segs.iter() {
            self.mm(x, m, s.w, s.out, "matmul")?;
            if let Some(b) = s.bias {
                let act = self.mem.dtype(s.out)?;
                let bias = self.mem.weight_as(&mut self.ctx, b, act)?;
                let n = self.mem.weight(s.w)?.rows;
                if bias.numel != n {
                    return Err(be_err(format!(
                        "matmul: bias `{}` has {} values for {n} outputs",
                        bias.name, bias.numel
                    )));
                }
                let (ctx, mem) = (&mut self.ctx, &self.mem);
                let (o, bt) = (mem.tensor(s.out, &[m, n])?, mem.weight_tensor(&bias, &[n])?);
                aclnn::inplace_add(ctx, &o, &bt, 1.0).map_err(|e| acl_err("aclnnInplaceAdd (bias)", e))?;
            }
        }
        Ok(())
    }

    /// `out = silu(h[0]) * h[1]` for the `[2, n]` scratch `h`.
    fn swiglu_halves(&mut self, n: usize, act: DType, out: View) -> Result<()> {
        let (ctx, mem) = (&mut self.ctx, &self.mem);
        let h = mem.scratch(Scratch::GateUp, act, 0, &[2, n])?;
        let o = mem.tensor(out, &[1, n])?;
        aclnn::swi_glu(ctx, &h, 0, &o).map_err(|e| acl_err("aclnnSwiGlu", e))
    }

    pub(super) fn matmul_swiglu(
        &mut self,
        x: View,
        m: usize,
        gate: WeightId,
        up: WeightId,
        out: View,
        precision: Precision,
    ) -> Result<()> {
        exact(precision)?;
        let (g, u) = (self.mem.weight(gate)?.clone(), self.mem.weight(up)?.clone());
        if (g.rows, g.cols, g.dtype) != (u.rows, u.cols, u.dtype) {
            return Err(be_err("matmul_swiglu: gate and up differ in shape or dtype"));
        }
        let (inter, act) = (g.rows, self.mem.dtype(x)?);
        let n = m * inter;
        if out.len != n || self.mem.dtype(out)? != act {
            return Err(be_err(format!("matmul_swiglu: out of {} values for m={m} x {inter}", out.len)));
        }
        self.mem.ensure(Scratch::GateUp, 2 * n * act.block_bytes())?;
        for (i, w) in [gate, up].into_iter().enumerate() {
            let wt = self.mem.weight(w)?.clone();
            if x.len != m * wt.cols || (wt.dtype != act && wt.scales.is_none()) {
                return Err(be_err(format!("matmul_swiglu: x of {} values for weight `{}`", x.len, wt.name)));
            }
            if wt.scales.is_some() {
                let at = i * n * act.block_bytes();
                self.quant_mm(w, act, |mem| {
                    Ok((mem.tensor(x, &[m, wt.cols])?, mem.scratch(Scratch::GateUp, act, at, &[m, inter])?))
                })?;
                continue;
            }
            let (ctx, mem) = (&mut self.ctx, &self.mem);
            let wv =
                mem.weight_tensor(&wt, &[inter, wt.cols])?.transpose(0, 1).map_err(|e| acl_err("matmul_swiglu", e))?;
            let half = mem.scratch(Scratch::GateUp, act, i * n * act.block_bytes(), &[m, inter])?;
            let xt = mem.tensor(x, &[m, wt.cols])?;
            aclnn::mm(ctx, &xt, &wv, &half, CubeMathType::KeepDtype).map_err(|e| acl_err("aclnnMm", e))?;
        }
        self.swiglu_halves(n, act, out)
    }

    pub(super) fn swiglu(&mut self, gate: View, up: View, out: View) -> Result<()> {
        let n = gate.len;
        let act = self.mem.dtype(gate)?;
        if up.len != n || out.len != n || self.mem.dtype(up)? != act || self.mem.dtype(out)? != act {
            return Err(be_err("swiglu: gate, up and out differ in length or dtype"));
        }
        let esz = act.block_bytes();
        self.mem.ensure(Scratch::GateUp, 2 * n * esz)?;
        self.mem.ensure_const(Const::Zeros)?;
        {
            let (ctx, mem) = (&mut self.ctx, &self.mem);
            let h = mem.scratch_buf(Scratch::GateUp)?;
            for (i, v) in [gate, up].into_iter().enumerate() {
                let (src, at, bytes) = mem.bytes_of(v)?;
                // both buffers are freed only after a synchronize
                mem.copy(ctx, act, (src, at), (h, i * n * esz), bytes, "swiglu: staging gate/up")?;
            }
        }
        self.swiglu_halves(n, act, out)
    }

    /// `out = gelu_tanh(gate) * up`, rounded once to the activation dtype (see the module docs).
    pub(super) fn geglu(&mut self, gate: View, up: View, out: View) -> Result<()> {
        let n = gate.len;
        let act = self.mem.dtype(gate)?;
        if up.len != n || out.len != n || self.mem.dtype(up)? != act || self.mem.dtype(out)? != act {
            return Err(be_err("geglu: gate, up and out differ in length or dtype"));
        }
        if n == 0 {
            return Ok(());
        }
        self.mem.ensure(Scratch::GeluOut, 2 * n * 4)?;
        let (ctx, mem) = (&mut self.ctx, &self.mem);
        let (a, b) = (
            mem.scratch(Scratch::GeluOut, DType::F32, 0, &[n])?,
            mem.scratch(Scratch::GeluOut, DType::F32, n * 4, &[n])?,
        );
        let (g, u, o) = (mem.tensor(gate, &[n])?, mem.tensor(up, &[n])?, mem.tensor(out, &[n])?);
        aclnn::cast(ctx, &g, &a).map_err(|e| acl_err("aclnnCast (geglu gate)", e))?;
        aclnn::gelu_v2(ctx, &a, GeluApproximate::Tanh, &b).map_err(|e| acl_err("aclnnGeluV2", e))?;
        aclnn::mul(ctx, &b, &u, &a).map_err(|e| acl_err("aclnnMul (geglu)", e))?;
        aclnn::cast(ctx, &a, &o).map_err(|e| acl_err("aclnnCast (geglu)", e))
    }
}
