//! The Ascend backend: tboost's ops as aclnn ops on one aclrtStream of one NPU, through the
//! runtime-loaded CANN bindings of `ascend-sys` (nothing links CANN; without it `open` says what it
//! searched). On a machine without an NPU the same code runs against the CANN SIMULATOR in
//! `ascend-sim/` (same sonames and symbols); every message that can come from it says so.
//!
//! - `memory`: device buffers, weights (uploaded once, ids consecutive), scratch, constants, and
//!   deferred frees (a buffer queued work may still read is freed after the next synchronize).
//! - `stream`: async writes staged through page-locked memory, reads, events, synchronize, the
//!   per-op device-time profile (`TBOOST_PROFILE=1`).
//! - `step`: the step's index arrays on the device and the host copies aclnn wants (sequence
//!   lengths are `aclIntArray`s, RoPE tables are computed on the host from the positions).
//! - one module per op family: `norm`, `matmul` (with SwiGLU and GeGLU), `rope`, `attention`, `moe`,
//!   `data` (with the embedding scale).
//! - `supports`: the capability table (documented constraints, SoC, CANN version, symbols).
//!
//! The op vocabulary comes from `tboost_ops` and `crate::backend`; this module never touches the
//! CPU kernels.

mod attention;
mod collective;
mod data;
mod matmul;
mod memory;
mod moe;
mod norm;
mod rope;
mod step;
mod stream;
pub mod supports;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use ascend_sys as sys;
use ascend_sys::{AclError, Cann, Context, Device, DeviceFacts};
use tboost_ops::{DType, Unsupported};

use super::op::{Op, OpQuery, StepViews, View};
use super::{Backend, BackendOptions, BufId, DeviceInfo, EventId, PendingRead, StepHost, WeightId};
use crate::model::Tensor;
use crate::{Error, Result};

use memory::Memory;
use step::StepState;
use stream::StreamState;
use supports::Caps;

pub(super) fn be_err(msg: impl Into<String>) -> Error {
    Error::Backend { backend: "ascend".into(), msg: msg.into() }
}

/// The CPU kernels' work-split tunables do not apply to aclnn ops (they tile themselves): an op
/// that sets one is refused, naming it, rather than run with the tiling silently dropped.
fn untiled<T: tboost_ops::Tiling>(op: &str, tiling: &T) -> Result<()> {
    tboost_ops::tiling::default_only(tiling, "ascend").map_err(|u| be_err(format!("{op}: {u}")))
}

/// A CANN failure with what tboost was doing (`AclError`'s text names the aclnn op or runtime
/// call, its status and `aclGetRecentErrMsg()`).
pub(super) fn acl_err(what: &str, e: AclError) -> Error {
    be_err(format!("{what}: {e}"))
}

pub struct AscendBackend {
    // Dropped in this order after `Drop::drop` synchronized the stream.
    /// Set when this backend is a rank of an HCCL group (`collective`).
    hccl: Option<ascend_sys::HcclComm>,
    mem: Memory,
    st: StreamState,
    ctx: Context,
    step: StepState,
    caps: Caps,
    dev: Device,
    cann: Cann,
    facts: DeviceFacts,
    interrupt: Option<Arc<AtomicBool>>,
}

impl AscendBackend {
    /// Loads CANN (the standard search order: `ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`,
    /// `LD_LIBRARY_PATH`, the default toolkit path) and opens NPU `device` with one stream.
    pub fn open(device: u32) -> Result<AscendBackend> {
        Self::open_with(device, &BackendOptions::default())
    }

    /// `open` with the engine config's backend options (profile, known-bad CANN versions).
    pub fn open_with(device: u32, opts: &BackendOptions) -> Result<AscendBackend> {
        let cann = Cann::load().map_err(|e| be_err(e.to_string()))?;
        Self::open_on_with(&cann, device, opts)
    }

    /// Opens NPU `device` of an already loaded CANN.
    pub fn open_on(cann: &Cann, device: u32) -> Result<AscendBackend> {
        Self::open_on_with(cann, device, &BackendOptions::default())
    }

    /// `open_on` with the engine config's backend options.
    pub fn open_on_with(cann: &Cann, device: u32, opts: &BackendOptions) -> Result<AscendBackend> {
        let facts = cann.facts();
        let id =
            i32::try_from(device).map_err(|_| Error::invalid("backend", format!("device {device} is too large")))?;
        let dev = cann.device(id).map_err(|e| acl_err(&format!("opening device {device}"), e))?;
        let ctx = Context::new(&dev).map_err(|e| acl_err("creating the stream", e))?;
        let caps =
            Caps::new(cann, &facts, &opts.ascend_known_bad).map_err(|e| Error::invalid("ascend_known_bad", e))?;
        let be = AscendBackend {
            hccl: None,
            mem: Memory::new(&dev),
            st: StreamState::new(opts.profile),
            ctx,
            step: StepState::default(),
            caps,
            dev,
            cann: cann.clone(),
            facts,
            interrupt: None,
        };
        log::info!("ascend: {}", be.describe());
        Ok(be)
    }

