//! Requests and the continuous-batching scheduler.
//!
//! THE INVARIANT: a sequence's tokens are its prompt followed by what it generated;
//! `computed` counts the leading tokens whose K/V are in the cache. Every step moves
//! `computed` toward `tokens.len()`, and a sequence samples its next token exactly when a
//! step makes them equal. Everything else follows from this one rule:
//! - a decode is a sequence one token behind (the token it sampled last step);
//! - chunked prefill is a sequence many tokens behind, catching up a budget at a time;
//! - a prefix-cache hit starts `computed` at the cached length;
//! - preemption frees the blocks and resets `computed` to 0 — the generated tokens stay in
//!   `tokens`, so recomputation is just a longer prefill and the output continues unchanged;
//! - speculative decoding appends `drafts` guessed tokens for one step: the chunk from the
//!   last real token through the drafts is computed, every row is sampled, the drafts that
//!   match are kept and `computed` steps back to just past them (the rest is cut off and
//!   its blocks freed), so after the step the sequence is one token behind again.
//!
//! Policy per step (`Scheduler::schedule`): first every running decode (one token each),
//! then running prefills, then waiting requests, highest priority first and first-come
//! first-served within a priority, until the token budget or `max_seqs` is reached. Blocks
//! are allocated on demand, so a sequence holds at most one partially filled block. When a
//! running sequence needs a block and none is left, the lowest-priority, most recently
//! admitted running sequence not yet scheduled this step is preempted (possibly the one
//! asking). The oldest highest-priority sequence therefore always progresses, and any
//! request that fits the cache on its own completes.

mod request;

pub use request::{Request, RequestId};

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use crate::kv::{KvManager, SeqWork};
use crate::sample::constrain::Constraint;
use crate::sample::{Sampler, StopCriteria};

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
pub struct SchedLimits {
    pub max_seqs: usize,
    pub max_batched_tokens: usize,
}

/// A request as the scheduler tracks it. Where its K/V live is the KV manager's business
/// (keyed by `id`).
pub struct Seq {
    pub id: RequestId,
    pub priority: i32,
    /// Enqueue order (FCFS tie-break; kept across preemption).
    pub arrival: u64,
    /// Order of the latest admission (preemption picks the most recent).
    pub admitted: u64,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub computed: usize,
    pub sampler: Sampler,
    pub stop: StopCriteria,
    pub preemptions: u32,
    /// Prefix-cache hits are counted at the first admission only.
    pub ever_admitted: bool,
    /// Prompt tokens computed so far that count as prompt work (not recomputation after a
    /// preemption), for the engine's `prompt_tokens` stat.
    pub prompt_counted: usize,
    /// When requested: log-probability of prompt token i given tokens < i, for the i
    /// computed so far (entry 0, which has no context, is NaN).
    pub prompt_logprobs: Option<Vec<f32>>,
    pub enqueued: Instant,
    /// First admission.
    pub started: Option<Instant>,
    pub first_token: Option<Instant>,
    /// Prompt tokens the prefix cache supplied at the first admission.
    pub cached_prompt: usize,
    /// Speculative tokens at the end of `tokens`, proposed this step and not yet verified
    /// (0 outside a step). They are never cached, counted or kept across a preemption.
    pub drafts: usize,
    /// Draft length for the next speculative step, adapted to how many were kept (0: not yet
    /// speculated; starts at the engine's maximum).
    pub draft_len: usize,
    /// Structured output's state (`Request::grammar`): every generated token is consumed.
    pub constraint: Option<Constraint>,
}

impl Seq {
    /// A waiting sequence for a validated request.
    pub fn new(
        id: RequestId,
        arrival: u64,
        prompt: Vec<u32>,
        priority: i32,
        sampler: Sampler,
        stop: StopCriteria,
    ) -> Seq {
        Seq {
            id,
            priority,
            arrival,
            admitted: 0,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            sampler,
            stop,
            preemptions: 0,
            ever_admitted: false,
            prompt_counted: 0,
            prompt_logprobs: None,
            enqueued: Instant::now(),
            started: None,
            first_token: None,
            cached_prompt: 0,
            drafts: 0,
            draft_len: 0,
            constraint: None,
        }
    }

