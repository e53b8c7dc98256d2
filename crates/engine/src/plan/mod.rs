//! The operator mapping table: at load time every slot of every layer (and of the model
//! around the layers) gets its operator by asking each candidate, in order of preference,
//! whether the backend supports the full case; the first that does wins. Every decision
//! records the candidates tried, which were rejected and the structured reason
//! (`Unsupported`: parameter, value, what the op needs) — ATB's three questions: was the
//! fused op chosen, on what, and were the ops around it fused.
//!
//! When the backend takes no candidate of a slot, the slot runs on the CPU backend beside
//! it (its inputs and outputs copied each step; the plan records the bytes per token) — the
//! load fails only when no backend can run it, with an error naming layer, slot and case.
//! Weights a backend cannot take natively may be converted at upload (e.g. a GGUF block type
//! to f16) when it takes the converted case.
//!
//! Users can forbid ops and fusions by name (`PlanOptions::disabled`, `TBOOST_DISABLE`); see
//! [`KNOWN_NAMES`].

pub mod query;
mod report;
pub mod shard;
mod table;

use std::collections::BTreeSet;

use serde::Serialize;
use tboost_ops::{DType, MatMulTiling, MoeTiling, Precision, Unsupported};

use crate::backend::{Backend, DeviceInfo, OpQuery};
use crate::model::{ModelConfig, ModelWeights};
use crate::{Error, Result};

pub use shard::{ShardSpec, TpReport};
pub use table::{embed_scale, global_rope, local_rope, Choice, Slot};

/// Every name `PlanOptions::disabled` accepts: ops, then fusions.
pub const KNOWN_NAMES: &[&str] = &[
    "flash_attention",
    "paged_decode_attention",
    "standard_attention",
    "moe_grouped",
    "convert_weights",
    "pack_weights",
    "fuse_qkv",
    "fuse_gate_up",
    "fuse_add_norm",
];

/// The matmul precision a user asks for. `Auto`, the default: `Fast` for matmuls whose weights
/// are all GGUF block types (8-bit activations and integer dot products, which is how
/// llama.cpp computes them: on the demo model its greedy ids are kept on every step,
/// `tests/qwen_demo.rs`), `Exact` for float weights (f32 activations; the golden tolerances of
/// the f32/f16/bf16 checkpoints are for that). Backends are only ever asked `Exact` or `Fast`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrecisionPolicy {
    #[default]
    Auto,
    Exact,
    Fast,
}

impl PrecisionPolicy {
    pub const NAMES: &'static str = "auto, exact, fast";

    pub fn name(self) -> &'static str {
        match self {
            PrecisionPolicy::Auto => "auto",
            PrecisionPolicy::Exact => "exact",
            PrecisionPolicy::Fast => "fast",
        }
    }

    pub fn parse(s: &str) -> Option<PrecisionPolicy> {
        match s.trim() {
            "auto" => Some(PrecisionPolicy::Auto),
            "exact" => Some(PrecisionPolicy::Exact),
            "fast" => Some(PrecisionPolicy::Fast),
            _ => None,
        }
    }

    /// The precision to ask a backend for first, for a matmul reading weights of `dtypes`.
    pub fn for_weights(self, dtypes: &[DType]) -> Precision {
        match self {
            PrecisionPolicy::Exact => Precision::Exact,
            PrecisionPolicy::Fast => Precision::Fast,
            PrecisionPolicy::Auto if !dtypes.is_empty() && dtypes.iter().all(|d| d.is_quantized()) => Precision::Fast,
            PrecisionPolicy::Auto => Precision::Exact,
        }
    }
}

/// What the user asks for, and the engine settings the choice depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    pub disabled: BTreeSet<String>,
    /// Element type of the KV cache; `None` = the attention backend's first choice.
    pub kv_dtype: Option<DType>,
    /// Element type of activations; `None` = the backend's first choice.
    pub act_dtype: Option<DType>,
    /// Activation precision for matmuls (per weight type where the backend takes it).
    pub precision: PrecisionPolicy,
    /// Tokens per KV block.
    pub block_size: usize,
    /// FlashAttention's KV tile for the flash and paged-decode slots (engine key
    /// `tiling.attention.tile_kv`); `None` = the default, 64.
    pub tile_kv: Option<usize>,
    /// The CPU matmul kernels' work split in every matmul slot (engine keys
    /// `tiling.matmul.*`); unset tunables are the op's defaults.
    pub matmul_tiling: MatMulTiling,
    /// The CPU grouped MoE's expert batching (engine keys `tiling.moe.*`).
    pub moe_tiling: MoeTiling,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            disabled: BTreeSet::new(),
            kv_dtype: None,
            act_dtype: None,
            precision: PrecisionPolicy::Auto,
            block_size: 16,
            tile_kv: None,
            matmul_tiling: MatMulTiling::default(),
            moe_tiling: MoeTiling::default(),
        }
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

    fn allows(&self, name: &str) -> bool {
        !self.disabled.contains(name)
    }
}

