//! One typed function per aclnn op the Ascend backend uses.
//!
//! Each takes the [`Context`] (stream + workspace) and [`TensorRef`] views, builds the aclTensor /
//! aclTensorList / aclIntArray handles, runs the two-phase protocol on the context's stream and drops the
//! handles after the launch. The work is queued: results are there after [`Context::synchronize`].
//! Shapes, dtypes and layouts are checked by CANN's first phase (and by the simulator the same way);
//! failures come back as [`AclError::Op`] with the op name, the status and CANN's message.
//!
//! Declarations, versions and sources: `include/tboost_cann.h` and the crate README's op table.

use std::ffi::CString;

use crate::error::{AclError, Result};
use crate::launch::Context;
use crate::raw;
use crate::tensor::{AclIntArray, AclScalar, AclTensor, AclTensorList, TensorRef};

macro_rules! first_phase {
    ($f:expr, $($arg:expr),* $(,)?) => {
        match $f {
            // SAFETY: the arguments are live handles (or NULL for optional ones) of the header's types.
            Some(f) => unsafe { f($($arg),*) },
            None => raw::ACLNN_ERR_INNER,
        }
    };
}

fn acl(ctx: &Context, t: &TensorRef) -> Result<AclTensor> {
    t.to_acl(ctx.cann())
}
fn acl_opt(ctx: &Context, t: Option<&TensorRef>) -> Result<Option<AclTensor>> {
    t.map(|t| t.to_acl(ctx.cann())).transpose()
}
fn ptr(t: &Option<AclTensor>) -> *mut raw::aclTensor {
    t.as_ref().map_or(std::ptr::null_mut(), AclTensor::as_ptr)
}
fn list(ctx: &Context, t: &TensorRef) -> Result<AclTensorList> {
    AclTensorList::new(ctx.cann(), vec![acl(ctx, t)?])
}

/// `aclnnRmsNorm`: `y = x / sqrt(mean(x^2) + eps) * gamma` over gamma's trailing dims; `rstd` (FLOAT32,
/// x's shape with the normalized dims 1) receives the reciprocal rms.
pub fn rms_norm(
    ctx: &mut Context,
    x: &TensorRef,
    gamma: &TensorRef,
    epsilon: f64,
    y: &TensorRef,
    rstd: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnRmsNorm";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnRmsNormGetWorkspaceSize_fn>(OP)? };
    let (x, g, y, r) = (acl(ctx, x)?, acl(ctx, gamma)?, acl(ctx, y)?, acl(ctx, rstd)?);
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), g.as_ptr(), epsilon, y.as_ptr(), r.as_ptr(), ws, ex))
}

/// `aclnnAddRmsNorm`: `x = x1 + x2` (written to `x_out`), then RmsNorm of x into `y`. `rstd` needs `x_out`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    ctx: &mut Context,
    x1: &TensorRef,
    x2: &TensorRef,
    gamma: &TensorRef,
    epsilon: f64,
    y: &TensorRef,
    rstd: Option<&TensorRef>,
    x_out: Option<&TensorRef>,
) -> Result<()> {
    const OP: &str = "aclnnAddRmsNorm";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnAddRmsNormGetWorkspaceSize_fn>(OP)? };
    let (a, b, g, y) = (acl(ctx, x1)?, acl(ctx, x2)?, acl(ctx, gamma)?, acl(ctx, y)?);
    let (r, xo) = (acl_opt(ctx, rstd)?, acl_opt(ctx, x_out)?);
    ctx.run(OP, |ws, ex| {
        first_phase!(f, a.as_ptr(), b.as_ptr(), g.as_ptr(), epsilon, y.as_ptr(), ptr(&r), ptr(&xo), ws, ex)
    })
}

/// `cubeMathType` of the matmul family (OT `common/include/common/op_api_def.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CubeMathType {
    #[default]
    KeepDtype = 0,
    AllowFp32DownPrecision = 1,
    UseFp16 = 2,
    UseHf32 = 3,
}

