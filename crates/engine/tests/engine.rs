//! The engine: continuous batching, prefix caching, preemption, chunked prefill,
//! cancellation and request-level determinism, checked from the outside.
//!
//! The scenarios that are about the engine rather than one backend (batch invariance, golden
//! greedy continuations, prefix cache, preemption, cancellation) run on every backend present
//! (`tboost_testkit::backends`: the CPU, and the Ascend backend on the CANN SIMULATOR), each
//! assertion naming the backend. Block counts follow the backend's block size (16 on the CPU,
//! 128 for Ascend's attention). The simulator computes in f64 loops on the host, far slower
//! than the CPU, so where a scenario's size is a choice it takes a smaller table there, with
//! the same structure.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::plan::PrecisionPolicy;
use tboost_engine::sample::{FinishReason, SamplingParams};
use tboost_engine::sched::Request;
use tboost_engine::Error;
use tboost_testkit::backends::{self, Kind, TestBackend};

fn engine(path: &std::path::Path, cfg: EngineConfig) -> Engine {
    let e = Engine::new(cfg).unwrap();
    e.load(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    e
}

fn cfg(blocks: usize, max_batched: usize) -> EngineConfig {
    EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(blocks),
        max_batched_tokens: max_batched,
        max_seqs: 32,
        ..Default::default()
    }
}

fn greedy(prompt: Vec<u32>, n: usize) -> Request {
    Request { ignore_eos: true, ..Request::new(prompt, n) }
}

/// Runs requests together on one engine; returns each one's tokens in order.
fn run_all(e: &Engine, reqs: &[Request]) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = reqs.iter().map(|r| e.enqueue(r.clone()).unwrap()).collect();
    e.run_to_completion().unwrap();
    ids.iter().map(|&id| e.output(id).unwrap().tokens).collect()
}

/// Deterministic prompts of the given lengths with ids in [3, vocab).
fn prompts(lens: &[usize], vocab: usize, salt: u64) -> Vec<Vec<u32>> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n).map(|j| 3 + ((i as u64 * 7919 + j as u64 * 104729 + salt) % (vocab as u64 - 3)) as u32).collect()
        })
        .collect()
}

const LENS: [usize; 16] = [1, 300, 17, 64, 5, 129, 250, 33, 2, 16, 95, 200, 48, 7, 160, 281];
/// The simulator's table: fewer and shorter requests, still chunked beside decodes.
const LENS_SIM: [usize; 8] = [1, 300, 17, 129, 5, 250, 33, 64];

/// Requests of `lens` prompt tokens, `tokens` ids each, alone on fresh engines and together
/// on one with a small token budget: the same ids.
fn batch_invariance_on(
    b: &TestBackend,
    path: &std::path::Path,
    vocab: usize,
    precision: PrecisionPolicy,
    lens: &[usize],
    tokens: usize,
) {
    let reqs: Vec<Request> = prompts(lens, vocab, 11).into_iter().map(|p| greedy(p, tokens)).collect();
    let cfg =
        |kv_tokens, max_batched| EngineConfig { precision, kv_size: KvSize::Tokens(kv_tokens), ..cfg(0, max_batched) };
    let alone: Vec<Vec<u32>> =
        reqs.iter().map(|r| run_all(&b.engine(cfg(1024, 512), path), std::slice::from_ref(r)).remove(0)).collect();
    // Together, with a small token budget so prompts are prefilled in chunks next to decodes.
    let together = run_all(&b.engine(cfg(8192, 96), path), &reqs);
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "[{b}] {}: request {i} (prompt {} tokens) differs in a batch", path.display(), lens[i]);
    }
}

/// On the CPU only: about its GGUF and fast-precision kernels (the Ascend backend runs GGUF
/// block types on the CPU beside it).
fn batch_invariance(path: &std::path::Path, vocab: usize, precision: PrecisionPolicy) {
    batch_invariance_on(&backends::cpu(), path, vocab, precision, &LENS, 12);
}

#[test]
fn batch_invariance_golden_models() {
    for b in backends::present() {
        let turn = b.exclusive();
        // On the simulator: the attention (llama_gqa) and MoE (mixtral) paths.
        let (cases, lens, tokens): (&[&str], &[usize], usize) = match b.kind {
            Kind::Cpu => (CASES, &LENS, 12),
            Kind::AscendSim => (&["llama_gqa", "mixtral"], &LENS_SIM, 8),
        };
        for case in cases {
            let vocab = golden(case)["params"]["vocab_size"].as_u64().unwrap() as usize;
            batch_invariance_on(&b, &golden_dir(case), vocab, PrecisionPolicy::Auto, lens, tokens);
        }
        b.check_released("batch_invariance_golden_models");
        drop(turn);
    }
}

