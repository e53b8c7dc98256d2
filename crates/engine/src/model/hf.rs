//! Hugging Face model directories: `config.json` (legacy and transformers-5 formats) plus
//! `model.safetensors` or sharded `model-0000N-of-0000M.safetensors` with an index.
//!
//! Tensors are views into the memory-mapped shards (validated by the `safetensors` crate:
//! contiguous, non-overlapping, exact sizes). HF checkpoints keep q/k in the layout that
//! `rotate_half` expects, so RoPE is half-split.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;
use serde_json::{Map, Value};
use tboost_ops::DType;
use tboost_ops::{Llama3Scaling, RopeScaling, RopeStyle, YarnScaling};

use super::arch::{MlpAct, SUPPORTED};
use super::weights::{
    check_shapes_in, ExpertWeights, LayerExtras, LayerWeights, Mlp, ModelWeights, RopeFactors, TensorSet,
};
use super::{Arch, Model, ModelConfig, ModelFormat, Storage, Tensor};
use crate::formats::files;
use crate::formats::limits;
use crate::{Error, Result};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Loads a model directory: config, every tensor mapped, shapes checked.
pub fn load(dir: &Path) -> Result<Model> {
    let config_path = dir.join(CONFIG_FILE);
    let text = files::read_text(&config_path, limits::MAX_SMALL_FILE_BYTES, CONFIG_FILE)?;
    let (mut config, factors) = parse_config_full(&text, &config_path)?;
    let set = read_tensors(dir)?;
    // Biases are a property of the checkpoint (qwen2 always has them, a llama may too).
    config.qkv_bias |= set.contains("model.layers.0.self_attn.q_proj.bias");
    let mut set = set;
    let mut weights = assemble(&config, &mut set)?;
    if let Some([short, long]) = factors {
        let t = |name: &str, v: Vec<f32>| {
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Tensor::owned(name, DType::F32, vec![v.len()], bytes)
                .map_err(|m| Error::config(config_path.display().to_string(), "rope_scaling", m))
        };
        weights.rope_factors = Some(RopeFactors {
            short: t("rope_scaling.short_factor", short)?,
            long: t("rope_scaling.long_factor", long)?,
        });
    }
    check_shapes_in(&config, &weights, &set, dir)?;
    Ok(Model {
        path: dir.to_path_buf(),
        format: ModelFormat::HuggingFace,
        config,
        weights,
        gguf_metadata: None,
        tokenizer: None,
        chat_template: None,
    })
}

/// Reads and resolves `config.json`. `qkv_bias` is set from `model_type` only; `load`
/// also sets it when the checkpoint holds q/k/v biases.
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    let text = files::read_text(path, limits::MAX_SMALL_FILE_BYTES, CONFIG_FILE)?;
    parse_config(&text, path)
}

/// Resolves a `config.json` text. `path` names the file in errors.
pub fn parse_config(text: &str, path: &Path) -> Result<ModelConfig> {
    parse_config_full(text, path).map(|(c, _)| c)
}

/// LongRoPE's short and long factor lists, which the config holds and the weights carry.
type LongRopeFactors = Option<[Vec<f32>; 2]>;

