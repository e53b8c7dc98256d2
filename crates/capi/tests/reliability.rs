//! Regression tests of issue 11: no model file may abort, hang or poison the host. Each
//! test generates its file (GGUF written here, Hugging Face directories in a tempdir around
//! the shared golden checkpoints, FIFOs made with mkfifo), loads it through the Rust API and
//! the C ABI with a time budget, and asserts the clear error: the file, the field and the
//! value. That the test process is still running at the end is the "process survives" part.

use tboost_testkit::model_files;

use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::null_mut;
use std::time::Duration;

use ::tboost_engine::engine::{Engine, EngineConfig, KvSize};
use ::tboost_engine::formats::gguf::Value;
use ::tboost_engine::formats::limits;
use ::tboost_engine::model::Model;
use ::tboost_engine::sched::Request;
use ::tboost_engine::tokenizer::{ChatTemplate, Tokenizer};
use model_files::gguf::{tiny_llama, tiny_moe, Shape, TINY};
use model_files::{assert_has, bounded, hf, load_error, mkfifo, Outcome, LOAD_BUDGET};
use serde_json::json;
use tboost::{tboost_last_error, tboost_model_free, tboost_model_load, tboost_status};

const BIG: [u64; 5] = [1 << 40, 1 << 58, (1 << 62) + 2, u64::MAX - 1, u64::MAX];

// ---------------------------------------------------------------------------------------
// 1. One metadata value must not become a giant allocation.

#[test]
fn gguf_block_count_of_2_pow_40_is_a_clear_error_not_an_abort() {
    for v in BIG {
        let mut g = tiny_llama(TINY);
        g.set("llama.block_count", Value::U64(v));
        let tmp = tempfile::tempdir().unwrap();
        let p = g.write(tmp.path(), "model.gguf");
        let e = load_error(&p, &format!("block_count = {v}"));
        assert_has(&e, &[&p.display().to_string(), "llama.block_count", &v.to_string(), "limit"]);
    }
}

#[test]
fn hf_num_hidden_layers_of_2_pow_40_is_a_clear_error_not_an_abort() {
    for v in BIG {
        let mut c = hf::golden_config("llama_gqa");
        c["num_hidden_layers"] = json!(v);
        let tmp = hf::dir_with_config("llama_gqa", &c);
        let e = load_error(tmp.path(), &format!("num_hidden_layers = {v}"));
        assert_has(&e, &["config.json", "num_hidden_layers", &v.to_string(), "limit"]);
    }
}