/// Where a slot's ops run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The engine's backend.
    Primary,
    /// The CPU backend beside a device backend that took no candidate.
    Cpu,
}

/// How one candidate's weights reach its backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "mode", content = "to", rename_all = "snake_case")]
pub enum WeightMode {
    /// As stored in the file.
    Native,
    /// Converted to this dtype once at upload (dequantized for block types).
    Convert(DType),
    /// As stored, but repacked once at upload into the backend's own layout where it has one
    /// for the tensor's dtype (`Backend::packs`; on the CPU, 16-row panels for the `Fast`
    /// integer kernels).
    Packed,
}

/// What became of one candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    Chosen,
    /// The backend answered no for this part of the case.
    Rejected {
        query: OpQuery,
        why: Unsupported,
    },
    /// Forbidden by the user (`disable` names it).
    Disabled {
        name: &'static str,
    },
    /// Not offered here at all (no such op on this device or communicator), so not asked.
    Unavailable {
        why: Unsupported,
    },
}

/// One candidate asked on one backend.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Tried {
    pub candidate: Choice,
    pub backend: String,
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// One decision of the mapping table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub slot: Slot,
    pub choice: Choice,
    /// The backend it runs on (its name), and whether that is the primary or the CPU beside it.
    pub backend: String,
    /// The backend's own name for what runs the chosen candidate's main op (the aclnn op on
    /// Ascend), when it has one.
    pub kernel: Option<String>,
    pub placement: Placement,
    pub weights: WeightMode,
    pub precision: Precision,
    /// True when a preferred candidate was rejected or forbidden, or the slot left the
    /// primary backend.
    pub fallback: bool,
    /// Bytes copied between the backends per token when `placement` is `Cpu`.
    pub copy_bytes_per_token: usize,
    /// One line for people: the case ("head_dim=64") or the fallback and its cause.
    pub reason: String,
    /// Every candidate asked, in order, with its verdict.
    pub tried: Vec<Tried>,
}

/// The decisions of one decoder layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerPlan {
    pub layer: usize,
    pub decisions: Vec<Decision>,
}

impl LayerPlan {
    /// The decision for `slot`, if the layer has that slot.
    pub fn get(&self, slot: Slot) -> Option<&Decision> {
        self.decisions.iter().find(|d| d.slot == slot)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub device: DeviceInfo,
    pub architecture: String,
    pub disabled: Vec<String>,
    pub act_dtype: DType,
    pub kv_dtype: DType,
    /// Why `kv_dtype` is not the type the config asked for (a logged fallback), if it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_dtype_reason: Option<String>,
    pub block_size: usize,
    /// The precision asked for (each matmul decision says what it got).
    pub precision: PrecisionPolicy,
    /// FlashAttention's KV tile in the flash and paged-decode attention slots.
    pub attention_tile_kv: usize,
    /// The work split of the CPU matmul kernels in every matmul slot (`null` fields: the op's
    /// default).
    pub matmul_tiling: MatMulTiling,
    /// The expert batching of the CPU grouped MoE (`null` fields: the op's default).
    pub moe_tiling: MoeTiling,
    /// Slots outside the layers: embedding, RoPE tables, final norm, LM head.
    pub model: Vec<Decision>,
    pub layers: Vec<LayerPlan>,
    /// Bytes copied between backends per token, over every decision placed on the CPU.
    pub copy_bytes_per_token: usize,
    /// This rank's part of a tensor-parallel model (`None`: one rank holds it all). The
    /// collectives are decisions in `model` (`all_reduce`, `all_gather`).
    pub tp: Option<TpReport>,
}

impl Plan {
    /// The model-level decision for `slot`.
    pub fn model_slot(&self, slot: Slot) -> Option<&Decision> {
        self.model.iter().find(|d| d.slot == slot)
    }

    /// Every decision, model-level first.
    pub fn decisions(&self) -> impl Iterator<Item = &Decision> {
        self.model.iter().chain(self.layers.iter().flat_map(|l| l.decisions.iter()))
    }

    /// Whether any slot runs on the CPU beside the primary backend.
    pub fn uses_cpu_fallback(&self) -> bool {
        self.decisions().any(|d| d.placement == Placement::Cpu)
    }
}

/// Builds the plan for a model on `primary`, with `cpu` (when given) as the backend of last
/// resort for slots `primary` cannot run. Logs one line per distinct decision.
pub fn build(
    cfg: &ModelConfig,
    w: &ModelWeights,
    primary: &dyn Backend,
    cpu: Option<&dyn Backend>,
    opts: &PlanOptions,
) -> Result<Plan> {
    let plan = table::Planner::new(cfg, w, primary, cpu, opts)?.build()?;
    plan.log();
    Ok(plan)
}
