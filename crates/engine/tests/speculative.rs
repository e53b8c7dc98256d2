//! Speculative decoding, prompt lookup (`spec_ngram`) and a draft model (`spec_draft_model`):
//! greedy and sampled output is the same token for token as without it (the same seed), on every
//! golden model and the demo model, beside other requests, with the prefix cache and through
//! preemption; rejected drafts give their blocks back.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::sample::SamplingParams;
use tboost_engine::sched::Request;

fn engine(path: &std::path::Path, cfg: EngineConfig) -> Engine {
    let e = Engine::new(cfg).unwrap();
    e.load(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    e
}

fn cfg(blocks: usize, spec: usize) -> EngineConfig {
    EngineConfig { threads: 2, kv_size: KvSize::Blocks(blocks), max_seqs: 16, spec_ngram: spec, ..Default::default() }
}

/// Runs the requests together, stepping by hand: after every step no sequence holds more
/// than one partially filled block (rejected drafts gave theirs back).
fn run(e: &Engine, reqs: &[Request]) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = reqs.iter().map(|r| e.enqueue(r.clone()).unwrap()).collect();
    let bs = e.stats().unwrap().block_size;
    while e.has_work().unwrap() {
        e.step().unwrap();
        for (id, positions, blocks) in e.kv_usage().unwrap() {
            assert!(blocks <= positions.div_ceil(bs) + 1, "request {id}: {blocks} blocks for {positions} positions");
        }
    }
    ids.iter().map(|&id| e.output(id).unwrap().tokens).collect()
}

fn greedy(prompt: Vec<u32>, n: usize) -> Request {
    Request { ignore_eos: true, ..Request::new(prompt, n) }
}

/// A prompt that repeats itself (what prompt lookup is for), of length `n`.
fn repetitive(n: usize, vocab: u32, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|j| 3 + ((j % 11) * 37 + salt) % (vocab - 3)).collect()
}

#[test]
fn greedy_ids_equal_non_speculative_on_the_golden_models() {
    let (mut drafted, mut kept) = (0, 0);
    for case in ["llama_gqa", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma3", "phi3", "llama_hd24"] {
        let g = golden(case);
        let vocab = g["params"]["vocab_size"].as_u64().unwrap() as u32;
        let mut reqs: Vec<Request> =
            g["prompts"].as_array().unwrap().iter().map(|p| greedy(ids(&p["token_ids"]), 24)).collect();
        reqs.push(greedy(repetitive(40, vocab, 5), 32));
        reqs.push(Request { stop_sequences: vec![vec![7, 7]], ..greedy(repetitive(30, vocab, 9), 20) });
        let want = run(&engine(&golden_dir(case), cfg(64, 0)), &reqs);
        let e = engine(&golden_dir(case), cfg(64, 4));
        let got = run(&e, &reqs);
        assert_eq!(got, want, "{case}: speculative greedy ids differ");
        let st = e.stats().unwrap();
        assert_eq!(st.kv_blocks_used, 0, "{case}: {st:?}");
        eprintln!("{case}: {} of {} drafted tokens kept", st.spec_accepted, st.spec_drafted);
        (drafted, kept) = (drafted + st.spec_drafted, kept + st.spec_accepted);
    }
    // Random weights rarely repeat themselves, but some continuations do: drafts were made,
    // kept and rejected, so both paths of the verification ran.
    assert!(kept > 0 && kept < drafted, "{kept} of {drafted} drafted tokens kept");
}

/// Sampled requests beside greedy ones, with a cached prefix, and in a pool so small that
/// requests are preempted: the same greedy ids, the same sampled ids for the same seeds
/// (each row of a verification draws the token it emits: one draw per token, as without
/// speculation).
#[test]
fn speculation_keeps_outputs_with_batching_prefix_cache_and_preemption() {
    let path = golden_dir("llama_gqa");
    let mut reqs: Vec<Request> = (0..8).map(|i| greedy(repetitive(20 + 5 * i, 640, i as u32), 24)).collect();
    for i in 0..3 {
        let sampling = SamplingParams { temperature: 0.8, seed: 40 + i, ..SamplingParams::greedy() };
        reqs.push(Request { sampling, ..greedy(repetitive(25, 640, 3), 16) });
    }
    // Shares its first blocks with request 4.
    let mut shared = repetitive(40, 640, 4);
    shared.extend([9, 9, 9]);
    reqs.push(greedy(shared, 24));
    let want = run(&engine(&path, cfg(256, 0)), &reqs);
    let e = engine(&path, cfg(256, 6));
    assert_eq!(run(&e, &reqs), want, "batched with a prefix cache");
    assert!(e.stats().unwrap().spec_accepted > 0, "{:?}", e.stats().unwrap());
    let mut small = cfg(14, 6);
    small.prefix_caching = false;
    let e = engine(&path, small);
    assert_eq!(run(&e, &reqs), want, "through preemption");
    let st = e.stats().unwrap();
    assert!(st.preemptions_total > 0, "no preemption: {st:?}");
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");

    // Sampled requests alone, cool enough to repeat themselves: drafts are kept, and every
    // request's tokens are those of the same seed without speculation.
    let sampled: Vec<Request> = (0..6)
        .map(|i| {
            let sampling = SamplingParams { temperature: 0.3, top_k: 20, seed: 7 + i, ..SamplingParams::greedy() };
            Request { sampling, ..greedy(repetitive(30 + i as usize, 640, 2), 32) }
        })
        .collect();
    let want = run(&engine(&path, cfg(256, 0)), &sampled);
    let e = engine(&path, cfg(256, 6));
    assert_eq!(run(&e, &sampled), want, "sampled requests");
    let st = e.stats().unwrap();
    assert!(st.spec_accepted > 0 && st.spec_accepted < st.spec_drafted, "sampled drafts: {st:?}");
}

