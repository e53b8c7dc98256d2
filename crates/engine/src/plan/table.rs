//! The slots of a decoder model, their candidates in order of preference, the full case
//! each candidate asks of a backend, and the search over candidates, weight modes and
//! backends.

use serde::Serialize;
use tboost_ops::{
    check_tile_kv, AttnPhase, DType, MatMulCase, Precision, RopeParams, Tiling, Unsupported, DEFAULT_TILE_KV,
};

use super::query;
use super::{Decision, LayerPlan, Placement, Plan, PlanOptions, Tried, Verdict, WeightMode};
use crate::backend::{AttnKind, Backend, OpQuery};
use crate::model::arch::MlpAct;
use crate::model::{LayerWeights, Mlp, ModelConfig, ModelWeights, Tensor};
use crate::{Error, Result};

/// A place in the model that one operator (or a fixed sequence of them) fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Slot {
    Embed,
    RopeTables,
    /// The sliding layers' tables when they rotate with their own base (Gemma 3).
    RopeTablesLocal,
    FinalNorm,
    LmHead,
    AttnNorm,
    Qkv,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    QkNorm,
    Rope,
    KvWrite,
    AttentionPrefill,
    AttentionDecode,
    OProj,
    /// RMSNorm of the attention output before the residual add (Gemma 3).
    PostAttnNorm,
    FfnNorm,
    MoeRouting,
    Mlp,
    /// RMSNorm of the MLP output before the residual add (Gemma 3).
    PostFfnNorm,
    /// Sums the row-parallel partial results of the tensor-parallel ranks.
    AllReduce,
    /// Joins the ranks' vocabulary parts of the logits.
    AllGather,
}

impl Slot {
    pub fn name(self) -> &'static str {
        match self {
            Slot::Embed => "embed",
            Slot::RopeTables => "rope_tables",
            Slot::RopeTablesLocal => "rope_tables_local",
            Slot::FinalNorm => "final_norm",
            Slot::LmHead => "lm_head",
            Slot::AttnNorm => "attn_norm",
            Slot::Qkv => "qkv",
            Slot::QkNorm => "qk_norm",
            Slot::PostAttnNorm => "post_attn_norm",
            Slot::PostFfnNorm => "post_ffn_norm",
            Slot::Rope => "rope",
            Slot::KvWrite => "kv_write",
            Slot::AttentionPrefill => "attention_prefill",
            Slot::AttentionDecode => "attention_decode",
            Slot::OProj => "o_proj",
            Slot::FfnNorm => "ffn_norm",
            Slot::MoeRouting => "moe_routing",
            Slot::Mlp => "mlp",
            Slot::AllReduce => "all_reduce",
            Slot::AllGather => "all_gather",
        }
    }
}

/// An operator (or a fixed composition of ops) that can fill a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    Embed,
    /// Embedding lookup, then the rows multiplied by a constant (Gemma's sqrt(hidden)).
    EmbedThenScale,
    RopeTables,
    RmsNorm,
    /// Residual add fused into the following RMSNorm.
    AddRmsNorm,
    /// Residual add, then RMSNorm.
    AddThenRmsNorm,
    /// One matmul call reads the normed input once for Q, K and V.
    FusedQkvMatmul,
    SeparateQkvMatmuls,
    /// One RMSNorm over the q heads and one over the k heads, each with a `[head_dim]` gain.
    QkRmsNorm,
    Rope,
    WriteKv,
    FlashAttention,
    PagedDecodeAttention,
    StandardAttention,
    Matmul,
    /// Gate and up projections and SwiGLU in one kernel.
    FusedGateUpSwiglu,
    GateUpMatmulsThenSwiglu,
    /// Gate and up projections, then GeGLU (tanh GELU).
    GateUpMatmulsThenGeglu,
    /// Tokens grouped per expert, one call for the whole MoE block.
    MoeGrouped,
    /// Every expert as a dense MLP over every token of the step, then scatter and combine.
    MoePerExpert,
    MoeTopkSoftmax,
    /// Gather the rows whose logits are wanted, then the output projection.
    GatherThenMatmul,
    /// The row-parallel matmul and its all-reduce in one device op (Ascend MC2).
    MatmulAllReduce,
    /// The communicator's collective on device memory.
    DeviceAllReduce,
    /// Read to the host, reduce across ranks, write back.
    HostAllReduce,
    /// The communicator's all-gather on device memory.
    DeviceAllGather,
    HostAllGather,
}

