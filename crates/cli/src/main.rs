//! The `tboost` command-line tool. Its output formats are part of the contract (README).

mod batch;
mod bench;
mod bench_op;
mod perplexity;
mod run;
mod synth;
mod tokenize;

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use tboost_engine::backend::Backend;
use tboost_engine::engine::keys::Raw;
use tboost_engine::engine::EngineConfig;
use tboost_engine::model::Model;
use tboost_engine::runner::ModelRunner;
use tboost_engine::session::Session;
use tboost_engine::{Error, Result};

#[derive(Parser)]
#[command(name = "tboost", version, about = "Embeddable LLM inference engine")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show the operator plan: per layer, the chosen ops and why.
    Plan {
        #[command(flatten)]
        m: ModelArgs,
        #[arg(long)]
        json: bool,
    },
    /// Print logits as JSON `{"logits": [[...]]}` for a token sequence.
    Logits {
        #[command(flatten)]
        m: ModelArgs,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// One row per position instead of the last position only.
        #[arg(long)]
        all_positions: bool,
    },
    /// Generate text or tokens (streams text as it is generated).
    Run(RunArgs),
    /// Text to token ids with the model's tokenizer.
    Tokenize(tokenize::TokenizeArgs),
    /// Run many requests through one engine (continuous batching) and print the results.
    Batch(batch::BatchArgs),
    /// Measure prefill and decode speed.
    Bench(bench::BenchArgs),
    /// Time one operator on its own (operator API), sweeping one parameter.
    BenchOp(bench_op::BenchOpArgs),
    /// Write a synthetic model as a GGUF file (for llama.cpp comparisons).
    Synth(synth::SynthArgs),
    /// Perplexity of the model on a text file, chunked and scored as llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
}

#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// Hugging Face directory or .gguf file.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args, Clone)]
pub(crate) struct EngineArgs {
    /// Where ops run: auto, cpu, ascend or ascend:N (auto: a device when its runtime
    /// loads, else the CPU). Key `backend`; default from TBOOST_BACKEND, else auto.
    #[arg(long)]
    backend: Option<String>,
    /// CPU compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Ops or fusions to forbid, comma-separated: flash_attention, paged_decode_attention,
    /// standard_attention, moe_grouped, convert_weights, pack_weights, fuse_qkv, fuse_gate_up,
    /// fuse_add_norm. Key `disabled_ops`; default from TBOOST_DISABLE.
    #[arg(long)]
    disable: Option<String>,
    /// KV cache element type: auto, f32, f16, bf16 or q8_0 (int8, 34 bytes per 32 values; auto: the backend's choice).
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Matmul activation precision: exact (f32 activations), fast (8-bit activations with
    /// integer dot products where the backend has them) or auto (fast for GGUF
    /// block-quantized weights, as llama.cpp computes them; exact for float weights).
    #[arg(long)]
    precision: Option<String>,
    /// FlashAttention's KV tile in the attention slots: 16, 32, 64, 128 or 256 (default 64;
    /// the engine key `tiling.attention.tile_kv`).
    #[arg(long)]
    tile_kv: Option<usize>,
    /// CPU kernel tiling, comma-separated NAME=VALUE (the engine keys `tiling.NAME`):
    /// matmul.panel_rows, matmul.act_rows, matmul.tasks_per_thread, matmul.decode_task_min_bytes,
    /// moe.expert_batch_tokens, moe.parallel_expert_batches (and attention.tile_kv). Unset
    /// tunables are the op's defaults; none changes a result, only speed.
    #[arg(long, default_value = "")]
    tiling: String,
    /// Tensor-parallel ranks to split the model over (key `tp`; default from TBOOST_TP, else
    /// 1). `--threads` is shared between the ranks of this process.
    #[arg(long)]
    tp: Option<usize>,
    /// How the ranks talk: local (threads of this process), mpi (one process per rank under
    /// `mpirun`; rank and world from MPI_COMM_WORLD) or hccl (threads of this process, one
    /// Ascend device each, `--set devices=ascend:0,1`; activations all-reduced by HCCL on the
    /// devices). Key `comm`.
    #[arg(long)]
    comm: Option<String>,
    /// Any engine key, KEY=VALUE (repeatable): e.g. pin_threads=1, profile=1,
    /// weight_pages=small, ascend_known_bad=aclnnRmsNorm@8.0.RC1..8.0.RC3, max_seqs=8.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

impl EngineArgs {
    /// The engine flags: each sets a key of the engine's configuration table (the C ABI's config
    /// keys), over the table's defaults and their `TBOOST_*` environment variables. A flag not
    /// given leaves its key at that default.
    pub(crate) fn engine_config(&self) -> Result<EngineConfig> {
        let mut c = EngineConfig::from_env()?;
        let flags = [
            ("backend", self.backend.as_deref()),
            ("disabled_ops", self.disable.as_deref()),
            ("kv_dtype", self.kv_dtype.as_deref()),
            ("precision", self.precision.as_deref()),
        ];
        for (key, value) in flags {
            if let Some(v) = value {
                c.set(key, Raw::Str(v))?;
            }
        }
        c.set("threads", Raw::Int(self.threads as i64))?;
        if let Some(tp) = self.tp {
            c.set("tp", Raw::Int(tp as i64))?;
        }
        if let Some(comm) = &self.comm {
            c.set("comm", Raw::Str(comm))?;
        }
        if let Some(t) = self.tile_kv {
            c.set("tiling.attention.tile_kv", Raw::Int(t as i64))?;
        }
        for item in self.tiling.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || Error::invalid("tiling", format!("`{item}`: NAME=VALUE, e.g. matmul.panel_rows=96"));
            let (name, value) = item.split_once('=').ok_or_else(bad)?;
            c.set(&format!("tiling.{}", name.trim()), Raw::Str(value))?;
        }
        for item in &self.set {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| Error::invalid("set", format!("`{item}`: KEY=VALUE, e.g. pin_threads=1")))?;
            c.set(key.trim(), Raw::Str(value))?;
        }
        Ok(c)
    }

