//! A GGUF file as a model: the config from llama.cpp's metadata keys and every tensor a view
//! into the memory map (the container itself is read by `formats::gguf`).

use std::path::Path;

use tboost_ops::{Llama3Scaling, RopeScaling, RopeStyle, YarnScaling};

use super::arch::SUPPORTED;
use super::weights::{
    check_shapes_in, ExpertWeights, LayerExtras, LayerWeights, Mlp, ModelWeights, RopeFactors, TensorSet,
};
use super::{Arch, Model, ModelConfig, ModelFormat, Storage, Tensor};
use crate::formats::files;
use crate::formats::gguf::{dtype_from_ggml, ggml_type_name, parse_mapped, GgufFile, Metadata, Value};
use crate::{Error, Result};

/// Loads a GGUF model file: config from the llama.cpp metadata keys, every tensor a view
/// into the memory map (MoE expert stacks split into per-expert views), shapes checked.
/// The header, metadata and tensor directory are read with `pread` and parsed from memory
/// ([`parse_mapped`]); nothing reads the map, so a file truncated during the load is an
/// error naming it, never a SIGBUS.
pub fn load(path: &Path) -> Result<Model> {
    let mapped = files::map_file(path)?;
    let file = parse_mapped(&mapped, path)?;
    // A file cut inside its tensor data (past what the parse read) fails here, not later.
    mapped.check_loaded()?;
    let map = Storage::Mmap(mapped);
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
        Error::Unsupported(format!("{src}: general.architecture `{arch_name}`; tboost runs {SUPPORTED}"))
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
    let block_count = k.req_usize(&key("block_count"))?;
    let experts_per_token = k.usize(&key("expert_used_count"))?.unwrap_or(0);
    // llama.cpp converts Mixtral to architecture `llama` with an expert count.
    let arch = if parsed == Arch::Llama && num_experts > 0 { Arch::Mixtral } else { parsed };

    if file.tensor("rope_freqs.weight").is_some() {
        return Err(Error::Unsupported(format!(
            "{src}: tensor `rope_freqs.weight` (llama3 RoPE frequency factors as a tensor) is not supported yet"
        )));
    }
    let context_length = k.req_usize(&key("context_length"))?;
    let get = |s: &str, kind: &str| -> Result<f64> {
        k.f64(&key(s))?.ok_or_else(|| Error::config(&src, key(s), format!("is missing for {kind} scaling")))
    };
    let mut rope_scaling = match k.str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => match k.f64(&key("rope.scaling.factor"))? {
            None => None,
            Some(1.0) => None,
            Some(factor) => Some(RopeScaling::Linear { factor }),
        },
        Some("llama3") => Some(RopeScaling::Llama3(Llama3Scaling {
            factor: get("rope.scaling.factor", "llama3")?,
            // Llama 3.1's values; llama.cpp defines no keys for them.
            low_freq_factor: k.f64(&key("rope.scaling.low_freq_factor"))?.unwrap_or(1.0),
            high_freq_factor: k.f64(&key("rope.scaling.high_freq_factor"))?.unwrap_or(4.0),
            original_max_position_embeddings: get("rope.scaling.original_context_length", "llama3")?,
        })),
        Some("yarn") => {
            let factor = get("rope.scaling.factor", "yarn")?;
            // llama.cpp: cos/sin times attn_factor * (1 + 0.1 ln factor).
            let attn = k.f64(&key("rope.scaling.attn_factor"))?.unwrap_or(1.0);
            Some(RopeScaling::Yarn(YarnScaling {
                factor,
                original_max_position_embeddings: get("rope.scaling.original_context_length", "yarn")?,
                beta_fast: k.f64(&key("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                beta_slow: k.f64(&key("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                attention_factor: attn * tboost_ops::rope::yarn_mscale(factor, 1.0),
                truncate: true,
            }))
        }
        Some(t) => {
            return Err(Error::Unsupported(format!(
                "{src}: {} `{t}`; tboost implements default, linear, llama3 and yarn RoPE (and Phi-3's LongRoPE)",
                key("rope.scaling.type")
            )))
        }
    };
    // Phi-3: LongRoPE when the file carries the factor tensors.
    if arch == Arch::Phi3 && file.tensor("rope_factors_long.weight").is_some() {
        let orig = match k.f64(&key("rope.scaling.original_context_length"))? {
            Some(o) => o,
            None => context_length as f64,
        };
        let factor = context_length as f64 / orig;
        let attention_factor = match k.f64(&key("rope.scaling.attn_factor"))? {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / orig.ln()).sqrt(),
        };
        rope_scaling = Some(RopeScaling::LongRope { original_max_position_embeddings: orig, attention_factor });
    }

    let mut features = arch.features();
    // llama.cpp's converter adds Gemma's 1 to the norm gains in the file.
    features.norm_plus_one = false;
    if let Some(v) = k.f64(&key("final_logit_softcapping"))?.filter(|&v| v != 0.0) {
        return Err(Error::Unsupported(format!(
            "{src}: {} {v} (logit soft-capping is not implemented)",
            key("final_logit_softcapping")
        )));
    }
    if let Some(s) = k.f64(&key("attention.scale"))? {
        features.attn_scale = Some(s);
    } else if arch == Arch::Gemma3 && block_count == 62 {
        // llama.cpp: Gemma 3 27B scales by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim).
        features.attn_scale = Some(1.0 / ((hidden_size / num_heads.max(1)) as f64).sqrt());
    }
    if let Some(w) = k.usize(&key("attention.sliding_window"))?.filter(|&w| w > 0 && arch != Arch::Phi3) {
        // llama.cpp: an array of per-layer flags, or a period whose last layer is global
        // (Gemma 3's default 6); without either every layer slides (Mistral).
        let pattern_key = key("attention.sliding_window_pattern");
        // Capped so an absurd block count reaches `validate`'s limit error instead of an
        // allocation of that size.
        let n = block_count.min(crate::formats::limits::MAX_LAYERS + 1);
        let layers: Vec<bool> = match file.metadata.get(&pattern_key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    other => Err(Error::config(&src, &pattern_key, format!("has {other}, expected booleans"))),
                })
                .collect::<Result<_>>()?,
            Some(_) => {
                let p = k.usize(&pattern_key)?.unwrap_or(0);
                (0..n).map(|i| p == 0 || i % p < p - 1).collect()
            }
            None if arch == Arch::Gemma3 => (0..n).map(|i| i % 6 < 5).collect(),
            None => vec![true; n],
        };
        if w < context_length && layers.iter().any(|&s| s) {
            features.sliding_window = w;
            features.sliding_layers = layers;
        }
    }
    if arch == Arch::Gemma3 {
        features.rope_local_theta = Some(k.f64(&key("rope.freq_base_swa"))?.unwrap_or(10000.0));
    }

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

    let intermediate_size = match arch {
        Arch::Qwen3Moe => k.req_usize(&key("expert_feed_forward_length"))?,
        _ => k.req_usize(&key("feed_forward_length"))?,
    };
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers: block_count,
        num_heads,
        num_kv_heads,
        head_dim,
        rope_dim: k.usize(&key("rope.dimension_count"))?.unwrap_or(head_dim),
        rope_theta: k.f64(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling,
        // llama.cpp's converter permutes llama-family q/k rows for GGML's adjacent-pair RoPE;
        // the others keep the HF order and run NeoX (half-split) RoPE.
        rope_style: match arch {
            Arch::Llama | Arch::Mistral | Arch::Mixtral => RopeStyle::Adjacent,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Phi3 => RopeStyle::HalfSplit,
        },
        rms_eps: k
            .f64(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| Error::config(&src, key("attention.layer_norm_rms_epsilon"), "is missing"))?,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        qkv_bias: arch == Arch::Qwen2 || file.tensor("blk.0.attn_q.bias").is_some(),
        num_experts,
        experts_per_token,
        max_position_embeddings: context_length,
        bos_token_id: k.token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
        features,
    };
    cfg.validate(&src).map_err(|e| match e {
        Error::Config { source_name, param, msg } => {
            // Name the key the user can find in the file.
            let gguf_key = match param.as_str() {
                "vocab_size" => "tokenizer.ggml.tokens".to_string(),
                "hidden_size" => key("embedding_length"),
                "intermediate_size" if arch == Arch::Qwen3Moe => key("expert_feed_forward_length"),
                "intermediate_size" => key("feed_forward_length"),
                "num_hidden_layers" => key("block_count"),
                "num_attention_heads" => key("attention.head_count"),
                "num_key_value_heads" => key("attention.head_count_kv"),
                "head_dim" => key("attention.key_length"),
                "rope_dim" => key("rope.dimension_count"),
                "rope_theta" => key("rope.freq_base"),
                "rms_norm_eps" => key("attention.layer_norm_rms_epsilon"),
                "rope_scaling" => key("rope.scaling.*"),
                "sliding_window" | "layer_types" => key("attention.sliding_window"),
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
    let f = &cfg.features;
    let (qd, kvd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let split_rows = |t: &Tensor, parts: &[(&str, usize)]| -> Result<Vec<Tensor>> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        if t.shape.len() != 2 || t.shape[0] != total {
            let what: Vec<String> = parts.iter().map(|(n, r)| format!("{n} {r}")).collect();
            return Err(Error::bad_tensor(
                path,
                &t.name,
                format!("expected {total} rows ({}), got shape {:?}", what.join(" + "), t.shape),
            ));
        }
        let mut start = 0;
        parts
            .iter()
            .map(|&(n, rows)| {
                let v = t
                    .slice_rows(start, rows, format!("{}[{n}]", t.name))
                    .map_err(|m| Error::bad_tensor(path, &t.name, m));
                start += rows;
                v
            })
            .collect()
    };
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
        } else if cfg.arch == Arch::Phi3 && !set.contains(&n("ffn_gate.weight")) {
            // Phi-3: ffn_up holds gate then up ([hidden, 2 * ff] in GGML order).
            let inter = cfg.intermediate_size;
            let gu = split_rows(&set.take(&n("ffn_up.weight"))?, &[("gate", inter), ("up", inter)])?;
            let [gate, up]: [Tensor; 2] = gu.try_into().map_err(|_| Error::invalid("phi3", "two parts"))?;
            Mlp::Dense { gate, up, down: set.take(&n("ffn_down.weight"))? }
        } else {
            Mlp::Dense {
                gate: set.take(&n("ffn_gate.weight"))?,
                up: set.take(&n("ffn_up.weight"))?,
                down: set.take(&n("ffn_down.weight"))?,
            }
        };
        let (q, k, v) = if set.contains(&n("attn_qkv.weight")) {
            let parts = split_rows(&set.take(&n("attn_qkv.weight"))?, &[("q", qd), ("k", kvd), ("v", kvd)])?;
            let [q, k, v]: [Tensor; 3] = parts.try_into().map_err(|_| Error::invalid("qkv", "three parts"))?;
            (q, k, v)
        } else {
            (set.take(&n("attn_q.weight"))?, set.take(&n("attn_k.weight"))?, set.take(&n("attn_v.weight"))?)
        };
        let mut extra = LayerExtras::default();
        if f.qk_norm {
            extra.q_norm = Some(set.take(&n("attn_q_norm.weight"))?);
            extra.k_norm = Some(set.take(&n("attn_k_norm.weight"))?);
        }
        if f.post_norms {
            extra.post_attn_norm = Some(set.take(&n("post_attention_norm.weight"))?);
            extra.post_ffn_norm = Some(set.take(&n("post_ffw_norm.weight"))?);
        }
        layers.push(LayerWeights {
            attn_norm: set.take(&n("attn_norm.weight"))?,
            q,
            k,
            v,
            o: set.take(&n("attn_output.weight"))?,
            q_bias,
            k_bias,
            v_bias,
            ffn_norm: set.take(&n("ffn_norm.weight"))?,
            mlp,
            extra,
        });
    }
    let norm = set.take("output_norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { set.take("output.weight")? };
    let rope_factors = match cfg.rope_scaling {
        Some(RopeScaling::LongRope { .. }) => Some(RopeFactors {
            short: set.take("rope_factors_short.weight")?,
            long: set.take("rope_factors_long.weight")?,
        }),
        _ => None,
    };
    set.finish()?;
    Ok(ModelWeights { embed, layers, norm, lm_head, rope_factors })
}
