//! The operator-level API: one operator, called directly, on a backend the host opened — for
//! timing an op, running models that are not decoder transformers, or trying tiling choices
//! (ATB's `Operation`: create from parameters, `Setup` → workspace size, `Execute`).
//!
//! ```no_run
//! use tboost_engine::backend::{BackendKind, BackendSpec, DType, Precision};
//! use tboost_engine::op_api::{MatMulParams, OpBackend, OpParams, Operation};
//! # fn main() -> tboost_engine::Result<()> {
//! let be = OpBackend::open(BackendSpec { kind: BackendKind::Cpu, threads: 2 })?;
//! let (precision, tiling) = (Precision::Exact, Default::default()); // tiling: the op's default split
//! let p = MatMulParams { weight: DType::F32, n: 2, k: 3, bias: false, precision, act: DType::F32, tiling };
//! let op = Operation::new(&be, OpParams::MatMul(p))?;
//! op.supports().map_err(|why| tboost_engine::Error::Unsupported(why.to_string()))?;
//! let x = be.alloc(DType::F32, &[1, 3])?;
//! let w = be.upload_weight(DType::F32, &[2, 3], [1f32, 0., 0., 0., 1., 0.].iter().flat_map(|v| v.to_le_bytes()).collect())?;
//! let y = be.alloc(DType::F32, &[1, 2])?;
//! be.write_f32(&x, &[1., 2., 3.])?;
//! op.execute(&[x, w], &mut [y.clone()], None)?;
//! assert_eq!(be.read_f32(&y)?, vec![1., 2.]);
//! # Ok(()) }
//! ```
//!
//! Tensors ([`TensorRef`]) are backend memory: buffers from [`OpBackend::alloc`] for
//! activations, indices, KV pools and outputs, resident weights from
//! [`OpBackend::upload_weight`] for matmul weights, norm gains, embedding tables and experts.
//! `supports` builds the very `OpQuery` the plan builds for the same case (through
//! [`crate::plan::query`]) and asks `Backend::supports`, so its answer is the plan's.
//! `execute` checks every tensor (count, dtype, shape, contiguity, memory kind, buffer
//! bounds) and returns an error naming the op, the tensor and what was expected; then it
//! enqueues the op on the backend's stream — [`OpBackend::read`] or
//! [`OpBackend::synchronize`] waits for it.
//!
//! Each op's tensors (shapes outermost first; `act` is the params' activation dtype):
//!
//! | op | inputs | outputs |
//! |---|---|---|
//! | `MatMul` | `x [m, k]` act, `weight [n, k]` weight, optional `bias [n]` weight | `y [m, n]` act |
//! | `MatMulSwiGlu` | `x [m, k]` act, `gate [n, k]` and `up [n, k]` weights | `y [m, n]` act |
//! | `RmsNorm` | `x [rows, dim]`, `gain [dim]` weight | `y [rows, dim]` |
//! | `AddRmsNorm` | `x [rows, dim]`, `gain [dim]` weight | `residual [rows, dim]` (read, `+= x`, written), `y [rows, dim]` |
//! | `Rope` | `positions [rows]` u32 | `x [rows, heads, head_dim]` (or `[rows, heads * head_dim]`) rotated in place (workspace: cos/sin tables in the act dtype) |
//! | `SwiGlu` | `gate [rows, n]`, `up [rows, n]` | `y [rows, n]` |
//! | `Embed` | `ids [n]` u32, `table [vocab, hidden]` weight | `y [n, hidden]` |
//! | `Attention` | `q [rows, heads * head_dim]`, `k_cache`, `v_cache` (whole buffers `[blocks, block_size, kv_heads, head_dim]` kv dtype), `seqs [count, 3]` u32 (`q_start, q_len, ctx_len`), `block_tables [count, max_blocks]` u32 | `out [rows, heads * head_dim]` |
//! | `MoeRoute` | `logits [m, experts]` | `ids [m, top_k]` u32, `weights [m, top_k]` (act) |
//! | `MoeGrouped` | `x [m, hidden]`, `ids`, `weights` (`MoeRoute`'s), then per expert `gate [inter, hidden]`, `up [inter, hidden]`, `down [hidden, inter]` weights, uploaded consecutively in that order | `y [m, hidden]` |

mod graph;
mod tensor;

pub use graph::{Callback, Graph, GraphBuilder};
pub use tensor::{contiguous_strides, Mem, OpBackend, TensorRef};

use crate::backend::{
    AttnKind, Backend, BufId, DType, ExpertSet, KvLayer, MatSegOp, Op, OpQuery, Precision, Segs, SeqRange, StepHost,
    StepViews, View, WeightId,
};
use crate::plan::query;
use crate::{Error, Result};
use tboost_ops::{AttnParams, AttnPhase, MatMulTiling, MoeTiling, RopeParams, Tiling, Unsupported, DEFAULT_TILE_KV};

