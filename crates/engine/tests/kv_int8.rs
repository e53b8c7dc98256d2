//! The int8 KV cache (`kv_dtype` q8_0): what it keeps of the float caches' results, that the
//! prefix cache and preemption behave as with any other cache type, the plan's fallback where
//! the model cannot hold it, and the bytes it saves.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::backend::DType;
use tboost_engine::engine::keys::Raw;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::kv::KvPools;
use tboost_engine::model::Model;
use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
use tboost_engine::sched::Request;
use tboost_engine::session::Session;

/// Largest distance of the last-position logits from the float64 reference with a q8_0 cache,
/// as a share of the largest reference logit, over the golden cases whose head_dim holds whole
/// blocks. The f32 cache stays within 1e-3 absolute. Int8 K and V move each (rotated) attention
/// input by up to half a step of its 32-value block; these random-weight models have no
/// outlier channels for the rotation to tame, and their logits moved by 0.7-1.1% of the
/// largest (mistral 8.6e-2, mixtral 6.9e-2, qwen2 1.2e-1, largest logits 10-11).
const TOL_Q8_KV: f32 = 2e-2;

fn q8(opts: PlanOptions) -> PlanOptions {
    PlanOptions { kv_dtype: Some(DType::Q8_0), ..opts }
}

#[test]
fn golden_cases_stay_within_the_int8_tolerance() {
    for case in ["mistral", "mixtral", "qwen2"] {
        let g = golden(case);
        let vocab = g["params"]["vocab_size"].as_u64().unwrap() as usize;
        let mut r = runner_with(&golden_dir(case), &q8(PlanOptions::default()), 2, 64);
        assert_eq!(r.plan.kv_dtype, DType::Q8_0, "{case}: the plan keeps the int8 cache");
        let mut worst = 0f32;
        let mut scale = 0f32;
        for p in g["prompts"].as_array().unwrap() {
            let prompt = ids(&p["token_ids"]);
            let mut s = Session::new(&mut r, prompt.len()).unwrap();
            let logits = s.feed(&prompt, false).unwrap();
            let want = floats(&p["last_logits"]);
            let d = max_abs_diff(&logits[logits.len() - vocab..], &want);
            worst = worst.max(d);
            scale = want.iter().fold(scale, |m, v| m.max(v.abs()));
        }
        eprintln!("{case}: q8_0 KV last_logits max abs diff {worst:.2e}, largest logit {scale:.2}");
        assert!(
            worst <= TOL_Q8_KV * scale,
            "{case}: q8_0 KV last_logits max abs diff {worst} > {TOL_Q8_KV} of the largest logit {scale}"
        );
        // The cache really is int8: it must not reproduce the f32 cache's logits bit for bit.
        assert!(worst > 1e-6, "{case}: q8_0 KV gave the float cache's logits exactly (was it quantized?)");
    }
}

#[test]
fn a_head_dim_without_whole_blocks_falls_back_to_f16_and_says_why() {
    // llama_hd24: head_dim 24; llama_gqa: 16. Neither holds a 32-value block per head row.
    for (case, hd) in [("llama_hd24", 24), ("llama_gqa", 16)] {
        let r = runner_with(&golden_dir(case), &q8(PlanOptions::default()), 2, 16);
        assert_eq!(r.plan.kv_dtype, DType::F16, "{case}");
        let why = r.plan.kv_dtype_reason.clone().unwrap_or_default();
        assert!(why.contains("q8_0") && why.contains(&format!("head_dim {hd}")), "{case}: reason {why:?}");
        assert!(r.plan.to_text().contains("kv cache fallback"), "{case}: tboost plan shows the fallback");
    }
    // Asked for nothing special, nothing is reported.
    let r = runner_with(&golden_dir("qwen2"), &q8(PlanOptions::default()), 2, 16);
    assert_eq!(r.plan.kv_dtype_reason, None);
}

#[test]
fn the_config_key_and_the_engine_take_q8_0() {
    let mut cfg = EngineConfig::default();
    cfg.set("kv_dtype", Raw::Str("q8_0")).unwrap();
    assert_eq!(cfg.kv_dtype, Some(DType::Q8_0));
    let err = cfg.set("kv_dtype", Raw::Str("q4_0")).unwrap_err().to_string();
    assert!(err.contains("kv_dtype") && err.contains("q8_0"), "{err}");
}

/// A q8_0 cache holds 34 bytes per 32 values: 53% of f16's bytes per token.
#[test]
fn the_int8_cache_takes_about_half_of_f16s_bytes() {
    let m = Model::load(&golden_dir("mistral")).unwrap();
    let (q, h) = (KvPools::bytes_per_token(&m.config, DType::Q8_0), KvPools::bytes_per_token(&m.config, DType::F16));
    assert_eq!(q * 64, h * 34, "q8_0 {q} vs f16 {h} bytes per token");
}

fn gen(path: &std::path::Path, cfg: EngineConfig, reqs: &[Request]) -> (Engine, Vec<Vec<u32>>) {
    let e = Engine::new(cfg).unwrap();
    e.load(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let ids: Vec<u64> = reqs.iter().map(|r| e.enqueue(r.clone()).unwrap()).collect();
    e.run_to_completion().unwrap();
    let out = ids.iter().map(|&id| e.output(id).unwrap().tokens).collect();
    (e, out)
}

fn cfg_q8(blocks: usize) -> EngineConfig {
    EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(blocks),
        kv_dtype: Some(DType::Q8_0),
        max_batched_tokens: 512,
        max_seqs: 32,
        ..Default::default()
    }
}