/// `parse_config`, plus LongRoPE's factor lists when the config has them.
fn parse_config_full(text: &str, path: &Path) -> Result<(ModelConfig, LongRopeFactors)> {
    let src = path.display().to_string();
    let root: Value = serde_json::from_str(text).map_err(|e| json_error(text, &e, path))?;
    let obj = root.as_object().ok_or_else(|| Error::format(path, "config.json must be a JSON object"))?;
    let c = Cfg { obj, src: &src };

    let model_type = c.str("model_type")?.ok_or_else(|| Error::config(&src, "model_type", "is missing"))?;
    let arch = Arch::parse(model_type)
        .ok_or_else(|| Error::Unsupported(format!("{src}: model_type `{model_type}`; tboost runs {SUPPORTED}")))?;
    if arch == Arch::Gemma3 && obj.contains_key("text_config") {
        return Err(Error::Unsupported(format!(
            "{src}: a multimodal Gemma 3 checkpoint (`text_config`); tboost runs the text model (model_type gemma3_text)"
        )));
    }
    let mut features = arch.features();
    // Gemma names it `hidden_activation` (and may keep a stale `hidden_act`).
    let act_key =
        if arch == Arch::Gemma3 && obj.contains_key("hidden_activation") { "hidden_activation" } else { "hidden_act" };
    if let Some(act) = c.str(act_key)? {
        let want = match features.mlp_act {
            MlpAct::Silu => &["silu"][..],
            MlpAct::GeluTanh => &["gelu_pytorch_tanh", "gelu_tanh"][..],
        };
        if !want.contains(&act) {
            return Err(Error::Unsupported(format!(
                "{src}: {act_key} `{act}`; tboost implements {} for {arch}",
                want.join(" / ")
            )));
        }
    }
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = c.f64(key)? {
            return Err(Error::Unsupported(format!("{src}: {key} {v} (logit soft-capping is not implemented)")));
        }
    }
    for flag in ["mlp_bias", "attention_bias"] {
        // llama's attention_bias also adds an o_proj bias, which the graph has no slot for.
        if arch != Arch::Qwen2 && c.bool(flag)? == Some(true) {
            return Err(Error::Unsupported(format!("{src}: `{flag}: true` (projection biases beyond q/k/v)")));
        }
    }

    let vocab_size = c.req_usize("vocab_size")?;
    let hidden_size = c.req_usize("hidden_size")?;
    let intermediate_size = c.req_usize("intermediate_size")?;
    let num_layers = c.req_usize("num_hidden_layers")?;
    let num_heads = c.req_usize("num_attention_heads")?;
    let num_kv_heads = c.usize("num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = match c.usize("head_dim")? {
        Some(d) => d,
        // Zero heads: leave head_dim 0 and let `validate` name num_attention_heads.
        None if num_heads == 0 => 0,
        None if hidden_size % num_heads != 0 => {
            return Err(Error::config(
                &src,
                "head_dim",
                format!("is not set and hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"),
            ))
        }
        None => hidden_size / num_heads,
    };

    // transformers 5 nests rope settings in `rope_parameters`; older configs keep
    // `rope_theta` at the top level and scaling in `rope_scaling`.
    let (rope_obj, rope_src) = match obj.get("rope_parameters") {
        Some(Value::Object(m)) => (Some(m), "rope_parameters"),
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(m)) => (Some(m), "rope_scaling"),
            Some(Value::Null) | None => (None, "rope_scaling"),
            Some(v) => return Err(Error::config(&src, "rope_scaling", format!("must be an object or null, got {v}"))),
        },
        Some(v) => return Err(Error::config(&src, "rope_parameters", format!("must be an object or null, got {v}"))),
    };
    // transformers 5 writes Gemma 3's rope per layer type: {full_attention: {...}, sliding_attention: {...}}.
    let per_type = rope_obj.and_then(|m| match (m.get("full_attention"), m.get("sliding_attention")) {
        (Some(Value::Object(f)), s) => Some((f, s.and_then(Value::as_object))),
        _ => None,
    });
    let rope_obj = per_type.map(|(f, _)| f).or(rope_obj);
    let rope = rope_obj.map(|m| Cfg { obj: m, src: &src });
    let rope_theta = match rope.as_ref().map(|r| r.f64("rope_theta")).transpose()?.flatten() {
        Some(t) => t,
        None if rope_src == "rope_parameters" => {
            return Err(Error::config(&src, "rope_parameters.rope_theta", "is missing"));
        }
        None => c.f64("rope_theta")?.unwrap_or(10000.0),
    };
    let rope_type = match &rope {
        // Older configs spell it `type`.
        Some(r) => match r.str("rope_type")? {
            Some(t) => Some(t),
            None => r.str("type")?,
        },
        None => None,
    };
    let max_position_embeddings = c.usize("max_position_embeddings")?.unwrap_or(match arch {
        Arch::Llama => 2048,
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => 32768,
        Arch::Mistral | Arch::Mixtral => 4096 * 32,
        Arch::Gemma3 => 131072,
        Arch::Phi3 => 4096,
    });
    let mut longrope_factors = None;
    let rope_scaling = match rope_type {
        None | Some("default") => None,
        Some(kind @ ("llama3" | "linear" | "yarn" | "longrope" | "su")) => {
            // `rope` is Some whenever rope_type is.
            let r = rope.as_ref().unwrap();
            let get = |k: &str| -> Result<f64> {
                r.f64(k)?.ok_or_else(|| {
                    Error::config(&src, format!("{rope_src}.{k}"), format!("is missing for {kind} scaling"))
                })
            };
            match kind {
                "llama3" => Some(RopeScaling::Llama3(Llama3Scaling {
                    factor: get("factor")?,
                    low_freq_factor: get("low_freq_factor")?,
                    high_freq_factor: get("high_freq_factor")?,
                    original_max_position_embeddings: get("original_max_position_embeddings")?,
                })),
                "linear" => Some(RopeScaling::Linear { factor: get("factor")? }),
                "yarn" => {
                    let factor = get("factor")?;
                    let orig = r.f64("original_max_position_embeddings")?.unwrap_or(max_position_embeddings as f64);
                    // transformers `_compute_yarn_parameters`: attention_factor, else from mscale.
                    let attention_factor =
                        match (r.f64("attention_factor")?, r.f64("mscale")?, r.f64("mscale_all_dim")?) {
                            (Some(a), _, _) => a,
                            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                                tboost_ops::rope::yarn_mscale(factor, m) / tboost_ops::rope::yarn_mscale(factor, all)
                            }
                            _ => tboost_ops::rope::yarn_mscale(factor, 1.0),
                        };
                    Some(RopeScaling::Yarn(YarnScaling {
                        factor,
                        original_max_position_embeddings: orig,
                        beta_fast: r.f64("beta_fast")?.unwrap_or(32.0),
                        beta_slow: r.f64("beta_slow")?.unwrap_or(1.0),
                        attention_factor,
                        truncate: r.bool("truncate")?.unwrap_or(true),
                    }))
                }
                // Phi-3's LongRoPE ("su" in its first configs): `original_max_position_embeddings`
                // at the top level (older) or in the rope object (transformers 5).
                _ => {
                    let orig = match c.f64("original_max_position_embeddings")? {
                        Some(o) => o,
                        None => get("original_max_position_embeddings")?,
                    };
                    let factor = max_position_embeddings as f64 / orig;
                    let attention_factor = match r.f64("attention_factor")? {
                        Some(a) => a,
                        None if factor <= 1.0 => 1.0,
                        None => (1.0 + factor.ln() / orig.ln()).sqrt(),
                    };
                    let list = |k: &str| -> Result<Vec<f32>> {
                        let key = format!("{rope_src}.{k}");
                        match r.get(k) {
                            Some(Value::Array(a)) => a
                                .iter()
                                .map(|v| {
                                    v.as_f64().filter(|x| x.is_finite() && *x > 0.0).map(|x| x as f32).ok_or_else(
                                        || Error::config(&src, &key, format!("has {v}, not a positive number")),
                                    )
                                })
                                .collect(),
                            _ => Err(Error::config(&src, key, "is missing for longrope scaling (a list of numbers)")),
                        }
                    };
                    longrope_factors = Some([list("short_factor")?, list("long_factor")?]);
                    Some(RopeScaling::LongRope { original_max_position_embeddings: orig, attention_factor })
                }
            }
        }
        Some(t) => {
            return Err(Error::Unsupported(format!(
                "{src}: {rope_src}.rope_type `{t}`; tboost implements default, llama3, linear, yarn and longrope RoPE"
            )))
        }
    };
    let rope_dim = match c.f64("partial_rotary_factor")? {
        None => head_dim,
        Some(f) if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
        Some(f) => return Err(Error::config(&src, "partial_rotary_factor", format!("must be in (0, 1], got {f}"))),
    };

    // Defaults are transformers' per-architecture config defaults.
    let rms_eps =
        c.f64("rms_norm_eps")?.unwrap_or(if matches!(arch, Arch::Mixtral | Arch::Phi3) { 1e-5 } else { 1e-6 });
    let tie_word_embeddings = c.bool("tie_word_embeddings")?.unwrap_or(arch == Arch::Gemma3);
    let (num_experts, experts_per_token) = if arch.is_moe() {
        // Hub Qwen3-MoE configs say `num_experts`; transformers 5 writes `num_local_experts`.
        let n = match c.usize("num_local_experts")? {
            Some(n) => n,
            None if arch == Arch::Qwen3Moe => c.req_usize("num_experts")?,
            None => c.req_usize("num_local_experts")?,
        };
        (n, c.req_usize("num_experts_per_tok")?)
    } else {
        (0, 0)
    };
    let mut intermediate_size = intermediate_size;
    if arch == Arch::Qwen3Moe {
        if c.usize("decoder_sparse_step")?.is_some_and(|s| s != 1) {
            return Err(Error::Unsupported(format!(
                "{src}: decoder_sparse_step other than 1 (dense layers between sparse ones)"
            )));
        }
        if matches!(obj.get("mlp_only_layers"), Some(Value::Array(a)) if !a.is_empty()) {
            return Err(Error::Unsupported(format!("{src}: mlp_only_layers (dense layers in a Qwen3-MoE model)")));
        }
        if c.bool("norm_topk_prob")? == Some(false) {
            return Err(Error::Unsupported(format!(
                "{src}: norm_topk_prob false (the top-k router weights without renormalization)"
            )));
        }
        intermediate_size = c.req_usize("moe_intermediate_size")?;
        if c.usize("shared_expert_intermediate_size")?.is_some_and(|s| s > 0) {
            return Err(Error::Unsupported(format!("{src}: a shared expert (shared_expert_intermediate_size)")));
        }
    }
    if arch == Arch::Gemma3 {
        if let Some(s) = c.f64("query_pre_attn_scalar")? {
            features.attn_scale = Some(1.0 / s.sqrt());
        }
        features.rope_local_theta = Some(match per_type.and_then(|(_, s)| s) {
            Some(m) => Cfg { obj: m, src: &src }.f64("rope_theta")?.unwrap_or(10000.0),
            None => c.f64("rope_local_base_freq")?.unwrap_or(10000.0),
        });
    }
    let bos_token_id = c.token_id("bos_token_id")?;
    let eos_token_ids = match obj.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            a.iter().map(|v| as_token_id(v).ok_or_else(|| c.bad("eos_token_id", v))).collect::<Result<_>>()?
        }
        Some(v) => vec![as_token_id(v).ok_or_else(|| c.bad("eos_token_id", v))?],
    };
    // Sliding window: Qwen configs carry one but use it only with `use_sliding_window`.
    let qwen = matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe);
    let on = !qwen || c.bool("use_sliding_window")? == Some(true);
    if let Some(w) = c.usize("sliding_window")?.filter(|&w| on && w > 0) {
        // Capped so an absurd layer count reaches `validate`'s limit error instead of an
        // allocation of that size.
        let n = num_layers.min(crate::formats::limits::MAX_LAYERS + 1);
        let layers: Vec<bool> = match obj.get("layer_types") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(Error::config(
                        &src,
                        "layer_types",
                        format!("has {v}; expected sliding_attention or full_attention"),
                    )),
                })
                .collect::<Result<_>>()?,
            _ if arch == Arch::Gemma3 => {
                let p = c.usize("sliding_window_pattern")?.unwrap_or(6).max(1);
                (0..n).map(|i| (i + 1) % p != 0).collect()
            }
            // Qwen2: layers from `max_window_layers` on use the window.
            _ if qwen => {
                let from = c.usize("max_window_layers")?.unwrap_or(0);
                (0..n).map(|i| i >= from).collect()
            }
            _ => vec![true; n],
        };
        // A window no sequence can exceed changes nothing.
        if w < max_position_embeddings && layers.iter().any(|&s| s) {
            features.sliding_window = w;
            features.sliding_layers = layers;
        }
    }

    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rope_dim,
        rope_theta,
        rope_scaling,
        rope_style: RopeStyle::HalfSplit,
        rms_eps,
        tie_word_embeddings,
        qkv_bias: arch == Arch::Qwen2,
        num_experts,
        experts_per_token,
        max_position_embeddings,
        bos_token_id,
        eos_token_ids,
        features,
    };
    cfg.validate(&src)?;
    if let Some([short, long]) = &longrope_factors {
        for (k, l) in [("short_factor", short), ("long_factor", long)] {
            if l.len() != cfg.rope_dim / 2 {
                return Err(Error::config(
                    &src,
                    format!("{rope_src}.{k}"),
                    format!("has {} values; rope_dim / 2 is {}", l.len(), cfg.rope_dim / 2),
                ));
            }
        }
    }
    Ok((cfg, longrope_factors))
}

