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
