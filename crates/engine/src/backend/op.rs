//! The ops a backend executes and the cases the plan asks about. Ops name buffers and
//! weights and carry plain parameters; they hold no host data, so a device can enqueue them
//! and the CPU can queue them (`Op` is `Copy`).

use serde::Serialize;
use tboost_ops::{
    AttentionCase, AttnParams, DType, MatMulCase, MatMulTiling, MoeTiling, Precision, RopeParams, RopeStyle,
};

use super::{BufId, WeightId};

/// `len` elements of buffer `buf` starting at element `offset` (elements of the buffer's
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

    /// `len` elements starting `start` elements into this view.
    pub fn sub(self, start: usize, len: usize) -> View {
        debug_assert!(start + len <= self.len);
        View { buf: self.buf, offset: self.offset + start, len }
    }
}

/// One layer's paged K and V pools: `[num_blocks, block_size, kv_heads, head_dim]` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayer {
    pub k: BufId,
    pub v: BufId,
    pub dtype: DType,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The attention algorithms the plan chooses between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnKind {
    /// Tiled, online softmax, scratch bounded by tile size (prefill chunks).
    Flash,
    /// One query row per sequence over its paged KV (decodes).
    PagedDecode,
    /// Materialized scores; any head_dim.
    Standard,
}

impl AttnKind {
    pub fn name(self) -> &'static str {
        match self {
            AttnKind::Flash => "flash_attention",
            AttnKind::PagedDecode => "paged_decode_attention",
            AttnKind::Standard => "standard_attention",
        }
    }
}

/// The step's index arrays as the backend holds them (see `Backend::set_step`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepViews {
    /// Token ids, `[tokens]` u32.
    pub ids: View,
    /// Absolute position of each token in its sequence, `[tokens]` u32.
    pub positions: View,
    /// KV slot (block * block_size + row) of each token, `[tokens]` u32.
    pub slots: View,
    /// Per sequence `[q_start, q_len, ctx_len]`, `[seqs * 3]` u32.
    pub seqs: View,
    /// Per sequence `max_blocks` block ids, `[seqs * max_blocks]` u32.
    pub block_tables: View,
    pub max_blocks: usize,
    /// Rows whose logits are wanted, `[rows]` u32.
    pub logit_rows: View,
}

/// A contiguous run of the step's sequences, all in one attention phase, and the query rows
/// they cover (`q_start` values in the seq table are rows of the whole step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRange {
    /// `[count * 3]` entries of the step's seq table.
    pub seqs: View,
    /// `[count * max_blocks]` entries of the step's block tables.
    pub block_tables: View,
    pub max_blocks: usize,
    /// First sequence of the run in the step (an index into the host copy of the table).
    pub first: usize,
    pub count: usize,
    pub row_start: usize,
    pub rows: usize,
}

/// The experts of one MoE layer: weights uploaded consecutively as
/// `gate_0, up_0, down_0, gate_1, ...` starting at `first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSet {
    pub first: WeightId,
    pub count: usize,
}

impl ExpertSet {
    /// (gate, up, down) of expert `e`.
    pub fn expert(&self, e: usize) -> (WeightId, WeightId, WeightId) {
        let b = self.first.0 + 3 * e as u32;
        (WeightId(b), WeightId(b + 1), WeightId(b + 2))
    }
}

/// One output of a (possibly merged) projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatSegOp {
    pub w: WeightId,
    pub bias: Option<WeightId>,
    pub out: View,
}

/// Up to three projections sharing one input (fused QKV), without a heap allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segs {
    segs: [Option<MatSegOp>; 3],
}

impl Segs {
    pub fn one(s: MatSegOp) -> Segs {
        Segs { segs: [Some(s), None, None] }
    }

    pub fn from_slice(s: &[MatSegOp]) -> Segs {
        assert!(!s.is_empty() && s.len() <= 3, "a matmul takes 1 to 3 segments, got {}", s.len());
        let mut segs = [None; 3];
        for (d, s) in segs.iter_mut().zip(s) {
            *d = Some(*s);
        }
        Segs { segs }
    }

    pub fn iter(&self) -> impl Iterator<Item = &MatSegOp> {
        self.segs.iter().flatten()
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.segs[0].is_none()
    }

    fn map(&self, mut f: impl FnMut(MatSegOp) -> MatSegOp) -> Segs {
        Segs { segs: self.segs.map(|s| s.map(&mut f)) }
    }
}

