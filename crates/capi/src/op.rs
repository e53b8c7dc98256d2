//! The operator API over the C ABI (`::tboost_engine::op_api`): a backend handle, buffers on it
//! (activations and outputs from `tboost_backend_alloc`, weights from
//! `tboost_backend_upload_weight`), tensors described by dtype + shape + strides + buffer, and
//! operations created from a kind and its parameter struct.

use std::os::raw::{c_char, c_void};
use std::sync::Arc;

use super::guard::guard;
use super::handle::Registry;
use super::status::{tboost_status, Failure, FfiResult};
use super::util::{read_cstr, read_sized, read_slice, require, write_out, write_str};
use ::tboost_engine::backend::{open_with, AttnKind, BackendKind, BackendSpec, DType, Precision};
use ::tboost_engine::engine::EngineConfig;
use ::tboost_engine::op_api::{
    AttentionParams, EmbedParams, MatMulParams, Mem, MoeGroupedParams, MoeRouteParams, NormParams, OpBackend, OpParams,
    Operation, RopeOpParams, TensorRef,
};
use tboost_ops::{MatMulTiling, MoeTiling, RopeParams, RopeStyle};

/// A compute backend opened for the operator API (`tboost_backend_open`). Thread-safe: calls
/// on one backend are serialized.
pub struct tboost_backend {
    _opaque: [u8; 0],
}

/// Memory on a backend: a buffer (`tboost_backend_alloc`) or a resident weight
/// (`tboost_backend_upload_weight`). Tensors name it with an element offset.
pub struct tboost_buffer {
    _opaque: [u8; 0],
}

/// One operator with its parameters on one backend (`tboost_op_create`).
pub struct tboost_op {
    _opaque: [u8; 0],
}

/// Element types. The numbers are stable.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_dtype {
    TBOOST_DTYPE_F32 = 0,
    TBOOST_DTYPE_F16 = 1,
    TBOOST_DTYPE_BF16 = 2,
    TBOOST_DTYPE_I64 = 3,
    TBOOST_DTYPE_I32 = 4,
    TBOOST_DTYPE_U32 = 5,
    TBOOST_DTYPE_I8 = 6,
    TBOOST_DTYPE_U8 = 7,
    /// GGUF block types (weights only), in ggml's block layout.
    TBOOST_DTYPE_Q4_0 = 8,
    TBOOST_DTYPE_Q5_0 = 9,
    TBOOST_DTYPE_Q8_0 = 10,
    TBOOST_DTYPE_Q4_K = 11,
    TBOOST_DTYPE_Q5_K = 12,
    TBOOST_DTYPE_Q6_K = 13,
    TBOOST_DTYPE_Q4_1 = 14,
    TBOOST_DTYPE_Q5_1 = 15,
    TBOOST_DTYPE_IQ4_NL = 16,
    TBOOST_DTYPE_IQ4_XS = 17,
    TBOOST_DTYPE_Q2_K = 18,
    TBOOST_DTYPE_Q3_K = 19,
}

/// The operators `tboost_op_create` makes, each with its parameter struct.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_op_kind {
    /// `tboost_matmul_params`. Inputs: x [m, k], weight [n, k] (a weight buffer), optional
    /// bias [n] (a weight buffer). Outputs: y [m, n].
    TBOOST_OP_MATMUL = 0,
    /// `tboost_norm_params`. Inputs: x [rows, dim], gain [dim] (a weight buffer). Outputs:
    /// y [rows, dim].
    TBOOST_OP_RMSNORM = 1,
    /// `tboost_norm_params`. Inputs: x [rows, dim], gain [dim]. Outputs: residual [rows, dim]
    /// (read, `+= x`, written back), y [rows, dim].
    TBOOST_OP_ADD_RMSNORM = 2,
    /// `tboost_swiglu_params`. Inputs: gate [rows, n], up [rows, n]. Outputs: y [rows, n].
    TBOOST_OP_SWIGLU = 3,
    /// `tboost_attention_params`. Inputs: q [rows, heads * head_dim], k_cache and v_cache
    /// (whole buffers [blocks, block_size, kv_heads, head_dim] of kv_dtype), seqs [count, 3]
    /// u32 (q_start, q_len, ctx_len per sequence), block_tables [count, max_blocks] u32.
    /// Outputs: out [rows, heads * head_dim].
    TBOOST_OP_ATTENTION = 4,
    /// `tboost_embed_params`. Inputs: ids [n] u32, table [vocab, hidden] (a weight buffer).
    /// Outputs: y [n, hidden]. An id >= vocab is `TBOOST_ERR_INVALID_ARGUMENT`.
    TBOOST_OP_EMBED = 5,
    /// `tboost_rope_params`. Inputs: positions [rows] u32. Outputs: x [rows, heads, head_dim]
    /// (or [rows, heads * head_dim]), rotated in place. Workspace: the cos/sin tables
    /// (`tboost_op_workspace_size`), or NULL.
    TBOOST_OP_ROPE = 6,
    /// `tboost_moe_route_params`. Inputs: logits [m, experts]. Outputs: ids [m, top_k] u32
    /// (each token's experts, best first), weights [m, top_k] (softmax over all experts,
    /// renormalized over the top k).
    TBOOST_OP_MOE_ROUTE = 7,
    /// `tboost_moe_grouped_params`. Inputs: x [m, hidden], ids and weights (as
    /// `TBOOST_OP_MOE_ROUTE` outputs them), then per expert its gate [inter, hidden], up
    /// [inter, hidden] and down [hidden, inter] weight buffers, uploaded consecutively in
    /// that order (3 × experts tensors). Outputs: y [m, hidden] = Σ_k weight_k ·
    /// down_e(silu(gate_e · x) * up_e · x) over each token's experts e.
    TBOOST_OP_MOE_GROUPED = 8,
    /// `tboost_matmul_swiglu_params`. Inputs: x [m, k], gate [n, k] and up [n, k] (weight
    /// buffers). Outputs: y [m, n] = silu(x · gateᵀ) * (x · upᵀ), in one kernel (the plan's
    /// fused gate-up SwiGLU).
    TBOOST_OP_MATMUL_SWIGLU = 9,
}

