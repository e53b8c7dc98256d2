//! HCCL: communicators between NPUs and the collectives tboost's tensor parallelism needs
//! (all-reduce, all-gather, broadcast, barrier) on device memory and a stream.
//!
//! `libhccl.so` is loaded on demand by [`Hccl::load`], from the directory `libascendcl.so` came from
//! first, then the rest of the search order; a missing library or symbol is an absent capability with an
//! error naming it, never a failure of [`Cann::load`]. With the CANN SIMULATOR, `ascend-sim` builds a
//! simulated `libhccl.so` (ranks are threads of one process, the collective runs in host memory).
//!
//! Ownership: [`HcclComm`] destroys its communicator on drop (`HcclCommDestroy`, once). A collective is
//! queued on the stream like an op: its buffers must stay allocated until the stream is synchronized, and
//! the communicator must not be dropped while one is queued (synchronize first).

use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

use crate::error::{AclError, Result};
use crate::loader::{c_string, find, Lib, SearchOrder, HCCL_LIB};
use crate::raw;
use crate::runtime::{Cann, DeviceBuffer, Stream};

pub use crate::error::hccl_result_name as result_name;

/// Element types of the collectives tboost issues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HcclDType {
    F32,
    F16,
    Bf16,
    I32,
    I8,
}

impl HcclDType {
    pub fn size(self) -> usize {
        match self {
            HcclDType::F32 | HcclDType::I32 => 4,
            HcclDType::F16 | HcclDType::Bf16 => 2,
            HcclDType::I8 => 1,
        }
    }

    fn raw(self) -> raw::HcclDataType {
        match self {
            HcclDType::F32 => raw::HcclDataType_HCCL_DATA_TYPE_FP32,
            HcclDType::F16 => raw::HcclDataType_HCCL_DATA_TYPE_FP16,
            HcclDType::Bf16 => raw::HcclDataType_HCCL_DATA_TYPE_BFP16,
            HcclDType::I32 => raw::HcclDataType_HCCL_DATA_TYPE_INT32,
            HcclDType::I8 => raw::HcclDataType_HCCL_DATA_TYPE_INT8,
        }
    }
}

#[allow(non_snake_case)]
struct Fns {
    HcclGetRootInfo: raw::HcclGetRootInfo_fn,
    HcclCommInitRootInfo: raw::HcclCommInitRootInfo_fn,
    HcclCommInitAll: raw::HcclCommInitAll_fn,
    HcclGetRankSize: raw::HcclGetRankSize_fn,
    HcclGetRankId: raw::HcclGetRankId_fn,
    HcclGetCommName: raw::HcclGetCommName_fn,
    HcclCommDestroy: raw::HcclCommDestroy_fn,
    HcclGetErrorString: raw::HcclGetErrorString_fn,
    HcclAllReduce: raw::HcclAllReduce_fn,
    HcclAllGather: raw::HcclAllGather_fn,
    HcclBroadcast: raw::HcclBroadcast_fn,
    HcclBarrier: raw::HcclBarrier_fn,
}

struct Inner {
    lib: Lib,
    cann: Cann,
    fns: Fns,
}

/// A loaded `libhccl.so`. Cheap to clone.
#[derive(Clone)]
pub struct Hccl {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Hccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hccl({})", self.inner.lib.path.display())
    }
}