/// Every capped GGUF key, at the cap + 1 and at the values of the adversarial pass.
#[test]
fn every_gguf_size_key_is_capped_with_its_name() {
    let caps: [(&str, usize); 7] = [
        ("llama.block_count", limits::MAX_LAYERS),
        ("llama.attention.head_count", limits::MAX_HEADS),
        ("llama.attention.head_count_kv", limits::MAX_KV_HEADS),
        ("llama.attention.key_length", limits::MAX_HEAD_DIM),
        ("llama.embedding_length", limits::MAX_HIDDEN),
        ("llama.feed_forward_length", limits::MAX_INTERMEDIATE),
        ("llama.context_length", limits::MAX_CONTEXT),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (key, cap) in caps {
        for v in [cap as u64 + 1, 1 << 40, (1 << 62) + 2] {
            let mut g = tiny_llama(TINY);
            g.set(key, Value::U64(v));
            let p = g.write(tmp.path(), "model.gguf");
            let e = load_error(&p, &format!("{key} = {v}"));
            assert_has(&e, &[key, &v.to_string(), "limit"]);
        }
    }
    // MoE counts: a llama with experts is Mixtral.
    for (key, cap) in
        [("llama.expert_count", limits::MAX_EXPERTS), ("llama.expert_used_count", limits::MAX_EXPERTS_PER_TOKEN)]
    {
        let mut g = tiny_llama(TINY);
        g.set("llama.expert_count", Value::U32(4));
        g.set("llama.expert_used_count", Value::U32(2));
        if key == "llama.expert_count" {
            g.set(key, Value::U64(cap as u64 + 1));
        } else {
            // Used count above the cap but not above the expert count.
            g.set("llama.expert_count", Value::U64(limits::MAX_EXPERTS as u64));
            g.set(key, Value::U64(cap as u64 + 1));
        }
        let p = g.write(tmp.path(), "model.gguf");
        let e = load_error(&p, key);
        assert_has(&e, &[key, &(cap + 1).to_string(), "limit"]);
    }
}

/// GGUF structure counts and lengths are capped before anything proportional is allocated.
#[test]
fn gguf_counts_and_lengths_above_their_caps_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let g = tiny_llama(TINY);
    let (bytes, fields) = g.build();
    let at = |what: &str| fields.iter().find(|f| f.what == what).unwrap_or_else(|| panic!("no field {what}")).pos;
    let cases: Vec<(usize, u64, &str)> = vec![
        (at("tensor count"), limits::MAX_TENSORS as u64 + 1, "the tensor count"),
        (at("metadata count"), limits::MAX_METADATA_KEYS as u64 + 1, "the metadata count"),
        (at("length of key `general.name`"), limits::MAX_STRING_BYTES as u64 + 1, "the length of metadata key"),
        (at("length of `tokenizer.ggml.tokens`"), limits::MAX_ARRAY_LEN as u64 + 1, "tokenizer.ggml.tokens"),
        (at("length of `tokenizer.ggml.tokens`"), 1 << 62, "tokenizer.ggml.tokens"),
        (at("length of `tokenizer.ggml.tokens`[0]"), u64::MAX, "tokenizer.ggml.tokens"),
        (at("length of tensor name `token_embd.weight`"), 1 << 40, "tensor #0"),
    ];
    for (pos, v, want) in cases {
        let mut b = bytes.clone();
        b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
        let p = tmp.path().join("model.gguf");
        std::fs::write(&p, &b).unwrap();
        let e = load_error(&p, want);
        assert_has(&e, &[&p.display().to_string(), want, &v.to_string()]);
    }
}

// ---------------------------------------------------------------------------------------
// 2. Products of sizes must not wrap.

/// `head_count = 2^62+2`, `key_length = 4`: the q width (2^62+2)*4 wraps to 8 in u64, so a
/// file whose q/k/v/o tensors are 8 wide used to load, plan and then run 2^62 attention
/// items. Now the head count is refused by name.
#[test]
fn wrapping_head_count_times_key_length_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // hidden 8, q/kv width 8 = the wrapped product.
    let s = Shape { vocab: 16, hidden: 8, layers: 1, q_rows: 8, kv_rows: 8, ffn: 8 };
    let heads: u64 = (1 << 62) + 2;
    for (kv_heads, key_length) in [(heads, 4u64), (2, 4), (heads, 1 << 62)] {
        let mut g = tiny_llama(s);
        g.set("llama.attention.head_count", Value::U64(heads));
        g.set("llama.attention.head_count_kv", Value::U64(kv_heads));
        g.set("llama.attention.key_length", Value::U64(key_length));
        g.set("llama.rope.dimension_count", Value::U32(4));
        let p = g.write(tmp.path(), "model.gguf");
        let e = load_error(&p, &format!("heads {heads} kv {kv_heads} key_length {key_length}"));
        assert_has(&e, &[&p.display().to_string(), "limit"]);
        assert!(e.contains("head_count") || e.contains("key_length"), "{e}");
    }
    // The same through an HF config.
    let mut c = hf::golden_config("llama_gqa");
    c["num_attention_heads"] = json!(heads);
    c["num_key_value_heads"] = json!(heads);
    c["head_dim"] = json!(4);
    let dir = hf::dir_with_config("llama_gqa", &c);
    let e = load_error(dir.path(), "HF heads 2^62+2");
    assert_has(&e, &["config.json", "num_attention_heads", &heads.to_string(), "limit"]);
}

