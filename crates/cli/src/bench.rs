//! `tboost bench`: prefill and decode speed, with the yardsticks measured in the same run
//! (memory bandwidth of a streaming read on the same number of threads), so every number
//! is reported as a ratio to what this machine can do right now.

use std::time::Instant;

use clap::Args;
use serde_json::json;

use super::{print_json, EngineArgs};
use tboost_engine::backend::cpu::measure_bandwidth;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::sched::Request;
use tboost_engine::session::{argmax, Session};
use tboost_engine::{Error, Result};
use tboost_testkit::synthetic;

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// A synthetic model shape: tinyllama-1.1b, small or tiny-moe.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// A model file or directory instead of a synthetic shape.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Weight type of a synthetic model: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, q2_k, q3_k, q4_k, q5_k, q6_k.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Prompt tokens to prefill.
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Tokens to decode after the prefill.
    #[arg(long, default_value_t = 128)]
    decode: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Also measure aggregate decode speed with this many requests decoding together
    /// (comma-separated, e.g. 1,4,16), through the engine's continuous batching.
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Prompt tokens of each request in the concurrency runs.
    #[arg(long, default_value_t = 32)]
    concurrency_prompt: usize,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Aggregate decode tokens/s of `n` requests decoding `decode` tokens together: the clock
/// starts once every request has its first token (all prefills done) and stops when the
/// last one finishes.
fn concurrent_decode(model: &Model, a: &BenchArgs, n: usize) -> Result<f64> {
    let decode = a.decode.max(2);
    let per_seq = a.concurrency_prompt + decode;
    let cfg = EngineConfig {
        kv_size: KvSize::Tokens(n * (per_seq + 128)),
        max_seqs: n.max(1),
        max_batched_tokens: (n * a.concurrency_prompt).max(n).max(16),
        prefix_caching: false,
        ..a.engine.engine_config()?
    };
    let engine = Engine::new(cfg)?;
    engine.load_model(model)?;
    let vocab = model.config.vocab_size as u64;
    for r in 0..n {
        let prompt: Vec<u32> =
            (0..a.concurrency_prompt).map(|i| 3 + ((r * 7919 + i * 131) as u64 % (vocab - 3)) as u32).collect();
        engine.enqueue(Request { ignore_eos: true, ..Request::new(prompt, decode) })?;
    }
    let mut started = 0;
    while started < n {
        started += engine.step()?.events.iter().filter(|e| e.token.is_some()).count();
    }
    let t = Instant::now();
    let mut tokens = 0;
    while engine.has_work()? {
        tokens += engine.step()?.events.iter().filter(|e| e.token.is_some()).count();
    }
    Ok(tokens as f64 / t.elapsed().as_secs_f64())
}

/// The median; of an even count, the mean of the middle two (the upper one alone would
/// report the better of two runs).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let h = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[h - 1] + v[h]) / 2.0
    } else {
        v[h]
    }
}

/// ", min–max a–b" for several samples (the spread behind a median), "" for one.
fn range(v: &[f64]) -> String {
    if v.len() < 2 {
        return String::new();
    }
    let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    format!(", min–max {lo:.1}–{hi:.1}")
}

/// Resets the peak-RSS mark (Linux `clear_refs` 5) so a later reading covers what follows.
pub(crate) fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident set size of this process, in bytes (Linux), or 0 if unknown.
pub(crate) fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Page faults this process has taken so far (minor and major), or 0 if unknown.
fn page_faults() -> u64 {
    // SAFETY: getrusage writes one `rusage` it is given; a zeroed one is a valid start.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF takes no other argument.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    (u.ru_minflt + u.ru_majflt) as u64
}