/// `aclnnMatmul`: `out = a @ b` (2-D, or batched 3-D). A transposed weight is a transposed view:
/// `w.transpose(0, 1)` of an `[n, k]` weight gives the `[k, n]` operand with no copy.
pub fn matmul(ctx: &mut Context, a: &TensorRef, b: &TensorRef, out: &TensorRef, cube: CubeMathType) -> Result<()> {
    const OP: &str = "aclnnMatmul";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMatmulGetWorkspaceSize_fn>(OP)? };
    let (a, b, o) = (acl(ctx, a)?, acl(ctx, b)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), o.as_ptr(), cube as i8, ws, ex))
}

/// `aclnnMm`: 2-D `out = a @ b`.
pub fn mm(ctx: &mut Context, a: &TensorRef, b: &TensorRef, out: &TensorRef, cube: CubeMathType) -> Result<()> {
    const OP: &str = "aclnnMm";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMmGetWorkspaceSize_fn>(OP)? };
    let (a, b, o) = (acl(ctx, a)?, acl(ctx, b)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), o.as_ptr(), cube as i8, ws, ex))
}

/// `aclnnWeightQuantBatchMatmulV2` (A16W8 / A16W4): `y = x @ ((weight + offset) * scale)`, `x` `[m, k]`
/// f16/bf16, `weight` `[k, n]` INT8 or INT4 (a transposed view of an `[n, k]` store is allowed), `scale` and
/// the optional `offset` in x's dtype, `[ceil(k / group), n]` per group (`group` a multiple of 32 in
/// `[32, k - 1]`, or 0 with `[n]`/`[1, n]` per channel), `y` `[m, n]` in x's dtype. No output quantization
/// and no bias here (quantScale/quantOffset/bias NULL). Rules: hicann/ops-nn
/// `matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md`.
pub fn weight_quant_batch_matmul_v2(
    ctx: &mut Context,
    x: &TensorRef,
    weight: &TensorRef,
    scale: &TensorRef,
    offset: Option<&TensorRef>,
    group: i32,
    y: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnWeightQuantBatchMatmulV2";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnWeightQuantBatchMatmulV2GetWorkspaceSize_fn>(OP)? };
    let (x, w, sc, y) = (acl(ctx, x)?, acl(ctx, weight)?, acl(ctx, scale)?, acl(ctx, y)?);
    let off = acl_opt(ctx, offset)?;
    let null = std::ptr::null_mut();
    ctx.run(OP, |ws, ex| {
        first_phase!(f, x.as_ptr(), w.as_ptr(), sc.as_ptr(), ptr(&off), null, null, null, group, y.as_ptr(), ws, ex)
    })
}

/// `aclnnMatmulAllReduce` (MC2): `y = allreduce(x1 @ x2 + bias)` over the communicator named `group`
/// (`HcclComm::name`), `x1` `[m, k]` and `x2` `[k, n]` (a transposed view allowed) f16/bf16, `bias` `[n]` or
/// none, `y` `[m, n]`, all of one dtype; reduceOp "sum", commTurn 0, streamMode 1 (the only values the doc
/// allows). Rules: ops-transformer `mc2/matmul_all_reduce/docs/aclnnMatmulAllReduce.md`.
pub fn matmul_all_reduce(
    ctx: &mut Context,
    x1: &TensorRef,
    x2: &TensorRef,
    bias: Option<&TensorRef>,
    group: &std::ffi::CStr,
    y: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnMatmulAllReduce";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMatmulAllReduceGetWorkspaceSize_fn>(OP)? };
    let (a, b, y) = (acl(ctx, x1)?, acl(ctx, x2)?, acl(ctx, y)?);
    let bias = acl_opt(ctx, bias)?;
    let sum = c"sum";
    ctx.run(OP, |ws, ex| {
        first_phase!(f, a.as_ptr(), b.as_ptr(), ptr(&bias), group.as_ptr(), sum.as_ptr(), 0, 1, y.as_ptr(), ws, ex)
    })
}

/// `aclnnSwiGlu`: with `[a, b]` the halves of `x` along `dim`, `out = silu(a) * b` (Llama's
/// `silu(gate) * up` when x is `[gate | up]`).
pub fn swi_glu(ctx: &mut Context, x: &TensorRef, dim: i64, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnSwiGlu";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnSwiGluGetWorkspaceSize_fn>(OP)? };
    let (x, o) = (acl(ctx, x)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), dim, o.as_ptr(), ws, ex))
}

