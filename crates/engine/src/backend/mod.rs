//! Backends: where ops run.
//!
//! A backend owns *device-resident* buffers and executes an ordered stream of work on them:
//! `launch` enqueues an op, `write_async`/`read_async` enqueue copies, `record_event` marks a
//! point in the stream and `wait_event`/`synchronize` block the host until the stream got
//! there. That is the shape of a device — Ascend's aclrtMalloc'd memory, aclnn ops on an
//! aclrtStream with the GetWorkspaceSize → execute protocol — and the CPU backend is one
//! implementation of it: host buffers, and a queue of work it runs on its own thread pool
//! when the host waits.
//!
//! What the orchestrator gives a backend:
//! - weights once at load (`upload_weight`, converted by the plan's choice where needed);
//! - per step, the step's index arrays once (`set_step`: token ids, positions, slot mapping,
//!   sequence lengths, block tables), which ops then name by view;
//! - ops ([`Op`]) that name buffers ([`View`]) and weights ([`WeightId`]), never elements.
//!
//! The vocabulary (dtypes, cases, rejections) comes from `tboost-ops`, which the kernel
//! crates share; only `backend/cpu` knows the CPU kernels. `backend/ascend` (cargo feature
//! `ascend`, on by default) runs the ops as aclnn ops through the runtime-loaded CANN bindings.

#[cfg(feature = "ascend")]
pub mod ascend;
pub mod cpu;
mod ext;
pub mod op;
pub mod select;

pub use ext::BackendExt;
pub use op::{AttnKind, ExpertSet, KvLayer, MatSegOp, Op, OpQuery, Segs, SeqRange, StepViews, View};
pub use select::{open, open_with, BackendKind, BackendOptions, BackendSpec};
pub use tboost_ops::{check_tile_kv, DType, MatMulTiling, MoeTiling, Precision, Unsupported, DEFAULT_TILE_KV};

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::model::Tensor;
use crate::Result;

/// A buffer on the backend's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub u32);

/// A weight tensor made resident on the device (zero-copy on the CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightId(pub u32);

/// A point in a backend's stream (`record_event`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// An enqueued device-to-host copy; its bytes are taken with `finish_read`.
#[derive(Debug)]
#[must_use = "a pending read holds staged bytes until finish_read takes them"]
pub struct PendingRead {
    pub(crate) id: u64,
    pub(crate) bytes: usize,
}

/// What the plan report says about the device.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// `cpu`, `ascend`, ... (the backend's name).
    pub backend: String,
    /// The device model (CPU ISA and threads, or the SoC name).
    pub device: String,
    /// Runtime version where there is one (the CANN version).
    pub runtime_version: Option<String>,
}

/// The host's copy of this step's index arrays, handed to `Backend::set_step` together
/// with the views the backend must hold them in.
#[derive(Clone, Copy, Debug)]
pub struct StepHost<'a> {
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    pub slots: &'a [u32],
    /// Per sequence: `[q_start, q_len, ctx_len]`.
    pub seqs: &'a [[u32; 3]],
    /// `seqs.len() * max_blocks` block ids, row-major; unused tails hold `u32::MAX`.
    pub block_tables: &'a [u32],
    pub logit_rows: &'a [u32],
}

pub trait Backend: Send {
    /// Short name for logs and the plan (`cpu`, `ascend`).
    fn name(&self) -> &'static str;

    /// What the device is, for the plan report and the init log.
    fn device(&self) -> DeviceInfo;

    /// Whether the backend has an operator for this case, and if not, which parameter of the
    /// case it cannot take.
    fn supports(&self, query: &OpQuery) -> Result<(), Unsupported>;

    /// The name of the device kernel that would run a supported case (e.g.
    /// `aclnnFusedInferAttentionScoreV2`), for the plan report; `None` when it has no
    /// separate name.
    fn kernel_name(&self, query: &OpQuery) -> Option<String> {
        let _ = query;
        None
    }

    /// Whether its matmul kernels take the work-split tunables `tiling` for `query` (a
    /// `MatMul`, `MatMulFused` or `MatMulSwiGlu` case). The default answer takes only the
    /// defaults: a device's kernels choose their own tiling.
    fn supports_matmul_tiling(&self, query: &OpQuery, tiling: &MatMulTiling) -> Result<(), Unsupported> {
        let _ = query;
        tboost_ops::tiling::default_only(tiling, self.name())
    }

