//! The engine: load a model, enqueue requests, `step()` in a loop, read tokens. For a host
//! that steps on one thread and reads on others, [`EventEngine`] queues the events and lets
//! any thread `wait` for them.
//!
//! Threads: `step` runs on one thread at a time (a concurrent call gets `Error::Busy`; the
//! core lock is the one stepping guard and nothing else takes it while requests run);
//! `enqueue`, `cancel`, `stats`, `output` and `plan` may be called from any thread, also
//! while a step runs: they touch only the `shared` state, which a step locks briefly at its
//! start (to take new requests and cancellations) and at its end (to publish tokens).
//!
//! Cancellation contract: `cancel` returning Ok means the request's events end with a
//! `Cancelled` finish — also when the step running at that moment would have finished it
//! (its last token is still delivered, with the `Cancelled` finish) — and cancelling it again
//! returns Ok.

mod config;
mod core;
mod draft;
mod events;
pub mod keys;
mod model_info;

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Instant;

use serde::Serialize;

pub use config::{parse_kv_dtype, parse_precision, tiling_keys, EngineConfig, KvSize, WeightPages};
pub use events::{EventEngine, QueuedEvent, StepFaults};
pub use model_info::model_info;

use self::core::Core;
use crate::backend;
use crate::kv::{KvManager, KvPools};
use crate::model::{Model, ModelConfig};
use crate::plan::Plan;
use crate::runner::ModelRunner;
use crate::sample::constrain::Grammars;
use crate::sample::{FinishReason, Sampler, StopCriteria};
pub use crate::sched::Timings;
use crate::sched::{Request, RequestId, SchedLimits, Seq};
use crate::{Error, Result};

/// A request's output so far, readable from any thread.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestOutput {
    pub id: RequestId,
    pub tag: u64,
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub error: Option<String>,
    /// Prompt logprobs (`Request::prompt_logprobs`), once the prompt has been computed.
    pub prompt_logprobs: Option<Vec<f32>>,
    /// Set when the request finished.
    pub timings: Option<Timings>,
}

/// What happened to one request in one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub id: RequestId,
    pub tag: u64,
    /// The new token, if one was generated.
    pub token: Option<u32>,
    pub logprob: Option<f32>,
    /// Top alternatives `(token, logprob)` when the request asked for logprobs.
    pub top_logprobs: Vec<(u32, f32)>,
    pub finish: Option<FinishReason>,
    /// Why the request failed (`finish == Some(Error)`).
    pub error: Option<String>,
    /// On the event of the first generated token of a request that asked for them:
    /// the logprob of each prompt token given those before it (entry 0 is NaN).
    pub prompt_logprobs: Vec<f32>,
    /// On the finish event (from the scheduler's view; a cancel raced with a finish keeps
    /// the finish's timings).
    pub timings: Option<Timings>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepOutput {
    pub events: Vec<Event>,
    /// Tokens computed this step (decodes + prefill chunks).
    pub batched_tokens: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub waiting: usize,
    pub running: usize,
    /// Waiting requests that were preempted and will be recomputed.
    pub preempted: usize,
    pub preemptions_total: u64,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_cached: usize,
    pub block_size: usize,
    pub prefix_cache_hit_tokens: u64,
    /// Prompt tokens computed (each once: not the recomputation after a preemption, not
    /// prefix-cache hits).
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Every token computed, recomputations included.
    pub computed_tokens: u64,
    pub steps: u64,
    pub last_step_ms: f64,
    pub total_step_ms: f64,
    pub finished: u64,
    pub cancelled: u64,
    /// Bytes copied between the backend and the CPU beside it (per-op fallbacks).
    pub fallback_copied_bytes: u64,
    /// Tensor parallelism: bytes of logits the leader's host all-gathers brought in (every
    /// rank's vocabulary part of a row, or only its best candidate for greedy rows).
    pub tp_gathered_logit_bytes: u64,
    /// Speculative decoding (`spec_ngram`): draft tokens proposed, and those the model kept.
    pub spec_drafted: u64,
    pub spec_accepted: u64,
    /// KV blocks the draft model's own pool holds (`spec_draft_model`).
    pub spec_draft_blocks_used: usize,
    /// Structured output: token masks computed and the host milliseconds they took (the
    /// first mask of a step overlaps the backend's forward pass).
    pub grammar_masks: u64,
    pub grammar_mask_ms: f64,
}