/// `approximate` of `aclnnGeluV2` (NN `activation/gelu_v2/docs/aclnnGeluV2.md`: 0 none, 1 tanh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluApproximate {
    /// `x * Φ(x)` with the exact normal CDF (erf).
    None = 0,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (PyTorch's `gelu(approximate="tanh")`).
    Tanh = 1,
}

/// `aclnnGeluV2`: `y = gelu(x)` elementwise (x and y of one dtype and shape).
pub fn gelu_v2(ctx: &mut Context, x: &TensorRef, approximate: GeluApproximate, y: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnGeluV2";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnGeluV2GetWorkspaceSize_fn>(OP)? };
    let (x, y) = (acl(ctx, x)?, acl(ctx, y)?);
    let a = approximate as i64;
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), a, y.as_ptr(), ws, ex))
}

/// `mode` of `aclnnRotaryPositionEmbedding` (A2/A3 have Half and Interleave).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// rotate_half, NeoX / Hugging Face Llama
    Half = 0,
    /// adjacent pairs, GPT-J / original Llama
    Interleave = 1,
    Quarter = 2,
    InterleaveHalf = 3,
}

/// `aclnnRotaryPositionEmbedding`: `out = x * cos + rotate(x) * sin` on a 4-D `x` (BSND: `[1, tokens,
/// heads, head_dim]` for tboost's flat token batch), cos/sin broadcastable (`[1, tokens, 1, head_dim]`,
/// full head_dim).
pub fn rotary_position_embedding(
    ctx: &mut Context,
    x: &TensorRef,
    cos: &TensorRef,
    sin: &TensorRef,
    mode: RopeMode,
    out: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnRotaryPositionEmbedding";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnRotaryPositionEmbeddingGetWorkspaceSize_fn>(OP)? };
    let (x, c, s, o) = (acl(ctx, x)?, acl(ctx, cos)?, acl(ctx, sin)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), c.as_ptr(), s.as_ptr(), mode as i64, o.as_ptr(), ws, ex))
}

/// `aclnnEmbedding`: `out[i, :] = weight[indices[i], :]`.
pub fn embedding(ctx: &mut Context, weight: &TensorRef, indices: &TensorRef, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnEmbedding";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnEmbeddingGetWorkspaceSize_fn>(OP)? };
    let (w, i, o) = (acl(ctx, weight)?, acl(ctx, indices)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, w.as_ptr(), i.as_ptr(), o.as_ptr(), ws, ex))
}

/// `aclnnCast` to `out`'s dtype.
pub fn cast(ctx: &mut Context, x: &TensorRef, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnCast";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnCastGetWorkspaceSize_fn>(OP)? };
    let dt = out.dtype().to_acl();
    let (x, o) = (acl(ctx, x)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), dt, o.as_ptr(), ws, ex))
}

/// `aclnnAdd`: `out = a + alpha * b` with broadcasting.
pub fn add(ctx: &mut Context, a: &TensorRef, b: &TensorRef, alpha: f32, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnAdd";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnAddGetWorkspaceSize_fn>(OP)? };
    let s = AclScalar::f32(ctx.cann(), alpha)?;
    let (a, b, o) = (acl(ctx, a)?, acl(ctx, b)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), s.as_ptr(), o.as_ptr(), ws, ex))
}

/// `aclnnInplaceAdd`: `a += alpha * b` (the residual add).
pub fn inplace_add(ctx: &mut Context, a: &TensorRef, b: &TensorRef, alpha: f32) -> Result<()> {
    const OP: &str = "aclnnInplaceAdd";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnInplaceAddGetWorkspaceSize_fn>(OP)? };
    let s = AclScalar::f32(ctx.cann(), alpha)?;
    let (a, b) = (acl(ctx, a)?, acl(ctx, b)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), s.as_ptr(), ws, ex))
}

/// `aclnnMul`: `out = a * b` with broadcasting.
pub fn mul(ctx: &mut Context, a: &TensorRef, b: &TensorRef, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnMul";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMulGetWorkspaceSize_fn>(OP)? };
    let (a, b, o) = (acl(ctx, a)?, acl(ctx, b)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), o.as_ptr(), ws, ex))
}

