//! The `tboost` command-line tool. Its output formats are part of the contract (README).

mod batch;
mod bench;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use tboost_kernels::DType;

use crate::backend::cpu::CpuBackend;
use crate::model::Model;
use crate::plan::PlanOptions;
use crate::runner::ModelRunner;
use crate::session::Session;
use crate::{Error, Result};

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
    /// Generate tokens.
    Run(RunArgs),
    /// Run many requests through one engine (continuous batching) and print the results.
    Batch(batch::BatchArgs),
    /// Measure prefill and decode speed.
    Bench(bench::BenchArgs),
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
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Ops or fusions to forbid, comma-separated (also TBOOST_DISABLE):
    /// flash_attention, standard_attention, fuse_qkv, fuse_gate_up, fuse_add_norm.
    #[arg(long, default_value = "")]
    disable: String,
    /// KV cache element type: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    kv_dtype: String,
}

impl EngineArgs {
    pub(crate) fn plan_options(&self) -> Result<PlanOptions> {
        let disabled: BTreeSet<String> = PlanOptions::parse_disabled(&self.disable)?;
        PlanOptions { disabled, kv_dtype: parse_kv_dtype(&self.kv_dtype)? }.with_env()
    }
}

pub(crate) fn parse_kv_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => Err(Error::invalid("kv-dtype", format!("`{other}` is not one of f32, f16, bf16"))),
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    m: ModelArgs,
    /// Comma-separated prompt token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 32)]
    n: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn load(m: &ModelArgs) -> Result<(Model, ModelRunner)> {
    let opts = m.engine.plan_options()?;
    let model = Model::load(&m.model)?;
    let backend = Box::new(CpuBackend::new(m.engine.threads)?);
    let runner = ModelRunner::new(&model, backend, &opts)?;
    Ok((model, runner))
}

/// Loads a model with a single-sequence KV cache of `capacity` positions.
fn session_runner(m: &ModelArgs, capacity: usize) -> Result<(Model, ModelRunner)> {
    let (model, mut runner) = load(m)?;
    let kv_dtype = parse_kv_dtype(&m.engine.kv_dtype)?;
    let bs = 16;
    runner.alloc_kv(capacity.div_ceil(bs).max(1), bs, kv_dtype)?;
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
            let (_, runner) = load(&m)?;
            if json {
                print_json(&runner.plan.to_json())?;
            } else {
                print!("{}", runner.plan.to_text());
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
        Cmd::Run(a) => {
            let (model, mut runner) = load(&a.m)?;
            let prompt = match &a.tokens {
                Some(t) if !t.is_empty() => t.clone(),
                _ => match model.config.bos_token_id {
                    Some(bos) => vec![bos],
                    None => {
                        return Err(Error::invalid("tokens", "give --tokens (this model has no BOS id to start from)"))
                    }
                },
            };
            if a.temp != 0.0 {
                return Err(Error::invalid("temp", "only greedy decoding (--temp 0) is available in `run` so far"));
            }
            let kv_dtype = parse_kv_dtype(&a.m.engine.kv_dtype)?;
            let cap = prompt.len() + a.n;
            runner.alloc_kv(cap.div_ceil(16), 16, kv_dtype)?;
            let eos: Vec<u32> = if a.ignore_eos { Vec::new() } else { model.config.eos_token_ids.clone() };
            let mut s = Session::new(&mut runner, cap)?;
            let mut generated = Vec::new();
            let mut finish = "length";
            if a.n > 0 {
                let mut logits = s.feed(&prompt, false)?;
                loop {
                    let next = crate::session::argmax(&logits);
                    generated.push(next);
                    if eos.contains(&next) {
                        finish = "eos";
                        break;
                    }
                    if generated.len() == a.n {
                        break;
                    }
                    logits = s.feed(&[next], false)?;
                }
            }
            if a.json {
                print_json(&serde_json::json!({
                    "prompt_ids": prompt, "generated_ids": generated, "finish_reason": finish
                }))?;
            } else {
                let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
                println!("{}", ids.join(" "));
            }
        }
        Cmd::Batch(b) => batch::run(b)?,
        Cmd::Bench(b) => bench::run(b)?,
    }
    Ok(())
}

/// Entry point of the `tboost` binary.
pub fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_timestamp(None).init();
    let cli = Cli::parse();
    if let Err(e) = run(cli.cmd) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