/// `y = x · weightᵀ (+ bias)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatMulParams {
    /// The weight's element type (f32, f16, bf16 or a GGUF block type).
    pub weight: DType,
    /// Output features (the weight's rows).
    pub n: usize,
    /// Input features (the weight's columns).
    pub k: usize,
    /// Whether a bias vector is the third input.
    pub bias: bool,
    pub precision: Precision,
    /// Element type of `x` and `y`.
    pub act: DType,
    /// The CPU kernels' work split (weight rows and activation rows per task, tasks per
    /// thread, least bytes of a quantized decode task); every field `None` = the op's default.
    /// Results do not depend on it. A backend whose kernels tile themselves, and the bf16
    /// kernels of fast precision, take only the default (`supports` says so).
    pub tiling: MatMulTiling,
}

/// RMSNorm (and the fused residual add + RMSNorm) over rows of `dim` values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormParams {
    pub dim: usize,
    pub eps: f32,
    /// The gain's element type.
    pub gain: DType,
    pub act: DType,
}

/// Rotary embedding of `heads` heads of `head_dim` values per row, at each row's position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeOpParams {
    pub heads: usize,
    pub head_dim: usize,
    /// `rope.dim` is the rotated part of each head.
    pub rope: RopeParams,
    pub act: DType,
}

/// Embedding lookup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbedParams {
    pub table: DType,
    pub vocab: usize,
    pub hidden: usize,
    pub act: DType,
}

/// Causal attention over a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// `Flash` (tiled, online softmax), `Standard` (materialized scores, any head_dim) or
    /// `PagedDecode` (one query row per sequence).
    pub kind: AttnKind,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Score scale; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    pub block_size: usize,
    pub kv_dtype: DType,
    /// Longest context a sequence may reach (asked of the backend as the plan asks it).
    pub max_context: usize,
    pub act: DType,
    /// FlashAttention's KV tile (flash and paged decode): a power of two in 16..=256;
    /// `None` is the default, 64. The CPU kernel is compiled for each; a device backend,
    /// whose attention kernel tiles itself, takes only the default.
    pub tile_kv: Option<usize>,
}

/// Top-k softmax routing (renormalized over the top k).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRouteParams {
    pub experts: usize,
    pub top_k: usize,
    /// Element type of the logits and the routing weights.
    pub act: DType,
}

/// Routed tokens through their experts' SwiGLU MLPs, weighted sum.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeGroupedParams {
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// Each expert's intermediate size.
    pub inter: usize,
    /// Element type of every expert weight.
    pub weight: DType,
    pub act: DType,
    /// The CPU kernel's expert batching (tokens per expert batch, batches at once); `None`
    /// fields = the op's default. Results do not depend on it; a backend whose kernels tile
    /// themselves takes only the default.
    pub tiling: MoeTiling,
}

/// What to create.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OpParams {
    MatMul(MatMulParams),
    /// `y = silu(x · gateᵀ) * (x · upᵀ)` in one kernel (the plan's fused gate-up SwiGLU);
    /// `bias` must be false.
    MatMulSwiGlu(MatMulParams),
    RmsNorm(NormParams),
    AddRmsNorm(NormParams),
    Rope(RopeOpParams),
    /// `y = silu(gate) * up`; `act` is the element type of all three.
    SwiGlu {
        act: DType,
    },
    Embed(EmbedParams),
    Attention(AttentionParams),
    MoeRoute(MoeRouteParams),
    MoeGrouped(MoeGroupedParams),
}