/// `aclnnDiv`: `out = a / b` with broadcasting.
pub fn div(ctx: &mut Context, a: &TensorRef, b: &TensorRef, out: &TensorRef) -> Result<()> {
    const OP: &str = "aclnnDiv";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnDivGetWorkspaceSize_fn>(OP)? };
    let (a, b, o) = (acl(ctx, a)?, acl(ctx, b)?, acl(ctx, out)?);
    ctx.run(OP, |ws, ex| first_phase!(f, a.as_ptr(), b.as_ptr(), o.as_ptr(), ws, ex))
}

/// `aclnnScatterPaKvCache`, scenario 2 ("Norm" caches): for token t with slot `s = slot_mapping[t]`,
/// `key_cache[s / block_size, s % block_size] = key[t]` (all heads), same for values. key/value
/// `[tokens, kv_heads, head_dim]`, caches `[blocks, block_size, kv_heads, head_dim]`, slots INT32/INT64.
pub fn scatter_pa_kv_cache(
    ctx: &mut Context,
    key: &TensorRef,
    key_cache: &TensorRef,
    slot_mapping: &TensorRef,
    value: &TensorRef,
    value_cache: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnScatterPaKvCache";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnScatterPaKvCacheGetWorkspaceSize_fn>(OP)? };
    let (k, kc, sl, v, vc) =
        (acl(ctx, key)?, acl(ctx, key_cache)?, acl(ctx, slot_mapping)?, acl(ctx, value)?, acl(ctx, value_cache)?);
    let mut mode = *b"Norm\0";
    let mut scatter = *b"None\0";
    let null = std::ptr::null_mut();
    ctx.run(OP, |ws, ex| {
        first_phase!(
            f,
            k.as_ptr(),
            kc.as_ptr(),
            sl.as_ptr(),
            v.as_ptr(),
            vc.as_ptr(),
            null,
            null,
            null,
            mode.as_mut_ptr().cast(),
            scatter.as_mut_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            ws,
            ex
        )
    })
}

/// `aclnnMoeGatingTopKSoftmax`: softmax over experts, the top `k` probabilities (`y`, x's dtype, not
/// renormalized) and expert ids (`expert_idx`, INT32); `row_idx[i][j] = j * rows + i` (INT32).
/// A row with `finished[i]` true gets expert id = number of experts.
pub fn moe_gating_top_k_softmax(
    ctx: &mut Context,
    x: &TensorRef,
    finished: Option<&TensorRef>,
    k: i64,
    y: &TensorRef,
    expert_idx: &TensorRef,
    row_idx: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnMoeGatingTopKSoftmax";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMoeGatingTopKSoftmaxGetWorkspaceSize_fn>(OP)? };
    let (x, fin, y, e, r) =
        (acl(ctx, x)?, acl_opt(ctx, finished)?, acl(ctx, y)?, acl(ctx, expert_idx)?, acl(ctx, row_idx)?);
    ctx.run(OP, |ws, ex| first_phase!(f, x.as_ptr(), ptr(&fin), k, y.as_ptr(), e.as_ptr(), r.as_ptr(), ws, ex))
}

/// What `aclnnMoeInitRoutingV2` reports per expert (`expertTokensCountOrCumsumFlag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertTokens {
    None = 0,
    Cumsum = 1,
    Count = 2,
}

/// Arguments of [`moe_init_routing_v2`].
pub struct MoeInitRouting<'a> {
    /// `[rows, hidden]`
    pub x: TensorRef<'a>,
    /// `[rows, k]` INT32
    pub expert_idx: TensorRef<'a>,
    /// 0: dropless; > 0: keep only the first `active_num` expanded rows
    pub active_num: i64,
    /// drop/pad mode only
    pub expert_capacity: i64,
    pub expert_num: i64,
    /// 0 dropless, 1 drop/pad
    pub drop_pad_mode: i64,
    pub expert_tokens: ExpertTokens,
    /// dropless `[rows*k (or active_num), hidden]`; drop/pad `[experts, capacity, hidden]`
    pub expanded_x: TensorRef<'a>,
    /// `[rows*k]` INT32: `expanded_row_idx[r*k + j]` = where (row r, choice j) landed in expanded_x
    pub expanded_row_idx: TensorRef<'a>,
    /// `[experts]` INT32, when `expert_tokens` is not None
    pub expert_tokens_out: Option<TensorRef<'a>>,
    /// `[experts]` INT32 token counts before the capacity cut (drop/pad mode)
    pub expert_tokens_before_capacity: Option<TensorRef<'a>>,
}

