//! Sampling: logits → next token, per request, deterministic for a given seed.
//!
//! - [`SamplingParams`]: the user's knobs (temperature, top-k/p, min-p, penalties, seed,
//!   logprobs), serde-compatible and validated with errors naming the parameter.
//! - [`Sampler`]: one per request; `sample` once per generated token. Its random stream
//!   depends on its own seed only, so a request gets the same tokens whatever else is batched.
//! - [`StopCriteria`] / [`FinishReason`]: when a request ends (length, EOS, stop sequences).
//! - [`constrain`]: structured output (JSON schema, regex, Lark, and GBNF through [`gbnf`]).

pub mod constrain;
pub mod gbnf;
mod params;
mod rng;
mod sampler;
mod stop;

pub use constrain::Grammar;
pub use gbnf::{gbnf_to_lark, GbnfError};
pub use params::SamplingParams;
pub use sampler::{token_logprob, Sampled, Sampler};
pub use stop::{FinishReason, StopCriteria};