#[test]
fn batch_invariance_gguf_models() {
    batch_invariance(&model_file("llama-2-tiny-random.gguf"), 32000, PrecisionPolicy::Auto);
    batch_invariance(&model_file("stories260K-placeholder-vocab.gguf"), 512, PrecisionPolicy::Auto);
}

/// F16 weights at `fast` (on AMX-BF16 CPUs, `gemm::dense::amx_pair_panels`): decode steps run the
/// vector replay of the tile products, prefill chunks the tiles themselves, and a request's
/// ids must not depend on which ran them.
#[test]
fn batch_invariance_f16_at_fast_precision() {
    batch_invariance(&model_file("llama-2-tiny-random.gguf"), 32000, PrecisionPolicy::Fast);
}

/// Golden greedy ids through the engine, the prompts batched, under the margin rule with the
/// backend's τ; and each request alone on a fresh engine gives the same ids.
#[test]
fn golden_greedy_continuations_through_the_engine() {
    golden_greedy_on_every_backend(CASES, "golden_greedy_continuations_through_the_engine");
}

/// The same for Qwen3, Qwen3-MoE, Gemma 3 and Phi-3: on the Ascend SIMULATOR their slots run on
/// the device too (q/k norm, GeGLU, the embedding scale, sliding-window attention with batched
/// decodes under the window's mask, LongRoPE tables), and the ids follow the reference under its τ.
#[test]
fn new_architecture_greedy_continuations_through_the_engine() {
    golden_greedy_on_every_backend(NEW_ARCH_CASES, "new_architecture_greedy_continuations_through_the_engine");
}

