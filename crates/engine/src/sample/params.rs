//! Per-request sampling parameters (what a host or an OpenAI-style request sets).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How one request turns logits into tokens. Every field has a default that turns its stage
/// off, so `{}` in JSON deserializes to plain softmax sampling at temperature 1 with seed 0.
///
/// Unknown fields are rejected so that a misspelt knob (`"top-p"`) is an error instead of being
/// silently ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax, ties → lowest token id).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability mass is
    /// at least `top_p`; `1.0` = off. Must lie in (0, 1].
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the top token's probability (both after
    /// temperature); `0` = off. Must lie in [0, 1].
    pub min_p: f32,
    /// HF / llama.cpp repetition penalty over every token id in prompt + generated:
    /// positive logits are divided by it, the others multiplied. `1.0` = off; must be > 0.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over generated tokens only: `logit -= presence_penalty` for every
    /// token generated at least once. `0` = off; OpenAI's range [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over generated tokens only: `logit -= frequency_penalty × count`.
    /// `0` = off; OpenAI's range [-2, 2].
    pub frequency_penalty: f32,
    /// Seed of the request's own random stream: the same seed and the same logits give the
    /// same tokens whatever else runs in the batch.
    pub seed: u64,
    /// `None`: no logprobs. `Some(n)`: the chosen token's logprob plus the `n` most likely
    /// alternatives, all taken from the model's raw distribution (see [`super::Sampled`]).
    pub logprobs: Option<usize>,
    /// `(token, bias)` pairs added to the logits before every other stage (OpenAI's
    /// `logit_bias`); a bias of -inf bans the token. Logprobs stay those of the raw model.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logprobs: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), everything else off.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Checks every value's range; the error names the parameter at fault.
    pub fn validate(&self) -> Result<()> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(name, format!("must be a finite number, got {v}")))
            }
        };
        finite("temperature", self.temperature)?;
        if self.temperature < 0.0 {
            return Err(Error::invalid("temperature", format!("must be >= 0 (0 = greedy), got {}", self.temperature)));
        }
        finite("top_p", self.top_p)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid("top_p", format!("must lie in (0, 1] (1 = off), got {}", self.top_p)));
        }
        finite("min_p", self.min_p)?;
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid("min_p", format!("must lie in [0, 1] (0 = off), got {}", self.min_p)));
        }
        finite("repetition_penalty", self.repetition_penalty)?;
        if self.repetition_penalty <= 0.0 {
            return Err(Error::invalid(
                "repetition_penalty",
                format!("must be > 0 (1 = off), got {}", self.repetition_penalty),
            ));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            finite(name, v)?;
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::invalid(name, format!("must lie in [-2, 2] (0 = off), got {v}")));
            }
        }
        for (i, &(t, b)) in self.logit_bias.iter().enumerate() {
            if b.is_nan() || b == f32::INFINITY {
                return Err(Error::invalid(
                    format!("logit_bias[{i}]"),
                    format!("the bias of token {t} is {b}: a finite number, or -inf to ban the token"),
                ));
            }
        }
        Ok(())
    }

    /// Token ids of `logit_bias` below the vocabulary size (the engine checks at enqueue).
    pub fn validate_tokens(&self, vocab: usize) -> Result<()> {
        match self.logit_bias.iter().enumerate().find(|(_, &(t, _))| t as usize >= vocab) {
            Some((i, &(t, _))) => Err(Error::invalid(
                format!("logit_bias[{i}]"),
                format!("token {t} is not below the vocabulary size {vocab}"),
            )),
            None => Ok(()),
        }
    }

    /// Whether any penalty stage changes logits (the sampler then works on a copy).
    /// Whether a row is only read for its argmax: greedy, with nothing that changes or reports
    /// other logits (penalties, bias, logprobs).
    pub(crate) fn argmax_only(&self) -> bool {
        self.temperature == 0.0 && !self.has_penalties() && self.logprobs.is_none()
    }

    pub(crate) fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}