impl Choice {
    pub fn name(self) -> &'static str {
        match self {
            Choice::Embed => "embed",
            Choice::EmbedThenScale => "embed_then_scale",
            Choice::QkRmsNorm => "qk_rmsnorm",
            Choice::GateUpMatmulsThenGeglu => "gate_up_matmuls_then_geglu",
            Choice::RopeTables => "rope_tables",
            Choice::RmsNorm => "rmsnorm",
            Choice::AddRmsNorm => "add_rmsnorm",
            Choice::AddThenRmsNorm => "add_then_rmsnorm",
            Choice::FusedQkvMatmul => "fused_qkv_matmul",
            Choice::SeparateQkvMatmuls => "separate_qkv_matmuls",
            Choice::Rope => "rope",
            Choice::WriteKv => "write_kv",
            Choice::FlashAttention => "flash_attention",
            Choice::PagedDecodeAttention => "paged_decode_attention",
            Choice::StandardAttention => "standard_attention",
            Choice::Matmul => "matmul",
            Choice::FusedGateUpSwiglu => "fused_gate_up_swiglu",
            Choice::GateUpMatmulsThenSwiglu => "gate_up_matmuls_then_swiglu",
            Choice::MoeGrouped => "moe_grouped",
            Choice::MoePerExpert => "moe_per_expert",
            Choice::MoeTopkSoftmax => "moe_topk_softmax",
            Choice::GatherThenMatmul => "gather_then_matmul",
            Choice::MatmulAllReduce => "matmul_all_reduce",
            Choice::DeviceAllReduce => "device_all_reduce",
            Choice::HostAllReduce => "host_all_reduce",
            Choice::DeviceAllGather => "device_all_gather",
            Choice::HostAllGather => "host_all_gather",
        }
    }

    /// Words for the "fallback to ..." line.
    fn words(self) -> &'static str {
        match self {
            Choice::FlashAttention => "flash attention",
            Choice::PagedDecodeAttention => "paged decode attention",
            Choice::StandardAttention => "standard attention",
            Choice::AddThenRmsNorm => "a separate add and rmsnorm",
            Choice::SeparateQkvMatmuls => "separate q/k/v matmuls",
            Choice::GateUpMatmulsThenSwiglu => "separate gate/up matmuls and swiglu",
            Choice::MoePerExpert => "moe per expert",
            other => other.name(),
        }
    }

    /// The `disable` name that forbids this candidate.
    pub fn disable_name(self) -> Option<&'static str> {
        match self {
            Choice::FlashAttention => Some("flash_attention"),
            Choice::PagedDecodeAttention => Some("paged_decode_attention"),
            Choice::StandardAttention => Some("standard_attention"),
            Choice::FusedQkvMatmul => Some("fuse_qkv"),
            Choice::FusedGateUpSwiglu => Some("fuse_gate_up"),
            Choice::AddRmsNorm => Some("fuse_add_norm"),
            Choice::MoeGrouped => Some("moe_grouped"),
            _ => None,
        }
    }

    pub fn attn_kind(self) -> Option<AttnKind> {
        match self {
            Choice::FlashAttention => Some(AttnKind::Flash),
            Choice::PagedDecodeAttention => Some(AttnKind::PagedDecode),
            Choice::StandardAttention => Some(AttnKind::Standard),
            _ => None,
        }
    }
}

