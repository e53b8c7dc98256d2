//! `tboost bench-op`: one operator through the operator API (`tboost_engine::op_api`), timed on its
//! own, with a parameter swept (`--sweep tile_kv=32,64,128`, `--sweep panel_rows=16,48,96`):
//! per value, the median time,
//! GFLOP/s, GB/s of the minimum traffic (every input read once, every output written once) and
//! that as a percentage of this machine's streaming-read bandwidth measured in the same run.

use std::time::Instant;

use clap::Args;
use serde_json::json;

use super::print_json;
use tboost_engine::backend::cpu::measure_bandwidth;
use tboost_engine::backend::{AttnKind, BackendKind, BackendSpec, DType, Precision};
use tboost_engine::op_api::{AttentionParams, MatMulParams, OpBackend, OpParams, Operation, TensorRef};
use tboost_engine::{Error, Result};
use tboost_ops::{MatMulTiling, Tiling};

#[derive(Args)]
pub(crate) struct BenchOpArgs {
    /// The operator: flash_attention (a causal prefill of --seq tokens), paged_decode_attention
    /// (--batch sequences decoding one token over --seq positions) or matmul.
    op: String,
    /// Attention: tokens of the sequence (prefill) or context length (decode).
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Paged decode: sequences decoding together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Tokens per KV block of the paged cache.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Attention: FlashAttention's KV tile when not swept.
    #[arg(long)]
    tile_kv: Option<usize>,
    /// Matmul: weight rows (output features).
    #[arg(long, default_value_t = 4096)]
    rows: usize,
    /// Matmul: weight columns (input features).
    #[arg(long, default_value_t = 4096)]
    cols: usize,
    /// Matmul: activation rows (tokens).
    #[arg(long, default_value_t = 1)]
    m: usize,
    /// Matmul: weight type (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, q2_k, q3_k, q4_k, q5_k, q6_k).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Matmul: exact or fast.
    #[arg(long, default_value = "exact")]
    precision: String,
    /// Matmul: the CPU kernels' work split when not swept, NAME=VALUE,... with the names of the
    /// engine's tiling.matmul.* keys (panel_rows, act_rows, tasks_per_thread,
    /// decode_task_min_bytes); unset = the op's default.
    #[arg(long, default_value = "")]
    tiling: String,
    /// One parameter and its values, one row each: tile_kv=... (attention), seq=...
    /// (attention), m=..., dtype=... or a tiling name (panel_rows=16,48,96, act_rows=...,
    /// tasks_per_thread=..., decode_task_min_bytes=...; matmul).
    #[arg(long)]
    sweep: Option<String>,
    /// Timed runs per row (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Where the op runs: cpu, ascend or ascend:N.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// CPU compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[arg(long)]
    json: bool,
}

/// One measured row.
struct Row {
    value: String,
    secs: f64,
    flops: f64,
    bytes: f64,
}

/// A small deterministic fill (the values do not matter for speed, only that they are finite).
fn fill(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
        .collect()
}

fn to_act(act: DType, v: &[f32]) -> Result<Vec<u8>> {
    Ok(match act {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        other => return Err(Error::Unsupported(format!("bench-op: activations in {other}"))),
    })
}

fn put(be: &OpBackend, act: DType, shape: &[usize], seed: u32) -> Result<TensorRef> {
    let t = be.alloc(act, shape)?;
    let n = shape.iter().product();
    be.write(&t, &to_act(act, &fill(n, seed))?)?;
    Ok(t)
}