/// The CPU kernels' work split of a matmul (in `tboost_matmul_params` and
/// `tboost_matmul_swiglu_params`). 0 in a field = the op's default. No value changes a result,
/// only speed. A value outside its range is `TBOOST_ERR_INVALID_ARGUMENT` at
/// `tboost_op_create`, naming the op, the field and the range; a backend whose kernels tile
/// themselves (Ascend), and the bf16 kernels of fast precision, take only the defaults
/// (`tboost_op_supports` says why).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct tboost_matmul_tiling {
    /// Weight rows (output features) per task: a multiple of 16 in 16..=4096.
    pub panel_rows: u32,
    /// Activation rows (tokens) per task: 1..=65536.
    pub act_rows: u32,
    /// Tasks per thread the split aims at: 1..=64 (default 8 in decode, 4 otherwise; by
    /// default a decode split's last tasks shrink so the threads finish together, a set value
    /// gives even tasks).
    pub tasks_per_thread: u32,
    /// Least weight bytes of a block-quantized decode task: a multiple of 1024 in
    /// 4096..=16777216 (default 32768).
    pub decode_task_min_bytes: u32,
}

/// The CPU kernel's expert batching of `TBOOST_OP_MOE_GROUPED` (0 = the op's default), under the
/// rules of `tboost_matmul_tiling`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct tboost_moe_tiling {
    /// Most tokens in one expert batch: 1..=65536 (default: all of an expert's tokens).
    pub expert_batch_tokens: u32,
    /// Expert batches run at once: 1..=64 (default 1).
    pub parallel_expert_batches: u32,
}

/// Parameters of `TBOOST_OP_MATMUL_SWIGLU`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_matmul_swiglu_params {
    /// sizeof(tboost_matmul_swiglu_params).
    pub struct_size: u32,
    /// The `tboost_dtype` of gate and up (dense or a GGUF block type).
    pub weight_dtype: i32,
    /// Output features (rows of gate and of up).
    pub n: u64,
    /// Input features (their columns).
    pub k: u64,
    /// 0 = exact, 1 = fast (8-bit activations where the backend has them).
    pub precision: u32,
    /// `tboost_dtype` of x and y; -1 = the backend's activation dtype.
    pub act_dtype: i32,
    pub tiling: tboost_matmul_tiling,
}

/// Parameters of `TBOOST_OP_MOE_ROUTE`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_moe_route_params {
    /// sizeof(tboost_moe_route_params).
    pub struct_size: u32,
    pub experts: u32,
    pub top_k: u32,
    /// `tboost_dtype` of the logits and the weights; -1 = the backend's activation dtype.
    pub act_dtype: i32,
}

/// Parameters of `TBOOST_OP_MOE_GROUPED`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_moe_grouped_params {
    /// sizeof(tboost_moe_grouped_params).
    pub struct_size: u32,
    pub experts: u32,
    pub top_k: u32,
    /// `tboost_dtype` of every expert weight.
    pub weight_dtype: i32,
    pub hidden: u64,
    /// Each expert's intermediate size.
    pub inter: u64,
    /// `tboost_dtype` of x, the routing weights and y; -1 = the backend's activation dtype.
    pub act_dtype: i32,
    pub reserved: u32,
    /// Expert batching (appended: a struct_size of 40 leaves the defaults).
    pub tiling: tboost_moe_tiling,
}

/// Parameters of `TBOOST_OP_EMBED`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_embed_params {
    /// sizeof(tboost_embed_params).
    pub struct_size: u32,
    /// `tboost_dtype` of the table.
    pub table_dtype: i32,
    pub vocab: u64,
    pub hidden: u64,
    /// `tboost_dtype` of y; -1 = the backend's activation dtype.
    pub act_dtype: i32,
    pub reserved: u32,
}

/// Parameters of `TBOOST_OP_ROPE`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tboost_rope_params {
    /// sizeof(tboost_rope_params).
    pub struct_size: u32,
    pub heads: u32,
    pub head_dim: u32,
    /// Rotated dimensions of each head (even, at most head_dim; 0 = head_dim).
    pub rot_dim: u32,
    /// Base of the inverse frequencies (e.g. 10000).
    pub theta: f64,
    /// 0 = half split (NeoX, Llama HF), 1 = adjacent pairs (GPT-J).
    pub style: u32,
    /// `tboost_dtype` of x; -1 = the backend's activation dtype.
    pub act_dtype: i32,
}