/// The demo model rewriting a function it was given (scripts/bench-speculative.sh's request):
/// greedy and sampled ids equal non-speculative, and many drafts are kept (the output copies
/// the input).
#[test]
fn demo_model_code_edit_keeps_its_greedy_and_sampled_tokens() {
    let path = demo_model();
    let probe = engine(&path, cfg(64, 0));
    let text = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
                <|im_start|>user\nRename the variable `total` to `running_sum` in this function and return the \
                whole function:\n\ndef summarize(values, weights=None):\n    total = 0.0\n    count = 0\n    \
                for i, v in enumerate(values):\n        w = 1.0 if weights is None else weights[i]\n        \
                if v is None:\n            continue\n        total += w * v\n        count += 1\n    \
                if count == 0:\n        return {\"total\": 0.0, \"count\": 0, \"mean\": None}\n    \
                mean = total / count\n    return {\"total\": total, \"count\": count, \"mean\": mean}<|im_end|>\n\
                <|im_start|>assistant\n";
    let prompt = probe.tokenize(text, false).unwrap();
    let sampling = SamplingParams { temperature: 0.7, top_p: 0.9, seed: 3, ..SamplingParams::default() };
    let reqs = [Request::new(prompt.clone(), 160), Request { sampling, ..Request::new(prompt, 160) }];
    let want = run(&probe, &reqs);
    let e = engine(&path, cfg(64, 8));
    assert_eq!(run(&e, &reqs), want, "demo model: speculative greedy ids differ");
    let st = e.stats().unwrap();
    eprintln!(
        "demo model: {} of {} drafted tokens kept, {} steps for {} tokens",
        st.spec_accepted,
        st.spec_drafted,
        st.steps,
        want[0].len()
    );
    assert!(st.spec_accepted * 5 >= st.spec_drafted * 2, "under 40% of the drafts kept on a copying task: {st:?}");
    assert!(st.steps * 3 <= want[0].len() as u64 * 2, "speculation saved under a third of the steps: {st:?}");
}

fn draft_cfg(blocks: usize, draft: &str, tokens: usize) -> EngineConfig {
    EngineConfig {
        spec_draft_model: golden_dir(draft).display().to_string(),
        spec_draft_tokens: tokens,
        prefix_caching: false,
        ..cfg(blocks, 0)
    }
}

/// A draft model (`spec_draft_model`) on two synthetic pairs over llama_gqa: its own weights
/// in bf16 (a close draft: most drafts kept) and qwen3_moe's random weights with the same
/// vocabulary size (a poor one: most rejected). Greedy and seeded sampled requests batched
/// together give the tokens of a run without speculation, also in a pool small enough to
/// preempt; the draft model's own pool is empty once they end.
#[test]
fn a_draft_model_keeps_greedy_and_sampled_outputs_and_gives_its_blocks_back() {
    let path = golden_dir("llama_gqa");
    let mut reqs: Vec<Request> = (0..6).map(|i| greedy(repetitive(12 + 7 * i, 640, i as u32), 24)).collect();
    for i in 0..3 {
        let sampling = SamplingParams { temperature: 0.7, top_k: 40, seed: 90 + i, ..SamplingParams::greedy() };
        reqs.push(Request { sampling, ..greedy(repetitive(21, 640, 8), 20) });
    }
    let want = run(&engine(&path, cfg(256, 0)), &reqs);
    for (draft, blocks, close) in
        [("llama_gqa_bf16", 256, true), ("qwen3_moe", 256, false), ("llama_gqa_bf16", 16, true)]
    {
        let e = engine(&path, draft_cfg(blocks, draft, 4));
        assert_eq!(run(&e, &reqs), want, "draft {draft}, {blocks} blocks");
        let st = e.stats().unwrap();
        eprintln!(
            "draft {draft} ({blocks} blocks): {} of {} drafted tokens kept, {} preemptions",
            st.spec_accepted, st.spec_drafted, st.preemptions_total
        );
        assert!(st.spec_drafted > 0, "{draft}: nothing drafted: {st:?}");
        if close {
            assert!(st.spec_accepted * 2 > st.spec_drafted, "{draft}: a close draft kept less than half: {st:?}");
        } else {
            assert!(st.spec_accepted < st.spec_drafted, "{draft}: a poor draft never rejected: {st:?}");
        }
        if blocks == 16 {
            assert!(st.preemptions_total > 0, "no preemption with {blocks} blocks: {st:?}");
        }
        assert_eq!((st.kv_blocks_used, st.spec_draft_blocks_used), (0, 0), "{draft}: {st:?}");
    }
}

/// A draft model whose vocabulary differs, a missing file, and a draft model beside prompt
/// lookup are refused at load, naming the key and the file.
#[test]
fn a_draft_model_that_cannot_serve_is_refused_at_load_naming_it() {
    let path = golden_dir("llama_gqa");
    let cases = [
        (draft_cfg(64, "mistral", 4), "vocabulary of 512 tokens"),
        (EngineConfig { spec_draft_model: "/nonexistent/draft.gguf".into(), ..cfg(64, 0) }, "/nonexistent/draft.gguf"),
        (EngineConfig { spec_ngram: 4, ..draft_cfg(64, "llama_gqa_bf16", 4) }, "exclusive"),
    ];
    for (c, want) in cases {
        let e = Engine::new(c).unwrap();
        let err = e.load(&path).unwrap_err().to_string();
        assert!(err.contains("spec_draft_model") && err.contains(want), "{err}");
    }
}