/// Typed access to one JSON object, with errors naming the parameter.
struct Cfg<'a> {
    obj: &'a Map<String, Value>,
    src: &'a str,
}

impl<'a> Cfg<'a> {
    fn bad(&self, key: &str, v: &Value) -> Error {
        Error::config(self.src, key, format!("has an unexpected value {v}"))
    }

    /// Absent and null are both None.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(Error::config(self.src, key, format!("must be a non-negative integer, got {v}"))),
            },
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| Error::config(self.src, key, "is missing"))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| Error::config(self.src, key, format!("must be a number, got {v}")))
            }
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Error::config(self.src, key, format!("must be true or false, got {v}"))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(Some).ok_or_else(|| Error::config(self.src, key, format!("must be a string, got {v}")))
            }
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_token_id(v).map(Some).ok_or_else(|| self.bad(key, v)),
        }
    }
}

fn as_token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// A JSON syntax error. Python's `json.dump` writes `NaN` and `Infinity`, which are not
/// JSON; for those the error names the parameter that holds them.
fn json_error(text: &str, e: &serde_json::Error, path: &Path) -> Error {
    let line_start: usize = text.split_inclusive('\n').take(e.line().saturating_sub(1)).map(str::len).sum();
    let offset = (line_start + e.column()).min(text.len());
    let before = text.get(..offset).unwrap_or("");
    // The last `"key":` before the error position, and what follows its colon.
    let found = before.rfind(':').and_then(|colon| {
        let head = before[..colon].trim_end().strip_suffix('"')?;
        let key = &head[head.rfind('"')? + 1..];
        let value = text.get(colon + 1..)?.trim_start();
        let bad = ["NaN", "Infinity", "-Infinity"].into_iter().find(|b| value.starts_with(b))?;
        Some((key.to_string(), bad))
    });
    match found {
        Some((key, bad)) => Error::config(
            path.display().to_string(),
            key,
            format!("is {bad}, which is neither valid JSON nor a usable value"),
        ),
        None => Error::format(path, format!("invalid JSON: {e}")),
    }
}