/// The attention algorithm of `tboost_attention_params.kind`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_attention_kind {
    /// FlashAttention (tiled, online softmax): prefill chunks, any rows per sequence.
    TBOOST_ATTENTION_FLASH = 0,
    /// Materialized scores; any head_dim.
    TBOOST_ATTENTION_STANDARD = 1,
    /// One query row per sequence over its paged KV.
    TBOOST_ATTENTION_PAGED_DECODE = 2,
}

/// Direction of `tboost_backend_copy`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_copy_kind {
    /// Host bytes into a buffer tensor.
    TBOOST_COPY_HOST_TO_BACKEND = 0,
    /// A buffer tensor into host bytes (waits for the work enqueued before).
    TBOOST_COPY_BACKEND_TO_HOST = 1,
}

/// Most dimensions a `tboost_tensor` describes.
pub const TBOOST_TENSOR_MAX_DIMS: usize = 8;

/// A tensor on a backend: `ndim` sizes in `shape` (outermost first) and `strides` (in
/// elements; operations take contiguous row-major tensors only), over `buffer` starting
/// `offset` elements in. Set `struct_size` to sizeof(tboost_tensor); `tboost_tensor_init`
/// fills a contiguous one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_tensor {
    pub struct_size: u32,
    /// A `tboost_dtype`.
    pub dtype: i32,
    pub ndim: u32,
    pub reserved: u32,
    pub shape: [u64; TBOOST_TENSOR_MAX_DIMS],
    pub strides: [u64; TBOOST_TENSOR_MAX_DIMS],
    pub buffer: *mut tboost_buffer,
    /// Element offset into the buffer (0 for weights).
    pub offset: u64,
}

const TENSOR_V1: usize = std::mem::size_of::<tboost_tensor>();

/// Parameters of `TBOOST_OP_MATMUL`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_matmul_params {
    /// sizeof(tboost_matmul_params).
    pub struct_size: u32,
    /// The weight's `tboost_dtype` (dense or a GGUF block type).
    pub weight_dtype: i32,
    /// Output features (weight rows).
    pub n: u64,
    /// Input features (weight columns).
    pub k: u64,
    /// Nonzero: a bias [n] is the third input.
    pub bias: u32,
    /// 0 = exact, 1 = fast (8-bit activations where the backend has them).
    pub precision: u32,
    /// `tboost_dtype` of x and y; -1 = the backend's activation dtype.
    pub act_dtype: i32,
    pub reserved: u32,
    /// The CPU kernels' work split (appended: a struct_size of 40 leaves the defaults).
    pub tiling: tboost_matmul_tiling,
}

/// Parameters of `TBOOST_OP_RMSNORM` and `TBOOST_OP_ADD_RMSNORM`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tboost_norm_params {
    /// sizeof(tboost_norm_params).
    pub struct_size: u32,
    /// `tboost_dtype` of the gain.
    pub gain_dtype: i32,
    pub dim: u64,
    pub eps: f32,
    /// `tboost_dtype` of x, y (and residual); -1 = the backend's activation dtype.
    pub act_dtype: i32,
}

/// Parameters of `TBOOST_OP_SWIGLU`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct tboost_swiglu_params {
    /// sizeof(tboost_swiglu_params).
    pub struct_size: u32,
    /// `tboost_dtype` of gate, up and y; -1 = the backend's activation dtype.
    pub act_dtype: i32,
}

/// Parameters of `TBOOST_OP_ATTENTION`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tboost_attention_params {
    /// sizeof(tboost_attention_params).
    pub struct_size: u32,
    /// A `tboost_attention_kind`.
    pub kind: i32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// `tboost_dtype` of the K/V pools; -1 = the activation dtype.
    pub kv_dtype: i32,
    /// `tboost_dtype` of q and out; -1 = the backend's activation dtype.
    pub act_dtype: i32,
    /// Longest context a sequence may reach (asked of the backend as the plan asks it).
    pub max_context: u64,
    /// Score scale; 0 = 1/sqrt(head_dim).
    pub scale: f32,
    /// FlashAttention's KV tile (flash and paged decode): 16, 32, 64, 128 or 256; 0 = the
    /// default (64). Another value is `TBOOST_ERR_INVALID_ARGUMENT` at `tboost_op_create`.
    pub tile_kv: u32,
}

pub(crate) struct BackendInner {
    pub(super) be: OpBackend,
}

pub(crate) struct BufferInner {
    backend: Arc<BackendInner>,
    mem: Mem,
    dtype: DType,
    /// A weight's shape as uploaded (tensors naming it must say the same).
    shape: Vec<usize>,
}

impl Drop for BufferInner {
    fn drop(&mut self) {
        if let Mem::Buffer { buf, .. } = self.mem {
            if let Ok(mut be) = self.backend.be.lock() {
                // Work using the buffer may still be queued.
                let _ = be.synchronize();
                be.free(buf);
            }
        }
    }
}

pub(crate) struct OpInner {
    pub(super) backend: Arc<BackendInner>,
    pub(super) op: Operation,
}

pub(super) static BACKENDS: Registry<BackendInner> = Registry::new("backend");
static BUFFERS: Registry<BufferInner> = Registry::new("buffer");
pub(super) static OPS: Registry<OpInner> = Registry::new("op");

/// `tboost_dtype` values are indices into `DType::ALL` (append only: the C enum is frozen).
const DTYPES: [DType; 20] = DType::ALL;