fn golden_greedy_on_every_backend(cases: &[&str], test: &str) {
    for b in backends::present() {
        let turn = b.exclusive();
        for &case in cases {
            let g = golden(case);
            let layers = g["params"]["num_hidden_layers"].as_u64().expect("num_hidden_layers") as usize;
            let path = golden_dir(case);
            let cfg = EngineConfig { kv_size: KvSize::Tokens(4096), ..cfg(0, 64) };
            let e = b.engine(cfg.clone(), &path);
            assert_eq!(e.plan().unwrap().device.backend, b.name, "[{b}] {case}: the plan's backend");
            let ps = g["prompts"].as_array().unwrap();
            let reqs: Vec<Request> = ps.iter().map(|p| greedy(ids(&p["token_ids"]), 16)).collect();
            let got = run_all(&e, &reqs);
            for (p, got) in ps.iter().zip(&got) {
                let gr = &p["greedy"];
                let steps = gr["steps"].as_array().unwrap();
                let margins: Vec<f64> = steps.iter().map(|s| s["top2_margin_f64"].as_f64().unwrap()).collect();
                let second: Vec<u32> = steps.iter().map(|s| ids(&s["top5_ids"])[1]).collect();
                let tau = b.greedy_tau(layers, max_abs(&floats(&steps[0]["top5_logits"])));
                let what = format!("[{b}] {case}/{}", p["name"]);
                check_greedy(&what, got, &ids(&gr["tokens_f64"]), &margins, &second, tau);
            }
            drop(e);
            let alone: Vec<Vec<u32>> = reqs
                .iter()
                .map(|r| run_all(&b.engine(cfg.clone(), &path), std::slice::from_ref(r)).remove(0))
                .collect();
            assert_eq!(alone, got, "[{b}] {case}: batched tokens differ from running alone");
        }
        b.check_released(test);
        drop(turn);
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

/// A second request sharing four full blocks of prompt with the first computes only its
/// suffix and its decodes, and gets the tokens an engine without the cache gives.
#[test]
fn prefix_cache_reuses_a_shared_four_block_prefix() {
    let path = golden_dir("llama_gqa");
    for b in backends::present() {
        let turn = b.exclusive();
        let shared_len = 4 * b.block_size;
        let shared = prompts(&[shared_len], 640, 5).remove(0);
        let mut a = shared.clone();
        a.extend([10, 11, 12, 13, 14]);
        let mut second_prompt = shared.clone();
        second_prompt.extend([20, 21, 22]);
        let reqs = [greedy(a, 8), greedy(second_prompt.clone(), 8)];

        let mut nocache = cfg(64, 512);
        nocache.prefix_caching = false;
        let want = run_all(&b.engine(nocache, &path), &reqs);

        let e = b.engine(cfg(64, 512), &path);
        let first = run_all(&e, &reqs[..1]);
        let before = e.stats().unwrap();
        let second = run_all(&e, &reqs[1..]);
        let after = e.stats().unwrap();
        assert_eq!(vec![first[0].clone(), second[0].clone()], want, "[{b}] tokens with the prefix cache");
        assert_eq!(
            after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
            shared_len as u64,
            "[{b}] prefix cache hit tokens"
        );
        // Only the suffix (3 prompt tokens) and the 7 decoded tokens were computed.
        assert_eq!(
            after.computed_tokens - before.computed_tokens,
            (second_prompt.len() - shared_len + 7) as u64,
            "[{b}] computed tokens of the second request"
        );
        drop(e);
        b.check_released("prefix_cache_reuses_a_shared_four_block_prefix");
        drop(turn);
    }
}

#[test]
fn preemption_keeps_outputs_identical() {
    let path = golden_dir("llama_gqa");
    for b in backends::present() {
        let turn = b.exclusive();
        // Prompts whose 24 decodes cross a block edge, more of them than the small pool holds
        // at once. CPU (16-token blocks): each request needs up to 5 blocks; 12 cannot hold 8
        // of them. Simulator (128): prompts 8..28 tokens short of an edge, 8 blocks of prompt
        // and growth for a pool of 5.
        let (lens, blocks): (&[usize], usize) = match b.kind {
            Kind::Cpu => (&[40, 35, 50, 20, 45, 30, 38, 41], 12),
            Kind::AscendSim => (&[120, 100, 230, 110], 5),
        };
        let reqs: Vec<Request> = prompts(lens, 640, 9).into_iter().map(|p| greedy(p, 24)).collect();
        let n = reqs.len() as u64;
        let want = run_all(&b.engine(cfg(256, 512), &path), &reqs);
        let mut small = cfg(blocks, 512);
        small.prefix_caching = false;
        let e = b.engine(small, &path);
        let got = run_all(&e, &reqs);
        assert_eq!(got, want, "[{b}] tokens after preemptions");
        let st = e.stats().unwrap();
        assert!(st.preemptions_total > 0, "[{b}] no preemption: {st:?}");
        assert_eq!(st.kv_blocks_used, 0, "[{b}] {st:?}");
        // Prompt tokens count once; the recomputation after a preemption is computed work only.
        let prompt: u64 = reqs.iter().map(|r| r.prompt.len() as u64).sum();
        assert_eq!(st.prompt_tokens, prompt, "[{b}] {st:?}");
        assert_eq!(st.generated_tokens, n * 24, "[{b}] {st:?}");
        assert!(st.computed_tokens > prompt + n * 23, "[{b}] recomputed tokens are in computed_tokens: {st:?}");
        drop(e);
        b.check_released("preemption_keeps_outputs_identical");
        drop(turn);
    }
}

#[test]
fn chunked_prefill_never_starves_running_decodes() {
    let path = golden_dir("llama_gqa");
    let e = engine(&path, cfg(512, 128));
    let decoders: Vec<u64> =
        prompts(&[5, 9, 3], 640, 1).into_iter().map(|p| e.enqueue(greedy(p, 60)).unwrap()).collect();
    // Get them decoding first.
    for _ in 0..3 {
        e.step().unwrap();
    }
    let long = e.enqueue(greedy(prompts(&[2000], 640, 2).remove(0), 4)).unwrap();
    let mut prefill_steps = 0;
    loop {
        let out = e.step().unwrap();
        let got_long = out.events.iter().any(|ev| ev.id == long && ev.token.is_some());
        for d in &decoders {
            assert!(
                out.events.iter().any(|ev| ev.id == *d && ev.token.is_some()),
                "decode {d} got no token in a prefill step"
            );
        }
        if got_long {
            break;
        }
        prefill_steps += 1;
    }
    // 2000 tokens at ≤ 125 per step (128 minus 3 decodes) need at least 16 chunks.
    assert!(prefill_steps >= 15, "only {prefill_steps} chunks");
}

#[test]
fn cancellation_frees_blocks_and_bad_ids_are_errors() {
    let path = golden_dir("llama_gqa");
    for b in backends::present() {
        let turn = b.exclusive();
        let e = b.engine(cfg(64, 512), &path);
        let idle = e.stats().unwrap().kv_blocks_used;
        let id = e.enqueue(greedy(prompts(&[40], 640, 3).remove(0), 100)).unwrap();
        for _ in 0..5 {
            e.step().unwrap();
        }
        assert!(e.stats().unwrap().kv_blocks_used > idle, "[{b}] blocks in use while decoding");
        e.cancel(id).unwrap();
        e.cancel(id).unwrap_or_else(|err| panic!("[{b}] a second cancel while pending: {err}"));
        let ev = e.step().unwrap().events;
        assert!(ev.iter().any(|v| v.id == id && v.finish == Some(FinishReason::Cancelled)), "[{b}] {ev:?}");
        assert_eq!(e.stats().unwrap().kv_blocks_used, idle, "[{b}] blocks not freed by the step after the cancel");
        let out = e.output(id).unwrap();
        assert_eq!(out.finish, Some(FinishReason::Cancelled), "[{b}] {out:?}");
        e.cancel(id).unwrap_or_else(|err| panic!("[{b}] a cancel once cancelled: {err}"));
        let done = e.enqueue(greedy(vec![5, 6], 1)).unwrap();
        e.run_to_completion().unwrap();
        let r = e.cancel(done);
        assert!(matches!(&r, Err(Error::NotFound(m)) if m.contains("already finished")), "[{b}] {r:?}");
        let r = e.cancel(987654);
        assert!(matches!(&r, Err(Error::NotFound(m)) if m.contains("unknown")), "[{b}] {r:?}");
        // The engine keeps working.
        let id2 = e.enqueue(greedy(vec![5, 6, 7], 3)).unwrap();
        e.run_to_completion().unwrap();
        assert_eq!(e.output(id2).unwrap().tokens.len(), 3, "[{b}] the engine keeps working");
        drop(e);
        b.check_released("cancellation_frees_blocks_and_bad_ids_are_errors");
        drop(turn);
    }
}

#[test]
fn ten_thousand_random_requests_with_random_cancels_leave_no_blocks() {
    let path = model_file("stories260K-placeholder-vocab.gguf");
    let e = engine(
        &path,
        EngineConfig {
            threads: 2,
            kv_size: KvSize::Blocks(96),
            max_seqs: 64,
            max_batched_tokens: 256,
            queue_limit: 20000,
            ..Default::default()
        },
    );
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut live = Vec::new();
    let mut cancelled = std::collections::HashSet::new();
    for i in 0..10_000u32 {
        let len = 1 + (next() % 40) as usize;
        let prompt: Vec<u32> = (0..len).map(|_| 3 + (next() % 509) as u32).collect();
        let mut r = Request::new(prompt, 1 + (next() % 12) as usize);
        r.sampling = SamplingParams { temperature: 0.9, seed: i as u64, ..SamplingParams::greedy() };
        live.push(e.enqueue(r).unwrap());
        if next() % 3 == 0 {
            e.step().unwrap();
        }
        if next() % 5 == 0 {
            // Mostly requests still in flight: among the 16 most recent.
            let recent = live.len().min(16) as u64;
            let victim = live[live.len() - 1 - (next() % recent) as usize];
            if e.cancel(victim).is_ok() {
                cancelled.insert(victim);
            }
        }
    }
    e.run_to_completion().unwrap();
    let st = e.stats().unwrap();
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
    assert_eq!(st.finished + st.cancelled, 10_000);
    let cancelled = cancelled.len() as u64;
    assert!(cancelled > 500 && st.cancelled == cancelled, "{cancelled} cancels, stats {st:?}");
}

#[test]
fn a_sequence_never_holds_more_than_one_partial_block() {
    let path = golden_dir("llama_gqa");
    let e = engine(&path, cfg(128, 40));
    for p in prompts(&[3, 70, 16, 33, 90], 640, 4) {
        e.enqueue(greedy(p, 20)).unwrap();
    }
    while e.has_work().unwrap() {
        e.step().unwrap();
        for (id, cached, blocks) in e.kv_usage().unwrap() {
            assert_eq!(blocks, cached.div_ceil(16), "request {id}: {cached} positions in {blocks} blocks");
        }
    }
}

#[test]
fn seeded_sampling_is_independent_of_the_batch() {
    let path = golden_dir("qwen2");
    let sampled = |prompt: Vec<u32>, seed| Request {
        sampling: SamplingParams { temperature: 0.9, top_k: 50, top_p: 0.95, seed, ..SamplingParams::greedy() },
        ..greedy(prompt, 20)
    };
    let ps = prompts(&[12, 30, 4, 77], 896, 8);
    let reqs: Vec<Request> = ps.iter().enumerate().map(|(i, p)| sampled(p.clone(), 100 + i as u64)).collect();
    let alone: Vec<Vec<u32>> =
        reqs.iter().map(|r| run_all(&engine(&path, cfg(64, 512)), std::slice::from_ref(r)).remove(0)).collect();
    let together = run_all(&engine(&path, cfg(64, 32)), &reqs);
    assert_eq!(alone, together);
    // A different seed gives a different continuation.
    let other = run_all(&engine(&path, cfg(64, 512)), &[sampled(ps[1].clone(), 999)]);
    assert_ne!(other[0], alone[1]);
}

#[test]
fn stop_sequences_straddling_steps_end_the_request() {
    let path = golden_dir("llama_gqa");
    let e = engine(&path, cfg(64, 512));
    let p = prompts(&[9], 640, 6).remove(0);
    let free = run_all(&e, &[greedy(p.clone(), 12)]).remove(0);
    let mut r = greedy(p, 12);
    r.stop_sequences = vec![free[4..7].to_vec()]; // three tokens from three different steps
    let id = e.enqueue(r).unwrap();
    e.run_to_completion().unwrap();
    let out = e.output(id).unwrap();
    assert_eq!(out.finish, Some(FinishReason::StopSequence));
    assert_eq!(out.tokens, free[..7]);
}

#[test]
fn impossible_requests_and_full_queues_are_clear_errors() {
    let path = golden_dir("llama_gqa");
    let e = engine(&path, EngineConfig { queue_limit: 2, ..cfg(4, 64) });
    let err = e.enqueue(greedy(vec![5; 60], 10)).unwrap_err();
    assert!(matches!(&err, Error::KvCapacity(m) if m.contains("need 5 blocks") && m.contains("has 4")), "{err}");
    let err = e.enqueue(greedy(vec![5, 700], 4)).unwrap_err().to_string();
    assert!(err.contains("700") && err.contains("vocabulary"), "{err}");
    e.enqueue(greedy(vec![5], 4)).unwrap();
    e.enqueue(greedy(vec![6], 4)).unwrap();
    assert!(matches!(e.enqueue(greedy(vec![7], 4)), Err(Error::QueueFull(2))));
    e.run_to_completion().unwrap();
    e.enqueue(greedy(vec![7], 4)).unwrap();
}

#[test]
fn enqueue_cancel_and_stats_from_other_threads_while_stepping() {
    let path = golden_dir("llama_gqa");
    let e = std::sync::Arc::new(engine(&path, EngineConfig { queue_limit: 1000, ..cfg(256, 128) }));
    let want = run_all(&engine(&path, cfg(64, 512)), &[greedy(vec![5, 6, 7, 8], 6)]).remove(0);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stepper = {
        let (e, stop) = (e.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) || e.has_work().unwrap() {
                match e.step() {
                    Ok(_) | Err(Error::Busy) => {}
                    Err(err) => panic!("step: {err}"),
                }
            }
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                for i in 0..25 {
                    let id = e.enqueue(greedy(vec![5, 6, 7, 8], 6)).unwrap();
                    if i % 5 == t {
                        let _ = e.cancel(id); // may already be finished: an error, not a crash
                    } else {
                        mine.push(id);
                    }
                    let _ = e.stats().unwrap();
                }
                mine
            })
        })
        .collect();
    let ids: Vec<u64> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    stepper.join().unwrap();
    for id in ids {
        let out = e.output(id).unwrap();
        assert_eq!(out.tokens, want, "request {id}");
    }
    assert_eq!(e.stats().unwrap().kv_blocks_used, 0);
}

