//! A single sequence run directly on a `ModelRunner`: what `tboost logits` uses to get
//! teacher-forced logits at every position, and the reference the engine's batched results
//! are compared with. Its blocks come from a KV manager of its own over the runner's pools.

use crate::kv::{KvManager, SeqWork, StepLayout};
use crate::runner::{ModelRunner, StepBatch};
use crate::{Error, Result};

/// The session's sequence in its KV manager.
const SEQ: u64 = 0;

pub struct Session<'r> {
    runner: &'r mut ModelRunner,
    kv: KvManager,
    layout: StepLayout,
    capacity: usize,
    len: usize,
}

impl<'r> Session<'r> {
    /// A session that can hold `capacity` positions; uses the runner's KV pools from block 0.
    pub fn new(runner: &'r mut ModelRunner, capacity: usize) -> Result<Session<'r>> {
        let (blocks, bs) = runner.kv_geometry().ok_or_else(|| Error::invalid("kv cache", "no KV cache allocated"))?;
        let mut kv = KvManager::new(blocks, bs, false);
        if !kv.grow(SEQ, capacity) {
            return Err(Error::invalid(
                "capacity",
                format!("{capacity} positions need {} blocks but the cache has {blocks}", capacity.div_ceil(bs)),
            ));
        }
        Ok(Session { runner, kv, layout: StepLayout::default(), capacity, len: 0 })
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `tokens`; returns logits for every new position (`all`) or the last only.
    pub fn feed(&mut self, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::invalid("tokens", "nothing to feed"));
        }
        let end = self.len + tokens.len();
        if end > self.capacity {
            return Err(Error::invalid(
                "tokens",
                format!("{end} positions exceed the session capacity {}", self.capacity),
            ));
        }
        self.kv.layout(&[SeqWork { seq: SEQ, start: self.len, n: tokens.len() }], &mut self.layout);
        let rows: Vec<u32> = if all { (0..tokens.len() as u32).collect() } else { vec![tokens.len() as u32 - 1] };
        let mut logits = Vec::new();
        self.runner
            .forward(&StepBatch { tokens, layout: &self.layout, logit_rows: &rows, argmax_only: false }, &mut logits)?;
        self.len = end;
        Ok(logits)
    }

    /// Greedy decoding: feeds `prompt`, then `n` argmax tokens (ties → lowest id).
    pub fn greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        let mut logits = self.feed(prompt, false)?;
        for i in 0..n {
            let next = argmax(&logits);
            out.push(next);
            if i + 1 < n {
                logits = self.feed(&[next], false)?;
            }
        }
        Ok(out)
    }
}

/// Index of the largest value, lowest index on ties; NaN never wins.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best = i;
            best_v = x;
        }
    }
    best as u32
}
