//! Speculative decoding with a draft model (`spec_draft_model`): a second, smaller model that
//! shares the target's vocabulary proposes each decode's next tokens, greedily; the target
//! verifies them in one chunk as it does prompt-lookup drafts (`core.rs`), so greedy output is
//! the target's own and sampled output follows the standard rejection rule.
//!
//! The draft keeps its own KV cache per request (its own pool, no prefix caching): each round
//! it first catches up on the tokens the target accepted since the last one (a whole prompt
//! the first time, in chunks of the step budget), then decodes one token at a time. After the
//! verification the cache keeps only what the target kept. A request that stops running
//! (finished, cancelled, preempted) gives its draft blocks back at the next round.

use std::collections::{HashMap, HashSet};

use crate::kv::{KvManager, SeqWork, StepLayout};
use crate::runner::{ModelRunner, StepBatch};
use crate::sched::RequestId;
use crate::session::argmax;
use crate::Result;

pub(super) struct Drafter {
    runner: ModelRunner,
    kv: KvManager,
    /// Tokens per round of drafting (`spec_draft_tokens`).
    pub tokens: usize,
    /// Most tokens of one forward pass (the target's step budget).
    budget: usize,
    /// How many leading tokens of each request the draft's cache holds.
    computed: HashMap<RequestId, usize>,
    work: Vec<SeqWork>,
    layout: StepLayout,
    batch: Vec<u32>,
    rows: Vec<u32>,
    logits: Vec<f32>,
}

/// One request to draft for: its id, its tokens so far, and how many tokens to propose.
pub(super) struct Ask<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
    pub k: usize,
}

impl Drafter {
    pub fn new(runner: ModelRunner, kv: KvManager, tokens: usize, budget: usize) -> Drafter {
        Drafter {
            runner,
            kv,
            tokens,
            budget: budget.max(1),
            computed: HashMap::new(),
            work: Vec::new(),
            layout: StepLayout::default(),
            batch: Vec::new(),
            rows: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// Forgets every request not in `running`; their blocks go back to the draft's pool.
    pub fn retain(&mut self, running: &HashSet<RequestId>) {
        let gone: Vec<RequestId> = self.computed.keys().filter(|id| !running.contains(id)).copied().collect();
        for id in gone {
            self.computed.remove(&id);
            self.kv.release(id);
        }
    }

    /// After a verification: the draft's cache of `id` is right for its first `valid` tokens
    /// only (the target's tokens; a rejected draft differs from there on).
    pub fn keep(&mut self, id: RequestId, valid: usize) {
        if let Some(c) = self.computed.get_mut(&id) {
            *c = (*c).min(valid);
            self.kv.shrink(id, *c);
        }
    }

    /// Blocks of the draft's pool in use (tests: none once every request has ended).
    pub fn blocks_used(&self) -> usize {
        self.kv.used()
    }

    /// Greedy drafts of up to `ask.k` tokens for each request, in order; an empty draft for a
    /// request the draft's pool has no room for.
    pub fn draft(&mut self, asks: &[Ask<'_>]) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); asks.len()];
        // Room for the catch-up and every draft but the last (which is never fed back).
        let mut active = Vec::new();
        for (i, a) in asks.iter().enumerate() {
            if a.k == 0 || a.tokens.is_empty() {
                continue;
            }
            // The last token is always fed: its logits give the first draft.
            let c = self.computed.get(&a.id).copied().unwrap_or(0).min(a.tokens.len() - 1);
            self.kv.shrink(a.id, c);
            if !self.kv.grow(a.id, a.tokens.len() + a.k - 1) {
                self.computed.insert(a.id, c);
                continue;
            }
            self.computed.insert(a.id, c);
            active.push(i);
        }
        // Catch up, in forward passes of at most `budget` tokens: a request whose last token
        // is in a pass gets its row, which gives its first draft.
        loop {
            self.begin();
            for &i in &active {
                let a = &asks[i];
                let c = self.computed[&a.id];
                let left = self.budget - self.batch.len();
                if c >= a.tokens.len() || left == 0 {
                    continue;
                }
                let n = (a.tokens.len() - c).min(left);
                self.work.push(SeqWork { seq: a.id, start: c, n });
                self.batch.extend_from_slice(&a.tokens[c..c + n]);
                if c + n == a.tokens.len() {
                    self.rows.push(self.batch.len() as u32 - 1);
                }
            }
            if self.work.is_empty() {
                break;
            }
            self.forward()?;
            let mut row = 0;
            for wi in 0..self.work.len() {
                let SeqWork { seq, start, n } = self.work[wi];
                self.computed.insert(seq, start + n);
                let ended = active.iter().copied().find(|&i| asks[i].id == seq && start + n == asks[i].tokens.len());
                if let Some(i) = ended {
                    out[i].push(self.argmax_of(row));
                    row += 1;
                }
            }
        }
        // Then one token a pass: each request feeds its newest draft until it has `k`.
        for j in 1..asks.iter().map(|a| a.k).max().unwrap_or(0) {
            self.begin();
            let step: Vec<usize> = active.iter().copied().filter(|&i| asks[i].k > j && out[i].len() == j).collect();
            if step.is_empty() {
                break;
            }
            for &i in &step {
                let a = &asks[i];
                self.work.push(SeqWork { seq: a.id, start: a.tokens.len() + j - 1, n: 1 });
                self.batch.push(out[i][j - 1]);
                self.rows.push(self.batch.len() as u32 - 1);
            }
            self.forward()?;
            for (row, &i) in step.iter().enumerate() {
                *self.computed.get_mut(&asks[i].id).expect("drafted requests are tracked") += 1;
                out[i].push(self.argmax_of(row));
            }
        }
        Ok(out)
    }

    fn begin(&mut self) {
        self.work.clear();
        self.batch.clear();
        self.rows.clear();
    }

    fn forward(&mut self) -> Result<()> {
        self.kv.layout(&self.work, &mut self.layout);
        let b = StepBatch { tokens: &self.batch, layout: &self.layout, logit_rows: &self.rows, argmax_only: true };
        self.runner.forward(&b, &mut self.logits)
    }

    fn argmax_of(&self, row: usize) -> u32 {
        let v = self.runner.cfg.vocab_size;
        argmax(&self.logits[row * v..(row + 1) * v])
    }
}
