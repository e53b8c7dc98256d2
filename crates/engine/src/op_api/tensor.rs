//! Tensors of the operator API: backend memory (a buffer or a resident weight) described by
//! dtype, shape and strides, and the shared backend handle they live on.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, BackendExt, BackendSpec, BufId, DType, View, WeightId};
use crate::model::Tensor;
use crate::{Error, Result};

/// Where a tensor's elements live on the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Elements `offset..` of a buffer from [`OpBackend::alloc`] (activations, indices, KV
    /// pools, outputs).
    Buffer { buf: BufId, offset: usize },
    /// A weight from [`OpBackend::upload_weight`] (matmul weights, norm gains, embedding
    /// tables, expert weights): ops read it, never write it.
    Weight(WeightId),
}

/// A tensor on a backend: memory, element type, shape (outermost first) and strides (in
/// elements, outermost first). Operations take contiguous row-major tensors only; any other
/// strides are refused with an error naming the tensor and the stride.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    pub mem: Mem,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl TensorRef {
    /// A contiguous tensor of `shape` at `mem`.
    pub fn new(mem: Mem, dtype: DType, shape: &[usize]) -> TensorRef {
        TensorRef { mem, dtype, shape: shape.to_vec(), strides: contiguous_strides(shape) }
    }

    /// Number of elements (`None` on overflow).
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }

    /// The same memory seen with another shape of the same element count (contiguous).
    pub fn reshape(&self, shape: &[usize]) -> Result<TensorRef> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != self.numel() {
            return Err(Error::invalid(
                "reshape",
                format!("shape {shape:?} does not hold the {:?} elements of shape {:?}", self.numel(), self.shape),
            ));
        }
        Ok(TensorRef { shape: shape.to_vec(), strides: contiguous_strides(shape), ..self.clone() })
    }

    /// Whether the strides are the row-major contiguous ones of the shape.
    pub fn is_contiguous(&self) -> bool {
        self.first_bad_stride().is_none()
    }

    /// `(dim, stride, expected)` of the first stride that is not row-major contiguous.
    pub(crate) fn first_bad_stride(&self) -> Option<(usize, usize, usize)> {
        if self.strides.len() != self.shape.len() {
            return Some((self.strides.len(), usize::MAX, self.shape.len()));
        }
        let want = contiguous_strides(&self.shape);
        // A dimension of size 1 may carry any stride: it is never stepped over.
        (0..want.len())
            .find(|&i| self.shape[i] != 1 && self.strides[i] != want[i])
            .map(|i| (i, self.strides[i], want[i]))
    }
}

/// Row-major strides (in elements) of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(shape[i + 1]);
    }
    s
}

/// A backend shared by the operations created on it (and by the host thread that copies data
/// in and out). Cloning shares the same backend; every call takes its lock for the duration
/// of the call, so one backend may be used from several threads, one call at a time.
#[derive(Clone)]
pub struct OpBackend {
    inner: Arc<Mutex<Box<dyn Backend>>>,
}

impl OpBackend {
    /// Wraps an opened backend.
    pub fn new(backend: Box<dyn Backend>) -> OpBackend {
        OpBackend { inner: Arc::new(Mutex::new(backend)) }
    }

    /// Opens a backend the way the engine does (`cpu`, `ascend`, `ascend:N`, `auto`).
    pub fn open(spec: BackendSpec) -> Result<OpBackend> {
        Ok(OpBackend::new(crate::backend::open(spec)?))
    }

