//! What a request can ask of the engine besides tokens: prompt logprobs (checked against the
//! golden float64 references and against the session's all-position logits), and the timings
//! every finish event carries.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::engine::{Engine, EngineConfig, Event, KvSize};
use tboost_engine::sample::FinishReason;
use tboost_engine::sched::Request;
use tboost_engine::session::Session;

fn engine(case: &str, cfg: EngineConfig) -> Engine {
    let e = Engine::new(cfg).unwrap();
    e.load(&golden_dir(case)).unwrap_or_else(|err| panic!("{case}: {err}"));
    e
}

fn cfg(blocks: usize, max_batched: usize) -> EngineConfig {
    EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(blocks),
        max_batched_tokens: max_batched,
        max_seqs: 8,
        ..Default::default()
    }
}

fn scored(prompt: Vec<u32>) -> Request {
    Request { ignore_eos: true, prompt_logprobs: true, ..Request::new(prompt, 1) }
}

/// Runs `reqs` together; returns each one's prompt logprobs and all events.
fn prompt_logprobs(e: &Engine, reqs: &[Request]) -> (Vec<Vec<f32>>, Vec<Event>) {
    let ids: Vec<u64> = reqs.iter().map(|r| e.enqueue(r.clone()).unwrap()).collect();
    let events = e.run_to_completion().unwrap();
    let lps = ids
        .iter()
        .map(|&id| {
            let from_event = events.iter().find(|ev| ev.id == id && !ev.prompt_logprobs.is_empty());
            let rec =
                e.output(id).unwrap().prompt_logprobs.unwrap_or_else(|| panic!("request {id}: no prompt logprobs"));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                from_event.map(|ev| bits(&ev.prompt_logprobs)),
                Some(bits(&rec)),
                "request {id}: event and record differ"
            );
            rec
        })
        .collect();
    (lps, events)
}

/// Each golden prompt followed by its first float64 greedy token, scored as a prompt: the
/// logprob of that last token is the log-softmax of the reference's last logits (f64) at it;
/// every other position equals the session's all-position logits' log-softmax; entry 0 is NaN.
#[test]
fn prompt_logprobs_match_the_f64_reference_and_the_session() {
    for case in ["llama_gqa", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma3", "phi3", "llama_hd24"] {
        let g = golden(case);
        let prompts = g["prompts"].as_array().unwrap();
        let seqs: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut s = ids(&p["token_ids"]);
                s.push(ids(&p["greedy"]["tokens_f64"])[0]);
                s
            })
            .collect();
        let e = engine(case, cfg(64, 512));
        let (lps, _) = prompt_logprobs(&e, &seqs.iter().cloned().map(scored).collect::<Vec<_>>());
        let mut r = runner(&golden_dir(case));
        let vocab = g["params"]["vocab_size"].as_u64().unwrap() as usize;
        let mut worst = 0f64;
        for ((p, seq), lp) in prompts.iter().zip(&seqs).zip(&lps) {
            let name = p["name"].as_str().unwrap();
            assert_eq!(lp.len(), seq.len(), "{case} {name}: one logprob per prompt token");
            assert!(lp[0].is_nan(), "{case} {name}: entry 0 has no context and must be NaN, got {}", lp[0]);
            let n = seq.len() - 1;
            let want = log_softmax_at(&floats(&p["last_logits"]), seq[n]);
            let d = (lp[n] as f64 - want).abs();
            worst = worst.max(d);
            // The golden tolerance is 1e-3 on logits; a log-softmax moves by at most twice that.
            assert!(d <= 2e-3, "{case} {name}: logprob of the last token {} vs f64 {want} ({d:.2e})", lp[n]);
            let mut s = Session::new(&mut r, seq.len()).unwrap();
            let all = s.feed(seq, true).unwrap();
            for i in 1..seq.len() {
                let want = log_softmax_at(&all[(i - 1) * vocab..i * vocab], seq[i]);
                let d = (lp[i] as f64 - want).abs();
                assert!(d <= 1e-4, "{case} {name}: position {i}: {} vs the session's {want} ({d:.2e})", lp[i]);
            }
        }
        eprintln!("{case}: prompt logprob of the reference's next token within {worst:.2e} of f64");
    }
}

