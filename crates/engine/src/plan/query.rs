//! The `OpQuery` of each op, built in one place: the plan's candidates and the operator API
//! (`crate::op_api`) both ask a backend through these functions, so a case one of them is
//! refused on gets the same answer (and the same `Unsupported` reason) from the other.

use tboost_ops::{AttentionCase, AttnPhase, DType, MatMulCase, Precision, RopeParams, RopeStyle};

use crate::backend::{AttnKind, OpQuery};

/// A weight matrix `[rows = out, cols = in]` of `dtype` against `act` activations.
pub fn matmul_case(dtype: DType, rows: usize, cols: usize, act: DType, precision: Precision) -> MatMulCase {
    MatMulCase { dtype, rows, cols, act_dtype: act, precision }
}

/// RMSNorm with a gain of `gain` dtype (`fused_add`: the residual add fused in).
pub fn rms_norm(gain: DType, act: DType, fused_add: bool) -> OpQuery {
    OpQuery::RmsNorm { gain, act, fused_add }
}

/// Embedding lookup from a `table` of that dtype.
pub fn embed(table: DType, act: DType) -> OpQuery {
    OpQuery::Embed { table, act }
}

/// RoPE over `rot_dim` of `head_dim` dimensions.
pub fn rope(head_dim: usize, rot_dim: usize, style: RopeStyle, act: DType) -> OpQuery {
    OpQuery::Rope { head_dim, rot_dim, style, act }
}

/// The cos/sin tables of a rotary embedding.
pub fn rope_tables(rope: RopeParams) -> OpQuery {
    OpQuery::RopeTables { rope }
}

/// The full case of one attention call.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    kind: AttnKind,
    phase: AttnPhase,
    head_dim: usize,
    n_heads: usize,
    kv_heads: usize,
    act: DType,
    kv: DType,
    block_size: usize,
    max_context: usize,
    sliding_window: usize,
) -> OpQuery {
    let case = AttentionCase {
        phase,
        head_dim,
        n_heads,
        kv_heads,
        act_dtype: act,
        kv_dtype: kv,
        block_size,
        max_context,
        sliding_window,
    };
    OpQuery::Attention { kind, case }
}

/// Softmax top-k routing over `experts` router logits.
pub fn moe_route(experts: usize, top_k: usize) -> OpQuery {
    OpQuery::MoeRoute { experts, top_k }
}

/// Grouped expert SwiGLU MLPs (every expert shaped and typed as `gate`/`down`).
pub fn moe_grouped(experts: usize, top_k: usize, gate: MatMulCase, down: MatMulCase) -> OpQuery {
    OpQuery::MoeGrouped { experts, top_k, gate, down }
}