/// `aclnnMoeInitRoutingV2`: sorts the (row, choice) pairs by expert (stable) and gathers the rows.
pub fn moe_init_routing_v2(ctx: &mut Context, a: &MoeInitRouting) -> Result<()> {
    const OP: &str = "aclnnMoeInitRoutingV2";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMoeInitRoutingV2GetWorkspaceSize_fn>(OP)? };
    let (x, e, ex, er) =
        (acl(ctx, &a.x)?, acl(ctx, &a.expert_idx)?, acl(ctx, &a.expanded_x)?, acl(ctx, &a.expanded_row_idx)?);
    let (cnt, bef) =
        (acl_opt(ctx, a.expert_tokens_out.as_ref())?, acl_opt(ctx, a.expert_tokens_before_capacity.as_ref())?);
    let before_flag = a.expert_tokens_before_capacity.is_some();
    ctx.run(OP, |ws, exr| {
        first_phase!(
            f,
            x.as_ptr(),
            e.as_ptr(),
            a.active_num,
            a.expert_capacity,
            a.expert_num,
            a.drop_pad_mode,
            a.expert_tokens as i64,
            before_flag,
            ex.as_ptr(),
            er.as_ptr(),
            ptr(&cnt),
            ptr(&bef),
            ws,
            exr
        )
    })
}

/// How `group_list` of [`grouped_matmul_v4`] counts rows (`groupListType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupListType {
    /// cumulative row counts (what MoeInitRoutingV2's Cumsum gives)
    Cumsum = 0,
    /// per-group row counts
    Count = 1,
}

/// `aclnnGroupedMatmulV4`, the MoE form (groupType 0 = M-axis grouping, single tensors, splitItem 3):
/// rows of `x [m, k]` are split into groups by `group_list` (INT64 `[experts]`), group g is multiplied by
/// `weight[g]` (`[experts, k, n]`, a transposed view of `[experts, n, k]` is fine) plus `bias[g]`
/// (`[experts, n]`), into `out [m, n]`. Rows past the last group are not written.
pub fn grouped_matmul_v4(
    ctx: &mut Context,
    x: &TensorRef,
    weight: &TensorRef,
    bias: Option<&TensorRef>,
    group_list: &TensorRef,
    group_list_type: GroupListType,
    out: &TensorRef,
) -> Result<()> {
    const OP: &str = "aclnnGroupedMatmulV4";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnGroupedMatmulV4GetWorkspaceSize_fn>(OP)? };
    let (xl, wl, ol) = (list(ctx, x)?, list(ctx, weight)?, list(ctx, out)?);
    let bl = bias.map(|b| list(ctx, b)).transpose()?;
    let g = acl(ctx, group_list)?;
    let bp = bl.as_ref().map_or(std::ptr::null_mut(), AclTensorList::as_ptr);
    let n = std::ptr::null_mut();
    ctx.run(OP, |ws, ex| {
        first_phase!(
            f,
            xl.as_ptr(),
            wl.as_ptr(),
            bp,
            n,
            n,
            n,
            n,
            n,
            g.as_ptr(),
            n,
            n,
            n,
            3,
            0,
            group_list_type as i64,
            raw::GMMActType_GMM_ACT_TYPE_NONE as i64,
            ol.as_ptr(),
            n,
            n,
            ws,
            ex
        )
    })
}

/// Arguments of [`moe_finalize_routing_v2`].
pub struct MoeFinalizeRouting<'a> {
    /// expert outputs, dropless `[rows*k, hidden]` (drop/pad `[experts, capacity, hidden]`)
    pub expanded_x: TensorRef<'a>,
    /// `[rows*k]` INT32 as MoeInitRoutingV2 wrote it
    pub expanded_row_idx: TensorRef<'a>,
    /// added as is (shared experts / residual), `[rows, hidden]`
    pub x1: Option<TensorRef<'a>>,
    pub x2: Option<TensorRef<'a>>,
    /// `[experts, hidden]`, needs `expert_idx`
    pub bias: Option<TensorRef<'a>>,
    /// routing weights `[rows, k]`; without them k = 1 and weight 1
    pub scales: Option<TensorRef<'a>>,
    /// `[rows, k]` INT32
    pub expert_idx: Option<TensorRef<'a>>,
    /// 2: dropless with MoeInitRoutingV2's row-major expanded_row_idx (3: drop/pad; 0/1: V1 column order)
    pub drop_pad_mode: i64,
    /// `[rows, hidden]`
    pub out: TensorRef<'a>,
}

