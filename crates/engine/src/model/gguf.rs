//! A GGUF file as a model: the config from llama.cpp's metadata keys and every tensor a view
//! into the memory map (the container itself is read by `formats::gguf`).

use std::path::Path;

use tboost_ops::{Llama3Scaling, RopeStyle};

use super::weights::{check_shapes_in, ExpertWeights, LayerWeights, Mlp, ModelWeights, TensorSet};
use super::{map_weights, Arch, Model, ModelConfig, ModelFormat, Tensor};
use crate::formats::gguf::{dtype_from_ggml, ggml_type_name, parse, GgufFile, Metadata, Value};
use crate::{Error, Result};

/// Loads a GGUF model file: config from the llama.cpp metadata keys, every tensor a view
/// into the memory map (MoE expert stacks split into per-expert views), shapes checked.
pub fn load(path: &Path) -> Result<Model> {
    let map = map_weights(path)?;
    let file = parse(map.bytes(), path)?;
    let config = config_from_gguf(&file, path)?;

    let mut set = TensorSet::new(path);
    for info in &file.tensors {
        let dtype = dtype_from_ggml(info.ggml_type).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: tensor `{}` has GGUF type {} ({}), which tboost does not support",
                path.display(),
                info.name,
                ggml_type_name(info.ggml_type),
                info.ggml_type
            ))
        })?;
        // `parse` checked data_offset + offset + size <= file length, so these fit in usize.
        let offset = (file.data_offset + info.offset) as usize;
        let size = info.size.unwrap_or(0) as usize;
        let t = Tensor::new(&info.name, dtype, info.shape(), map.clone(), offset, size)
            .map_err(|m| Error::bad_tensor(path, &info.name, m))?;
        set.insert(t, path)?;
    }
    let weights = assemble(&config, &mut set, path)?;
    check_shapes_in(&config, &weights, &set, path)?;
    Ok(Model {
        path: path.to_path_buf(),
        format: ModelFormat::Gguf,
        config,
        weights,
        gguf_metadata: Some(file.metadata),
        tokenizer: None,
        chat_template: None,
    })
}

/// Typed access to `{arch}.*` and other metadata keys, with errors naming the key.
struct Keys<'a> {
    md: &'a Metadata,
    src: String,
}

impl Keys<'_> {
    fn u64(&self, key: &str) -> Result<Option<u64>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(Value::Array(_)) => Err(Error::Unsupported(format!(
                "{}: metadata `{key}` is a per-layer array; tboost needs one value for all layers",
                self.src
            ))),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                Error::config(&self.src, key, format!("must be a non-negative integer, got {} {v}", v.type_name()))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.u64(key)? {
            None => Ok(None),
            Some(v) => {
                usize::try_from(v).map(Some).map_err(|_| Error::config(&self.src, key, format!("{v} is too large")))
            }
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| Error::config(&self.src, key, "is missing"))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::config(&self.src, key, format!("must be a number, got {} {v}", v.type_name()))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| Error::config(&self.src, key, format!("must be a string, got {}", v.type_name()))),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.u64(key)? {
            None => Ok(None),
            Some(v) => {
                u32::try_from(v).map(Some).map_err(|_| Error::config(&self.src, key, format!("{v} is too large")))
            }
        }
    }
}