pub(super) fn dtype_of(v: i32, param: &str) -> FfiResult<DType> {
    usize::try_from(v)
        .ok()
        .and_then(|i| DTYPES.get(i).copied())
        .ok_or_else(|| Failure::invalid(format!("`{param}` = {v} is not a tboost_dtype (0..={})", DTYPES.len() - 1)))
}

fn precision_of(v: u32) -> FfiResult<Precision> {
    match v {
        0 => Ok(Precision::Exact),
        1 => Ok(Precision::Fast),
        v => Err(Failure::invalid(format!("`params.precision` = {v}: 0 (exact) or 1 (fast)"))),
    }
}

/// 0 = unset.
fn tunable(v: u32) -> Option<usize> {
    (v != 0).then_some(v as usize)
}

fn matmul_tiling_of(t: &tboost_matmul_tiling) -> MatMulTiling {
    MatMulTiling {
        panel_rows: tunable(t.panel_rows),
        act_rows: tunable(t.act_rows),
        tasks_per_thread: tunable(t.tasks_per_thread),
        decode_task_min_bytes: tunable(t.decode_task_min_bytes),
    }
}

fn act_of(v: i32, be: &OpBackend, param: &str) -> FfiResult<DType> {
    if v == -1 {
        return Ok(be.activation_dtype()?);
    }
    dtype_of(v, param)
}

pub(super) fn dims(shape: &[u64], param: &str) -> FfiResult<Vec<usize>> {
    if shape.len() > TBOOST_TENSOR_MAX_DIMS {
        return Err(Failure::invalid(format!(
            "`{param}`: {} dimensions, at most {TBOOST_TENSOR_MAX_DIMS}",
            shape.len()
        )));
    }
    shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| Failure::invalid(format!("`{param}`: {d} does not fit size_t"))))
        .collect()
}

/// Fills `*t` as a contiguous tensor of `ndim` sizes over `buffer` at element 0
/// (`struct_size`, dtype from the buffer, row-major strides). Returns
/// `TBOOST_ERR_INVALID_ARGUMENT` for more than `TBOOST_TENSOR_MAX_DIMS` dimensions,
/// `TBOOST_ERR_INVALID_HANDLE` for a buffer that is not live.
#[no_mangle]
pub unsafe extern "C" fn tboost_tensor_init(
    t: *mut tboost_tensor,
    buffer: *mut tboost_buffer,
    shape: *const u64,
    ndim: usize,
) -> tboost_status {
    guard("tboost_tensor_init", |_| {
        require(t, "t")?;
        let b = BUFFERS.get(buffer, "buffer")?;
        // SAFETY: `ndim` readable elements per the contract.
        let s = dims(unsafe { read_slice(shape, ndim, "shape") }?, "shape")?;
        let strides = ::tboost_engine::op_api::contiguous_strides(&s);
        let mut v = tboost_tensor {
            struct_size: TENSOR_V1 as u32,
            dtype: DTYPES.iter().position(|&d| d == b.dtype).map_or(-1, |i| i as i32),
            ndim: s.len() as u32,
            reserved: 0,
            shape: [0; TBOOST_TENSOR_MAX_DIMS],
            strides: [0; TBOOST_TENSOR_MAX_DIMS],
            buffer,
            offset: 0,
        };
        for i in 0..s.len() {
            v.shape[i] = s[i] as u64;
            v.strides[i] = strides[i] as u64;
        }
        // SAFETY: non-null, valid for writes per the contract.
        unsafe { t.write(v) };
        Ok(())
    })
}

