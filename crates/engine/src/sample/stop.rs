//! When a request stops generating.
//!
//! [`StopCriteria::check`] runs after every appended token and looks only at the tail of the
//! generated tokens, so a stop sequence whose tokens arrive over several steps is found on the
//! step that completes it. Tokens that stop generation (EOS, the last token of a stop
//! sequence) **stay in the output**: the host sees exactly what the model produced and can trim
//! it (OpenAI-style servers strip them when detokenizing).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` tokens were generated.
    Length,
    /// The model produced one of the end-of-sequence tokens (and `ignore_eos` was off).
    Eos,
    /// The generated tokens end with one of the stop sequences
    /// ([`StopCriteria::matched_stop_sequence`] tells which).
    StopSequence,
    /// The host cancelled the request (set by the engine, never by `check`).
    Cancelled,
    /// Generation failed for this request (set by the engine, never by `check`).
    Error,
}

impl FinishReason {
    /// The stable lowercase name used in logs, JSON and the C ABI.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::StopSequence => "stop_sequence",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The stop rules of one request. Only generated tokens are inspected: a stop sequence never
/// matches across the prompt / output boundary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopCriteria {
    /// Maximum number of generated tokens (at least 1).
    pub max_tokens: usize,
    /// Tokens that end generation unless `ignore_eos` is set.
    pub eos_ids: Vec<u32>,
    /// Keep generating through EOS tokens (benchmarks, forced-length runs).
    pub ignore_eos: bool,
    /// Token sequences that end generation once the output ends with them (each non-empty).
    pub stop_sequences: Vec<Vec<u32>>,
}

impl StopCriteria {
    /// Stop after `max_tokens` tokens or at EOS; no stop sequences.
    pub fn new(max_tokens: usize, eos_ids: Vec<u32>) -> Self {
        StopCriteria { max_tokens, eos_ids, ignore_eos: false, stop_sequences: Vec::new() }
    }

    /// Rejects rules that could never work: `max_tokens == 0` and empty stop sequences (which
    /// would match before anything is generated). The error names the parameter.
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        if let Some(i) = self.stop_sequences.iter().position(|s| s.is_empty()) {
            return Err(Error::invalid(format!("stop_sequences[{i}]"), "a stop sequence must not be empty"));
        }
        Ok(())
    }

    /// Rejects stop tokens the model can never produce: an EOS id or a stop-sequence token
    /// at or above `vocab`. (A stop sequence holding one would silently never match.) The
    /// engine calls it at enqueue with the model's vocabulary size.
    pub fn validate_tokens(&self, vocab: usize) -> Result<()> {
        if let Some(&e) = self.eos_ids.iter().find(|&&e| e as usize >= vocab) {
            return Err(Error::invalid("eos_ids", format!("token {e} is not below the vocabulary size {vocab}")));
        }
        for (i, seq) in self.stop_sequences.iter().enumerate() {
            if let Some((j, &t)) = seq.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return Err(Error::invalid(
                    format!("stop_sequences[{i}]"),
                    format!("token {t} at index {j} is not below the vocabulary size {vocab}"),
                ));
            }
        }
        Ok(())
    }

    /// Whether `generated` (all tokens generated so far, including the one just appended) ends
    /// the request. Call it after every token. Precedence when several rules fire on the same
    /// token: EOS, then stop sequences, then length (a request that ends naturally on its last
    /// allowed token reports the natural reason, as vLLM does).
    pub fn check(&self, generated: &[u32]) -> Option<FinishReason> {
        let last = *generated.last()?;
        if !self.ignore_eos && self.eos_ids.contains(&last) {
            return Some(FinishReason::Eos);
        }
        if self.matched_stop_sequence(generated).is_some() {
            return Some(FinishReason::StopSequence);
        }
        if generated.len() >= self.max_tokens {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Index (into `stop_sequences`) of the first listed sequence that `generated` ends with.
    /// When overlapping sequences complete on the same token, the earliest listed one wins.
    pub fn matched_stop_sequence(&self, generated: &[u32]) -> Option<usize> {
        self.stop_sequences.iter().position(|s| !s.is_empty() && generated.ends_with(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_tokens_at_or_above_the_vocabulary_are_named() {
        let ok = StopCriteria { stop_sequences: vec![vec![1, 9]], ..StopCriteria::new(4, vec![2]) };
        ok.validate_tokens(10).unwrap();
        let e = StopCriteria::new(4, vec![2, 10]).validate_tokens(10).unwrap_err().to_string();
        assert!(e.contains("eos_ids") && e.contains("10") && e.contains("vocabulary size 10"), "{e}");
        let bad = StopCriteria { stop_sequences: vec![vec![1], vec![3, u32::MAX]], ..StopCriteria::new(4, vec![]) };
        let e = bad.validate_tokens(10).unwrap_err().to_string();
        assert!(e.contains("stop_sequences[1]") && e.contains(&u32::MAX.to_string()) && e.contains("index 1"), "{e}");
    }
}
