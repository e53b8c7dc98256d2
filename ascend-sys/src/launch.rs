//! The two-phase aclnn protocol and the per-stream context ops run in.
//!
//! Every op is `aclnnXxxGetWorkspaceSize(..., &ws, &executor)` then `aclnnXxx(workspace, ws, executor,
//! stream)`. [`Context::run`] does both: it resolves the pair (lazily, cached), calls the first phase,
//! grows the context's workspace only when it is too small, and launches on the context's stream.
//!
//! Ownership:
//! - An executor from a successful first phase is owned by an [`Executor`] until its execute phase is
//!   called. A one-shot executor then belongs to CANN *whatever the execute returned*: opbase's
//!   `CommonOpExecutorRun` deletes a non-repeatable executor after `Run()` (success or failure) and
//!   `DeleteExecutorForError` deletes it on a NULL workspace (hicann/opbase
//!   `src/nnopbase/composite_op/aclnn_engine/op_executor.cpp`), so destroying it here would be a double
//!   free. Only an executor whose execute phase was never called (the workspace allocation failed) is
//!   destroyed with `aclDestroyAclOpExecutor`, which deletes any executor (`acl_op_api.cpp`). A
//!   repeatable executor ([`Context::prepare`]) stays owned by its [`PreparedOp`] and is destroyed on
//!   drop, which must come after the stream finished with it.
//! - A workspace that is replaced by a larger one may still be in use by queued work: it is kept in a
//!   retired list and freed at the next successful [`Context::synchronize`] (or when the context drops).
//! - Staging buffers used by [`Context::upload`] are recycled the same way.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::dtype::{as_bytes, Element};
use crate::error::{AclError, Phase, Result};
use crate::raw;
use crate::runtime::{Cann, Device, DeviceBuffer, HostBuffer, Stream};

/// An `aclOpExecutor` returned by a first phase and not yet handed to CANN.
pub struct Executor {
    ptr: NonNull<raw::aclOpExecutor>,
    op: &'static str,
    cann: Cann,
    owned: bool,
    repeatable: bool,
}

impl Executor {
    /// Takes ownership of an executor a caller got from a first phase it made itself (see
    /// [`Cann::raw_op`](crate::Cann::raw_op)); it is destroyed on drop unless [`Executor::release`]d.
    ///
    /// # Safety
    /// `ptr` must be a live executor of `op` that nothing else destroys.
    pub unsafe fn from_raw(cann: &Cann, op: &'static str, ptr: *mut raw::aclOpExecutor) -> Option<Executor> {
        NonNull::new(ptr).map(|ptr| Executor { ptr, op, cann: cann.clone(), owned: true, repeatable: false })
    }

    /// Gives up ownership (after a successful one-shot launch CANN releases the executor itself).
    pub fn release(mut self) -> *mut raw::aclOpExecutor {
        self.owned = false;
        self.ptr.as_ptr()
    }

    pub fn as_ptr(&self) -> *mut raw::aclOpExecutor {
        self.ptr.as_ptr()
    }
    pub fn op(&self) -> &'static str {
        self.op
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Some(f) = self.cann.api().aclDestroyAclOpExecutor {
            // SAFETY: we own the executor (never launched, or repeatable).
            let st = unsafe { f(self.ptr.as_ptr()) };
            if st != 0 {
                log::warn!(
                    "ascend: aclDestroyAclOpExecutor({}) failed with {st}: {}",
                    self.op,
                    self.cann.recent_error().unwrap_or_default()
                );
            }
        }
    }
}

/// A first phase, as a closure over the op's typed `GetWorkspaceSize` call.
pub type FirstPhase<'f> = dyn FnOnce(*mut u64, *mut *mut raw::aclOpExecutor) -> raw::aclnnStatus + 'f;

/// A repeatable executor and the workspace size its first phase asked for.
pub struct PreparedOp {
    exec: Executor,
    workspace: u64,
}

impl PreparedOp {
    pub fn op(&self) -> &'static str {
        self.exec.op
    }
    pub fn workspace_size(&self) -> u64 {
        self.workspace
    }
}