fn cast<F: Copy>(p: Option<*mut c_void>) -> Option<F> {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: F is an `Option<unsafe extern "C" fn(..)>` from raw.rs (pointer-sized, null = None); the
    // address is the symbol the header declares with that type.
    p.map(|p| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// A root info (`HcclGetRootInfo` on the root rank), to hand to every rank's [`Hccl::init_rank`].
#[derive(Clone)]
pub struct RootInfo(Box<raw::HcclRootInfo>);

impl RootInfo {
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: a plain array of c_char.
        unsafe { std::slice::from_raw_parts(self.0.internal.as_ptr().cast::<u8>(), self.0.internal.len()) }
    }

    pub fn from_bytes(b: &[u8]) -> Result<RootInfo> {
        let mut r = Box::new(raw::HcclRootInfo { internal: [0; raw::HCCL_ROOT_INFO_BYTES as usize] });
        if b.len() != r.internal.len() {
            return Err(AclError::Invalid(format!("a root info has {} bytes, not {}", r.internal.len(), b.len())));
        }
        for (d, s) in r.internal.iter_mut().zip(b) {
            *d = *s as std::ffi::c_char;
        }
        Ok(RootInfo(r))
    }
}

impl Hccl {
    /// Loads `libhccl.so` next to `cann`'s runtime, else from the standard search order.
    pub fn load(cann: &Cann) -> Result<Hccl> {
        Self::load_from(cann, &SearchOrder::from_env())
    }

    pub fn load_from(cann: &Cann, order: &SearchOrder) -> Result<Hccl> {
        let path = find(order, Some(cann.lib_dir()), HCCL_LIB, "HCCL (libhccl.so)")?;
        let lib = Lib::open(&path)?;
        let sym = |n: &str| lib.symbol(n);
        let fns = Fns {
            HcclGetRootInfo: cast(sym("HcclGetRootInfo")),
            HcclCommInitRootInfo: cast(sym("HcclCommInitRootInfo")),
            HcclCommInitAll: cast(sym("HcclCommInitAll")),
            HcclGetRankSize: cast(sym("HcclGetRankSize")),
            HcclGetRankId: cast(sym("HcclGetRankId")),
            HcclGetCommName: cast(sym("HcclGetCommName")),
            HcclCommDestroy: cast(sym("HcclCommDestroy")),
            HcclGetErrorString: cast(sym("HcclGetErrorString")),
            HcclAllReduce: cast(sym("HcclAllReduce")),
            HcclAllGather: cast(sym("HcclAllGather")),
            HcclBroadcast: cast(sym("HcclBroadcast")),
            HcclBarrier: cast(sym("HcclBarrier")),
        };
        // what every HCCL since CANN 5 exports: without these the file is not HCCL
        let required: [(&'static str, bool); 4] = [
            ("HcclCommDestroy", fns.HcclCommDestroy.is_some()),
            ("HcclAllReduce", fns.HcclAllReduce.is_some()),
            ("HcclGetRankSize", fns.HcclGetRankSize.is_some()),
            ("HcclGetRankId", fns.HcclGetRankId.is_some()),
        ];
        if let Some((symbol, _)) = required.iter().find(|(_, ok)| !ok) {
            return Err(AclError::MissingSymbol { library: path, symbol });
        }
        log::info!("ascend: HCCL loaded from {}", path.display());
        Ok(Hccl { inner: Arc::new(Inner { lib, cann: cann.clone(), fns }) })
    }

    pub fn path(&self) -> &Path {
        &self.inner.lib.path
    }

    fn unavailable(&self, symbol: &'static str) -> AclError {
        AclError::FunctionUnavailable { library: self.inner.lib.path.clone(), symbol }
    }

    fn check(&self, call: &'static str, code: raw::HcclResult) -> Result<()> {
        if code == raw::HcclResult_HCCL_SUCCESS {
            return Ok(());
        }
        // HCCL's own text for the code, then the runtime's last message (the simulator puts its reason there)
        let mut message = self
            .inner
            .fns
            .HcclGetErrorString
            // SAFETY: returns a static NUL-terminated string (or NULL).
            .and_then(|f| c_string(unsafe { f(code) }))
            .unwrap_or_default();
        if let Some(m) = self.inner.cann.recent_error() {
            message = if message.is_empty() { m } else { format!("{message}; {m}") };
        }
        Err(AclError::Hccl { call, code, message })
    }

    /// `HcclGetRootInfo` (on the root rank's thread, its device current).
    pub fn root_info(&self) -> Result<RootInfo> {
        let f = self.inner.fns.HcclGetRootInfo.ok_or_else(|| self.unavailable("HcclGetRootInfo"))?;
        let mut r = Box::new(raw::HcclRootInfo { internal: [0; raw::HCCL_ROOT_INFO_BYTES as usize] });
        // SAFETY: a valid out struct.
        self.check("HcclGetRootInfo", unsafe { f(&mut *r) })?;
        Ok(RootInfo(r))
    }

    /// `HcclCommInitRootInfo` for rank `rank` of `n`, on the calling thread's current device; blocks until
    /// every rank has joined (HCCL_CONNECT_TIMEOUT).
    pub fn init_rank(&self, n: u32, root: &RootInfo, rank: u32) -> Result<HcclComm> {
        let f = self.inner.fns.HcclCommInitRootInfo.ok_or_else(|| self.unavailable("HcclCommInitRootInfo"))?;
        let mut c: raw::HcclComm = std::ptr::null_mut();
        // SAFETY: valid pointers; HCCL copies the root info.
        self.check("HcclCommInitRootInfo", unsafe { f(n, &*root.0, rank, &mut c) })?;
        self.wrap(c)
    }

    /// `HcclCommInitAll`: one communicator per device of this process, rank i on `devices[i]`.
    pub fn init_all(&self, devices: &[i32]) -> Result<Vec<HcclComm>> {
        let f = self.inner.fns.HcclCommInitAll.ok_or_else(|| self.unavailable("HcclCommInitAll"))?;
        let mut devs = devices.to_vec();
        let mut raw_comms: Vec<raw::HcclComm> = vec![std::ptr::null_mut(); devices.len()];
        let n = u32::try_from(devices.len()).map_err(|_| AclError::Invalid("too many devices".into()))?;
        // SAFETY: arrays of n entries.
        self.check("HcclCommInitAll", unsafe { f(n, devs.as_mut_ptr(), raw_comms.as_mut_ptr()) })?;
        raw_comms.into_iter().map(|c| self.wrap(c)).collect()
    }

    fn wrap(&self, c: raw::HcclComm) -> Result<HcclComm> {
        if c.is_null() {
            return Err(AclError::NullHandle { call: "HcclCommInit", message: String::new() });
        }
        // owned from here: an error below destroys it
        let mut comm = HcclComm { hccl: self.clone(), raw: c, rank: 0, size: 0 };
        let (mut rank, mut size) = (0u32, 0u32);
        let get_rank = self.inner.fns.HcclGetRankId.ok_or_else(|| self.unavailable("HcclGetRankId"))?;
        let get_size = self.inner.fns.HcclGetRankSize.ok_or_else(|| self.unavailable("HcclGetRankSize"))?;
        // SAFETY: a live communicator and valid out pointers.
        self.check("HcclGetRankId", unsafe { get_rank(c, &mut rank) })?;
        // SAFETY: as above.
        self.check("HcclGetRankSize", unsafe { get_size(c, &mut size) })?;
        (comm.rank, comm.size) = (rank, size);
        Ok(comm)
    }
}

/// One rank's communicator. Destroyed on drop.
pub struct HcclComm {
    hccl: Hccl,
    raw: raw::HcclComm,
    rank: u32,
    size: u32,
}

// SAFETY: an HCCL communicator handle may be used from any thread whose current device is the rank's
// (every call checks that on the simulator); the handle itself is an opaque pointer.
unsafe impl Send for HcclComm {}
unsafe impl Sync for HcclComm {}

impl std::fmt::Debug for HcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HcclComm(rank {} of {})", self.rank, self.size)
    }
}

