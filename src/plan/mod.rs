//! The operator mapping table: at load time, every layer's ops are chosen by asking each
//! candidate, in order of preference, whether the backend supports this case; the first
//! that does wins, and the choice and its reason are recorded (ATB's question "was the fused
//! op chosen, and if not, why"). Users can forbid ops and fusions by name to isolate a
//! performance or accuracy problem (`PlanOptions::disabled`, `TBOOST_DISABLE`).
//!
//! Names users can forbid (see README "Operator plan"):
//! - ops: `flash_attention`, `standard_attention`
//! - fusions: `fuse_qkv` (one matmul call for the Q, K and V projections),
//!   `fuse_gate_up` (gate and up projections and SwiGLU in one kernel),
//!   `fuse_add_norm` (residual add inside the following RMSNorm)

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::Serialize;
use tboost_ops::DType;
use tboost_ops::{AttentionCase, AttnPhase, MatMulCase};

use crate::backend::{AttnKind, Backend, OpQuery};
use crate::model::{Mlp, ModelConfig, ModelWeights, Tensor};
use crate::{Error, Result};

/// Every name `PlanOptions::disabled` accepts.
pub const KNOWN_NAMES: &[&str] =
    &["flash_attention", "standard_attention", "fuse_qkv", "fuse_gate_up", "fuse_add_norm"];

/// What the user forbids, and the engine settings the choice depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    pub disabled: BTreeSet<String>,
    /// Element type of the KV cache the attention ops read.
    pub kv_dtype: DType,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { disabled: BTreeSet::new(), kv_dtype: DType::F32 }
    }
}

impl PlanOptions {
    /// Parses a comma-separated list of names (`TBOOST_DISABLE` syntax).
    pub fn parse_disabled(list: &str) -> Result<BTreeSet<String>> {
        let mut out = BTreeSet::new();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !KNOWN_NAMES.contains(&name) {
                return Err(Error::invalid(
                    "disable",
                    format!("unknown op or fusion `{name}`; known: {}", KNOWN_NAMES.join(", ")),
                ));
            }
            out.insert(name.to_string());
        }
        Ok(out)
    }

    /// Adds the names listed in `TBOOST_DISABLE` to `self.disabled`.
    pub fn with_env(mut self) -> Result<PlanOptions> {
        if let Ok(v) = std::env::var("TBOOST_DISABLE") {
            self.disabled
                .extend(Self::parse_disabled(&v).map_err(|e| Error::invalid("TBOOST_DISABLE", e.to_string()))?);
        }
        Ok(self)
    }

    fn allows(&self, name: &str) -> bool {
        !self.disabled.contains(name)
    }
}

/// One decision of the mapping table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Choice {
    /// The op slot ("attention", "qkv_projection", ...).
    pub slot: &'static str,
    /// The op or fusion that runs ("flash_attention", "fused", "separate", ...).
    pub op: String,
    /// Why, in words (the candidate's own capability text for fallbacks).
    pub reason: String,
    /// True when a preferred candidate was rejected or forbidden.
    pub fallback: bool,
}

/// The ops of one decoder layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerPlan {
    pub layer: usize,
    #[serde(skip)]
    pub attention: AttnKind,
    #[serde(skip)]
    pub fuse_qkv: bool,
    #[serde(skip)]
    pub fuse_gate_up: bool,
    #[serde(skip)]
    pub fuse_add_norm: bool,
    pub choices: Vec<Choice>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub backend: String,
    pub architecture: String,
    pub disabled: Vec<String>,
    pub layers: Vec<LayerPlan>,
}

fn matmul_check(be: &dyn Backend, t: &Tensor) -> Result<()> {
    let (rows, cols) = t.rows_cols();
    be.supports(&OpQuery::MatMul(MatMulCase::f32(t.dtype, rows, cols)))
        .map_err(|why| Error::Unsupported(format!("tensor `{}` ({} {:?}): {why}", t.name, t.dtype, t.shape)))
}