/// What the plan asks a backend about: the full case of one op.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpQuery {
    /// Embedding lookup from a table of `table` dtype into `act` activations.
    Embed {
        table: DType,
        act: DType,
    },
    /// RMSNorm (`fused_add`: with the residual add fused in) with a gain of `gain` dtype.
    RmsNorm {
        gain: DType,
        act: DType,
        fused_add: bool,
    },
    /// Elementwise `dst += src`.
    Add {
        act: DType,
    },
    /// One weight matrix.
    MatMul(MatMulCase),
    /// Several weight matrices sharing one input in one call (fused QKV).
    MatMulFused {
        cases: [Option<MatMulCase>; 3],
    },
    /// `silu(x · gateᵀ) * (x · upᵀ)` in one kernel.
    MatMulSwiGlu {
        gate: MatMulCase,
        up: MatMulCase,
    },
    /// `silu(gate) * up`.
    SwiGlu {
        act: DType,
    },
    /// `gelu_tanh(gate) * up` (GeGLU).
    GeGlu {
        act: DType,
    },
    /// Elementwise `x *= s` (Gemma's embedding scale).
    Scale {
        act: DType,
    },
    /// cos/sin tables for the step's positions.
    RopeTables {
        rope: RopeParams,
    },
    /// RoPE over `rot_dim` of `head_dim` dimensions.
    Rope {
        head_dim: usize,
        rot_dim: usize,
        style: RopeStyle,
        act: DType,
    },
    /// K/V rows into the paged cache at the slot mapping.
    WriteKv {
        act: DType,
        kv_dtype: DType,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    Attention {
        kind: AttnKind,
        case: AttentionCase,
    },
    /// Softmax top-k routing over router logits.
    MoeRoute {
        experts: usize,
        top_k: usize,
    },
    /// Grouped expert SwiGLU MLPs over routed tokens.
    MoeGrouped {
        experts: usize,
        top_k: usize,
        gate: MatMulCase,
        down: MatMulCase,
    },
    /// The per-expert MoE path's scatter of one expert's rows and the weighted combine.
    MoeScatterCombine {
        act: DType,
    },
    /// Rows of a matrix gathered by index.
    GatherRows {
        act: DType,
    },
    /// Element type conversion.
    Convert {
        from: DType,
        to: DType,
    },
}

/// One unit of work on a backend's stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// `out[i] = table[ids[i]]`.
    Embed { ids: View, table: WeightId, out: View },
    /// `out = rmsnorm(x) * w`.
    RmsNorm { x: View, w: WeightId, eps: f32, out: View },
    /// `residual += x; out = rmsnorm(residual) * w` (fused).
    AddRmsNorm { residual: View, x: View, w: WeightId, eps: f32, out: View },
    /// `dst += src`.
    Add { dst: View, src: View },
    /// `seg.out = x · seg.wᵀ + seg.bias` for each segment; `x` is `[m, k]`. `tiling`: the CPU
    /// kernels' work split (a backend whose kernels tile themselves takes only the default).
    MatMul { x: View, m: usize, segs: Segs, precision: Precision, tiling: MatMulTiling },
    /// `out = silu(x · gateᵀ) * (x · upᵀ)` (fused).
    MatMulSwiGlu {
        x: View,
        m: usize,
        gate: WeightId,
        up: WeightId,
        out: View,
        precision: Precision,
        tiling: MatMulTiling,
    },
    /// `out = silu(gate) * up`.
    SwiGlu { gate: View, up: View, out: View },
    /// `out = gelu_tanh(gate) * up`, `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/π) (g + 0.044715 g³)))`.
    GeGlu { gate: View, up: View, out: View },
    /// `x *= s`.
    Scale { x: View, s: f32 },
    /// cos/sin tables (`[positions, rope.dim / 2]` f32 each) for `positions`.
    RopeTables { positions: View, rope: RopeParams, cos: View, sin: View },
    /// `RopeTables` with frequency `i` divided by `factors[i]` (a `[rope.dim / 2]` weight:
    /// LongRoPE's short or long list).
    RopeTablesScaled { positions: View, rope: RopeParams, factors: WeightId, cos: View, sin: View },
    /// Rotates `x` (`[rows, heads, head_dim]`) in place.
    Rope { x: View, heads: usize, head_dim: usize, cos: View, sin: View, style: RopeStyle },
    /// Writes K/V rows into the cache at `slots`.
    WriteKv { k: View, v: View, slots: View, cache: KvLayer },
    /// Causal attention of the rows of `seqs` in `q` over the cache; writes those rows of
    /// `out` (`q` and `out` span the whole step).
    Attention { kind: AttnKind, q: View, cache: KvLayer, seqs: SeqRange, params: AttnParams, out: View },
    /// Top-k softmax routing of `[m, experts]` logits: `ids`/`weights` are `[m, top_k]`
    /// (u32 / f32), weights renormalized over the top k.
    MoeRoute { logits: View, m: usize, experts: usize, top_k: usize, ids: View, weights: View },
    /// Routed tokens through their experts' SwiGLU MLPs, weighted sum into `out`, with the
    /// CPU kernel's expert batching `tiling`.
    MoeGrouped {
        x: View,
        m: usize,
        experts: ExpertSet,
        top_k: usize,
        ids: View,
        weights: View,
        out: View,
        tiling: MoeTiling,
    },
    /// `ys[i * top_k + j] = y[i]` for every `j` with `ids[i, j] == expert`; `y` is
    /// `[m, hidden]`, `ys` `[m * top_k, hidden]` (the per-expert MoE path).
    MoeScatter { y: View, m: usize, expert: u32, top_k: usize, ids: View, ys: View },
    /// `out[i] = Σ_j weights[i, j] * ys[i * top_k + j]`, summed in rank order (as the grouped
    /// op sums, so both MoE paths give the same bits).
    MoeCombine { ys: View, m: usize, top_k: usize, weights: View, out: View },
    /// `out[i] = x[rows[i]]`, rows of `cols` values.
    GatherRows { x: View, cols: usize, rows: View, out: View },
    /// `dst = src` converted to `dst`'s dtype (same element count).
    Convert { src: View, dst: View },
    /// `dst = 0`.
    Zero { dst: View },
}