    /// True when this is the CANN SIMULATOR (ascend-sim), not CANN on an NPU.
    pub fn is_simulator(&self) -> bool {
        self.facts.simulator
    }

    /// The loaded runtime (for the simulator's counters in tests: `cann().sim_stats()`).
    pub fn cann(&self) -> &Cann {
        &self.cann
    }

    fn describe(&self) -> String {
        let d = self.device();
        format!("{} on {}", d.runtime_version.unwrap_or_default(), d.device)
    }

    fn interrupted(&self) -> bool {
        self.interrupt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Makes the device current on the calling thread: `aclrtSetDevice` binds a *thread*, and hosts
    /// drive the engine (`Backend: Send`) from whichever thread they like. Cheap when it already is
    /// (`aclrtGetDevice`).
    fn bind(&self) -> Result<()> {
        self.dev.make_current().map_err(|e| acl_err("making the device current on this thread", e))
    }

    /// After a failed launch: let the stream finish what this step queued (its errors belong to
    /// the failed step, which already has one), so nothing of it surfaces in the next step.
    fn drain(&mut self) {
        if let Err(e) = self.synchronize() {
            log::debug!("ascend: draining the stream after a failed op: {e}");
        }
    }

    fn run_op(&mut self, op: &Op) -> Result<()> {
        match *op {
            Op::Embed { ids, table, out } => self.embed(ids, table, out),
            Op::RmsNorm { x, w, eps, out } => self.rms_norm(None, x, w, eps, out),
            Op::AddRmsNorm { residual, x, w, eps, out } => self.rms_norm(Some(residual), x, w, eps, out),
            Op::Add { dst, src } => self.add(dst, src),
            Op::MatMul { x, m, segs, precision, tiling } => {
                untiled("matmul", &tiling)?;
                self.matmul(x, m, &segs, precision)
            }
            Op::MatMulSwiGlu { x, m, gate, up, out, precision, tiling } => {
                untiled("matmul_swiglu", &tiling)?;
                self.matmul_swiglu(x, m, gate, up, out, precision)
            }
            Op::SwiGlu { gate, up, out } => self.swiglu(gate, up, out),
            Op::RopeTables { positions, rope, cos, sin } => self.rope_tables(positions, &rope, cos, sin),
            Op::RopeTablesScaled { positions, rope, factors, cos, sin } => {
                self.rope_tables_scaled(positions, &rope, factors, cos, sin)
            }
            Op::GeGlu { gate, up, out } => self.geglu(gate, up, out),
            Op::Scale { x, s } => self.scale(x, s),
            Op::Rope { x, heads, head_dim, cos, sin, style } => self.rope(x, heads, head_dim, cos, sin, style),
            Op::WriteKv { k, v, slots, cache } => self.write_kv(k, v, slots, &cache),
            Op::Attention { kind, q, cache, seqs, params, out } => self.attention(kind, q, &cache, &seqs, &params, out),
            Op::MoeRoute { logits, m, experts, top_k, ids, weights } => {
                self.moe_route(logits, m, experts, top_k, ids, weights)
            }
            Op::MoeGrouped { x, m, experts, top_k, ids, weights, out, tiling } => {
                untiled("moe_grouped", &tiling)?;
                self.moe_grouped(x, m, &experts, top_k, ids, weights, out)
            }
            Op::MoeScatter { .. } | Op::MoeCombine { .. } => Err(be_err(
                "the per-expert MoE path (moe_scatter/moe_combine) is not mapped on Ascend; the plan runs it on \
                 the cpu (a bug in the caller if it reached the device)",
            )),
            Op::GatherRows { x, cols, rows, out } => self.gather_rows(x, cols, rows, out),
            Op::Convert { src, dst } => self.convert(src, dst),
            Op::Zero { dst } => self.zero(dst),
        }
    }
}

impl Backend for AscendBackend {
    fn name(&self) -> &'static str {
        "ascend"
    }

    fn device(&self) -> DeviceInfo {
        let f = &self.facts;
        let soc = f.soc_name.as_deref().unwrap_or("unknown SoC");
        let sim = if f.simulator { ", CANN SIMULATOR (ascend-sim), not an NPU" } else { "" };
        DeviceInfo {
            backend: "ascend".into(),
            device: format!("{soc} (device {}{sim})", self.dev.id()),
            runtime_version: Some(format!(
                "CANN {}{}",
                f.cann_version_string.as_deref().unwrap_or("version unknown"),
                if f.simulator { " (simulated)" } else { "" }
            )),
        }
    }

    fn supports(&self, query: &OpQuery) -> Result<(), Unsupported> {
        self.caps.supports(query)
    }

    fn kernel_name(&self, query: &OpQuery) -> Option<String> {
        self.caps.kernel_name(query)
    }