    /// Asks for prompt logprobs (see `Request::prompt_logprobs`).
    pub fn with_prompt_logprobs(mut self) -> Seq {
        self.prompt_logprobs = Some(vec![f32::NAN]);
        self
    }

    /// The request's timings, as of now (the finish event carries them).
    pub fn timings(&self) -> Timings {
        let ms = |t: Instant| t.duration_since(self.enqueued).as_secs_f64() * 1e3;
        let now = Instant::now();
        Timings {
            queued_ms: ms(self.started.unwrap_or(now)),
            first_token_ms: self.first_token.map(ms),
            total_ms: ms(now),
            prompt_tokens: self.prompt_len,
            cached_prompt_tokens: self.cached_prompt,
            preemptions: self.preemptions,
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// Where a request's time went, in milliseconds since it was enqueued.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Timings {
    /// Until its first admission (all of its life if it never started).
    pub queued_ms: f64,
    /// Until its first generated token; None if it produced none.
    pub first_token_ms: Option<f64>,
    /// Until it finished.
    pub total_ms: f64,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub preemptions: u32,
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// Index into `Scheduler::running`.
    pub index: usize,
    /// Tokens computed this step, starting at the sequence's `computed`.
    pub n: usize,
}

/// Counters the scheduler keeps for stats.
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedCounters {
    pub preemptions: u64,
    pub prefix_hit_tokens: u64,
}

#[derive(Default)]
pub struct Scheduler {
    /// Sorted by (priority desc, admitted asc).
    pub running: Vec<Seq>,
    /// Keyed (and so ordered) by (priority desc, arrival asc): admission takes the first, a
    /// preempted sequence goes back in its place, both in O(log n) however long the queue.
    pub waiting: BTreeMap<(i64, u64), Seq>,
    pub counters: SchedCounters,
    clock: u64,
}

impl Scheduler {
    pub fn new() -> Scheduler {
        Scheduler::default()
    }

    /// Adds a new request to the waiting queue.
    pub fn add(&mut self, seq: Seq) {
        self.insert_waiting(seq);
    }

    fn insert_waiting(&mut self, seq: Seq) {
        self.waiting.insert((-(seq.priority as i64), seq.arrival), seq);
    }

    /// Frees a sequence's blocks and sends it back to wait, keeping its tokens.
    fn preempt(&mut self, index: usize, kv: &mut KvManager) {
        let mut s = self.running.remove(index);
        kv.release(s.id);
        s.tokens.truncate(s.tokens.len() - s.drafts);
        s.drafts = 0;
        s.computed = 0;
        s.preemptions += 1;
        self.counters.preemptions += 1;
        log::debug!("preempted request {} ({} tokens to recompute)", s.id, s.tokens.len());
        self.insert_waiting(s);
    }

    /// Removes a sequence wherever it is, releasing its blocks.
    pub fn remove(&mut self, id: RequestId, kv: &mut KvManager) -> Option<Seq> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            kv.release(id);
            return Some(s);
        }
        let key = *self.waiting.iter().find(|(_, s)| s.id == id)?.0;
        self.waiting.remove(&key)
    }

    /// Grows `running[i]`'s block table to hold `positions` positions, preempting from the
    /// tail of the running set (lowest priority, most recently admitted) as needed; a
    /// preempted sequence that was already scheduled this step gives back its share. Returns
    /// false if `running[i]` itself was the tail and had to go.
    fn reserve(
        &mut self,
        i: usize,
        positions: usize,
        out: &mut Vec<Scheduled>,
        budget: &mut usize,
        kv: &mut KvManager,
    ) -> bool {
        loop {
            if kv.grow(self.running[i].id, positions) {
                return true;
            }
            let victim = self.running.len() - 1;
            if let Some(k) = out.iter().position(|s| s.index == victim) {
                *budget += out.swap_remove(k).n;
            }
            self.preempt(victim, kv);
            if victim == i {
                return false;
            }
        }
    }

