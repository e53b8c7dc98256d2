//! The plain types of the ABI: opaque handles, ids, enums and the `struct_size`-versioned
//! structs. Struct fields are laid out without padding so that every language's mapping
//! (cgo, JNA) agrees with C's; new fields are only ever appended.

use std::os::raw::{c_char, c_void};

/// Engine and model options, set by string keys (see `tboost_config_set_int`).
/// Not thread-safe: set it up on one thread, then share it read-only.
pub struct tboost_config {
    _opaque: [u8; 0],
}

/// A loaded model: immutable, may be shared by many engines and threads. Engines keep
/// what they need, so the model may be freed before the engines made from it.
pub struct tboost_model {
    _opaque: [u8; 0],
}

/// One continuous-batching engine with its own KV cache, scheduler and compute threads.
pub struct tboost_engine {
    _opaque: [u8; 0],
}

/// A model file's tokenizer loaded on its own, without weights (`tboost_tokenizer_load`).
/// Immutable: may be shared by many threads.
pub struct tboost_tokenizer {
    _opaque: [u8; 0],
}

/// Engine-unique request id, never reused; ids start at 1.
pub type tboost_request_id = u64;

/// "Any request" for `tboost_engine_read` and `tboost_engine_wait`.
pub const TBOOST_ANY_REQUEST: tboost_request_id = 0;

/// What `tboost_sampling_params::grammar` holds (structured output).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_grammar_kind {
    /// No constraint.
    TBOOST_GRAMMAR_NONE = 0,
    /// A JSON schema (JSON text): the output is one JSON value that validates.
    TBOOST_GRAMMAR_JSON_SCHEMA = 1,
    /// A regular expression the whole output matches.
    TBOOST_GRAMMAR_REGEX = 2,
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    TBOOST_GRAMMAR_LARK = 3,
    /// A grammar in llama.cpp's GBNF (`root ::= ...`, as llama.cpp's `--grammar` takes it),
    /// converted to Lark: the output matches exactly what llama.cpp's grammar would accept.
    /// Tokens `<[id]>`, `<text>` and their negations `!<...>` are taken; a grammar that does
    /// not convert fails the enqueue with a last error naming the line and column.
    TBOOST_GRAMMAR_GBNF = 4,
}

/// Why a request finished (`TBOOST_FINISH_NONE` while it runs).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_finish_reason {
    TBOOST_FINISH_NONE = 0,
    /// `max_tokens` tokens were generated.
    TBOOST_FINISH_LENGTH = 1,
    /// The model produced an end-of-sequence token (the token is in the output).
    TBOOST_FINISH_EOS = 2,
    /// The output ends with one of the request's stop sequences (kept in the output).
    TBOOST_FINISH_STOP_SEQUENCE = 3,
    /// The host cancelled the request.
    TBOOST_FINISH_CANCELLED = 4,
    /// The request failed; `tboost_engine_request_error` gives the reason.
    TBOOST_FINISH_ERROR = 5,
}

impl tboost_finish_reason {
    pub(crate) fn from_engine(f: Option<::tboost_engine::sample::FinishReason>) -> Self {
        use ::tboost_engine::sample::FinishReason as F;
        match f {
            None => Self::TBOOST_FINISH_NONE,
            Some(F::Length) => Self::TBOOST_FINISH_LENGTH,
            Some(F::Eos) => Self::TBOOST_FINISH_EOS,
            Some(F::StopSequence) => Self::TBOOST_FINISH_STOP_SEQUENCE,
            Some(F::Cancelled) => Self::TBOOST_FINISH_CANCELLED,
            Some(F::Error) => Self::TBOOST_FINISH_ERROR,
        }
    }
}

/// Log levels, most severe first (`TBOOST_LOG_OFF` silences everything).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_log_level {
    TBOOST_LOG_OFF = 0,
    TBOOST_LOG_ERROR = 1,
    TBOOST_LOG_WARN = 2,
    TBOOST_LOG_INFO = 3,
    TBOOST_LOG_DEBUG = 4,
    TBOOST_LOG_TRACE = 5,
}

/// Receives one log record. `target` (the module, e.g. "tboost::plan") and `message` are
/// NUL-terminated UTF-8, valid only during the call. It may be called from any thread,
/// including the engine's compute threads, and must not call back into tboost: such a call
/// returns `TBOOST_ERR_REENTRANT` without running (only `tboost_last_error`,
/// `tboost_status_name` and `tboost_finish_reason_name` work there), and the call that
/// logged completes.
pub type tboost_log_fn = Option<
    unsafe extern "C" fn(
        level: tboost_log_level,
        target: *const c_char,
        message: *const c_char,
        user_data: *mut c_void,
    ),
