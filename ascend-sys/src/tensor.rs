//! Tensors: typed views over device memory, and the RAII aclnn handles made from them.
//!
//! Ownership:
//! - [`TensorRef`] is a plain description (dtype, shape, strides, element offset) of memory inside a
//!   [`DeviceBuffer`] it borrows; it owns nothing on the CANN side and is `Copy`. Bounds are checked
//!   when it is made, so every aclTensor built from it lies inside its buffer.
//! - [`AclTensor`], [`AclIntArray`], [`AclScalar`] own one CANN object each and destroy it on drop.
//! - [`AclTensorList`] takes ownership of the tensors put in it: CANN's `aclDestroyTensorList` destroys
//!   the elements too (OPBASE `src/nnopbase/common/api/acl_op_api.cpp`), so they are not destroyed again.
//! - The typed op functions build these handles, call the op and drop them right after the launch; an
//!   executor keeps what it needs, and the device memory stays owned by the caller's buffers, which must
//!   outlive the queued work (synchronize before dropping a buffer an op still uses).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;

pub use crate::dtype::{DType, Element, Format};
use crate::error::{AclError, Result};
use crate::raw;
use crate::runtime::{Cann, DeviceBuffer};

pub const MAX_DIMS: usize = 8;

/// A typed, strided view of device memory inside a buffer it borrows.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    base: *mut c_void, // the start of the allocation (what aclCreateTensor gets as tensorData)
    capacity: usize,   // bytes from base that belong to the buffer
    dtype: DType,
    format: Format,
    ndim: usize,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
    offset: i64, // elements from base
    _buf: PhantomData<&'a DeviceBuffer>,
}

impl std::fmt::Debug for TensorRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}{:?}", self.dtype, self.shape())?;
        if !self.is_contiguous() {
            write!(f, " strides {:?}", self.strides())?;
        }
        if self.offset != 0 {
            write!(f, " +{}", self.offset)?;
        }
        Ok(())
    }
}

fn contiguous_strides(shape: &[i64]) -> [i64; MAX_DIMS] {
    let mut s = [0i64; MAX_DIMS];
    let mut acc = 1i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    s
}

impl<'a> TensorRef<'a> {
    /// A contiguous tensor at `byte_offset` in `buf`.
    pub fn new(buf: &'a DeviceBuffer, byte_offset: usize, dtype: DType, shape: &[i64]) -> Result<TensorRef<'a>> {
        let strides = contiguous_strides(shape);
        Self::strided(buf, byte_offset, dtype, shape, &strides[..shape.len()])
    }

    /// Any strided view (non-negative strides in elements) at `byte_offset` in `buf`.
    pub fn strided(
        buf: &'a DeviceBuffer,
        byte_offset: usize,
        dtype: DType,
        shape: &[i64],
        strides: &[i64],
    ) -> Result<TensorRef<'a>> {
        // SAFETY: the buffer is a live allocation of buf.len() bytes for 'a.
        unsafe { Self::from_raw(buf.as_ptr(), buf.len(), byte_offset, dtype, shape, strides) }
    }

