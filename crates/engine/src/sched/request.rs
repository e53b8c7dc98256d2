//! What a host submits.

use crate::sample::{Grammar, SamplingParams};

/// Engine-unique, increasing request id (never reused within an engine).
pub type RequestId = u64;

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Maximum tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// End-of-sequence ids; `None` uses the model's.
    pub eos_ids: Option<Vec<u32>>,
    pub ignore_eos: bool,
    /// Token sequences that end generation.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Higher is served first.
    pub priority: i32,
    /// Opaque value returned with every event (hosts map it to their own request object).
    pub tag: u64,
    /// Compute the log-probability of every prompt token given the ones before it (for
    /// evaluation harnesses and perplexity). Such a request computes its whole prompt: the
    /// prefix cache is not used for it.
    pub prompt_logprobs: bool,
    /// Structured output: what the generated text must match (a JSON schema, a regex or a
    /// Lark grammar). The request ends when the grammar is complete.
    pub grammar: Option<Grammar>,
}

impl Request {
    /// A greedy request for `max_tokens` tokens.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens,
            eos_ids: None,
            ignore_eos: false,
            stop_sequences: Vec::new(),
            priority: 0,
            tag: 0,
            prompt_logprobs: false,
            grammar: None,
        }
    }
}