/// Maps every shard and collects its tensors.
fn read_tensors(dir: &Path) -> Result<TensorSet> {
    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    // `exists` (a stat) rather than `is_file`: a FIFO or directory in a file's place is then
    // opened through `files::open_regular`, which names what it is, instead of being skipped.
    let has_index = index.exists();
    // Missing tensors are reported against the index or the single file.
    let mut set = TensorSet::new(if has_index { &index } else { &single });
    if has_index {
        let text = files::read_text(&index, limits::MAX_SMALL_FILE_BYTES, INDEX_FILE)?;
        let weight_map = parse_index(&text, &index)?;
        // Shard -> the tensors the index says it holds.
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, shard) in &weight_map {
            shards.entry(shard.as_str()).or_default().push(tensor.as_str());
        }
        for (shard, names) in shards {
            if shard.is_empty() || shard.contains(['/', '\\']) || shard == "." || shard == ".." {
                return Err(Error::format(&index, format!("shard name `{shard}` must be a plain file name")));
            }
            let path = dir.join(shard);
            if !path.exists() {
                return Err(Error::format(
                    &index,
                    format!("shard `{}` (holding `{}`) does not exist", path.display(), names[0]),
                ));
            }
            add_shard(&mut set, &path)?;
            for n in names {
                if set.file_of_exact(n) != Some(path.as_path()) {
                    return Err(Error::MissingTensor { path: path.clone(), tensor: n.to_string() });
                }
            }
        }
    } else if single.exists() {
        add_shard(&mut set, &single)?;
    } else {
        let has = |ext: &str| {
            std::fs::read_dir(dir)
                .map(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().ends_with(ext)))
                .unwrap_or(false)
        };
        let msg = if has(".bin") || has(".pt") {
            "holds PyTorch pickle weights; tboost reads safetensors only (convert the checkpoint)".to_string()
        } else if has(".safetensors") {
            format!("has .safetensors files but neither {SINGLE_FILE} nor {INDEX_FILE}")
        } else {
            format!("has no {SINGLE_FILE} and no {INDEX_FILE}")
        };
        return Err(Error::format(dir, msg));
    }
    Ok(set)
}