fn prompt(len: usize, vocab: u64, salt: u64) -> Vec<u32> {
    (0..len as u64).map(|j| 3 + ((j * 104729 + salt * 7919) % (vocab - 3)) as u32).collect()
}

/// The prefix cache reuses int8 blocks: a second request sharing four blocks gets the tokens
/// an engine without the cache gives, computing only its suffix.
#[test]
fn prefix_cache_reuses_int8_blocks() {
    let path = golden_dir("qwen2");
    let shared = prompt(64, 896, 5);
    let (mut a, mut b) = (shared.clone(), shared.clone());
    a.extend([10, 11, 12]);
    b.extend([20, 21, 22, 23]);
    let reqs = [Request { ignore_eos: true, ..Request::new(a, 8) }, Request { ignore_eos: true, ..Request::new(b, 8) }];
    let mut nocache = cfg_q8(64);
    nocache.prefix_caching = false;
    let (_, want) = gen(&path, nocache, &reqs);
    let e = Engine::new(cfg_q8(64)).unwrap();
    e.load(&path).unwrap();
    let mut got = Vec::new();
    let mut hits = 0;
    for r in &reqs {
        let before = e.stats().unwrap().prefix_cache_hit_tokens;
        let id = e.enqueue(r.clone()).unwrap();
        e.run_to_completion().unwrap();
        got.push(e.output(id).unwrap().tokens);
        hits = e.stats().unwrap().prefix_cache_hit_tokens - before;
    }
    assert_eq!(got, want, "tokens with the prefix cache over an int8 cache");
    assert_eq!(hits, 64, "the second request reuses the four shared blocks");
}

/// Preempted and recomputed requests get the tokens they get with room to spare.
#[test]
fn preemption_over_an_int8_cache_keeps_outputs_identical() {
    let path = golden_dir("qwen2");
    let reqs: Vec<Request> = [40, 35, 50, 20, 45, 30, 38, 41]
        .iter()
        .enumerate()
        .map(|(i, &n)| Request { ignore_eos: true, ..Request::new(prompt(n, 896, 9 + i as u64), 24) })
        .collect();
    let (_, want) = gen(&path, cfg_q8(256), &reqs);
    let mut small = cfg_q8(12);
    small.prefix_caching = false;
    let (e, got) = gen(&path, small, &reqs);
    assert_eq!(got, want, "tokens after preemptions");
    let st = e.stats().unwrap();
    assert!(st.preemptions_total > 0, "no preemption: {st:?}");
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
}

/// The demo model (head_dim 64) keeps the f32 cache's greedy ids on its four golden prompts,
/// 48 tokens each, at the same (exact) precision, up to a near tie: where the ids part, the
/// f32 cache's logit of its token leads the int8 cache's pick by at most the int8 tolerance
/// (the golden README's margin rule). After that the continuations may differ.
#[test]
fn demo_model_greedy_ids_equal_the_f32_caches() {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(shared_dir().join("models/qwen-demo-golden.json")).expect("qwen-demo-golden.json"),
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap().iter().map(|p| ids(&p["prompt_ids"])).collect();
    let reqs: Vec<Request> = prompts.iter().map(|p| Request::new(p.clone(), 48)).collect();
    let base = EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(64),
        precision: PrecisionPolicy::Exact,
        ..Default::default()
    };
    let (_, want) = gen(&demo_model(), EngineConfig { kv_dtype: Some(DType::F32), ..base.clone() }, &reqs);
    let (_, got) = gen(&demo_model(), EngineConfig { kv_dtype: Some(DType::Q8_0), ..base }, &reqs);
    let r = runner_with(&demo_model(), &q8(PlanOptions::default()), 1, 4);
    assert_eq!(r.plan.kv_dtype, DType::Q8_0, "the demo model runs the int8 cache");
    let f32_opts =
        PlanOptions { kv_dtype: Some(DType::F32), precision: PrecisionPolicy::Exact, ..PlanOptions::default() };
    let mut reference = runner_with(&demo_model(), &f32_opts, 2, 64);
    let mut whole = 0;
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.len(), b.len(), "prompt {i}: lengths");
        let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        if same == b.len() {
            whole += 1;
            eprintln!("prompt {i}: q8_0 KV equals f32 KV for all {same} tokens");
            continue;
        }
        // The f32 cache's logits at the step where the ids part.
        let mut fed = prompts[i].clone();
        fed.extend_from_slice(&b[..same]);
        let mut s = Session::new(&mut reference, fed.len()).unwrap();
        let logits = s.feed(&fed, false).unwrap();
        let vocab = r.cfg.vocab_size;
        let last = &logits[logits.len() - vocab..];
        let largest = last.iter().fold(0f32, |m, v| m.max(v.abs()));
        let margin = last[b[same] as usize] - last[a[same] as usize];
        eprintln!(
            "prompt {i}: q8_0 KV equals f32 KV for {same} of {} tokens, then a near tie: f32 logit margin {margin:.3} \
             ({:.2}% of the largest logit {largest:.2})",
            b.len(),
            100.0 * margin / largest
        );
        assert!(
            margin <= TOL_Q8_KV * largest,
            "prompt {i}: at token {same} the int8 cache picked {} where the f32 cache picks {} by a margin of \
             {margin} > {TOL_Q8_KV} of the largest logit {largest}: not a near tie",
            a[same],
            b[same]
        );
    }
    eprintln!("{whole} of {} prompts: identical greedy ids", want.len());
}
