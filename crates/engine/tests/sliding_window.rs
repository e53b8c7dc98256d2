//! Sliding-window attention in Mistral-style configs (one window in every layer): the window is
//! a mask in the attention kernels, the KV blocks wholly behind it go back to the pool while a
//! request runs, and the prefix cache stays correct.
//!
//! The reference for the logits is the same model run through a `Session` (one sequence,
//! blocks never given back): it computes the masked attention with the same kernels, which the
//! kernel tests check against an f64 attention over only the last `window` keys
//! (`crates/kernels/tests/attention.rs`), and which the gemma3 golden case checks against
//! Hugging Face's sliding-window model. Here: giving blocks back, chunked prefill and prefix
//! hits change no token, and the window does change the logits once the context exceeds it.

use serde_json::json;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::sched::Request;
use tboost_engine::session::{argmax, Session};
use tboost_testkit::golden::{max_abs_diff, runner};
use tboost_testkit::model_files::hf::{dir_with_config, golden_config};

const WINDOW: usize = 24;
const BS: usize = 16;

fn windowed(window: Option<usize>) -> tempfile::TempDir {
    let mut c = golden_config("mistral");
    c["sliding_window"] = match window {
        Some(w) => json!(w),
        None => json!(null),
    };
    dir_with_config("mistral", &c)
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 7919 + salt * 104_729) % 509).collect()
}

/// Greedy ids and the logits of every step (prefill's last row, then each decode) through a
/// session: the reference.
fn session_run(dir: &std::path::Path, p: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut r = runner(dir);
    let vocab = r.cfg.vocab_size;
    let mut s = Session::new(&mut r, p.len() + n).unwrap();
    let logits = s.feed(p, true).unwrap();
    let mut cur = logits[(p.len() - 1) * vocab..].to_vec();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        let next = argmax(&cur);
        ids.push(next);
        all.push(cur.clone());
        if i + 1 < n {
            cur = s.feed(&[next], false).unwrap();
        }
    }
    (ids, all)
}

fn engine(dir: &std::path::Path, prefix_caching: bool, max_batched: usize) -> Engine {
    let cfg = EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(64),
        max_batched_tokens: max_batched,
        max_seqs: 8,
        prefix_caching,
        backend: tboost_engine::backend::BackendKind::Cpu,
        ..Default::default()
    };
    let e = Engine::new(cfg).unwrap();
    e.load(dir).unwrap();
    e
}

#[test]
fn config_window_reaches_every_layer() {
    let dir = windowed(Some(WINDOW));
    let r = runner(dir.path());
    assert_eq!(r.cfg.features.uniform_window(), Some(WINDOW));
    for l in &r.plan.layers {
        for slot in [tboost_engine::plan::Slot::AttentionPrefill, tboost_engine::plan::Slot::AttentionDecode] {
            let d = l.get(slot).unwrap();
            assert!(d.reason.contains(&format!("sliding_window={WINDOW}")), "layer {}: {}", l.layer, d.reason);
        }
    }
}

/// The window changes the logits once the context exceeds it and not before.
#[test]
fn the_window_masks_keys_behind_it() {
    let (w, full) = (windowed(Some(WINDOW)), windowed(None));
    let p = prompt(70, 1);
    let (_, lw) = session_run(w.path(), &p[..WINDOW], 1);
    let (_, lf) = session_run(full.path(), &p[..WINDOW], 1);
    assert_eq!(lw, lf, "a context within the window is plain causal attention");
    let (_, lw) = session_run(w.path(), &p, 1);
    let (_, lf) = session_run(full.path(), &p, 1);
    let d = max_abs_diff(&lw[0], &lf[0]);
    assert!(d > 1e-2, "70 positions with a window of {WINDOW}: the logits must move (moved {d})");
}

/// A request whose context exceeds the window: the engine (blocks given back as the window
/// moves, chunked prefill) gives the session's tokens, holds at most the window's blocks plus
/// one, and every block returns to the pool at the end.
#[test]
fn blocks_behind_the_window_return_to_the_pool() {
    let dir = windowed(Some(WINDOW));
    let p = prompt(100, 2);
    let n = 40;
    let (want, _) = session_run(dir.path(), &p, n);
    for max_batched in [512, 16] {
        let e = engine(dir.path(), false, max_batched);
        let id = e.enqueue(Request { ignore_eos: true, ..Request::new(p.clone(), n) }).unwrap();
        let mut peak = 0;
        while e.has_work().unwrap() {
            e.step().unwrap();
            for (_, cached, held) in e.kv_usage().unwrap() {
                // Blocks still visible to the next query, plus the partially filled one.
                let bound = (cached % BS != 0) as usize + WINDOW.div_ceil(BS) + 1;
                assert!(held <= bound, "{cached} positions hold {held} blocks (bound {bound})");
                peak = peak.max(held);
            }
            let s = e.stats().unwrap();
            assert!(
                s.kv_blocks_used <= WINDOW.div_ceil(BS) + 2 + max_batched.div_ceil(BS),
                "{} used",
                s.kv_blocks_used
            );
        }
        assert_eq!(e.output(id).unwrap().tokens, want, "max_batched {max_batched}: tokens with blocks given back");
        assert!(peak < (p.len() + n).div_ceil(BS), "the request never held its whole context (peak {peak})");
        assert_eq!(e.stats().unwrap().kv_blocks_used, 0, "every block back in the pool");
    }
}

/// Blocks given back behind the window stay in the prefix cache: a second request sharing the
/// prompt's first blocks hits them and gets the tokens of an engine without the cache.
#[test]
fn the_prefix_cache_stays_correct_with_a_window() {
    let dir = windowed(Some(WINDOW));
    let first = prompt(90, 3);
    let mut second = first[..64].to_vec();
    second.extend(prompt(20, 4));
    let reqs = [first, second];
    let run = |e: &Engine, p: &Vec<u32>| {
        let id = e.enqueue(Request { ignore_eos: true, ..Request::new(p.clone(), 20) }).unwrap();
        e.run_to_completion().unwrap();
        e.output(id).unwrap().tokens
    };
    let nocache = engine(dir.path(), false, 512);
    let want: Vec<Vec<u32>> = reqs.iter().map(|p| run(&nocache, p)).collect();
    let e = engine(dir.path(), true, 512);
    let got0 = run(&e, &reqs[0]);
    let before = e.stats().unwrap();
    let got1 = run(&e, &reqs[1]);
    let after = e.stats().unwrap();
    assert_eq!(vec![got0, got1], want, "tokens with the prefix cache and a window");
    assert_eq!(after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens, 64, "4 shared blocks hit");
    assert_eq!(session_run(dir.path(), &reqs[1], 20).0, want[1], "the session agrees");
    assert_eq!(after.kv_blocks_used, 0);
}