impl OpParams {
    /// The op's name in errors and reports.
    pub fn name(&self) -> &'static str {
        match self {
            OpParams::MatMul(_) => "matmul",
            OpParams::MatMulSwiGlu(_) => "matmul_swiglu",
            OpParams::RmsNorm(_) => "rmsnorm",
            OpParams::AddRmsNorm(_) => "add_rmsnorm",
            OpParams::Rope(_) => "rope",
            OpParams::SwiGlu { .. } => "swiglu",
            OpParams::Embed(_) => "embed",
            OpParams::Attention(a) => a.kind.name(),
            OpParams::MoeRoute(_) => "moe_route",
            OpParams::MoeGrouped(_) => "moe_grouped",
        }
    }

    /// The queries the plan asks for this case (through the same constructors).
    pub fn queries(&self) -> Vec<OpQuery> {
        match *self {
            OpParams::MatMul(p) => vec![OpQuery::MatMul(query::matmul_case(p.weight, p.n, p.k, p.act, p.precision))],
            OpParams::MatMulSwiGlu(p) => {
                let case = query::matmul_case(p.weight, p.n, p.k, p.act, p.precision);
                vec![OpQuery::MatMulSwiGlu { gate: case, up: case }]
            }
            OpParams::RmsNorm(p) => vec![query::rms_norm(p.gain, p.act, false)],
            OpParams::AddRmsNorm(p) => vec![query::rms_norm(p.gain, p.act, true)],
            OpParams::Rope(p) => {
                vec![query::rope_tables(p.rope), query::rope(p.head_dim, p.rope.dim, p.rope.style, p.act)]
            }
            OpParams::SwiGlu { act } => vec![OpQuery::SwiGlu { act }],
            OpParams::Embed(p) => vec![query::embed(p.table, p.act)],
            OpParams::Attention(p) => {
                let phase = if p.kind == AttnKind::PagedDecode { AttnPhase::Decode } else { AttnPhase::Prefill };
                vec![query::attention(
                    p.kind,
                    phase,
                    p.head_dim,
                    p.heads,
                    p.kv_heads,
                    p.act,
                    p.kv_dtype,
                    p.block_size,
                    p.max_context,
                    0,
                )]
            }
            OpParams::MoeRoute(p) => vec![query::moe_route(p.experts, p.top_k)],
            OpParams::MoeGrouped(p) => {
                let gate = query::matmul_case(p.weight, p.inter, p.hidden, p.act, Precision::Exact);
                let down = query::matmul_case(p.weight, p.hidden, p.inter, p.act, Precision::Exact);
                vec![query::moe_grouped(p.experts, p.top_k, gate, down)]
            }
        }
    }

    /// Parameters that make no op at all (zero sizes, top_k above experts, ...).
    fn validate(&self) -> Result<()> {
        let op = self.name();
        let positive = |name: &str, v: usize| -> Result<()> {
            if v == 0 {
                return Err(Error::invalid(format!("{op}.{name}"), "must be positive"));
            }
            Ok(())
        };
        match *self {
            OpParams::MatMul(p) => {
                positive("n", p.n)?;
                positive("k", p.k)?;
                tiling_in_range(op, &p.tiling)
            }
            OpParams::MatMulSwiGlu(p) => {
                positive("n", p.n)?;
                positive("k", p.k)?;
                tiling_in_range(op, &p.tiling)?;
                if p.bias {
                    return Err(Error::invalid(format!("{op}.bias"), "the fused gate-up kernel takes no bias"));
                }
                Ok(())
            }
            OpParams::RmsNorm(p) | OpParams::AddRmsNorm(p) => {
                positive("dim", p.dim)?;
                if !p.eps.is_finite() || p.eps < 0.0 {
                    return Err(Error::invalid(format!("{op}.eps"), format!("{} is not finite and >= 0", p.eps)));
                }
                Ok(())
            }
            OpParams::Rope(p) => {
                positive("heads", p.heads)?;
                positive("head_dim", p.head_dim)?;
                if p.rope.dim > p.head_dim {
                    return Err(Error::invalid(
                        format!("{op}.rope.dim"),
                        format!("{} is above head_dim {}", p.rope.dim, p.head_dim),
                    ));
                }
                Ok(())
            }
            OpParams::SwiGlu { .. } => Ok(()),
            OpParams::Embed(p) => {
                positive("vocab", p.vocab)?;
                positive("hidden", p.hidden)
            }
            OpParams::Attention(p) => {
                positive("heads", p.heads)?;
                positive("kv_heads", p.kv_heads)?;
                positive("head_dim", p.head_dim)?;
                positive("block_size", p.block_size)?;
                if !p.heads.is_multiple_of(p.kv_heads) {
                    return Err(Error::invalid(
                        format!("{op}.heads"),
                        format!("{} is not a multiple of kv_heads {}", p.heads, p.kv_heads),
                    ));
                }
                if p.scale.is_some_and(|s| !s.is_finite()) {
                    return Err(Error::invalid(format!("{op}.scale"), "must be finite"));
                }
                if let Some(t) = p.tile_kv {
                    if p.kind == AttnKind::Standard {
                        return Err(Error::invalid(
                            format!("{op}.tile_kv"),
                            "standard attention materializes all scores and has no KV tile (flash and paged decode \
                             take tile_kv)",
                        ));
                    }
                    tboost_ops::check_tile_kv(t).map_err(|u| {
                        Error::invalid(
                            format!("{op}.tile_kv"),
                            format!("{} is not {} (accepted: 16, 32, 64, 128, 256)", u.value, u.need),
                        )
                    })?;
                }
                Ok(())
            }
            OpParams::MoeRoute(p) => {
                positive("experts", p.experts)?;
                positive("top_k", p.top_k)
            }
            OpParams::MoeGrouped(p) => {
                positive("experts", p.experts)?;
                positive("top_k", p.top_k)?;
                positive("hidden", p.hidden)?;
                positive("inter", p.inter)?;
                tiling_in_range(op, &p.tiling)
            }
        }
    }
}

/// Every set tunable in its range: else `{op}.{param}` with the accepted range.
fn tiling_in_range<T: Tiling>(op: &str, t: &T) -> Result<()> {
    t.check().map_err(|u| Error::invalid(format!("{op}.{}", u.param), format!("{} is not {}", u.value, u.need)))
}