/// What `enqueue` needs to validate a request, and what readers ask about the model,
/// without waiting for a running step.
struct ModelFacts {
    tokenizer: Option<Arc<crate::tokenizer::Tokenizer>>,
    name: String,
    config: ModelConfig,
    plan: Plan,
    eos_ids: Vec<u32>,
    kv_blocks: usize,
    block_size: usize,
    /// This process's rank when it follows a tensor-parallel leader (takes no requests).
    follower: Option<usize>,
    /// The token trie grammars compile against, built at the first constrained request.
    grammars: Arc<std::sync::OnceLock<std::result::Result<Arc<Grammars>, String>>>,
}

#[derive(Default)]
struct Shared {
    facts: Option<ModelFacts>,
    next_id: RequestId,
    arrivals: u64,
    incoming: Vec<(Seq, u64)>,
    /// Cancels accepted since the last step began.
    cancels: Vec<RequestId>,
    outputs: HashMap<RequestId, RequestOutput>,
    finished_order: VecDeque<RequestId>,
    /// Requests not yet admitted (incoming + the scheduler's waiting queue at the last step).
    waiting: usize,
    stats: Stats,
    /// A tensor-parallel follower whose leader has not stopped: its `step` has the leader's
    /// steps to run, so it has work.
    following: bool,
}

impl Shared {
    fn record_finish(&mut self, id: RequestId, keep: usize) {
        self.finished_order.push_back(id);
        while self.finished_order.len() > keep {
            if let Some(old) = self.finished_order.pop_front() {
                self.outputs.remove(&old);
            }
        }
    }
}

pub struct Engine {
    config: EngineConfig,
    shared: Mutex<Shared>,
    core: Mutex<Option<Core>>,
    /// Set by `interrupt`: the running step stops at its next op and fails its batch.
    interrupted: Arc<AtomicBool>,
}

fn poisoned<T>(_: T) -> Error {
    Error::Poisoned
}

