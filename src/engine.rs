//! The engine: load a model, enqueue requests, `step()` in a loop, read tokens.
//!
//! Threads: `step` runs on one thread at a time (a concurrent call gets `Error::Busy`);
//! `enqueue`, `cancel`, `stats` and `output` may be called from any thread, also while a
//! step runs: they touch only the `shared` state, which a step locks briefly at its start
//! (to take new requests and cancellations) and at its end (to publish tokens and stats).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::Path;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Instant;

use serde::Serialize;
use tboost_kernels::attention::SeqSpan;
use tboost_ops::DType;

use crate::backend::cpu::CpuBackend;
use crate::kv::{BlockManager, KvPools};
use crate::model::{Model, ModelConfig};
use crate::plan::{Plan, PlanOptions};
use crate::runner::{ModelRunner, StepBatch};
use crate::sample::{FinishReason, Sampler, StopCriteria};
use crate::sched::{Request, RequestId, SchedLimits, Scheduler, Seq};
use crate::{Error, Result};

/// How much memory the KV cache gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSize {
    Bytes(usize),
    Blocks(usize),
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads (0 = one per core).
    pub threads: usize,
    pub kv_size: KvSize,
    /// Tokens per KV block.
    pub block_size: usize,
    pub kv_dtype: DType,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most tokens computed in one step (decodes + prefill chunks).
    pub max_batched_tokens: usize,
    pub prefix_caching: bool,
    /// Most requests waiting to start; `enqueue` fails beyond it.
    pub queue_limit: usize,
    /// Ops and fusions to forbid (plan names; `TBOOST_DISABLE` adds to them).
    pub disabled_ops: BTreeSet<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: 0,
            kv_size: KvSize::Bytes(512 << 20),
            block_size: 16,
            kv_dtype: DType::F32,
            max_seqs: 64,
            max_batched_tokens: 512,
            prefix_caching: true,
            queue_limit: 4096,
            disabled_ops: BTreeSet::new(),
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |p: &str, m: String| Err(Error::invalid(p, m));
        if self.block_size == 0 || self.block_size > 1024 {
            return bad("block_size", format!("{} is not in 1..=1024", self.block_size));
        }
        if self.max_seqs == 0 {
            return bad("max_seqs", "must be at least 1".into());
        }
        if self.max_batched_tokens < self.max_seqs {
            return bad(
                "max_batched_tokens",
                format!(
                    "{} is below max_seqs {}: every running decode must fit in a step",
                    self.max_batched_tokens, self.max_seqs
                ),
            );
        }
        if self.queue_limit == 0 {
            return bad("queue_limit", "must be at least 1".into());
        }
        if !matches!(self.kv_dtype, DType::F32 | DType::F16 | DType::BF16) {
            return bad("kv_dtype", format!("{} is not one of f32, f16, bf16", self.kv_dtype));
        }
        match self.kv_size {
            KvSize::Blocks(0) | KvSize::Bytes(0) => bad("kv_cache", "the KV cache cannot be empty".into()),
            _ => Ok(()),
        }
    }
}

/// A request's output so far, readable from any thread.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestOutput {
    pub id: RequestId,
    pub tag: u64,
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub error: Option<String>,
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
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub computed_tokens: u64,
    pub steps: u64,
    pub last_step_ms: f64,
    pub total_step_ms: f64,
    pub finished: u64,
    pub cancelled: u64,
}

/// What `enqueue` needs to validate a request without waiting for a running step.
struct ModelFacts {
    tokenizer: Option<std::sync::Arc<crate::tokenizer::Tokenizer>>,
    name: String,
    vocab: usize,
    eos_ids: Vec<u32>,
    kv_blocks: usize,
    block_size: usize,
    max_positions: usize,
}

/// Records of finished requests are kept this long (for `output` and `cancel` answers).
const FINISHED_RECORDS: usize = 65536;

#[derive(Default)]
struct Shared {
    facts: Option<ModelFacts>,
    next_id: RequestId,
    arrivals: u64,
    incoming: Vec<Seq>,
    cancels: Vec<RequestId>,
    outputs: HashMap<RequestId, RequestOutput>,
    finished_order: VecDeque<RequestId>,
    /// Requests not yet admitted (incoming + the scheduler's waiting queue at the last step).
    waiting: usize,
    stats: Stats,
    /// Events of cancellations applied between steps (by `cancel`), returned by the next
    /// `step` so that a host reading the event stream sees every request's end.
    pending_events: Vec<Event>,
}