/// Opens a backend by name: "cpu", "ascend", "ascend:N" or "auto" (as the engine's `backend`
/// option). `threads`: CPU compute threads, 0 = one per core. On success `*out` is a new
/// handle to free with `tboost_backend_free`. `TBOOST_ERR_INVALID_ARGUMENT` for an unknown
/// name, `TBOOST_ERR_UNSUPPORTED` when the device is not there. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_backend_open(
    name: *const c_char,
    threads: u32,
    out: *mut *mut tboost_backend,
) -> tboost_status {
    guard("tboost_backend_open", |_| {
        require(out, "out")?;
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { read_cstr(name, "name") }?;
        let kind = BackendKind::parse(name)?;
        // The engine keys' environment defaults apply here too (`auto` → TBOOST_BACKEND,
        // pin_threads, profile): this call takes no config.
        let env = EngineConfig::from_env()?;
        let kind = if kind == BackendKind::Auto { env.backend } else { kind };
        let be = OpBackend::new(open_with(BackendSpec { kind, threads: threads as usize }, &env.backend_options())?);
        let h = BACKENDS.insert(Arc::new(BackendInner { be }));
        // SAFETY: checked non-null above.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees a backend handle. Buffers and operations made on it keep it alive until they are
/// freed too. NULL is a no-op.
#[no_mangle]
pub extern "C" fn tboost_backend_free(backend: *mut tboost_backend) -> tboost_status {
    guard("tboost_backend_free", |_| {
        if !backend.is_null() {
            BACKENDS.remove(backend, "backend")?;
        }
        Ok(())
    })
}

/// Allocates a zero-filled buffer of `ndim` sizes of a dense `dtype` (f32, f16, bf16 or an
/// integer type) on the backend. Free it with `tboost_buffer_free`.
#[no_mangle]
pub unsafe extern "C" fn tboost_backend_alloc(
    backend: *mut tboost_backend,
    dtype: i32,
    shape: *const u64,
    ndim: usize,
    out: *mut *mut tboost_buffer,
) -> tboost_status {
    guard("tboost_backend_alloc", |_| {
        require(out, "out")?;
        let b = BACKENDS.get(backend, "backend")?;
        let dtype = dtype_of(dtype, "dtype")?;
        // SAFETY: `ndim` readable elements per the contract.
        let s = dims(unsafe { read_slice(shape, ndim, "shape") }?, "shape")?;
        let t = b.be.alloc(dtype, &s)?;
        let inner = BufferInner { backend: b, mem: t.mem, dtype, shape: s };
        // SAFETY: checked non-null above.
        unsafe { write_out(out, BUFFERS.insert(Arc::new(inner))) };
        Ok(())
    })
}

/// Makes `bytes` bytes at `data` (a tensor of `ndim` sizes of `dtype`; GGUF block layout for
/// the quantized types) resident as a weight: the weight, bias, gain or table input of an
/// operation. The bytes are copied before the call returns. The weight stays resident until
/// the backend is dropped; `tboost_buffer_free` releases the handle.
#[no_mangle]
pub unsafe extern "C" fn tboost_backend_upload_weight(
    backend: *mut tboost_backend,
    dtype: i32,
    shape: *const u64,
    ndim: usize,
    data: *const c_void,
    bytes: usize,
    out: *mut *mut tboost_buffer,
) -> tboost_status {
    guard("tboost_backend_upload_weight", |_| {
        require(out, "out")?;
        let b = BACKENDS.get(backend, "backend")?;
        let dtype = dtype_of(dtype, "dtype")?;
        // SAFETY: readable for the sizes given per the contract.
        let s = dims(unsafe { read_slice(shape, ndim, "shape") }?, "shape")?;
        let data = unsafe { read_slice(data.cast::<u8>(), bytes, "data") }?;
        let t = b.be.upload_weight(dtype, &s, data.to_vec())?;
        let inner = BufferInner { backend: b, mem: t.mem, dtype, shape: s };
        // SAFETY: checked non-null above.
        unsafe { write_out(out, BUFFERS.insert(Arc::new(inner))) };
        Ok(())
    })
}

/// Releases a buffer handle (a buffer's memory is freed after the work using it). NULL is a
/// no-op.
#[no_mangle]
pub extern "C" fn tboost_buffer_free(buffer: *mut tboost_buffer) -> tboost_status {
    guard("tboost_buffer_free", |_| {
        if !buffer.is_null() {
            BUFFERS.remove(buffer, "buffer")?;
        }
        Ok(())
    })
}

/// A C tensor as the operator API's, checked against its buffer handle; keeps the buffer
/// alive for the call.
pub(super) fn tensor_of(
    t: &tboost_tensor,
    backend: &Arc<BackendInner>,
    what: &str,
) -> FfiResult<(TensorRef, Arc<BufferInner>)> {
    let b = BUFFERS.get(t.buffer, &format!("{what}.buffer"))?;
    if !Arc::ptr_eq(&b.backend, backend) {
        return Err(Failure::invalid(format!("`{what}`: its buffer belongs to another tboost_backend")));
    }
    let dtype = dtype_of(t.dtype, &format!("{what}.dtype"))?;
    let n = t.ndim as usize;
    if n > TBOOST_TENSOR_MAX_DIMS {
        return Err(Failure::invalid(format!("`{what}.ndim` = {n}, at most {TBOOST_TENSOR_MAX_DIMS}")));
    }
    let shape = dims(&t.shape[..n], &format!("{what}.shape"))?;
    let strides = dims(&t.strides[..n], &format!("{what}.strides"))?;
    let offset = usize::try_from(t.offset).map_err(|_| Failure::invalid(format!("`{what}.offset` is too large")))?;
    let mem = match b.mem {
        Mem::Buffer { buf, .. } => Mem::Buffer { buf, offset },
        Mem::Weight(id) => {
            if offset != 0 || shape != b.shape {
                return Err(Failure::invalid(format!(
                    "`{what}`: a weight is named whole (offset 0, shape {:?} as uploaded), not offset {offset} \
                     shape {shape:?}",
                    b.shape
                )));
            }
            Mem::Weight(id)
        }
    };
    if dtype != b.dtype {
        return Err(Failure::invalid(format!("`{what}.dtype` is {dtype} but its buffer holds {}", b.dtype)));
    }
    Ok((TensorRef { mem, dtype, shape, strides }, b))
}

/// Reads a C tensor argument (`struct_size` checked).
pub(super) unsafe fn read_tensor(p: *const tboost_tensor, what: &str) -> FfiResult<tboost_tensor> {
    let default = tboost_tensor {
        struct_size: 0,
        dtype: -1,
        ndim: 0,
        reserved: 0,
        shape: [0; TBOOST_TENSOR_MAX_DIMS],
        strides: [0; TBOOST_TENSOR_MAX_DIMS],
        buffer: std::ptr::null_mut(),
        offset: 0,
    };
    // SAFETY: NULL or `struct_size` readable bytes per the contract.
    unsafe { read_sized(p, default, TENSOR_V1, what) }
}

/// Copies between host memory and a buffer tensor (contiguous, exactly its bytes):
/// `TBOOST_COPY_HOST_TO_BACKEND` writes `bytes` bytes from `host` into `*t`,
/// `TBOOST_COPY_BACKEND_TO_HOST` reads `*t` into `host` after the work enqueued before.
/// `TBOOST_ERR_INVALID_ARGUMENT` when `bytes` is not the tensor's size, the tensor is a
/// weight or not contiguous, or it runs past its buffer.
#[no_mangle]
pub unsafe extern "C" fn tboost_backend_copy(
    backend: *mut tboost_backend,
    t: *const tboost_tensor,
    host: *mut c_void,
    bytes: usize,
    kind: i32,
) -> tboost_status {
    guard("tboost_backend_copy", |_| {
        let b = BACKENDS.get(backend, "backend")?;
        // SAFETY: per the contract.
        let ct = unsafe { read_tensor(t, "t") }?;
        let (tr, _keep) = tensor_of(&ct, &b, "t")?;
        if kind == tboost_copy_kind::TBOOST_COPY_HOST_TO_BACKEND as i32 {
            // SAFETY: `bytes` readable bytes per the contract.
            let src = unsafe { read_slice(host.cast_const().cast::<u8>(), bytes, "host") }?;
            b.be.write(&tr, src)?;
        } else if kind == tboost_copy_kind::TBOOST_COPY_BACKEND_TO_HOST as i32 {
            if bytes > 0 {
                require(host, "host")?;
            }
            // SAFETY: `bytes` writable bytes per the contract (non-null checked when > 0).
            let dst: &mut [u8] =
                if bytes == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), bytes) } };
            b.be.read(&tr, dst)?;
        } else {
            return Err(Failure::invalid(format!("`kind` = {kind} is not a tboost_copy_kind")));
        }
        Ok(())
    })
}