/// The weights a slot's candidates use (their dtypes and shapes make the matmul cases).
enum SlotWeights<'w> {
    None,
    /// q and k norm gains.
    QkGains(&'w Tensor, &'w Tensor),
    Gain(&'w Tensor),
    Embed(&'w Tensor),
    Qkv(&'w LayerWeights),
    One(&'w Tensor),
    Mlp(&'w Mlp),
    Router(&'w Tensor),
    /// The sliding layers' RoPE tables (no weights).
    LocalRope,
}

/// The KV cache type for an explicit `asked`: itself, or, for an int8 (q8_0) cache the model
/// or backend cannot hold, f16 (else the backend's default) with the reason. Other types are
/// taken as asked, and a backend without them refuses the KV slots with its own answer.
fn kv_or_fallback(asked: DType, head_dim: usize, be: &dyn Backend) -> (DType, Option<String>) {
    if asked != DType::Q8_0 {
        return (asked, None);
    }
    let why = if !be.kv_dtypes().contains(&asked) {
        format!("backend {} has no q8_0 KV cache path", be.name())
    } else if asked.bytes_for(head_dim).is_none() {
        format!("head_dim {head_dim} is not a multiple of 32, q8_0's block")
    } else {
        return (asked, None);
    };
    let to = if be.kv_dtypes().contains(&DType::F16) {
        DType::F16
    } else {
        be.kv_dtypes().first().copied().unwrap_or(DType::F32)
    };
    (to, Some(format!("kv_dtype q8_0 asked, {to} used: {why}")))
}

/// What a backend is asked with: its activation and KV dtypes, the weight mode and the
/// precision under evaluation.
#[derive(Clone, Copy)]
struct Ask {
    act: DType,
    kv: DType,
    mode: WeightMode,
    precision: Precision,
}

/// Builds a candidate's queries under an `Ask`.
type BuildQueries<'f> = &'f dyn Fn(Choice, Ask) -> Vec<OpQuery>;

fn mm(t: &Tensor, a: Ask) -> MatMulCase {
    let (rows, cols) = t.rows_cols();
    let dtype = match a.mode {
        WeightMode::Convert(to) => to,
        WeightMode::Native | WeightMode::Packed => t.dtype,
    };
    query::matmul_case(dtype, rows, cols, a.act, a.precision)
}

fn gain_dtype(t: &Tensor, a: Ask) -> DType {
    match a.mode {
        WeightMode::Convert(to) => to,
        WeightMode::Native | WeightMode::Packed => t.dtype,
    }
}

/// What a backend took: the weight mode, the precision, its kernel's name, and the tiling
/// tunable it refuses for this case (`tiling.<group>.<param>=<value>: why`), if any.
type Accepted = (WeightMode, Precision, Option<String>, Option<String>);
/// The query a backend answered no to, and its answer.
type Rejection = Box<(OpQuery, Unsupported)>;

pub(super) struct Planner<'a> {
    cfg: &'a ModelConfig,
    w: &'a ModelWeights,
    primary: &'a dyn Backend,
    cpu: Option<&'a dyn Backend>,
    opts: &'a PlanOptions,
    act: DType,
    kv: DType,
    /// Why the KV cache is not the type the options asked for, when it is not.
    kv_reason: Option<String>,
}

impl<'a> Planner<'a> {
    pub fn new(
        cfg: &'a ModelConfig,
        w: &'a ModelWeights,
        primary: &'a dyn Backend,
        cpu: Option<&'a dyn Backend>,
        opts: &'a PlanOptions,
    ) -> Result<Planner<'a>> {
        let act = match opts.act_dtype {
            Some(d) => d,
            None => *primary
                .activation_dtypes()
                .first()
                .ok_or_else(|| Error::Unsupported(format!("backend {} names no activation dtype", primary.name())))?,
        };
        let (kv, kv_reason) = match opts.kv_dtype {
            Some(d) => kv_or_fallback(d, cfg.head_dim, primary),
            None => (primary.kv_dtypes().first().copied().unwrap_or(DType::F32), None),
        };
        let ranges = [("matmul", opts.matmul_tiling.check()), ("moe", opts.moe_tiling.check())];
        for (group, r) in ranges {
            r.map_err(|u| Error::config("engine config", format!("tiling.{group}.{}", u.param), u.to_string()))?;
        }
        Ok(Planner { cfg, w, primary, cpu, opts, act, kv, kv_reason })
    }

    fn rope(&self) -> RopeParams {
        global_rope(self.cfg)
    }

    fn local_rope(&self) -> RopeParams {
        local_rope(self.cfg).unwrap_or_else(|| self.rope())
    }

    fn attention_query(&self, kind: AttnKind, phase: AttnPhase, window: usize, a: Ask) -> OpQuery {
        let c = self.cfg;
        let (hd, heads, kvh, bs) = (c.head_dim, c.num_heads, c.num_kv_heads, self.opts.block_size);
        query::attention(kind, phase, hd, heads, kvh, a.act, a.kv, bs, c.max_position_embeddings, window)
    }

    /// The queries candidate `choice` makes for its slot under `a`.
    fn queries(&self, choice: Choice, sw: &SlotWeights<'_>, a: Ask) -> Vec<OpQuery> {
        let c = self.cfg;
        let norm = |t: &Tensor, fused_add| query::rms_norm(gain_dtype(t, a), a.act, fused_add);
        match (choice, sw) {
            (Choice::Embed, SlotWeights::Embed(t)) => vec![query::embed(gain_dtype(t, a), a.act)],
            (Choice::EmbedThenScale, SlotWeights::Embed(t)) => {
                vec![query::embed(gain_dtype(t, a), a.act), OpQuery::Scale { act: a.act }]
            }
            (Choice::RopeTables, SlotWeights::None) => vec![query::rope_tables(self.rope())],
            (Choice::RopeTables, SlotWeights::LocalRope) => vec![query::rope_tables(self.local_rope())],
            (Choice::QkRmsNorm, SlotWeights::QkGains(qn, kn)) => vec![norm(qn, false), norm(kn, false)],
            (Choice::RmsNorm, SlotWeights::Gain(t)) => vec![norm(t, false)],
            (Choice::AddRmsNorm, SlotWeights::Gain(t)) => vec![norm(t, true)],
            (Choice::AddThenRmsNorm, SlotWeights::Gain(t)) => vec![OpQuery::Add { act: a.act }, norm(t, false)],
            (Choice::FusedQkvMatmul, SlotWeights::Qkv(l)) => {
                vec![OpQuery::MatMulFused { cases: [Some(mm(&l.q, a)), Some(mm(&l.k, a)), Some(mm(&l.v, a))] }]
            }
            (Choice::SeparateQkvMatmuls, SlotWeights::Qkv(l)) => {
                [&l.q, &l.k, &l.v].iter().map(|t| OpQuery::MatMul(mm(t, a))).collect()
            }
            (Choice::Rope, _) => {
                vec![query::rope(c.head_dim, c.rope_dim, c.rope_style, a.act)]
            }
            (Choice::WriteKv, _) => vec![OpQuery::WriteKv {
                act: a.act,
                kv_dtype: a.kv,
                block_size: self.opts.block_size,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
            }],
            (Choice::FlashAttention | Choice::PagedDecodeAttention | Choice::StandardAttention, SlotWeights::None) => {
                // The phase is the slot's; the caller passes it through `a` below.
                unreachable!("attention queries are built by `attention_queries`")
            }
            (Choice::Matmul, SlotWeights::One(t)) => vec![OpQuery::MatMul(mm(t, a))],
            (Choice::FusedGateUpSwiglu, SlotWeights::Mlp(Mlp::Dense { gate, up, down })) => {
                vec![OpQuery::MatMulSwiGlu { gate: mm(gate, a), up: mm(up, a) }, OpQuery::MatMul(mm(down, a))]
            }
            (Choice::GateUpMatmulsThenSwiglu, SlotWeights::Mlp(Mlp::Dense { gate, up, down })) => vec![
                OpQuery::MatMul(mm(gate, a)),
                OpQuery::MatMul(mm(up, a)),
                OpQuery::SwiGlu { act: a.act },
                OpQuery::MatMul(mm(down, a)),
            ],
            (Choice::GateUpMatmulsThenGeglu, SlotWeights::Mlp(Mlp::Dense { gate, up, down })) => vec![
                OpQuery::MatMul(mm(gate, a)),
                OpQuery::MatMul(mm(up, a)),
                OpQuery::GeGlu { act: a.act },
                OpQuery::MatMul(mm(down, a)),
            ],
            (Choice::MoeGrouped, SlotWeights::Mlp(Mlp::Moe { experts, .. })) => match experts.first() {
                Some(e) => {
                    vec![query::moe_grouped(experts.len(), c.experts_per_token, mm(&e.gate, a), mm(&e.down, a))]
                }
                None => vec![],
            },
            // Every expert has the shape and dtype of the first (checked at load).
            (Choice::MoePerExpert, SlotWeights::Mlp(Mlp::Moe { experts, .. })) => match experts.first() {
                Some(e) => vec![
                    OpQuery::MatMul(mm(&e.gate, a)),
                    OpQuery::MatMul(mm(&e.up, a)),
                    OpQuery::SwiGlu { act: a.act },
                    OpQuery::MatMul(mm(&e.down, a)),
                    OpQuery::MoeScatterCombine { act: a.act },
                ],
                None => vec![],
            },
            (Choice::MoeTopkSoftmax, SlotWeights::Router(r)) => {
                vec![OpQuery::MatMul(mm(r, a)), query::moe_route(c.num_experts, c.experts_per_token)]
            }
            (Choice::GatherThenMatmul, SlotWeights::One(t)) => {
                let mut q = vec![OpQuery::GatherRows { act: a.act }, OpQuery::MatMul(mm(t, a))];
                if a.act != DType::F32 {
                    q.push(OpQuery::Convert { from: a.act, to: DType::F32 });
                }
                q
            }
            (choice, _) => unreachable!("candidate {} asked with the weights of another slot", choice.name()),
        }
    }

    fn attention_queries(&self, choice: Choice, phase: AttnPhase, window: usize, a: Ask) -> Vec<OpQuery> {
        match choice.attn_kind() {
            Some(kind) => vec![self.attention_query(kind, phase, window, a)],
            None => unreachable!("{} is not an attention candidate", choice.name()),
        }
    }

    /// The dtypes of the weights candidate `choice` reads (for weight-mode choices).
    fn weight_dtypes(sw: &SlotWeights<'_>) -> Vec<DType> {
        let mut v: Vec<DType> = match sw {
            SlotWeights::None | SlotWeights::LocalRope => vec![],
            SlotWeights::QkGains(q, k) => vec![q.dtype, k.dtype],
            SlotWeights::Gain(t) | SlotWeights::Embed(t) | SlotWeights::One(t) | SlotWeights::Router(t) => {
                vec![t.dtype]
            }
            SlotWeights::Qkv(l) => vec![l.q.dtype, l.k.dtype, l.v.dtype],
            SlotWeights::Mlp(Mlp::Dense { gate, up, down }) => vec![gate.dtype, up.dtype, down.dtype],
            SlotWeights::Mlp(Mlp::Moe { experts, .. }) => {
                experts.first().map(|e| vec![e.gate.dtype, e.up.dtype, e.down.dtype]).unwrap_or_default()
            }
        };
        v.dedup();
        v
    }

    /// `Packed` for a matmul slot's stored weights when `be` keeps some of their dtypes in its
    /// own layout at `precision` (and `pack_weights` is allowed); `mode` otherwise.
    fn packed_mode(
        &self,
        be: &dyn Backend,
        mode: WeightMode,
        precision: Precision,
        sw: &SlotWeights<'_>,
    ) -> WeightMode {
        let matmul = matches!(sw, SlotWeights::Qkv(_) | SlotWeights::One(_) | SlotWeights::Mlp(Mlp::Dense { .. }));
        let packs = Self::weight_dtypes(sw).iter().any(|&d| be.packs(d, precision));
        if mode == WeightMode::Native && matmul && packs && self.opts.allows("pack_weights") {
            WeightMode::Packed
        } else {
            mode
        }
    }

    /// The weight modes to try on backend `be`, native first. Conversion targets are the
    /// float types, the backend's activation types first; a target equal to every weight's
    /// own dtype is just "native".
    fn modes(&self, be: &dyn Backend, sw: &SlotWeights<'_>) -> Vec<WeightMode> {
        let mut modes = vec![WeightMode::Native];
        let dtypes = Self::weight_dtypes(sw);
        if dtypes.is_empty() || !self.opts.allows("convert_weights") {
            return modes;
        }
        let mut targets: Vec<DType> = be.activation_dtypes().to_vec();
        for d in [DType::F16, DType::BF16, DType::F32] {
            if !targets.contains(&d) {
                targets.push(d);
            }
        }
        for t in targets {
            if dtypes.iter().any(|&d| d != t) && t.is_float() {
                modes.push(WeightMode::Convert(t));
            }
        }
        modes
    }

    /// Asks `be` about `choice`: the first (mode, precision) it takes all queries of, or the
    /// answer to the first, preferred attempt — unless a later attempt failed on another
    /// parameter (a converted weight meeting a missing symbol or a gated version): that answer
    /// names what really blocks. `convert` selects the weight modes tried: the weights as
    /// stored, or converted at upload; `against` is the parameter the stored weights were
    /// refused on (a conversion's answer on another parameter is the blocker).
    #[allow(clippy::too_many_arguments)]
    fn evaluate(
        &self,
        be: &dyn Backend,
        act: DType,
        choice: Choice,
        build: &dyn Fn(Ask) -> Vec<OpQuery>,
        sw: &SlotWeights<'_>,
        convert: bool,
        against: Option<&str>,
    ) -> Option<Result<Accepted, Rejection>> {
        let (mut first_no, mut blocker) = (None, None);
        let first = self.opts.precision.for_weights(&Self::weight_dtypes(sw));
        let mut precisions = vec![first];
        if first != Precision::Exact {
            precisions.push(Precision::Exact);
        }
        let modes: Vec<WeightMode> =
            self.modes(be, sw).into_iter().filter(|m| (*m != WeightMode::Native) == convert).collect();
        if modes.is_empty() {
            return None;
        }
        for mode in modes {
            for &precision in &precisions {
                let a = Ask { act, kv: self.kv, mode, precision };
                let queries = build(a);
                match queries.iter().try_for_each(|q| be.supports(q).map_err(|why| Box::new((*q, why)))) {
                    Ok(()) => {
                        let tiling = self.tiling_refusal(be, &queries);
                        return Some(Ok((mode, precision, main_kernel(be, &queries), tiling)));
                    }
                    Err(no) => match &first_no {
                        None if against.is_some_and(|p| p != no.1.param) => blocker = Some(no),
                        None => first_no = Some(no),
                        // A later attempt failing on another parameter: the conversion (or the
                        // precision) cured the first objection and this one is what blocks.
                        Some(f) if blocker.is_none() && no.1.param != against.unwrap_or(&f.1.param) => {
                            blocker = Some(no)
                        }
                        Some(_) => {}
                    },
                }
            }
        }
        Some(Err(blocker.or(first_no).unwrap_or_else(|| {
            Box::new((OpQuery::Add { act }, Unsupported::new("candidate", choice.name(), "some query to ask")))
        })))
    }

    /// Whether `be` takes the engine's tiling tunables for these queries (every matmul and
    /// the grouped MoE): the first it refuses, as `tiling.<group>.<param>=<value> is not ...`.
    fn tiling_refusal(&self, be: &dyn Backend, queries: &[OpQuery]) -> Option<String> {
        queries.iter().find_map(|q| {
            let (group, answer) = match q {
                OpQuery::MatMul(_) | OpQuery::MatMulFused { .. } | OpQuery::MatMulSwiGlu { .. } => {
                    ("matmul", be.supports_matmul_tiling(q, &self.opts.matmul_tiling))
                }
                OpQuery::MoeGrouped { .. } => ("moe", be.supports_moe_tiling(&self.opts.moe_tiling)),
                _ => return None,
            };
            answer.err().map(|u| format!("tiling.{group}.{u}"))
        })
    }

    /// The backends to try, in order, each with the activation dtype it computes in.
    fn backends(&self) -> Vec<(&'a dyn Backend, Placement, DType)> {
        let mut v = vec![(self.primary, Placement::Primary, self.act)];
        if let Some(cpu) = self.cpu {
            v.push((cpu, Placement::Cpu, DType::F32));
        }
        v
    }

    /// Decides one slot: every candidate on the primary backend, then on the CPU (`only`
    /// restricts it to one of them).
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        layer: Option<usize>,
        slot: Slot,
        candidates: &[Choice],
        sw: &SlotWeights<'_>,
        build: &dyn Fn(Choice, Ask) -> Vec<OpQuery>,
        detail: String,
        only: Option<Placement>,
    ) -> Result<Decision> {
        self.decide_after(Vec::new(), layer, slot, candidates, sw, build, detail, only).map_err(|e| e.0)
    }

    /// `decide`, with `tried` holding earlier attempts (the primary's, when a group moves to the
    /// CPU): they stay in the decision's record and its reason. A failure keeps what was tried.
    #[allow(clippy::too_many_arguments)]
    fn decide_after(
        &self,
        mut tried: Vec<Tried>,
        layer: Option<usize>,
        slot: Slot,
        candidates: &[Choice],
        sw: &SlotWeights<'_>,
        build: &dyn Fn(Choice, Ask) -> Vec<OpQuery>,
        detail: String,
        only: Option<Placement>,
    ) -> Result<Decision, (Error, Vec<Tried>)> {
        // Every candidate with its weights as stored first; converting weights at upload (more
        // memory, maybe less precision) only when none of them fits. A block-quantized
        // embedding table is tried as stored on every backend before any conversion: a device
        // whose gather copies activation-dtype rows would hold it converted (f16: 3.6x a Q4_0
        // table), while on the host it stays in its file bytes and a lookup sends one row per
        // token to the device.
        let stored_everywhere_first = matches!(sw, SlotWeights::Embed(t) if t.dtype.is_quantized());
        let backends: Vec<_> = self.backends().into_iter().filter(|b| only.is_none_or(|p| p == b.1)).collect();
        let mut order = Vec::new();
        for convert in [false, true] {
            for &(be, placement, act) in &backends {
                order.push((be, placement, act, convert));
            }
        }
        if !stored_everywhere_first {
            order.sort_by_key(|&(_, placement, _, convert)| (placement != Placement::Primary, convert));
        }
        for (be, placement, act, convert) in order {
            for &choice in candidates {
                if let Some(name) = choice.disable_name().filter(|n| !self.opts.allows(n)) {
                    if !convert {
                        tried.push(Tried {
                            candidate: choice,
                            backend: be.name().into(),
                            verdict: Verdict::Disabled { name },
                        });
                    }
                    continue;
                }
                let Some(answer) = self.evaluate(
                    be,
                    act,
                    choice,
                    &|a| build(choice, a),
                    sw,
                    convert,
                    native_param(&tried, choice, be),
                ) else {
                    continue;
                };
                match answer {
                    Ok((_, _, _, Some(tiling))) => {
                        // Refused loudly, never dropped: the user asked for this split.
                        let at = layer.map_or("model".to_string(), |l| format!("layer {l}"));
                        let e = Error::Unsupported(format!(
                            "{tiling} ({at}: {} runs {} on {})",
                            slot.name(),
                            choice.name(),
                            be.name()
                        ));
                        return Err((e, tried));
                    }
                    Ok((weights, precision, kernel, None)) => {
                        let weights = self.packed_mode(be, weights, precision, sw);
                        tried.push(Tried { candidate: choice, backend: be.name().into(), verdict: Verdict::Chosen });
                        // Converting weights at upload is not a fallback: the preferred op
                        // runs where it should (the reason still says why the stored weights
                        // were refused). A fallback is a less preferred candidate or the CPU.
                        let rank = |c: Choice| candidates.iter().position(|&x| x == c);
                        let fallback =
                            placement != Placement::Primary || tried.iter().any(|t| rank(t.candidate) < rank(choice));
                        let refused: Vec<String> =
                            tried.iter().filter(|t| t.verdict != Verdict::Chosen).map(tried_text).collect();
                        let reason = match () {
                            _ if fallback && stored_everywhere_first && !convert => format!(
                                "{}; the table stays on the host as stored rather than converted on the device \
                                     (a lookup copies one row per token)",
                                fallback_reason(choice, &tried)
                            ),
                            _ if fallback => fallback_reason(choice, &tried),
                            _ if refused.is_empty() => detail,
                            _ => format!("{detail}; stored weights refused: {}", refused.join("; ")),
                        };
                        let copy = if placement == Placement::Cpu { self.copy_bytes(slot) } else { 0 };
                        return Ok(Decision {
                            slot,
                            choice,
                            backend: be.name().into(),
                            kernel,
                            placement,
                            weights,
                            precision,
                            fallback,
                            copy_bytes_per_token: copy,
                            reason,
                            tried,
                        });
                    }
                    // A conversion failing on another parameter than the stored weights
                    // (a missing symbol, a gated version) names what really blocks; one
                    // failing on the same adds nothing.
                    Err(no) if convert => {
                        let native = tried.iter_mut().rev().find(|t| t.candidate == choice && t.backend == be.name());
                        if let Some(t) = native {
                            if matches!(&t.verdict, Verdict::Rejected { why, .. } if why.param != no.1.param) {
                                t.verdict = Verdict::Rejected { query: no.0, why: no.1 };
                            }
                        }
                    }
                    Err(no) => tried.push(Tried {
                        candidate: choice,
                        backend: be.name().into(),
                        verdict: Verdict::Rejected { query: no.0, why: no.1 },
                    }),
                }
            }
        }
        let at = layer.map_or("model".to_string(), |l| format!("layer {l}"));
        let why: Vec<String> = tried.iter().map(tried_text).collect();
        let e = Error::Unsupported(format!(
            "{at}: no backend can run {} ({}): {}",
            slot.name(),
            self.case_text(),
            why.join("; ")
        ));
        Err((e, tried))
    }

    fn case_text(&self) -> String {
        let c = self.cfg;
        format!(
            "head_dim={} heads={} kv_heads={} act={} kv={} block_size={}",
            c.head_dim, c.num_heads, c.num_kv_heads, self.act, self.kv, self.opts.block_size
        )
    }

    /// Bytes a slot's inputs and outputs take per token when it runs away from its
    /// neighbours (copied there and back every step).
    fn copy_bytes(&self, slot: Slot) -> usize {
        let c = self.cfg;
        let e = self.act.block_bytes();
        let (h, qd, kvd) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let elems = match slot {
            Slot::Embed => h,
            Slot::RopeTables | Slot::RopeTablesLocal => c.rope_dim,
            Slot::AttnNorm | Slot::FfnNorm | Slot::FinalNorm => 4 * h,
            Slot::PostAttnNorm | Slot::PostFfnNorm => 2 * h,
            Slot::QkNorm => 4 * (qd + kvd),
            Slot::Qkv => h + qd + 2 * kvd,
            Slot::Rope => 2 * (qd + kvd) + c.rope_dim,
            Slot::KvWrite => 2 * kvd,
            Slot::AttentionPrefill | Slot::AttentionDecode => 3 * qd,
            Slot::OProj => qd + h,
            Slot::MoeRouting => h + 2 * c.experts_per_token,
            Slot::Mlp => 2 * h + 2 * c.experts_per_token,
            Slot::LmHead => h + c.vocab_size,
            Slot::AllReduce | Slot::AllGather => 0,
        };
        elems * e + 4 // + the u32 index (id, position or slot) the slot reads
    }

    pub fn build(&self) -> Result<Plan> {
        let c = self.cfg;
        let w = self.w;
        let q = |choice, sw: &SlotWeights<'_>, a| self.queries(choice, sw, a);
        let mut model = Vec::new();
        let sw = SlotWeights::Embed(&w.embed);
        let (embed, detail) = match embed_scale(c, w.embed.dtype) {
            Some(s) => (Choice::EmbedThenScale, format!("{} table, times {s}", w.embed.dtype)),
            None => (Choice::Embed, format!("{} table", w.embed.dtype)),
        };
        model.push(self.decide(None, Slot::Embed, &[embed], &sw, &|ch, a| q(ch, &sw, a), detail, None)?);
        let sw = SlotWeights::None;
        let rope = self.rope();
        let scaling = rope.scaling.map_or(String::new(), |s| format!(", {} scaling", s.name()));
        model.push(self.decide(
            None,
            Slot::RopeTables,
            &[Choice::RopeTables],
            &sw,
            &|ch, a| q(ch, &sw, a),
            format!("rope_dim={} theta={}{scaling}", rope.dim, rope.theta),
            None,
        )?);
        if let Some(local) = local_rope(c) {
            let sw = SlotWeights::LocalRope;
            model.push(self.decide(
                None,
                Slot::RopeTablesLocal,
                &[Choice::RopeTables],
                &sw,
                &|ch, a| q(ch, &sw, a),
                format!("sliding layers: rope_dim={} theta={}", local.dim, local.theta),
                None,
            )?);
        }

        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, lw) in w.layers.iter().enumerate() {
            let mut d = Vec::new();
            let one = |slot, cands: &[Choice], sw: SlotWeights<'_>, detail: String| -> Result<Decision> {
                self.decide(Some(i), slot, cands, &sw, &|ch, a| q(ch, &sw, a), detail, None)
            };
            let norms: &[Choice] =
                if i == 0 { &[Choice::RmsNorm] } else { &[Choice::AddRmsNorm, Choice::AddThenRmsNorm] };
            d.push(one(Slot::AttnNorm, norms, SlotWeights::Gain(&lw.attn_norm), format!("eps={}", c.rms_eps))?);
            d.push(one(
                Slot::Qkv,
                &[Choice::FusedQkvMatmul, Choice::SeparateQkvMatmuls],
                SlotWeights::Qkv(lw),
                matmul_detail(&[&lw.q, &lw.k, &lw.v], self.act),
            )?);
            if let (Some(qn), Some(kn)) = (&lw.extra.q_norm, &lw.extra.k_norm) {
                d.push(one(
                    Slot::QkNorm,
                    &[Choice::QkRmsNorm],
                    SlotWeights::QkGains(qn, kn),
                    format!("per head, [{}] gains, eps={}", c.head_dim, c.rms_eps),
                )?);
            }
            let tables = if c.features.local_rope(i) { "local tables" } else { "tables" };
            d.push(one(
                Slot::Rope,
                &[Choice::Rope],
                SlotWeights::None,
                format!("{:?}, rope_dim={}, {tables}", c.rope_style, c.rope_dim),
            )?);
            d.extend(self.attention_group(i)?);
            d.push(one(Slot::OProj, &[Choice::Matmul], SlotWeights::One(&lw.o), matmul_detail(&[&lw.o], self.act))?);
            if let Some(g) = &lw.extra.post_attn_norm {
                d.push(one(
                    Slot::PostAttnNorm,
                    &[Choice::RmsNorm],
                    SlotWeights::Gain(g),
                    format!("eps={}", c.rms_eps),
                )?);
            }
            d.push(one(
                Slot::FfnNorm,
                &[Choice::AddRmsNorm, Choice::AddThenRmsNorm],
                SlotWeights::Gain(&lw.ffn_norm),
                format!("eps={}", c.rms_eps),
            )?);
            let glu: &[Choice] = match c.features.mlp_act {
                MlpAct::Silu => &[Choice::FusedGateUpSwiglu, Choice::GateUpMatmulsThenSwiglu],
                MlpAct::GeluTanh => &[Choice::GateUpMatmulsThenGeglu],
            };
            match &lw.mlp {
                Mlp::Dense { gate, up, down } => {
                    d.push(one(Slot::Mlp, glu, SlotWeights::Mlp(&lw.mlp), matmul_detail(&[gate, up, down], self.act))?)
                }
                Mlp::Moe { router, experts } => {
                    d.push(one(
                        Slot::MoeRouting,
                        &[Choice::MoeTopkSoftmax],
                        SlotWeights::Router(router),
                        format!("top-{} of {} experts, renormalized", c.experts_per_token, experts.len()),
                    )?);
                    let first: Vec<&Tensor> =
                        experts.first().map(|e| vec![&e.gate, &e.up, &e.down]).unwrap_or_default();
                    d.push(one(
                        Slot::Mlp,
                        &[Choice::MoeGrouped, Choice::MoePerExpert],
                        SlotWeights::Mlp(&lw.mlp),
                        format!(
                            "{} experts, top-{}; {}",
                            experts.len(),
                            c.experts_per_token,
                            matmul_detail(&first, self.act)
                        ),
                    )?);
                }
            }
            if let Some(g) = &lw.extra.post_ffn_norm {
                d.push(one(Slot::PostFfnNorm, &[Choice::RmsNorm], SlotWeights::Gain(g), format!("eps={}", c.rms_eps))?);
            }
            layers.push(LayerPlan { layer: i, decisions: d });
        }

        let sw = SlotWeights::Gain(&w.norm);
        model.push(self.decide(
            None,
            Slot::FinalNorm,
            &[Choice::AddRmsNorm, Choice::AddThenRmsNorm],
            &sw,
            &|ch, a| q(ch, &sw, a),
            format!("eps={}", c.rms_eps),
            None,
        )?);
        let sw = SlotWeights::One(&w.lm_head);
        model.push(self.decide(
            None,
            Slot::LmHead,
            &[Choice::GatherThenMatmul],
            &sw,
            &|ch, a| q(ch, &sw, a),
            matmul_detail(&[&w.lm_head], self.act),
            None,
        )?);

        let mut plan = Plan {
            device: self.primary.device(),
            architecture: c.arch.to_string(),
            disabled: self.opts.disabled.iter().cloned().collect(),
            act_dtype: self.act,
            kv_dtype: self.kv,
            kv_dtype_reason: self.kv_reason.clone(),
            block_size: self.opts.block_size,
            precision: self.opts.precision,
            attention_tile_kv: self.opts.tile_kv.unwrap_or(DEFAULT_TILE_KV),
            matmul_tiling: self.opts.matmul_tiling,
            moe_tiling: self.opts.moe_tiling,
            model,
            layers,
            copy_bytes_per_token: 0,
            tp: None,
        };
        plan.copy_bytes_per_token = plan.decisions().map(|d| d.copy_bytes_per_token).sum();
        if let Some(t) = self.opts.tile_kv {
            const KEY: &str = "tiling.attention.tile_kv";
            check_tile_kv(t).map_err(|u| Error::config("engine config", KEY, u.to_string()))?;
            let tiled = |d: &&Decision| matches!(d.choice, Choice::FlashAttention | Choice::PagedDecodeAttention);
            if let Some(d) = plan.decisions().filter(tiled).find(|d| t != DEFAULT_TILE_KV && d.backend != "cpu") {
                return Err(Error::Unsupported(format!(
                    "{KEY}={t}: {} runs on {}, whose attention kernel chooses its own tiling (it takes only \
                     {DEFAULT_TILE_KV})",
                    d.slot.name(),
                    d.backend
                )));
            }
        }
        Ok(plan)
    }

    /// KV write and both attention phases: they share the KV pools, so they run on the same
    /// backend — the primary when it takes all three, else the CPU.
    fn attention_group(&self, i: usize) -> Result<Vec<Decision>> {
        let sw = SlotWeights::None;
        let window = self.cfg.features.window(i);
        let hd = match window {
            0 => format!("head_dim={}", self.cfg.head_dim),
            w => format!("head_dim={}, sliding_window={w}", self.cfg.head_dim),
        };
        let kv = |ch, a| self.queries(ch, &sw, a);
        let pre = |ch, a| self.attention_queries(ch, AttnPhase::Prefill, window, a);
        let dec = |ch, a| self.attention_queries(ch, AttnPhase::Decode, window, a);
        let prefill = [Choice::FlashAttention, Choice::StandardAttention];
        let decode = [Choice::PagedDecodeAttention, Choice::FlashAttention, Choice::StandardAttention];
        let slots: [(Slot, &[Choice], BuildQueries<'_>, String); 3] = [
            (Slot::KvWrite, &[Choice::WriteKv], &kv, format!("{} cache", self.kv)),
            (Slot::AttentionPrefill, &prefill, &pre, hd.clone()),
            (Slot::AttentionDecode, &decode, &dec, hd),
        ];
        let group = |prior: Vec<Vec<Tried>>, only| {
            let mut out = Vec::with_capacity(3);
            for ((slot, cands, build, detail), prior) in slots.iter().zip(prior) {
                out.push(self.decide_after(prior, Some(i), *slot, cands, &sw, *build, detail.clone(), only));
            }
            out
        };
        let on_primary = group(vec![Vec::new(); 3], Some(Placement::Primary));
        if on_primary.iter().all(Result::is_ok) || self.cpu.is_none() {
            return on_primary.into_iter().map(|r| r.map_err(|e| e.0)).collect();
        }
        // The primary cannot run the whole group: all three go to the CPU, and their records keep
        // what the primary answered (its rejections are the reason).
        let mut why_primary = Vec::new();
        let prior: Vec<Vec<Tried>> = on_primary
            .into_iter()
            .map(|r| {
                let tried = match r {
                    Ok(d) => d.tried,
                    Err((e, tried)) => {
                        why_primary.push(e.to_string());
                        tried
                    }
                };
                tried.into_iter().filter(|t| t.verdict != Verdict::Chosen).collect()
            })
            .collect();
        let mut d = Vec::with_capacity(3);
        for r in group(prior, Some(Placement::Cpu)) {
            let mut x = r.map_err(|(on_cpu, _)| {
                Error::Unsupported(format!("{}; and on the cpu: {on_cpu}", why_primary.join("; ")))
            })?;
            x.fallback = true;
            x.reason =
                format!("{} (kv_write and both attention phases share the KV pools: one backend runs them)", x.reason);
            d.push(x);
        }
        Ok(d)
    }
}

/// The model's RoPE (the global layers' when Gemma 3 gives the sliding ones their own base).
pub fn global_rope(c: &ModelConfig) -> RopeParams {
    RopeParams { dim: c.rope_dim, theta: c.rope_theta, scaling: c.rope_scaling, style: c.rope_style }
}

/// The sliding layers' RoPE when they have their own base: that base, unscaled (Gemma 3
/// scales only its global layers' frequencies).
pub fn local_rope(c: &ModelConfig) -> Option<RopeParams> {
    let theta = c.features.rope_local_theta?;
    c.features.sliding_layers.iter().any(|&s| s).then_some(RopeParams { theta, scaling: None, ..global_rope(c) })
}

/// Gemma's embedding scale: sqrt(hidden_size) rounded to the embedding's dtype (as
/// transformers rounds it to the weights' dtype), when the architecture has one.
pub fn embed_scale(c: &ModelConfig, table: DType) -> Option<f32> {
    if !c.features.embed_scale {
        return None;
    }
    let s = (c.hidden_size as f64).sqrt();
    Some(match table {
        DType::BF16 => half::bf16::from_f64(s).to_f32(),
        DType::F16 => half::f16::from_f64(s).to_f32(),
        _ => s as f32,
    })
}

/// The kernel names of a candidate's queries, joined (`aclnnMm+aclnnSwiGlu`), if the
/// backend names any.
fn main_kernel(be: &dyn Backend, queries: &[OpQuery]) -> Option<String> {
    let mut names: Vec<String> = Vec::new();
    for q in queries {
        for n in be.kernel_name(q).iter().flat_map(|n| n.split('+')) {
            if !names.iter().any(|x| x == n) {
                names.push(n.to_string());
            }
        }
    }
    (!names.is_empty()).then(|| names.join("+"))
}

fn matmul_detail(ts: &[&Tensor], act: DType) -> String {
    let mut dtypes: Vec<&str> = ts.iter().map(|t| t.dtype.name()).collect();
    dtypes.dedup();
    format!("{} weights, {act} activations", dtypes.join("/"))
}

pub(super) fn tried_text(t: &Tried) -> String {
    match &t.verdict {
        Verdict::Chosen => format!("{} on {}: chosen", t.candidate.name(), t.backend),
        Verdict::Disabled { name } => format!("{name} disabled by the user"),
        Verdict::Rejected { why, .. } | Verdict::Unavailable { why } => {
            format!("{} on {}: {why}", t.candidate.name(), t.backend)
        }
    }
}

/// "fallback to standard attention (flash_attention on cpu: head_dim=24 is not a multiple
/// of 16)".
fn fallback_reason(choice: Choice, tried: &[Tried]) -> String {
    let why: Vec<String> = tried.iter().filter(|t| t.verdict != Verdict::Chosen).map(tried_text).collect();
    let chosen = tried.last().map_or("", |t| t.backend.as_str());
    if why.is_empty() {
        format!("fallback to {} on {chosen}", choice.words())
    } else {
        format!("fallback to {} on {chosen} ({})", choice.words(), why.join("; "))
    }
}

/// The parameter `be` refused `choice`'s stored weights on, if it did.
fn native_param<'t>(tried: &'t [Tried], choice: Choice, be: &dyn Backend) -> Option<&'t str> {
    tried.iter().rev().find(|t| t.candidate == choice && t.backend == be.name()).and_then(|t| match &t.verdict {
        Verdict::Rejected { why, .. } => Some(why.param.as_ref()),
        _ => None,
    })
}
