//! What a step works on, owned by the stepping thread: the runner (plan, weights, device
//! buffers), the KV manager, the scheduler and the counters.

use std::collections::HashMap;

use super::draft::{Ask, Drafter};
use super::{Event, StepOutput};
use crate::kv::{KvManager, SeqWork, StepLayout};
use crate::runner::{ModelRunner, StepBatch};
use crate::sample::constrain::{apply_mask, Constraint};
use crate::sample::{token_logprob, FinishReason};
use crate::sched::{RequestId, SchedLimits, Scheduled, Scheduler, Seq};
use crate::Error;
use crate::Result;
use llguidance::toktrie::SimpleVob;
use std::time::Instant;

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
    /// Prompt-lookup draft length (`spec_ngram`; 0 = off) and its counters.
    pub spec_ngram: usize,
    /// The draft model (`spec_draft_model`), instead of prompt lookup.
    pub drafter: Option<Drafter>,
    pub spec_drafted: u64,
    pub spec_accepted: u64,
    /// Structured output: grammar masks computed and the host time they took.
    pub masks: u64,
    pub mask_ms: f64,
    // Reused per-step buffers.
    logits: Vec<f32>,
    work: Vec<SeqWork>,
    layout: StepLayout,
    tokens: Vec<u32>,
    rows: Vec<u32>,
    /// Prompt-logprob rows of this step: (index into the work, prompt position scored, row).
    plp_rows: Vec<(usize, usize, usize)>,
    draft: Vec<u32>,
    masked: Vec<f32>,
}