/// `weight_map` of a `model.safetensors.index.json`.
fn parse_index(text: &str, path: &Path) -> Result<BTreeMap<String, String>> {
    let v: Value = serde_json::from_str(text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::format(path, "has no `weight_map` object"))?;
    map.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(Error::format(path, format!("weight_map entry `{k}` must be a file name, got {v}"))),
        })
        .collect()
}

/// Maps a shard and adds its tensors to `set`. The header is read with `pread` and parsed
/// from memory ([`read_header`]); nothing reads the map, so a shard truncated while it loads
/// is an error naming it, never a SIGBUS.
fn add_shard(set: &mut TensorSet, path: &Path) -> Result<()> {
    let map = files::map_file(path)?;
    let (data_start, header) = read_header(&map, path)?;
    // A file cut inside its tensor data fails here, not at the first read of a tensor.
    map.check_loaded()?;
    let map = Storage::Mmap(map);
    let tensors = header.tensors();
    let total = set.len().saturating_add(tensors.len());
    if total > limits::MAX_TENSORS {
        return Err(Error::format(
            path,
            format!(
                "the checkpoint would hold {total} tensors with this shard, above tboost's limit of {}",
                limits::MAX_TENSORS
            ),
        ));
    }
    let mut views: Vec<_> = tensors.into_iter().collect();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, info) in views {
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            d => {
                return Err(Error::Unsupported(format!(
                    "{}: tensor `{name}` has dtype {d:?}, which tboost does not support (F32, F16, BF16)",
                    path.display()
                )))
            }
        };
        // The crate checked that the data section is exactly the file's rest: these fit.
        let (start, end) = info.data_offsets;
        let t = Tensor::new(&name, dtype, info.shape.clone(), map.clone(), data_start + start, end - start)
            .map_err(|m| Error::bad_tensor(path, &name, m))?;
        set.insert(t, path)?;
    }
    Ok(())
}

