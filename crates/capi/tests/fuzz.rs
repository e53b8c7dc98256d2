//! Fuzzing the model loaders: GGUF, safetensors, config.json, tokenizer.json and chat
//! templates, seeded from the real files in `shared/testdata/golden` and `shared/models`
//! (read in place; mutated copies go to a tempdir) and from the tests' own generators.
//!
//! Property: a load returns Ok or a clear Err (one that names the file), never panics,
//! aborts or hangs; when it returns Ok, an engine built on the model plans it and runs a
//! one-token request without panicking. Tokenizers: `Tokenizer::from_hf_dir` is Ok or a
//! clear Err and a loaded tokenizer encodes and decodes. Chat templates render or fail
//! within their fuel.
//!
//! Each target runs its cases in a child process (this test binary re-run on one test),
//! so that an abort or a hang is caught too: the parent reads the child's
//! `FUZZ case ...` lines, kills it when one case runs over its budget, and fails naming the
//! case (its seed and mutations) and how to replay it.
//!
//! - `TBOOST_FUZZ_SECS` (default 3): seconds of cases per target. `TBOOST_FUZZ_SECS=600`
//!   for a long run.
//! - `TBOOST_FUZZ_SEED` (default fixed): the base seed, so runs are reproducible.
//! - `TBOOST_FUZZ_CASE=0x...`: replay one case seed (with `--nocapture` to see it).
//! - `TBOOST_FUZZ_CASE_SECS` (default 30; the slowest cases take under a second): the
//!   budget of one case.

use tboost_testkit::model_files;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ::tboost_engine::engine::{Engine, EngineConfig, KvSize};
use ::tboost_engine::formats::gguf::{self, Value};
use ::tboost_engine::model::Model;
use ::tboost_engine::sample::FinishReason;
use ::tboost_engine::sched::Request;
use ::tboost_engine::tokenizer::{ChatTemplate, Message, PreTokenizer, Tokenizer};
use model_files::gguf::{tiny_llama, tiny_moe, tiny_qwen2, Field, Gguf, TINY};
use model_files::{hf, panic_message};
use serde_json::{json, Map, Value as Json};

const WORKER_ENV: &str = "TBOOST_FUZZ_WORKER";
const DEFAULT_SEED: u64 = 0x7b00_57f0_2211_0011;
/// At least this many cases per target, however slow the machine.
const MIN_CASES: u64 = 8;

// ---------------------------------------------------------------------------------------
// Randomness: SplitMix64, seeded per case.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

fn case_seed(base: u64, i: u64) -> u64 {
    Rng(base ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93)).next()
}

/// The values a field is set to: the edges of every integer width, the adversarial pass's
/// values, and small numbers near real ones.
const SPECIALS: [u64; 22] = [
    0,
    1,
    2,
    3,
    7,
    16,
    31,
    255,
    256,
    65_535,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    1 << 58,
    (1 << 62) + 2,
    1 << 63,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
    1 << 24,
];

fn special(rng: &mut Rng, orig: Option<u64>) -> u64 {
    match (orig, rng.below(4)) {
        (Some(o), 0) => o.wrapping_add(1 + rng.below(3) as u64),
        (Some(o), 1) => o.wrapping_sub(1),
        _ => *rng.pick(&SPECIALS),
    }
}

// ---------------------------------------------------------------------------------------
// Byte-level mutations shared by every target.

fn flip_bits(rng: &mut Rng, b: &mut [u8], region: usize, log: &mut Vec<String>) {
    if b.is_empty() {
        return;
    }
    for _ in 0..1 + rng.below(4) {
        let pos = rng.below(region.clamp(1, b.len()));
        let bit = rng.below(8);
        b[pos] ^= 1 << bit;
        log.push(format!("flip byte {pos} bit {bit}"));
    }
}

fn truncate(rng: &mut Rng, b: &mut Vec<u8>, region: usize, log: &mut Vec<String>) {
    let at = rng.below(region.clamp(1, b.len().max(1)));
    b.truncate(at);
    log.push(format!("truncate to {at} bytes"));
}

fn splice(rng: &mut Rng, b: &mut [u8], other: &[u8], log: &mut Vec<String>) {
    if b.is_empty() || other.is_empty() {
        return;
    }
    let len = 1 + rng.below(64.min(other.len()));
    let from = rng.below(other.len() - len + 1);
    let to = rng.below(b.len());
    let end = (to + len).min(b.len());
    b[to..end].copy_from_slice(&other[from..from + (end - to)]);
    log.push(format!("splice {} bytes from offset {from} of another seed at {to}", end - to));
}

fn set_field(b: &mut [u8], f: &Field, v: u64, log: &mut Vec<String>) {
    if f.pos + f.width <= b.len() {
        b[f.pos..f.pos + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
        log.push(format!("set {} (at {}) to {v}", f.what, f.pos));
    }
}

// ---------------------------------------------------------------------------------------
// The property on a model path.

/// What one case ended with (when it is not a failure).
enum Verdict {
    Loaded,
    Refused,
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        threads: 1,
        kv_size: KvSize::Blocks(16),
        block_size: Some(16),
        max_seqs: 4,
        max_batched_tokens: 64,
        ..Default::default()
    }
}