    /// Chooses this step's work. Sequences in the result are in `running`, by index.
    pub fn schedule(&mut self, limits: SchedLimits, kv: &mut KvManager) -> Vec<Scheduled> {
        let bs = kv.block_size();
        let mut budget = limits.max_batched_tokens;
        let mut out: Vec<Scheduled> = Vec::new();
        // Passes 1 and 2 over the running set: decodes, then unfinished prefills.
        for decodes in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let behind = self.running[i].tokens.len() - self.running[i].computed;
                if (behind == 1) != decodes || out.iter().any(|s| s.index == i) {
                    i += 1;
                    continue;
                }
                let n = behind.min(budget);
                let positions = self.running[i].computed + n;
                if self.reserve(i, positions, &mut out, &mut budget, kv) {
                    out.push(Scheduled { index: i, n });
                    budget -= n;
                }
                i += 1;
            }
        }
        // Pass 3: admit waiting sequences while blocks, budget and max_seqs allow, without
        // preempting anyone.
        while budget > 0 && self.running.len() < limits.max_seqs {
            let Some((&key, s)) = self.waiting.iter().next() else { break };
            // Prefix cache: reuse full blocks of the longest cached prefix, but always leave
            // the last token to compute (its logits are needed).
            // A request that wants prompt logprobs needs the logits of every prompt row.
            let max_blocks = if s.prompt_logprobs.is_some() { 0 } else { (s.tokens.len() - 1) / bs };
            let hit = kv.lookup_prefix(&s.tokens, max_blocks);
            let cached = hit.tokens(bs);
            let n = (s.tokens.len() - cached).min(budget);
            if !kv.admit(s.id, hit, cached + n) {
                break; // try again next step
            }
            let Some(mut s) = self.waiting.remove(&key) else { break };
            if !s.ever_admitted {
                self.counters.prefix_hit_tokens += cached as u64;
                // Cached prompt tokens count as prompt work done once.
                s.prompt_counted = cached.min(s.prompt_len);
                s.cached_prompt = cached.min(s.prompt_len);
                s.started = Some(Instant::now());
            }
            s.computed = cached;
            s.ever_admitted = true;
            self.clock += 1;
            s.admitted = self.clock;
            // Running order is (priority desc, admission asc): a new admission goes after
            // every running sequence of its priority or higher.
            let at = self.running.partition_point(|r| r.priority >= s.priority);
            for sc in out.iter_mut().filter(|sc| sc.index >= at) {
                sc.index += 1;
            }
            self.running.insert(at, s);
            out.push(Scheduled { index: at, n });
            budget -= n;
        }
        out
    }

    /// The KV manager's view of this step's work, in the same order.
    pub fn work(&self, work: &[Scheduled], out: &mut Vec<SeqWork>) {
        out.clear();
        out.extend(work.iter().map(|w| {
            let s = &self.running[w.index];
            SeqWork { seq: s.id, start: s.computed, n: w.n }
        }));
    }

    /// After the forward pass: advances `computed` and registers newly full blocks in the
    /// prefix cache. Returns the prompt tokens computed for the first time.
    pub fn commit(&mut self, work: &[Scheduled], kv: &mut KvManager) -> u64 {
        let mut prompt = 0;
        for w in work {
            let s = &mut self.running[w.index];
            s.computed += w.n;
            let first_time = s.computed.min(s.prompt_len).saturating_sub(s.prompt_counted);
            s.prompt_counted += first_time;
            prompt += first_time as u64;
            // Draft positions are not known to be right yet: their blocks are registered once
            // the verification has kept them.
            kv.commit(s.id, &s.tokens, s.computed.min(s.tokens.len() - s.drafts));
        }
        prompt
    }
}