    /// The backend these flags name, with their options.
    pub(crate) fn open_backend(&self) -> Result<Box<dyn Backend>> {
        self.engine_config()?.open_backend()
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// Comma-separated prompt token ids.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "chat"])]
    tokens: Option<Vec<u32>>,
    /// Raw prompt text (BOS added when the model asks for it; special tokens parsed).
    #[arg(long, conflicts_with = "chat")]
    prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    n: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalize tokens already in the prompt or output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed (default: from the clock; printed with --json).
    #[arg(long)]
    seed: Option<u64>,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

fn load(m: &ModelArgs) -> Result<(Model, ModelRunner)> {
    let c = m.engine.engine_config()?;
    let backend = m.engine.open_backend()?;
    let model = Model::load(&m.model)?;
    let opts = c.plan_options(backend.as_ref())?;
    let runner = c.runner(&model, backend, &opts)?;
    Ok((model, runner))
}

/// Loads a model with a single-sequence KV cache of `capacity` positions.
fn session_runner(m: &ModelArgs, capacity: usize) -> Result<(Model, ModelRunner)> {
    let (model, mut runner) = load(m)?;
    let bs = runner.plan.block_size;
    runner.alloc_kv(capacity.div_ceil(bs).max(1), bs)?;
    Ok((model, runner))
}

fn print_json(v: &serde_json::Value) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v).map_err(|e| Error::invalid("stdout", e.to_string()))?;
    writeln!(out).map_err(|e| Error::io("stdout", e))
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Plan { m, json } => {
            let (model, runner) = load(&m)?;
            // Device bytes of the uploaded weights per dtype (a backend that counts them, e.g. Ascend,
            // where Q8_0/Q4_0 stay quantized), next to the file's bytes of the tensors of that dtype.
            let file = |d: tboost_ops::DType| -> usize {
                model.weights.tensors().iter().filter(|t| t.dtype == d).map(|t| t.bytes().len()).sum()
            };
            let dev = runner.device_weight_bytes();
            if json {
                let mut v = runner.plan.to_json();
                if let Some(o) = v.as_object_mut() {
                    let per: serde_json::Map<String, serde_json::Value> = dev
                        .iter()
                        .map(|(d, b)| (d.to_string(), serde_json::json!({ "device_bytes": b, "file_bytes": file(*d) })))
                        .collect();
                    o.insert("device_weight_bytes".into(), serde_json::Value::Object(per));
                }
                print_json(&v)?;
            } else {
                print!("{}", runner.plan.to_text());
                if !dev.is_empty() {
                    let per: Vec<String> = dev.iter().map(|(d, b)| format!("{d} {b}")).collect();
                    let total_file: usize = model.weights.tensors().iter().map(|t| t.bytes().len()).sum();
                    println!(
                        "device weight bytes: {}; total {} for {total_file} bytes of tensors in the file",
                        per.join(", "),
                        dev.iter().map(|x| x.1).sum::<usize>()
                    );
                }
            }
        }
        Cmd::Logits { m, tokens, all_positions } => {
            let (model, mut runner) = session_runner(&m, tokens.len())?;
            let vocab = model.config.vocab_size;
            let mut s = Session::new(&mut runner, tokens.len())?;
            let logits = s.feed(&tokens, all_positions)?;
            let rows: Vec<&[f32]> = logits.chunks(vocab).collect();
            print_json(&serde_json::json!({ "logits": rows }))?;
        }
        Cmd::Run(a) => run::run(a)?,
        Cmd::Batch(b) => batch::run(b)?,
        Cmd::Tokenize(t) => tokenize::run(t)?,
        Cmd::Bench(b) => bench::run(b)?,
        Cmd::BenchOp(b) => bench_op::run(b)?,
        Cmd::Synth(a) => synth::run(a)?,
        Cmd::Perplexity(a) => perplexity::run(a)?,
    }
    Ok(())
}

/// Entry point of the `tboost` binary.
pub fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_timestamp(None).init();
    let cli = Cli::parse();
    let res = run(cli.cmd);
    // Printed before MPI ends: after a failed collective `finalize` ends the job and does not
    // return.
    if let Err(e) = &res {
        eprintln!("error: {e}");
    }
    // Under `mpirun` (comm mpi) every rank ends MPI; a no-op otherwise.
    tboost_engine::comm::mpi::finalize();
    if res.is_err() {
        std::process::exit(1);
    }
}
