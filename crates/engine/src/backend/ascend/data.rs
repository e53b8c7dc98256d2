//! Data movement: the embedding lookup and the logit-row gather (`aclnnEmbedding`: table
//! `[rows, cols]`, INT32 indices, out `[n, cols]` in the table's dtype), dtype conversion
//! (`aclnnCast`) and zeroing (`aclrtMemsetAsync`, in stream order).
//!
//! The embedding scale (Gemma's `sqrt(hidden)`, rounded to the table's dtype by the plan): `aclnnMul`
//! of the rows by a one-element FLOAT tensor holding the scale (the f16/bf16 × f32 pair promotes to
//! a FLOAT product, so the scale is not rounded to the activation dtype) into FLOAT scratch, then
//! `aclnnCast` back over the rows (one rounding, no output aliasing an input).

use ascend_sys::aclnn;
use tboost_ops::DType;

use super::memory::Scratch;
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{View, WeightId};
use crate::{Error, Result};

impl AscendBackend {
    pub(super) fn embed(&mut self, ids: View, table: WeightId, out: View) -> Result<()> {
        let w = self.mem.weight(table)?.clone();
        let (vocab, hidden) = (w.rows, w.cols);
        if out.len != ids.len * hidden {
            return Err(be_err(format!("embed: out of {} values for {} ids of {hidden}", out.len, ids.len)));
        }
        if w.dtype != self.mem.dtype(out)? {
            return Err(be_err(format!(
                "embed: table `{}` is {} but out is {} (the plan converts the table at upload)",
                w.name,
                w.dtype,
                self.mem.dtype(out)?
            )));
        }
        if let Some(host) = self.step_host(ids, |s| s.ids, |s| &s.ids) {
            if let Some(&bad) = host.iter().find(|&&id| id as usize >= vocab) {
                return Err(Error::invalid("token id", format!("{bad} is not below the vocabulary size {vocab}")));
            }
        }
        if ids.len == 0 {
            return Ok(());
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (tt, it, ot) =
            (m.weight_tensor(&w, &[vocab, hidden])?, m.tensor(ids, &[ids.len])?, m.tensor(out, &[ids.len, hidden])?);
        aclnn::embedding(ctx, &tt, &it, &ot).map_err(|e| acl_err("aclnnEmbedding", e))
    }

    /// `x *= s` in place (see the module docs).
    pub(super) fn scale(&mut self, x: View, s: f32) -> Result<()> {
        let n = x.len;
        if n == 0 {
            return Ok(());
        }
        self.mem.ensure(Scratch::EmbedScale, 4)?;
        self.mem.ensure(Scratch::InPlace, n * 4)?;
        let buf = self.mem.scratch_buf(Scratch::EmbedScale)?;
        // staged: ordered on the stream before the product
        self.ctx.upload(&[s], buf, 0).map_err(|e| acl_err("scale: upload", e))?;
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (xt, st) = (m.tensor(x, &[n])?, m.scratch(Scratch::EmbedScale, DType::F32, 0, &[1])?);
        let tmp = m.scratch(Scratch::InPlace, DType::F32, 0, &[n])?;
        aclnn::mul(ctx, &xt, &st, &tmp).map_err(|e| acl_err("aclnnMul (scale)", e))?;
        aclnn::cast(ctx, &tmp, &xt).map_err(|e| acl_err("aclnnCast (scale)", e))
    }

    pub(super) fn gather_rows(&mut self, x: View, cols: usize, rows: View, out: View) -> Result<()> {
        if cols == 0 || !x.len.is_multiple_of(cols) || out.len != rows.len * cols {
            return Err(be_err(format!(
                "gather_rows: {} rows of {cols} from {} values into {}",
                rows.len, x.len, out.len
            )));
        }
        let n = x.len / cols;
        if let Some(host) = self.step_host(rows, |s| s.logit_rows, |s| &s.logit_rows) {
            if let Some(&bad) = host.iter().find(|&&r| r as usize >= n) {
                return Err(be_err(format!("gather_rows: row {bad} of {n} (the device would read out of bounds)")));
            }
        }
        if rows.len == 0 {
            return Ok(());
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (xt, rt, ot) = (m.tensor(x, &[n, cols])?, m.tensor(rows, &[rows.len])?, m.tensor(out, &[rows.len, cols])?);
        aclnn::embedding(ctx, &xt, &rt, &ot).map_err(|e| acl_err("aclnnEmbedding (gather rows)", e))
    }

    pub(super) fn convert(&mut self, src: View, dst: View) -> Result<()> {
        if src.len != dst.len {
            return Err(be_err(format!("convert: {} values into {}", src.len, dst.len)));
        }
        let (from, to) = (self.mem.dtype(src)?, self.mem.dtype(dst)?);
        if !from.is_float() || !to.is_float() {
            return Err(be_err(format!("convert: {from} -> {to} (aclnnCast here converts f32/f16/bf16)")));
        }
        if src.len == 0 {
            return Ok(());
        }
        let (ctx, m) = (&mut self.ctx, &self.mem);
        let (s, d) = (m.tensor(src, &[src.len])?, m.tensor(dst, &[dst.len])?);
        aclnn::cast(ctx, &s, &d).map_err(|e| acl_err("aclnnCast", e))
    }

    pub(super) fn zero(&mut self, dst: View) -> Result<()> {
        let (buf, at, n) = self.mem.bytes_of(dst)?;
        // SAFETY: orchestrator buffers are freed only after a synchronize.
        unsafe { self.ctx.stream().memset_async(buf, at, n, 0) }.map_err(|e| acl_err("zero", e))
    }
}