/// Chunked prefill (8 tokens a step beside other requests), preemption in the middle of a
/// prompt (a pool too small for all of them) and a prefix already in the cache change nothing:
/// a prompt-logprobs request computes its whole prompt and scores each position once.
#[test]
fn prompt_logprobs_survive_chunking_preemption_and_the_prefix_cache() {
    // The engine tests' preemption table: 24 decodes cross a block edge, more requests than
    // 12 blocks of 16 hold at once.
    let lens = [40u32, 35, 50, 20, 45, 30, 38, 41];
    let seqs: Vec<Vec<u32>> =
        lens.iter().enumerate().map(|(i, &n)| (0..n).map(|j| 3 + (i as u32 * 131 + j * 17) % 600).collect()).collect();
    let reqs: Vec<Request> = seqs.iter().cloned().map(|p| Request { max_tokens: 24, ..scored(p) }).collect();
    let (want, _) = prompt_logprobs(&engine("llama_gqa", cfg(64, 512)), &reqs);

    let (chunked, _) = prompt_logprobs(&engine("llama_gqa", cfg(64, 8)), &reqs);
    let mut tiny = cfg(12, 24);
    tiny.prefix_caching = false;
    let e = engine("llama_gqa", tiny);
    let (preempted, events) = prompt_logprobs(&e, &reqs);
    assert!(e.stats().unwrap().preemptions_total > 0, "no preemption happened: {:?}", e.stats().unwrap());
    let preemptions: u32 = events.iter().filter_map(|ev| ev.timings).map(|t| t.preemptions).sum();
    assert_eq!(preemptions as u64, e.stats().unwrap().preemptions_total, "the finish events count every preemption");

    // A cached prefix (the same prompt ran before) is not reused for a scored request.
    let e = engine("llama_gqa", cfg(64, 512));
    e.enqueue(Request { ignore_eos: true, ..Request::new(seqs[0].clone(), 1) }).unwrap();
    e.run_to_completion().unwrap();
    let (again, events) = prompt_logprobs(&e, &reqs[..1]);
    let t = events.iter().find_map(|ev| ev.timings).unwrap();
    assert_eq!(t.cached_prompt_tokens, 0, "a scored request must not take the cached prefix");

    for (what, got) in [("chunked", &chunked), ("preempted", &preempted), ("after a cached run", &again)] {
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            let d = g.iter().zip(w).skip(1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d <= 1e-4, "{what}: request {i}: prompt logprobs differ by {d:.2e}");
            assert_eq!(g.len(), w.len(), "{what}: request {i}");
        }
    }
}

/// Every finish event carries the request's timings: queued <= first token <= total, the
/// prompt length, the prefix-cache tokens and the preemptions; a request cancelled before it
/// started has no first token.
#[test]
fn finish_events_carry_timings() {
    let e = engine("llama_gqa", cfg(64, 512));
    let prompt: Vec<u32> = (0..37).map(|j| 3 + j * 7).collect();
    let a = e.enqueue(Request { ignore_eos: true, ..Request::new(prompt.clone(), 5) }).unwrap();
    let events = e.run_to_completion().unwrap();
    let last = events.iter().rfind(|ev| ev.id == a).unwrap();
    assert_eq!(last.finish, Some(FinishReason::Length));
    assert!(events.iter().filter(|ev| ev.finish.is_none()).all(|ev| ev.timings.is_none()), "timings only at the end");
    let t = last.timings.expect("the finish event carries timings");
    let first = t.first_token_ms.expect("it produced tokens");
    assert!(0.0 <= t.queued_ms && t.queued_ms <= first && first <= t.total_ms, "{t:?}");
    assert_eq!((t.prompt_tokens, t.cached_prompt_tokens, t.preemptions), (37, 0, 0), "{t:?}");
    assert_eq!(e.output(a).unwrap().timings, Some(t), "the request's record keeps them");

    // The same prompt again: the prefix cache supplies its full blocks (all but the last token).
    let b = e.enqueue(Request { ignore_eos: true, ..Request::new(prompt.clone(), 2) }).unwrap();
    let events = e.run_to_completion().unwrap();
    let t = events.iter().rfind(|ev| ev.id == b).and_then(|ev| ev.timings).unwrap();
    let bs = e.stats().unwrap().block_size;
    assert_eq!(t.cached_prompt_tokens, (37 - 1) / bs * bs, "{t:?}");

    // Cancelled while waiting: no first token, all of its life queued.
    let c = e.enqueue(Request::new(prompt, 4)).unwrap();
    e.cancel(c).unwrap();
    let events = e.run_to_completion().unwrap();
    let ev = events.iter().find(|ev| ev.id == c).unwrap();
    assert_eq!(ev.finish, Some(FinishReason::Cancelled));
    let t = ev.timings.unwrap();
    assert_eq!(t.first_token_ms, None, "{t:?}");
    assert!(t.queued_ms <= t.total_ms, "{t:?}");
}

/// Logit bias: banning a request's greedy token gives the runner-up instead, a large bias
/// forces a token, and the logprobs stay those of the raw model. Bad entries are refused
/// at enqueue, naming the entry.
#[test]
fn logit_bias_bans_and_forces_tokens() {
    use tboost_engine::sample::SamplingParams;
    let e = engine("llama_gqa", cfg(64, 512));
    let prompt: Vec<u32> = (0..9).map(|j| 3 + j * 41).collect();
    let with = |bias: Vec<(u32, f32)>| Request {
        ignore_eos: true,
        sampling: SamplingParams { logprobs: Some(2), logit_bias: bias, ..SamplingParams::greedy() },
        ..Request::new(prompt.clone(), 1)
    };
    let first = |r: Request| {
        let id = e.enqueue(r).unwrap();
        let evs = e.run_to_completion().unwrap();
        evs.into_iter().find(|ev| ev.id == id && ev.token.is_some()).unwrap()
    };
    let plain = first(with(vec![]));
    let (best, second) = (plain.top_logprobs[0].0, plain.top_logprobs[1].0);
    assert_eq!(plain.token, Some(best));
    let banned = first(with(vec![(best, f32::NEG_INFINITY)]));
    assert_eq!(banned.token, Some(second), "the runner-up once the best is banned");
    assert_eq!(banned.top_logprobs, plain.top_logprobs, "logprobs are the raw model's");
    let forced = first(with(vec![(17, 1000.0)]));
    assert_eq!(forced.token, Some(17));
    for (bias, what) in [(vec![(640, 1.0)], "vocabulary size"), (vec![(5, f32::NAN)], "-inf to ban")] {
        let err = e.enqueue(with(bias)).unwrap_err().to_string();
        assert!(err.contains("logit_bias[0]") && err.contains(what), "{err}");
    }
}