/// Prompt lookup: into `out`, up to `k` tokens that followed the latest earlier occurrence of
/// the last n tokens of `tokens` (n = 3, else 2, else 1); empty when none occurs.
pub(crate) fn ngram_draft(tokens: &[u32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = tokens.len();
    for n in (2..=4.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        if let Some(i) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == tail) {
            out.extend_from_slice(&tokens[i + n..(i + n + k).min(len)]);
            return;
        }
    }
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
            spec_ngram: 0,
            drafter: None,
            spec_drafted: 0,
            spec_accepted: 0,
            masks: 0,
            mask_ms: 0.0,
            logits: Vec::new(),
            work: Vec::new(),
            layout: StepLayout::default(),
            tokens: Vec::new(),
            rows: Vec::new(),
            plp_rows: Vec::new(),
            draft: Vec::new(),
            masked: Vec::new(),
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
        self.forget_drafts();
    }

    /// The longest draft a request proposes: the draft model's, or prompt lookup's.
    fn spec_max(&self) -> usize {
        self.drafter.as_ref().map_or(self.spec_ngram, |d| d.tokens)
    }

    /// Schedules and runs one batch. Per-request failures become events.
    pub fn run(&mut self, limits: SchedLimits, out: &mut StepOutput) -> Result<bool> {
        self.propose_drafts();
        let work = self.sched.schedule(limits, &mut self.kv);
        // A sequence the budget left out this step takes its drafts off again.
        for (i, s) in self.sched.running.iter_mut().enumerate() {
            if s.drafts > 0 && !work.iter().any(|w| w.index == i) {
                s.tokens.truncate(s.tokens.len() - s.drafts);
                s.drafts = 0;
            }
        }
        if work.is_empty() {
            return Ok(false);
        }
        self.run_batch(&work, out);
        self.forget_drafts();
        Ok(true)
    }

    /// The draft model's cache of requests that stopped running goes back to its pool.
    fn forget_drafts(&mut self) {
        if let Some(d) = self.drafter.as_mut() {
            d.retain(&self.sched.running.iter().map(|s| s.id).collect());
        }
    }

    /// Drafts for every decode: the tokens that followed the latest earlier occurrence of its
    /// last tokens (prompt lookup), or the draft model's greedy tokens (`draft.rs`). Drafts
    /// only take blocks no plain decode of this step needs, so speculation never preempts
    /// anyone.
    ///
    /// Sampled requests speculate too. A draft is one fixed token, so the standard rejection
    /// rule (keep it with probability p(d), else draw from p without d) gives the same joint
    /// law as drawing x from p and keeping the draft iff x = d, which is what the
    /// verification does: every row draws the token it emits, one draw per token as without
    /// speculation, so a request's tokens are the same as without it for the same seed.
    fn propose_drafts(&mut self) {
        let max = self.spec_max();
        if max == 0 {
            return;
        }
        // Each decode's draft length: what its verification can still emit (drafts + 1 tokens).
        let mut ks = Vec::with_capacity(self.sched.running.len());
        for s in self.sched.running.iter_mut() {
            let left = s.stop.max_tokens.saturating_sub(s.generated().len());
            if s.draft_len == 0 {
                s.draft_len = max;
            }
            let decoding = s.tokens.len() == s.computed + 1 && s.drafts == 0;
            ks.push(if decoding { s.draft_len.min(left.saturating_sub(1)) } else { 0 });
        }
        // With a draft model, every decode's draft comes from one batched round of it.
        let mut from_model = match self.drafter.as_mut() {
            Some(d) => {
                let asks: Vec<Ask<'_>> =
                    self.sched.running.iter().zip(&ks).map(|(s, &k)| Ask { id: s.id, tokens: &s.tokens, k }).collect();
                match d.draft(&asks) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        // The target decodes on without drafts; its requests are not at fault.
                        log::warn!("draft model: {e}; this step decodes without drafts");
                        return;
                    }
                }
            }
            None => None,
        };
        let decode_need: usize = self.sched.running.iter().map(|s| self.kv.blocks_needed(s.id, s.tokens.len())).sum();
        let mut free = self.kv.available().saturating_sub(decode_need);
        for (i, s) in self.sched.running.iter_mut().enumerate() {
            let k = ks[i];
            if k == 0 {
                continue;
            }
            match from_model.as_mut() {
                Some(v) => std::mem::swap(&mut self.draft, &mut v[i]),
                None => ngram_draft(&s.tokens, k, &mut self.draft),
            }
            let plain = self.kv.blocks_needed(s.id, s.tokens.len());
            let need = self.kv.blocks_needed(s.id, s.tokens.len() + self.draft.len()) - plain;
            if self.draft.is_empty() || need > free {
                continue;
            }
            free -= need;
            s.drafts = self.draft.len();
            s.tokens.extend_from_slice(&self.draft);
        }
    }

    fn run_batch(&mut self, work: &[Scheduled], out: &mut StepOutput) {
        self.sched.work(work, &mut self.work);
        self.kv.layout(&self.work, &mut self.layout);
        self.tokens.clear();
        self.rows.clear();
        self.plp_rows.clear();
        // (index into `work`, first logits row, rows) of those that produce tokens: one row,
        // or every row of a speculative chunk.
        let mut sampled = Vec::new();
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
            if s.drafts > 0 {
                // Verification: each row of the chunk predicts the token after it.
                sampled.push((wi, self.rows.len(), w.n));
                self.rows.extend((base..base + w.n).map(|r| r as u32));
            } else if s.computed + w.n == s.tokens.len() {
                sampled.push((wi, self.rows.len(), 1));
                self.rows.push(self.tokens.len() as u32 - 1);
            }
        }
        // Rows read only for their argmax let a tensor-parallel leader gather each rank's best
        // candidate instead of every logit.
        let argmax_only = self.plp_rows.is_empty()
            && sampled.iter().all(|&(wi, _, _)| {
                let s = &self.sched.running[work[wi].index];
                s.constraint.is_none() && s.sampler.params().argmax_only()
            });
        let batch = StepBatch { tokens: &self.tokens, layout: &self.layout, logit_rows: &self.rows, argmax_only };
        // Structured output: the mask of each constrained sequence's next token depends only on
        // the tokens it has consumed, so a helper thread computes it while the backend runs
        // the batch.
        let mut first_masks: HashMap<usize, Result<SimpleVob>> = HashMap::new();
        let constrained: Vec<(usize, &mut Constraint)> = if self.sched.running.iter().any(|s| s.constraint.is_some()) {
            let idx: Vec<usize> = sampled.iter().map(|&(wi, _, _)| work[wi].index).collect();
            self.sched
                .running
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| idx.contains(i))
                .filter_map(|(i, s)| s.constraint.as_mut().map(|c| (i, c)))
                .collect()
        } else {
            Vec::new()
        };
        let (runner, logits) = (&mut self.runner, &mut self.logits);
        let fwd = if constrained.is_empty() {
            runner.forward(&batch, logits)
        } else {
            let t = Instant::now();
            let (fwd, masks) = std::thread::scope(|sc| {
                let h = sc.spawn(move || {
                    constrained.into_iter().map(|(i, c)| (i, c.mask(), t.elapsed())).collect::<Vec<_>>()
                });
                (runner.forward(&batch, logits), h.join())
            });
            match masks {
                Ok(masks) => {
                    for (i, m, at) in masks {
                        self.mask_ms += at.as_secs_f64() * 1e3;
                        self.masks += 1;
                        first_masks.insert(i, m);
                    }
                }
                Err(_) => log::error!("the grammar mask thread panicked; its requests fail"),
            }
            fwd
        };
        if let Err(e) = fwd {
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
        let spec_max = self.spec_max();
        for &(wi, row0, rows) in &sampled {
            let s = &mut self.sched.running[work[wi].index];
            let tag = self.tags.get(&s.id).copied().unwrap_or(0);
            let drafts = s.tokens.split_off(s.tokens.len() - s.drafts);
            let speculated = s.drafts > 0;
            s.drafts = 0;
            // Each row samples the next token; while it equals the next draft, that draft
            // (whose K/V this chunk computed) is kept and the next row counts.
            let mut kept = 0;
            for i in 0..rows {
                let mut lg = &self.logits[(row0 + i) * vocab..(row0 + i + 1) * vocab];
                // A constrained sequence samples from its row with the disallowed tokens at
                // -inf: the first mask came from the helper thread, a speculative chunk's
                // later ones are computed here, after the kept drafts were consumed.
                let masked = match s.constraint.as_mut() {
                    None => Ok(()),
                    Some(c) => {
                        let m = match first_masks.remove(&work[wi].index).filter(|_| i == 0) {
                            Some(m) => m,
                            None if i == 0 => Err(Error::invalid("grammar", "the token mask was not computed")),
                            None => {
                                let t = Instant::now();
                                let m = c.mask();
                                self.mask_ms += t.elapsed().as_secs_f64() * 1e3;
                                self.masks += 1;
                                m
                            }
                        };
                        m.map(|m| {
                            self.masked.clear();
                            self.masked.extend_from_slice(lg);
                            apply_mask(&mut self.masked, &m);
                        })
                    }
                };
                if s.constraint.is_some() && masked.is_ok() {
                    lg = &self.masked;
                }
                let (prompt, generated) = s.tokens.split_at(s.prompt_len);
                let sampled_token = masked.and_then(|()| s.sampler.sample(lg, prompt, generated)).and_then(|x| {
                    if let Some(c) = s.constraint.as_mut() {
                        c.consume(x.token)?;
                    }
                    Ok(x)
                });
                let ev = match sampled_token {
                    Ok(x) => {
                        s.tokens.push(x.token);
                        s.first_token.get_or_insert_with(std::time::Instant::now);
                        self.generated_tokens += 1;
                        // A complete grammar allows nothing more: the request ends as at EOS.
                        let done_grammar = s.constraint.as_ref().is_some_and(|c| c.is_stopped());
                        let finish = s.stop.check(s.generated()).or(done_grammar.then_some(FinishReason::Eos));
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
                let (token, finished) = (ev.token, ev.finish.is_some());
                out.events.push(ev);
                if finished {
                    done.push(s.id);
                    break;
                }
                if i + 1 < rows && token.is_some() && token == drafts.get(i).copied() {
                    kept += 1;
                } else {
                    break;
                }
            }
            if speculated {
                // The chunk started at the last real token: it and the kept drafts have their
                // K/V; the rest of the chunk is discarded with the blocks only it used.
                s.computed = s.computed - rows + 1 + kept;
                self.kv.commit(s.id, &s.tokens, s.computed);
                self.kv.shrink(s.id, s.computed);
                if let Some(d) = self.drafter.as_mut() {
                    d.keep(s.id, s.computed);
                }
                self.spec_drafted += drafts.len() as u64;
                self.spec_accepted += kept as u64;
                // Rejected rows are compute spent for nothing: draft as far as the model has
                // been following lately, doubling back up after a fully kept draft.
                s.draft_len = if kept == drafts.len() { (2 * kept).clamp(1, spec_max) } else { kept + 1 };
            }
        }
        for id in done {
            self.sched.remove(id, &mut self.kv);
            self.tags.remove(&id);
        }
    }
}