/// Counters a backend can log or test against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextStats {
    pub launches: u64,
    /// times the workspace had to be replaced by a larger one
    pub workspace_grows: u64,
    pub workspace_bytes: usize,
}

/// ATB's Context: one stream, one reusable workspace, staging buffers for uploads.
pub struct Context {
    // field order = drop order after Drop::drop ran: buffers before the stream
    retired: Vec<DeviceBuffer>,
    workspace: Option<DeviceBuffer>,
    staging_busy: Vec<HostBuffer>,
    staging_free: Vec<HostBuffer>,
    stream: Stream,
    dev: Device,
    stats: ContextStats,
}

/// Smallest workspace allocation (ops often ask for a few bytes; avoid one allocation per op).
const MIN_WORKSPACE: usize = 64 << 10;
const MIN_STAGING: usize = 64 << 10;

impl Context {
    pub fn new(dev: &Device) -> Result<Context> {
        Ok(Context {
            retired: Vec::new(),
            workspace: None,
            staging_busy: Vec::new(),
            staging_free: Vec::new(),
            stream: dev.create_stream()?,
            dev: dev.clone(),
            stats: ContextStats::default(),
        })
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }
    pub fn cann(&self) -> &Cann {
        self.dev.cann()
    }
    pub fn stats(&self) -> ContextStats {
        self.stats
    }

    /// Waits for the stream, then frees retired workspaces and recycles staging buffers.
    pub fn synchronize(&mut self) -> Result<()> {
        self.stream.synchronize()?;
        self.retired.clear();
        self.staging_free.append(&mut self.staging_busy);
        Ok(())
    }