>;

/// Model-load progress in [0, 1], called on the loading thread, increasing, ending with 1.
/// Return false to abort the load (`TBOOST_ERR_CANCELLED`).
pub type tboost_progress_fn = Option<unsafe extern "C" fn(progress: f32, user_data: *mut c_void) -> bool>;

/// Per-request generation parameters. Fill with `tboost_sampling_params_init` (which sets
/// `struct_size` and every default), then change what you need. The library reads only
/// `struct_size` bytes, so hosts built against an older header keep working.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tboost_sampling_params {
    /// sizeof(tboost_sampling_params), set by `tboost_sampling_params_init`.
    pub struct_size: u32,
    /// Most tokens to generate (>= 1). Default 16.
    pub max_tokens: u32,
    /// 0 = greedy (argmax, ties to the lowest id). Default 0.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off. Default 0.
    pub top_k: i32,
    /// Nucleus sampling mass in (0, 1]; 1 = off. Default 1.
    pub top_p: f32,
    /// Drop tokens below min_p x the top probability, in [0, 1]; 0 = off. Default 0.
    pub min_p: f32,
    /// > 0; 1 = off. Default 1.
    pub repetition_penalty: f32,
    /// In [-2, 2]; 0 = off. Default 0.
    pub presence_penalty: f32,
    /// In [-2, 2]; 0 = off. Default 0.
    pub frequency_penalty: f32,
    /// -1 = no logprobs; n >= 0 = events carry the chosen token's logprob and the n most
    /// likely alternatives (at most `TBOOST_MAX_TOP_LOGPROBS` of them; a larger n gets
    /// that many). Default -1.
    pub logprobs: i32,
    /// Higher is served first. Default 0.
    pub priority: i32,
    /// Nonzero: keep generating through end-of-sequence tokens. Default 0.
    pub ignore_eos: u32,
    /// Seed of the request's own random stream (same seed + same logits = same tokens,
    /// whatever else is in the batch). Default 0.
    pub seed: u64,
    /// Opaque host value echoed in every event of the request. Default 0.
    pub user_tag: u64,
    /// Nonzero: compute the logprob of every prompt token given those before it, read with
    /// `tboost_engine_prompt_logprobs` once the first token's event has come. Such a request
    /// computes its whole prompt (no prefix-cache reuse) and its prefill computes lm_head
    /// rows for every prompt position. Default 0. (Appended: ABI 1, second version.)
    pub prompt_logprobs: u32,
    /// Entries of `logit_bias_tokens` / `logit_bias_values`. Default 0.
    pub n_logit_bias: u32,
    /// Token ids whose logits get `logit_bias_values` added before sampling (OpenAI's
    /// `logit_bias`; -INFINITY bans a token). Both arrays are copied by enqueue; NULL when
    /// `n_logit_bias` is 0. Logprobs stay those of the raw model. Default NULL.
    pub logit_bias_tokens: *const i32,
    pub logit_bias_values: *const f32,
    /// Structured output: the request's output must match `grammar` (NUL-terminated UTF-8,
    /// copied by enqueue), read as `grammar_kind` says; the request ends (`TBOOST_FINISH_EOS`)
    /// when the grammar is complete. A grammar that does not compile fails the enqueue with
    /// `TBOOST_ERR_INVALID_ARGUMENT` naming its kind and position. Its logprobs are those of
    /// the masked distribution. Needs the model's tokenizer. Default NULL.
    pub grammar: *const c_char,
    /// A `tboost_grammar_kind` (an int here, so that any value a host writes is defined
    /// and an unknown one is refused by name). Default `TBOOST_GRAMMAR_NONE`.
    pub grammar_kind: i32,
    /// Zero.
    pub reserved: u32,
}

/// Size of the first version of `tboost_sampling_params` (the minimum `struct_size`).
pub(crate) const SAMPLING_PARAMS_V1: usize = 64;

impl Default for tboost_sampling_params {
    fn default() -> Self {
        tboost_sampling_params {
            struct_size: std::mem::size_of::<Self>() as u32,
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: -1,
            priority: 0,
            ignore_eos: 0,
            seed: 0,
            user_tag: 0,
            prompt_logprobs: 0,
            n_logit_bias: 0,
            logit_bias_tokens: std::ptr::null(),
            logit_bias_values: std::ptr::null(),
            grammar: std::ptr::null(),
            grammar_kind: tboost_grammar_kind::TBOOST_GRAMMAR_NONE as i32,
            reserved: 0,
        }
    }
}