/// `aclnnMoeFinalizeRoutingV2`: `out[i] = x1[i] + x2[i] + sum_k scales[i,k] * (expanded_x[row(i,k)] +
/// bias[expert_idx[i,k]])`.
pub fn moe_finalize_routing_v2(ctx: &mut Context, a: &MoeFinalizeRouting) -> Result<()> {
    const OP: &str = "aclnnMoeFinalizeRoutingV2";
    // SAFETY: the type is this op's first phase in the header.
    let f = unsafe { ctx.first_phase_fn::<raw::aclnnMoeFinalizeRoutingV2GetWorkspaceSize_fn>(OP)? };
    let (ex, er, o) = (acl(ctx, &a.expanded_x)?, acl(ctx, &a.expanded_row_idx)?, acl(ctx, &a.out)?);
    let (x1, x2, b) = (acl_opt(ctx, a.x1.as_ref())?, acl_opt(ctx, a.x2.as_ref())?, acl_opt(ctx, a.bias.as_ref())?);
    let (s, e) = (acl_opt(ctx, a.scales.as_ref())?, acl_opt(ctx, a.expert_idx.as_ref())?);
    let mode = a.drop_pad_mode;
    ctx.run(OP, |ws, exr| {
        first_phase!(
            f,
            ex.as_ptr(),
            er.as_ptr(),
            ptr(&x1),
            ptr(&x2),
            ptr(&b),
            ptr(&s),
            ptr(&e),
            mode,
            o.as_ptr(),
            ws,
            exr
        )
    })
}

/// Which `aclnnFusedInferAttentionScore` version ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FiaVersion {
    V2,
    V3,
    V4,
    /// The only version Ascend950 runs.
    V5,
}

impl FiaVersion {
    pub fn op_name(self) -> &'static str {
        match self {
            FiaVersion::V2 => "aclnnFusedInferAttentionScoreV2",
            FiaVersion::V3 => "aclnnFusedInferAttentionScoreV3",
            FiaVersion::V4 => "aclnnFusedInferAttentionScoreV4",
            FiaVersion::V5 => "aclnnFusedInferAttentionScoreV5",
        }
    }
}

/// The FusedInferAttentionScore version to call, if the installation has one: V5 on Ascend950, where V1..V4
/// refuse with 361001 ("versions V1 to V4 are no longer supported on Ascend950": ops-transformer
/// `attention/fused_infer_attention_score/op_api/aclnn_fused_infer_attention_score_v4.cpp`; torch_npu's
/// op-plugin and ATB call V5 there); elsewhere the newest of V4, V3, V2, as torch_npu does.
pub fn fused_infer_attention_version(cann: &crate::Cann) -> Option<FiaVersion> {
    fia_version_for(cann.soc(), |op| cann.has_op(op))
}

/// [`fused_infer_attention_version`] for a SoC family and a symbol test.
pub fn fia_version_for(soc: crate::SocFamily, has: impl Fn(&str) -> bool) -> Option<FiaVersion> {
    let order: &[FiaVersion] = if soc == crate::SocFamily::Ascend950 {
        &[FiaVersion::V5]
    } else {
        &[FiaVersion::V4, FiaVersion::V3, FiaVersion::V2]
    };
    order.iter().copied().find(|v| has(v.op_name()))
}

/// `inputLayout` of FusedInferAttentionScore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnLayout {
    /// `[B, S, N*D]`
    Bsh,
    /// `[B, S, N, D]`: what tboost uses (paged caches are then BnBsH `[blocks, block_size, kv_heads*head_dim]`)
    Bsnd,
    /// `[B, N, S, D]`
    Bnsd,
}

impl AttnLayout {
    fn c_str(self) -> &'static [u8] {
        match self {
            AttnLayout::Bsh => b"BSH\0",
            AttnLayout::Bsnd => b"BSND\0",
            AttnLayout::Bnsd => b"BNSD\0",
        }
    }
}

