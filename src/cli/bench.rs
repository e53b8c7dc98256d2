//! `tboost bench`: prefill and decode speed, with the yardsticks measured in the same run
//! (memory bandwidth of a streaming read on the same number of threads), so every number
//! is reported as a ratio to what this machine can do right now.

use std::time::Instant;

use clap::Args;
use serde_json::json;
use tboost_kernels::{membw, DType};

use super::{parse_kv_dtype, print_json, EngineArgs};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::model::{synthetic, Model};
use crate::runner::ModelRunner;
use crate::session::{argmax, Session};
use crate::{Error, Result};

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// A synthetic model shape: tinyllama-1.1b, small or tiny-moe.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// A model file or directory instead of a synthetic shape.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Weight type of a synthetic model: f32, f16 or bf16.
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
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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

/// Streaming-read bandwidth on `threads` threads over a buffer far larger than the caches.
pub(crate) fn measure_bandwidth(threads: usize) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::invalid("threads", e.to_string()))?;
    // 256 MiB: far beyond any L3, small enough not to dominate peak memory.
    let buf = vec![1u8; 256 << 20];
    let mut runs = Vec::new();
    let mut sink = 0u64;
    for _ in 0..5 {
        let t = Instant::now();
        sink = sink.wrapping_add(pool.install(|| membw::stream_read(&buf)));
        runs.push(buf.len() as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    Ok(median(runs))
}

pub(crate) fn run(a: BenchArgs) -> Result<()> {
    if a.repeat == 0 || a.prefill == 0 {
        return Err(Error::invalid("bench", "--repeat and --prefill must be at least 1"));
    }
    let opts = a.engine.plan_options()?;
    let kv_dtype = parse_kv_dtype(&a.engine.kv_dtype)?;
    let (model, label) = match (&a.synthetic, &a.model) {
        (Some(name), None) => {
            let dtype = match a.dtype.as_str() {
                "f32" => DType::F32,
                "f16" => DType::F16,
                "bf16" => DType::BF16,
                other => return Err(Error::invalid("dtype", format!("`{other}` is not one of f32, f16, bf16"))),
            };
            (synthetic::build(name, dtype, 42)?, format!("synthetic {name} {dtype}"))
        }
        (None, Some(path)) => (Model::load(path)?, path.display().to_string()),
        _ => return Err(Error::invalid("bench", "give --synthetic NAME or --model PATH")),
    };
    let backend = Box::new(CpuBackend::new(a.engine.threads)?);
    let threads = backend.threads();
    let mut runner = ModelRunner::new(&model, backend, &opts)?;
    let cfg = model.config.clone();
    drop(model); // the runner holds what it needs
    let bs = 16;
    let cap = a.prefill + a.decode;
    runner.alloc_kv(cap.div_ceil(bs), bs, kv_dtype)?;
    let weight_bytes = runner.weight_bytes() as f64;
    let bandwidth = measure_bandwidth(threads)?;
    reset_peak_rss();

    // Deterministic prompt ids in [3, vocab).
    let prompt: Vec<u32> =
        (0..a.prefill).map(|i| 3 + ((i as u64 * 2654435761) % (cfg.vocab_size as u64 - 3)) as u32).collect();
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
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
    let prefill_tps = median(pre);
    let decode_tps = if dec.is_empty() { 0.0 } else { median(dec) };
    let decode_bw = weight_bytes * decode_tps;
    let peak = peak_rss_bytes();
    let backend = runner.backend().describe();
    if a.json {
        print_json(&json!({
            "model": label, "backend": backend, "threads": threads,
            "weight_bytes": weight_bytes as u64, "kv_dtype": kv_dtype.name(),
            "prefill_tokens": a.prefill, "decode_tokens": a.decode, "repeat": a.repeat,
            "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
            "memory_bandwidth_bytes_per_s": bandwidth,
            "decode_weight_bytes_per_s": decode_bw,
            "decode_share_of_bandwidth": decode_bw / bandwidth,
            "peak_rss_bytes": peak,
        }))?;
    } else {
        let gb = |b: f64| b / 1e9;
        println!("model     {label}: {:.2} GB of weights; {backend}", gb(weight_bytes));
        println!("bandwidth {:.1} GB/s (streaming read, {threads} threads, same run)", gb(bandwidth));
        println!("prefill   {:.1} tokens/s ({} tokens, median of {})", prefill_tps, a.prefill, a.repeat);
        if a.decode > 0 {
            println!(
                "decode    {:.2} tokens/s ({} tokens): {:.1} GB/s of weights = {:.0}% of the bandwidth limit",
                decode_tps,
                a.decode,
                gb(decode_bw),
                100.0 * decode_bw / bandwidth
            );
        }
        println!("memory    peak RSS {:.2} GB", gb(peak as f64));
    }
    Ok(())
}
