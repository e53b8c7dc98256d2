//! The ops a backend executes, naming buffers and weights, never holding elements.

use tboost_kernels::attention::SeqSpan;
use tboost_ops::{AttentionCase, AttnParams, DType, MatMulCase, RopeStyle};

use super::{BufId, WeightId};

/// `len` elements of buffer `buf` starting at element `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub buf: BufId,
    pub offset: usize,
    pub len: usize,
}

impl View {
    pub fn new(buf: BufId, offset: usize, len: usize) -> View {
        View { buf, offset, len }
    }

    /// The first `len` elements of this view.
    pub fn prefix(self, len: usize) -> View {
        debug_assert!(len <= self.len);
        View { len, ..self }
    }
}

/// One layer's paged K and V pools: `[num_blocks, block_size, kv_heads, head_dim]` each.
#[derive(Clone, Copy, Debug)]
pub struct KvLayer {
    pub k: BufId,
    pub v: BufId,
    pub dtype: DType,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The attention algorithms the plan chooses between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Tiled, online softmax, scratch bounded by tile size.
    Flash,
    /// Materialized scores; any head_dim.
    Standard,
}

/// What the plan asks a backend about.
#[derive(Clone, Copy, Debug)]
pub enum OpQuery {
    Attention(AttnKind, AttentionCase),
    MatMul(MatMulCase),
    /// Embedding lookup from a table of this dtype.
    Embed(DType),
    /// RMSNorm with a gain vector of this dtype.
    RmsNorm(DType),
    /// RoPE over `rot_dim` of `head_dim` dimensions.
    Rope {
        head_dim: usize,
        rot_dim: usize,
    },
    /// Top-k routing over `experts`.
    Moe {
        experts: usize,
        top_k: usize,
    },
}

/// One expert's weights.
#[derive(Clone, Copy, Debug)]
pub struct ExpertIds {
    pub gate: WeightId,
    pub up: WeightId,
    pub down: WeightId,
}

/// One output of a (possibly merged) projection.
#[derive(Clone, Copy, Debug)]
pub struct MatSegOp {
    pub w: WeightId,
    pub bias: Option<WeightId>,
    pub out: View,
}

#[derive(Debug)]
pub enum Op<'a> {
    /// `out[i] = table[ids[i]]`.
    Embed { ids: &'a [u32], table: WeightId, out: View },
    /// `out = rmsnorm(x) * w`.
    RmsNorm { x: View, w: WeightId, eps: f32, out: View },
    /// `residual += x; out = rmsnorm(residual) * w` (fused).
    AddRmsNorm { residual: View, x: View, w: WeightId, eps: f32, out: View },
    /// `dst += src`.
    Add { dst: View, src: View },
    /// `seg.out = x · seg.wᵀ + seg.bias` for each segment; `x` is `[m, k]`.
    MatMul { x: View, m: usize, segs: &'a [MatSegOp] },
    /// `out = silu(x · gateᵀ) * (x · upᵀ)` (fused).
    MatMulSwiGlu { x: View, m: usize, gate: WeightId, up: WeightId, out: View },
    /// `out = silu(gate) * up`.
    SwiGlu { gate: View, up: View, out: View },
    /// cos/sin tables for `positions` (`[positions, inv_freq.len()]` each).
    RopeTables { positions: &'a [u32], inv_freq: &'a [f64], cos: View, sin: View },
    /// Rotates `x` (`[rows, heads, head_dim]`) in place.
    Rope { x: View, heads: usize, head_dim: usize, cos: View, sin: View, style: RopeStyle },
    /// Writes K/V rows into the cache at `slots`.
    WriteKv { k: View, v: View, slots: &'a [u32], cache: KvLayer },
    /// Causal attention of `q` over the cache, per sequence.
    Attention { kind: AttnKind, q: View, cache: KvLayer, seqs: &'a [SeqSpan<'a>], params: AttnParams, out: View },
    /// Mixture of experts: router, top-k and grouped expert SwiGLU MLPs.
    Moe { x: View, m: usize, router: WeightId, experts: &'a [ExpertIds], top_k: usize, out: View },
    /// `out[i] = x[rows[i]]`, rows of `cols` values.
    GatherRows { x: View, cols: usize, rows: &'a [u32], out: View },
}

impl Op<'_> {
    /// Name for logs and per-op profiles.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::AddRmsNorm { .. } => "add_rmsnorm",
            Op::Add { .. } => "add",
            Op::MatMul { .. } => "matmul",
            Op::MatMulSwiGlu { .. } => "matmul_swiglu",
            Op::SwiGlu { .. } => "swiglu",
            Op::RopeTables { .. } => "rope_tables",
            Op::Rope { .. } => "rope",
            Op::WriteKv { .. } => "write_kv",
            Op::Attention { kind: AttnKind::Flash, .. } => "flash_attention",
            Op::Attention { kind: AttnKind::Standard, .. } => "standard_attention",
            Op::Moe { .. } => "moe",
            Op::GatherRows { .. } => "gather_rows",
        }
    }
}