/// How an op uses one of its views.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    /// Read and written (in-place ops, accumulators).
    ReadWrite,
}

impl Op {
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
            Op::GeGlu { .. } => "geglu",
            Op::Scale { .. } => "scale",
            Op::RopeTables { .. } | Op::RopeTablesScaled { .. } => "rope_tables",
            Op::Rope { .. } => "rope",
            Op::WriteKv { .. } => "write_kv",
            Op::Attention { kind, .. } => kind.name(),
            Op::MoeRoute { .. } => "moe_route",
            Op::MoeGrouped { .. } => "moe_grouped",
            Op::MoeScatter { .. } => "moe_scatter",
            Op::MoeCombine { .. } => "moe_combine",
            Op::GatherRows { .. } => "gather_rows",
            Op::Convert { .. } => "convert",
            Op::Zero { .. } => "zero",
        }
    }

    /// Every buffer view the op touches and how (KV pools excluded: they stay where the plan
    /// put attention).
    pub fn views(&self, f: &mut dyn FnMut(View, Access)) {
        use Access::*;
        match *self {
            Op::Embed { ids, out, .. } => {
                f(ids, Read);
                f(out, Write);
            }
            Op::RmsNorm { x, out, .. } => {
                f(x, Read);
                f(out, Write);
            }
            Op::AddRmsNorm { residual, x, out, .. } => {
                f(residual, ReadWrite);
                f(x, Read);
                f(out, Write);
            }
            Op::Add { dst, src } => {
                f(dst, ReadWrite);
                f(src, Read);
            }
            Op::MatMul { x, segs, .. } => {
                f(x, Read);
                for s in segs.iter() {
                    f(s.out, Write);
                }
            }
            Op::MatMulSwiGlu { x, out, .. } => {
                f(x, Read);
                f(out, Write);
            }
            Op::SwiGlu { gate, up, out } | Op::GeGlu { gate, up, out } => {
                f(gate, Read);
                f(up, Read);
                f(out, Write);
            }
            Op::Scale { x, .. } => f(x, ReadWrite),
            Op::RopeTables { positions, cos, sin, .. } | Op::RopeTablesScaled { positions, cos, sin, .. } => {
                f(positions, Read);
                f(cos, Write);
                f(sin, Write);
            }
            Op::Rope { x, cos, sin, .. } => {
                f(x, ReadWrite);
                f(cos, Read);
                f(sin, Read);
            }
            Op::WriteKv { k, v, slots, .. } => {
                f(k, Read);
                f(v, Read);
                f(slots, Read);
            }
            Op::Attention { q, seqs, out, .. } => {
                f(q, Read);
                f(seqs.seqs, Read);
                f(seqs.block_tables, Read);
                f(out, ReadWrite);
            }
            Op::MoeRoute { logits, ids, weights, .. } => {
                f(logits, Read);
                f(ids, Write);
                f(weights, Write);
            }
            Op::MoeGrouped { x, ids, weights, out, .. } => {
                f(x, Read);
                f(ids, Read);
                f(weights, Read);
                f(out, Write);
            }
            Op::MoeScatter { y, ids, ys, .. } => {
                f(y, Read);
                f(ids, Read);
                f(ys, ReadWrite);
            }
            Op::MoeCombine { ys, weights, out, .. } => {
                f(ys, Read);
                f(weights, Read);
                f(out, Write);
            }
            Op::GatherRows { x, rows, out, .. } => {
                f(x, Read);
                f(rows, Read);
                f(out, Write);
            }
            Op::Convert { src, dst } => {
                f(src, Read);
                f(dst, Write);
            }
            Op::Zero { dst } => f(dst, Write),
        }
    }

    /// The same op with every view passed through `v` and every weight through `w` (to run
    /// it on another backend).
    pub fn remap(&self, v: &dyn Fn(View) -> View, w: &dyn Fn(WeightId) -> WeightId) -> Op {
        let mut op = *self;
        match &mut op {
            Op::Embed { ids, table, out } => {
                *ids = v(*ids);
                *table = w(*table);
                *out = v(*out);
            }
            Op::RmsNorm { x, w: g, out, .. } => {
                *x = v(*x);
                *g = w(*g);
                *out = v(*out);
            }
            Op::AddRmsNorm { residual, x, w: g, out, .. } => {
                *residual = v(*residual);
                *x = v(*x);
                *g = w(*g);
                *out = v(*out);
            }
            Op::Add { dst, src } => {
                *dst = v(*dst);
                *src = v(*src);
            }
            Op::MatMul { x, segs, .. } => {
                *x = v(*x);
                *segs = segs.map(|s| MatSegOp { w: w(s.w), bias: s.bias.map(w), out: v(s.out) });
            }
            Op::MatMulSwiGlu { x, gate, up, out, .. } => {
                *x = v(*x);
                *gate = w(*gate);
                *up = w(*up);
                *out = v(*out);
            }
            Op::SwiGlu { gate, up, out } | Op::GeGlu { gate, up, out } => {
                *gate = v(*gate);
                *up = v(*up);
                *out = v(*out);
            }
            Op::Scale { x, .. } => *x = v(*x),
            Op::RopeTables { positions, cos, sin, .. } => {
                *positions = v(*positions);
                *cos = v(*cos);
                *sin = v(*sin);
            }
            Op::RopeTablesScaled { positions, factors, cos, sin, .. } => {
                *positions = v(*positions);
                *factors = w(*factors);
                *cos = v(*cos);
                *sin = v(*sin);
            }
            Op::Rope { x, cos, sin, .. } => {
                *x = v(*x);
                *cos = v(*cos);
                *sin = v(*sin);
            }
            Op::WriteKv { k, v: vv, slots, .. } => {
                *k = v(*k);
                *vv = v(*vv);
                *slots = v(*slots);
            }
            Op::Attention { q, seqs, out, .. } => {
                *q = v(*q);
                seqs.seqs = v(seqs.seqs);
                seqs.block_tables = v(seqs.block_tables);
                *out = v(*out);
            }
            Op::MoeRoute { logits, ids, weights, .. } => {
                *logits = v(*logits);
                *ids = v(*ids);
                *weights = v(*weights);
            }
            Op::MoeGrouped { x, experts, ids, weights, out, .. } => {
                *x = v(*x);
                experts.first = w(experts.first);
                *ids = v(*ids);
                *weights = v(*weights);
                *out = v(*out);
            }
            Op::MoeScatter { y, ids, ys, .. } => {
                *y = v(*y);
                *ids = v(*ids);
                *ys = v(*ys);
            }
            Op::MoeCombine { ys, weights, out, .. } => {
                *ys = v(*ys);
                *weights = v(*weights);
                *out = v(*out);
            }
            Op::GatherRows { x, rows, out, .. } => {
                *x = v(*x);
                *rows = v(*rows);
                *out = v(*out);
            }
            Op::Convert { src, dst } => {
                *src = v(*src);
                *dst = v(*dst);
            }
            Op::Zero { dst } => *dst = v(*dst),
        }
        op
    }
}