    /// The resolved typed first-phase function of `op` (an `Option<fn>` type from [`raw`]).
    ///
    /// # Safety
    /// `F` must be the `<op>GetWorkspaceSize_fn` type of the header for this `op`.
    pub unsafe fn first_phase_fn<F: Copy>(&self, op: &'static str) -> Result<F> {
        let syms = self.cann().op_syms(op)?;
        debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: the caller names the matching type; the address is that symbol.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&syms.gws) })
    }

    fn first_phase(&self, op: &'static str, gws: Box<FirstPhase<'_>>) -> Result<(Executor, u64)> {
        let mut ws: u64 = 0;
        let mut ex: *mut raw::aclOpExecutor = std::ptr::null_mut();
        let st = gws(&mut ws, &mut ex);
        if st != 0 {
            let message = self.cann().recent_error().unwrap_or_default();
            if let Some(p) = NonNull::new(ex) {
                // a failing first phase should not hand out an executor; if it did, release it
                drop(Executor { ptr: p, op, cann: self.cann().clone(), owned: true, repeatable: false });
            }
            return Err(AclError::Op { op, phase: Phase::GetWorkspaceSize, status: st, message });
        }
        match NonNull::new(ex) {
            Some(ptr) => Ok((Executor { ptr, op, cann: self.cann().clone(), owned: true, repeatable: false }, ws)),
            None => Err(AclError::Op {
                op,
                phase: Phase::GetWorkspaceSize,
                status: 0,
                message: "the first phase succeeded but returned no executor".into(),
            }),
        }
    }

    /// A device pointer to at least `need` bytes of workspace (NULL for 0), growing only when too small.
    fn workspace(&mut self, need: u64) -> Result<*mut c_void> {
        if need == 0 {
            return Ok(std::ptr::null_mut());
        }
        let need = usize::try_from(need).map_err(|_| AclError::Invalid(format!("workspace of {need} bytes")))?;
        if let Some(w) = &self.workspace {
            if w.len() >= need {
                return Ok(w.as_ptr());
            }
        }
        let size = need.next_power_of_two().max(MIN_WORKSPACE);
        let fresh = self.dev.alloc(size)?;
        if let Some(old) = self.workspace.replace(fresh) {
            self.retired.push(old); // queued work may still use it
            self.stats.workspace_grows += 1;
        }
        self.stats.workspace_bytes = size;
        Ok(self.workspace.as_ref().map_or(std::ptr::null_mut(), DeviceBuffer::as_ptr))
    }

    fn launch(&mut self, exec: &mut Executor, ws: u64) -> Result<()> {
        let syms = self.cann().op_syms(exec.op)?;
        let wsp = self.workspace(ws)?;
        // SAFETY: exec is the execute twin of the header (aclnnExecute_fn) of this op.
        let f: raw::aclnnExecute_fn =
            unsafe { std::mem::transmute_copy::<*mut c_void, raw::aclnnExecute_fn>(&syms.exec) };
        let Some(f) = f else {
            return Err(AclError::OpUnavailable { op: exec.op.to_string(), libraries: self.cann().op_libraries() });
        };
        // SAFETY: a live executor from this op's first phase, a workspace of at least `ws` bytes, our stream.
        let st = unsafe { f(wsp, ws, exec.as_ptr(), self.stream.as_raw()) };
        if !exec.repeatable {
            exec.owned = false; // consumed by the execute phase, whatever it returned (see the module doc)
        }
        if st != 0 {
            return Err(AclError::Op {
                op: exec.op,
                phase: Phase::Execute,
                status: st,
                message: self.cann().recent_error().unwrap_or_default(),
            });
        }
        self.stats.launches += 1;
        Ok(())
    }

    /// Runs one op: first phase, workspace, launch on the stream.
    pub fn run(
        &mut self,
        op: &'static str,
        gws: impl FnOnce(*mut u64, *mut *mut raw::aclOpExecutor) -> raw::aclnnStatus,
    ) -> Result<()> {
        let (mut exec, ws) = self.first_phase(op, Box::new(gws))?;
        self.launch(&mut exec, ws)
    }

    /// First phase only, with the executor made repeatable (`aclSetAclOpExecutorRepeatable`), for ops
    /// whose inputs keep their addresses from step to step.
    pub fn prepare(
        &mut self,
        op: &'static str,
        gws: impl FnOnce(*mut u64, *mut *mut raw::aclOpExecutor) -> raw::aclnnStatus,
    ) -> Result<PreparedOp> {
        let (mut exec, ws) = self.first_phase(op, Box::new(gws))?;
        let c = self.cann().clone();
        let f = crate::call_fn!(c.api().aclSetAclOpExecutorRepeatable, "aclSetAclOpExecutorRepeatable", c);
        // SAFETY: a live executor we own.
        let st = unsafe { f(exec.as_ptr()) };
        if st != 0 {
            return Err(AclError::Op {
                op,
                phase: Phase::GetWorkspaceSize,
                status: st,
                message: c.recent_error().unwrap_or_default(),
            });
        }
        exec.repeatable = true;
        Ok(PreparedOp { exec, workspace: ws })
    }

    /// Launches a prepared op again (any number of times). Drop the `PreparedOp` only after synchronizing.
    pub fn launch_prepared(&mut self, op: &mut PreparedOp) -> Result<()> {
        let ws = op.workspace;
        self.launch(&mut op.exec, ws)
    }

    /// Queues a copy of `data` to byte `at` of `dst` through a page-locked staging buffer the context
    /// keeps busy until the next synchronize (so `data` may be dropped right away).
    pub fn upload<T: Element>(&mut self, data: &[T], dst: &DeviceBuffer, at: usize) -> Result<()> {
        let bytes = as_bytes(data);
        if bytes.is_empty() {
            return Ok(());
        }
        let idx = self.staging_free.iter().position(|b| b.len() >= bytes.len());
        let mut stage = match idx {
            Some(i) => self.staging_free.swap_remove(i),
            None => self.dev.alloc_host(bytes.len().next_power_of_two().max(MIN_STAGING))?,
        };
        stage.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: `stage` is kept in staging_busy until the stream is synchronized; `dst` is the caller's
        // buffer, which like every op operand must outlive the queued work.
        let r = unsafe { self.stream.copy_to_device_async(&stage, 0, dst, at, bytes.len()) };
        self.staging_busy.push(stage);
        r
    }

    /// Synchronizes, then copies `out.len()` elements from byte `at` of `src` to the host.
    pub fn download<T: Element>(&mut self, src: &DeviceBuffer, at: usize, out: &mut [T]) -> Result<()> {
        self.synchronize()?;
        src.read(at, out)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            log::warn!("ascend: context synchronize on drop failed: {e}");
        }
    }
}