/// Blocks until every operation enqueued on the backend completed; returns the first
/// failure of that work.
#[no_mangle]
pub extern "C" fn tboost_backend_synchronize(backend: *mut tboost_backend) -> tboost_status {
    guard("tboost_backend_synchronize", |_| {
        let b = BACKENDS.get(backend, "backend")?;
        b.be.synchronize()?;
        Ok(())
    })
}

/// Creates an operation of `kind` with `params` (the kind's parameter struct, `struct_size`
/// set). Parameters that describe no op (a zero size, an unknown dtype) give
/// `TBOOST_ERR_INVALID_ARGUMENT`; a case the backend cannot run is not an error here (ask
/// `tboost_op_supports`). Free with `tboost_op_free`.
#[no_mangle]
pub unsafe extern "C" fn tboost_op_create(
    backend: *mut tboost_backend,
    kind: i32,
    params: *const c_void,
    out: *mut *mut tboost_op,
) -> tboost_status {
    guard("tboost_op_create", |_| {
        require(out, "out")?;
        let b = BACKENDS.get(backend, "backend")?;
        let size = |d: u64, p: &str| {
            usize::try_from(d).map_err(|_| Failure::invalid(format!("`params.{p}` = {d} does not fit size_t")))
        };
        let p = if kind == tboost_op_kind::TBOOST_OP_MATMUL as i32 {
            let d = tboost_matmul_params {
                struct_size: 0,
                weight_dtype: 0,
                n: 0,
                k: 0,
                bias: 0,
                precision: 0,
                act_dtype: -1,
                reserved: 0,
                tiling: tboost_matmul_tiling::default(),
            };
            // SAFETY: NULL or `struct_size` readable bytes per the contract.
            let m = unsafe { read_sized(params.cast::<tboost_matmul_params>(), d, 40, "params") }?;
            OpParams::MatMul(MatMulParams {
                weight: dtype_of(m.weight_dtype, "params.weight_dtype")?,
                n: size(m.n, "n")?,
                k: size(m.k, "k")?,
                bias: m.bias != 0,
                precision: precision_of(m.precision)?,
                act: act_of(m.act_dtype, &b.be, "params.act_dtype")?,
                tiling: matmul_tiling_of(&m.tiling),
            })
        } else if kind == tboost_op_kind::TBOOST_OP_MATMUL_SWIGLU as i32 {
            let d = tboost_matmul_swiglu_params {
                struct_size: 0,
                weight_dtype: 0,
                n: 0,
                k: 0,
                precision: 0,
                act_dtype: -1,
                tiling: tboost_matmul_tiling::default(),
            };
            // SAFETY: as above.
            let m = unsafe { read_sized(params.cast::<tboost_matmul_swiglu_params>(), d, 48, "params") }?;
            OpParams::MatMulSwiGlu(MatMulParams {
                weight: dtype_of(m.weight_dtype, "params.weight_dtype")?,
                n: size(m.n, "n")?,
                k: size(m.k, "k")?,
                bias: false,
                precision: precision_of(m.precision)?,
                act: act_of(m.act_dtype, &b.be, "params.act_dtype")?,
                tiling: matmul_tiling_of(&m.tiling),
            })
        } else if kind == tboost_op_kind::TBOOST_OP_RMSNORM as i32
            || kind == tboost_op_kind::TBOOST_OP_ADD_RMSNORM as i32
        {
            let d = tboost_norm_params { struct_size: 0, gain_dtype: 0, dim: 0, eps: 1e-6, act_dtype: -1 };
            // SAFETY: as above.
            let n = unsafe { read_sized(params.cast::<tboost_norm_params>(), d, 24, "params") }?;
            let np = NormParams {
                dim: size(n.dim, "dim")?,
                eps: n.eps,
                gain: dtype_of(n.gain_dtype, "params.gain_dtype")?,
                act: act_of(n.act_dtype, &b.be, "params.act_dtype")?,
            };
            if kind == tboost_op_kind::TBOOST_OP_RMSNORM as i32 {
                OpParams::RmsNorm(np)
            } else {
                OpParams::AddRmsNorm(np)
            }
        } else if kind == tboost_op_kind::TBOOST_OP_ATTENTION as i32 {
            let d = tboost_attention_params {
                struct_size: 0,
                kind: 0,
                heads: 0,
                kv_heads: 0,
                head_dim: 0,
                block_size: 16,
                kv_dtype: -1,
                act_dtype: -1,
                max_context: 4096,
                scale: 0.0,
                tile_kv: 0,
            };
            // SAFETY: as above.
            let a = unsafe { read_sized(params.cast::<tboost_attention_params>(), d, 48, "params") }?;
            let kind = match a.kind {
                0 => AttnKind::Flash,
                1 => AttnKind::Standard,
                2 => AttnKind::PagedDecode,
                v => return Err(Failure::invalid(format!("`params.kind` = {v} is not a tboost_attention_kind"))),
            };
            let act = act_of(a.act_dtype, &b.be, "params.act_dtype")?;
            OpParams::Attention(AttentionParams {
                kind,
                heads: a.heads as usize,
                kv_heads: a.kv_heads as usize,
                head_dim: a.head_dim as usize,
                scale: (a.scale != 0.0).then_some(a.scale),
                block_size: a.block_size as usize,
                kv_dtype: if a.kv_dtype == -1 { act } else { dtype_of(a.kv_dtype, "params.kv_dtype")? },
                max_context: size(a.max_context, "max_context")?,
                act,
                tile_kv: (a.tile_kv != 0).then_some(a.tile_kv as usize),
            })
        } else if kind == tboost_op_kind::TBOOST_OP_EMBED as i32 {
            let d =
                tboost_embed_params { struct_size: 0, table_dtype: 0, vocab: 0, hidden: 0, act_dtype: -1, reserved: 0 };
            // SAFETY: as above.
            let e = unsafe { read_sized(params.cast::<tboost_embed_params>(), d, 32, "params") }?;
            OpParams::Embed(EmbedParams {
                table: dtype_of(e.table_dtype, "params.table_dtype")?,
                vocab: size(e.vocab, "vocab")?,
                hidden: size(e.hidden, "hidden")?,
                act: act_of(e.act_dtype, &b.be, "params.act_dtype")?,
            })
        } else if kind == tboost_op_kind::TBOOST_OP_ROPE as i32 {
            let d = tboost_rope_params {
                struct_size: 0,
                heads: 0,
                head_dim: 0,
                rot_dim: 0,
                theta: 10000.0,
                style: 0,
                act_dtype: -1,
            };
            // SAFETY: as above.
            let r = unsafe { read_sized(params.cast::<tboost_rope_params>(), d, 32, "params") }?;
            let style = match r.style {
                0 => RopeStyle::HalfSplit,
                1 => RopeStyle::Adjacent,
                v => return Err(Failure::invalid(format!("`params.style` = {v}: 0 (half split) or 1 (adjacent)"))),
            };
            if !r.theta.is_finite() || r.theta <= 0.0 {
                return Err(Failure::invalid(format!("`params.theta` = {} is not finite and positive", r.theta)));
            }
            let dim = if r.rot_dim == 0 { r.head_dim } else { r.rot_dim } as usize;
            OpParams::Rope(RopeOpParams {
                heads: r.heads as usize,
                head_dim: r.head_dim as usize,
                rope: RopeParams { dim, theta: r.theta, scaling: None, style },
                act: act_of(r.act_dtype, &b.be, "params.act_dtype")?,
            })
        } else if kind == tboost_op_kind::TBOOST_OP_SWIGLU as i32 {
            let d = tboost_swiglu_params { struct_size: 0, act_dtype: -1 };
            // SAFETY: as above.
            let s = unsafe { read_sized(params.cast::<tboost_swiglu_params>(), d, 8, "params") }?;
            OpParams::SwiGlu { act: act_of(s.act_dtype, &b.be, "params.act_dtype")? }
        } else if kind == tboost_op_kind::TBOOST_OP_MOE_ROUTE as i32 {
            let d = tboost_moe_route_params { struct_size: 0, experts: 0, top_k: 0, act_dtype: -1 };
            // SAFETY: as above.
            let r = unsafe { read_sized(params.cast::<tboost_moe_route_params>(), d, 16, "params") }?;
            OpParams::MoeRoute(MoeRouteParams {
                experts: r.experts as usize,
                top_k: r.top_k as usize,
                act: act_of(r.act_dtype, &b.be, "params.act_dtype")?,
            })
        } else if kind == tboost_op_kind::TBOOST_OP_MOE_GROUPED as i32 {
            let d = tboost_moe_grouped_params {
                struct_size: 0,
                experts: 0,
                top_k: 0,
                weight_dtype: 0,
                hidden: 0,
                inter: 0,
                act_dtype: -1,
                reserved: 0,
                tiling: tboost_moe_tiling::default(),
            };
            // SAFETY: as above.
            let g = unsafe { read_sized(params.cast::<tboost_moe_grouped_params>(), d, 40, "params") }?;
            OpParams::MoeGrouped(MoeGroupedParams {
                experts: g.experts as usize,
                top_k: g.top_k as usize,
                hidden: size(g.hidden, "hidden")?,
                inter: size(g.inter, "inter")?,
                weight: dtype_of(g.weight_dtype, "params.weight_dtype")?,
                act: act_of(g.act_dtype, &b.be, "params.act_dtype")?,
                tiling: MoeTiling {
                    expert_batch_tokens: tunable(g.tiling.expert_batch_tokens),
                    parallel_expert_batches: tunable(g.tiling.parallel_expert_batches),
                },
            })
        } else {
            return Err(Failure::invalid(format!("`kind` = {kind} is not a tboost_op_kind")));
        };
        let op = Operation::new(&b.be, p)?;
        let h = OPS.insert(Arc::new(OpInner { backend: b, op }));
        // SAFETY: checked non-null above.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees an operation. NULL is a no-op.
#[no_mangle]
pub extern "C" fn tboost_op_free(op: *mut tboost_op) -> tboost_status {
    guard("tboost_op_free", |_| {
        if !op.is_null() {
            OPS.remove(op, "op")?;
        }
        Ok(())
    })
}

/// Whether the backend runs this operation's case: `*supported` (may not be NULL) is true or
/// false, and when false `why` receives the reason the plan would record for the same case
/// ("head_dim=24 is not a multiple of 16"), "" when true. Buffer rules as in
/// `tboost_last_error` (`why` may be NULL with `cap` 0). Returns `TBOOST_OK` either way.
#[no_mangle]
pub unsafe extern "C" fn tboost_op_supports(
    op: *const tboost_op,
    supported: *mut bool,
    why: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_op_supports", |_| {
        require(supported, "supported")?;
        let o = OPS.get(op, "op")?;
        let r = o.op.supports();
        // SAFETY: checked non-null above.
        unsafe { supported.write(r.is_ok()) };
        let text = r.err().map(|u| u.to_string()).unwrap_or_default();
        // SAFETY: `cap` writable bytes at `why` per the contract.
        unsafe { write_str(&text, why, cap, needed) }
    })
}

/// The tensors of a call, checked against the op's backend.
pub(super) unsafe fn tensors(
    list: *const tboost_tensor,
    n: usize,
    backend: &Arc<BackendInner>,
    what: &str,
) -> FfiResult<(Vec<TensorRef>, Vec<Arc<BufferInner>>)> {
    // SAFETY: `n` readable structs per the contract.
    let raw = unsafe { read_slice(list, n, what) }?;
    let (mut ts, mut keep) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (i, t) in raw.iter().enumerate() {
        let name = format!("{what}[{i}]");
        super::util::check_size(t.struct_size as usize, TENSOR_V1, &name)?;
        let (tr, b) = tensor_of(t, backend, &name)?;
        ts.push(tr);
        keep.push(b);
    }
    Ok((ts, keep))
}

/// Bytes of workspace `tboost_op_execute` needs for these tensors (0 for most ops) into
/// `*bytes`.
#[no_mangle]
pub unsafe extern "C" fn tboost_op_workspace_size(
    op: *const tboost_op,
    inputs: *const tboost_tensor,
    n_inputs: usize,
    outputs: *const tboost_tensor,
    n_outputs: usize,
    bytes: *mut usize,
) -> tboost_status {
    guard("tboost_op_workspace_size", |_| {
        require(bytes, "bytes")?;
        let o = OPS.get(op, "op")?;
        // SAFETY: per the contract.
        let (ins, _k1) = unsafe { tensors(inputs, n_inputs, &o.backend, "inputs") }?;
        let (outs, _k2) = unsafe { tensors(outputs, n_outputs, &o.backend, "outputs") }?;
        let n = o.op.workspace_size(&ins, &outs)?;
        // SAFETY: checked non-null above.
        unsafe { write_out(bytes, n) };
        Ok(())
    })
}

/// Checks the tensors and enqueues the operation on its backend (`tboost_backend_copy` back
/// to the host or `tboost_backend_synchronize` waits for it). `workspace` may be NULL (the op
/// keeps its own). A wrong tensor count, dtype, shape, stride or buffer gives
/// `TBOOST_ERR_INVALID_ARGUMENT` with the op and the tensor named in the last error
/// ("matmul.x: shape [2, 7]: expected [*, 8]"); a case the backend cannot run
/// `TBOOST_ERR_UNSUPPORTED` or `TBOOST_ERR_BACKEND`.
#[no_mangle]
pub unsafe extern "C" fn tboost_op_execute(
    op: *const tboost_op,
    inputs: *const tboost_tensor,
    n_inputs: usize,
    outputs: *const tboost_tensor,
    n_outputs: usize,
    workspace: *const tboost_tensor,
) -> tboost_status {
    guard("tboost_op_execute", |_| {
        let o = OPS.get(op, "op")?;
        // SAFETY: per the contract.
        let (ins, _k1) = unsafe { tensors(inputs, n_inputs, &o.backend, "inputs") }?;
        let (mut outs, _k2) = unsafe { tensors(outputs, n_outputs, &o.backend, "outputs") }?;
        let ws = if workspace.is_null() {
            None
        } else {
            // SAFETY: per the contract.
            let w = unsafe { read_tensor(workspace, "workspace") }?;
            Some(tensor_of(&w, &o.backend, "workspace")?)
        };
        o.op.execute(&ins, &mut outs, ws.as_ref().map(|w| &w.0))?;
        Ok(())
    })
}