/// A model at the edge of the caps that does load also plans and runs a step: the caps are
/// a promise to the kernels, not just to the loader. (Heads × head_dim at the cap with a
/// hidden size of 16 keeps the file small.)
#[test]
fn a_model_with_many_heads_loads_plans_and_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let heads = 256u64;
    let hd = 16u64;
    let s = Shape { vocab: 16, hidden: 16, layers: 1, q_rows: heads * hd, kv_rows: hd, ffn: 16 };
    let mut g = tiny_llama(s);
    g.set("llama.attention.head_count", Value::U64(heads));
    g.set("llama.attention.head_count_kv", Value::U32(1));
    g.set("llama.attention.key_length", Value::U64(hd));
    g.set("llama.rope.dimension_count", Value::U64(hd));
    let p = g.write(tmp.path(), "model.gguf");
    let out = bounded(LOAD_BUDGET, move || {
        let e = Engine::new(EngineConfig { threads: 1, kv_size: KvSize::Blocks(8), ..Default::default() }).unwrap();
        e.load(&p).map_err(|e| e.to_string())?;
        let id = e.enqueue(Request::new(vec![1, 2, 3], 2)).map_err(|e| e.to_string())?;
        e.run_to_completion().map_err(|e| e.to_string())?;
        Ok::<_, String>(e.output(id).map_err(|e| e.to_string())?.tokens.len())
    });
    match out {
        Outcome::Done(Ok(n)) => assert!((1..=2).contains(&n), "{n} tokens"),
        other => panic!("256 heads x 16 over a 1-kv-head model: {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Fuzz findings.

/// Found by `fuzz_gguf` (case seed 0xa816677f9b1dece7: "set type of
/// blk.0.ffn_up_exps.weight to 6"): an MoE expert whose gate is f32 and whose up is Q5_0
/// reached the fused SwiGLU kernel, which panicked on the first step. The MoE kernel now
/// runs such a pair as two matmuls.
#[test]
fn moe_experts_with_gate_and_up_of_different_dtypes_run_a_step() {
    let mut g = tiny_moe();
    let up = g.tensor_mut("blk.0.ffn_up_exps.weight");
    up.ty = 6; // Q5_0: 22 bytes per 32 values.
    up.data = vec![0; 3 * 32 * 22];
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "moe.gguf");
    let out = bounded(LOAD_BUDGET, move || {
        let e = Engine::new(EngineConfig { threads: 1, kv_size: KvSize::Blocks(8), ..Default::default() }).unwrap();
        e.load(&p).map_err(|e| e.to_string())?;
        let id =
            e.enqueue(Request { ignore_eos: true, ..Request::new(vec![1, 5, 7], 2) }).map_err(|e| e.to_string())?;
        e.run_to_completion().map_err(|e| e.to_string())?;
        Ok::<_, String>(e.output(id).map_err(|e| e.to_string())?.tokens)
    });
    match out {
        Outcome::Done(Ok(tokens)) => assert_eq!(tokens.len(), 2, "{tokens:?}"),
        other => panic!("MoE with an f32 gate and a Q5_0 up: {other:?}"),
    }
}

/// The same pair in a dense layer: the fused SwiGLU kernel does not take it, so the mapping
/// table asks the backend, falls back to separate gate/up matmuls for that layer (and says
/// so), and a step runs.
#[test]
fn dense_gate_and_up_of_different_dtype_families_fall_back_to_two_matmuls() {
    let mut g = tiny_llama(TINY);
    let up = g.tensor_mut("blk.1.ffn_up.weight");
    up.ty = 6;
    up.data = vec![0; 32 * 22];
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "dense.gguf");
    let out = bounded(LOAD_BUDGET, move || {
        let e = Engine::new(EngineConfig { threads: 1, kv_size: KvSize::Blocks(8), ..Default::default() }).unwrap();
        e.load(&p).map_err(|e| e.to_string())?;
        let plan = e.plan().map_err(|e| e.to_string())?;
        let mlp = |l: usize| plan.layers[l].get(::tboost_engine::plan::Slot::Mlp).map(|d| (d.choice, d.reason.clone()));
        let id =
            e.enqueue(Request { ignore_eos: true, ..Request::new(vec![1, 5, 7], 2) }).map_err(|e| e.to_string())?;
        e.run_to_completion().map_err(|e| e.to_string())?;
        Ok::<_, String>((mlp(0), mlp(1), e.output(id).map_err(|e| e.to_string())?.tokens))
    });
    match out {
        Outcome::Done(Ok((l0, l1, tokens))) => {
            use ::tboost_engine::plan::Choice;
            assert_eq!(l0.map(|d| d.0), Some(Choice::FusedGateUpSwiglu));
            let (choice, reason) = l1.expect("layer 1 has an mlp decision");
            assert_eq!(choice, Choice::GateUpMatmulsThenSwiglu);
            assert_has(&reason, &["fallback", "q5_0"]);
            assert_eq!(tokens.len(), 2, "{tokens:?}");
        }
        other => panic!("dense f32 gate, q5_0 up: {other:?}"),
    }
}

