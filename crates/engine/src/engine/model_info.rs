//! The description of a model a host asks for before it creates an engine: its shape and
//! the operator plan an engine with a given config would run.

use serde_json::json;

use super::EngineConfig;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::model::{Model, ModelFormat};
use crate::plan;
use crate::Result;

/// The model's description as a JSON object: path, format, architecture, weights_dtype,
/// vocab_size, context_length, hidden_size, intermediate_size, num_layers, num_heads,
/// num_kv_heads, head_dim, num_experts, experts_per_token, bos_token_id, eos_token_ids, and
/// `plan`: the operator plan on `config`'s backend with its options. Building the plan
/// opens that backend (on a device backend, the device), so call this when the description
/// is asked for, not when the model loads.
pub fn model_info(model: &Model, config: &EngineConfig) -> Result<serde_json::Value> {
    let backend = config.open_backend()?;
    let opts = config.plan_options(backend.as_ref())?;
    // A device backend's plan may put ops on the CPU beside it.
    let cpu = if backend.name() == "cpu" {
        None
    } else {
        Some(CpuBackend::with_options(config.threads, &config.backend_options())?)
    };
    let plan =
        plan::build(&model.config, &model.weights, backend.as_ref(), cpu.as_ref().map(|c| c as &dyn Backend), &opts)?;
    let c = &model.config;
    Ok(json!({
        "path": model.path.display().to_string(),
        "format": match model.format {
            ModelFormat::HuggingFace => "huggingface",
            ModelFormat::Gguf => "gguf",
            ModelFormat::Synthetic => "synthetic",
        },
        "architecture": c.arch.name(),
        "weights_dtype": model.weights.embed.dtype.to_string(),
        "vocab_size": c.vocab_size,
        "context_length": c.max_position_embeddings,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_layers": c.num_layers,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_experts": c.num_experts,
        "experts_per_token": c.experts_per_token,
        "bos_token_id": c.bos_token_id,
        "eos_token_ids": c.eos_token_ids,
        "plan": plan.to_json(),
    }))
}