/// Resolves the config from llama.cpp's metadata keys.
pub fn config_from_gguf(file: &GgufFile, path: &Path) -> Result<ModelConfig> {
    let k = Keys { md: &file.metadata, src: path.display().to_string() };
    let src = k.src.clone();
    let arch_name =
        k.str("general.architecture")?.ok_or_else(|| Error::config(&src, "general.architecture", "is missing"))?;
    let parsed = Arch::parse(arch_name).ok_or_else(|| {
        Error::Unsupported(format!(
            "{src}: general.architecture `{arch_name}`; tboost runs llama, mistral, qwen2 and mixtral"
        ))
    })?;
    let key = |s: &str| format!("{arch_name}.{s}");

    let hidden_size = k.req_usize(&key("embedding_length"))?;
    let num_heads = k.req_usize(&key("attention.head_count"))?;
    let num_kv_heads = k.usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
    let head_dim = match k.usize(&key("attention.key_length"))? {
        Some(d) => d,
        None if num_heads == 0 => 0,
        None if hidden_size % num_heads != 0 => {
            return Err(Error::config(
                &src,
                key("attention.key_length"),
                format!("is not set and embedding_length {hidden_size} is not divisible by head_count {num_heads}"),
            ))
        }
        None => hidden_size / num_heads,
    };
    if let Some(v) = k.usize(&key("attention.value_length"))? {
        if v != head_dim {
            return Err(Error::Unsupported(format!(
                "{src}: {} {v} differs from the key length {head_dim}",
                key("attention.value_length")
            )));
        }
    }
    let num_experts = k.usize(&key("expert_count"))?.unwrap_or(0);
    let experts_per_token = k.usize(&key("expert_used_count"))?.unwrap_or(0);
    // llama.cpp converts Mixtral to architecture `llama` with an expert count.
    let arch = if parsed == Arch::Llama && num_experts > 0 { Arch::Mixtral } else { parsed };

    if file.tensor("rope_freqs.weight").is_some() {
        return Err(Error::Unsupported(format!(
            "{src}: tensor `rope_freqs.weight` (llama3 RoPE frequency factors as a tensor) is not supported yet"
        )));
    }
    let rope_scaling = match k.str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") if k.f64(&key("rope.scaling.factor"))?.is_none_or(|f| f == 1.0) => None,
        Some("llama3") => {
            let get = |s: &str| -> Result<f64> {
                k.f64(&key(s))?.ok_or_else(|| Error::config(&src, key(s), "is missing for llama3 scaling"))
            };
            Some(Llama3Scaling {
                factor: get("rope.scaling.factor")?,
                // Llama 3.1's values; llama.cpp defines no keys for them.
                low_freq_factor: k.f64(&key("rope.scaling.low_freq_factor"))?.unwrap_or(1.0),
                high_freq_factor: k.f64(&key("rope.scaling.high_freq_factor"))?.unwrap_or(4.0),
                original_max_position_embeddings: get("rope.scaling.original_context_length")?,
            })
        }
        Some(t) => {
            return Err(Error::Unsupported(format!(
                "{src}: {} `{t}`; tboost implements default and llama3 RoPE",
                key("rope.scaling.type")
            )))
        }
    };

    let vocab_size = match file.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a.len(),
        Some(v) => {
            return Err(Error::config(
                &src,
                "tokenizer.ggml.tokens",
                format!("must be an array, got {}", v.type_name()),
            ))
        }
        // Files without a vocabulary may state the size, else the embedding has one row per id.
        None => match (k.usize(&key("vocab_size"))?, file.tensor("token_embd.weight")) {
            (Some(n), _) => n,
            (None, Some(t)) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => {
                return Err(Error::config(
                    &src,
                    "tokenizer.ggml.tokens",
                    "is missing and so is a 2-D token_embd.weight",
                ))
            }
        },
    };
    let eos = k.token_id("tokenizer.ggml.eos_token_id")?;
    let eot = k.token_id("tokenizer.ggml.eot_token_id")?;
    // Checked here, not only in `validate`, so that the error names the key that holds it.
    for (name, id) in [("tokenizer.ggml.eos_token_id", eos), ("tokenizer.ggml.eot_token_id", eot)] {
        if let Some(id) = id.filter(|&id| id as usize >= vocab_size) {
            return Err(Error::config(&src, name, format!("{id} is not below the vocabulary size {vocab_size}")));
        }
    }
    let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
    if let Some(t) = eot.filter(|t| Some(*t) != eos) {
        eos_token_ids.push(t);
    }

    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: k.req_usize(&key("feed_forward_length"))?,
        num_layers: k.req_usize(&key("block_count"))?,
        num_heads,
        num_kv_heads,
        head_dim,
        rope_dim: k.usize(&key("rope.dimension_count"))?.unwrap_or(head_dim),
        rope_theta: k.f64(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling,
        // llama.cpp's converter permutes llama-family q/k rows for GGML's adjacent-pair RoPE;
        // qwen2 keeps the HF order and runs NeoX (half-split) RoPE.
        rope_style: if arch == Arch::Qwen2 { RopeStyle::HalfSplit } else { RopeStyle::Adjacent },
        rms_eps: k
            .f64(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| Error::config(&src, key("attention.layer_norm_rms_epsilon"), "is missing"))?,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        qkv_bias: arch == Arch::Qwen2 || file.tensor("blk.0.attn_q.bias").is_some(),
        num_experts,
        experts_per_token,
        max_position_embeddings: k.req_usize(&key("context_length"))?,
        bos_token_id: k.token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
    };
    cfg.validate(&src).map_err(|e| match e {
        Error::Config { source_name, param, msg } => {
            // Name the key the user can find in the file.
            let gguf_key = match param.as_str() {
                "vocab_size" => "tokenizer.ggml.tokens".to_string(),
                "hidden_size" => key("embedding_length"),
                "intermediate_size" => key("feed_forward_length"),
                "num_hidden_layers" => key("block_count"),
                "num_attention_heads" => key("attention.head_count"),
                "num_key_value_heads" => key("attention.head_count_kv"),
                "head_dim" => key("attention.key_length"),
                "rope_dim" => key("rope.dimension_count"),
                "rope_theta" => key("rope.freq_base"),
                "rms_norm_eps" => key("attention.layer_norm_rms_epsilon"),
                "rope_scaling" => key("rope.scaling.*"),
                "num_experts_per_tok" => key("expert_used_count"),
                "max_position_embeddings" => key("context_length"),
                "num_local_experts" => key("expert_count"),
                "bos_token_id" => "tokenizer.ggml.bos_token_id".to_string(),
                "eos_token_id" => "tokenizer.ggml.eos_token_id".to_string(),
                _ => param.clone(),
            };
            Error::Config { source_name, param: gguf_key, msg: format!("{msg} (as {param})") }
        }
        e => e,
    })?;
    Ok(cfg)
}