/// Found by `fuzz_tokenizer_json` (e.g. case seed 0x49e1eb0897587ad9: "remove
/// /post_processor/special_tokens/<s>"): the tokenizers crate parses a TemplateProcessing
/// that names a special token it does not define, then panics on every encode. The load now
/// probes the pipeline and refuses the file by name.
#[test]
fn a_tokenizer_whose_post_processor_panics_is_refused_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tj = tiny_tokenizer_json(8);
    tj["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}});
    std::fs::write(tmp.path().join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    let d = tmp.path().to_path_buf();
    match bounded(LOAD_BUDGET, move || Tokenizer::from_hf_dir(&d).map(|_| ()).map_err(|e| e.to_string())) {
        Outcome::Done(Err(e)) => assert_has(&e, &["tokenizer.json", "fails on a test text"]),
        other => panic!("{other:?}"),
    }
}

/// Found by `fuzz_chat_template` (case seed 0x23339d58a971bea4: `''.join(['a'] * 100000000)`
/// spliced into the demo model's template took 41 s; a larger count would exhaust memory):
/// a chat template shipped in tokenizer_config.json renders within its fuel.
#[test]
fn a_chat_template_from_a_model_file_renders_in_bounded_time() {
    for body in [
        "{{ ''.join(['a'] * 100000000) }}",
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}",
        "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
        "{{ 'x' * 1000000000000 }}",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("tokenizer_config.json"), json!({ "chat_template": body }).to_string()).unwrap();
        let tmpl = ChatTemplate::from_hf_dir(tmp.path()).unwrap().expect("a template");
        let start = std::time::Instant::now();
        match bounded(LOAD_BUDGET, move || {
            tmpl.render(&[::tboost_engine::tokenizer::Message::new("user", "hi")], true).map_err(|e| e.to_string())
        }) {
            Outcome::Done(Err(e)) => assert!(!e.is_empty()),
            other => panic!("{body}: {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{body}: took {:?}", start.elapsed());
    }
}

// ---------------------------------------------------------------------------------------
// 3. A FIFO (or another non-regular file) never blocks a load.

fn fifo_dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn a_fifo_as_the_model_path_is_a_clear_error_not_a_hang() {
    let tmp = fifo_dir();
    for name in ["model.gguf", "model.safetensors", "config.json"] {
        let p = tmp.path().join(name);
        mkfifo(&p);
        let e = load_error(&p, &format!("FIFO {name}"));
        assert_has(&e, &[&p.display().to_string(), "FIFO", "not a regular file"]);
        if name == "model.gguf" {
            let p2 = p.clone();
            match bounded(LOAD_BUDGET, move || {
                ::tboost_engine::formats::gguf::read_metadata(&p2).map_err(|e| e.to_string())
            }) {
                Outcome::Done(Err(e)) => assert_has(&e, &["FIFO"]),
                other => panic!("read_metadata of a FIFO: {other:?}"),
            }
        }
        std::fs::remove_file(&p).unwrap();
    }
}

#[test]
fn a_fifo_inside_an_hf_directory_is_a_clear_error_not_a_hang() {
    for name in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        let tmp = tempfile::tempdir().unwrap();
        let golden = hf::golden("llama_gqa");
        for f in ["config.json", "model.safetensors"] {
            if f != name {
                hf::link(tmp.path(), f, &golden.join(f));
            }
        }
        let fifo = tmp.path().join(name);
        mkfifo(&fifo);
        let e = load_error(tmp.path(), &format!("FIFO {name}"));
        assert_has(&e, &[&fifo.display().to_string(), "FIFO"]);
    }
}

