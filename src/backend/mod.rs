//! Backends: where ops run.
//!
//! A backend owns *device-resident* buffers and executes an ordered stream of ops on them
//! (`launch` enqueues, `synchronize` waits), so that a device backend — Ascend's
//! aclrtMalloc'd memory and aclnn ops on an aclrtStream with the GetWorkspaceSize → execute
//! protocol — fits the same trait. The CPU backend is one implementation: its buffers are
//! host memory and `launch` runs the kernel at once on the engine's own thread pool.
//!
//! The orchestrator only ever names buffers (`View`) and weights (`WeightId`) in ops; it
//! never touches their elements, except for reading logits back with `read`.

pub mod cpu;
mod cpu_pool;
pub mod op;

pub use op::{AttnKind, KvLayer, Op, OpQuery, View};
use tboost_ops::DType;

use crate::model::Tensor;
use crate::Result;

/// A buffer on the backend's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufId(pub(crate) u32);

/// A weight tensor made resident on the device (zero-copy on the CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightId(pub(crate) u32);

pub trait Backend: Send {
    /// Short name for logs and the plan ("cpu", "ascend").
    fn name(&self) -> &'static str;

    /// A description of the device and the kernel variant in use (e.g. "cpu avx512 x2 threads").
    fn describe(&self) -> String;

    /// Compute threads this backend uses.
    fn threads(&self) -> usize;

    /// Whether the backend has an operator for this case, and if not, why.
    fn supports(&self, query: &OpQuery) -> Result<(), tboost_ops::Unsupported>;

    /// Allocates a zero-filled buffer of `len` elements of `dtype`.
    fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId>;

    /// Frees a buffer. Freeing an unknown id is a no-op.
    fn free(&mut self, buf: BufId);

    /// Bytes currently allocated in buffers (not counting weights).
    fn allocated_bytes(&self) -> usize;

    /// Makes a weight tensor resident and returns its handle.
    fn upload_weight(&mut self, tensor: &Tensor) -> Result<WeightId>;

    /// Copies host f32 values into an f32 buffer view (`data.len() == view.len`).
    fn write(&mut self, view: View, data: &[f32]) -> Result<()>;

    /// Copies an f32 buffer view back to the host, after the ops before it completed.
    fn read(&mut self, view: View, out: &mut [f32]) -> Result<()>;

    /// Enqueues one op on the stream.
    fn launch(&mut self, op: &Op<'_>) -> Result<()>;

    /// Waits until every launched op has completed.
    fn synchronize(&mut self) -> Result<()>;

    /// Runs `work`, which launches a sequence of ops, as one stream: a backend may set up
    /// its execution context once for the whole sequence (the CPU backend runs it on its own
    /// pool, so each op starts without a cross-thread hand-off).
    fn with_stream(&mut self, work: &mut (dyn FnMut(&mut dyn Backend) -> Result<()> + Send)) -> Result<()>;
}
