//! A Hugging Face checkpoint converted to GGUF the way llama.cpp's `convert_hf_to_gguf.py` lays
//! it out (tensor names, GGML dimension order, metadata keys, Gemma's `+1` on norm gains, Phi-3's
//! fused tensors and LongRoPE factor tensors, stacked MoE experts), so that a golden case can be
//! checked from a GGUF conversion of the same weights. Written into a tempdir, never into
//! `shared/`. Only what the golden cases need: f32/f16/bf16 tensors, no tokenizer (the vocabulary
//! size is `{arch}.vocab_size`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tboost_engine::formats::gguf::Value;

use super::gguf::{GTensor, Gguf};

/// One safetensors tensor: dtype name, shape (outermost first) and bytes.
struct St {
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn read_safetensors(path: &Path) -> BTreeMap<String, St> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Json = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, info) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let offs: Vec<usize> =
            info["data_offsets"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let shape = info["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let dtype = info["dtype"].as_str().unwrap().to_string();
        out.insert(name.clone(), St { dtype, shape, data: data[offs[0]..offs[1]].to_vec() });
    }
    out
}

fn ggml_type(dtype: &str) -> u32 {
    match dtype {
        "F32" => 0,
        "F16" => 1,
        "BF16" => 30,
        other => panic!("convert: safetensors dtype {other} is not converted"),
    }
}

/// `1 + w` of a norm gain, kept in its dtype (llama.cpp's Gemma converter adds the shift).
fn plus_one(t: &St) -> Vec<u8> {
    match t.dtype.as_str() {
        "F32" => t
            .data
            .chunks_exact(4)
            .flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) + 1.0).to_le_bytes())
            .collect(),
        "BF16" => t
            .data
            .chunks_exact(2)
            .flat_map(|c| half::bf16::from_f32(half::bf16::from_le_bytes([c[0], c[1]]).to_f32() + 1.0).to_le_bytes())
            .collect(),
        "F16" => t
            .data
            .chunks_exact(2)
            .flat_map(|c| half::f16::from_f32(half::f16::from_le_bytes([c[0], c[1]]).to_f32() + 1.0).to_le_bytes())
            .collect(),
        other => panic!("convert: norm gain of dtype {other}"),
    }
}

fn f32_vec(name: &str, v: &[f64]) -> GTensor {
    let data = v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect();
    GTensor { name: name.into(), ne: vec![v.len() as u64], ty: 0, data, offset_override: None }
}

/// llama.cpp's architecture name for an HF `model_type`.
fn gguf_arch(model_type: &str) -> &'static str {
    match model_type {
        "qwen3" => "qwen3",
        "qwen3_moe" => "qwen3moe",
        "gemma3_text" | "gemma3" => "gemma3",
        "phi3" => "phi3",
        other => panic!("convert: model_type {other} is not converted by the testkit"),
    }
}