    /// A view of memory this crate did not allocate (e.g. a host application's device buffer).
    ///
    /// # Safety
    /// `base..base+capacity` must be device memory that stays allocated while the view and any work
    /// queued with it are alive.
    pub unsafe fn from_raw(
        base: *mut c_void,
        capacity: usize,
        byte_offset: usize,
        dtype: DType,
        shape: &[i64],
        strides: &[i64],
    ) -> Result<TensorRef<'a>> {
        if shape.len() > MAX_DIMS || strides.len() != shape.len() {
            return Err(AclError::Invalid(format!(
                "tensor of {} dims with {} strides (at most {MAX_DIMS} dims, one stride each)",
                shape.len(),
                strides.len()
            )));
        }
        if shape.iter().chain(strides).any(|&d| d < 0) {
            return Err(AclError::Invalid(format!("negative size or stride in shape {shape:?} strides {strides:?}")));
        }
        if !(byte_offset * 8).is_multiple_of(dtype.bits()) {
            return Err(AclError::Invalid(format!(
                "byte offset {byte_offset} is not a multiple of the {dtype:?} element size {}",
                dtype.size()
            )));
        }
        let mut t = TensorRef {
            base,
            capacity,
            dtype,
            format: Format::Nd,
            ndim: shape.len(),
            shape: [0; MAX_DIMS],
            strides: [0; MAX_DIMS],
            offset: (byte_offset * 8 / dtype.bits()) as i64,
            _buf: PhantomData,
        };
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..shape.len()].copy_from_slice(strides);
        t.check_bounds()?;
        Ok(t)
    }

    fn check_bounds(&self) -> Result<()> {
        if self.numel() == 0 {
            return Ok(());
        }
        let mut last = self.offset as i128;
        for i in 0..self.ndim {
            last += (self.shape[i] as i128 - 1) * self.strides[i] as i128;
        }
        let end = ((last + 1) * self.dtype.bits() as i128 + 7) / 8;
        if end > self.capacity as i128 {
            return Err(AclError::Invalid(format!(
                "{self:?} reaches byte {end}, past the end of its {}-byte buffer",
                self.capacity
            )));
        }
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn format(&self) -> Format {
        self.format
    }
    pub fn shape(&self) -> &[i64] {
        &self.shape[..self.ndim]
    }
    pub fn strides(&self) -> &[i64] {
        &self.strides[..self.ndim]
    }
    pub fn ndim(&self) -> usize {
        self.ndim
    }
    pub fn numel(&self) -> i64 {
        self.shape().iter().product()
    }
    pub fn is_contiguous(&self) -> bool {
        self.strides() == &contiguous_strides(self.shape())[..self.ndim]
    }
    /// Element offset from the start of the buffer.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// The same memory tagged with another storage format (FRACTAL_NZ for 310P layouts).
    pub fn with_format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }

    /// Swaps two dims (a transposed view, no copy).
    pub fn transpose(mut self, a: usize, b: usize) -> Result<Self> {
        if a >= self.ndim || b >= self.ndim {
            return Err(AclError::Invalid(format!("transpose({a}, {b}) of a {}-D tensor", self.ndim)));
        }
        self.shape.swap(a, b);
        self.strides.swap(a, b);
        Ok(self)
    }

    /// A new shape for a contiguous tensor with the same number of elements.
    pub fn reshape(mut self, shape: &[i64]) -> Result<Self> {
        if !self.is_contiguous() || shape.len() > MAX_DIMS || shape.iter().product::<i64>() != self.numel() {
            return Err(AclError::Invalid(format!("cannot reshape {self:?} to {shape:?}")));
        }
        self.ndim = shape.len();
        self.shape = [0; MAX_DIMS];
        self.shape[..shape.len()].copy_from_slice(shape);
        self.strides = contiguous_strides(shape);
        Ok(self)
    }

    /// Elements `start..start+len` of `dim` (a view, no copy).
    pub fn narrow(mut self, dim: usize, start: i64, len: i64) -> Result<Self> {
        if dim >= self.ndim || start < 0 || len < 0 || start + len > self.shape[dim] {
            return Err(AclError::Invalid(format!("narrow(dim {dim}, {start}, {len}) of {self:?}")));
        }
        self.offset += start * self.strides[dim];
        self.shape[dim] = len;
        Ok(self)
    }

    /// Builds the aclTensor for this view: tensorData is the start of the allocation, the view's
    /// element offset is `offset`, the storage is the whole buffer as a 1-D array.
    pub fn to_acl(&self, cann: &Cann) -> Result<AclTensor> {
        let storage = [(self.capacity * 8 / self.dtype.bits()) as i64];
        let api = cann.api();
        // SAFETY: shape/strides arrays hold ndim values; the storage pointer outlives the call.
        let p = unsafe {
            crate::call_fn!(api.aclCreateTensor, "aclCreateTensor", cann)(
                self.shape.as_ptr(),
                self.ndim as u64,
                self.dtype.to_acl(),
                self.strides.as_ptr(),
                self.offset,
                self.format.to_acl(),
                storage.as_ptr(),
                1,
                self.base,
            )
        };
        match NonNull::new(p) {
            Some(p) => Ok(AclTensor { ptr: p, cann: cann.clone() }),
            None => {
                Err(AclError::NullHandle { call: "aclCreateTensor", message: cann.recent_error().unwrap_or_default() })
            }
        }
    }
}

/// One `aclTensor`, destroyed on drop.
pub struct AclTensor {
    ptr: NonNull<raw::aclTensor>,
    cann: Cann,
}