/// Builds the per-layer weights from llama.cpp tensor names.
fn assemble(cfg: &ModelConfig, set: &mut TensorSet, path: &Path) -> Result<ModelWeights> {
    let embed = set.take("token_embd.weight")?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let mut bias = |s: &str| -> Result<Option<Tensor>> {
            if cfg.qkv_bias {
                set.take(&n(s)).map(Some)
            } else {
                Ok(None)
            }
        };
        let (q_bias, k_bias, v_bias) = (bias("attn_q.bias")?, bias("attn_k.bias")?, bias("attn_v.bias")?);
        let mlp = if cfg.arch.is_moe() {
            let router = set.take(&n("ffn_gate_inp.weight"))?;
            let gate = set.take(&n("ffn_gate_exps.weight"))?;
            let up = set.take(&n("ffn_up_exps.weight"))?;
            let down = set.take(&n("ffn_down_exps.weight"))?;
            let split = |t: &Tensor, e: usize| -> Result<Tensor> {
                if t.shape.len() != 3 || t.shape[0] != cfg.num_experts {
                    return Err(Error::bad_tensor(
                        path,
                        &t.name,
                        format!(
                            "expected a 3-D stack of {} experts (expert_count), got shape {:?}",
                            cfg.num_experts, t.shape
                        ),
                    ));
                }
                t.slice_outer(e, format!("{}[expert {e}]", t.name)).map_err(|m| Error::bad_tensor(path, &t.name, m))
            };
            let experts = (0..cfg.num_experts)
                .map(|e| Ok(ExpertWeights { gate: split(&gate, e)?, up: split(&up, e)?, down: split(&down, e)? }))
                .collect::<Result<_>>()?;
            Mlp::Moe { router, experts }
        } else {
            Mlp::Dense {
                gate: set.take(&n("ffn_gate.weight"))?,
                up: set.take(&n("ffn_up.weight"))?,
                down: set.take(&n("ffn_down.weight"))?,
            }
        };
        layers.push(LayerWeights {
            attn_norm: set.take(&n("attn_norm.weight"))?,
            q: set.take(&n("attn_q.weight"))?,
            k: set.take(&n("attn_k.weight"))?,
            v: set.take(&n("attn_v.weight"))?,
            o: set.take(&n("attn_output.weight"))?,
            q_bias,
            k_bias,
            v_bias,
            ffn_norm: set.take(&n("ffn_norm.weight"))?,
            mlp,
        });
    }
    let norm = set.take("output_norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { set.take("output.weight")? };
    set.finish()?;
    Ok(ModelWeights { embed, layers, norm, lm_head })
}