impl Engine {
    pub fn new(config: EngineConfig) -> Result<Engine> {
        config.validate()?;
        Ok(Engine {
            config,
            shared: Mutex::new(Shared { next_id: 1, ..Default::default() }),
            core: Mutex::new(None),
            interrupted: Arc::new(AtomicBool::new(false)),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    fn shared(&self) -> Result<MutexGuard<'_, Shared>> {
        self.shared.lock().map_err(poisoned)
    }

    /// Loads a model file or directory (replacing a previous model when idle).
    pub fn load(&self, path: &Path) -> Result<()> {
        let model = Model::load(path)?;
        self.load_model(&model)
    }

    /// Plans and places an already loaded model (e.g. a synthetic one) on the configured
    /// backend.
    pub fn load_model(&self, model: &Model) -> Result<()> {
        self.load_model_on(model, self.config.open_backend()?)
    }

    /// Plans and places a model on a given backend (tests, hosts with their own backend).
    pub fn load_model_on(&self, model: &Model, be: Box<dyn backend::Backend>) -> Result<()> {
        let mut core = self.core.lock().map_err(poisoned)?;
        if core.as_ref().is_some_and(|c| !c.is_idle()) {
            return Err(Error::invalid(
                "load",
                "requests are in flight; cancel them or wait before loading another model",
            ));
        }
        let cfg = &model.config;
        let opts = self.config.plan_options(be.as_ref())?;
        let bs = opts.block_size;
        let mut runner = self.config.runner(model, be, &opts)?;
        runner.set_interrupt(self.interrupted.clone());
        let kv_dtype = runner.plan.kv_dtype;
        let per_token = KvPools::bytes_per_token(cfg, kv_dtype);
        let blocks = match self.config.kv_size {
            KvSize::Blocks(n) => n,
            KvSize::Tokens(n) => n.div_ceil(bs),
            KvSize::Bytes(b) => b / (bs * per_token).max(1),
        };
        if blocks == 0 {
            return Err(Error::invalid(
                "kv_cache",
                format!("{:?} holds no block of {bs} tokens ({per_token} bytes per token)", self.config.kv_size),
            ));
        }
        // A tensor-parallel follower (under `mpirun`) gets its pools and buffers from the
        // leader, whose load broadcasts them; its `step` runs them.
        if runner.follower_rank().is_none() {
            runner.alloc_kv(blocks, bs)?;
            // The largest step the scheduler can make: each running sequence gives one logit
            // row and holds at most its context's blocks.
            let seq_blocks = cfg.max_position_embeddings.div_ceil(bs).clamp(1, blocks);
            runner.reserve(self.config.max_batched_tokens, self.config.max_seqs, self.config.max_seqs, seq_blocks)?;
        }
        log::info!(
            "KV cache: {blocks} blocks x {bs} tokens ({per_token} bytes per token, {} MiB, {kv_dtype})",
            (blocks * bs * per_token) >> 20,
        );
        let facts = ModelFacts {
            tokenizer: model.tokenizer.clone(),
            name: model.path.display().to_string(),
            config: cfg.clone(),
            plan: runner.plan.clone(),
            eos_ids: cfg.eos_token_ids.clone(),
            kv_blocks: blocks,
            block_size: bs,
            follower: runner.follower_rank(),
            grammars: Arc::default(),
        };
        let mut kv = KvManager::new(blocks, bs, self.config.prefix_caching);
        // One sliding window in every layer (Mistral-style): blocks behind it go back to the pool.
        kv.set_window(cfg.features.uniform_window().unwrap_or(0));
        let mut c = Core::new(runner, kv);
        c.spec_ngram = self.config.spec_ngram;
        if !self.config.spec_draft_model.is_empty() && facts.follower.is_none() {
            c.drafter = Some(self.drafter(cfg, blocks)?);
        }
        *core = Some(c);
        let mut sh = self.shared()?;
        sh.following = facts.follower.is_some();
        sh.facts = Some(facts);
        sh.stats = Stats { kv_blocks_total: blocks, block_size: bs, ..Default::default() };
        Ok(())
    }

    /// The draft model of `spec_draft_model` beside a target of config `target`: its own runner
    /// on the configured backend (the whole model, on the leader only) and a pool of `blocks`
    /// blocks.
    fn drafter(&self, target: &ModelConfig, blocks: usize) -> Result<draft::Drafter> {
        let path = Path::new(&self.config.spec_draft_model);
        let named = |e: Error| Error::invalid("spec_draft_model", format!("draft model {}: {e}", path.display()));
        if self.config.spec_ngram > 0 {
            return Err(Error::invalid(
                "spec_draft_model",
                "a draft model and prompt lookup (spec_ngram) are exclusive: set one of them",
            ));
        }
        let model = Model::load(path).map_err(named)?;
        if model.config.vocab_size != target.vocab_size {
            return Err(Error::invalid(
                "spec_draft_model",
                format!(
                    "draft model {} has a vocabulary of {} tokens, the model {}: drafts must be the model's token ids",
                    path.display(),
                    model.config.vocab_size,
                    target.vocab_size
                ),
            ));
        }
        let be = self.config.open_backend()?;
        let opts = self.config.plan_options(be.as_ref())?;
        let bs = opts.block_size;
        let mut runner = ModelRunner::new(&model, be, &opts, self.config.threads).map_err(named)?;
        runner.set_interrupt(self.interrupted.clone());
        runner.alloc_kv(blocks, bs)?;
        let seq_blocks = model.config.max_position_embeddings.div_ceil(bs).clamp(1, blocks);
        runner.reserve(self.config.max_batched_tokens, self.config.max_seqs, self.config.max_seqs, seq_blocks)?;
        let mut kv = KvManager::new(blocks, bs, false);
        kv.set_window(model.config.features.uniform_window().unwrap_or(0));
        log::info!(
            "draft model {}: {} layers, {} draft tokens a step, {blocks} KV blocks of its own",
            path.display(),
            model.config.num_layers,
            self.config.spec_draft_tokens
        );
        Ok(draft::Drafter::new(runner, kv, self.config.spec_draft_tokens, self.config.max_batched_tokens))
    }

    fn facts<T>(&self, f: impl FnOnce(&ModelFacts) -> T) -> Result<T> {
        let sh = self.shared()?;
        sh.facts.as_ref().map(f).ok_or(Error::NoModel)
    }

    /// The loaded model's config.
    pub fn model_config(&self) -> Result<ModelConfig> {
        self.facts(|f| f.config.clone())
    }

    /// The loaded model's operator plan.
    pub fn plan(&self) -> Result<Plan> {
        self.facts(|f| f.plan.clone())
    }

    /// Text → token ids with the model's tokenizer (`add_special`: add BOS when the model
    /// asks for it). Safe from any thread, also during a step.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.tokenizer()?.encode(text, add_special)
    }

    /// Token ids → text with the model's tokenizer (control tokens hidden). Safe from any
    /// thread, also during a step.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer()?.decode(ids)
    }