impl AclTensor {
    pub fn as_ptr(&self) -> *mut raw::aclTensor {
        self.ptr.as_ptr()
    }
    fn into_raw(self) -> *mut raw::aclTensor {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for AclTensor {
    fn drop(&mut self) {
        let api = self.cann.api();
        if let Some(f) = api.aclDestroyTensor {
            // SAFETY: we own the tensor and nothing else destroys it.
            let st = unsafe { f(self.ptr.as_ptr()) };
            if st != 0 {
                log::warn!(
                    "ascend: aclDestroyTensor failed with {st}: {}",
                    self.cann.recent_error().unwrap_or_default()
                );
            }
        }
    }
}

/// One `aclTensorList`; owns its tensors (destroying the list destroys them).
pub struct AclTensorList {
    ptr: NonNull<raw::aclTensorList>,
    cann: Cann,
}

impl AclTensorList {
    pub fn new(cann: &Cann, tensors: Vec<AclTensor>) -> Result<AclTensorList> {
        let ptrs: Vec<*const raw::aclTensor> = tensors.iter().map(|t| t.as_ptr() as *const raw::aclTensor).collect();
        let api = cann.api();
        // SAFETY: ptrs holds live tensors for the duration of the call.
        let p = unsafe {
            crate::call_fn!(api.aclCreateTensorList, "aclCreateTensorList", cann)(ptrs.as_ptr(), ptrs.len() as u64)
        };
        match NonNull::new(p) {
            Some(p) => {
                // the list owns them now
                for t in tensors {
                    t.into_raw();
                }
                Ok(AclTensorList { ptr: p, cann: cann.clone() })
            }
            None => Err(AclError::NullHandle {
                call: "aclCreateTensorList",
                message: cann.recent_error().unwrap_or_default(),
            }),
        }
    }

    pub fn as_ptr(&self) -> *mut raw::aclTensorList {
        self.ptr.as_ptr()
    }
}

impl Drop for AclTensorList {
    fn drop(&mut self) {
        if let Some(f) = self.cann.api().aclDestroyTensorList {
            // SAFETY: we own the list (and through it its tensors).
            let st = unsafe { f(self.ptr.as_ptr()) };
            if st != 0 {
                log::warn!(
                    "ascend: aclDestroyTensorList failed with {st}: {}",
                    self.cann.recent_error().unwrap_or_default()
                );
            }
        }
    }
}

/// One `aclIntArray` (host data, copied by CANN at creation).
pub struct AclIntArray {
    ptr: NonNull<raw::aclIntArray>,
    cann: Cann,
}

impl AclIntArray {
    pub fn new(cann: &Cann, values: &[i64]) -> Result<AclIntArray> {
        let api = cann.api();
        // SAFETY: values is a live slice for the call.
        let p = unsafe {
            crate::call_fn!(api.aclCreateIntArray, "aclCreateIntArray", cann)(values.as_ptr(), values.len() as u64)
        };
        match NonNull::new(p) {
            Some(p) => Ok(AclIntArray { ptr: p, cann: cann.clone() }),
            None => Err(AclError::NullHandle {
                call: "aclCreateIntArray",
                message: cann.recent_error().unwrap_or_default(),
            }),
        }
    }
    pub fn as_ptr(&self) -> *mut raw::aclIntArray {
        self.ptr.as_ptr()
    }
}

impl Drop for AclIntArray {
    fn drop(&mut self) {
        if let Some(f) = self.cann.api().aclDestroyIntArray {
            // SAFETY: owned.
            let st = unsafe { f(self.ptr.as_ptr()) };
            if st != 0 {
                log::warn!("ascend: aclDestroyIntArray failed with {st}");
            }
        }
    }
}

/// One `aclScalar`.
pub struct AclScalar {
    ptr: NonNull<raw::aclScalar>,
    cann: Cann,
}

impl AclScalar {
    /// A FLOAT scalar (what alpha of the float ops takes).
    pub fn f32(cann: &Cann, v: f32) -> Result<AclScalar> {
        let mut v = v;
        Self::make(cann, (&mut v as *mut f32).cast(), raw::aclDataType_ACL_FLOAT)
    }
    /// An INT64 scalar.
    pub fn i64(cann: &Cann, v: i64) -> Result<AclScalar> {
        let mut v = v;
        Self::make(cann, (&mut v as *mut i64).cast(), raw::aclDataType_ACL_INT64)
    }
    fn make(cann: &Cann, value: *mut c_void, dt: raw::aclDataType) -> Result<AclScalar> {
        let api = cann.api();
        // SAFETY: value points to a live value of the named type for the call (CANN copies it).
        let p = unsafe { crate::call_fn!(api.aclCreateScalar, "aclCreateScalar", cann)(value, dt) };
        match NonNull::new(p) {
            Some(p) => Ok(AclScalar { ptr: p, cann: cann.clone() }),
            None => {
                Err(AclError::NullHandle { call: "aclCreateScalar", message: cann.recent_error().unwrap_or_default() })
            }
        }
    }
    pub fn as_ptr(&self) -> *mut raw::aclScalar {
        self.ptr.as_ptr()
    }
}

impl Drop for AclScalar {
    fn drop(&mut self) {
        if let Some(f) = self.cann.api().aclDestroyScalar {
            // SAFETY: owned.
            let st = unsafe { f(self.ptr.as_ptr()) };
            if st != 0 {
                log::warn!("ascend: aclDestroyScalar failed with {st}");
            }
        }
    }
}

/// Views of a buffer (here, beside [`TensorRef`], so that the runtime needs nothing of tensors).
impl DeviceBuffer {
    /// A contiguous tensor view at byte `at`.
    pub fn tensor(&self, at: usize, dtype: DType, shape: &[i64]) -> Result<TensorRef<'_>> {
        TensorRef::new(self, at, dtype, shape)
    }

    /// The whole buffer as a contiguous tensor of `shape` starting at byte 0.
    pub fn view(&self, dtype: DType, shape: &[i64]) -> Result<TensorRef<'_>> {
        TensorRef::new(self, 0, dtype, shape)
    }
}