/// Builds the plan for a model on a backend.
pub fn build(cfg: &ModelConfig, w: &ModelWeights, be: &dyn Backend, opts: &PlanOptions) -> Result<Plan> {
    let check = |q: OpQuery, t: &Tensor| {
        be.supports(&q).map_err(|why| Error::Unsupported(format!("tensor `{}`: {why}", t.name)))
    };
    check(OpQuery::Embed(w.embed.dtype), &w.embed)?;
    check(OpQuery::RmsNorm(w.norm.dtype), &w.norm)?;
    be.supports(&OpQuery::Rope { head_dim: cfg.head_dim, rot_dim: cfg.rope_dim })
        .map_err(|why| Error::Unsupported(why.to_string()))?;
    matmul_check(be, &w.lm_head)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for (i, lw) in w.layers.iter().enumerate() {
        for t in [&lw.q, &lw.k, &lw.v, &lw.o] {
            matmul_check(be, t)?;
        }
        check(OpQuery::RmsNorm(lw.attn_norm.dtype), &lw.attn_norm)?;
        check(OpQuery::RmsNorm(lw.ffn_norm.dtype), &lw.ffn_norm)?;
        match &lw.mlp {
            Mlp::Dense { gate, up, down } => {
                for t in [gate, up, down] {
                    matmul_check(be, t)?;
                }
            }
            Mlp::Moe { router, experts } => {
                check(OpQuery::Moe { experts: experts.len(), top_k: cfg.experts_per_token }, router)?;
                matmul_check(be, router)?;
                for e in experts {
                    for t in [&e.gate, &e.up, &e.down] {
                        matmul_check(be, t)?;
                    }
                }
            }
        }
        layers.push(plan_layer(i, cfg, lw, be, opts)?);
    }
    let plan = Plan {
        backend: be.describe(),
        architecture: cfg.arch.to_string(),
        disabled: opts.disabled.iter().cloned().collect(),
        layers,
    };
    plan.log();
    Ok(plan)
}

