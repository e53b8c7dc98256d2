//! Hugging Face loader: the six golden directories (read in place), a sharded copy, and
//! small models written by the tests themselves, valid and broken.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{json, Value};
use tboost_engine::model::weights::Mlp;
use tboost_engine::model::{hf, Arch, Model, ModelConfig};
use tboost_engine::Error;
use tboost_ops::DType;
use tboost_ops::{RopeScaling, RopeStyle};

const CASES: [&str; 6] = ["llama_gqa", "llama_gqa_bf16", "llama_hd24", "mistral", "mixtral", "qwen2"];

fn golden_dir(case: &str) -> PathBuf {
    let d = tboost_testkit::golden::golden_dir(case);
    assert!(
        d.join("golden.json").is_file(),
        "{} is missing: the golden data lives in shared/testdata/golden (see its README.md)",
        d.display()
    );
    d
}

fn golden_params(case: &str) -> Value {
    let text = std::fs::read_to_string(golden_dir(case).join("golden.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["params"].clone()
}

/// Every resolved value golden.json lists must equal ours.
fn assert_matches_params(cfg: &ModelConfig, p: &Value, case: &str) {
    let u = |k: &str| p[k].as_u64().unwrap_or_else(|| panic!("{case}: params.{k}")) as usize;
    assert_eq!(cfg.arch.name(), p["model_type"].as_str().unwrap(), "{case}");
    assert_eq!(cfg.vocab_size, u("vocab_size"), "{case}");
    assert_eq!(cfg.hidden_size, u("hidden_size"), "{case}");
    assert_eq!(cfg.intermediate_size, u("intermediate_size"), "{case}");
    assert_eq!(cfg.num_layers, u("num_hidden_layers"), "{case}");
    assert_eq!(cfg.num_heads, u("num_attention_heads"), "{case}");
    assert_eq!(cfg.num_kv_heads, u("num_key_value_heads"), "{case}");
    assert_eq!(cfg.head_dim, u("head_dim"), "{case}");
    assert_eq!(cfg.rope_dim, u("head_dim"), "{case}");
    assert_eq!(cfg.gqa_group(), u("gqa_group_size"), "{case}");
    assert_eq!(cfg.rms_eps, p["rms_norm_eps"].as_f64().unwrap(), "{case}");
    assert_eq!(cfg.rope_theta, p["rope_theta"].as_f64().unwrap(), "{case}");
    assert_eq!(cfg.max_position_embeddings, u("max_position_embeddings"), "{case}");
    assert_eq!(cfg.tie_word_embeddings, p["tie_word_embeddings"].as_bool().unwrap(), "{case}");
    assert_eq!(cfg.qkv_bias, p["attention_bias"].as_bool().unwrap(), "{case}");
    assert_eq!(cfg.rope_style, RopeStyle::HalfSplit, "{case}: params.rope_layout is {}", p["rope_layout"]);
    match p["rope_type"].as_str().unwrap() {
        "default" => {
            assert!(p["rope_scaling"].is_null(), "{case}");
            assert_eq!(cfg.rope_scaling, None, "{case}");
        }
        "llama3" => {
            let Some(RopeScaling::Llama3(s)) = cfg.rope_scaling else { panic!("{case}: llama3 scaling missing") };
            let r = &p["rope_scaling"];
            assert_eq!(s.factor, r["factor"].as_f64().unwrap(), "{case}");
            assert_eq!(s.low_freq_factor, r["low_freq_factor"].as_f64().unwrap(), "{case}");
            assert_eq!(s.high_freq_factor, r["high_freq_factor"].as_f64().unwrap(), "{case}");
            assert_eq!(
                s.original_max_position_embeddings,
                r["original_max_position_embeddings"].as_f64().unwrap(),
                "{case}"
            );
        }
        t => panic!("{case}: unexpected rope_type {t}"),
    }
    assert_eq!(cfg.bos_token_id, p["bos_token_id"].as_u64().map(|v| v as u32), "{case}");
    let eos: Vec<u32> = match &p["eos_token_id"] {
        Value::Null => vec![],
        Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
        v => vec![v.as_u64().unwrap() as u32],
    };
    assert_eq!(cfg.eos_token_ids, eos, "{case}");
    assert_eq!(cfg.num_experts, p["num_local_experts"].as_u64().unwrap_or(0) as usize, "{case}");
    assert_eq!(cfg.experts_per_token, p["num_experts_per_tok"].as_u64().unwrap_or(0) as usize, "{case}");
}

#[test]
fn golden_configs_resolve_to_golden_params() {
    for case in CASES {
        let p = golden_params(case);
        let model = Model::load(&golden_dir(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_matches_params(&model.config, &p, case);
        // The config alone resolves the same (qwen2 biases come from model_type).
        let cfg = hf::read_config(&golden_dir(case).join("config.json")).unwrap();
        assert_eq!(cfg, model.config, "{case}");
    }
}

#[test]
fn golden_models_load_as_mapped_views() {
    for case in CASES {
        let m = Model::load(&golden_dir(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
        let w = &m.weights;
        let want = if case.ends_with("bf16") { DType::BF16 } else { DType::F32 };
        let mut all = vec![&w.embed, &w.norm, &w.lm_head];
        for l in &w.layers {
            all.extend([&l.attn_norm, &l.q, &l.k, &l.v, &l.o, &l.ffn_norm]);
            all.extend([&l.q_bias, &l.k_bias, &l.v_bias].into_iter().flatten());
            match &l.mlp {
                Mlp::Dense { gate, up, down } => all.extend([gate, up, down]),
                Mlp::Moe { router, experts } => {
                    all.push(router);
                    for e in experts {
                        all.extend([&e.gate, &e.up, &e.down]);
                    }
                }
            }
        }
        for t in &all {
            assert!(t.is_mapped(), "{case}: {} is copied", t.name);
            assert_eq!(t.dtype, want, "{case}: {}", t.name);
        }
        let st_bytes = std::fs::metadata(golden_dir(case).join("model.safetensors")).unwrap().len() as usize;
        assert!(w.total_bytes() <= st_bytes && w.total_bytes() > st_bytes * 9 / 10, "{case}");
        match case {
            "qwen2" => {
                assert!(m.config.tie_word_embeddings);
                assert_eq!(w.lm_head.bytes().as_ptr(), w.embed.bytes().as_ptr(), "tied lm_head is the embedding");
                assert!(w.layers.iter().all(|l| l.q_bias.is_some() && l.k_bias.is_some() && l.v_bias.is_some()));
            }
            "mixtral" => {
                assert_eq!(m.config.arch, Arch::Mixtral);
                for l in &w.layers {
                    let Mlp::Moe { router, experts } = &l.mlp else { panic!("mixtral layer is dense") };
                    assert_eq!(router.shape, [4, 128]);
                    assert_eq!(experts.len(), 4);
                    assert_eq!(experts[3].down.shape, [128, 160]);
                }
            }
            "mistral" => {
                assert_eq!(w.layers[0].q.shape, [256, 128]);
                assert_eq!(w.layers[0].o.shape, [128, 256]);
            }
            _ => {
                assert!(w.layers.iter().all(|l| l.q_bias.is_none()), "{case}");
                assert_ne!(w.lm_head.bytes().as_ptr(), w.embed.bytes().as_ptr(), "{case}");
            }
        }
    }
}

/// Splits a golden model into two shards plus an index; the result must be identical.
#[test]
fn sharded_copy_loads_identical_tensors() {
    let src = golden_dir("mixtral");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let mut weight_map = serde_json::Map::new();
    let half = names.len() / 2;
    for (k, part) in [&names[..half], &names[half..]].into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let views: Vec<_> = part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        std::fs::write(tmp.path().join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
        for n in part {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(tmp.path().join("model.safetensors.index.json"), index.to_string()).unwrap();

    let a = Model::load(&src).unwrap();
    let b = Model::load(tmp.path()).unwrap();
    assert_eq!(a.config, b.config);
    let flat = |m: &Model| -> Vec<(String, Vec<usize>, Vec<u8>)> {
        let w = &m.weights;
        let mut v = vec![&w.embed, &w.norm, &w.lm_head];
        for l in &w.layers {
            v.extend([&l.attn_norm, &l.q, &l.k, &l.v, &l.o, &l.ffn_norm]);
            if let Mlp::Moe { router, experts } = &l.mlp {
                v.push(router);
                for e in experts {
                    v.extend([&e.gate, &e.up, &e.down]);
                }
            }
        }
        v.into_iter().map(|t| (t.name.clone(), t.shape.clone(), t.bytes().to_vec())).collect()
    };
    let (fa, fb) = (flat(&a), flat(&b));
    assert_eq!(fa.len(), fb.len());
    assert_eq!(fa, fb);
    assert!(b.weights.embed.is_mapped());
}

// ---------------------------------------------------------------------------------------
// Small models written by the tests.

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn f32_bytes(n: usize, seed: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (((i * 7 + seed * 13) % 17) as f32 * 0.01).to_le_bytes()).collect()
}

/// A 2-layer llama: vocab 16, hidden 8, 2 heads of 4, 1 kv head, intermediate 12.
fn tiny_llama() -> (Value, Tensors) {
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": null,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "max_position_embeddings": 64,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32"
    });
    let mut t = Tensors::new();
    let mut add = |name: String, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let seed = t.len();
        t.insert(name, (Dtype::F32, shape, f32_bytes(n, seed)));
    };
    add("model.embed_tokens.weight".into(), vec![16, 8]);
    add("model.norm.weight".into(), vec![8]);
    add("lm_head.weight".into(), vec![16, 8]);
    for i in 0..2 {
        let p = format!("model.layers.{i}.");
        add(format!("{p}input_layernorm.weight"), vec![8]);
        add(format!("{p}post_attention_layernorm.weight"), vec![8]);
        add(format!("{p}self_attn.q_proj.weight"), vec![8, 8]);
        add(format!("{p}self_attn.k_proj.weight"), vec![4, 8]);
        add(format!("{p}self_attn.v_proj.weight"), vec![4, 8]);
        add(format!("{p}self_attn.o_proj.weight"), vec![8, 8]);
        add(format!("{p}mlp.gate_proj.weight"), vec![12, 8]);
        add(format!("{p}mlp.up_proj.weight"), vec![12, 8]);
        add(format!("{p}mlp.down_proj.weight"), vec![8, 12]);
    }
    (config, t)
}

fn st_bytes(t: &Tensors) -> Vec<u8> {
    let views: Vec<_> = t
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn write_model(dir: &Path, config: &Value, t: &Tensors) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    std::fs::write(dir.join("model.safetensors"), st_bytes(t)).unwrap();
}

/// Writes the model, loads it, and returns the error text.
fn load_err(config: &Value, t: &Tensors) -> String {
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), config, t);
    match Model::load(tmp.path()) {
        Ok(_) => panic!("loaded a broken model: {config}"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` should mention `{p}`");
    }
}

#[test]
fn tiny_model_loads() {
    let (c, t) = tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &c, &t);
    let m = Model::load(tmp.path()).unwrap();
    assert_eq!(m.config.head_dim, 4);
    assert_eq!(m.config.num_kv_heads, 1);
    assert_eq!(m.config.eos_token_ids, [2]);
    assert_eq!(m.weights.layers[1].k.shape, [4, 8]);
    assert_eq!(m.weights.layers[1].k.bytes(), &t["model.layers.1.self_attn.k_proj.weight"].2[..]);
    // Loading through config.json or the weights file works too.
    assert!(Model::load(&tmp.path().join("config.json")).is_ok());
    assert!(Model::load(&tmp.path().join("model.safetensors")).is_ok());
}

#[test]
fn eos_token_id_int_list_or_null() {
    for (eos, want) in [(json!(2), vec![2u32]), (json!([2, 7]), vec![2, 7]), (json!(null), vec![])] {
        let (mut c, t) = tiny_llama();
        c["eos_token_id"] = eos;
        let tmp = tempfile::tempdir().unwrap();
        write_model(tmp.path(), &c, &t);
        assert_eq!(Model::load(tmp.path()).unwrap().config.eos_token_ids, want);
    }
    let (mut c, t) = tiny_llama();
    c["eos_token_id"] = json!([2, 99]);
    assert_has(&load_err(&c, &t), &["eos_token_id", "99", "config.json"]);
    c["eos_token_id"] = json!("two");
    assert_has(&load_err(&c, &t), &["eos_token_id", "config.json"]);
}

#[test]
fn legacy_and_v5_rope_formats_resolve_the_same() {
    let (legacy, _) = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let mut legacy = legacy;
    legacy["rope_theta"] = json!(500000.0);
    legacy["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let mut v5 = legacy.clone();
    let o = v5.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.remove("torch_dtype");
    o.insert("dtype".into(), json!("float32"));
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    );
    let a = hf::parse_config(&legacy.to_string(), &path).unwrap();
    let b = hf::parse_config(&v5.to_string(), &path).unwrap();
    assert_eq!(a, b);
    assert!(matches!(a.rope_scaling, Some(RopeScaling::Llama3(s)) if s.factor == 8.0));
    // Old spelling `type` instead of `rope_type`.
    let mut old = legacy.clone();
    old["rope_scaling"].as_object_mut().unwrap().remove("rope_type");
    old["rope_scaling"]["type"] = json!("llama3");
    assert_eq!(hf::parse_config(&old.to_string(), &path).unwrap(), a);
    // Absent rope_theta defaults to 10000.
    let mut bare = legacy.clone();
    bare.as_object_mut().unwrap().remove("rope_theta");
    assert_eq!(hf::parse_config(&bare.to_string(), &path).unwrap().rope_theta, 10000.0);
}

// ---------------------------------------------------------------------------------------
// Bad input: an error naming the thing at fault, never a panic.

#[test]
fn missing_path_and_missing_config() {
    let e = Model::load(Path::new("/no/such/model/dir")).map(|_| ()).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert_has(&e.to_string(), &["/no/such/model/dir"]);

    let tmp = tempfile::tempdir().unwrap();
    let e = hf::load(tmp.path()).unwrap_err().to_string();
    assert_has(&e, &["config.json"]);

    // A config but no weights.
    let (c, _) = tiny_llama();
    std::fs::write(tmp.path().join("config.json"), c.to_string()).unwrap();
    let e = Model::load(tmp.path()).unwrap_err().to_string();
    assert_has(&e, &["model.safetensors", &tmp.path().display().to_string()]);
    std::fs::write(tmp.path().join("pytorch_model.bin"), b"x").unwrap();
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["safetensors only"]);
}

#[test]
fn config_that_is_not_json_or_not_an_object() {
    let (_, t) = tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &json!([1, 2]), &t);
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["config.json", "object"]);
    std::fs::write(tmp.path().join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let e = Model::load(tmp.path()).unwrap_err().to_string();
    assert_has(&e, &["config.json", "invalid JSON", "line 1"]);
    assert!(!e.contains("model_type"), "a truncated file is not blamed on a parameter: {e}");
}

#[test]
fn truncated_safetensors_at_every_point() {
    let (c, t) = tiny_llama();
    let full = st_bytes(&t);
    let header_end = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &c, &t);
    let file = tmp.path().join("model.safetensors");
    let cuts: Vec<usize> = (0..header_end + 16).chain((header_end + 16..full.len()).step_by(29)).collect();
    for cut in cuts {
        std::fs::write(&file, &full[..cut]).unwrap();
        match Model::load(tmp.path()) {
            Ok(_) => panic!("loaded a safetensors file cut at {cut} of {}", full.len()),
            Err(e) => assert_has(&e.to_string(), &["model.safetensors"]),
        }
    }
}

/// Writes a safetensors file with a hand-made header (values may lie) and `data_len` bytes.
fn raw_safetensors(header: &Value, data_len: usize) -> Vec<u8> {
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    out.extend(std::iter::repeat_n(0u8, data_len));
    out
}

fn load_raw(bytes: &[u8]) -> String {
    let (c, t) = tiny_llama();
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &c, &t);
    std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
    Model::load(tmp.path()).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn safetensors_header_lying_about_offsets_and_sizes() {
    let x = "model.embed_tokens.weight";
    let y = "model.norm.weight";
    // Data range beyond the end of the file.
    let e = load_raw(&raw_safetensors(
        &json!({x: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        y: {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}),
        20,
    ));
    assert_has(&e, &["model.safetensors", y, "outside"]);
    // Overlapping tensors.
    let e = load_raw(&raw_safetensors(
        &json!({x: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        y: {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}),
        24,
    ));
    assert_has(&e, &["model.safetensors", "overlaps"]);
    // Offsets that overflow, and a shape whose size overflows.
    let e = load_raw(&raw_safetensors(&json!({x: {"dtype": "F32", "shape": [4], "data_offsets": [0, u64::MAX]}}), 16));
    assert_has(&e, &["model.safetensors", x]);
    let e = load_raw(&raw_safetensors(
        &json!({x: {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 16]}}),
        16,
    ));
    assert_has(&e, &["model.safetensors", x]);
    // A header length far beyond the file.
    let mut b = raw_safetensors(&json!({}), 0);
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_has(&load_raw(&b), &["model.safetensors", "header"]);
    b[..8].copy_from_slice(&1000u64.to_le_bytes());
    assert_has(&load_raw(&b), &["model.safetensors", "header"]);
}

#[test]
fn wrong_length_tensor_names_it() {
    let x = "model.embed_tokens.weight";
    let e = load_raw(&raw_safetensors(&json!({x: {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 500]}}), 500));
    assert_has(&e, &["model.safetensors", x, "512"]);
}

#[test]
fn missing_tensor_names_it() {
    let (c, mut t) = tiny_llama();
    t.remove("model.layers.1.mlp.down_proj.weight");
    assert_has(&load_err(&c, &t), &["model.layers.1.mlp.down_proj.weight", "missing", "model.safetensors"]);
    let (c, mut t) = tiny_llama();
    t.remove("lm_head.weight");
    assert_has(&load_err(&c, &t), &["lm_head.weight"]);
}

#[test]
fn wrong_shape_names_tensor_expected_and_actual() {
    let (c, mut t) = tiny_llama();
    t.insert("model.layers.1.self_attn.k_proj.weight".into(), (Dtype::F32, vec![8, 8], f32_bytes(64, 0)));
    let e = load_err(&c, &t);
    assert_has(&e, &["model.layers.1.self_attn.k_proj.weight", "[4, 8]", "[8, 8]", "model.safetensors"]);
    let (c, mut t) = tiny_llama();
    t.insert("model.norm.weight".into(), (Dtype::F32, vec![1, 8], f32_bytes(8, 0)));
    assert_has(&load_err(&c, &t), &["model.norm.weight", "[8]", "[1, 8]"]);
    // Layer count in config larger than the file: the missing layer is named.
    let (mut c, t) = tiny_llama();
    c["num_hidden_layers"] = json!(3);
    assert_has(&load_err(&c, &t), &["model.layers.2."]);
}

#[test]
fn unused_tensors_are_an_error() {
    let (c, mut t) = tiny_llama();
    t.insert("model.layers.0.self_attn.o_proj.bias".into(), (Dtype::F32, vec![8], f32_bytes(8, 0)));
    assert_has(&load_err(&c, &t), &["model.layers.0.self_attn.o_proj.bias", "does not use"]);
}

#[test]
fn unsupported_architecture_and_dtype() {
    let (mut c, t) = tiny_llama();
    c["model_type"] = json!("gpt2");
    assert_has(&load_err(&c, &t), &["gpt2", "config.json"]);
    let (c, mut t) = tiny_llama();
    t.insert("model.norm.weight".into(), (Dtype::I64, vec![8], vec![0; 64]));
    assert_has(&load_err(&c, &t), &["model.norm.weight", "I64", "model.safetensors"]);
    let (mut c, t) = tiny_llama();
    c["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
    assert_has(&load_err(&c, &t), &["dynamic", "rope_type"]);
    let (mut c, t) = tiny_llama();
    c["hidden_act"] = json!("gelu");
    assert_has(&load_err(&c, &t), &["hidden_act", "gelu"]);
}

#[test]
fn bf16_and_f16_tensors_load_with_their_dtype() {
    let (c, mut t) = tiny_llama();
    for (name, d) in [("model.norm.weight", Dtype::BF16), ("lm_head.weight", Dtype::F16)] {
        let (_, shape, _) = t[name].clone();
        let n: usize = shape.iter().product();
        t.insert(name.into(), (d, shape, vec![0; 2 * n]));
    }
    let tmp = tempfile::tempdir().unwrap();
    write_model(tmp.path(), &c, &t);
    let m = Model::load(tmp.path()).unwrap();
    assert_eq!(m.weights.norm.dtype, DType::BF16);
    assert_eq!(m.weights.lm_head.dtype, DType::F16);
}

#[test]
fn config_values_out_of_range_name_the_parameter() {
    let (base, t) = tiny_llama();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("num_attention_heads", json!(0), "num_attention_heads"),
        ("num_key_value_heads", json!(0), "num_key_value_heads"),
        ("hidden_size", json!(0), "hidden_size"),
        ("vocab_size", json!(-5), "vocab_size"),
        ("intermediate_size", json!(1.5), "intermediate_size"),
        ("rope_theta", json!(-1.0), "rope_theta"),
        ("rope_theta", json!(0.0), "rope_theta"),
        ("rms_norm_eps", json!(-1e-5), "rms_norm_eps"),
        ("bos_token_id", json!(16), "bos_token_id"),
        ("num_hidden_layers", json!("two"), "num_hidden_layers"),
    ];
    for (key, v, want) in cases {
        let mut c = base.clone();
        c[key] = v.clone();
        let e = load_err(&c, &t);
        assert_has(&e, &[want, "config.json"]);
    }
    // 3 heads do not divide among 2 kv heads.
    let mut c = base.clone();
    c["num_attention_heads"] = json!(3);
    c["num_key_value_heads"] = json!(2);
    c["head_dim"] = json!(4);
    assert_has(&load_err(&c, &t), &["num_key_value_heads", "not divisible"]);
    // head_dim null and hidden 8 not divisible by 3 heads.
    let mut c = base.clone();
    c["num_attention_heads"] = json!(3);
    c["num_key_value_heads"] = json!(1);
    assert_has(&load_err(&c, &t), &["head_dim", "not divisible"]);
    // Missing required values.
    let mut c = base.clone();
    c.as_object_mut().unwrap().remove("hidden_size");
    assert_has(&load_err(&c, &t), &["hidden_size", "missing"]);
    // MoE without its counts.
    let mut c = base.clone();
    c["model_type"] = json!("mixtral");
    assert_has(&load_err(&c, &t), &["num_local_experts", "missing"]);
    c["num_local_experts"] = json!(2);
    c["num_experts_per_tok"] = json!(3);
    assert_has(&load_err(&c, &t), &["num_experts_per_tok"]);
}

#[test]
fn nan_and_infinity_in_config_name_the_parameter() {
    let (c, t) = tiny_llama();
    for bad in ["NaN", "Infinity", "-Infinity"] {
        let text = serde_json::to_string_pretty(&c)
            .unwrap()
            .replace("\"rope_theta\": 10000.0", &format!("\"rope_theta\": {bad}"));
        assert!(text.contains(bad));
        let tmp = tempfile::tempdir().unwrap();
        write_model(tmp.path(), &c, &t);
        std::fs::write(tmp.path().join("config.json"), text).unwrap();
        let e = Model::load(tmp.path()).map(|_| ()).unwrap_err().to_string();
        assert_has(&e, &["rope_theta", "config.json", bad]);
    }
}

fn write_sharded(dir: &Path) -> (Tensors, BTreeMap<String, String>) {
    let (c, t) = tiny_llama();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let names: Vec<&String> = t.keys().collect();
    let mut map = BTreeMap::new();
    for (k, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let sub: Tensors = part.iter().map(|n| ((*n).clone(), t[*n].clone())).collect();
        std::fs::write(dir.join(&file), st_bytes(&sub)).unwrap();
        for n in part {
            map.insert((*n).clone(), file.clone());
        }
    }
    (t, map)
}

fn write_index(dir: &Path, map: &BTreeMap<String, String>) {
    std::fs::write(dir.join("model.safetensors.index.json"), json!({"weight_map": map}).to_string()).unwrap();
}

#[test]
fn sharded_index_errors_name_the_shard_or_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (t, mut map) = write_sharded(tmp.path());
    // Shards without an index are not guessed at.
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["model.safetensors.index.json"]);
    write_index(tmp.path(), &map);
    let m = Model::load(tmp.path()).unwrap();
    assert_eq!(m.weights.layers[0].o.bytes(), &t["model.layers.0.self_attn.o_proj.weight"].2[..]);

    // Index naming a missing shard.
    map.insert("model.norm.weight".into(), "model-00003-of-00002.safetensors".into());
    write_index(tmp.path(), &map);
    assert_has(
        &Model::load(tmp.path()).unwrap_err().to_string(),
        &["model-00003-of-00002.safetensors", "does not exist", "model.norm.weight"],
    );
    // Index placing a tensor in the wrong (existing) shard.
    let other = |f: &str| {
        if f.starts_with("model-00001") {
            "model-00002-of-00002.safetensors".to_string()
        } else {
            "model-00001-of-00002.safetensors".to_string()
        }
    };
    let (_, mut map) = write_sharded(tmp.path());
    let f = other(&map["lm_head.weight"]);
    map.insert("lm_head.weight".into(), f.clone());
    write_index(tmp.path(), &map);
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["lm_head.weight", &f]);
    // Path traversal in a shard name.
    let (_, mut map) = write_sharded(tmp.path());
    map.insert("lm_head.weight".into(), "../x.safetensors".into());
    write_index(tmp.path(), &map);
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["../x.safetensors", "plain file name"]);
    // An index without weight_map.
    std::fs::write(tmp.path().join("model.safetensors.index.json"), "{}").unwrap();
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &["model.safetensors.index.json", "weight_map"]);
    // A wrong shape in shard 2 names shard 2.
    let (mut t2, map) = write_sharded(tmp.path());
    write_index(tmp.path(), &map);
    let victim = "model.layers.1.self_attn.v_proj.weight";
    let shard = map[victim].clone();
    t2.insert(victim.into(), (Dtype::F32, vec![8, 4], f32_bytes(32, 0)));
    let sub: Tensors = t2.iter().filter(|(n, _)| map[*n] == shard).map(|(n, v)| (n.clone(), v.clone())).collect();
    std::fs::write(tmp.path().join(&shard), st_bytes(&sub)).unwrap();
    assert_has(&Model::load(tmp.path()).unwrap_err().to_string(), &[victim, &shard, "[4, 8]", "[8, 4]"]);
}
