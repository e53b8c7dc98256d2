//! `tboost run`: one request through the engine, text streamed as tokens arrive.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use serde_json::json;

use super::{print_json, RunArgs};
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::sample::{FinishReason, SamplingParams};
use tboost_engine::sched::Request;
use tboost_engine::tokenizer::{ChatTemplate, Decoder, Message};
use tboost_engine::{Error, Result};

/// Loads a model and reads its weights once, with a progress bar when stderr is a terminal.
pub(crate) fn load_with_progress(path: &std::path::Path) -> Result<Model> {
    let model = Model::load(path)?;
    if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} {bar:40} {bytes}/{total_bytes} ({eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        model.weights.touch(&mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
            true
        });
        bar.finish_and_clear();
    } else {
        model.weights.touch(&mut |_, _| true);
    }
    Ok(model)
}

pub(crate) fn run(a: RunArgs) -> Result<()> {
    let model = load_with_progress(&a.m.model)?;
    let tok = model.tokenizer.clone();
    let no_tok = || Error::NoTokenizer(a.m.model.display().to_string());
    let prompt: Vec<u32> = if let Some(t) = &a.tokens {
        t.clone()
    } else if let Some(text) = &a.prompt {
        tok.as_ref().ok_or_else(no_tok)?.encode(text, true)?
    } else if let Some(user) = &a.chat {
        let tmpl = ChatTemplate::require(model.chat_template.clone(), &a.m.model.display().to_string())?;
        let mut msgs = Vec::new();
        if let Some(sys) = &a.system {
            msgs.push(Message::new("system", sys));
        }
        msgs.push(Message::new("user", user));
        let text = tmpl.render(&msgs, true)?;
        // The template writes BOS itself when the model wants one.
        tok.as_ref().ok_or_else(no_tok)?.encode(&text, false)?
    } else {
        match model.config.bos_token_id {
            Some(bos) => vec![bos],
            None => {
                return Err(Error::invalid(
                    "prompt",
                    "give --tokens, --prompt or --chat (this model has no BOS id to start from)",
                ))
            }
        }
    };
    if prompt.is_empty() {
        return Err(Error::invalid("prompt", "encodes to no tokens"));
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
    });
    let sampling = SamplingParams {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repeat_penalty,
        seed,
        ..SamplingParams::default()
    };
    let cfg = a.m.engine.engine_config()?;
    // One request: a step never holds more than the prompt (or a draft and its token), so the
    // activation buffers, reserved and touched up front, need no room for 512 tokens (as
    // llama.cpp's examples size their batch to the prompt).
    let step_tokens = prompt.len().max(1 + cfg.spec_ngram.max(cfg.spec_draft_tokens)).min(512);
    let engine = Engine::new(EngineConfig {
        kv_size: KvSize::Tokens(prompt.len() + a.n),
        max_seqs: 1,
        max_batched_tokens: step_tokens,
        ..cfg
    })?;
    engine.load_model(&model)?;
    if engine.follower_rank()?.is_some() {
        // A tensor-parallel follower (comm mpi): runs the leader's steps until it stops.
        engine.step()?;
        return Ok(());
    }
    let id = engine.enqueue(Request { sampling, ignore_eos: a.ignore_eos, ..Request::new(prompt.clone(), a.n) })?;

    let stream = !a.json && tok.is_some();
    let mut decoder = tok.as_ref().map(|_| Decoder::new());
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let mut first_token = None;
    let mut generated = Vec::new();
    let mut finish = None;
    let mut error = None;
    while finish.is_none() {
        for ev in engine.step()?.events.into_iter().filter(|e| e.id == id) {
            if let Some(t) = ev.token {
                first_token.get_or_insert_with(Instant::now);
                generated.push(t);
                if let (true, Some(d), Some(tk)) = (stream, decoder.as_mut(), tok.as_ref()) {
                    let is_eog = !a.ignore_eos && tk.is_eog(t);
                    if !is_eog {
                        let piece = d.push(tk, t)?;
                        out.write_all(piece.as_bytes())
                            .and_then(|_| out.flush())
                            .map_err(|e| Error::io("stdout", e))?;
                    }
                }
            }
            if ev.finish.is_some() {
                finish = ev.finish;
                error = ev.error;
            }
        }
    }
    let end = Instant::now();
    if let (true, Some(d)) = (stream, decoder.as_mut()) {
        writeln!(out, "{}", d.finish()).map_err(|e| Error::io("stdout", e))?;
    }
    drop(out);
    if let Some(e) = error {
        return Err(Error::Request(e));
    }
    let ttft = first_token.map_or(0.0, |t| (t - t0).as_secs_f64());
    let decode_s = first_token.map_or(0.0, |t| (end - t).as_secs_f64());
    let prefill_tps = prompt.len() as f64 / ttft.max(1e-9);
    let decode_tps = if generated.len() > 1 { (generated.len() - 1) as f64 / decode_s.max(1e-9) } else { 0.0 };
    let finish = finish.unwrap_or(FinishReason::Error);
    if a.json {
        let mut v = json!({
            "prompt_ids": prompt, "generated_ids": generated, "finish_reason": finish.as_str(), "seed": seed,
            "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
        });
        let st = engine.stats()?;
        if st.spec_drafted > 0 {
            v["spec_drafted"] = json!(st.spec_drafted);
            v["spec_accepted"] = json!(st.spec_accepted);
        }
        if let Some(tk) = &tok {
            v["text"] = json!(tk.decode(&generated)?);
        }
        print_json(&v)?;
    } else if tok.is_none() {
        let ids: Vec<String> = generated.iter().map(u32::to_string).collect();
        println!("{}", ids.join(" "));
    }
    if !a.json {
        eprintln!(
            "[{} prompt tokens at {:.1} tokens/s, {} generated at {:.1} tokens/s, finish: {}]",
            prompt.len(),
            prefill_tps,
            generated.len(),
            decode_tps,
            finish
        );
    }
    Ok(())
}