/// The cancellation contract under its one race: a cancel issued while the step that
/// finishes the request runs. Thousands of times, with the cancel landing anywhere from
/// before the step to after it: `Ok` must mean the stream ends `Cancelled` (the last token
/// still delivered) and a second cancel is `Ok`; `NotFound` must mean it ended normally.
#[test]
fn cancel_racing_the_final_step_keeps_the_contract() {
    use std::sync::{Arc, Barrier};
    use std::time::Instant;
    let path = model_file("stories260K-placeholder-vocab.gguf");
    let e = Arc::new(engine(&path, EngineConfig { threads: 1, kv_size: KvSize::Blocks(64), ..Default::default() }));
    // How long a one-token step takes here, to spread the cancels over it.
    let t = Instant::now();
    for i in 0..20u32 {
        e.enqueue(greedy(vec![3 + i], 1)).unwrap();
        e.run_to_completion().unwrap();
    }
    let mut step = t.elapsed() / 20;
    let (mut ok, mut raced, mut not_found) = (0, 0, 0);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..3000u32 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let delay = step.mul_f64((rng % 1000) as f64 / 1000.0 * 1.5);
        let id = e.enqueue(greedy(vec![3 + i % 500], 1)).unwrap();
        let go = Arc::new(Barrier::new(2));
        let (e2, go2) = (e.clone(), go.clone());
        let canceller = std::thread::spawn(move || {
            go2.wait();
            let t = Instant::now();
            while t.elapsed() < delay {
                std::hint::spin_loop();
            }
            e2.cancel(id)
        });
        go.wait();
        let t = Instant::now();
        let mut events = Vec::new();
        while e.has_work().unwrap() {
            events.extend(e.step().unwrap().events);
        }
        // Follow the step's time as the machine's load changes (a loaded 2-core box can
        // take many times the warm-up's), so the cancels keep landing on both sides of it.
        step = (step * 7 + t.elapsed()) / 8;
        let answer = canceller.join().unwrap();
        // A cancel accepted after that step is reported by the next one.
        while e.has_work().unwrap() {
            events.extend(e.step().unwrap().events);
        }
        let ends: Vec<_> = events.iter().filter(|v| v.id == id && v.finish.is_some()).collect();
        assert_eq!(ends.len(), 1, "iteration {i}: {events:?}");
        match answer {
            Ok(()) => {
                assert_eq!(ends[0].finish, Some(FinishReason::Cancelled), "iteration {i}: cancel said Ok");
                assert!(e.cancel(id).is_ok(), "iteration {i}: a second cancel must be Ok");
                ok += 1;
                if ends[0].token.is_some() {
                    raced += 1; // the step finished it, the cancel won
                }
            }
            Err(Error::NotFound(_)) => {
                assert_eq!(ends[0].finish, Some(FinishReason::Length), "iteration {i}");
                not_found += 1;
            }
            Err(other) => panic!("iteration {i}: {other}"),
        }
    }
    eprintln!("cancel race: {ok} ok ({raced} during the finishing step), {not_found} after it; step {step:?}");
    assert!(ok > 0 && not_found > 0 && raced > 0, "the race was not exercised: {ok}/{raced}/{not_found}");
    let st = e.stats().unwrap();
    assert_eq!(st.kv_blocks_used, 0);
}

