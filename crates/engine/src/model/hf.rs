//! Hugging Face model directories: `config.json` (legacy and transformers-5 formats) plus
//! `model.safetensors` or sharded `model-0000N-of-0000M.safetensors` with an index.
//!
//! Tensors are views into the memory-mapped shards (validated by the `safetensors` crate:
//! contiguous, non-overlapping, exact sizes). HF checkpoints keep q/k in the layout that
//! `rotate_half` expects, so RoPE is half-split.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde_json::{Map, Value};
use tboost_ops::DType;
use tboost_ops::{Llama3Scaling, RopeStyle};

use super::weights::{check_shapes_in, ExpertWeights, LayerWeights, Mlp, ModelWeights, TensorSet};
use super::{map_weights, Arch, Model, ModelConfig, ModelFormat, Tensor};
use crate::formats::files;
use crate::formats::limits;
use crate::{Error, Result};

pub const CONFIG_FILE: &str = "config.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Loads a model directory: config, every tensor mapped, shapes checked.
pub fn load(dir: &Path) -> Result<Model> {
    let config_path = dir.join(CONFIG_FILE);
    let mut config = read_config(&config_path)?;
    let set = read_tensors(dir)?;
    // Biases are a property of the checkpoint (qwen2 always has them, a llama may too).
    config.qkv_bias |= set.contains("model.layers.0.self_attn.q_proj.bias");
    let mut set = set;
    let weights = assemble(&config, &mut set)?;
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
    let src = path.display().to_string();
    let root: Value = serde_json::from_str(text).map_err(|e| json_error(text, &e, path))?;
    let obj = root.as_object().ok_or_else(|| Error::format(path, "config.json must be a JSON object"))?;
    let c = Cfg { obj, src: &src };

    let model_type = c.str("model_type")?.ok_or_else(|| Error::config(&src, "model_type", "is missing"))?;
    let arch = Arch::parse(model_type).ok_or_else(|| {
        Error::Unsupported(format!("{src}: model_type `{model_type}`; tboost runs llama, mistral, qwen2 and mixtral"))
    })?;
    if let Some(act) = c.str("hidden_act")? {
        if act != "silu" {
            return Err(Error::Unsupported(format!("{src}: hidden_act `{act}`; tboost implements silu (SwiGLU)")));
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
    let rope_scaling = match rope_type {
        None | Some("default") => None,
        Some("llama3") => {
            // `rope` is Some whenever rope_type is.
            let r = rope.as_ref().unwrap();
            let get = |k: &str| -> Result<f64> {
                r.f64(k)?.ok_or_else(|| Error::config(&src, format!("{rope_src}.{k}"), "is missing for llama3 scaling"))
            };
            Some(Llama3Scaling {
                factor: get("factor")?,
                low_freq_factor: get("low_freq_factor")?,
                high_freq_factor: get("high_freq_factor")?,
                original_max_position_embeddings: get("original_max_position_embeddings")?,
            })
        }
        Some(t) => {
            return Err(Error::Unsupported(format!(
                "{src}: {rope_src}.rope_type `{t}`; tboost implements default and llama3 RoPE"
            )))
        }
    };
    let rope_dim = match c.f64("partial_rotary_factor")? {
        None => head_dim,
        Some(f) if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
        Some(f) => return Err(Error::config(&src, "partial_rotary_factor", format!("must be in (0, 1], got {f}"))),
    };

    // Defaults are transformers' per-architecture config defaults.
    let rms_eps = c.f64("rms_norm_eps")?.unwrap_or(if arch == Arch::Mixtral { 1e-5 } else { 1e-6 });
    let max_position_embeddings = c.usize("max_position_embeddings")?.unwrap_or(match arch {
        Arch::Llama => 2048,
        Arch::Qwen2 => 32768,
        Arch::Mistral | Arch::Mixtral => 4096 * 32,
    });
    let tie_word_embeddings = c.bool("tie_word_embeddings")?.unwrap_or(false);
    let (num_experts, experts_per_token) =
        if arch.is_moe() { (c.req_usize("num_local_experts")?, c.req_usize("num_experts_per_tok")?) } else { (0, 0) };
    let bos_token_id = c.token_id("bos_token_id")?;
    let eos_token_ids = match obj.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            a.iter().map(|v| as_token_id(v).ok_or_else(|| c.bad("eos_token_id", v))).collect::<Result<_>>()?
        }
        Some(v) => vec![as_token_id(v).ok_or_else(|| c.bad("eos_token_id", v))?],
    };
    if let Some(w) = c.usize("sliding_window")? {
        let on = arch != Arch::Qwen2 || c.bool("use_sliding_window")? == Some(true);
        if on && w < max_position_embeddings {
            log::warn!(
                "{src}: sliding_window {w} is not applied: attention over sequences longer than {w} tokens will differ from the reference"
            );
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
    };
    cfg.validate(&src)?;
    Ok(cfg)
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

fn add_shard(set: &mut TensorSet, path: &Path) -> Result<()> {
    let map = map_weights(path)?;
    let st = SafeTensors::deserialize(map.bytes()).map_err(|e| safetensors_error(map.bytes(), path, e))?;
    let base = map.bytes().as_ptr() as usize;
    let total = set.len().saturating_add(st.len());
    if total > limits::MAX_TENSORS {
        return Err(Error::format(
            path,
            format!(
                "the checkpoint would hold {total} tensors with this shard, above tboost's limit of {}",
                limits::MAX_TENSORS
            ),
        ));
    }
    let mut views: Vec<_> = st.iter().collect();
    views.sort_by_key(|(n, _)| *n);
    for (name, view) in views {
        let dtype = match view.dtype() {
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
        let data = view.data();
        // `data` is a sub-slice of the map, so the difference is its offset.
        let offset = data.as_ptr() as usize - base;
        let t = Tensor::new(name, dtype, view.shape().to_vec(), map.clone(), offset, data.len())
            .map_err(|m| Error::bad_tensor(path, name, m))?;
        set.insert(t, path)?;
    }
    Ok(())
}

/// The crate's errors do not always name the tensor; re-read the header to find it.
fn safetensors_error(bytes: &[u8], path: &Path, e: safetensors::SafeTensorError) -> Error {
    let fallback = || Error::format(path, format!("invalid safetensors file: {e}"));
    let Some(n) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())) else {
        return Error::format(path, format!("invalid safetensors file: only {} bytes, no header", bytes.len()));
    };
    let Some(header) = usize::try_from(n).ok().and_then(|n| bytes.get(8..8usize.checked_add(n)?)) else {
        return Error::format(
            path,
            format!(
                "invalid safetensors file: header length {n} runs past the end of the file ({} bytes)",
                bytes.len()
            ),
        );
    };
    let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(header) else { return fallback() };
    let data_len = bytes.len() - 8 - header.len();
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
        if end < start || end > data_len as u64 {
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
            let m = format!("{p}block_sparse_moe.");
            let router = set.take(&format!("{m}gate.weight"))?;
            let experts = (0..cfg.num_experts)
                .map(|e| {
                    Ok(ExpertWeights {
                        gate: set.take(&format!("{m}experts.{e}.w1.weight"))?,
                        up: set.take(&format!("{m}experts.{e}.w3.weight"))?,
                        down: set.take(&format!("{m}experts.{e}.w2.weight"))?,
                    })
                })
                .collect::<Result<_>>()?;
            Mlp::Moe { router, experts }
        } else {
            Mlp::Dense {
                gate: set.take(&format!("{p}mlp.gate_proj.weight"))?,
                up: set.take(&format!("{p}mlp.up_proj.weight"))?,
                down: set.take(&format!("{p}mlp.down_proj.weight"))?,
            }
        };
        layers.push(LayerWeights {
            attn_norm: set.take(&format!("{p}input_layernorm.weight"))?,
            q: set.take(&format!("{p}self_attn.q_proj.weight"))?,
            k: set.take(&format!("{p}self_attn.k_proj.weight"))?,
            v: set.take(&format!("{p}self_attn.v_proj.weight"))?,
            o: set.take(&format!("{p}self_attn.o_proj.weight"))?,
            q_bias,
            k_bias,
            v_bias,
            ffn_norm: set.take(&format!("{p}post_attention_layernorm.weight"))?,
            mlp,
        });
    }
    let norm = set.take("model.norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings {
        // Some tied checkpoints still store a copy; transformers ignores it, so do we.
        set.take_opt("lm_head.weight");
        embed.clone()
    } else {
        set.take("lm_head.weight")?
    };
    set.finish()?;
    Ok(ModelWeights { embed, layers, norm, lm_head })
}
