//! RMSNorm (`aclnnRmsNorm`), RMSNorm with the residual add fused in (`aclnnAddRmsNorm`), and the
//! residual add itself (`aclnnInplaceAdd`).
//!
//! Layout: `x` `[rows, hidden]`, gamma `[hidden]` in the activation dtype (the plan converts gains
//! at upload), `rstdOut` FLOAT32 `[rows, 1]` (required by the doc) in scratch. AddRmsNorm writes the
//! sum (`xOut`) to scratch and copies it over the residual on the stream, so no output aliases an
//! input (in-place aliasing is not documented for the op).

use ascend_sys::aclnn;
use tboost_ops::DType;

use super::memory::{Const, Scratch};
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{View, WeightId};
use crate::Result;

impl AscendBackend {
    pub(super) fn rms_norm(&mut self, residual: Option<View>, x: View, w: WeightId, eps: f32, out: View) -> Result<()> {
        let g = self.mem.weight(w)?.clone();
        let n = g.numel;
        let act = self.mem.dtype(x)?;
        if n == 0 || !x.len.is_multiple_of(n) || out.len != x.len || residual.is_some_and(|r| r.len != x.len) {
            return Err(be_err(format!("rmsnorm: {} values are not rows of the {n}-value gain", x.len)));
        }
        if g.dtype != act || self.mem.dtype(out)? != act {
            return Err(be_err(format!(
                "rmsnorm: gain `{}` is {} and out {}, activations are {act} (the plan converts gains at upload)",
                g.name,
                g.dtype,
                self.mem.dtype(out)?
            )));
        }
        let rows = x.len / n;
        self.mem.ensure(Scratch::Rstd, rows.max(1) * 4)?;
        if residual.is_some() {
            self.mem.ensure(Scratch::NormOut, x.len * act.block_bytes())?;
            self.mem.ensure_const(Const::Zeros)?;
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let gamma = m.weight_tensor(&g, &[n])?;
        let rstd = m.scratch(Scratch::Rstd, DType::F32, 0, &[rows, 1])?;
        let (xt, yt) = (m.tensor(x, &[rows, n])?, m.tensor(out, &[rows, n])?);
        match residual {
            None => aclnn::rms_norm(ctx, &xt, &gamma, eps as f64, &yt, &rstd).map_err(|e| acl_err("aclnnRmsNorm", e)),
            Some(r) => {
                let rt = m.tensor(r, &[rows, n])?;
                let sum = m.scratch(Scratch::NormOut, act, 0, &[rows, n])?;
                aclnn::add_rms_norm(ctx, &rt, &xt, &gamma, eps as f64, &yt, Some(&rstd), Some(&sum))
                    .map_err(|e| acl_err("aclnnAddRmsNorm", e))?;
                let (dst, at, bytes) = m.bytes_of(r)?;
                // scratch and orchestrator buffers are freed only after a synchronize
                m.copy(ctx, act, (m.scratch_buf(Scratch::NormOut)?, 0), (dst, at), bytes, "add_rmsnorm: residual copy")
            }
        }
    }

    pub(super) fn add(&mut self, dst: View, src: View) -> Result<()> {
        if dst.len != src.len {
            return Err(be_err(format!("add: {} values into {}", src.len, dst.len)));
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (d, s) = (m.tensor(dst, &[dst.len])?, m.tensor(src, &[src.len])?);
        aclnn::inplace_add(ctx, &d, &s, 1.0).map_err(|e| acl_err("aclnnInplaceAdd", e))
    }
}