/// One thing that happened to a request: a token, its end, or both. Written by
/// `tboost_engine_read` into the caller's array; `struct_size` says how many bytes the
/// library filled.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct tboost_event {
    pub struct_size: u32,
    /// The generated token, or -1 when the event carries none (a cancel or an error).
    pub token: i32,
    pub request_id: tboost_request_id,
    /// The request's `user_tag`.
    pub user_tag: u64,
    /// Natural-log probability of `token` under the model's raw distribution; NaN when
    /// the request did not ask for logprobs or there is no token.
    pub logprob: f32,
    /// 0-based index of `token` in the request's output; on an event without a token, the
    /// number of tokens the request produced.
    pub index: u32,
    /// `TBOOST_FINISH_NONE` while the request runs; the reason on its last event.
    pub finish: tboost_finish_reason,
    /// `TBOOST_ERR_REQUEST_FAILED` on a `TBOOST_FINISH_ERROR` event, else `TBOOST_OK`.
    pub error: super::tboost_status,
    // Appended (ABI 1, second version): top alternatives and, on the last event, timings.
    /// How many entries of `top_tokens`/`top_logprobs` are filled: min(the request's
    /// `logprobs`, `TBOOST_MAX_TOP_LOGPROBS`) on a token event, else 0.
    pub n_top: u32,
    /// On the last event (`finish` != NONE): times the request was preempted; else 0.
    pub preemptions: u32,
    /// On the last event: the prompt's length in tokens; else 0.
    pub prompt_tokens: u32,
    /// On the last event: prompt tokens the prefix cache supplied; else 0.
    pub cached_prompt_tokens: u32,
    /// On the last event: milliseconds from enqueue to the request's first admission (to
    /// its end if it never started); else 0.
    pub queued_ms: f64,
    /// On the last event: milliseconds from enqueue to its first token; NaN if it produced
    /// none or on other events.
    pub first_token_ms: f64,
    /// On the last event: milliseconds from enqueue to its end; else 0.
    pub total_ms: f64,
    /// The most likely tokens at this position, most likely first.
    pub top_tokens: [i32; TBOOST_MAX_TOP_LOGPROBS],
    /// Their natural-log probabilities under the model's raw distribution.
    pub top_logprobs: [f32; TBOOST_MAX_TOP_LOGPROBS],
}

/// Most top alternatives an event carries (`tboost_sampling_params::logprobs`).
pub const TBOOST_MAX_TOP_LOGPROBS: usize = 20;

pub(crate) const EVENT_V1: usize = 40;

/// Engine counters, filled by `tboost_engine_stats`. Set `struct_size` first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct tboost_stats {
    /// Set to sizeof(tboost_stats) before the call; the library sets it to the bytes filled.
    pub struct_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Requests waiting to start (including preempted ones).
    pub waiting: u64,
    pub running: u64,
    /// Waiting requests that were preempted and will be recomputed.
    pub preempted: u64,
    pub preemptions_total: u64,
    pub kv_blocks_total: u64,
    pub kv_blocks_used: u64,
    /// Free blocks that still hold a reusable cached prefix.
    pub kv_blocks_cached: u64,
    pub prefix_cache_hit_tokens: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Tokens run through the model (prefill chunks + decodes, recomputation included).
    pub computed_tokens: u64,
    /// Steps that ran a batch.
    pub steps: u64,
    pub finished: u64,
    pub cancelled: u64,
    /// Events produced but not yet read.
    pub events_pending: u64,
    pub last_step_ms: f64,
    pub total_step_ms: f64,
}

pub(crate) const STATS_V1: usize = 144;

#[cfg(test)]
mod tests {
    use super::*;

    /// The first-version sizes are part of the ABI: they must never change, and the first
    /// version's fields keep their places.
    #[test]
    fn first_versions_keep_their_size_and_places() {
        assert_eq!((SAMPLING_PARAMS_V1, EVENT_V1, STATS_V1), (64, 40, 144));
        assert_eq!(std::mem::size_of::<tboost_stats>(), STATS_V1);
        assert_eq!(std::mem::offset_of!(tboost_sampling_params, user_tag), 56);
        assert_eq!(std::mem::offset_of!(tboost_event, error), 36);
    }

    /// The second versions have no padding (every FFI mapping lays them out alike).
    #[test]
    fn second_versions_are_packed() {
        assert_eq!(std::mem::size_of::<tboost_sampling_params>(), 104);
        assert_eq!(std::mem::size_of::<tboost_event>(), 40 + 16 + 24 + 8 * TBOOST_MAX_TOP_LOGPROBS);
    }
}