/// The tokenizer's files: a FIFO in their place is named by the tokenizer and template
/// loaders. `Model::load` goes on without a tokenizer when only tokenizer.json is broken
/// (a token-id model must not fail for it), and never hangs.
#[test]
fn a_fifo_as_a_tokenizer_file_is_a_clear_error_not_a_hang() {
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
        let tmp = hf::linked_dir("llama_gqa");
        let fifo = tmp.path().join(name);
        mkfifo(&fifo);
        let dir = tmp.path().to_path_buf();
        let d = dir.clone();
        let tok =
            bounded(LOAD_BUDGET, move || Tokenizer::from_hf_dir(&d).map(|t| t.is_some()).map_err(|e| e.to_string()));
        let d = dir.clone();
        let tmpl =
            bounded(LOAD_BUDGET, move || ChatTemplate::from_hf_dir(&d).map(|t| t.is_some()).map_err(|e| e.to_string()));
        match name {
            // tokenizer.json is read first: its FIFO is the tokenizer's error.
            "tokenizer.json" => match tok {
                Outcome::Done(Err(e)) => assert_has(&e, &[&fifo.display().to_string(), "FIFO"]),
                other => panic!("{name}: Tokenizer::from_hf_dir gave {other:?}"),
            },
            // Read only when tokenizer.json exists: here there is none, so the tokenizer is
            // absent (Ok(None)) and nothing blocks.
            "generation_config.json" => assert!(matches!(tok, Outcome::Done(Ok(false))), "{name}: {tok:?}"),
            _ => {}
        }
        match name {
            "tokenizer_config.json" | "chat_template.jinja" => match tmpl {
                Outcome::Done(Err(e)) => assert_has(&e, &[&fifo.display().to_string(), "FIFO"]),
                other => panic!("{name}: ChatTemplate::from_hf_dir gave {other:?}"),
            },
            _ => assert!(matches!(tmpl, Outcome::Done(Ok(false))), "{name}: {tmpl:?}"),
        }
        // The whole load returns (Ok without a tokenizer, or the template's error).
        let d = dir.clone();
        match bounded(LOAD_BUDGET, move || Model::load(&d).map(|m| m.tokenizer.is_some()).map_err(|e| e.to_string())) {
            Outcome::Done(Ok(has_tokenizer)) => assert!(!has_tokenizer, "{name}"),
            Outcome::Done(Err(e)) => assert_has(&e, &["FIFO"]),
            other => panic!("{name}: Model::load gave {other:?}"),
        }
    }
}