    /// Whether its grouped MoE takes the expert batching `tiling` (by default only the
    /// default, as for matmuls).
    fn supports_moe_tiling(&self, tiling: &MoeTiling) -> Result<(), Unsupported> {
        tboost_ops::tiling::default_only(tiling, self.name())
    }

    /// Element types this backend computes activations in, best first (the plan takes the
    /// first one every op of the model accepts).
    fn activation_dtypes(&self) -> &'static [DType];

    /// Element types its KV cache can hold, best first.
    fn kv_dtypes(&self) -> &'static [DType];

    /// Tokens per KV block its attention ops want when the user does not choose.
    fn preferred_block_size(&self) -> usize {
        16
    }

    /// Allocates a zero-filled buffer of `len` elements of `dtype`.
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId>;

    /// Frees a buffer after the work using it completed. Freeing an unknown id is a no-op.
    fn free(&mut self, buf: BufId);

    /// Element type and length of a live buffer.
    fn buffer(&self, buf: BufId) -> Option<(DType, usize)>;

    /// Bytes currently allocated in buffers (not counting weights).
    fn allocated_bytes(&self) -> usize;

    /// Makes a weight tensor resident as it is (no conversion) and returns its handle. Ids
    /// are handed out consecutively in upload order (the experts of an MoE layer are named
    /// by their first id).
    fn upload_weight(&mut self, tensor: &Tensor) -> Result<WeightId>;

    /// Whether [`Backend::upload_weight`] and [`Backend::upload_packed`] take a tensor mapped
    /// from its file and read its bytes only through `Tensor::read_range` (`pread`), never
    /// `Tensor::bytes`. The engine gives any other backend an owned copy of each mapped
    /// tensor, read with `pread` just before its upload (its host staging): a read of the map
    /// during the upload would be SIGBUS if the file were truncated meanwhile.
    fn reads_mapped_weights(&self) -> bool {
        false
    }

    /// Device bytes of the weights uploaded so far, per dtype as stored in the model (a backend that
    /// keeps block types quantized reports them under their GGUF type). Empty when the backend does
    /// not count (the CPU's weights are the model's own memory).
    fn weight_bytes_by_dtype(&self) -> Vec<(DType, usize)> {
        Vec::new()
    }

    /// Whether [`Backend::upload_packed`] keeps `dtype` matmul weights run at `precision` in
    /// a layout of the backend's own kernels (the CPU: 16-row panels for the `Fast` integer
    /// kernels). The plan asks it for matmul slots and records the answer.
    fn packs(&self, dtype: DType, precision: Precision) -> bool {
        let _ = (dtype, precision);
        false
    }

    /// [`Backend::upload_weight`] for a matmul weight whose slot the plan packed (run at
    /// `precision`): the backend may store it in its own layout (same dtype and values) when
    /// [`Backend::packs`] says so for its dtype, and as it is otherwise. Only matmul ops at
    /// that precision may then read it.
    fn upload_packed(&mut self, tensor: &Tensor, precision: Precision) -> Result<WeightId> {
        let _ = precision;
        self.upload_weight(tensor)
    }

    /// Whether the embedding lookup (`Op::Embed`) reads rows of a `dtype` table that
    /// [`Backend::upload_packed`] packed at `precision`: then a tied embedding table needs no
    /// second, stored copy beside the lm_head's.
    fn embeds_packed(&self, dtype: DType, precision: Precision) -> bool {
        let _ = (dtype, precision);
        false
    }

    /// Copies `src` (exactly the view's bytes in its buffer's dtype) into `dst`, after the
    /// work already enqueued; returns when `src` may be reused.
    fn write(&mut self, dst: View, src: &[u8]) -> Result<()>;

    /// Enqueues the copy of `src` into `dst` on the stream. The backend stages the bytes, so
    /// `src` may be dropped at once.
    fn write_async(&mut self, dst: View, src: &[u8]) -> Result<()>;

    /// Copies `src` to the host after the work already enqueued completed.
    fn read(&mut self, src: View, dst: &mut [u8]) -> Result<()>;