impl Shared {
    fn record_finish(&mut self, id: RequestId) {
        self.finished_order.push_back(id);
        while self.finished_order.len() > FINISHED_RECORDS {
            if let Some(old) = self.finished_order.pop_front() {
                self.outputs.remove(&old);
            }
        }
    }
}

/// Everything a step works on.
struct Core {
    runner: ModelRunner,
    blocks: BlockManager,
    sched: Scheduler,
    tags: HashMap<RequestId, u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    computed_tokens: u64,
    steps: u64,
    total_step_ms: f64,
    finished: u64,
    cancelled: u64,
    // Reused per-step buffers.
    logits: Vec<f32>,
}

pub struct Engine {
    config: EngineConfig,
    shared: Mutex<Shared>,
    core: Mutex<Option<Core>>,
}

fn poisoned<T>(_: T) -> Error {
    Error::Poisoned
}

impl Engine {
    pub fn new(config: EngineConfig) -> Result<Engine> {
        config.validate()?;
        Ok(Engine { config, shared: Mutex::new(Shared { next_id: 1, ..Default::default() }), core: Mutex::new(None) })
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

    /// Plans and places an already loaded model (e.g. a synthetic one).
    pub fn load_model(&self, model: &Model) -> Result<()> {
        let mut core = self.core.lock().map_err(poisoned)?;
        if let Some(c) = core.as_ref() {
            if !c.sched.running.is_empty() || !c.sched.waiting.is_empty() {
                return Err(Error::invalid(
                    "load",
                    "requests are in flight; cancel them or wait before loading another model",
                ));
            }
        }
        let cfg = &model.config;
        let opts =
            PlanOptions { disabled: self.config.disabled_ops.clone(), kv_dtype: self.config.kv_dtype }.with_env()?;
        let backend = Box::new(CpuBackend::new(self.config.threads)?);
        let mut runner = ModelRunner::new(model, backend, &opts)?;
        let bs = self.config.block_size;
        let blocks = match self.config.kv_size {
            KvSize::Blocks(n) => n,
            KvSize::Bytes(b) => b / (bs * KvPools::bytes_per_token(cfg, self.config.kv_dtype)).max(1),
        };
        if blocks == 0 {
            return Err(Error::invalid(
                "kv_cache",
                format!(
                    "{:?} holds no block of {bs} tokens ({} bytes per token)",
                    self.config.kv_size,
                    KvPools::bytes_per_token(cfg, self.config.kv_dtype)
                ),
            ));
        }
        runner.alloc_kv(blocks, bs, self.config.kv_dtype)?;
        log::info!(
            "KV cache: {blocks} blocks x {bs} tokens ({} bytes per token, {} MiB, {})",
            KvPools::bytes_per_token(cfg, self.config.kv_dtype),
            (blocks * bs * KvPools::bytes_per_token(cfg, self.config.kv_dtype)) >> 20,
            self.config.kv_dtype
        );
        let facts = ModelFacts {
            tokenizer: model.tokenizer.clone(),
            name: model.path.display().to_string(),
            vocab: cfg.vocab_size,
            eos_ids: cfg.eos_token_ids.clone(),
            kv_blocks: blocks,
            block_size: bs,
            max_positions: cfg.max_position_embeddings,
        };
        *core = Some(Core {
            runner,
            blocks: BlockManager::new(blocks, bs, self.config.prefix_caching),
            sched: Scheduler::new(),
            tags: HashMap::new(),
            prompt_tokens: 0,
            generated_tokens: 0,
            computed_tokens: 0,
            steps: 0,
            total_step_ms: 0.0,
            finished: 0,
            cancelled: 0,
            logits: Vec::new(),
        });
        let mut sh = self.shared()?;
        sh.facts = Some(facts);
        sh.stats = Stats { kv_blocks_total: blocks, block_size: bs, ..Default::default() };
        Ok(())
    }

    /// The loaded model's config.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let core = self.core.lock().map_err(poisoned)?;
        core.as_ref().map(|c| c.runner.cfg.clone()).ok_or(Error::NoModel)
    }