/// Load (must be Ok or an error naming `path`), then engine + one-token request.
fn check_model(path: &Path) -> Result<Verdict, String> {
    let name = path.display().to_string();
    let name = name.as_str();
    let model = match Model::load(path) {
        Ok(m) => m,
        Err(e) => {
            let msg = e.to_string();
            if !msg.contains(name) {
                return Err(format!("load error does not name `{name}`: {msg}"));
            }
            return Ok(Verdict::Refused);
        }
    };
    let vocab = model.config.vocab_size as u32;
    drop(model);
    let e = Engine::new(engine_config()).map_err(|e| format!("Engine::new: {e}"))?;
    if let Err(err) = e.load(path) {
        // Loaded as a model but refused by the engine (e.g. no operator for it): fine
        // when it says why.
        let msg = err.to_string();
        if msg.is_empty() {
            return Err("Engine::load failed with an empty message".into());
        }
        return Ok(Verdict::Refused);
    }
    let prompt = vec![1u32.min(vocab - 1), (vocab - 1) / 2];
    match e.enqueue(Request { ignore_eos: true, ..Request::new(prompt, 1) }) {
        Ok(id) => {
            // A step error is allowed (a clear one); a panic is not. A request may end with
            // its own error (non-finite logits from corrupt weights) when it says why.
            if e.run_to_completion().is_ok() {
                let out = e.output(id).map_err(|e| format!("output: {e}"))?;
                match (out.finish, &out.error) {
                    (Some(FinishReason::Error), Some(msg)) if !msg.is_empty() => {}
                    (Some(FinishReason::Length), None) if out.tokens.len() == 1 && out.tokens[0] < vocab => {}
                    _ => return Err(format!("one-token request gave {out:?} (vocab {vocab})")),
                }
            }
        }
        Err(err) => return Err(format!("enqueue of a valid prompt on a loaded model failed: {err}")),
    }
    Ok(Verdict::Loaded)
}

type Exec = Box<dyn FnOnce() -> Result<Verdict, String>>;

// ---------------------------------------------------------------------------------------
// Seeds.

fn shared() -> PathBuf {
    let dir = tboost_testkit::golden::shared_dir();
    assert!(
        dir.join("testdata/golden").is_dir() && dir.join("models").is_dir(),
        "shared test data not found at {}: check out the `shared` directory next to the repository or set TBOOST_SHARED",
        dir.display()
    );
    dir
}

const GOLDEN: [&str; 6] = ["llama_gqa", "llama_gqa_bf16", "llama_hd24", "mistral", "mixtral", "qwen2"];

fn shared_model(name: &str) -> PathBuf {
    let p = shared().join("models").join(name);
    assert!(p.is_file(), "{} is missing: it ships in shared/models (see its README.md)", p.display());
    p
}

/// The demo model (for its real Qwen vocabulary, merges and chat template).
fn demo_model() -> PathBuf {
    let p = match std::env::var_os("TBOOST_DEMO_MODEL") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("TBOOST_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tboost"))
            .join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    };
    assert!(
        p.is_file(),
        "demo model {} is missing: run scripts/fetch-demo-model.sh (or set TBOOST_DEMO_MODEL)",
        p.display()
    );
    p
}

// ---------------------------------------------------------------------------------------
// Target: GGUF.

struct GgufSeeds {
    docs: Vec<(String, Gguf)>,
    bytes: Vec<Vec<u8>>,
}

fn gguf_seeds() -> GgufSeeds {
    let mut docs = vec![];
    for name in ["llama-2-tiny-random.gguf", "stories260K-placeholder-vocab.gguf"] {
        docs.push((name.to_string(), Gguf::from_file(&shared_model(name))));
    }
    docs.push(("generated tiny llama".into(), tiny_llama(TINY)));
    docs.push(("generated tiny moe".into(), tiny_moe()));
    docs.push(("generated tiny qwen2".into(), tiny_qwen2()));
    let bytes = docs.iter().map(|(_, d)| d.build().0).collect();
    GgufSeeds { docs, bytes }
}

/// Keys whose values size things: edited more often than the rest.
const GGUF_KEYS: [&str; 16] = [
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "expert_count",
    "expert_used_count",
    "vocab_size",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "general.alignment",
];

fn gguf_value(rng: &mut Rng, orig: Option<u64>) -> Value {
    let v = special(rng, orig);
    match rng.below(8) {
        0 => Value::U32(v as u32),
        1 => Value::I32(v as i32),
        2 => Value::I64(v as i64),
        3 => Value::String(format!("{v}")),
        4 => Value::F32(v as f32),
        5 => Value::Array(vec![Value::U32(v as u32); 1 + rng.below(3)]),
        6 => Value::Bool(v & 1 == 1),
        _ => Value::U64(v),
    }
}