    /// Locks the backend for one call. A panic in an earlier call poisons it.
    pub fn lock(&self) -> Result<MutexGuard<'_, Box<dyn Backend>>> {
        self.inner.lock().map_err(|_| Error::Poisoned)
    }

    /// The backend's name (`cpu`, `ascend`).
    pub fn name(&self) -> Result<&'static str> {
        Ok(self.lock()?.name())
    }

    /// The element type the backend computes activations in (its first choice).
    pub fn activation_dtype(&self) -> Result<DType> {
        let be = self.lock()?;
        be.activation_dtypes()
            .first()
            .copied()
            .ok_or_else(|| Error::Unsupported(format!("backend {} names no activation dtype", be.name())))
    }

    /// A zero-filled contiguous buffer tensor of `shape` (dense dtypes: f32, f16, bf16,
    /// integers).
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<TensorRef> {
        if dtype.block_elems() != 1 {
            return Err(Error::invalid(
                "dtype",
                format!("buffers hold dense types; {dtype} data is uploaded as a weight (upload_weight)"),
            ));
        }
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::invalid("shape", format!("{shape:?} overflows")))?;
        let buf = self.lock()?.alloc(dtype, n.max(1))?;
        Ok(TensorRef::new(Mem::Buffer { buf, offset: 0 }, dtype, shape))
    }

    /// Makes `bytes` (a `[rows, cols]` matrix or a `[len]` vector of `dtype`, GGUF block
    /// layout for quantized types) resident as a weight.
    pub fn upload_weight(&self, dtype: DType, shape: &[usize], bytes: Vec<u8>) -> Result<TensorRef> {
        let t = Tensor::owned("op_api.weight", dtype, shape.to_vec(), bytes)
            .map_err(|msg| Error::invalid("weight", msg))?;
        let id = self.lock()?.upload_weight(&t)?;
        Ok(TensorRef::new(Mem::Weight(id), dtype, shape))
    }

    /// Frees a buffer tensor's buffer (after the work using it completed). Weights stay
    /// resident until the backend is dropped.
    pub fn free(&self, t: &TensorRef) -> Result<()> {
        if let Mem::Buffer { buf, .. } = t.mem {
            self.lock()?.free(buf);
        }
        Ok(())
    }

    /// The view of a contiguous buffer tensor, checked against the buffer the backend holds.
    pub(crate) fn view_of(be: &dyn Backend, t: &TensorRef, what: &str) -> Result<View> {
        let Mem::Buffer { buf, offset } = t.mem else {
            return Err(Error::invalid(what, "is a weight; a buffer (alloc) is needed here"));
        };
        if let Some((dim, stride, want)) = t.first_bad_stride() {
            return Err(Error::invalid(
                what,
                format!(
                    "strides {:?} for shape {:?}: stride {stride} of dimension {dim} is not the contiguous \
                     {want} (only contiguous row-major tensors are taken)",
                    t.strides, t.shape
                ),
            ));
        }
        let (dtype, len) = be
            .buffer(buf)
            .ok_or_else(|| Error::invalid(what, format!("buffer {} is not live on this backend", buf.0)))?;
        if dtype != t.dtype {
            return Err(Error::invalid(what, format!("says dtype {} but its buffer holds {dtype}", t.dtype)));
        }
        let n = t.numel().ok_or_else(|| Error::invalid(what, format!("shape {:?} overflows", t.shape)))?;
        if offset.checked_add(n).is_none_or(|end| end > len) {
            return Err(Error::invalid(
                what,
                format!("{n} elements at offset {offset} run past its buffer of {len} elements"),
            ));
        }
        Ok(View::new(buf, offset, n))
    }

    /// Copies host bytes (exactly the tensor's bytes) into a buffer tensor.
    pub fn write(&self, t: &TensorRef, bytes: &[u8]) -> Result<()> {
        let mut be = self.lock()?;
        let v = Self::view_of(be.as_ref(), t, "write destination")?;
        check_bytes(t, v, bytes.len(), "write")?;
        be.write(v, bytes)
    }

    /// Copies a buffer tensor to the host after the work already enqueued completed.
    pub fn read(&self, t: &TensorRef, bytes: &mut [u8]) -> Result<()> {
        let mut be = self.lock()?;
        let v = Self::view_of(be.as_ref(), t, "read source")?;
        check_bytes(t, v, bytes.len(), "read")?;
        be.read(v, bytes)
    }

    /// `write` of f32 values into an f32 buffer tensor.
    pub fn write_f32(&self, t: &TensorRef, v: &[f32]) -> Result<()> {
        let mut be = self.lock()?;
        let view = Self::view_of(be.as_ref(), t, "write destination")?;
        be.write_typed(view, v)
    }

    /// `write` of u32 values into a u32 buffer tensor.
    pub fn write_u32(&self, t: &TensorRef, v: &[u32]) -> Result<()> {
        let mut be = self.lock()?;
        let view = Self::view_of(be.as_ref(), t, "write destination")?;
        be.write_typed(view, v)
    }

    /// The values of an f32 buffer tensor, after the enqueued work.
    pub fn read_f32(&self, t: &TensorRef) -> Result<Vec<f32>> {
        let mut be = self.lock()?;
        let view = Self::view_of(be.as_ref(), t, "read source")?;
        let mut out = vec![0f32; view.len];
        be.read_typed(view, &mut out)?;
        Ok(out)
    }

    /// The values of a u32 buffer tensor, after the enqueued work.
    pub fn read_u32(&self, t: &TensorRef) -> Result<Vec<u32>> {
        let mut be = self.lock()?;
        let view = Self::view_of(be.as_ref(), t, "read source")?;
        let mut out = vec![0u32; view.len];
        be.read_typed(view, &mut out)?;
        Ok(out)
    }

    /// Blocks until every enqueued operation completed (and reports the first failure).
    pub fn synchronize(&self) -> Result<()> {
        self.lock()?.synchronize()
    }
}

fn check_bytes(t: &TensorRef, v: View, got: usize, what: &str) -> Result<()> {
    let want = t.dtype.bytes_for(v.len).unwrap_or(usize::MAX);
    if got != want {
        return Err(Error::invalid(
            what,
            format!("{got} host bytes for a {} tensor of shape {:?} ({want} bytes)", t.dtype, t.shape),
        ));
    }
    Ok(())
}