/// Median seconds of `repeat` runs of `op` (each enqueued and waited for), after a warm-up.
fn time(be: &OpBackend, op: &Operation, ins: &[TensorRef], outs: &mut [TensorRef], repeat: usize) -> Result<f64> {
    op.execute(ins, outs, None)?;
    be.synchronize()?;
    let mut t = Vec::with_capacity(repeat);
    for _ in 0..repeat.max(1) {
        let s = Instant::now();
        op.execute(ins, outs, None)?;
        be.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn attention_row(a: &BenchOpArgs, be: &OpBackend, kind: AttnKind, seq: usize, tile: Option<usize>) -> Result<Row> {
    let act = be.activation_dtype()?;
    let (h, kvh, hd, bs) = (a.heads, a.kv_heads, a.head_dim, a.block_size);
    if bs == 0 || seq == 0 {
        return Err(Error::invalid("seq", "--seq and --block-size must be positive"));
    }
    let decode = kind == AttnKind::PagedDecode;
    let nseq = if decode { a.batch.max(1) } else { 1 };
    let per_seq_blocks = seq.div_ceil(bs);
    let blocks = nseq * per_seq_blocks;
    let p = AttentionParams {
        kind,
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
        scale: None,
        block_size: bs,
        kv_dtype: act,
        max_context: seq.max(4096),
        act,
        tile_kv: tile,
    };
    let op = Operation::new(be, OpParams::Attention(p))?;
    op.supports().map_err(|why| Error::Unsupported(format!("{} on {}: {why}", op.name(), be.name().unwrap_or("?"))))?;
    let rows = if decode { nseq } else { seq };
    let q = put(be, act, &[rows, h * hd], 1)?;
    let k = put(be, act, &[blocks, bs, kvh, hd], 2)?;
    let v = put(be, act, &[blocks, bs, kvh, hd], 3)?;
    let mut table = Vec::with_capacity(nseq * 3);
    for s in 0..nseq {
        let (start, len) = if decode { (s, 1) } else { (0, seq) };
        table.extend([start as u32, len as u32, seq as u32]);
    }
    let st = be.alloc(DType::U32, &[nseq, 3])?;
    be.write_u32(&st, &table)?;
    let bt = be.alloc(DType::U32, &[nseq, per_seq_blocks])?;
    be.write_u32(&bt, &(0..blocks as u32).collect::<Vec<_>>())?;
    let out = be.alloc(act, &[rows, h * hd])?;
    let secs = time(be, &op, &[q, k, v, st, bt], &mut [out], a.repeat)?;
    let e = act.block_bytes() as f64;
    // Scores and P·V: 2 flops per multiply-add, over every (query, key) pair the causal mask keeps.
    let pairs = if decode { (nseq * seq) as f64 } else { (seq as f64) * (seq as f64 + 1.0) / 2.0 };
    let flops = 4.0 * (h * hd) as f64 * pairs;
    let bytes = e * (2 * rows * h * hd + 2 * nseq * seq * kvh * hd) as f64;
    Ok(Row { value: String::new(), secs, flops, bytes })
}

fn matmul_row(a: &BenchOpArgs, be: &OpBackend, dtype: DType, m: usize, tiling: MatMulTiling) -> Result<Row> {
    let act = be.activation_dtype()?;
    let precision = Precision::parse(&a.precision)
        .ok_or_else(|| Error::invalid("precision", format!("`{}`: exact or fast", a.precision)))?;
    let p = MatMulParams { weight: dtype, n: a.rows, k: a.cols, bias: false, precision, act, tiling };
    let op = Operation::new(be, OpParams::MatMul(p))?;
    op.supports().map_err(|why| Error::Unsupported(format!("matmul on {}: {why}", be.name().unwrap_or("?"))))?;
    let vals = fill(a.rows * a.cols, 4);
    let wbytes = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => to_act(dtype, &vals)?,
        q => tboost_engine::backend::cpu::quantize_row_reference(q, &vals)
            .map_err(|e| Error::invalid("dtype", format!("{q}: {e}")))?,
    };
    let wlen = wbytes.len();
    let w = be.upload_weight(dtype, &[a.rows, a.cols], wbytes)?;
    let x = put(be, act, &[m, a.cols], 5)?;
    let y = be.alloc(act, &[m, a.rows])?;
    let secs = time(be, &op, &[x, w], &mut [y], a.repeat)?;
    let e = act.block_bytes() as f64;
    let flops = 2.0 * (m * a.rows * a.cols) as f64;
    let bytes = wlen as f64 + e * (m * (a.rows + a.cols)) as f64;
    Ok(Row { value: String::new(), secs, flops, bytes })
}

fn parse_dtype(s: &str) -> Result<DType> {
    DType::parse(s).filter(|d| d.is_float() || d.is_quantized()).ok_or_else(|| {
        Error::invalid(
            "dtype",
            format!(
                "`{s}`: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, iq4_xs, q2_k, q3_k, q4_k, q5_k or q6_k"
            ),
        )
    })
}

pub(crate) fn run(a: BenchOpArgs) -> Result<()> {
    let kind = match a.op.as_str() {
        "flash_attention" => Some(AttnKind::Flash),
        "paged_decode_attention" => Some(AttnKind::PagedDecode),
        "matmul" => None,
        other => {
            return Err(Error::invalid("op", format!("`{other}`: flash_attention, paged_decode_attention or matmul")))
        }
    };
    let (key, values): (String, Vec<String>) = match &a.sweep {
        Some(s) => {
            let (k, v) = s.split_once('=').ok_or_else(|| Error::invalid("sweep", format!("`{s}`: name=v1,v2,...")))?;
            let vals: Vec<String> = v.split(',').map(str::trim).filter(|x| !x.is_empty()).map(String::from).collect();
            if vals.is_empty() {
                return Err(Error::invalid("sweep", format!("`{s}` names no values")));
            }
            (k.trim().to_string(), vals)
        }
        None => (String::new(), vec![String::new()]),
    };
    let mut allowed: Vec<&str> = if kind.is_some() { vec!["tile_kv", "seq"] } else { vec!["m", "dtype"] };
    if kind.is_none() {
        allowed.extend(MatMulTiling::TUNABLES.iter().map(|t| t.name));
    }
    let mut tiling = MatMulTiling::default();
    for item in a.tiling.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = || Error::invalid("tiling", format!("`{item}`: NAME=VALUE, e.g. panel_rows=96"));
        let (name, v) = item.split_once('=').ok_or_else(bad)?;
        let v = v.trim().parse::<usize>().map_err(|_| bad())?;
        tiling.set(name.trim(), v).map_err(|u| Error::invalid("tiling", u.to_string()))?;
    }
    if !key.is_empty() && !allowed.contains(&key.as_str()) {
        return Err(Error::invalid("sweep", format!("`{key}` for {}: one of {}", a.op, allowed.join(", "))));
    }
    let usize_of = |v: &str| {
        v.parse::<usize>().map_err(|_| Error::invalid("sweep", format!("`{key}={v}`: not a non-negative integer")))
    };
    // The engine keys' environment defaults (TBOOST_BACKEND for auto, pin_threads, profile).
    let env = tboost_engine::engine::EngineConfig::from_env()?;
    let backend = match BackendKind::parse(&a.backend)? {
        BackendKind::Auto => env.backend,
        kind => kind,
    };
    let spec = BackendSpec { kind: backend, threads: a.threads };
    let be = OpBackend::new(tboost_engine::backend::open_with(spec, &env.backend_options())?);
    let threads = if a.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { a.threads };
    let peak = measure_bandwidth(threads)?;
    let mut rows = Vec::with_capacity(values.len());
    for v in &values {
        let mut r = match kind {
            Some(k) => {
                let tile = if key == "tile_kv" { Some(usize_of(v)?) } else { a.tile_kv };
                let seq = if key == "seq" { usize_of(v)? } else { a.seq };
                attention_row(&a, &be, k, seq, tile)?
            }
            None => {
                let dtype = parse_dtype(if key == "dtype" { v } else { &a.dtype })?;
                let m = if key == "m" { usize_of(v)? } else { a.m };
                let mut t = tiling;
                if MatMulTiling::TUNABLES.iter().any(|t| t.name == key) {
                    t.set(&key, usize_of(v)?).map_err(|u| Error::invalid("sweep", format!("matmul.{u}")))?;
                }
                matmul_row(&a, &be, dtype, m, t)?
            }
        };
        r.value = v.clone();
        rows.push(r);
    }
    let shape = match kind {
        Some(_) => json!({
            "seq": a.seq, "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "block_size": a.block_size, "tile_kv": a.tile_kv,
        }),
        None => json!({
            "rows": a.rows, "cols": a.cols, "m": a.m, "dtype": a.dtype, "precision": a.precision, "tiling": tiling,
        }),
    };
    let backend_name = be.name()?;
    if a.json {
        let out: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let mut o = json!({
                    "time_ms": r.secs * 1e3,
                    "gflops": r.flops / r.secs / 1e9,
                    "gbs": r.bytes / r.secs / 1e9,
                    "pct_peak_bandwidth": 100.0 * r.bytes / r.secs / peak,
                });
                if !key.is_empty() {
                    o[key.as_str()] = serde_json::Value::String(r.value.clone());
                }
                o
            })
            .collect();
        print_json(&json!({
            "op": a.op, "backend": backend_name, "threads": threads, "shape": shape,
            "sweep": if key.is_empty() { serde_json::Value::Null } else { json!(key) },
            "peak_bandwidth_gbs": peak / 1e9, "rows": out,
        }))?;
    } else {
        println!(
            "{} on {backend_name} ({threads} threads) {shape}; peak: {:.1} GB/s streaming read, measured now",
            a.op,
            peak / 1e9
        );
        let label = if key.is_empty() { "run" } else { key.as_str() };
        println!("{label:>10} {:>11} {:>10} {:>9} {:>11}", "time_ms", "GFLOP/s", "GB/s", "%peak_bw");
        for r in &rows {
            let v = if key.is_empty() { "-" } else { r.value.as_str() };
            println!(
                "{v:>10} {:>11.3} {:>10.2} {:>9.2} {:>10.1}%",
                r.secs * 1e3,
                r.flops / r.secs / 1e9,
                r.bytes / r.secs / 1e9,
                100.0 * r.bytes / r.secs / peak
            );
        }
    }
    Ok(())
}