fn mutate_gguf_doc(rng: &mut Rng, g: &mut Gguf, log: &mut Vec<String>) {
    let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("llama").to_string();
    match rng.below(10) {
        0..=2 => {
            let k = *rng.pick(&GGUF_KEYS);
            let key = if k.starts_with("tokenizer.") || k.starts_with("general.") {
                k.to_string()
            } else {
                format!("{arch}.{k}")
            };
            let v = gguf_value(rng, g.get(&key).and_then(Value::as_u64));
            log.push(format!("set {key} = {v:?}"));
            g.set(&key, v);
        }
        3 => {
            // Any existing scalar key.
            let i = rng.below(g.kv.len());
            let (key, old) = g.kv[i].clone();
            if let Value::Array(a) = &old {
                // Shorter or longer arrays (scores/types no longer match the tokens).
                let n = match rng.below(3) {
                    0 => 0,
                    1 => a.len() / 2,
                    _ => a.len() + 1,
                };
                let mut a = a.clone();
                a.resize(n, a.first().cloned().unwrap_or(Value::U32(0)));
                log.push(format!("resize array {key} to {n}"));
                g.kv[i].1 = Value::Array(a);
            } else {
                let v = gguf_value(rng, old.as_u64());
                log.push(format!("set {key} = {v:?}"));
                g.kv[i].1 = v;
            }
        }
        4 => {
            let i = rng.below(g.kv.len());
            log.push(format!("remove metadata {}", g.kv[i].0));
            g.kv.remove(i);
        }
        5 if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            let t = &mut g.tensors[i];
            let d = rng.below(t.ne.len());
            let v = special(rng, Some(t.ne[d]));
            log.push(format!("set dim {d} of {} to {v} (data unchanged)", t.name));
            t.ne[d] = v;
        }
        6 if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            let ty = rng.below(42) as u32;
            log.push(format!("set type of {} to {ty}", g.tensors[i].name));
            g.tensors[i].ty = ty;
        }
        7 if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            match rng.below(3) {
                0 => {
                    log.push(format!("remove tensor {}", g.tensors[i].name));
                    g.tensors.remove(i);
                }
                1 => {
                    let j = rng.below(g.tensors.len());
                    let name = g.tensors[j].name.clone();
                    log.push(format!("rename tensor {} to {name}", g.tensors[i].name));
                    g.tensors[i].name = name;
                }
                _ => {
                    let t = &mut g.tensors[i];
                    let n = rng.below(t.data.len() + 1);
                    log.push(format!("cut the data of {} to {n} bytes", t.name));
                    t.data.truncate(n);
                }
            }
        }
        8 if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            let v = special(rng, None);
            log.push(format!("data offset of {} lies: {v}", g.tensors[i].name));
            g.tensors[i].offset_override = Some(v);
        }
        _ => {
            // Add or drop a dimension.
            let i = rng.below(g.tensors.len().max(1));
            if let Some(t) = g.tensors.get_mut(i) {
                if rng.chance(0.5) && t.ne.len() > 1 {
                    t.ne.pop();
                    log.push(format!("drop the last dim of {}", t.name));
                } else {
                    t.ne.push(1 + rng.below(3) as u64);
                    log.push(format!("add a dim to {}", t.name));
                }
            }
        }
    }
}