/// The `safetensors` crate's cap on a header's length (`MAX_HEADER_SIZE`, private there).
const MAX_HEADER_BYTES: usize = 100_000_000;

/// The header of a mapped safetensors file, read with `pread` and validated by the
/// `safetensors` crate as `SafeTensors::deserialize` validates a whole file (the same steps
/// and errors, against the length of the map): returns where the data section starts and
/// the tensor directory.
fn read_header(map: &files::MappedFile, path: &Path) -> Result<(usize, safetensors::tensor::Metadata)> {
    use safetensors::SafeTensorError as E;
    let len = map.len() as u64;
    let mut head = vec![0u8; len.min(8) as usize];
    map.read_head(0, &mut head, "the safetensors header length")?;
    let fail = |head: &[u8], e: E| safetensors_error(head, len, path, e);
    let Some(n) = head.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())) else {
        return Err(fail(&head, E::HeaderTooSmall));
    };
    let n = match usize::try_from(n) {
        Ok(n) if n <= MAX_HEADER_BYTES => n,
        _ => return Err(fail(&head, E::HeaderTooLarge)),
    };
    // `n <= MAX_HEADER_BYTES`: no overflow.
    if 8 + n as u64 > len {
        return Err(fail(&head, E::InvalidHeaderLength));
    }
    head.try_reserve_exact(n).map_err(|e| Error::format(path, format!("cannot allocate the {n}-byte header: {e}")))?;
    head.resize(8 + n, 0);
    map.read_head(8, &mut head[8..], "the safetensors header")?;
    let text = std::str::from_utf8(&head[8..]).map_err(|e| fail(&head, E::InvalidHeader(e)))?;
    /// The crate's own header layout (`HashMetadata`, private there).
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__")]
        metadata: Option<std::collections::HashMap<String, String>>,
        #[serde(flatten)]
        tensors: std::collections::HashMap<String, safetensors::tensor::TensorInfo>,
    }
    let h: Header = serde_json::from_str(text).map_err(|e| fail(&head, E::InvalidHeaderDeserialization(e)))?;
    // As the crate's `TryFrom<HashMetadata>`: sorted by offsets, then validated.
    let mut tensors: Vec<_> = h.tensors.into_iter().collect();
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let header = safetensors::tensor::Metadata::new(h.metadata, tensors).map_err(|e| fail(&head, e))?;
    // `data_len` is the end of the last tensor, which `new` checked are contiguous from 0.
    if (8 + n as u64).checked_add(header.data_len() as u64) != Some(len) {
        return Err(fail(&head, E::MetadataIncompleteBuffer));
    }
    Ok((8 + n, header))
}