/// One operator on one backend.
pub struct Operation {
    backend: OpBackend,
    params: OpParams,
    /// Scratch the op allocated itself when `execute` got no workspace (grown on demand).
    own_workspace: std::sync::Mutex<Option<(BufId, usize)>>,
}

impl Operation {
    /// Creates the operation. Parameters that describe no op (zero sizes, ...) are an error;
    /// a case the backend cannot run is not (ask `supports`).
    pub fn new(backend: &OpBackend, params: OpParams) -> Result<Operation> {
        params.validate()?;
        Ok(Operation { backend: backend.clone(), params, own_workspace: std::sync::Mutex::new(None) })
    }

    pub fn params(&self) -> &OpParams {
        &self.params
    }

    pub fn name(&self) -> &'static str {
        self.params.name()
    }

    /// Whether the backend runs this case, and if not the parameter it refuses — the same
    /// answer the plan records for the same case.
    pub fn supports(&self) -> Result<(), Unsupported> {
        let be = self.backend.lock().map_err(|e| Unsupported::new("backend", e, "usable"))?;
        let queries = self.params.queries();
        queries.iter().try_for_each(|q| be.supports(q))?;
        match self.params {
            OpParams::MatMul(p) | OpParams::MatMulSwiGlu(p) => {
                queries.iter().try_for_each(|q| be.supports_matmul_tiling(q, &p.tiling))?
            }
            OpParams::MoeGrouped(p) => be.supports_moe_tiling(&p.tiling)?,
            _ => {}
        }
        if let OpParams::Attention(AttentionParams { tile_kv: Some(t), .. }) = self.params {
            if t != DEFAULT_TILE_KV && be.name() != "cpu" {
                let need = format!("{DEFAULT_TILE_KV} on {} (its attention kernel chooses its own tiling)", be.name());
                return Err(Unsupported::new("tile_kv", t, need));
            }
        }
        Ok(())
    }

    /// Bytes of scratch `execute` needs for these tensors (0 for most ops; RoPE's cos/sin
    /// tables, in the activation dtype). Pass a workspace of at least this size (a buffer of
    /// [`Operation::workspace_dtype`] elements) or none, and the operation keeps scratch of its
    /// own.
    pub fn workspace_size(&self, inputs: &[TensorRef], outputs: &[TensorRef]) -> Result<usize> {
        match self.params {
            OpParams::Rope(p) => {
                let rows = self.rope_rows(&p, inputs, outputs)?;
                Ok(2 * rows * (p.rope.dim / 2) * p.act.block_bytes())
            }
            _ => Ok(0),
        }
    }

    /// The element type of the workspace buffer (the activation dtype).
    pub fn workspace_dtype(&self) -> DType {
        match self.params {
            OpParams::Rope(p) => p.act,
            _ => DType::F32,
        }
    }

    fn rope_rows(&self, p: &RopeOpParams, inputs: &[TensorRef], outputs: &[TensorRef]) -> Result<usize> {
        let c = Check::new(self.name(), inputs, outputs);
        c.counts(&["positions"], &["x"])?;
        let pos = &inputs[0];
        c.shape(pos, "positions", &[None])?;
        let rows = pos.shape[0];
        let x = &outputs[0];
        let ok3 = x.shape == [rows, p.heads, p.head_dim];
        let ok2 = x.shape == [rows, p.heads * p.head_dim];
        if !ok3 && !ok2 {
            return Err(c.err(
                "x",
                format!(
                    "shape {:?}: expected [{rows}, {}, {}] (rows of positions, heads, head_dim) or [{rows}, {}]",
                    x.shape,
                    p.heads,
                    p.head_dim,
                    p.heads * p.head_dim
                ),
            ));
        }
        Ok(rows)
    }

    /// Checks the tensors and enqueues the op on the backend's stream. `workspace`: see
    /// `workspace_size`. Errors name the op, the tensor and what was expected; a case the
    /// backend does not take is `Error::Unsupported` with its reason (never a kernel's panic).
    pub fn execute(
        &self,
        inputs: &[TensorRef],
        outputs: &mut [TensorRef],
        workspace: Option<&TensorRef>,
    ) -> Result<()> {
        if let Err(why) = self.supports() {
            let be = self.backend.name().unwrap_or("?");
            return Err(Error::Unsupported(format!("{} on {be}: {why}", self.name())));
        }
        let op = self.build(inputs, outputs, workspace)?;
        let mut be = self.backend.lock()?;
        for o in op {
            be.launch(&o)?;
        }
        Ok(())
    }

    /// The backend ops `execute` enqueues for these tensors (after every check).
    fn build(&self, inputs: &[TensorRef], outputs: &[TensorRef], workspace: Option<&TensorRef>) -> Result<Vec<Op>> {
        let name = self.name();
        let c = Check::new(name, inputs, outputs);
        let mut be_guard = self.backend.lock()?;
        let be: &mut dyn Backend = be_guard.as_mut();
        match self.params {
            OpParams::MatMul(p) => {
                let ins: &[&str] = if p.bias { &["x", "weight", "bias"] } else { &["x", "weight"] };
                c.counts(ins, &["y"])?;
                let (x, w, y) = (&inputs[0], &inputs[1], &outputs[0]);
                c.dtype(x, "x", p.act)?;
                c.shape(x, "x", &[None, Some(p.k)])?;
                let m = x.shape[0];
                c.dtype(w, "weight", p.weight)?;
                c.shape(w, "weight", &[Some(p.n), Some(p.k)])?;
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &[Some(m), Some(p.n)])?;
                let bias = if p.bias {
                    let b = &inputs[2];
                    c.shape(b, "bias", &[Some(p.n)])?;
                    Some(c.weight(b, "bias")?)
                } else {
                    None
                };
                let seg = MatSegOp { w: c.weight(w, "weight")?, bias, out: c.view(be, y, "y")? };
                let (precision, tiling) = (p.precision, p.tiling);
                Ok(vec![Op::MatMul { x: c.view(be, x, "x")?, m, segs: Segs::one(seg), precision, tiling }])
            }
            OpParams::MatMulSwiGlu(p) => {
                c.counts(&["x", "gate", "up"], &["y"])?;
                let (x, g, u, y) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
                c.dtype(x, "x", p.act)?;
                c.shape(x, "x", &[None, Some(p.k)])?;
                let m = x.shape[0];
                for (t, what) in [(g, "gate"), (u, "up")] {
                    c.dtype(t, what, p.weight)?;
                    c.shape(t, what, &[Some(p.n), Some(p.k)])?;
                }
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &[Some(m), Some(p.n)])?;
                Ok(vec![Op::MatMulSwiGlu {
                    x: c.view(be, x, "x")?,
                    m,
                    gate: c.weight(g, "gate")?,
                    up: c.weight(u, "up")?,
                    out: c.view(be, y, "y")?,
                    precision: p.precision,
                    tiling: p.tiling,
                }])
            }
            OpParams::RmsNorm(p) => {
                c.counts(&["x", "gain"], &["y"])?;
                let (x, g, y) = (&inputs[0], &inputs[1], &outputs[0]);
                c.dtype(x, "x", p.act)?;
                c.shape(x, "x", &[None, Some(p.dim)])?;
                c.dtype(g, "gain", p.gain)?;
                c.shape(g, "gain", &[Some(p.dim)])?;
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &x.shape.iter().map(|&d| Some(d)).collect::<Vec<_>>())?;
                let (xv, w, out) = (c.view(be, x, "x")?, c.weight(g, "gain")?, c.view(be, y, "y")?);
                Ok(vec![Op::RmsNorm { x: xv, w, eps: p.eps, out }])
            }
            OpParams::AddRmsNorm(p) => {
                c.counts(&["x", "gain"], &["residual", "y"])?;
                let (x, g, r, y) = (&inputs[0], &inputs[1], &outputs[0], &outputs[1]);
                c.dtype(x, "x", p.act)?;
                c.shape(x, "x", &[None, Some(p.dim)])?;
                c.dtype(g, "gain", p.gain)?;
                c.shape(g, "gain", &[Some(p.dim)])?;
                let same: Vec<Option<usize>> = x.shape.iter().map(|&d| Some(d)).collect();
                c.dtype(r, "residual", p.act)?;
                c.shape(r, "residual", &same)?;
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &same)?;
                let (xv, w) = (c.view(be, x, "x")?, c.weight(g, "gain")?);
                let (residual, out) = (c.view(be, r, "residual")?, c.view(be, y, "y")?);
                Ok(vec![Op::AddRmsNorm { residual, x: xv, w, eps: p.eps, out }])
            }
            OpParams::Rope(p) => {
                let rows = self.rope_rows(&p, inputs, outputs)?;
                let (pos, x) = (&inputs[0], &outputs[0]);
                c.dtype(pos, "positions", DType::U32)?;
                c.dtype(x, "x", p.act)?;
                let half = p.rope.dim / 2;
                let need = 2 * rows * half;
                let ws = match workspace {
                    Some(ws) => {
                        c.dtype(ws, "workspace", p.act)?;
                        let v = OpBackend::view_of(be, ws, &format!("{name}.workspace"))?;
                        if v.len < need {
                            return Err(c.err(
                                "workspace",
                                format!("{} {} elements: at least {need} needed (workspace_size)", v.len, p.act),
                            ));
                        }
                        v
                    }
                    None => self.own_scratch(be, p.act, need)?,
                };
                let (cos, sin) = (ws.sub(0, rows * half), ws.sub(rows * half, rows * half));
                let positions = c.view(be, pos, "positions")?;
                let xv = c.view(be, x, "x")?;
                Ok(vec![
                    Op::RopeTables { positions, rope: p.rope, cos, sin },
                    Op::Rope { x: xv, heads: p.heads, head_dim: p.head_dim, cos, sin, style: p.rope.style },
                ])
            }
            OpParams::SwiGlu { act } => {
                c.counts(&["gate", "up"], &["y"])?;
                let (g, u, y) = (&inputs[0], &inputs[1], &outputs[0]);
                c.dtype(g, "gate", act)?;
                c.shape(g, "gate", &[None, None])?;
                let same: Vec<Option<usize>> = g.shape.iter().map(|&d| Some(d)).collect();
                c.dtype(u, "up", act)?;
                c.shape(u, "up", &same)?;
                c.dtype(y, "y", act)?;
                c.shape(y, "y", &same)?;
                Ok(vec![Op::SwiGlu {
                    gate: c.view(be, g, "gate")?,
                    up: c.view(be, u, "up")?,
                    out: c.view(be, y, "y")?,
                }])
            }
            OpParams::Embed(p) => {
                c.counts(&["ids", "table"], &["y"])?;
                let (ids, t, y) = (&inputs[0], &inputs[1], &outputs[0]);
                c.dtype(ids, "ids", DType::U32)?;
                c.shape(ids, "ids", &[None])?;
                c.dtype(t, "table", p.table)?;
                c.shape(t, "table", &[Some(p.vocab), Some(p.hidden)])?;
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &[Some(ids.shape[0]), Some(p.hidden)])?;
                let idv = c.view(be, ids, "ids")?;
                // Ids are the user's data: out-of-range ones are an error, not a wild read.
                let mut host = vec![0u32; idv.len];
                if !host.is_empty() {
                    crate::backend::BackendExt::read_typed(be, idv, &mut host)?;
                }
                if let Some((i, &id)) = host.iter().enumerate().find(|(_, &id)| id as usize >= p.vocab) {
                    return Err(c.err("ids", format!("ids[{i}] = {id} is not below vocab {}", p.vocab)));
                }
                Ok(vec![Op::Embed { ids: idv, table: c.weight(t, "table")?, out: c.view(be, y, "y")? }])
            }
            OpParams::Attention(p) => self.attention(&c, be, &p, inputs, outputs),
            OpParams::MoeRoute(p) => {
                c.counts(&["logits"], &["ids", "weights"])?;
                let (l, ids, w) = (&inputs[0], &outputs[0], &outputs[1]);
                c.dtype(l, "logits", p.act)?;
                c.shape(l, "logits", &[None, Some(p.experts)])?;
                let m = l.shape[0];
                c.dtype(ids, "ids", DType::U32)?;
                c.shape(ids, "ids", &[Some(m), Some(p.top_k)])?;
                c.dtype(w, "weights", p.act)?;
                c.shape(w, "weights", &[Some(m), Some(p.top_k)])?;
                Ok(vec![Op::MoeRoute {
                    logits: c.view(be, l, "logits")?,
                    m,
                    experts: p.experts,
                    top_k: p.top_k,
                    ids: c.view(be, ids, "ids")?,
                    weights: c.view(be, w, "weights")?,
                }])
            }
            OpParams::MoeGrouped(p) => {
                let mut names: Vec<String> = vec!["x".into(), "ids".into(), "weights".into()];
                for e in 0..p.experts {
                    names.extend([format!("gate_{e}"), format!("up_{e}"), format!("down_{e}")]);
                }
                let ins: Vec<&str> = names.iter().map(String::as_str).collect();
                c.counts(&ins, &["y"])?;
                let (x, ids, w, y) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
                c.dtype(x, "x", p.act)?;
                c.shape(x, "x", &[None, Some(p.hidden)])?;
                let m = x.shape[0];
                c.dtype(ids, "ids", DType::U32)?;
                c.shape(ids, "ids", &[Some(m), Some(p.top_k)])?;
                c.dtype(w, "weights", p.act)?;
                c.shape(w, "weights", &[Some(m), Some(p.top_k)])?;
                c.dtype(y, "y", p.act)?;
                c.shape(y, "y", &[Some(m), Some(p.hidden)])?;
                let first = c.weight(&inputs[3], "gate_0")?;
                for (i, t) in inputs[3..].iter().enumerate() {
                    let what = ins[3 + i];
                    let shape = if i % 3 == 2 { [p.hidden, p.inter] } else { [p.inter, p.hidden] };
                    c.dtype(t, what, p.weight)?;
                    c.shape(t, what, &shape.map(Some))?;
                    let id = c.weight(t, what)?;
                    if id != WeightId(first.0 + i as u32) {
                        return Err(c.err(
                            what,
                            "expert weights must be uploaded consecutively as gate_0, up_0, down_0, gate_1, ... \
                             and passed in that order",
                        ));
                    }
                }
                // Expert ids are the user's data: check them before the kernel indexes by them.
                let idv = c.view(be, ids, "ids")?;
                let mut host = vec![0u32; idv.len];
                if !host.is_empty() {
                    crate::backend::BackendExt::read_typed(be, idv, &mut host)?;
                }
                if let Some((i, &e)) = host.iter().enumerate().find(|(_, &e)| e as usize >= p.experts) {
                    return Err(c.err("ids", format!("ids[{i}] = {e} is not below experts {}", p.experts)));
                }
                Ok(vec![Op::MoeGrouped {
                    x: c.view(be, x, "x")?,
                    m,
                    experts: ExpertSet { first, count: p.experts },
                    top_k: p.top_k,
                    ids: idv,
                    weights: c.view(be, w, "weights")?,
                    out: c.view(be, y, "y")?,
                    tiling: p.tiling,
                }])
            }
        }
    }

    fn attention(
        &self,
        c: &Check<'_>,
        be: &mut dyn Backend,
        p: &AttentionParams,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
    ) -> Result<Vec<Op>> {
        c.counts(&["q", "k_cache", "v_cache", "seqs", "block_tables"], &["out"])?;
        let (q, k, v, seqs, bt, out) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3], &inputs[4], &outputs[0]);
        let width = p.heads * p.head_dim;
        c.dtype(q, "q", p.act)?;
        c.shape(q, "q", &[None, Some(width)])?;
        let rows = q.shape[0];
        c.dtype(out, "out", p.act)?;
        c.shape(out, "out", &[Some(rows), Some(width)])?;
        let pool = [None, Some(p.block_size), Some(p.kv_heads), Some(p.head_dim)];
        c.dtype(k, "k_cache", p.kv_dtype)?;
        c.shape(k, "k_cache", &pool)?;
        let blocks = k.shape[0];
        c.dtype(v, "v_cache", p.kv_dtype)?;
        c.shape(v, "v_cache", &[Some(blocks), Some(p.block_size), Some(p.kv_heads), Some(p.head_dim)])?;
        c.dtype(seqs, "seqs", DType::U32)?;
        c.shape(seqs, "seqs", &[None, Some(3)])?;
        let count = seqs.shape[0];
        c.dtype(bt, "block_tables", DType::U32)?;
        c.shape(bt, "block_tables", &[Some(count), None])?;
        let max_blocks = bt.shape[1];
        let mut pools = [BufId(0); 2];
        for (i, (t, what)) in [(k, "k_cache"), (v, "v_cache")].into_iter().enumerate() {
            let view = c.view(be, t, what)?;
            let whole = be.buffer(view.buf).map(|(_, len)| len);
            if view.offset != 0 || whole != Some(view.len) {
                return Err(c.err(what, "must be a whole buffer (KV pools are named by buffer)"));
            }
            pools[i] = view.buf;
        }
        let seqs_v = c.view(be, seqs, "seqs")?;
        let bt_v = c.view(be, bt, "block_tables")?;
        // The seq table and block tables are the user's data: check every entry before a
        // kernel indexes by them.
        let mut table = vec![0u32; seqs_v.len];
        let mut blocks_host = vec![0u32; bt_v.len];
        if !table.is_empty() {
            crate::backend::BackendExt::read_typed(be, seqs_v, &mut table)?;
        }
        if !blocks_host.is_empty() {
            crate::backend::BackendExt::read_typed(be, bt_v, &mut blocks_host)?;
        }
        for (i, s) in table.chunks_exact(3).enumerate() {
            let (q_start, q_len, ctx) = (s[0] as usize, s[1] as usize, s[2] as usize);
            let used = ctx.div_ceil(p.block_size);
            if q_len == 0 || q_len > ctx || q_start + q_len > rows || used > max_blocks {
                return Err(c.err(
                    "seqs",
                    format!(
                        "sequence {i}: rows {q_start}+{q_len} of context {ctx} do not fit {rows} query rows and \
                         {max_blocks} blocks of {}",
                        p.block_size
                    ),
                ));
            }
            if p.kind == AttnKind::PagedDecode && q_len != 1 {
                return Err(c.err("seqs", format!("sequence {i}: q_len {q_len}; paged decode takes 1 row")));
            }
            let row = &blocks_host[i * max_blocks..i * max_blocks + used];
            if let Some(b) = row.iter().find(|&&b| b as usize >= blocks) {
                return Err(
                    c.err("block_tables", format!("sequence {i} names block {b}; the pools have {blocks} blocks"))
                );
            }
        }
        // Device backends take the sequence lengths on the host (aclnn's FIA): hand the
        // tables over as a step's, naming the caller's buffers (the CPU rewrites them in place).
        let seq_rows: Vec<[u32; 3]> = table.chunks_exact(3).map(|s| [s[0], s[1], s[2]]).collect();
        let none = View::new(seqs_v.buf, seqs_v.offset, 0);
        let host = StepHost {
            ids: &[],
            positions: &[],
            slots: &[],
            seqs: &seq_rows,
            block_tables: &blocks_host,
            logit_rows: &[],
        };
        let views = StepViews {
            ids: none,
            positions: none,
            slots: none,
            seqs: seqs_v,
            block_tables: bt_v,
            max_blocks,
            logit_rows: none,
        };
        be.set_step(&host, &views)?;
        let cache = KvLayer {
            k: pools[0],
            v: pools[1],
            dtype: p.kv_dtype,
            num_blocks: blocks,
            block_size: p.block_size,
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
        };
        let range = SeqRange { seqs: seqs_v, block_tables: bt_v, max_blocks, first: 0, count, row_start: 0, rows };
        let scale = p.scale.unwrap_or(1.0 / (p.head_dim as f32).sqrt());
        let mut params = AttnParams::new(p.heads, p.kv_heads, p.head_dim, scale);
        params.tile_kv = p.tile_kv.unwrap_or(DEFAULT_TILE_KV);
        Ok(vec![Op::Attention {
            kind: p.kind,
            q: c.view(be, q, "q")?,
            cache,
            seqs: range,
            params,
            out: c.view(be, out, "out")?,
        }])
    }

    /// The operation's own scratch of at least `len` elements of `dtype`.
    fn own_scratch(&self, be: &mut dyn Backend, dtype: DType, len: usize) -> Result<View> {
        let mut ws = self.own_workspace.lock().map_err(|_| Error::Poisoned)?;
        match *ws {
            Some((buf, have)) if have >= len && be.buffer(buf).is_some_and(|b| b.0 == dtype) => {
                return Ok(View::new(buf, 0, len))
            }
            Some((buf, _)) => {
                be.synchronize()?;
                be.free(buf);
                *ws = None;
            }
            None => {}
        }
        let buf = be.alloc(dtype, len.max(1))?;
        *ws = Some((buf, len.max(1)));
        Ok(View::new(buf, 0, len))
    }
}

