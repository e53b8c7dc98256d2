//! `tboost perplexity`: the perplexity of a model on a text, computed as llama.cpp's
//! `llama-perplexity` does so that the two can be compared on the same file: the text is
//! tokenized once (BOS first when the model adds one), cut into chunks of `--ctx` tokens
//! (the last partial chunk dropped), each chunk starts with BOS when the model adds one,
//! and only the second half of each chunk is scored (positions ctx/2 + 1 .. ctx - 1, so every
//! scored token has at least ctx/2 tokens of context). PPL = exp(mean negative
//! log-likelihood). The chunks are requests on one engine with prompt logprobs, so they run
//! batched.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use super::{print_json, EngineArgs};
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::sched::Request;
use tboost_engine::{Error, Result};

#[derive(Args)]
pub(crate) struct PerplexityArgs {
    /// Hugging Face directory or .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// The text file to score (e.g. wiki.test.raw).
    #[arg(short = 'f', long)]
    file: PathBuf,
    /// Tokens per chunk (llama-perplexity's -c).
    #[arg(short = 'c', long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many chunks (llama-perplexity's --chunks; default all).
    #[arg(long)]
    chunks: Option<usize>,
    /// Chunks in flight at once on the engine.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub(crate) fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        return Err(Error::invalid("ctx", format!("{} is too small: a chunk needs at least 4 tokens", a.ctx)));
    }
    let text = std::fs::read_to_string(&a.file).map_err(|e| Error::io(a.file.display().to_string(), e))?;
    let model = Model::load(&a.model)?;
    let tok = model.tokenizer.clone().ok_or_else(|| Error::NoTokenizer(a.model.display().to_string()))?;
    let tokens = tok.encode(&text, true)?;
    let available = tokens.len() / a.ctx;
    if available < 1 {
        return Err(Error::invalid(
            "file",
            format!("{} tokenizes to {} tokens, fewer than one chunk of {}", a.file.display(), tokens.len(), a.ctx),
        ));
    }
    let n_chunks = a.chunks.map_or(available, |c| c.min(available)).max(1);
    let parallel = a.parallel.clamp(1, n_chunks);
    let cfg = EngineConfig {
        kv_size: KvSize::Tokens(parallel * (a.ctx + 64)),
        max_seqs: parallel,
        prefix_caching: false,
        ..a.engine.engine_config()?
    };
    let engine = Engine::new(cfg)?;
    engine.load_model(&model)?;
    let bos = tok.bos_id().filter(|_| tok.add_bos());
    let first = a.ctx / 2;
    let started = Instant::now();
    // Chunk index of each request, and each chunk's (nll, count) once scored.
    let mut chunk_of = BTreeMap::new();
    let mut scored: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
    let mut next = 0;
    let mut printed = 0;
    let (mut nll, mut count) = (0f64, 0usize);
    while scored.len() < n_chunks {
        while next < n_chunks && chunk_of.len() - scored.len() < parallel {
            let mut prompt = tokens[next * a.ctx..(next + 1) * a.ctx].to_vec();
            if let Some(b) = bos {
                prompt[0] = b;
            }
            let req = Request { ignore_eos: true, prompt_logprobs: true, ..Request::new(prompt, 1) };
            chunk_of.insert(engine.enqueue(req)?, next);
            next += 1;
        }
        for e in engine.step()?.events {
            if let Some(err) = &e.error {
                return Err(Error::invalid("perplexity", format!("chunk request {} failed: {err}", e.id)));
            }
            if e.prompt_logprobs.is_empty() {
                continue;
            }
            let chunk = chunk_of[&e.id];
            // Position p's logprob is of token p given tokens < p: score first+1 ..= ctx-1.
            let lp = &e.prompt_logprobs[first + 1..a.ctx];
            scored.insert(chunk, (-lp.iter().map(|&x| x as f64).sum::<f64>(), lp.len()));
        }
        // Report in chunk order, as llama-perplexity prints its running estimate.
        while let Some(&(n, c)) = scored.get(&printed) {
            nll += n;
            count += c;
            printed += 1;
            if !a.json {
                eprint!("[{printed}]{:.4},", (nll / count as f64).exp());
            }
        }
    }
    let ppl = (nll / count as f64).exp();
    let secs = started.elapsed().as_secs_f64();
    if a.json {
        print_json(&json!({
            "ppl": ppl, "chunks": n_chunks, "ctx": a.ctx, "scored_tokens": count,
            "text_tokens": tokens.len(), "seconds": secs,
        }))?;
    } else {
        eprintln!();
        println!("Final estimate: PPL = {ppl:.4} ({n_chunks} chunks of {}, {count} tokens scored, {secs:.1} s)", a.ctx);
    }
    Ok(())
}
