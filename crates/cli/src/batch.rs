//! `tboost batch`: every line of a JSONL file becomes a request on one engine; the engine
//! steps until all finish; one JSON line per request (input order) and a stats line.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;
use serde_json::{json, Value};

use super::EngineArgs;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::sample::{Grammar, SamplingParams};
use tboost_engine::sched::{Request, RequestId};
use tboost_engine::{Error, Result};

#[derive(Args)]
pub(crate) struct BatchArgs {
    /// Hugging Face directory or .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// JSONL file: one request per line (`{"tokens": [...], "max_tokens": 16, ...}`).
    #[arg(long)]
    requests: PathBuf,
    /// KV cache size in blocks (default: 512 MiB worth).
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Tokens per KV block (default: the backend's choice, 16 on the CPU).
    #[arg(long)]
    block_size: Option<usize>,
    #[arg(long, default_value_t = 64)]
    max_seqs: usize,
    #[arg(long, default_value_t = 512)]
    max_batched_tokens: usize,
    #[arg(long)]
    no_prefix_cache: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Keys a request line may have besides the sampling parameters.
const LINE_KEYS: &[&str] =
    &["tokens", "max_tokens", "stop", "priority", "ignore_eos", "eos_ids", "prompt_logprobs", "grammar"];
const SAMPLING_KEYS: &[&str] = &[
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "logit_bias",
];

#[derive(Deserialize)]
struct Line {
    tokens: Vec<u32>,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default)]
    stop: Vec<Vec<u32>>,
    #[serde(default)]
    priority: i32,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    eos_ids: Option<Vec<u32>>,
    #[serde(default)]
    prompt_logprobs: bool,
    /// `{"json_schema": "..."}`, `{"regex": "..."}`, `{"lark": "..."}` or `{"gbnf": "..."}`.
    #[serde(default)]
    grammar: Option<Grammar>,
}

fn default_max_tokens() -> usize {
    16
}

fn parse_line(n: usize, text: &str, file: &std::path::Path) -> Result<Request> {
    let at = |m: String| Error::format(file, format!("line {n}: {m}"));
    let v: Value = serde_json::from_str(text).map_err(|e| at(e.to_string()))?;
    let obj = v.as_object().ok_or_else(|| at("is not a JSON object".into()))?;
    if let Some(k) = obj.keys().find(|k| !LINE_KEYS.contains(&k.as_str()) && !SAMPLING_KEYS.contains(&k.as_str())) {
        return Err(at(format!("unknown field `{k}` (known: {}, {})", LINE_KEYS.join(", "), SAMPLING_KEYS.join(", "))));
    }
    // Sampling fields sit beside the request fields on one line; split them apart.
    let mut sampling: serde_json::Map<String, Value> =
        obj.iter().filter(|(k, _)| SAMPLING_KEYS.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
    // Without an explicit seed, each line gets its own (its line number), so identical
    // prompts still sample independently while a rerun reproduces the output.
    sampling.entry("seed").or_insert(json!(n));
    // Like `tboost run`, greedy unless a temperature is given.
    sampling.entry("temperature").or_insert(json!(0.0));
    let sampling: SamplingParams = serde_json::from_value(Value::Object(sampling)).map_err(|e| at(e.to_string()))?;
    let rest: serde_json::Map<String, Value> =
        obj.iter().filter(|(k, _)| LINE_KEYS.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
    let l: Line = serde_json::from_value(Value::Object(rest)).map_err(|e| at(e.to_string()))?;
    Ok(Request {
        prompt: l.tokens,
        sampling,
        max_tokens: l.max_tokens,
        eos_ids: l.eos_ids,
        ignore_eos: l.ignore_eos,
        stop_sequences: l.stop,
        priority: l.priority,
        tag: n as u64,
        prompt_logprobs: l.prompt_logprobs,
        grammar: l.grammar,
    })
}

pub(crate) fn run(a: BatchArgs) -> Result<()> {
    let file = std::fs::File::open(&a.requests).map_err(|e| Error::io(&a.requests, e))?;
    let mut requests = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(&a.requests, e))?;
        if !line.trim().is_empty() {
            requests.push(parse_line(i + 1, &line, &a.requests)?);
        }
    }
    let config = EngineConfig {
        kv_size: a.kv_blocks.map(KvSize::Blocks).unwrap_or(EngineConfig::default().kv_size),
        block_size: a.block_size,
        max_seqs: a.max_seqs,
        max_batched_tokens: a.max_batched_tokens,
        prefix_caching: !a.no_prefix_cache,
        queue_limit: requests.len().max(1),
        ..a.engine.engine_config()?
    };
    let engine = Engine::new(config)?;
    engine.load(&a.model)?;
    let mut ids = Vec::with_capacity(requests.len());
    for (i, r) in requests.into_iter().enumerate() {
        let line = r.tag;
        ids.push(
            engine.enqueue(r).map_err(|e| Error::invalid(format!("request on line {line} (#{i})"), e.to_string()))?,
        );
    }
    // Results stream out as requests finish, in input order: a finished request waits only
    // for the ones before it. They are built from the step events, so nothing depends on
    // how many finished-request records the engine keeps.
    let tok = engine.tokenizer().ok();
    let index: HashMap<RequestId, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut prompt_lps: HashMap<RequestId, Vec<f32>> = HashMap::new();
    let mut done: BTreeMap<usize, Value> = BTreeMap::new();
    let mut next = 0;
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock, v: &Value| -> Result<()> {
        writeln!(out, "{v}").map_err(|e| Error::io("stdout", e))
    };
    while engine.has_work()? {
        for e in engine.step()?.events {
            if let Some(t) = e.token {
                tokens.entry(e.id).or_default().push(t);
            }
            if !e.prompt_logprobs.is_empty() {
                prompt_lps.insert(e.id, e.prompt_logprobs);
            }
            let (Some(finish), Some(&i)) = (e.finish, index.get(&e.id)) else { continue };
            let generated = tokens.remove(&e.id).unwrap_or_default();
            let mut v = json!({
                "index": i, "id": e.id, "generated_ids": generated,
                "finish_reason": finish.as_str(), "timings": e.timings,
            });
            if let Some(t) = &tok {
                v["text"] = json!(t.decode(&generated)?);
            }
            if let Some(lp) = prompt_lps.remove(&e.id) {
                // Entry 0 has no context: null (JSON has no NaN).
                v["prompt_logprobs"] = json!(lp.iter().map(|x| x.is_finite().then_some(*x)).collect::<Vec<_>>());
            }
            if let Some(err) = e.error {
                v["error"] = json!(err);
            }
            done.insert(i, v);
        }
        while let Some(v) = done.remove(&next) {
            w(&mut out, &v)?;
            next += 1;
        }
        out.flush().map_err(|e| Error::io("stdout", e))?;
    }
    if next != ids.len() {
        return Err(Error::invalid("batch", format!("{} of {} requests never finished", ids.len() - next, ids.len())));
    }
    w(&mut out, &json!({ "stats": engine.stats()? }))
}