pub(crate) fn run(a: BenchArgs) -> Result<()> {
    if a.repeat == 0 || a.prefill == 0 {
        return Err(Error::invalid("bench", "--repeat and --prefill must be at least 1"));
    }
    let ecfg = a.engine.engine_config()?;
    let (model, label) = match (&a.synthetic, &a.model) {
        (Some(name), None) => {
            let dtype = synthetic::parse_dtype(&a.dtype)?;
            (synthetic::build(name, dtype, 42)?, format!("synthetic {name} {dtype}"))
        }
        (None, Some(path)) => (Model::load(path)?, path.display().to_string()),
        _ => return Err(Error::invalid("bench", "give --synthetic NAME or --model PATH")),
    };
    // Read the weights in before any clock runs: a mapped file may be partly evicted from
    // the page cache, and its first forward pass would otherwise time disk reads.
    model.weights.touch(&mut |_, _| true);
    let backend = a.engine.open_backend()?;
    let opts = ecfg.plan_options(backend.as_ref())?;
    let threads =
        if ecfg.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { ecfg.threads };
    // With `--tp` or under mpirun, the leader's shard (its `local` followers beside it), as
    // an engine builds it; an MPI follower runs the leader's passes and prints nothing.
    let mut runner = ecfg.runner(&model, backend, &opts)?;
    if runner.follower_rank().is_some() {
        return runner.follow();
    }
    let kv_dtype = runner.plan.kv_dtype;
    let cfg = model.config.clone();
    let bs = runner.plan.block_size;
    let cap = a.prefill + a.decode;
    runner.alloc_kv(cap.div_ceil(bs), bs)?;
    // As llama.cpp sizes its buffers when it makes a context: a step's time, not the first
    // step's page faults.
    runner.reserve(a.prefill.max(1), 1, 1, cap.div_ceil(bs))?;
    let weight_bytes = runner.weight_bytes() as f64;
    reset_peak_rss();

    // Deterministic prompt ids in [3, vocab).
    let prompt: Vec<u32> =
        (0..a.prefill).map(|i| 3 + ((i as u64 * 2654435761) % (cfg.vocab_size as u64 - 3)) as u32).collect();
    // One untimed run of the whole prompt and one decode token, as llama-bench warms up
    // (`test_prompt(ctx, t.n_prompt, ...)`, then `test_gen(ctx, 1, ...)`): first-use costs
    // (the kernels' per-thread scratch at this size, the pool's threads, the caches) are
    // not a property of steady-state speed.
    {
        let mut s = Session::new(&mut runner, cap)?;
        let logits = s.feed(&prompt, false)?;
        s.feed(&[argmax(&logits)], false)?;
    }
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    // Faults inside the timed passes: memory first touched in a step rather than at load.
    let faults0 = page_faults();
    for _ in 0..a.repeat {
        let mut s = Session::new(&mut runner, cap)?;
        let t = Instant::now();
        let mut logits = s.feed(&prompt, false)?;
        pre.push(a.prefill as f64 / t.elapsed().as_secs_f64());
        if a.decode > 0 {
            let t = Instant::now();
            for _ in 0..a.decode {
                logits = s.feed(&[argmax(&logits)], false)?;
            }
            dec.push(a.decode as f64 / t.elapsed().as_secs_f64());
        }
    }
    let pass_faults = page_faults().saturating_sub(faults0);
    let prefill_tps = median(&pre);
    let decode_tps = if dec.is_empty() { 0.0 } else { median(&dec) };
    let decode_bw = weight_bytes * decode_tps;
    let peak = peak_rss_bytes();
    let backend = runner.backend().device().device;
    drop(runner);
    let mut conc = Vec::new();
    for &n in &a.concurrency {
        if n == 0 {
            return Err(Error::invalid("concurrency", "0 requests"));
        }
        let runs: Vec<f64> = (0..a.repeat).map(|_| concurrent_decode(&model, &a, n)).collect::<Result<_>>()?;
        conc.push((n, median(&runs)));
    }
    // The probe runs after every timed pass: the VM reports the gigabyte it frees to the host
    // (virtio-balloon free page reporting, in 2 MiB chunks about every 2 s), and a prefill
    // taken in the seconds after it ran 10-18% slower at each report (Qwen2.5-0.5B Q4_K_M
    // pp512, nine passes: the 4th and 8th at 911-989 tokens/s, the rest 1015-1139; with the
    // probe skipped, none).
    let bandwidth = measure_bandwidth(threads)?;
    if a.json {
        print_json(&json!({
            "model": label, "backend": backend, "threads": threads,
            "weight_bytes": weight_bytes as u64, "kv_dtype": kv_dtype.name(),
            "prefill_tokens": a.prefill, "decode_tokens": a.decode, "repeat": a.repeat,
            "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
            "prefill_samples_tokens_per_s": pre, "decode_samples_tokens_per_s": dec,
            "memory_bandwidth_bytes_per_s": bandwidth,
            "decode_weight_bytes_per_s": decode_bw,
            "decode_share_of_bandwidth": decode_bw / bandwidth,
            "peak_rss_bytes": peak, "page_faults_during_passes": pass_faults,
            "concurrency": conc.iter().map(|&(n, tps)| json!({
                "requests": n, "aggregate_decode_tokens_per_s": tps,
                "speedup_vs_single_request": tps / decode_tps,
            })).collect::<Vec<_>>(),
        }))?;
    } else {
        let gb = |b: f64| b / 1e9;
        println!("model     {label}: {:.2} GB of weights; {backend}", gb(weight_bytes));
        println!("bandwidth {:.1} GB/s (streaming read, {threads} threads, same run)", gb(bandwidth));
        println!("prefill   {:.1} tokens/s ({} tokens, median of {}{})", prefill_tps, a.prefill, a.repeat, range(&pre));
        if a.decode > 0 {
            println!(
                "decode    {:.2} tokens/s ({} tokens{}): {:.1} GB/s of weights = {:.0}% of the bandwidth limit",
                decode_tps,
                a.decode,
                range(&dec),
                gb(decode_bw),
                100.0 * decode_bw / bandwidth
            );
        }
        println!(
            "memory    peak RSS {:.2} GB (weights, KV cache and activations); {pass_faults} page faults in the timed passes",
            gb(peak as f64)
        );
        for (n, tps) in &conc {
            println!(
                "batched   {n:>3} requests decoding together: {tps:.2} tokens/s aggregate = {:.1}x one request",
                tps / decode_tps
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(super::median(&[150.0, 160.0]), 155.0);
        assert_eq!(super::median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(super::median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(&[7.0]), 7.0);
    }
}
