//! Resolving an op's views to host slices: bounds, dtypes, and the rule that a written view
//! overlaps no other view of the same op (what makes handing out `&mut` slices sound).

use tboost_kernels::attention::{KvPool, KvPoolMut};
use tboost_ops::DType;

use super::CpuBackend;
use crate::backend::op::{KvLayer, View};
use crate::backend::BufId;
use crate::Result;

pub(super) struct Views<'b> {
    be: &'b CpuBackend,
    /// Claimed byte ranges (buffer, start, end, written), on the stack up to 16: an op has a
    /// handful of views, and one `Views` is made per op of every step.
    spans: smallvec::SmallVec<[(BufId, usize, usize, bool); 16]>,
}

impl<'b> Views<'b> {
    pub fn new(be: &'b CpuBackend) -> Self {
        Views { be, spans: smallvec::SmallVec::new() }
    }

    fn claim(&mut self, buf: BufId, start_byte: usize, end_byte: usize, write: bool) -> Result<()> {
        for &(b, s, e, w) in &self.spans {
            if b == buf && start_byte < e && s < end_byte && (write || w) {
                return Err(CpuBackend::err(format!(
                    "op views overlap in buffer {} (a bug in the graph builder)",
                    buf.0
                )));
            }
        }
        self.spans.push((buf, start_byte, end_byte, write));
        Ok(())
    }

    /// Pointer to the view's first byte, its byte length, after the checks.
    fn raw(&mut self, v: View, dtype: Option<DType>, write: bool) -> Result<(*mut u8, usize)> {
        let hb = self.be.buf(v.buf)?;
        if let Some(d) = dtype {
            if hb.dtype != d {
                return Err(CpuBackend::err(format!("buffer {} holds {} where {d} was expected", v.buf.0, hb.dtype)));
            }
        }
        let end = v.offset.checked_add(v.len).filter(|&e| e <= hb.len).ok_or_else(|| {
            CpuBackend::err(format!("view {}+{} out of buffer {} of {}", v.offset, v.len, v.buf.0, hb.len))
        })?;
        let (start_b, end_b) = match (hb.dtype.bytes_for(v.offset), hb.dtype.bytes_for(end)) {
            (Some(s), Some(e)) => (s, e),
            _ => return Err(CpuBackend::err(format!("view {}+{} splits a {} block", v.offset, v.len, hb.dtype))),
        };
        self.claim(v.buf, start_b, end_b, write)?;
        // SAFETY: start_b is within the allocation (checked above).
        Ok((unsafe { hb.ptr.add(start_b) }, end_b - start_b))
    }

    pub fn f32(&mut self, v: View) -> Result<&'b [f32]> {
        let (p, _) = self.raw(v, Some(DType::F32), false)?;
        // SAFETY: in bounds, aligned (64-byte base, 4-byte elements), not written by this op.
        Ok(unsafe { std::slice::from_raw_parts(p as *const f32, v.len) })
    }

    #[allow(clippy::mut_from_ref)]
    pub fn f32_mut(&mut self, v: View) -> Result<&'b mut [f32]> {
        let (p, _) = self.raw(v, Some(DType::F32), true)?;
        // SAFETY: in bounds, aligned, and no other view of this op overlaps it.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut f32, v.len) })
    }

    pub fn u32(&mut self, v: View) -> Result<&'b [u32]> {
        let (p, _) = self.raw(v, Some(DType::U32), false)?;
        // SAFETY: in bounds, aligned, read-only in this op.
        Ok(unsafe { std::slice::from_raw_parts(p as *const u32, v.len) })
    }

    #[allow(clippy::mut_from_ref)]
    pub fn u32_mut(&mut self, v: View) -> Result<&'b mut [u32]> {
        let (p, _) = self.raw(v, Some(DType::U32), true)?;
        // SAFETY: in bounds, aligned, exclusively claimed.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut u32, v.len) })
    }

    /// The view's bytes, whatever its dtype.
    pub fn bytes(&mut self, v: View) -> Result<&'b [u8]> {
        let (p, n) = self.raw(v, None, false)?;
        // SAFETY: in bounds, read-only in this op.
        Ok(unsafe { std::slice::from_raw_parts(p, n) })
    }

    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&mut self, v: View) -> Result<&'b mut [u8]> {
        let (p, n) = self.raw(v, None, true)?;
        // SAFETY: in bounds, exclusively claimed.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    pub fn dtype(&self, v: View) -> Result<DType> {
        Ok(self.be.buf(v.buf)?.dtype)
    }

    /// A whole buffer as bytes (KV pools).
    fn whole(&mut self, buf: BufId, dtype: DType, write: bool) -> Result<(*mut u8, usize)> {
        let len = self.be.buf(buf)?.len;
        self.raw(View::new(buf, 0, len), Some(dtype), write)
    }

    pub fn pool(&mut self, c: &KvLayer) -> Result<KvPool<'b>> {
        let (k, kb) = self.whole(c.k, c.dtype, false)?;
        let (v, vb) = self.whole(c.v, c.dtype, false)?;
        // SAFETY: whole buffers, read-only in this op.
        let (k, v) = unsafe { (std::slice::from_raw_parts(k, kb), std::slice::from_raw_parts(v, vb)) };
        Ok(KvPool { dtype: c.dtype, block_size: c.block_size, kv_heads: c.kv_heads, head_dim: c.head_dim, k, v })
    }

    pub fn pool_mut(&mut self, c: &KvLayer) -> Result<KvPoolMut<'b>> {
        let (k, kb) = self.whole(c.k, c.dtype, true)?;
        let (v, vb) = self.whole(c.v, c.dtype, true)?;
        // SAFETY: whole buffers, exclusively claimed by this op.
        let (k, v) = unsafe { (std::slice::from_raw_parts_mut(k, kb), std::slice::from_raw_parts_mut(v, vb)) };
        Ok(KvPoolMut { dtype: c.dtype, block_size: c.block_size, kv_heads: c.kv_heads, head_dim: c.head_dim, k, v })
    }
}