    fn activation_dtypes(&self) -> &'static [DType] {
        if self.facts.soc.supports_bf16() {
            &[DType::F16, DType::BF16]
        } else {
            &[DType::F16]
        }
    }

    fn kv_dtypes(&self) -> &'static [DType] {
        self.activation_dtypes()
    }

    /// FIA's paged prefill takes block sizes 128..512 that are multiples of 128 (research §2.4).
    fn preferred_block_size(&self) -> usize {
        128
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId> {
        self.bind()?;
        self.mem.alloc(dtype, len)
    }

    fn free(&mut self, buf: BufId) {
        self.mem.free(buf);
    }

    fn buffer(&self, buf: BufId) -> Option<(DType, usize)> {
        self.mem.buffer(buf)
    }

    fn allocated_bytes(&self) -> usize {
        self.mem.allocated()
    }

    fn upload_weight(&mut self, tensor: &Tensor) -> Result<WeightId> {
        self.bind()?;
        self.mem.upload_weight(tensor)
    }

    fn weight_bytes_by_dtype(&self) -> Vec<(DType, usize)> {
        self.mem.weight_bytes()
    }

    fn write(&mut self, dst: View, src: &[u8]) -> Result<()> {
        // Staged: `src` may be reused as soon as this returns.
        self.write_async(dst, src)
    }

    fn write_async(&mut self, dst: View, src: &[u8]) -> Result<()> {
        self.bind()?;
        let (buf, at, n) = self.mem.bytes_of(dst)?;
        if n != src.len() {
            return Err(be_err(format!("write of {} bytes into a view of {n} bytes", src.len())));
        }
        self.ctx.upload(src, buf, at).map_err(|e| acl_err("write", e))
    }

    fn read(&mut self, src: View, dst: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        let (buf, at, n) = self.mem.bytes_of(src)?;
        if n != dst.len() {
            return Err(be_err(format!("read of a view of {n} bytes into {} bytes", dst.len())));
        }
        buf.read(at, dst).map_err(|e| acl_err("read", e))
    }

    fn read_async(&mut self, src: View) -> Result<PendingRead> {
        self.bind()?;
        let (buf, at, n) = self.mem.bytes_of(src)?;
        self.st.read_async(&self.dev, &self.ctx, buf, at, n)
    }

    fn finish_read(&mut self, read: PendingRead, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        let r = self.st.finish_read(read, dst);
        if r.is_err() {
            self.mem.release_retired();
        }
        r
    }

    fn set_step(&mut self, host: &StepHost<'_>, views: &StepViews) -> Result<()> {
        self.bind()?;
        let r = self.upload_step(host, views);
        if r.is_err() {
            self.drain();
        }
        r
    }

    fn launch(&mut self, op: &Op) -> Result<()> {
        self.bind()?;
        if self.interrupted() {
            self.drain();
            return Err(Error::Interrupted);
        }
        let t = self.st.op_started(&self.dev, &self.ctx)?;
        let r = self.run_op(op);
        match r {
            Ok(()) => self.st.op_finished(t, op.name(), &self.dev, &mut self.ctx),
            Err(e) => {
                self.st.op_abandoned(t);
                self.drain();
                Err(match e {
                    Error::Backend { backend, msg } => Error::Backend { backend, msg: format!("{}: {msg}", op.name()) },
                    other => other,
                })
            }
        }
    }

    fn record_event(&mut self) -> Result<EventId> {
        self.bind()?;
        self.st.record_event(&self.dev, &self.ctx)
    }

    fn wait_event(&mut self, event: EventId) -> Result<()> {
        self.bind()?;
        let r = self.st.wait_event(event);
        if r.is_err() {
            self.mem.release_retired();
        }
        r
    }

    fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        let r = self.ctx.synchronize().map_err(|e| acl_err("synchronize", e));
        // Whatever the answer, the stream ran (or abandoned) every task: freed buffers may go.
        self.mem.release_retired();
        self.st.synchronized(r.is_ok());
        r
    }

    fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.interrupt = Some(flag);
    }

    fn device_collective(&mut self) -> Option<&mut dyn super::DeviceCollective> {
        if self.hccl.is_some() {
            Some(self)
        } else {
            None
        }
    }

    fn attach_hccl(&mut self, comm: ascend_sys::HcclComm) -> Result<()> {
        self.set_hccl(comm);
        Ok(())
    }

    fn hccl_root_info(&mut self) -> Result<Vec<u8>> {
        self.make_root_info()
    }

    fn join_hccl(&mut self, root: &[u8], world: usize, rank: usize) -> Result<()> {
        self.join_root_info(root, world, rank)
    }
}

impl Drop for AscendBackend {
    fn drop(&mut self) {
        // the buffers, events and stream are freed on the dropping thread: it needs the device too
        if let Err(e) = self.bind() {
            log::warn!("ascend: at shutdown: {e}");
        }
        if let Err(e) = self.synchronize() {
            log::warn!("ascend: synchronize at shutdown failed: {e}");
        }
        self.st.print_profile(&self.describe());
    }
}