    /// The loaded model's tokenizer.
    pub fn tokenizer(&self) -> Result<Arc<crate::tokenizer::Tokenizer>> {
        let sh = self.shared()?;
        let f = sh.facts.as_ref().ok_or(Error::NoModel)?;
        f.tokenizer.clone().ok_or_else(|| Error::NoTokenizer(f.name.clone()))
    }

    /// This engine's rank when it is a tensor-parallel follower (`None` on the leader and
    /// without tensor parallelism). A follower takes no requests; its `step` runs the
    /// leader's steps until the leader's engine is dropped, and `has_work` is true until then.
    pub fn follower_rank(&self) -> Result<Option<usize>> {
        self.facts(|f| f.follower)
    }

    /// Validates and queues a request; returns its id.
    pub fn enqueue(&self, req: Request) -> Result<RequestId> {
        // Compiling a grammar (and, the first time, the vocabulary's token trie) takes
        // milliseconds: done before taking the shared lock, so a step can publish meanwhile.
        let constraint = match &req.grammar {
            None => None,
            Some(g) => Some(self.grammars()?.constraint(g)?),
        };
        let mut sh = self.shared()?;
        let f = sh.facts.as_ref().ok_or(Error::NoModel)?;
        if let Some(rank) = f.follower {
            return Err(Error::invalid(
                "enqueue",
                format!("this engine is tensor-parallel rank {rank}, a follower: requests go to rank 0"),
            ));
        }
        let vocab = f.config.vocab_size;
        if req.prompt.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        if let Some((i, &t)) = req.prompt.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(Error::invalid(
                "prompt",
                format!("token {t} at index {i} is not below the vocabulary size {vocab}"),
            ));
        }
        if req.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        req.sampling.validate()?;
        req.sampling.validate_tokens(vocab)?;
        let eos_ids = req.eos_ids.clone().unwrap_or_else(|| f.eos_ids.clone());
        let stop = StopCriteria {
            max_tokens: req.max_tokens,
            eos_ids,
            ignore_eos: req.ignore_eos,
            stop_sequences: req.stop_sequences.clone(),
        };
        stop.validate()?;
        stop.validate_tokens(vocab)?;
        let total = req.prompt.len().saturating_add(req.max_tokens);
        let need = total.div_ceil(f.block_size);
        if need > f.kv_blocks {
            return Err(Error::KvCapacity(format!(
                "prompt {} + max_tokens {} = {total} tokens need {need} blocks of {} but the whole KV cache has {}",
                req.prompt.len(),
                req.max_tokens,
                f.block_size,
                f.kv_blocks
            )));
        }
        let max_positions = f.config.max_position_embeddings;
        if total > max_positions {
            log::warn!("request of {total} tokens goes beyond the model's {max_positions} trained positions");
        }
        if sh.waiting >= self.config.queue_limit {
            return Err(Error::QueueFull(self.config.queue_limit));
        }
        let sampler = Sampler::new(req.sampling.clone())?;
        let id = sh.next_id;
        sh.next_id += 1;
        sh.arrivals += 1;
        let want_plp = req.prompt_logprobs;
        let mut seq = Seq::new(id, sh.arrivals, req.prompt, req.priority, sampler, stop);
        if want_plp {
            seq = seq.with_prompt_logprobs();
        }
        seq.constraint = constraint;
        sh.outputs.insert(
            id,
            RequestOutput {
                id,
                tag: req.tag,
                tokens: Vec::new(),
                finish: None,
                error: None,
                prompt_logprobs: None,
                timings: None,
            },
        );
        sh.incoming.push((seq, req.tag));
        sh.waiting += 1;
        Ok(id)
    }

    /// The token trie grammars compile against, built at the first call.
    fn grammars(&self) -> Result<Arc<Grammars>> {
        let (cell, tok, name, vocab, eos) = {
            let sh = self.shared()?;
            let f = sh.facts.as_ref().ok_or(Error::NoModel)?;
            (f.grammars.clone(), f.tokenizer.clone(), f.name.clone(), f.config.vocab_size, f.eos_ids.first().copied())
        };
        cell.get_or_init(|| {
            let tok =
                tok.ok_or_else(|| format!("{name}: structured output needs the model's tokenizer, and it has none"))?;
            let eos = eos.or(tok.eos_id()).unwrap_or(0);
            Grammars::new(&tok, vocab, eos).map(Arc::new).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| Error::invalid("grammar", e))
    }

    /// Cancels a request (see the module doc for the contract). An unknown id, or one that
    /// finished otherwise, is `NotFound`. Its blocks are freed by the next step, whose events
    /// carry its `Cancelled` finish.
    pub fn cancel(&self, id: RequestId) -> Result<()> {
        let mut sh = self.shared()?;
        match sh.outputs.get(&id) {
            None => Err(Error::NotFound(format!("request {id} is unknown"))),
            Some(o) if o.finish == Some(FinishReason::Cancelled) => Ok(()),
            Some(o) if o.finish.is_some() => {
                Err(Error::NotFound(format!("request {id} already finished ({})", o.finish.map_or("", |f| f.as_str()))))
            }
            Some(_) => {
                if !sh.cancels.contains(&id) {
                    sh.cancels.push(id);
                }
                Ok(())
            }
        }
    }

    /// A request's tokens and state so far.
    pub fn output(&self, id: RequestId) -> Result<RequestOutput> {
        let sh = self.shared()?;
        sh.outputs.get(&id).cloned().ok_or_else(|| Error::NotFound(format!("request {id} is unknown")))
    }

    pub fn stats(&self) -> Result<Stats> {
        Ok(self.shared()?.stats.clone())
    }

    /// For each running request: (id, positions in the cache, blocks held). Lets tests and
    /// operators check that a sequence never holds more than one partially filled block.
    /// Waits for a running step.
    pub fn kv_usage(&self) -> Result<Vec<(RequestId, usize, usize)>> {
        let core = self.core.lock().map_err(poisoned)?;
        let c = core.as_ref().ok_or(Error::NoModel)?;
        Ok(c.sched.running.iter().map(|s| (s.id, s.computed, c.kv.blocks_of(s.id) - c.kv.dropped_of(s.id))).collect())
    }

    /// True while any request is waiting or running, or a cancellation is to be reported; on
    /// a tensor-parallel follower, until its `step` has returned from following the leader
    /// (the leader stopped, or the group failed). So `while has_work() { step() }` serves
    /// the leader and the followers alike.
    pub fn has_work(&self) -> Result<bool> {
        let sh = self.shared()?;
        Ok(sh.waiting > 0 || sh.stats.running > 0 || !sh.cancels.is_empty() || sh.following)
    }

    /// Stops a running step at its next op (its batch fails with an error event) and makes
    /// every later step fail at once: for hosts tearing the engine down.
    pub fn interrupt(&self) {
        self.interrupted.store(true, Ordering::SeqCst);
    }

    /// Publishes a step's events and the stats; applies the cancellation contract to
    /// requests that finished in a step a cancel raced with.
    fn publish(&self, c: &mut Core, events: &mut [Event], step_ms: f64) -> Result<()> {
        let mut sh = self.shared()?;
        for e in events.iter_mut() {
            if e.finish.is_some() && e.finish != Some(FinishReason::Cancelled) {
                if let Some(i) = sh.cancels.iter().position(|&id| id == e.id) {
                    // The cancel was accepted while this step ran: it wins.
                    sh.cancels.swap_remove(i);
                    e.finish = Some(FinishReason::Cancelled);
                    e.error = None;
                }
            }
            match e.finish {
                Some(FinishReason::Cancelled) => c.cancelled += 1,
                Some(_) => c.finished += 1,
                None => {}
            }
            let keep = self.config.finished_records;
            if let Some(o) = sh.outputs.get_mut(&e.id) {
                if let Some(t) = e.token {
                    o.tokens.push(t);
                }
                if !e.prompt_logprobs.is_empty() {
                    o.prompt_logprobs = Some(e.prompt_logprobs.clone());
                }
                if e.finish.is_some() {
                    o.finish = e.finish;
                    o.error.clone_from(&e.error);
                    o.timings = e.timings;
                }
            }
            if e.finish.is_some() {
                sh.record_finish(e.id, keep);
            }
        }
        let waiting = c.sched.waiting.len() + sh.incoming.len();
        sh.waiting = waiting;
        let prev_ms = sh.stats.last_step_ms;
        sh.stats = Stats {
            waiting,
            running: c.sched.running.len(),
            preempted: c.sched.waiting.values().filter(|s| s.preemptions > 0).count(),
            preemptions_total: c.sched.counters.preemptions,
            kv_blocks_total: c.kv.total(),
            kv_blocks_used: c.kv.used(),
            kv_blocks_cached: c.kv.cached(),
            block_size: c.kv.block_size(),
            prefix_cache_hit_tokens: c.sched.counters.prefix_hit_tokens,
            prompt_tokens: c.prompt_tokens,
            generated_tokens: c.generated_tokens,
            computed_tokens: c.computed_tokens,
            steps: c.steps,
            last_step_ms: if step_ms > 0.0 { step_ms } else { prev_ms },
            total_step_ms: c.total_step_ms,
            finished: c.finished,
            cancelled: c.cancelled,
            fallback_copied_bytes: c.runner.fallback_copied_bytes(),
            tp_gathered_logit_bytes: c.runner.gathered_logit_bytes(),
            spec_drafted: c.spec_drafted,
            spec_accepted: c.spec_accepted,
            spec_draft_blocks_used: c.drafter.as_ref().map_or(0, |d| d.blocks_used()),
            grammar_masks: c.masks,
            grammar_mask_ms: c.mask_ms,
        };
        Ok(())
    }

    /// One continuous-batching iteration. Returns `Error::Busy` if another thread is
    /// stepping. Per-request failures are events (`finish == Error`), not errors.
    pub fn step(&self) -> Result<StepOutput> {
        self.step_with(|| {})
    }

    /// `step`, running `first` once this thread holds the stepping guard (`EventEngine`'s
    /// testing faults — a delay, an injected panic — run there, so a concurrent step sees
    /// `Busy` and a panic poisons the engine as a real one would).
    fn step_with(&self, first: impl FnOnce()) -> Result<StepOutput> {
        let mut guard = match self.core.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return Err(Error::Busy),
            Err(TryLockError::Poisoned(_)) => return Err(Error::Poisoned),
        };
        first();
        let c = guard.as_mut().ok_or(Error::NoModel)?;
        if c.runner.follower_rank().is_some() {
            // A follower's step runs the leader's steps until the leader stops (or the group
            // fails: the error is this step's). Its work then ends: `has_work` turns false and
            // a later step returns at once, as a leader's does with nothing to do.
            if !self.shared()?.following {
                return Ok(StepOutput::default());
            }
            let followed = c.runner.follow();
            self.shared()?.following = false;
            followed?;
            return Ok(StepOutput::default());
        }
        let t0 = Instant::now();
        let mut out = StepOutput::default();
        let (incoming, cancels) = {
            let mut sh = self.shared()?;
            (std::mem::take(&mut sh.incoming), std::mem::take(&mut sh.cancels))
        };
        c.admit(incoming);
        c.cancel(&cancels, &mut out.events);
        let limits = SchedLimits { max_seqs: self.config.max_seqs, max_batched_tokens: self.config.max_batched_tokens };
        let ran = c.run(limits, &mut out)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if ran {
            c.steps += 1;
            c.total_step_ms += ms;
        }
        self.publish(c, &mut out.events, if ran { ms } else { 0.0 })?;
        Ok(out)
    }

    /// Steps until no request is waiting or running; returns every event in order.
    pub fn run_to_completion(&self) -> Result<Vec<Event>> {
        let mut all = Vec::new();
        while self.has_work()? {
            let out = self.step()?;
            all.extend(out.events);
        }
        Ok(all)
    }
}