/// Converts the checkpoint in `dir` into `out_dir/model.gguf`.
pub fn hf_to_gguf(dir: &Path, out_dir: &Path) -> PathBuf {
    let cfg: Json = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut st = read_safetensors(&dir.join("model.safetensors"));
    let model_type = cfg["model_type"].as_str().unwrap();
    let arch = gguf_arch(model_type);
    let u = |k: &str| cfg[k].as_u64();
    let num = |k: &str| cfg[k].as_f64();
    let (hidden, heads) = (u("hidden_size").unwrap(), u("num_attention_heads").unwrap());
    let kv_heads = u("num_key_value_heads").unwrap_or(heads);
    let head_dim = u("head_dim").unwrap_or(hidden / heads);
    let layers = u("num_hidden_layers").unwrap();
    let gemma = arch == "gemma3";

    let mut g = Gguf::new();
    let key = |s: &str| format!("{arch}.{s}");
    g.set("general.architecture", Value::String(arch.into()));
    g.set("general.name", Value::String(format!("golden {model_type}")));
    g.set(&key("vocab_size"), Value::U32(u("vocab_size").unwrap() as u32));
    g.set(&key("block_count"), Value::U32(layers as u32));
    g.set(&key("context_length"), Value::U32(u("max_position_embeddings").unwrap() as u32));
    g.set(&key("embedding_length"), Value::U32(hidden as u32));
    g.set(&key("feed_forward_length"), Value::U32(u("intermediate_size").unwrap() as u32));
    g.set(&key("attention.head_count"), Value::U32(heads as u32));
    g.set(&key("attention.head_count_kv"), Value::U32(kv_heads as u32));
    g.set(&key("attention.key_length"), Value::U32(head_dim as u32));
    g.set(&key("attention.value_length"), Value::U32(head_dim as u32));
    g.set(&key("rope.dimension_count"), Value::U32(head_dim as u32));
    let theta = num("rope_theta").or_else(|| cfg["rope_parameters"]["rope_theta"].as_f64()).unwrap_or(10000.0);
    g.set(&key("rope.freq_base"), Value::F32(theta as f32));
    g.set(&key("attention.layer_norm_rms_epsilon"), Value::F32(num("rms_norm_eps").unwrap() as f32));
    for (k, id) in [("bos", "bos_token_id"), ("eos", "eos_token_id")] {
        if let Some(v) = u(id) {
            g.set(&format!("tokenizer.ggml.{k}_token_id"), Value::U32(v as u32));
        }
    }
    if arch == "qwen3moe" {
        let n = u("num_experts").or(u("num_local_experts")).unwrap();
        g.set(&key("expert_count"), Value::U32(n as u32));
        g.set(&key("expert_used_count"), Value::U32(u("num_experts_per_tok").unwrap() as u32));
        g.set(&key("expert_feed_forward_length"), Value::U32(u("moe_intermediate_size").unwrap() as u32));
    }
    if gemma {
        if let Some(w) = u("sliding_window") {
            g.set(&key("attention.sliding_window"), Value::U32(w as u32));
            let types = cfg["layer_types"].as_array().unwrap();
            let flags = types.iter().map(|t| Value::Bool(t.as_str() == Some("sliding_attention"))).collect();
            g.set(&key("attention.sliding_window_pattern"), Value::Array(flags));
        }
        g.set(&key("rope.freq_base_swa"), Value::F32(num("rope_local_base_freq").unwrap_or(10000.0) as f32));
        if let Some(q) = num("query_pre_attn_scalar") {
            g.set(&key("attention.scale"), Value::F32((1.0 / q.sqrt()) as f32));
        }
    }
    if arch == "phi3" {
        let rs = &cfg["rope_scaling"];
        if rs["type"].as_str().or(rs["rope_type"].as_str()) == Some("longrope") {
            let orig = num("original_max_position_embeddings").unwrap();
            let max = num("max_position_embeddings").unwrap();
            let att = (1.0 + (max / orig).ln() / orig.ln()).sqrt();
            g.set(&key("rope.scaling.original_context_length"), Value::U32(orig as u32));
            g.set(&key("rope.scaling.attn_factor"), Value::F32(att as f32));
            for (name, k) in
                [("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")]
            {
                let v: Vec<f64> = rs[k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                g.tensors.push(f32_vec(name, &v));
            }
        }
    }

    fn put(g: &mut Gguf, name: String, t: St, shift: bool) {
        let data = if shift { plus_one(&t) } else { t.data };
        let ne = t.shape.iter().rev().copied().collect();
        g.tensors.push(GTensor { name, ne, ty: ggml_type(&t.dtype), data, offset_override: None });
    }
    let mut take = |name: &str| st.remove(name).unwrap_or_else(|| panic!("convert: no tensor {name}"));
    put(&mut g, "token_embd.weight".into(), take("model.embed_tokens.weight"), false);
    for i in 0..layers {
        let p = format!("model.layers.{i}.");
        let b = |s: &str| format!("blk.{i}.{s}");
        put(&mut g, b("attn_norm.weight"), take(&format!("{p}input_layernorm.weight")), gemma);
        if arch == "phi3" {
            put(&mut g, b("attn_qkv.weight"), take(&format!("{p}self_attn.qkv_proj.weight")), false);
        } else {
            for (n, h) in [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")] {
                put(&mut g, b(&format!("{h}.weight")), take(&format!("{p}self_attn.{n}_proj.weight")), false);
            }
        }
        put(&mut g, b("attn_output.weight"), take(&format!("{p}self_attn.o_proj.weight")), false);
        if arch != "phi3" {
            put(&mut g, b("attn_q_norm.weight"), take(&format!("{p}self_attn.q_norm.weight")), gemma);
            put(&mut g, b("attn_k_norm.weight"), take(&format!("{p}self_attn.k_norm.weight")), gemma);
        }
        if gemma {
            put(&mut g, b("post_attention_norm.weight"), take(&format!("{p}post_attention_layernorm.weight")), true);
            put(&mut g, b("ffn_norm.weight"), take(&format!("{p}pre_feedforward_layernorm.weight")), true);
            put(&mut g, b("post_ffw_norm.weight"), take(&format!("{p}post_feedforward_layernorm.weight")), true);
        } else {
            put(&mut g, b("ffn_norm.weight"), take(&format!("{p}post_attention_layernorm.weight")), false);
        }
        if arch == "qwen3moe" {
            put(&mut g, b("ffn_gate_inp.weight"), take(&format!("{p}mlp.gate.weight")), false);
            let n = u("num_experts").or(u("num_local_experts")).unwrap() as usize;
            for (proj, gname) in
                [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]
            {
                let parts: Vec<St> = (0..n).map(|e| take(&format!("{p}mlp.experts.{e}.{proj}.weight"))).collect();
                let mut shape = vec![n as u64];
                shape.extend(&parts[0].shape);
                let data = parts.iter().flat_map(|t| t.data.iter().copied()).collect();
                put(&mut g, b(&format!("{gname}.weight")), St { dtype: parts[0].dtype.clone(), shape, data }, false);
            }
        } else if arch == "phi3" {
            put(&mut g, b("ffn_up.weight"), take(&format!("{p}mlp.gate_up_proj.weight")), false);
            put(&mut g, b("ffn_down.weight"), take(&format!("{p}mlp.down_proj.weight")), false);
        } else {
            for (n, h) in [("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")] {
                put(&mut g, b(&format!("{h}.weight")), take(&format!("{p}mlp.{n}_proj.weight")), false);
            }
        }
    }
    put(&mut g, "output_norm.weight".into(), take("model.norm.weight"), gemma);
    if let Some(t) = st.remove("lm_head.weight") {
        put(&mut g, "output.weight".into(), t, false);
    }
    assert!(st.is_empty(), "convert: tensors left unconverted: {:?}", st.keys().collect::<Vec<_>>());
    g.write(out_dir, "model.gguf")
}