/// generation_config.json is read next to a real tokenizer.json.
#[test]
fn a_fifo_as_generation_config_beside_a_tokenizer_is_named() {
    let tmp = hf::linked_dir("llama_gqa");
    std::fs::write(tmp.path().join("tokenizer.json"), serde_json::to_vec(&tiny_tokenizer_json(640)).unwrap()).unwrap();
    let fifo = tmp.path().join("generation_config.json");
    mkfifo(&fifo);
    let d = tmp.path().to_path_buf();
    match bounded(LOAD_BUDGET, move || Tokenizer::from_hf_dir(&d).map(|t| t.is_some()).map_err(|e| e.to_string())) {
        Outcome::Done(Err(e)) => assert_has(&e, &[&fifo.display().to_string(), "FIFO"]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn directories_and_devices_are_named_for_what_they_are() {
    let e = load_error(Path::new("/dev/zero"), "/dev/zero");
    assert_has(&e, &["/dev/zero", "character device"]);
    let tmp = tempfile::tempdir().unwrap();
    let gguf_dir = tmp.path().join("model.gguf");
    std::fs::create_dir(&gguf_dir).unwrap();
    // A directory is an HF checkpoint; an empty one says what it lacks.
    assert_has(&load_error(&gguf_dir, "directory"), &["model.gguf/config.json", "No such file"]);
    // A directory where config.json should be.
    let hfdir = hf::linked_dir("llama_gqa");
    std::fs::remove_file(hfdir.path().join("config.json")).unwrap();
    std::fs::create_dir(hfdir.path().join("config.json")).unwrap();
    assert_has(&load_error(hfdir.path(), "config.json dir"), &["config.json", "is a directory"]);
}

// ---------------------------------------------------------------------------------------
// 6. Stop tokens outside the vocabulary and a zero context length.

#[test]
fn context_length_zero_is_a_clear_error() {
    let mut g = tiny_llama(TINY);
    g.set("llama.context_length", Value::U32(0));
    let tmp = tempfile::tempdir().unwrap();
    let p = g.write(tmp.path(), "model.gguf");
    assert_has(&load_error(&p, "context_length 0"), &["llama.context_length", "must be > 0"]);
    let mut c = hf::golden_config("llama_gqa");
    c["max_position_embeddings"] = json!(0);
    let dir = hf::dir_with_config("llama_gqa", &c);
    assert_has(&load_error(dir.path(), "max_position_embeddings 0"), &["max_position_embeddings", "must be > 0"]);
}

#[test]
fn model_stop_tokens_at_or_above_the_vocabulary_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        for v in [16u64, 1 << 31, u32::MAX as u64] {
            let mut g = tiny_llama(TINY);
            g.set(key, Value::U64(v));
            let p = g.write(tmp.path(), "model.gguf");
            let e = load_error(&p, &format!("{key} = {v}"));
            assert_has(&e, &[key, &v.to_string()]);
        }
    }
    // Beyond u32: named as too large.
    let mut g = tiny_llama(TINY);
    g.set("tokenizer.ggml.eos_token_id", Value::U64(1 << 40));
    let p = g.write(tmp.path(), "model.gguf");
    assert_has(&load_error(&p, "eos 2^40"), &["tokenizer.ggml.eos_token_id", "1099511627776"]);
    // config.json.
    for eos in [json!(640), json!([2, 640]), json!(1u64 << 40)] {
        let mut c = hf::golden_config("llama_gqa");
        c["eos_token_id"] = eos.clone();
        let dir = hf::dir_with_config("llama_gqa", &c);
        let e = load_error(dir.path(), &format!("eos_token_id {eos}"));
        assert_has(&e, &["config.json", "eos_token_id"]);
    }
}

/// A minimal word-level tokenizer.json with `n` tokens `t0..`.
fn tiny_tokenizer_json(n: usize) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..n).map(|i| (format!("t{i}"), json!(i))).collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

#[test]
fn generation_config_stop_tokens_outside_the_vocabulary_are_named() {
    for (eos, bad) in [
        (json!(64), "64"),
        (json!([1, 64]), "64"),
        (json!((1u64 << 32) + 2), "4294967298"),
        (json!(-1), "-1"),
        (json!("x"), "\"x\""),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("tokenizer.json"), serde_json::to_vec(&tiny_tokenizer_json(64)).unwrap())
            .unwrap();
        std::fs::write(tmp.path().join("generation_config.json"), json!({ "eos_token_id": eos }).to_string()).unwrap();
        let e = Tokenizer::from_hf_dir(tmp.path()).unwrap_err().to_string();
        assert_has(&e, &["generation_config.json", "eos_token_id", bad, "vocabulary size 64"]);
    }
}

