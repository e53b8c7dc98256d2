//! What a step works on, owned by the stepping thread: the runner (plan, weights, device
//! buffers), the KV manager, the scheduler and the counters.

use std::collections::HashMap;

use super::{Event, StepOutput};
use crate::kv::{KvManager, SeqWork, StepLayout};
use crate::runner::{ModelRunner, StepBatch};
use crate::sample::{token_logprob, FinishReason};
use crate::sched::{RequestId, SchedLimits, Scheduled, Scheduler, Seq};
use crate::Result;

pub(super) struct Core {
    pub runner: ModelRunner,
    pub kv: KvManager,
    pub sched: Scheduler,
    pub tags: HashMap<RequestId, u64>,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub computed_tokens: u64,
    pub steps: u64,
    pub total_step_ms: f64,
    pub finished: u64,
    pub cancelled: u64,
    // Reused per-step buffers.
    logits: Vec<f32>,
    work: Vec<SeqWork>,
    layout: StepLayout,
    tokens: Vec<u32>,
    rows: Vec<u32>,
    /// Prompt-logprob rows of this step: (index into the work, prompt position scored, row).
    plp_rows: Vec<(usize, usize, usize)>,
}

/// The last event of a request that ends without a new token.
fn finish_event(s: &Seq, tag: u64, finish: FinishReason, error: Option<String>) -> Event {
    Event {
        id: s.id,
        tag,
        token: None,
        logprob: None,
        top_logprobs: Vec::new(),
        finish: Some(finish),
        error,
        prompt_logprobs: Vec::new(),
        timings: Some(s.timings()),
    }
}

impl Core {
    pub fn new(runner: ModelRunner, kv: KvManager) -> Core {
        Core {
            runner,
            kv,
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
            work: Vec::new(),
            layout: StepLayout::default(),
            tokens: Vec::new(),
            rows: Vec::new(),
            plp_rows: Vec::new(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.sched.running.is_empty() && self.sched.waiting.is_empty()
    }

    /// Takes new requests into the scheduler.
    pub fn admit(&mut self, incoming: Vec<(Seq, u64)>) {
        for (s, tag) in incoming {
            self.tags.insert(s.id, tag);
            self.sched.add(s);
        }
    }

    /// Ends requests cancelled since the last step; their blocks go back at once.
    pub fn cancel(&mut self, ids: &[RequestId], events: &mut Vec<Event>) {
        for &id in ids {
            if let Some(s) = self.sched.remove(id, &mut self.kv) {
                events.push(finish_event(&s, self.tags.remove(&id).unwrap_or(0), FinishReason::Cancelled, None));
            }
        }
    }

    /// Schedules and runs one batch. Per-request failures become events.
    pub fn run(&mut self, limits: SchedLimits, out: &mut StepOutput) -> Result<bool> {
        let work = self.sched.schedule(limits, &mut self.kv);
        if work.is_empty() {
            return Ok(false);
        }
        self.run_batch(&work, out);
        Ok(true)
    }

    fn run_batch(&mut self, work: &[Scheduled], out: &mut StepOutput) {
        self.sched.work(work, &mut self.work);
        self.kv.layout(&self.work, &mut self.layout);
        self.tokens.clear();
        self.rows.clear();
        self.plp_rows.clear();
        let mut sampled = Vec::new(); // (index into `work`, logits row) of those that produce a token
        for (wi, w) in work.iter().enumerate() {
            let s = &self.sched.running[w.index];
            let base = self.tokens.len();
            self.tokens.extend_from_slice(&s.tokens[s.computed..s.computed + w.n]);
            if let Some(plp) = &s.prompt_logprobs {
                // Row p predicts token p + 1: the prompt tokens not scored yet (a preempted
                // request recomputes rows it has already scored).
                for p in s.computed..s.computed + w.n {
                    if p + 1 < s.prompt_len && p + 1 >= plp.len() {
                        self.plp_rows.push((wi, p + 1, self.rows.len()));
                        self.rows.push((base + p - s.computed) as u32);
                    }
                }
            }
            if s.computed + w.n == s.tokens.len() {
                sampled.push((wi, self.rows.len()));
                self.rows.push(self.tokens.len() as u32 - 1);
            }
        }
        let batch = StepBatch { tokens: &self.tokens, layout: &self.layout, logit_rows: &self.rows };
        if let Err(e) = self.runner.forward(&batch, &mut self.logits) {
            // The batch failed as a whole (a backend error): fail its requests, keep the engine.
            log::error!("step failed: {e}");
            let mut failed: Vec<RequestId> = work.iter().map(|w| self.sched.running[w.index].id).collect();
            failed.sort_unstable();
            for id in failed {
                let tag = self.tags.remove(&id).unwrap_or(0);
                if let Some(s) = self.sched.remove(id, &mut self.kv) {
                    out.events.push(finish_event(&s, tag, FinishReason::Error, Some(e.to_string())));
                }
            }
            return;
        }
        let n_tokens = self.tokens.len();
        self.computed_tokens += n_tokens as u64;
        out.batched_tokens = n_tokens;
        self.prompt_tokens += self.sched.commit(work, &mut self.kv);

        let vocab = self.runner.cfg.vocab_size;
        for &(wi, pos, row) in &self.plp_rows {
            let s = &mut self.sched.running[work[wi].index];
            let lg = &self.logits[row * vocab..(row + 1) * vocab];
            let token = s.tokens[pos];
            if let Some(plp) = s.prompt_logprobs.as_mut().filter(|p| p.len() == pos) {
                plp.push(token_logprob(lg, token));
            }
        }
        let mut done = Vec::new();
        for &(wi, row) in &sampled {
            let s = &mut self.sched.running[work[wi].index];
            let lg = &self.logits[row * vocab..(row + 1) * vocab];
            let tag = self.tags.get(&s.id).copied().unwrap_or(0);
            let (prompt, generated) = s.tokens.split_at(s.prompt_len);
            let ev = match s.sampler.sample(lg, prompt, generated) {
                Ok(x) => {
                    s.tokens.push(x.token);
                    s.first_token.get_or_insert_with(std::time::Instant::now);
                    self.generated_tokens += 1;
                    let finish = s.stop.check(s.generated());
                    let first = s.tokens.len() == s.prompt_len + 1;
                    Event {
                        id: s.id,
                        tag,
                        token: Some(x.token),
                        logprob: x.logprob,
                        top_logprobs: x.top,
                        finish,
                        error: None,
                        prompt_logprobs: s.prompt_logprobs.as_ref().filter(|_| first).cloned().unwrap_or_default(),
                        timings: finish.map(|_| s.timings()),
                    }
                }
                Err(e) => finish_event(s, tag, FinishReason::Error, Some(e.to_string())),
            };
            if ev.finish.is_some() {
                done.push(s.id);
            }
            out.events.push(ev);
        }
        for id in done {
            self.sched.remove(id, &mut self.kv);
            self.tags.remove(&id);
        }
    }
}