/// A byte range of a device buffer.
fn range(buf: &DeviceBuffer, at: usize, bytes: usize, what: &str) -> Result<*mut c_void> {
    if at.checked_add(bytes).is_none_or(|e| e > buf.len()) {
        return Err(AclError::Invalid(format!(
            "{what}: {bytes} bytes at {at} reach past the device buffer of {} bytes",
            buf.len()
        )));
    }
    // SAFETY: in bounds (checked above).
    Ok(unsafe { buf.as_ptr().cast::<u8>().add(at) }.cast())
}

impl HcclComm {
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// `HcclGetCommName`: the communicator's name, which fused MC2 ops take as `group`.
    pub fn name(&self) -> Result<std::ffi::CString> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclGetCommName.ok_or_else(|| h.unavailable("HcclGetCommName"))?;
        // COMM_NAME_MAX_LENGTH (hccl_types.h) is 128 with the NUL.
        let mut buf = [0 as std::os::raw::c_char; 128];
        // SAFETY: a live communicator and a 128-byte buffer.
        h.check("HcclGetCommName", unsafe { f(self.raw, buf.as_mut_ptr()) })?;
        buf[127] = 0;
        // SAFETY: NUL-terminated within the buffer (forced above).
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_owned())
    }
    pub fn size(&self) -> u32 {
        self.size
    }
    pub fn raw(&self) -> raw::HcclComm {
        self.raw
    }

    /// `HcclAllReduce` (sum) of `count` elements at `send` into `recv` (the same range is allowed:
    /// in place), queued on `stream`.
    pub fn all_reduce_sum(
        &self,
        send: (&DeviceBuffer, usize),
        recv: (&DeviceBuffer, usize),
        count: usize,
        dtype: HcclDType,
        stream: &Stream,
    ) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclAllReduce.ok_or_else(|| h.unavailable("HcclAllReduce"))?;
        let bytes = count * dtype.size();
        let s = range(send.0, send.1, bytes, "HcclAllReduce sendBuf")?;
        let r = range(recv.0, recv.1, bytes, "HcclAllReduce recvBuf")?;
        // SAFETY: in-bounds device pointers; the caller keeps them alive until the stream ran the task.
        h.check("HcclAllReduce", unsafe {
            f(s, r, count as u64, dtype.raw(), raw::HcclReduceOp_HCCL_REDUCE_SUM, self.raw, stream.as_raw())
        })
    }

    /// `HcclAllGather`: every rank's `count` elements at `send`, rank order, into `recv` (`size × count`).
    pub fn all_gather(
        &self,
        send: (&DeviceBuffer, usize),
        recv: (&DeviceBuffer, usize),
        count: usize,
        dtype: HcclDType,
        stream: &Stream,
    ) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclAllGather.ok_or_else(|| h.unavailable("HcclAllGather"))?;
        let bytes = count * dtype.size();
        let s = range(send.0, send.1, bytes, "HcclAllGather sendBuf")?;
        let r = range(recv.0, recv.1, bytes * self.size as usize, "HcclAllGather recvBuf")?;
        // SAFETY: as in all_reduce_sum.
        h.check("HcclAllGather", unsafe { f(s, r, count as u64, dtype.raw(), self.raw, stream.as_raw()) })
    }

    /// `HcclBroadcast` of `count` elements at `buf` from rank `root`.
    pub fn broadcast(
        &self,
        buf: (&DeviceBuffer, usize),
        count: usize,
        dtype: HcclDType,
        root: u32,
        stream: &Stream,
    ) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclBroadcast.ok_or_else(|| h.unavailable("HcclBroadcast"))?;
        let b = range(buf.0, buf.1, count * dtype.size(), "HcclBroadcast buf")?;
        // SAFETY: as in all_reduce_sum.
        h.check("HcclBroadcast", unsafe { f(b, count as u64, dtype.raw(), root, self.raw, stream.as_raw()) })
    }

    /// `HcclBarrier` on `stream`.
    pub fn barrier(&self, stream: &Stream) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclBarrier.ok_or_else(|| h.unavailable("HcclBarrier"))?;
        // SAFETY: a live communicator and stream.
        h.check("HcclBarrier", unsafe { f(self.raw, stream.as_raw()) })
    }

    /// The raw `HcclAllReduce` with caller-chosen pointers (tests of the simulator's rules).
    ///
    /// # Safety
    /// `send`/`recv` are passed to HCCL unchecked.
    pub unsafe fn all_reduce_raw(
        &self,
        send: *mut c_void,
        recv: *mut c_void,
        count: u64,
        dtype: HcclDType,
        stream: raw::aclrtStream,
    ) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclAllReduce.ok_or_else(|| h.unavailable("HcclAllReduce"))?;
        // SAFETY: the caller's contract.
        h.check("HcclAllReduce", unsafe {
            f(send, recv, count, dtype.raw(), raw::HcclReduceOp_HCCL_REDUCE_SUM, self.raw, stream)
        })
    }

    /// `HcclCommDestroy` now, reporting its result (drop does it silently otherwise). A second call on the
    /// same handle is what the simulator refuses: this consumes the communicator.
    pub fn destroy(self) -> Result<()> {
        let r = self.destroy_raw();
        std::mem::forget(self);
        r
    }

    /// `HcclCommDestroy` without consuming the handle: a second call is a double destroy (tests).
    pub fn destroy_raw(&self) -> Result<()> {
        let h = &self.hccl;
        let f = h.inner.fns.HcclCommDestroy.ok_or_else(|| h.unavailable("HcclCommDestroy"))?;
        // SAFETY: a communicator this handle made.
        h.check("HcclCommDestroy", unsafe { f(self.raw) })
    }
}

impl Drop for HcclComm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_raw() {
            log::warn!("ascend: HcclCommDestroy (rank {}) at drop failed: {e}", self.rank);
        }
    }
}