/// The crate's errors do not always name the tensor; re-read the header to find it.
/// `head` is the start of a file of `len` bytes: its first 8 bytes (fewer in a shorter
/// file), then the header when it was read.
fn safetensors_error(head: &[u8], len: u64, path: &Path, e: safetensors::SafeTensorError) -> Error {
    let fallback = || Error::format(path, format!("invalid safetensors file: {e}"));
    let Some(n) = head.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())) else {
        return Error::format(path, format!("invalid safetensors file: only {len} bytes, no header"));
    };
    if n.checked_add(8).is_none_or(|end| end > len) {
        return Error::format(
            path,
            format!("invalid safetensors file: header length {n} runs past the end of the file ({len} bytes)"),
        );
    }
    // Not read: a header above the crate's cap.
    let Some(header) = usize::try_from(n).ok().and_then(|n| head.get(8..8 + n)) else { return fallback() };
    let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(header) else { return fallback() };
    let data_len = len - 8 - n;
    let mut ranges = Vec::new();
    for (name, info) in &m {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let shape: Option<Vec<u64>> =
            info.get("shape").and_then(Value::as_array).and_then(|a| a.iter().map(Value::as_u64).collect());
        let offs: Option<Vec<u64>> =
            info.get("data_offsets").and_then(Value::as_array).and_then(|a| a.iter().map(Value::as_u64).collect());
        let (Some(shape), Some(offs)) = (shape, offs) else {
            return Error::bad_tensor(path, name, "malformed header entry (shape or data_offsets)");
        };
        let &[start, end] = &offs[..] else {
            return Error::bad_tensor(path, name, format!("data_offsets {offs:?} must have two entries"));
        };
        if end < start || end > data_len {
            return Error::bad_tensor(
                path,
                name,
                format!(
                    "data_offsets {start}..{end} lie outside the data section ({data_len} bytes); the file is truncated or the header is wrong"
                ),
            );
        }
        let elem = match dtype {
            "F64" | "I64" | "U64" => Some(8),
            "F32" | "I32" | "U32" => Some(4),
            "F16" | "BF16" | "I16" | "U16" => Some(2),
            "I8" | "U8" | "BOOL" => Some(1),
            _ => None,
        };
        if let Some(elem) = elem {
            let need = shape.iter().try_fold(elem, |a: u64, &d| a.checked_mul(d));
            if need != Some(end - start) {
                return Error::bad_tensor(
                    path,
                    name,
                    format!(
                        "shape {shape:?} of {dtype} needs {} bytes but data_offsets {start}..{end} give {}",
                        need.map_or("too many".to_string(), |n| n.to_string()),
                        end - start
                    ),
                );
            }
        }
        ranges.push((start, end, name.as_str()));
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 != w[0].1 {
            let what = if w[1].0 < w[0].1 { "overlaps" } else { "leaves a gap after" };
            return Error::bad_tensor(
                path,
                w[1].2,
                format!("data {}..{} {what} tensor `{}` ({}..{})", w[1].0, w[1].1, w[0].2, w[0].0, w[0].1),
            );
        }
    }
    fallback()
}