/// `interrupt` (what `tboost_engine_free` does to a stepping engine) stops a long step at
/// its next op: the step returns well before it would have finished, its requests end with
/// an error, and later steps fail at once rather than compute.
#[test]
fn an_interrupt_stops_a_long_step_at_its_next_op() {
    use std::sync::Arc;
    use std::time::Instant;
    let model = tboost_testkit::synthetic::build("small", tboost_engine::backend::DType::F32, 7).unwrap();
    let cfg = EngineConfig { threads: 1, kv_size: KvSize::Blocks(300), max_batched_tokens: 4096, ..Default::default() };
    let prompt: Vec<u32> = (0..4000).map(|i| 3 + (i * 7) % 500).collect();
    // How long the whole prefill takes uninterrupted.
    let full = {
        let e = Engine::new(cfg.clone()).unwrap();
        e.load_model(&model).unwrap();
        e.enqueue(greedy(prompt.clone(), 1)).unwrap();
        let t = Instant::now();
        e.step().unwrap();
        t.elapsed()
    };
    let e = Arc::new(Engine::new(cfg).unwrap());
    e.load_model(&model).unwrap();
    let id = e.enqueue(greedy(prompt, 1)).unwrap();
    let e2 = e.clone();
    let stepper = std::thread::spawn(move || {
        let t = Instant::now();
        let out = e2.step().unwrap();
        (out, t.elapsed())
    });
    std::thread::sleep(full / 5);
    e.interrupt();
    let (out, took) = stepper.join().unwrap();
    assert!(took < full.mul_f64(0.8), "an interrupted step took {took:?} of a full {full:?}");
    let ev = out.events.iter().find(|v| v.id == id).expect("the request's event");
    assert_eq!(ev.finish, Some(FinishReason::Error));
    assert!(ev.error.as_deref().unwrap_or("").contains("interrupted"), "{ev:?}");
    assert_eq!(e.stats().unwrap().kv_blocks_used, 0);
}