/// A vocabulary entry with id 2^32-1: the id space (every id up to the largest) would be 4
/// billion entries long, so it is refused by the vocabulary cap before anything is sized
/// by it.
#[test]
fn a_tokenizer_with_a_huge_token_id_is_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tj = tiny_tokenizer_json(8);
    tj["model"]["vocab"]["big"] = json!(u32::MAX);
    std::fs::write(tmp.path().join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    let d = tmp.path().to_path_buf();
    match bounded(LOAD_BUDGET, move || Tokenizer::from_hf_dir(&d).map(|_| ()).map_err(|e| e.to_string())) {
        Outcome::Done(Err(e)) => {
            assert_has(&e, &["tokenizer.json", "vocabulary size", &(u32::MAX as u64 + 1).to_string(), "limit"])
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// The same files through the C ABI: a status, the message in tboost_last_error.

fn c_last_error() -> String {
    let mut buf = vec![0 as std::os::raw::c_char; 8192];
    let mut need = 0;
    assert_eq!(unsafe { tboost_last_error(buf.as_mut_ptr(), buf.len(), &mut need) }, tboost_status::TBOOST_OK);
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

fn c_load(path: &Path) -> (tboost_status, String) {
    let p = path.to_path_buf();
    match bounded(LOAD_BUDGET, move || {
        let c = CString::new(p.to_str().unwrap()).unwrap();
        let mut m = null_mut();
        let s = unsafe { tboost_model_load(c.as_ptr(), std::ptr::null(), None, null_mut(), &mut m) };
        let msg = c_last_error();
        if s == tboost_status::TBOOST_OK {
            assert_eq!(tboost_model_free(m), tboost_status::TBOOST_OK);
        }
        (s, msg)
    }) {
        Outcome::Done(r) => r,
        other => panic!("tboost_model_load({}): {other:?}", path.display()),
    }
}

#[test]
fn the_c_abi_reports_each_case_as_a_status_with_the_message() {
    let tmp = tempfile::tempdir().unwrap();
    use tboost_status::*;

    let mut g = tiny_llama(TINY);
    g.set("llama.block_count", Value::U64(1 << 40));
    let p = g.write(tmp.path(), "layers.gguf");
    let (s, msg) = c_load(&p);
    assert_eq!(s, TBOOST_ERR_MODEL_FORMAT, "{msg}");
    assert_has(&msg, &["layers.gguf", "llama.block_count", "1099511627776", "limit"]);

    let s8 = Shape { vocab: 16, hidden: 8, layers: 1, q_rows: 8, kv_rows: 8, ffn: 8 };
    let mut g = tiny_llama(s8);
    g.set("llama.attention.head_count", Value::U64((1 << 62) + 2));
    g.set("llama.attention.head_count_kv", Value::U64((1 << 62) + 2));
    g.set("llama.attention.key_length", Value::U32(4));
    g.set("llama.rope.dimension_count", Value::U32(4));
    let p = g.write(tmp.path(), "heads.gguf");
    let (s, msg) = c_load(&p);
    assert_eq!(s, TBOOST_ERR_MODEL_FORMAT, "{msg}");
    assert_has(&msg, &["heads.gguf", "llama.attention.head_count", "4611686018427387906"]);

    let fifo = tmp.path().join("fifo.gguf");
    mkfifo(&fifo);
    let (s, msg) = c_load(&fifo);
    assert_eq!(s, TBOOST_ERR_IO, "{msg}");
    assert_has(&msg, &["fifo.gguf", "FIFO"]);

    let mut c = hf::golden_config("llama_gqa");
    c["num_hidden_layers"] = json!(1u64 << 40);
    let dir = hf::dir_with_config("llama_gqa", &c);
    let (s, msg) = c_load(dir.path());
    assert_eq!(s, TBOOST_ERR_MODEL_FORMAT, "{msg}");
    assert_has(&msg, &["config.json", "num_hidden_layers", "1099511627776"]);

    let dir = hf::linked_dir("llama_gqa");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    mkfifo(&dir.path().join("model.safetensors"));
    let (s, msg) = c_load(dir.path());
    assert_eq!(s, TBOOST_ERR_IO, "{msg}");
    assert_has(&msg, &["model.safetensors", "FIFO"]);

    let mut g = tiny_llama(TINY);
    g.set("llama.context_length", Value::U32(0));
    let p = g.write(tmp.path(), "ctx0.gguf");
    let (s, msg) = c_load(&p);
    assert_eq!(s, TBOOST_ERR_MODEL_FORMAT, "{msg}");
    assert_has(&msg, &["ctx0.gguf", "llama.context_length"]);

    // And the library still works afterwards: a good model loads.
    let (s, msg) = c_load(&hf::golden("llama_gqa"));
    assert_eq!(s, TBOOST_OK, "{msg}");
}

/// A time budget is part of every case above; this checks the helper itself fails a hang
/// (so a regression to a blocking open would be reported, not wait forever).
#[test]
fn the_time_budget_reports_a_hang() {
    let out = bounded(Duration::from_millis(50), || std::thread::sleep(Duration::from_secs(5)));
    assert!(matches!(out, Outcome::TimedOut), "{out:?}");
    let out = bounded(Duration::from_secs(5), || panic!("boom"));
    assert!(matches!(&out, Outcome::Panicked(m) if m == "boom"), "{out:?}");
}