    /// Enqueues a copy of `src` to host staging; `finish_read` waits for it and hands the
    /// bytes over.
    fn read_async(&mut self, src: View) -> Result<PendingRead>;

    /// Waits for a `read_async` and copies its bytes into `dst` (`dst.len()` = its size).
    fn finish_read(&mut self, read: PendingRead, dst: &mut [u8]) -> Result<()>;

    /// Makes this step's index arrays resident in the views of `views` (one copy each) and
    /// keeps whatever host copy its ops need (aclnn takes sequence lengths on the host).
    fn set_step(&mut self, host: &StepHost<'_>, views: &StepViews) -> Result<()>;

    /// Enqueues one op on the stream. An op's errors may surface here or at the next wait.
    fn launch(&mut self, op: &Op) -> Result<()>;

    /// Marks the current end of the stream.
    fn record_event(&mut self) -> Result<EventId>;

    /// Blocks until the stream reached `event`.
    fn wait_event(&mut self, event: EventId) -> Result<()>;

    /// Blocks until every enqueued piece of work has completed.
    fn synchronize(&mut self) -> Result<()>;

    /// A flag the host sets to stop work in progress: once it is set the backend stops at
    /// the next op and fails the stream with `Error::Interrupted`.
    fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        let _ = flag;
    }

    /// The collectives this backend runs on its own memory and stream (HCCL on Ascend), when it
    /// is a rank of a device group; None: the tensor-parallel data plane goes through the host.
    fn device_collective(&mut self) -> Option<&mut dyn DeviceCollective> {
        None
    }

    /// Makes this backend rank `comm.rank()` of an HCCL group (engine key `comm` = `hccl`).
    #[cfg(feature = "ascend")]
    fn attach_hccl(&mut self, comm: ascend_sys::HcclComm) -> Result<()> {
        drop(comm);
        Err(no_hccl(self.name()))
    }

    /// The root info of a new HCCL group (`HcclGetRootInfo` on this backend's device), for the
    /// host to hand to every rank's [`Backend::join_hccl`].
    #[cfg(feature = "ascend")]
    fn hccl_root_info(&mut self) -> Result<Vec<u8>> {
        Err(no_hccl(self.name()))
    }

    /// Makes this backend rank `rank` of the `world` ranks of the HCCL group `root` names
    /// (`HcclCommInitRootInfo`: the ranks may be other processes); blocks until all have joined.
    #[cfg(feature = "ascend")]
    fn join_hccl(&mut self, root: &[u8], world: usize, rank: usize) -> Result<()> {
        let _ = (root, world, rank);
        Err(no_hccl(self.name()))
    }
}

/// Collectives on device memory, queued on the backend's stream like ops (the tensor-parallel
/// data plane without a host round trip). Every rank calls the same ones in the same order; a
/// failure (a rank that does not arrive in time) surfaces at the next synchronize.
pub trait DeviceCollective {
    /// The library (`hccl`).
    fn collective_name(&self) -> &'static str;
    /// Sums `v` over the ranks, in place.
    fn all_reduce_sum(&mut self, v: View) -> Result<()>;
    /// `dst` (ranks × `src.len`) receives every rank's `src`, in rank order.
    fn all_gather(&mut self, src: View, dst: View) -> Result<()>;
    /// Whether the device fuses a matmul with the all-reduce of its output in one op (Ascend's
    /// MC2); the reason when it does not.
    fn fused_matmul_all_reduce(&self) -> std::result::Result<(), Unsupported> {
        Err(Unsupported::new("collective", self.collective_name(), "a device with a fused matmul + all-reduce"))
    }
    /// `out = x · wᵀ` (`x` `[m, k]`) summed over the ranks in one op, queued: `Ok(false)` when this
    /// weight cannot take it (the caller then runs the matmul and the all-reduce).
    fn matmul_all_reduce(&mut self, _x: View, _m: usize, _w: WeightId, _out: View) -> Result<bool> {
        Ok(false)
    }
}

#[cfg(feature = "ascend")]
fn no_hccl(backend: &str) -> crate::Error {
    crate::Error::Unsupported(format!("comm = hccl needs the ascend backend; {backend} has no device collectives"))
}