    /// The loaded model's operator plan.
    pub fn plan(&self) -> Result<Plan> {
        let core = self.core.lock().map_err(poisoned)?;
        core.as_ref().map(|c| c.runner.plan.clone()).ok_or(Error::NoModel)
    }

    /// Text → token ids with the model's tokenizer (`add_special`: add BOS when the model
    /// asks for it).
    /// Safe from any thread, also during a step.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.tokenizer()?.encode(text, add_special)
    }

    /// Token ids → text with the model's tokenizer (control tokens hidden). Safe from any
    /// thread, also during a step.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer()?.decode(ids)
    }

    /// The loaded model's tokenizer.
    pub fn tokenizer(&self) -> Result<std::sync::Arc<crate::tokenizer::Tokenizer>> {
        let sh = self.shared()?;
        let f = sh.facts.as_ref().ok_or(Error::NoModel)?;
        f.tokenizer.clone().ok_or_else(|| Error::NoTokenizer(f.name.clone()))
    }

    /// Validates and queues a request; returns its id.
    pub fn enqueue(&self, req: Request) -> Result<RequestId> {
        let mut sh = self.shared()?;
        let f = sh.facts.as_ref().ok_or(Error::NoModel)?;
        if req.prompt.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        if let Some((i, &t)) = req.prompt.iter().enumerate().find(|(_, &t)| t as usize >= f.vocab) {
            return Err(Error::invalid(
                "prompt",
                format!("token {t} at index {i} is not below the vocabulary size {}", f.vocab),
            ));
        }
        if req.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        req.sampling.validate()?;
        let eos_ids = req.eos_ids.clone().unwrap_or_else(|| f.eos_ids.clone());
        let stop = StopCriteria {
            max_tokens: req.max_tokens,
            eos_ids,
            ignore_eos: req.ignore_eos,
            stop_sequences: req.stop_sequences.clone(),
        };
        stop.validate()?;
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
        if total > f.max_positions {
            log::warn!("request of {total} tokens goes beyond the model's {} trained positions", f.max_positions);
        }
        if sh.waiting >= self.config.queue_limit {
            return Err(Error::QueueFull(self.config.queue_limit));
        }
        let sampler = Sampler::new(req.sampling.clone())?;
        let id = sh.next_id;
        sh.next_id += 1;
        sh.arrivals += 1;
        let seq = Seq {
            id,
            priority: req.priority,
            arrival: sh.arrivals,
            admitted: 0,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            computed: 0,
            block_table: Vec::new(),
            hashed_blocks: 0,
            last_hash: None,
            sampler,
            stop,
            preemptions: 0,
            ever_admitted: false,
        };
        sh.outputs.insert(id, RequestOutput { id, tag: req.tag, tokens: Vec::new(), finish: None, error: None });
        sh.incoming.push(seq);
        sh.waiting += 1;
        Ok(id)
    }

    /// Cancels a request. Idempotent while it is in flight; an unknown or finished id is an
    /// error. Its blocks are freed at once when no step is running, else at the next step;
    /// either way its `Cancelled` event comes out of the next `step`.
    pub fn cancel(&self, id: RequestId) -> Result<()> {
        {
            let mut sh = self.shared()?;
            match sh.outputs.get(&id) {
                None => return Err(Error::NotFound(format!("request {id} is unknown"))),
                Some(o) if o.finish.is_some() => {
                    return Err(Error::NotFound(format!(
                        "request {id} already finished ({})",
                        o.finish.map_or("", |f| f.as_str())
                    )))
                }
                Some(_) => {
                    if !sh.cancels.contains(&id) {
                        sh.cancels.push(id);
                    }
                }
            }
        }
        // Apply now if no step holds the core.
        match self.core.try_lock() {
            Ok(mut core) => {
                if let Some(c) = core.as_mut() {
                    let mut events = Vec::new();
                    self.take_shared_input(c, &mut events)?;
                    self.publish(c, &events, 0.0)?;
                    self.shared()?.pending_events.extend(events);
                }
                Ok(())
            }
            Err(TryLockError::WouldBlock) => Ok(()),
            Err(TryLockError::Poisoned(_)) => Err(Error::Poisoned),
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
    pub fn kv_usage(&self) -> Result<Vec<(RequestId, usize, usize)>> {
        let core = self.core.lock().map_err(poisoned)?;
        let c = core.as_ref().ok_or(Error::NoModel)?;
        Ok(c.sched.running.iter().map(|s| (s.id, s.computed, s.block_table.len())).collect())
    }

    /// True while any request is waiting or running.
    pub fn has_work(&self) -> Result<bool> {
        let sh = self.shared()?;
        Ok(sh.waiting > 0 || sh.stats.running > 0 || !sh.cancels.is_empty() || !sh.pending_events.is_empty())
    }

    /// Moves new requests into the scheduler and applies cancellations.
    fn take_shared_input(&self, c: &mut Core, events: &mut Vec<Event>) -> Result<()> {
        let (incoming, cancels, tags) = {
            let mut sh = self.shared()?;
            let incoming = std::mem::take(&mut sh.incoming);
            let tags: Vec<u64> = incoming.iter().map(|s| sh.outputs.get(&s.id).map_or(0, |o| o.tag)).collect();
            (incoming, std::mem::take(&mut sh.cancels), tags)
        };
        for (s, tag) in incoming.into_iter().zip(tags) {
            c.tags.insert(s.id, tag);
            c.sched.add(s);
        }
        for id in cancels {
            if c.sched.remove(id, &mut c.blocks).is_some() {
                c.cancelled += 1;
                events.push(Event {
                    id,
                    tag: c.tags.remove(&id).unwrap_or(0),
                    token: None,
                    logprob: None,
                    top_logprobs: Vec::new(),
                    finish: Some(FinishReason::Cancelled),
                    error: None,
                });
            }
        }
        Ok(())
    }

    /// Publishes events and stats to the shared state.
    fn publish(&self, c: &Core, events: &[Event], step_ms: f64) -> Result<()> {
        let mut sh = self.shared()?;
        for e in events {
            if let Some(o) = sh.outputs.get_mut(&e.id) {
                if let Some(t) = e.token {
                    o.tokens.push(t);
                }
                if e.finish.is_some() {
                    o.finish = e.finish;
                    o.error.clone_from(&e.error);
                }
            }
            if e.finish.is_some() {
                sh.record_finish(e.id);
            }
        }
        let waiting = c.sched.waiting.len() + sh.incoming.len();
        sh.waiting = waiting;
        let prev = sh.stats.clone();
        sh.stats = Stats {
            waiting,
            running: c.sched.running.len(),
            preempted: c.sched.waiting.iter().filter(|s| s.preemptions > 0).count(),
            preemptions_total: c.sched.counters.preemptions,
            kv_blocks_total: c.blocks.total(),
            kv_blocks_used: c.blocks.used(),
            kv_blocks_cached: c.blocks.cached(),
            block_size: c.blocks.block_size(),
            prefix_cache_hit_tokens: c.sched.counters.prefix_hit_tokens,
            prompt_tokens: c.prompt_tokens,
            generated_tokens: c.generated_tokens,
            computed_tokens: c.computed_tokens,
            steps: c.steps,
            last_step_ms: if step_ms > 0.0 { step_ms } else { prev.last_step_ms },
            total_step_ms: c.total_step_ms,
            finished: c.finished,
            cancelled: c.cancelled,
        };
        Ok(())
    }

    /// One continuous-batching iteration. Returns `Error::Busy` if another thread is
    /// stepping. Per-request failures are events (`finish == Error`), not errors.
    pub fn step(&self) -> Result<StepOutput> {
        let mut guard = match self.core.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return Err(Error::Busy),
            Err(TryLockError::Poisoned(_)) => return Err(Error::Poisoned),
        };
        let c = guard.as_mut().ok_or(Error::NoModel)?;
        let t0 = Instant::now();
        let mut out = StepOutput::default();
        self.take_shared_input(c, &mut out.events)?;

        let limits = SchedLimits { max_seqs: self.config.max_seqs, max_batched_tokens: self.config.max_batched_tokens };
        let work = c.sched.schedule(limits, &mut c.blocks);
        if !work.is_empty() {
            self.run_batch(c, &work, &mut out)?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if !work.is_empty() {
            c.steps += 1;
            c.total_step_ms += ms;
        }
        self.publish(c, &out.events, if work.is_empty() { 0.0 } else { ms })?;
        // Cancellations applied between steps happened before this step's events.
        let pending = std::mem::take(&mut self.shared()?.pending_events);
        out.events.splice(0..0, pending);
        Ok(out)
    }

    fn run_batch(&self, c: &mut Core, work: &[crate::sched::Scheduled], out: &mut StepOutput) -> Result<()> {
        let bs = c.blocks.block_size();
        let n_tokens: usize = work.iter().map(|w| w.n).sum();
        let mut tokens = Vec::with_capacity(n_tokens);
        let mut positions = Vec::with_capacity(n_tokens);
        let mut slots = Vec::with_capacity(n_tokens);
        let mut rows = Vec::new();
        let mut sampled = Vec::new(); // indices into `work` that produce a token
        for (wi, w) in work.iter().enumerate() {
            let s = &c.sched.running[w.index];
            for p in s.computed..s.computed + w.n {
                tokens.push(s.tokens[p]);
                positions.push(p as u32);
                slots.push(s.block_table[p / bs] * bs as u32 + (p % bs) as u32);
            }
            if s.computed + w.n == s.tokens.len() {
                rows.push(tokens.len() as u32 - 1);
                sampled.push(wi);
            }
            if s.computed < s.prompt_len {
                c.prompt_tokens += (s.prompt_len.min(s.computed + w.n) - s.computed) as u64;
            }
        }
        let mut start = 0;
        let seqs: Vec<SeqSpan<'_>> = work
            .iter()
            .map(|w| {
                let s = &c.sched.running[w.index];
                let span =
                    SeqSpan { q_start: start, q_len: w.n, ctx_len: s.computed + w.n, block_table: &s.block_table };
                start += w.n;
                span
            })
            .collect();
        let mut logits = std::mem::take(&mut c.logits);
        let fwd = c.runner.forward(
            &StepBatch { tokens: &tokens, positions: &positions, slots: &slots, seqs: &seqs, logit_rows: &rows },
            &mut logits,
        );
        drop(seqs);
        if let Err(e) = fwd {
            // The batch failed as a whole (a backend error): fail its requests, keep the engine.
            log::error!("step failed: {e}");
            let mut failed: Vec<RequestId> = work.iter().map(|w| c.sched.running[w.index].id).collect();
            failed.sort_unstable();
            for id in failed {
                c.sched.remove(id, &mut c.blocks);
                c.finished += 1;
                out.events.push(Event {
                    id,
                    tag: c.tags.remove(&id).unwrap_or(0),
                    token: None,
                    logprob: None,
                    top_logprobs: Vec::new(),
                    finish: Some(FinishReason::Error),
                    error: Some(e.to_string()),
                });
            }
            c.logits = logits;
            return Ok(());
        }
        c.computed_tokens += n_tokens as u64;
        out.batched_tokens = n_tokens;
        c.sched.commit(work, &mut c.blocks);

        let vocab = c.runner.cfg.vocab_size;
        let mut done = Vec::new();
        for (row, &wi) in sampled.iter().enumerate() {
            let idx = work[wi].index;
            let s = &mut c.sched.running[idx];
            let lg = &logits[row * vocab..(row + 1) * vocab];
            let tag = c.tags.get(&s.id).copied().unwrap_or(0);
            let (prompt, generated) = s.tokens.split_at(s.prompt_len);
            let ev = match s.sampler.sample(lg, prompt, generated) {
                Ok(x) => {
                    s.tokens.push(x.token);
                    c.generated_tokens += 1;
                    let finish = s.stop.check(s.generated());
                    Event {
                        id: s.id,
                        tag,
                        token: Some(x.token),
                        logprob: x.logprob,
                        top_logprobs: x.top,
                        finish,
                        error: None,
                    }
                }
                Err(e) => Event {
                    id: s.id,
                    tag,
                    token: None,
                    logprob: None,
                    top_logprobs: Vec::new(),
                    finish: Some(FinishReason::Error),
                    error: Some(e.to_string()),
                },
            };
            if ev.finish.is_some() {
                done.push(s.id);
            }
            out.events.push(ev);
        }
        for id in done {
            c.sched.remove(id, &mut c.blocks);
            c.tags.remove(&id);
            c.finished += 1;
        }
        c.logits = logits;
        Ok(())
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