fn plan_layer(
    i: usize,
    cfg: &ModelConfig,
    lw: &crate::model::LayerWeights,
    be: &dyn Backend,
    opts: &PlanOptions,
) -> Result<LayerPlan> {
    let mut choices = Vec::new();

    // Attention: FlashAttention first, standard attention as the fallback.
    let case = AttentionCase {
        phase: AttnPhase::Prefill,
        head_dim: cfg.head_dim,
        n_heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        act_dtype: DType::F32,
        kv_dtype: opts.kv_dtype,
        block_size: 16,
        max_context: cfg.max_position_embeddings,
    };
    let mut rejected: Vec<String> = Vec::new();
    let mut attention = None;
    let candidates = [
        (AttnKind::Flash, "flash_attention", "flash attention"),
        (AttnKind::Standard, "standard_attention", "standard attention"),
    ];
    for (kind, name, words) in candidates {
        if !opts.allows(name) {
            rejected.push(format!("{name} disabled by the user"));
            continue;
        }
        match be.supports(&OpQuery::Attention(kind, case)) {
            Ok(()) => {
                let reason = if rejected.is_empty() {
                    format!("head_dim={}", cfg.head_dim)
                } else {
                    format!("fallback to {words} ({})", rejected.join("; "))
                };
                choices.push(Choice { slot: "attention", op: name.into(), reason, fallback: !rejected.is_empty() });
                attention = Some(kind);
                break;
            }
            Err(why) => rejected.push(why.to_string()),
        }
    }
    let attention = attention.ok_or_else(|| {
        Error::Unsupported(format!("layer {i}: no attention operator is left: {}", rejected.join("; ")))
    })?;

    // Fusions: chosen when allowed and when their parts have the same input (always true
    // here: they are data-flow fusions that need no weight copy).
    let mut fusion = |slot: &'static str, name: &str, fused_op: &str, separate_op: &str, what: &str| -> bool {
        if opts.allows(name) {
            choices.push(Choice { slot, op: fused_op.into(), reason: what.into(), fallback: false });
            true
        } else {
            choices.push(Choice {
                slot,
                op: separate_op.into(),
                reason: format!("{name} disabled by the user"),
                fallback: true,
            });
            false
        }
    };
    let fuse_qkv = fusion(
        "qkv_projection",
        "fuse_qkv",
        "fused_qkv_matmul",
        "separate_q_k_v_matmuls",
        "one matmul call reads the normed input once for Q, K and V",
    );
    let fuse_add_norm = fusion(
        "residual_norm",
        "fuse_add_norm",
        "add_rmsnorm",
        "add_then_rmsnorm",
        "residual add fused into the following RMSNorm",
    );
    let fuse_gate_up = match &lw.mlp {
        Mlp::Dense { .. } => fusion(
            "mlp",
            "fuse_gate_up",
            "fused_gate_up_swiglu",
            "gate_up_matmuls_then_swiglu",
            "gate and up projections and SwiGLU in one kernel",
        ),
        Mlp::Moe { experts, .. } => {
            choices.push(Choice {
                slot: "mlp",
                op: "moe_grouped".into(),
                reason: format!("{} experts, top-{}, tokens grouped per expert", experts.len(), cfg.experts_per_token),
                fallback: false,
            });
            false
        }
    };
    // Which matmul kernel family the layer's projections run on, by weight type.
    let mut mats: Vec<&Tensor> = vec![&lw.q, &lw.k, &lw.v, &lw.o];
    match &lw.mlp {
        Mlp::Dense { gate, up, down } => mats.extend([gate, up, down]),
        Mlp::Moe { router, experts } => {
            mats.push(router);
            mats.extend(experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]));
        }
    }
    let mut dtypes: Vec<DType> = Vec::new();
    for t in mats {
        if !dtypes.contains(&t.dtype) {
            dtypes.push(t.dtype);
        }
    }
    let quant = dtypes.iter().any(|d| d.is_quantized());
    let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
    choices.push(Choice {
        slot: "matmul",
        op: if quant { "quant_block_matmul".into() } else { "dense_matmul".into() },
        reason: format!("{} weights, f32 activations", names.join("/")),
        fallback: false,
    });
    Ok(LayerPlan { layer: i, attention, fuse_qkv, fuse_gate_up, fuse_add_norm, choices })
}

impl Plan {
    /// One log line per distinct decision, with the layers it applies to.
    pub fn log(&self) {
        for line in self.summary_lines() {
            if line.contains("fallback") || line.contains("disabled") {
                log::warn!("{line}");
            } else {
                log::info!("{line}");
            }
        }
    }

    /// `layers 0-21: attention: flash_attention (head_dim=64)` style lines.
    pub fn summary_lines(&self) -> Vec<String> {
        let mut groups: Vec<(&Choice, Vec<usize>)> = Vec::new();
        for l in &self.layers {
            for c in &l.choices {
                match groups.iter_mut().find(|(g, _)| *g == c) {
                    Some((_, ls)) => ls.push(l.layer),
                    None => groups.push((c, vec![l.layer])),
                }
            }
        }
        groups
            .into_iter()
            .map(|(c, ls)| {
                let layers = ranges(&ls);
                if c.reason.starts_with("fallback") {
                    format!("layers {layers}: {}: {}", c.slot, c.reason)
                } else {
                    format!("layers {layers}: {}: {} ({})", c.slot, c.op, c.reason)
                }
            })
            .collect()
    }

    /// Human-readable table for `tboost plan`.
    pub fn to_text(&self) -> String {
        let mut s = format!("backend: {}\narchitecture: {}\n", self.backend, self.architecture);
        if !self.disabled.is_empty() {
            let _ = writeln!(s, "disabled: {}", self.disabled.join(", "));
        }
        for l in &self.layers {
            let _ = writeln!(s, "layer {}:", l.layer);
            for c in &l.choices {
                let _ = writeln!(s, "  {:<16} {:<30} {}", c.slot, c.op, c.reason);
            }
        }
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// `[0,1,2,5]` → `"0-2,5"`.
fn ranges(v: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    out.join(",")
}