/// Arguments of [`fused_infer_attention_score`]. Start from [`FusedInferAttention::new`].
pub struct FusedInferAttention<'a> {
    pub query: TensorRef<'a>,
    /// contiguous K in the query's layout, or with `block_table` the paged key cache
    pub key: TensorRef<'a>,
    pub value: TensorRef<'a>,
    pub out: TensorRef<'a>,
    pub num_heads: i64,
    /// 0 = num_heads
    pub num_kv_heads: i64,
    /// usually 1/sqrt(head_dim)
    pub scale: f64,
    pub layout: AttnLayout,
    /// INT32 `[B, max_blocks_per_seq]`: enables page attention
    pub block_table: Option<TensorRef<'a>>,
    /// with a block table: 128..512 and a multiple of 128 for Q_S > 1; 16-aligned, <= 512 for Q_S == 1
    pub block_size: i64,
    /// per-batch query lengths (host); ignored when Q_S == 1
    pub actual_seq_lengths: Option<&'a [i64]>,
    /// per-batch KV lengths (host); required with a block table
    pub actual_seq_lengths_kv: Option<&'a [i64]>,
    /// BOOL/INT8/UINT8, 1 = masked out; sparse modes 2/3 take the 2048x2048 upper-triangular mask
    pub atten_mask: Option<TensorRef<'a>>,
    /// 0 default (mask optional), 1 all-mask, 2 left-up causal, 3 right-down causal, 4 band
    pub sparse_mode: i64,
    pub pre_tokens: i64,
    pub next_tokens: i64,
    pub inner_precise: i64,
    /// FLOAT `[B, N, Q_S, 1]`: written when given
    pub softmax_lse: Option<TensorRef<'a>>,
    /// run exactly this version instead of the newest present
    pub version: Option<FiaVersion>,
}

impl<'a> FusedInferAttention<'a> {
    pub fn new(
        query: TensorRef<'a>,
        key: TensorRef<'a>,
        value: TensorRef<'a>,
        out: TensorRef<'a>,
        num_heads: i64,
        num_kv_heads: i64,
        scale: f64,
    ) -> Self {
        FusedInferAttention {
            query,
            key,
            value,
            out,
            num_heads,
            num_kv_heads,
            scale,
            layout: AttnLayout::Bsnd,
            block_table: None,
            block_size: 0,
            actual_seq_lengths: None,
            actual_seq_lengths_kv: None,
            atten_mask: None,
            sparse_mode: 0,
            pre_tokens: i32::MAX as i64,
            next_tokens: i32::MAX as i64,
            inner_precise: 0,
            softmax_lse: None,
            version: None,
        }
    }
}