impl Drop for Operation {
    fn drop(&mut self) {
        let ws = self.own_workspace.get_mut().ok().and_then(|w| w.take());
        if let (Some((buf, _)), Ok(mut be)) = (ws, self.backend.lock()) {
            // Work using the scratch may still be queued.
            let _ = be.synchronize();
            be.free(buf);
        }
    }
}

/// Tensor checks of one `execute`, with errors naming the op and the tensor.
struct Check<'a> {
    op: &'static str,
    inputs: &'a [TensorRef],
    outputs: &'a [TensorRef],
}

impl<'a> Check<'a> {
    fn new(op: &'static str, inputs: &'a [TensorRef], outputs: &'a [TensorRef]) -> Check<'a> {
        Check { op, inputs, outputs }
    }

    fn err(&self, tensor: &str, msg: impl Into<String>) -> Error {
        Error::invalid(format!("{}.{tensor}", self.op), msg)
    }

    fn counts(&self, ins: &[&str], outs: &[&str]) -> Result<()> {
        for (what, got, want) in [("inputs", self.inputs.len(), ins), ("outputs", self.outputs.len(), outs)] {
            if got != want.len() {
                return Err(self.err(what, format!("got {got} tensors, expected {} ({})", want.len(), want.join(", "))));
            }
        }
        Ok(())
    }

    fn dtype(&self, t: &TensorRef, what: &str, want: DType) -> Result<()> {
        if t.dtype != want {
            return Err(self.err(what, format!("dtype {}: expected {want}", t.dtype)));
        }
        Ok(())
    }

    /// `want`: per dimension its size, or `None` for any size.
    fn shape(&self, t: &TensorRef, what: &str, want: &[Option<usize>]) -> Result<()> {
        let ok = t.shape.len() == want.len() && t.shape.iter().zip(want).all(|(&d, w)| w.is_none_or(|w| w == d));
        if !ok {
            let text: Vec<String> = want.iter().map(|w| w.map_or("*".to_string(), |w| w.to_string())).collect();
            return Err(self.err(what, format!("shape {:?}: expected [{}]", t.shape, text.join(", "))));
        }
        Ok(())
    }

    fn view(&self, be: &dyn Backend, t: &TensorRef, what: &str) -> Result<View> {
        OpBackend::view_of(be, t, &format!("{}.{what}", self.op))
    }

    fn weight(&self, t: &TensorRef, what: &str) -> Result<WeightId> {
        match t.mem {
            Mem::Weight(id) => {
                if let Some((dim, stride, want)) = t.first_bad_stride() {
                    return Err(
                        self.err(what, format!("stride {stride} of dimension {dim} is not the contiguous {want}"))
                    );
                }
                Ok(id)
            }
            Mem::Buffer { .. } => Err(self.err(what, "is a buffer; a weight (upload_weight) is needed here")),
        }
    }
}
