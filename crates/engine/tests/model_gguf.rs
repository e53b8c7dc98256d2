//! GGUF reader: real files from shared/models and hand-built broken files.

use std::path::{Path, PathBuf};

use tboost_engine::formats::gguf::{self, Value};
use tboost_engine::model::weights::{LayerWeights, Mlp};
use tboost_engine::model::{Arch, Model, ModelFormat, Tensor};
use tboost_engine::Error;
use tboost_ops::DType;
use tboost_ops::{RopeScaling, RopeStyle};
use tboost_testkit::model_files::gguf::Gguf;

fn models_dir() -> PathBuf {
    tboost_testkit::golden::shared_dir().join("models")
}

/// A shared model file, or a failure saying how to get it.
fn shared_model(name: &str) -> PathBuf {
    let p = models_dir().join(name);
    assert!(p.is_file(), "{} is missing: see shared/models/README.md for its origin and sha256", p.display());
    p
}

#[test]
fn read_metadata_of_llama2_tiny() {
    let md = gguf::read_metadata(&shared_model("llama-2-tiny-random.gguf")).unwrap();
    assert_eq!(md["general.architecture"].as_str(), Some("llama"));
    assert_eq!(md["llama.block_count"].as_u64(), Some(1));
    assert_eq!(md["llama.embedding_length"].as_u64(), Some(8));
    assert_eq!(md["llama.rope.dimension_count"].as_u64(), Some(4));
    assert_eq!(md["tokenizer.ggml.model"].as_str(), Some("llama"));
    let tokens = md["tokenizer.ggml.tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 32000);
    assert_eq!(tokens[1], Value::String("<s>".into()));
    assert_eq!(md["tokenizer.ggml.scores"].as_array().unwrap().len(), 32000);
    assert!(!md.contains_key("llama.rope.freq_base"));
}

#[test]
fn read_metadata_of_missing_file_names_it() {
    let p = Path::new("/nonexistent/dir/model.gguf");
    let e = gguf::read_metadata(p).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/dir/model.gguf"), "{e}");
}

#[test]
fn parse_directory_of_real_files() {
    for (name, n, version) in [("llama-2-tiny-random.gguf", 12, 3), ("stories260K-placeholder-vocab.gguf", 48, 3)] {
        let p = shared_model(name);
        let bytes = std::fs::read(&p).unwrap();
        let f = gguf::parse(&bytes, &p).unwrap();
        assert_eq!(f.tensors.len(), n, "{name}");
        assert_eq!(f.version, version, "{name}");
        assert_eq!(f.data_offset % f.alignment, 0);
        assert!(f.tensors.iter().all(|t| t.size.is_some()), "{name}: every tensor type is supported");
    }
}

// ---------------------------------------------------------------------------------------
// A GGUF writer for test files (valid or deliberately broken).

/// A 2-layer llama: vocab 16, hidden 32, 2 heads of 16, 1 kv head, ffn 32; F32.
fn tiny_gguf() -> Gguf {
    let u = Value::U32;
    let mut g = Gguf::new();
    g.set("general.architecture", Value::String("llama".into()));
    g.set("general.name", Value::String("tiny".into()));
    g.set("llama.block_count", u(2));
    g.set("llama.context_length", u(64));
    g.set("llama.embedding_length", u(32));
    g.set("llama.feed_forward_length", u(32));
    g.set("llama.attention.head_count", u(2));
    g.set("llama.attention.head_count_kv", u(1));
    g.set("llama.rope.dimension_count", u(16));
    g.set("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    g.set("tokenizer.ggml.model", Value::String("llama".into()));
    g.set("tokenizer.ggml.tokens", Value::Array((0..16).map(|i| Value::String(format!("t{i}"))).collect()));
    g.set("tokenizer.ggml.scores", Value::Array((0..16).map(|i| Value::F32(-(i as f32))).collect()));
    g.set("tokenizer.ggml.bos_token_id", u(1));
    g.set("tokenizer.ggml.eos_token_id", u(2));
    g.add_f32("token_embd.weight", &[32, 16]);
    for i in 0..2 {
        g.add_f32(&format!("blk.{i}.attn_norm.weight"), &[32]);
        g.add_f32(&format!("blk.{i}.attn_q.weight"), &[32, 32]);
        g.add_f32(&format!("blk.{i}.attn_k.weight"), &[32, 16]);
        g.add_f32(&format!("blk.{i}.attn_v.weight"), &[32, 16]);
        g.add_f32(&format!("blk.{i}.attn_output.weight"), &[32, 32]);
        g.add_f32(&format!("blk.{i}.ffn_norm.weight"), &[32]);
        g.add_f32(&format!("blk.{i}.ffn_gate.weight"), &[32, 32]);
        g.add_f32(&format!("blk.{i}.ffn_up.weight"), &[32, 32]);
        g.add_f32(&format!("blk.{i}.ffn_down.weight"), &[32, 32]);
    }
    g.add_f32("output_norm.weight", &[32]);
    g.add_f32("output.weight", &[32, 16]);
    g
}

fn load_err(g: &Gguf) -> (String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "model.gguf");
    match Model::load(&p) {
        Ok(_) => panic!("loaded a broken GGUF"),
        Err(e) => (e.to_string(), p.display().to_string()),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` should mention `{p}`");
    }
}

// ---------------------------------------------------------------------------------------
// Real files.

#[test]
fn llama2_tiny_gguf_loads_with_readme_config() {
    let p = shared_model("llama-2-tiny-random.gguf");
    let m = Model::load(&p).unwrap();
    let c = &m.config;
    assert_eq!(m.format, ModelFormat::Gguf);
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim),
        (1, 8, 32, 2, 2, 4, 4)
    );
    assert_eq!(c.vocab_size, 32000);
    assert_eq!(c.rope_theta, 10000.0, "no rope.freq_base key: default");
    assert_eq!(c.rms_eps as f32, 1e-5);
    assert_eq!(c.max_position_embeddings, 4096);
    assert_eq!((c.bos_token_id, c.eos_token_ids.as_slice()), (Some(1), &[2u32][..]));
    assert_eq!(c.rope_style, RopeStyle::Adjacent);
    assert_eq!(c.rope_scaling, None);
    assert!(!c.tie_word_embeddings && !c.qkv_bias);
    let w = &m.weights;
    assert_eq!(w.embed.shape, [32000, 8]);
    assert_eq!(w.lm_head.shape, [32000, 8]);
    assert_eq!(dense(&w.layers[0]).2.shape, [8, 32]);
    assert_eq!(w.layers[0].q.dtype, DType::F16);
    assert_eq!(w.layers[0].attn_norm.dtype, DType::F32);
    assert_eq!(w.norm.dtype, DType::F32);
    for t in w.tensors() {
        assert!(t.is_mapped(), "{} is copied", t.name);
    }
    // The views are the file's bytes at the directory's offsets.
    let bytes = std::fs::read(&p).unwrap();
    let f = gguf::parse(&bytes, &p).unwrap();
    let info = f.tensor("blk.0.attn_k.weight").unwrap();
    let start = (f.data_offset + info.offset) as usize;
    assert_eq!(w.layers[0].k.bytes(), &bytes[start..start + 8 * 8 * 2]);
    let md = m.gguf_metadata.as_ref().unwrap();
    assert_eq!(md["tokenizer.ggml.tokens"].as_array().unwrap().len(), 32000);
}

#[test]
fn stories260k_gguf_loads_with_readme_config() {
    let m = Model::load(&shared_model("stories260K-placeholder-vocab.gguf")).unwrap();
    let c = &m.config;
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim),
        (5, 64, 172, 8, 4, 8, 8)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (512, 128));
    assert_eq!(c.gqa_group(), 2);
    assert_eq!(c.rope_style, RopeStyle::Adjacent);
    assert!(!c.tie_word_embeddings, "output.weight is written out explicitly");
    let ts = m.weights.tensors();
    assert_eq!(ts.len(), 48);
    for t in ts {
        assert!(t.is_mapped(), "{}", t.name);
        assert_eq!(t.dtype, DType::F32, "{}", t.name);
    }
    assert_eq!(m.weights.layers[4].k.shape, [32, 64]);
    assert_eq!(dense(&m.weights.layers[4]).2.shape, [64, 172]);
}

fn dense(l: &LayerWeights) -> (&Tensor, &Tensor, &Tensor) {
    match &l.mlp {
        Mlp::Dense { gate, up, down } => (gate, up, down),
        Mlp::Moe { .. } => panic!("expected a dense MLP"),
    }
}

// ---------------------------------------------------------------------------------------
// Files written by the tests.

#[test]
fn tiny_gguf_loads_with_converted_shapes() {
    let g = tiny_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "model.gguf");
    let m = Model::load(&p).unwrap();
    let c = &m.config;
    assert_eq!((c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size), (32, 2, 1, 16, 16));
    let l = &m.weights.layers[1];
    // ne [32, 16] (16 rows of 32 columns) becomes [16, 32].
    assert_eq!(l.k.shape, [16, 32]);
    assert_eq!(l.k.bytes(), &g.tensors.iter().find(|t| t.name == "blk.1.attn_k.weight").unwrap().data[..]);
    assert_eq!(m.weights.embed.shape, [16, 32]);
    assert!(m.weights.tensors().iter().all(|t| t.is_mapped()));

    // Without a vocabulary the size comes from `{arch}.vocab_size`, else the embedding rows.
    let mut g = tiny_gguf();
    g.remove("tokenizer.ggml.tokens");
    let m = Model::load(&g.write(tmp.path(), "model.gguf")).unwrap();
    assert_eq!(m.config.vocab_size, 16);
    g.set("llama.vocab_size", Value::U32(20));
    assert_has(&load_err(&g).0, &["token_embd.weight", "[20, 32]", "[16, 32]"]);
}

#[test]
fn moe_expert_stacks_become_zero_copy_views() {
    let mut g = tiny_gguf();
    g.set("llama.expert_count", Value::U32(3));
    g.set("llama.expert_used_count", Value::U32(2));
    for i in 0..2 {
        g.tensors.retain(|t| !t.name.starts_with(&format!("blk.{i}.ffn_")) || t.name.ends_with("norm.weight"));
        g.add_f32(&format!("blk.{i}.ffn_gate_inp.weight"), &[32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_gate_exps.weight"), &[32, 32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_up_exps.weight"), &[32, 32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_down_exps.weight"), &[32, 32, 3]);
    }
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "model.gguf");
    let m = Model::load(&p).unwrap();
    assert_eq!(m.config.arch, Arch::Mixtral, "llama + expert_count is Mixtral");
    assert_eq!((m.config.num_experts, m.config.experts_per_token), (3, 2));
    let Mlp::Moe { router, experts } = &m.weights.layers[1].mlp else { panic!("dense") };
    assert_eq!(router.shape, [3, 32]);
    assert_eq!(experts.len(), 3);
    let stack = &g.tensors.iter().find(|t| t.name == "blk.1.ffn_up_exps.weight").unwrap().data;
    let each = 32 * 32 * 4;
    for (e, x) in experts.iter().enumerate() {
        assert_eq!(x.up.shape, [32, 32]);
        assert!(x.up.is_mapped());
        assert_eq!(x.up.bytes(), &stack[e * each..(e + 1) * each], "expert {e}");
    }
    assert_eq!(experts[2].down.bytes().as_ptr() as usize - experts[1].down.bytes().as_ptr() as usize, each);

    // A stack with the wrong expert count names the tensor.
    let mut bad = g.clone();
    bad.set("llama.expert_count", Value::U32(4));
    let (e, _) = load_err(&bad);
    assert_has(&e, &["blk.0.ffn_gate_exps.weight", "4 experts", "[3, 32, 32]"]);
    let mut bad = g.clone();
    bad.tensor_mut("blk.0.ffn_gate_exps.weight").ne = vec![32, 24, 4];
    bad.tensor_mut("blk.0.ffn_gate_exps.weight").data.truncate(32 * 24 * 4 * 4);
    let (e, _) = load_err(&bad);
    assert_has(&e, &["blk.0.ffn_gate_exps.weight", "3 experts"]);
}

#[test]
fn qwen2_gguf_is_half_split_with_biases_and_tied_output() {
    let mut g = tiny_gguf();
    for (k, _) in &mut g.kv {
        *k = k.replace("llama.", "qwen2.");
    }
    g.set("general.architecture", Value::String("qwen2".into()));
    g.tensors.retain(|t| t.name != "output.weight");
    for i in 0..2 {
        g.add_f32(&format!("blk.{i}.attn_q.bias"), &[32]);
        g.add_f32(&format!("blk.{i}.attn_k.bias"), &[16]);
        g.add_f32(&format!("blk.{i}.attn_v.bias"), &[16]);
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&g.write(tmp.path(), "model.gguf")).unwrap();
    assert_eq!(m.config.arch, Arch::Qwen2);
    assert_eq!(m.config.rope_style, RopeStyle::HalfSplit);
    assert!(m.config.qkv_bias && m.config.tie_word_embeddings);
    assert_eq!(m.weights.layers[0].k_bias.as_ref().unwrap().shape, [16]);
    assert_eq!(m.weights.lm_head.bytes().as_ptr(), m.weights.embed.bytes().as_ptr());

    // A bias of the wrong length.
    let mut bad = g.clone();
    bad.tensor_mut("blk.1.attn_v.bias").ne = vec![8];
    bad.tensor_mut("blk.1.attn_v.bias").data.truncate(32);
    assert_has(&load_err(&bad).0, &["blk.1.attn_v.bias", "[16]", "[8]"]);
    // A missing bias.
    let mut bad = g.clone();
    bad.tensors.retain(|t| t.name != "blk.1.attn_k.bias");
    assert_has(&load_err(&bad).0, &["blk.1.attn_k.bias", "missing"]);
}

#[test]
fn quantized_and_half_tensors_load_with_their_dtype() {
    let mut g = tiny_gguf();
    // Q8_0: 32 values in 34 bytes; 32 rows of 32 columns.
    let q = g.tensor_mut("blk.0.attn_q.weight");
    q.ty = 8;
    q.data = vec![0; 32 * 34];
    let o = g.tensor_mut("blk.0.attn_output.weight");
    o.ty = 1;
    o.data = vec![0; 32 * 32 * 2];
    let e = g.tensor_mut("token_embd.weight");
    e.ty = 30;
    e.data = vec![0; 16 * 32 * 2];
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&g.write(tmp.path(), "model.gguf")).unwrap();
    assert_eq!(m.weights.layers[0].q.dtype, DType::Q8_0);
    assert_eq!(m.weights.layers[0].q.shape, [32, 32]);
    assert_eq!(m.weights.layers[0].o.dtype, DType::F16);
    assert_eq!(m.weights.embed.dtype, DType::BF16);

    // Q4_K rows must hold whole 256-value blocks.
    let mut bad = tiny_gguf();
    let q = bad.tensor_mut("blk.0.attn_q.weight");
    q.ty = 12;
    q.data = vec![0; 144 * 4];
    assert_has(&load_err(&bad).0, &["blk.0.attn_q.weight", "Q4_K", "blocks"]);
    // Norms must be dense.
    let mut bad = tiny_gguf();
    let n = bad.tensor_mut("blk.1.ffn_norm.weight");
    n.ty = 8;
    n.data = vec![0; 34];
    assert_has(&load_err(&bad).0, &["blk.1.ffn_norm.weight", "q8_0", "f32, f16 or bf16"]);
}

#[test]
fn llama3_rope_scaling_keys_are_read() {
    let mut g = tiny_gguf();
    g.set("llama.rope.freq_base", Value::F32(500000.0));
    g.set("llama.rope.scaling.type", Value::String("llama3".into()));
    g.set("llama.rope.scaling.factor", Value::F32(8.0));
    g.set("llama.rope.scaling.original_context_length", Value::U32(64));
    let tmp = tempfile::tempdir().unwrap();
    let m = Model::load(&g.write(tmp.path(), "model.gguf")).unwrap();
    assert_eq!(m.config.rope_theta, 500000.0);
    let Some(RopeScaling::Llama3(s)) = m.config.rope_scaling else { panic!("llama3 scaling missing") };
    assert_eq!(
        (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings),
        (8.0, 1.0, 4.0, 64.0)
    );

    // llama.cpp's own llama3 form (a frequency-factor tensor) is refused clearly.
    let mut g = tiny_gguf();
    g.add_f32("rope_freqs.weight", &[8]);
    assert_has(&load_err(&g).0, &["rope_freqs.weight", "not supported"]);
    // Other scaling types are refused.
    let mut g = tiny_gguf();
    g.set("llama.rope.scaling.type", Value::String("dynamic".into()));
    assert_has(&load_err(&g).0, &["llama.rope.scaling.type", "dynamic"]);
}

// ---------------------------------------------------------------------------------------
// Bad input: an error naming the thing at fault, never a panic.

#[test]
fn not_a_gguf_file_and_empty_file() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("notes.txt");
    std::fs::write(&p, "hello, this is not a model").unwrap();
    let e = Model::load(&p).unwrap_err().to_string();
    assert_has(&e, &["notes.txt", "not a GGUF file"]);
    let p = tmp.path().join("empty.gguf");
    std::fs::write(&p, b"").unwrap();
    assert_has(&Model::load(&p).unwrap_err().to_string(), &["empty.gguf", "truncated"]);
    assert_has(&gguf::read_metadata(&p).unwrap_err().to_string(), &["empty.gguf", "truncated"]);
    let e = Model::load(Path::new("/no/such/model.gguf")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }));
    assert_has(&e.to_string(), &["/no/such/model.gguf"]);
}

#[test]
fn truncated_gguf_at_every_point() {
    let (full, layout) = tiny_gguf().build_sections();
    let p = Path::new("cut.gguf");
    for cut in 0..full.len() {
        match gguf::parse(&full[..cut], p) {
            Ok(_) => panic!("parsed a file cut at {cut} of {} ({layout:?})", full.len()),
            Err(e) => assert_has(&e.to_string(), &["cut.gguf"]),
        }
    }
    assert!(gguf::parse(&full, p).is_ok());
    // Through the loader, cut in each section.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.gguf");
    for (cut, section) in [
        (3, "magic"),
        (10, "version / counts"),
        (layout.metadata_start + 5, "metadata key"),
        (layout.infos_start - 7, "metadata value"),
        (layout.infos_start + 20, "tensor info"),
        (layout.data_start + 100, "tensor data"),
        (full.len() - 1, "last byte"),
    ] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let e = Model::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("model.gguf") && e.contains("truncated"), "cut in the {section}: {e}");
    }
    // Metadata alone still reads when only the tensor data is cut.
    std::fs::write(&path, &full[..layout.data_start + 100]).unwrap();
    assert!(gguf::read_metadata(&path).is_ok());
}

/// Replaces the 8 bytes at `pos`.
fn patch_u64(bytes: &mut [u8], pos: usize, v: u64) {
    bytes[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
}

fn parse_err(bytes: &[u8]) -> String {
    match gguf::parse(bytes, Path::new("lying.gguf")) {
        Ok(_) => panic!("parsed a lying file"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn gguf_header_lying_about_counts_and_lengths() {
    let (full, layout) = tiny_gguf().build_sections();
    // Tensor and metadata counts far beyond the file: refused before any allocation.
    let mut b = full.clone();
    patch_u64(&mut b, 8, u64::MAX);
    assert_has(&parse_err(&b), &["lying.gguf", "tensor count"]);
    let mut b = full.clone();
    patch_u64(&mut b, 16, u64::MAX / 2);
    assert_has(&parse_err(&b), &["lying.gguf", "metadata count"]);
    // The first key's length.
    let mut b = full.clone();
    patch_u64(&mut b, layout.metadata_start, 1 << 40);
    assert_has(&parse_err(&b), &["lying.gguf", "metadata key #0"]);
    // An array's length (tokenizer.ggml.tokens), found by its key.
    let key = b"tokenizer.ggml.tokens";
    let at = full.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 4;
    let mut b = full.clone();
    patch_u64(&mut b, at, u64::MAX / 8);
    assert_has(&parse_err(&b), &["lying.gguf", "tokenizer.ggml.tokens"]);
    // A string element's length inside that array.
    let mut b = full.clone();
    patch_u64(&mut b, at + 8, u64::MAX);
    assert_has(&parse_err(&b), &["lying.gguf", "tokenizer.ggml.tokens"]);
    // read_metadata applies the same limits.
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("lying.gguf");
    std::fs::write(&p, &b).unwrap();
    assert_has(&gguf::read_metadata(&p).unwrap_err().to_string(), &["lying.gguf", "tokenizer.ggml.tokens"]);
}

#[test]
fn gguf_header_lying_about_tensor_offsets_and_dims() {
    let name = "blk.0.attn_k.weight";
    // Beyond the end of the file.
    let mut g = tiny_gguf();
    g.tensor_mut(name).offset_override = Some(1 << 20);
    assert_has(&load_err(&g).0, &[name, "beyond the end"]);
    // offset + size overflows u64.
    let mut g = tiny_gguf();
    g.tensor_mut(name).offset_override = Some(u64::MAX - 31);
    assert_has(&load_err(&g).0, &[name, "beyond the end"]);
    let mut g = tiny_gguf();
    let last = g.tensors.len() - 1;
    let (b, _) = g.build();
    let data_len = b.len() as u64;
    g.tensors[last].offset_override = Some(data_len / 32 * 32 - 32);
    assert_has(&load_err(&g).0, &["output.weight", "beyond the end"]);
    // Overlapping another tensor.
    let mut g = tiny_gguf();
    g.tensor_mut(name).offset_override = Some(0);
    assert_has(&load_err(&g).0, &["overlaps", "token_embd.weight"]);
    // Not aligned.
    let mut g = tiny_gguf();
    g.tensor_mut(name).offset_override = Some(4);
    assert_has(&load_err(&g).0, &[name, "alignment"]);
    // Dims whose product overflows.
    let mut g = tiny_gguf();
    g.tensor_mut(name).ne = vec![1 << 40, 1 << 40];
    assert_has(&load_err(&g).0, &[name, "overflow"]);
    // Too many dims, a zero dim.
    let mut g = tiny_gguf();
    g.tensor_mut(name).ne = vec![1, 1, 1, 1, 512];
    assert_has(&load_err(&g).0, &[name, "5 dimensions"]);
    let mut g = tiny_gguf();
    g.tensor_mut(name).ne = vec![32, 0];
    assert_has(&load_err(&g).0, &[name, "dimension 1 is 0"]);
    // A tensor listed twice.
    let mut g = tiny_gguf();
    let dup = g.tensor_mut(name).clone();
    g.tensors.push(dup);
    assert_has(&load_err(&g).0, &[name, "twice"]);
    // Bad alignment value.
    let mut g = tiny_gguf();
    g.set("general.alignment", Value::U32(3));
    assert_has(&load_err(&g).0, &["general.alignment", "power of two"]);
}

#[test]
fn gguf_malformed_metadata() {
    let (full, layout) = tiny_gguf().build_sections();
    // Magic, versions.
    let mut b = full.clone();
    b[0] = b'X';
    assert_has(&parse_err(&b), &["lying.gguf", "not a GGUF file"]);
    for (v, want) in [(1u32, "version 1"), (3u32.swap_bytes(), "big-endian"), (7, "version 7")] {
        let mut b = full.clone();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert_has(&parse_err(&b), &["lying.gguf", want]);
    }
    // An unknown value type for the first key ("general.architecture").
    let first_type = layout.metadata_start + 8 + "general.architecture".len();
    let mut b = full.clone();
    b[first_type..first_type + 4].copy_from_slice(&99u32.to_le_bytes());
    assert_has(&parse_err(&b), &["general.architecture", "unknown value type 99"]);
    // Duplicate keys, bad bools, nesting too deep.
    let mut g = tiny_gguf();
    g.kv.push(("general.name".into(), Value::String("again".into())));
    assert_has(&load_err(&g).0, &["general.name", "twice"]);
    let mut g = tiny_gguf();
    g.set("x.flag", Value::Bool(true));
    let (mut b, _) = g.build();
    let key = b"x.flag";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    b[at] = 2;
    assert_has(&parse_err(&b), &["x.flag", "bool"]);
    let mut deep = Value::U8(1);
    for _ in 0..12 {
        deep = Value::Array(vec![deep]);
    }
    let mut g = tiny_gguf();
    g.set("x.deep", deep);
    assert_has(&load_err(&g).0, &["x.deep", "nested"]);
    // Nested arrays within the limit are fine, and readable.
    let mut g = tiny_gguf();
    g.set("x.nested", Value::Array(vec![Value::Array(vec![Value::I16(-3), Value::I16(4)]), Value::Array(vec![])]));
    let tmp = tempfile::tempdir().unwrap();
    let md = gguf::read_metadata(&g.write(tmp.path(), "model.gguf")).unwrap();
    let n = md["x.nested"].as_array().unwrap();
    assert_eq!(n[0].as_array().unwrap()[0].as_i64(), Some(-3));
    assert_eq!(n[1].as_array().unwrap().len(), 0);
}

#[test]
fn unsupported_tensor_type_is_named() {
    let mut g = tiny_gguf();
    let q = g.tensor_mut("blk.0.attn_q.weight");
    // IQ2_XXS: 256 values in 66 bytes; Q4_1 (the type this test used) is supported now.
    q.ty = 16;
    q.data = vec![0; 32 * 32 / 256 * 66];
    let (e, path) = load_err(&g);
    assert_has(&e, &[&path, "tensor `blk.0.attn_q.weight` has GGUF type IQ2_XXS (16), which tboost does not support"]);
    // The metadata of such a file is still readable (for its tokenizer).
    let tmp = tempfile::tempdir().unwrap();
    assert!(gguf::read_metadata(&g.write(tmp.path(), "model.gguf")).is_ok());
    let mut g = tiny_gguf();
    g.tensor_mut("output.weight").ty = 77;
    assert_has(&load_err(&g).0, &["output.weight", "unknown (77)"]);
}

#[test]
fn unsupported_architecture_is_named() {
    let mut g = tiny_gguf();
    g.set("general.architecture", Value::String("gpt2".into()));
    assert_has(&load_err(&g).0, &["general.architecture", "gpt2"]);
    let mut g = tiny_gguf();
    g.remove("general.architecture");
    assert_has(&load_err(&g).0, &["general.architecture", "missing"]);
}

#[test]
fn missing_wrong_shape_and_unused_tensors_are_named() {
    let mut g = tiny_gguf();
    g.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let (e, path) = load_err(&g);
    assert_has(&e, &[&path, "blk.1.ffn_up.weight", "missing"]);

    let mut g = tiny_gguf();
    let k = g.tensor_mut("blk.1.attn_k.weight");
    k.ne = vec![32, 32];
    k.data = vec![0; 32 * 32 * 4];
    let (e, path) = load_err(&g);
    assert_has(&e, &[&path, "blk.1.attn_k.weight", "expected shape [16, 32]", "got [32, 32]"]);

    // The embedding has more rows than the vocabulary has tokens.
    let mut g = tiny_gguf();
    let t = g.tensor_mut("token_embd.weight");
    t.ne = vec![32, 20];
    t.data = vec![0; 20 * 32 * 4];
    assert_has(&load_err(&g).0, &["token_embd.weight", "[16, 32]", "[20, 32]"]);

    let mut g = tiny_gguf();
    g.add_f32("blk.0.attn_output.bias", &[32]);
    assert_has(&load_err(&g).0, &["blk.0.attn_output.bias", "does not use"]);
}

#[test]
fn config_out_of_range_names_the_key() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("llama.attention.head_count", Value::U32(0), "config `llama.attention.head_count`"),
        ("llama.attention.head_count_kv", Value::U32(0), "config `llama.attention.head_count_kv`"),
        ("llama.rope.freq_base", Value::F32(-1.0), "config `llama.rope.freq_base`"),
        ("llama.rope.freq_base", Value::F32(f32::NAN), "config `llama.rope.freq_base`"),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(f32::INFINITY),
            "config `llama.attention.layer_norm_rms_epsilon`",
        ),
        ("llama.rope.dimension_count", Value::U32(17), "config `llama.rope.dimension_count`"),
        ("llama.block_count", Value::String("two".into()), "config `llama.block_count`"),
        ("llama.block_count", Value::I32(-2), "config `llama.block_count`"),
        ("llama.attention.head_count_kv", Value::Array(vec![Value::U32(1), Value::U32(1)]), "per-layer"),
        ("tokenizer.ggml.eos_token_id", Value::U32(16), "config `tokenizer.ggml.eos_token_id`"),
        ("tokenizer.ggml.tokens", Value::U32(16), "config `tokenizer.ggml.tokens`"),
    ];
    for (key, v, want) in cases {
        let mut g = tiny_gguf();
        g.set(key, v.clone());
        let (e, path) = load_err(&g);
        assert_has(&e, &[want, &path]);
    }
    // 3 heads over 2 kv heads.
    let mut g = tiny_gguf();
    g.set("llama.attention.head_count", Value::U32(3));
    g.set("llama.attention.head_count_kv", Value::U32(2));
    g.set("llama.attention.key_length", Value::U32(16));
    assert_has(&load_err(&g).0, &["llama.attention.head_count_kv", "not divisible"]);
    // No key_length and embedding_length not divisible by head_count.
    let mut g = tiny_gguf();
    g.set("llama.attention.head_count", Value::U32(3));
    g.set("llama.attention.head_count_kv", Value::U32(1));
    assert_has(&load_err(&g).0, &["llama.attention.key_length", "not divisible"]);
    // Required keys.
    for key in [
        "llama.block_count",
        "llama.embedding_length",
        "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon",
    ] {
        let mut g = tiny_gguf();
        g.remove(key);
        assert_has(&load_err(&g).0, &[key, "missing"]);
    }
}