/// `aclnnFusedInferAttentionScoreV5` on Ascend950, else V4/V3/V2 (the newest present unless `a.version`
/// pins one): Q_S == 1 is
/// the decode (IncreFlashAttention) branch, Q_S > 1 the prefill branch; `block_table` + `block_size` make
/// it paged attention. Returns the version that ran.
pub fn fused_infer_attention_score(ctx: &mut Context, a: &FusedInferAttention) -> Result<FiaVersion> {
    let version = match a.version {
        Some(v) => v,
        None => fused_infer_attention_version(ctx.cann()).ok_or_else(|| AclError::OpUnavailable {
            op: "aclnnFusedInferAttentionScoreV5 (Ascend950) or V4/V3/V2".into(),
            libraries: ctx.cann().op_libraries(),
        })?,
    };
    let c = ctx.cann().clone();
    let (q, o) = (acl(ctx, &a.query)?, acl(ctx, &a.out)?);
    let (k, v) = (list(ctx, &a.key)?, list(ctx, &a.value)?);
    let (mask, bt, lse) = (
        acl_opt(ctx, a.atten_mask.as_ref())?,
        acl_opt(ctx, a.block_table.as_ref())?,
        acl_opt(ctx, a.softmax_lse.as_ref())?,
    );
    let sq = a.actual_seq_lengths.map(|s| AclIntArray::new(&c, s)).transpose()?;
    let skv = a.actual_seq_lengths_kv.map(|s| AclIntArray::new(&c, s)).transpose()?;
    let sqp = sq.as_ref().map_or(std::ptr::null_mut(), AclIntArray::as_ptr);
    let skvp = skv.as_ref().map_or(std::ptr::null_mut(), AclIntArray::as_ptr);
    let layout = CString::from_vec_with_nul(a.layout.c_str().to_vec()).map_err(|e| AclError::Invalid(e.to_string()))?;
    let lp = layout.as_ptr() as *mut std::os::raw::c_char;
    let n: *mut raw::aclTensor = std::ptr::null_mut();
    let na: *mut raw::aclIntArray = std::ptr::null_mut();
    let lse_flag = a.softmax_lse.is_some();
    let (qp, kp, vp, mp, btp, op, lsep) =
        (q.as_ptr(), k.as_ptr(), v.as_ptr(), ptr(&mask), ptr(&bt), o.as_ptr(), ptr(&lse));
    match version {
        FiaVersion::V2 => {
            // SAFETY: the type is this op's first phase in the header.
            let f = unsafe {
                ctx.first_phase_fn::<raw::aclnnFusedInferAttentionScoreV2GetWorkspaceSize_fn>(version.op_name())?
            };
            ctx.run(version.op_name(), |ws, ex| {
                first_phase!(
                    f,
                    qp,
                    kp,
                    vp,
                    n,
                    mp,
                    sqp,
                    skvp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    btp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    na,
                    a.num_heads,
                    a.scale,
                    a.pre_tokens,
                    a.next_tokens,
                    lp,
                    a.num_kv_heads,
                    a.sparse_mode,
                    a.inner_precise,
                    a.block_size,
                    0,
                    lse_flag,
                    0,
                    0,
                    op,
                    lsep,
                    ws,
                    ex
                )
            })?
        }
        FiaVersion::V3 => {
            // SAFETY: the type is this op's first phase in the header.
            let f = unsafe {
                ctx.first_phase_fn::<raw::aclnnFusedInferAttentionScoreV3GetWorkspaceSize_fn>(version.op_name())?
            };
            ctx.run(version.op_name(), |ws, ex| {
                first_phase!(
                    f,
                    qp,
                    kp,
                    vp,
                    n,
                    mp,
                    sqp,
                    skvp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    btp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    na,
                    n,
                    n,
                    n,
                    a.num_heads,
                    a.scale,
                    a.pre_tokens,
                    a.next_tokens,
                    lp,
                    a.num_kv_heads,
                    a.sparse_mode,
                    a.inner_precise,
                    a.block_size,
                    0,
                    lse_flag,
                    0,
                    0,
                    op,
                    lsep,
                    ws,
                    ex
                )
            })?
        }
        FiaVersion::V4 => {
            // SAFETY: the type is this op's first phase in the header.
            let f = unsafe {
                ctx.first_phase_fn::<raw::aclnnFusedInferAttentionScoreV4GetWorkspaceSize_fn>(version.op_name())?
            };
            ctx.run(version.op_name(), |ws, ex| {
                first_phase!(
                    f,
                    qp,
                    kp,
                    vp,
                    n,
                    mp,
                    sqp,
                    skvp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    btp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    na,
                    n,
                    n,
                    n,
                    n,
                    n,
                    a.num_heads,
                    a.scale,
                    a.pre_tokens,
                    a.next_tokens,
                    lp,
                    a.num_kv_heads,
                    a.sparse_mode,
                    a.inner_precise,
                    a.block_size,
                    0,
                    lse_flag,
                    0,
                    0,
                    0,
                    op,
                    lsep,
                    ws,
                    ex
                )
            })?
        }
        FiaVersion::V5 => {
            // SAFETY: the type is this op's first phase in the header.
            let f = unsafe {
                ctx.first_phase_fn::<raw::aclnnFusedInferAttentionScoreV5GetWorkspaceSize_fn>(version.op_name())?
            };
            ctx.run(version.op_name(), |ws, ex| {
                first_phase!(
                    f,
                    qp,
                    kp,
                    vp,
                    n,
                    mp,
                    sqp,
                    skvp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    btp,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    n,
                    na,
                    n,
                    n,
                    n,
                    n,
                    n,
                    na,
                    na,
                    a.num_heads,
                    a.scale,
                    a.pre_tokens,
                    a.next_tokens,
                    lp,
                    a.num_kv_heads,
                    a.sparse_mode,
                    a.inner_precise,
                    a.block_size,
                    0,
                    lse_flag,
                    0,
                    0,
                    0,
                    0,
                    op,
                    lsep,
                    ws,
                    ex
                )
            })?
        }
    }
    Ok(version)
}