/// Builds the per-layer weights from HF tensor names.
fn assemble(cfg: &ModelConfig, set: &mut TensorSet) -> Result<ModelWeights> {
    let embed = set.take("model.embed_tokens.weight")?;
    let f = &cfg.features;
    // Gemma stores norm gains as offsets from 1.
    let gain = |set: &mut TensorSet, name: &str| -> Result<Tensor> {
        let t = set.take(name)?;
        if f.norm_plus_one {
            plus_one(&t, set.file_of(name))
        } else {
            Ok(t)
        }
    };
    let (qd, kvd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}.");
        // Old checkpoints saved the RoPE table; it is recomputed from the config.
        set.take_opt(&format!("{p}self_attn.rotary_emb.inv_freq"));
        let bias = |set: &mut TensorSet, n: &str| -> Result<Option<Tensor>> {
            if cfg.qkv_bias {
                set.take(&format!("{p}self_attn.{n}_proj.bias")).map(Some)
            } else {
                Ok(None)
            }
        };
        let q_bias = bias(set, "q")?;
        let k_bias = bias(set, "k")?;
        let v_bias = bias(set, "v")?;
        let mlp = if cfg.arch.is_moe() {
            // Mixtral: block_sparse_moe.experts.E.w1|w3|w2; Qwen3-MoE: mlp.experts.E.{gate,up,down}_proj.
            let (m, names) = match cfg.arch {
                Arch::Qwen3Moe => (format!("{p}mlp."), ["gate_proj", "up_proj", "down_proj"]),
                _ => (format!("{p}block_sparse_moe."), ["w1", "w3", "w2"]),
            };
            let router = set.take(&format!("{m}gate.weight"))?;
            let experts = (0..cfg.num_experts)
                .map(|e| {
                    let t = |set: &mut TensorSet, n: &str| set.take(&format!("{m}experts.{e}.{n}.weight"));
                    Ok(ExpertWeights { gate: t(set, names[0])?, up: t(set, names[1])?, down: t(set, names[2])? })
                })
                .collect::<Result<_>>()?;
            Mlp::Moe { router, experts }
        } else if cfg.arch == Arch::Phi3 {
            // Phi-3 fuses gate and up: rows [0, I) gate, [I, 2I) up; split into views.
            let name = format!("{p}mlp.gate_up_proj.weight");
            let gu = set.take(&name)?;
            let inter = cfg.intermediate_size;
            let rows = |start, part: &str| {
                gu.slice_rows(start, inter, format!("{name}[{part}]")).map_err(|m| {
                    Error::bad_tensor(
                        set.file_of(&name),
                        &name,
                        format!("{m} (expected [2 * intermediate_size, hidden])"),
                    )
                })
            };
            if gu.shape.first() != Some(&(2 * inter)) {
                return Err(Error::bad_tensor(
                    set.file_of(&name),
                    &name,
                    format!(
                        "expected shape [{}, {}] (2 * intermediate_size, hidden_size), got {:?}",
                        2 * inter,
                        cfg.hidden_size,
                        gu.shape
                    ),
                ));
            }
            Mlp::Dense {
                gate: rows(0, "gate")?,
                up: rows(inter, "up")?,
                down: set.take(&format!("{p}mlp.down_proj.weight"))?,
            }
        } else {
            Mlp::Dense {
                gate: set.take(&format!("{p}mlp.gate_proj.weight"))?,
                up: set.take(&format!("{p}mlp.up_proj.weight"))?,
                down: set.take(&format!("{p}mlp.down_proj.weight"))?,
            }
        };
        let (q, k, v) = if cfg.arch == Arch::Phi3 {
            // rows [0, H*d) q, then K*d of k, then K*d of v.
            let name = format!("{p}self_attn.qkv_proj.weight");
            let qkv = set.take(&name)?;
            if qkv.shape.first() != Some(&(qd + 2 * kvd)) {
                return Err(Error::bad_tensor(
                    set.file_of(&name),
                    &name,
                    format!("expected {} rows (q {qd} + k {kvd} + v {kvd}), got shape {:?}", qd + 2 * kvd, qkv.shape),
                ));
            }
            let rows = |start, n, part: &str| {
                qkv.slice_rows(start, n, format!("{name}[{part}]"))
                    .map_err(|m| Error::bad_tensor(set.file_of(&name), &name, m))
            };
            (rows(0, qd, "q")?, rows(qd, kvd, "k")?, rows(qd + kvd, kvd, "v")?)
        } else {
            (
                set.take(&format!("{p}self_attn.q_proj.weight"))?,
                set.take(&format!("{p}self_attn.k_proj.weight"))?,
                set.take(&format!("{p}self_attn.v_proj.weight"))?,
            )
        };
        let mut extra = LayerExtras::default();
        if f.qk_norm {
            extra.q_norm = Some(gain(set, &format!("{p}self_attn.q_norm.weight"))?);
            extra.k_norm = Some(gain(set, &format!("{p}self_attn.k_norm.weight"))?);
        }
        // Gemma 3: post_attention_layernorm is the attention output's norm and
        // pre_feedforward_layernorm the MLP input's.
        let ffn_norm = if f.post_norms {
            extra.post_attn_norm = Some(gain(set, &format!("{p}post_attention_layernorm.weight"))?);
            extra.post_ffn_norm = Some(gain(set, &format!("{p}post_feedforward_layernorm.weight"))?);
            gain(set, &format!("{p}pre_feedforward_layernorm.weight"))?
        } else {
            gain(set, &format!("{p}post_attention_layernorm.weight"))?
        };
        layers.push(LayerWeights {
            attn_norm: gain(set, &format!("{p}input_layernorm.weight"))?,
            q,
            k,
            v,
            o: set.take(&format!("{p}self_attn.o_proj.weight"))?,
            q_bias,
            k_bias,
            v_bias,
            ffn_norm,
            mlp,
            extra,
        });
    }
    let norm = gain(set, "model.norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings {
        // Some tied checkpoints still store a copy; transformers ignores it, so do we.
        set.take_opt("lm_head.weight");
        embed.clone()
    } else {
        set.take("lm_head.weight")?
    };
    set.finish()?;
    Ok(ModelWeights { embed, layers, norm, lm_head, rope_factors: None })
}

/// `1 + w` in f32 (Gemma's norm gains; transformers adds the 1 in f32 as well). The gains
/// are read with `pread` ([`Tensor::to_f32`]), not through the map.
fn plus_one(t: &Tensor, file: &Path) -> Result<Tensor> {
    let v = t.to_f32()?.ok_or_else(|| {
        Error::bad_tensor(file, &t.name, format!("is {}, but a norm gain must be f32, f16 or bf16", t.dtype))
    })?;
    let v: Vec<f32> = v.iter().map(|w| 1.0 + w).collect();
    t.with_f32(&v).map_err(|m| Error::bad_tensor(file, &t.name, m))
}