fn gguf_case(s: &GgufSeeds, rng: &mut Rng, dir: &Path) -> (String, Exec) {
    let k = rng.below(s.docs.len());
    let (seed_name, doc) = &s.docs[k];
    let mut log = vec![format!("seed {seed_name}")];
    let mut doc = doc.clone();
    for _ in 0..1 + rng.below(2) {
        if rng.chance(0.6) {
            mutate_gguf_doc(rng, &mut doc, &mut log);
        }
    }
    let (mut bytes, fields) = doc.build();
    let header_end = fields.last().map_or(bytes.len(), |f| f.pos + f.width);
    for _ in 0..rng.below(3) {
        match rng.below(5) {
            0 | 1 => {
                let f = rng.pick(&fields).clone();
                let orig = if f.width == 8 {
                    bytes.get(f.pos..f.pos + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                } else {
                    bytes.get(f.pos..f.pos + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as u64)
                };
                let v = special(rng, orig);
                set_field(&mut bytes, &f, v, &mut log);
            }
            2 => {
                let region = if rng.chance(0.7) { header_end } else { usize::MAX };
                flip_bits(rng, &mut bytes, region, &mut log)
            }
            3 => {
                let region = if rng.chance(0.7) { header_end + 64 } else { usize::MAX };
                truncate(rng, &mut bytes, region, &mut log)
            }
            _ => {
                let other = &s.bytes[rng.below(s.bytes.len())];
                splice(rng, &mut bytes, other, &mut log)
            }
        }
    }
    let path = dir.join("case.gguf");
    std::fs::write(&path, &bytes).unwrap();
    (log.join("; "), Box::new(move || check_model(&path)))
}

// ---------------------------------------------------------------------------------------
// Targets: safetensors and config.json (Hugging Face directories).

struct HfSeeds {
    configs: Vec<Json>,
    shards: Vec<Vec<u8>>,
}

fn hf_seeds() -> HfSeeds {
    let configs = GOLDEN.iter().map(|c| hf::golden_config(c)).collect();
    let shards = GOLDEN.iter().map(|c| std::fs::read(hf::golden(c).join("model.safetensors")).unwrap()).collect();
    HfSeeds { configs, shards }
}

fn json_value(rng: &mut Rng, orig: Option<&Json>) -> Json {
    let o = orig.and_then(Json::as_u64);
    match rng.below(9) {
        0 => json!(-(1 + rng.below(1000) as i64)),
        1 => json!([1e308, 0.5, -0.0][rng.below(3)]),
        2 => json!("x"),
        3 => Json::Null,
        4 => json!([special(rng, o)]),
        5 => json!({"a": 1}),
        6 => json!(rng.chance(0.5)),
        _ => json!(special(rng, o)),
    }
}

fn edit_safetensors(rng: &mut Rng, bytes: &[u8], log: &mut Vec<String>) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Map<String, Json> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
    let name = rng.pick(&names).clone();
    match rng.below(7) {
        0 => {
            let shape = header[&name]["shape"].as_array().cloned().unwrap_or_default();
            if shape.is_empty() {
                header.get_mut(&name).unwrap()["shape"] = json!([special(rng, None)]);
            } else {
                let d = rng.below(shape.len());
                let v = special(rng, shape[d].as_u64());
                header.get_mut(&name).unwrap()["shape"][d] = json!(v);
                log.push(format!("set shape[{d}] of {name} to {v}"));
            }
        }
        1 => {
            let dt = *rng.pick(&["F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "Q4", ""]);
            header.get_mut(&name).unwrap()["dtype"] = json!(dt);
            log.push(format!("set dtype of {name} to {dt:?}"));
        }
        2 => {
            let i = rng.below(2);
            let old = header[&name]["data_offsets"][i].as_u64();
            let v = special(rng, old);
            header.get_mut(&name).unwrap()["data_offsets"][i] = json!(v);
            log.push(format!("set data_offsets[{i}] of {name} to {v}"));
        }
        3 => {
            header.remove(&name);
            log.push(format!("remove {name} from the header"));
        }
        4 => {
            let new = name.replace("layers.0.", "layers.7.").replace("layers.1.", "layers.99999999999.");
            let v = header.remove(&name).unwrap();
            header.insert(new.clone(), v);
            log.push(format!("rename {name} to {new}"));
        }
        5 => {
            let v = json_value(rng, None);
            header.get_mut(&name).unwrap()["shape"] = v.clone();
            log.push(format!("set shape of {name} to {v}"));
        }
        _ => {
            let dims = 1 + rng.below(12);
            header.get_mut(&name).unwrap()["shape"] = json!(vec![1; dims]);
            log.push(format!("give {name} {dims} dims of 1"));
        }
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

fn safetensors_case(s: &HfSeeds, rng: &mut Rng, dir: &Path) -> (String, Exec) {
    let k = rng.below(GOLDEN.len());
    let case = GOLDEN[k];
    let mut log = vec![format!("seed {case}/model.safetensors")];
    let mut bytes = s.shards[k].clone();
    // Structural edits first (each leaves a well-formed header), then byte-level ones.
    let mut edits = 0;
    while edits < 2 && rng.chance(0.6) {
        bytes = edit_safetensors(rng, &bytes, &mut log);
        edits += 1;
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for _ in 0..usize::from(edits == 0) + rng.below(2) {
        match rng.below(4) {
            0 if bytes.len() >= 8 => {
                let v = special(rng, Some(n as u64));
                bytes[..8].copy_from_slice(&v.to_le_bytes());
                log.push(format!("set the header length to {v}"));
            }
            1 => {
                let region = if rng.chance(0.7) { 8 + n } else { usize::MAX };
                flip_bits(rng, &mut bytes, region, &mut log)
            }
            _ => {
                if rng.chance(0.5) {
                    {
                        let region = if rng.chance(0.5) { 8 + n } else { usize::MAX };
                        truncate(rng, &mut bytes, region, &mut log)
                    }
                } else {
                    let other = &s.shards[rng.below(s.shards.len())];
                    splice(rng, &mut bytes, other, &mut log)
                }
            }
        }
    }
    let d = dir.join("st");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    // The config of the same case (or, sometimes, another: a splice of two checkpoints).
    let cfg_case = if rng.chance(0.85) { case } else { GOLDEN[rng.below(GOLDEN.len())] };
    if cfg_case != case {
        log.push(format!("config of {cfg_case}"));
    }
    hf::link(&d, "config.json", &hf::golden(cfg_case).join("config.json"));
    std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
    (log.join("; "), Box::new(move || check_model(&d)))
}

const CONFIG_KEYS: [&str; 22] = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "num_local_experts",
    "num_experts_per_tok",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "partial_rotary_factor",
    "rope_scaling",
    "sliding_window",
    "model_type",
    "hidden_act",
    "attention_bias",
    "rope_parameters",
];

fn config_case(s: &HfSeeds, rng: &mut Rng, dir: &Path) -> (String, Exec) {
    let k = rng.below(GOLDEN.len());
    let case = GOLDEN[k];
    let mut log = vec![format!("seed {case}/config.json")];
    let mut cfg = s.configs[k].clone();
    for _ in 0..1 + rng.below(3) {
        let key = *rng.pick(&CONFIG_KEYS);
        let obj = cfg.as_object_mut().unwrap();
        if rng.chance(0.15) {
            obj.remove(key);
            log.push(format!("remove {key}"));
        } else if key == "rope_scaling" && rng.chance(0.5) {
            let sub = *rng.pick(&[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
                "rope_type",
            ]);
            let v = json_value(rng, None);
            if !obj.get(key).is_some_and(Json::is_object) {
                obj.insert(key.into(), json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}));
            }
            log.push(format!("set {key}.{sub} = {v}"));
            obj[key][sub] = v;
        } else {
            let v = json_value(rng, obj.get(key));
            log.push(format!("set {key} = {v}"));
            obj.insert(key.into(), v);
        }
    }
    let mut text = serde_json::to_vec_pretty(&cfg).unwrap();
    match rng.below(6) {
        0 => flip_bits(rng, &mut text, usize::MAX, &mut log),
        1 => truncate(rng, &mut text, usize::MAX, &mut log),
        _ => {}
    }
    let d = dir.join("cfg");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("config.json"), &text).unwrap();
    let weights = if rng.chance(0.85) { case } else { GOLDEN[rng.below(GOLDEN.len())] };
    if weights != case {
        log.push(format!("weights of {weights}"));
    }
    hf::link(&d, "model.safetensors", &hf::golden(weights).join("model.safetensors"));
    (log.join("; "), Box::new(move || check_model(&d)))
}

// ---------------------------------------------------------------------------------------
// Target: tokenizer.json (with tokenizer_config.json and generation_config.json).

struct TokSeeds {
    /// (name, tokenizer.json, tokenizer_config.json)
    files: Vec<(String, Json, Json)>,
}

/// Byte-level BPE from the demo model's real Qwen2 vocabulary and merges, cut to the first
/// `n` ids (and the merges among them) so a case parses in milliseconds.
fn qwen_tokenizer(meta: &gguf::Metadata, n: usize) -> (Json, Json) {
    let tokens = meta["tokenizer.ggml.tokens"].as_array().unwrap();
    let types = meta["tokenizer.ggml.token_type"].as_array().unwrap();
    let mut vocab = Map::new();
    let mut added = vec![];
    let mut keep = std::collections::HashSet::new();
    // The first n ids and every special one (control, user-defined: `<|im_end|>`...).
    let ids: Vec<usize> = (0..tokens.len()).filter(|&i| i < n || types[i].as_i64() != Some(1)).collect();
    for (new_id, &i) in ids.iter().enumerate() {
        let t = tokens[i].as_str().unwrap();
        keep.insert(t.to_string());
        if types[i].as_i64() == Some(1) {
            vocab.insert(t.to_string(), json!(new_id));
        } else {
            added.push(json!({"id": new_id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": types[i].as_i64() == Some(3)}));
        }
    }
    let merges: Vec<&str> = meta["tokenizer.ggml.merges"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m.as_str())
        .filter(|m| {
            let mut parts = m.splitn(2, ' ');
            let (a, b) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            keep.contains(a) && keep.contains(b) && keep.contains(&format!("{a}{b}"))
        })
        .collect();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PreTokenizer::Qwen2.regexes()[0]},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    let cfg = json!({"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>",
        "chat_template": meta["tokenizer.chat_template"].as_str().unwrap()});
    (tj, cfg)
}

/// SentencePiece-style (Metaspace, byte fallback, Unigram scores) from the real Llama-2
/// vocabulary of `llama-2-tiny-random.gguf`, cut to the first `n` ids.
fn llama_tokenizer(meta: &gguf::Metadata, n: usize) -> (Json, Json) {
    let tokens = meta["tokenizer.ggml.tokens"].as_array().unwrap();
    let scores = meta["tokenizer.ggml.scores"].as_array().unwrap();
    let vocab: Vec<Json> = (0..n).map(|i| json!([tokens[i].as_str().unwrap(), scores[i].as_f64().unwrap()])).collect();
    let special = |id: usize| {
        json!({"id": id, "content": tokens[id].as_str().unwrap(), "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [special(0), special(1), special(2)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": true}
    });
    let cfg = json!({"add_bos_token": true, "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"});
    (tj, cfg)
}

fn tok_seeds() -> TokSeeds {
    let llama = gguf::read_metadata(&shared_model("llama-2-tiny-random.gguf")).unwrap();
    let qwen = gguf::read_metadata(&demo_model()).unwrap();
    let (a, ac) = llama_tokenizer(&llama, 2000);
    let (b, bc) = qwen_tokenizer(&qwen, 2000);
    TokSeeds { files: vec![("llama-2 vocab (unigram)".into(), a, ac), ("qwen2 vocab (byte-level bpe)".into(), b, bc)] }
}

/// JSON paths into a tokenizer.json that a mutation may target.
fn json_paths(v: &Json, prefix: &str, out: &mut Vec<String>, rng: &mut Rng) {
    match v {
        Json::Object(m) => {
            for (k, x) in m {
                // Big maps (a vocabulary): only a few entries.
                if m.len() < 40 || rng.chance(0.01) {
                    let p = format!("{prefix}/{}", k.replace('~', "~0").replace('/', "~1"));
                    out.push(p.clone());
                    json_paths(x, &p, out, rng);
                }
            }
        }
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                if a.len() < 40 || rng.chance(0.005) || i < 3 {
                    let p = format!("{prefix}/{i}");
                    out.push(p.clone());
                    json_paths(x, &p, out, rng);
                }
            }
        }
        _ => {}
    }
}

fn tokenizer_case(s: &TokSeeds, rng: &mut Rng, dir: &Path) -> (String, Exec) {
    let (name, tj, cfg) = rng.pick(&s.files);
    let mut log = vec![format!("seed {name}")];
    let mut tj = tj.clone();
    let mut cfg = cfg.clone();
    for _ in 0..1 + rng.below(3) {
        let target_cfg = rng.chance(0.15);
        let doc = if target_cfg { &mut cfg } else { &mut tj };
        let mut paths = vec![];
        json_paths(doc, "", &mut paths, rng);
        let p = rng.pick(&paths).clone();
        let what = if target_cfg { "tokenizer_config.json" } else { "tokenizer.json" };
        match rng.below(6) {
            0 => {
                // Delete.
                let (parent, last) = p.rsplit_once('/').unwrap();
                match doc.pointer_mut(parent) {
                    Some(Json::Object(m)) => {
                        m.remove(&last.replace("~1", "/").replace("~0", "~"));
                    }
                    Some(Json::Array(a)) => {
                        if let Ok(i) = last.parse::<usize>() {
                            if i < a.len() {
                                a.remove(i);
                            }
                        }
                    }
                    _ => {}
                }
                log.push(format!("{what}: remove {p}"));
            }
            1 => {
                let t = json!(*rng.pick(&[
                    "BPE",
                    "WordPiece",
                    "WordLevel",
                    "Unigram",
                    "ByteLevel",
                    "Metaspace",
                    "Sequence",
                    "Split",
                    "Replace",
                    "X"
                ]));
                if let Some(slot) = doc.pointer_mut(&p) {
                    log.push(format!("{what}: set {p} = {t}"));
                    *slot = t;
                }
            }
            2 => {
                let pat = *rng.pick(&["(a+)+$", "[", "\\p{Zzz}", "", "(?<=a)b", "(?i)(.*)*x", "\\"]);
                if let Some(slot) = doc.pointer_mut(&p) {
                    log.push(format!("{what}: set {p} = {pat:?}"));
                    *slot = json!(pat);
                }
            }
            _ => {
                let v = json_value(rng, doc.pointer(&p));
                if let Some(slot) = doc.pointer_mut(&p) {
                    log.push(format!("{what}: set {p} = {v}"));
                    *slot = v;
                }
            }
        }
    }
    let mut text = serde_json::to_vec(&tj).unwrap();
    match rng.below(8) {
        0 => flip_bits(rng, &mut text, usize::MAX, &mut log),
        1 => truncate(rng, &mut text, usize::MAX, &mut log),
        _ => {}
    }
    let d = dir.join("tok");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("tokenizer.json"), &text).unwrap();
    std::fs::write(d.join("tokenizer_config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let eos = json_value(rng, Some(&json!(2)));
    if rng.chance(0.3) {
        log.push(format!("generation_config eos_token_id = {eos}"));
        std::fs::write(d.join("generation_config.json"), json!({ "eos_token_id": eos }).to_string()).unwrap();
    }
    (log.join("; "), Box::new(move || check_tokenizer(&d)))
}

fn check_tokenizer(d: &Path) -> Result<Verdict, String> {
    let dir = d.display().to_string();
    let clear = |e: ::tboost_engine::Error| -> Result<Verdict, String> {
        let msg = e.to_string();
        if msg.contains(&dir) {
            Ok(Verdict::Refused)
        } else {
            Err(format!("tokenizer error does not name the file: {msg}"))
        }
    };
    let t = match Tokenizer::from_hf_dir(d) {
        Ok(Some(t)) => t,
        Ok(None) => return Err("tokenizer.json exists but from_hf_dir says there is none".into()),
        Err(e) => return clear(e),
    };
    // A loaded tokenizer works on short text (a hostile regex cannot take long on it).
    for text in ["Hello, world! 123", "é中 <s></s><|im_end|>", ""] {
        if let Ok(ids) = t.encode(text, true) {
            let _ = t.decode(&ids);
        }
    }
    for id in (0..t.vocab_size().min(64) as u32).chain([t.vocab_size() as u32, u32::MAX]) {
        let _ = t.decode(&[id]);
    }
    match ChatTemplate::from_hf_dir(d) {
        Ok(Some(tmpl)) => {
            let _ = tmpl.render(&[Message::new("user", "hi")], true);
        }
        Ok(None) => {}
        Err(e) => return clear(e),
    }
    Ok(Verdict::Loaded)
}

// ---------------------------------------------------------------------------------------
// Target: chat templates.

struct TemplateSeeds {
    templates: Vec<(String, String)>,
}

fn template_seeds() -> TemplateSeeds {
    let qwen = gguf::read_metadata(&demo_model()).unwrap();
    let q = qwen["tokenizer.chat_template"].as_str().unwrap().to_string();
    let simple = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}<<SYS>>{{ m.content }}<</SYS>>{% else %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    TemplateSeeds { templates: vec![("qwen2.5 (demo model)".into(), q), ("llama-style".into(), simple.into())] }
}

/// Jinja fragments spliced into templates: loops, recursion, huge strings and lists, bad
/// syntax, every construct that could hang, recurse without bound or allocate without end.
const JINJA: [&str; 24] = [
    "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "{{ 'x' * 1000000000000 }}",
    "{{ range(1000000000000000000) | list | length }}",
    "{% set s = 'ab' %}{% for i in range(60) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}",
    "{{ messages[999999999].content }}",
    "{{ ((((((((((((((((((((((((((((((((((((((((1)))))))))))))))))))))))))))))))))))))))) }}",
    "{{ raise_exception('bad role') }}",
    "{{ strftime_now('%Y-%m-%d %Q') }}",
    "{% include 'other' %}",
    "{% extends 'base' %}",
    "{{ 10 ** 10 ** 10 }}",
    "{{ (messages * 100000000) | length }}",
    "{{ messages | tojson }}",
    "{% for m in messages %}{{ m.content.split('') }}{% endfor %}",
    "{{ '%s' % messages }}",
    "{{ 1 / 0 }}",
    "{{ x.y.z() }}",
    "{%",
    "}}",
    "{% endfor %}",
    "{% if %}",
    "{{ ''.join(['a'] * 100000000) }}",
    "{% filter upper %}{% for i in range(100000) %}{{ messages | tojson }}{% endfor %}{% endfilter %}",
];

fn template_case(s: &TemplateSeeds, rng: &mut Rng, _dir: &Path) -> (String, Exec) {
    let (name, src) = rng.pick(&s.templates);
    let mut log = vec![format!("seed {name}")];
    let mut src = src.clone().into_bytes();
    for _ in 0..1 + rng.below(3) {
        match rng.below(5) {
            0 => flip_bits(rng, &mut src, usize::MAX, &mut log),
            1 => truncate(rng, &mut src, usize::MAX, &mut log),
            _ => {
                let frag = *rng.pick(&JINJA);
                let at = rng.below(src.len() + 1);
                src.splice(at..at, frag.bytes());
                log.push(format!("insert {frag:?} at {at}"));
            }
        }
    }
    let src = String::from_utf8_lossy(&src).into_owned();
    let exec: Exec = Box::new(move || {
        let t = ChatTemplate::new(src, "<s>", "</s>");
        let msgs = [
            Message::new("system", "You are helpful."),
            Message::new("user", "Write a Rust function that reverses a string."),
            Message::new("assistant", "fn rev(s: &str) -> String { s.chars().rev().collect() }"),
            Message::new("user", "Thanks!"),
        ];
        match t.render(&msgs, true) {
            Ok(out) if out.len() > 1 << 30 => Err(format!("rendered {} bytes", out.len())),
            Ok(_) => Ok(Verdict::Loaded),
            Err(e) if e.to_string().is_empty() => Err("empty error".into()),
            Err(_) => Ok(Verdict::Refused),
        }
    });
    (log.join("; "), exec)
}

// ---------------------------------------------------------------------------------------
// Worker and parent.

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn env_seed(name: &str) -> Option<u64> {
    let s = std::env::var(name).ok()?;
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

fn worker<S>(target: &str, seeds: S, make: fn(&S, &mut Rng, &Path) -> (String, Exec)) {
    let secs = env_f64("TBOOST_FUZZ_SECS", 3.0);
    let base = env_seed("TBOOST_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let only = env_seed("TBOOST_FUZZ_CASE");
    let tmp = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let out = std::io::stdout();
    let (mut loaded, mut refused, mut failed) = (0u64, 0u64, 0u64);
    let mut i = 0u64;
    loop {
        if only.is_some() && i == 1 {
            break;
        }
        if only.is_none() && i >= MIN_CASES && start.elapsed().as_secs_f64() >= secs {
            break;
        }
        let seed = only.unwrap_or_else(|| case_seed(base, i));
        let (desc, exec) = make(&seeds, &mut Rng(seed), tmp.path());
        {
            let mut o = out.lock();
            writeln!(o, "FUZZ case {i} seed={seed:#018x}: {desc}").unwrap();
            o.flush().unwrap();
        }
        let t0 = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(exec));
        let took = t0.elapsed().as_secs_f64();
        let line = match r {
            Ok(Ok(Verdict::Loaded)) => {
                loaded += 1;
                format!("FUZZ ok {took:.3} loaded")
            }
            Ok(Ok(Verdict::Refused)) => {
                refused += 1;
                format!("FUZZ ok {took:.3} refused")
            }
            Ok(Err(v)) => {
                failed += 1;
                format!("FUZZ fail {}", v.replace('\n', "\\n"))
            }
            Err(p) => {
                failed += 1;
                format!("FUZZ fail panicked: {}", panic_message(&*p).replace('\n', "\\n"))
            }
        };
        let mut o = out.lock();
        writeln!(o, "{line}").unwrap();
        o.flush().unwrap();
        i += 1;
    }
    let mut o = out.lock();
    writeln!(
        o,
        "FUZZ end {target}: {i} cases in {:.1} s: {loaded} loaded and ran, {refused} refused with a clear error, {failed} failed",
        start.elapsed().as_secs_f64()
    )
    .unwrap();
    o.flush().unwrap();
}

/// Runs `target`'s cases in a child process and fails on any panic, abort, hang or unclear
/// error, naming the case.
fn parent(test_name: &str, target: &str) {
    let case_budget = Duration::from_secs_f64(env_f64("TBOOST_FUZZ_CASE_SECS", 30.0));
    let err_log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(WORKER_ENV, target)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err_log.reopen().unwrap()))
        .spawn()
        .expect("spawn the fuzz worker");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut current = String::from("(before the first case)");
    let mut failures: Vec<String> = vec![];
    let mut summary = None;
    let mut slowest = (0.0f64, String::new());
    loop {
        match rx.recv_timeout(case_budget) {
            Ok(line) => {
                if let Some(case) = line.strip_prefix("FUZZ case ") {
                    current = case.to_string();
                } else if let Some(rest) = line.strip_prefix("FUZZ ok ") {
                    let took: f64 = rest.split(' ').next().and_then(|t| t.parse().ok()).unwrap_or(0.0);
                    if took > slowest.0 {
                        slowest = (took, current.clone());
                    }
                } else if let Some(why) = line.strip_prefix("FUZZ fail ") {
                    failures.push(format!("case {current}\n    -> {why}"));
                } else if let Some(end) = line.strip_prefix("FUZZ end ") {
                    summary = Some(end.to_string());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                failures.push(format!(
                    "case {current}\n    -> did not finish within {case_budget:?} (a hang); the worker was killed"
                ));
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait().expect("wait for the fuzz worker");
    if summary.is_none() && failures.is_empty() {
        failures.push(format!("case {current}\n    -> the worker died ({status}): an abort or a crash in this case"));
    }
    if !failures.is_empty() {
        let stderr = std::fs::read_to_string(err_log.path()).unwrap_or_default();
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect();
        panic!(
            "fuzz {target}: {} failing case(s):\n{}\n\nreplay one with: TBOOST_FUZZ_CASE=<seed> cargo test --release --test fuzz {test_name} -- --nocapture\nworker stderr (last lines):\n{}",
            failures.len(),
            failures.join("\n"),
            tail.join("\n")
        );
    }
    println!("fuzz {}; slowest case {:.2} s: {}", summary.unwrap(), slowest.0, slowest.1);
}

fn run<S>(test_name: &str, target: &str, seeds: fn() -> S, make: fn(&S, &mut Rng, &Path) -> (String, Exec)) {
    match std::env::var(WORKER_ENV) {
        Ok(t) if t == target => worker(target, seeds(), make),
        // Another target's worker process: this test is not its job.
        Ok(_) => {}
        Err(_) => {
            // Seeds must be there (a missing file fails here with how to get it).
            drop(seeds());
            parent(test_name, target)
        }
    }
}

#[test]
fn fuzz_gguf() {
    run("fuzz_gguf", "gguf", gguf_seeds, gguf_case);
}

#[test]
fn fuzz_safetensors() {
    run("fuzz_safetensors", "safetensors", hf_seeds, safetensors_case);
}

#[test]
fn fuzz_config_json() {
    run("fuzz_config_json", "config", hf_seeds, config_case);
}

#[test]
fn fuzz_tokenizer_json() {
    run("fuzz_tokenizer_json", "tokenizer", tok_seeds, tokenizer_case);
}

#[test]
fn fuzz_chat_template() {
    run("fuzz_chat_template", "template", template_seeds, template_case);
}
