//! `tboost_engine`: the engine crate's `EventEngine` (the engine, its event queue and
//! `wait`, the poison flag) and the engine's plan as JSON. This module only converts events to
//! `tboost_event` and errors to status codes.

use std::os::raw::c_char;
use std::sync::Arc;
use std::time::Duration;

use super::config::settings_of;
use super::guard::{guard, CallCtx, Poison};
use super::handle::Registry;
use super::log_bridge::ensure_logger;
use super::model::MODELS;
use super::status::{tboost_status, Failure, FfiResult, Status};
use super::types::*;
use super::util::*;
use ::tboost_engine::engine::{Engine, EventEngine, QueuedEvent};
use ::tboost_engine::sample::{FinishReason, Grammar, SamplingParams};
use ::tboost_engine::sched::{Request, RequestId};
use ::tboost_engine::Error;

pub(crate) struct EngineInner {
    ev: EventEngine,
    plan_json: String,
    /// Tensor-parallel rank and world size (0 of 1 without tensor parallelism).
    rank: u32,
    world: u32,
}

impl Poison for EngineInner {
    fn poison(&self) {
        self.ev.poison();
    }
}

/// `TBOOST_ANY_REQUEST` as the engine crate's "every request".
fn which(id: tboost_request_id) -> Option<RequestId> {
    (id != TBOOST_ANY_REQUEST).then_some(id)
}

fn to_c(q: &QueuedEvent) -> tboost_event {
    let e = &q.event;
    let failed = e.finish == Some(FinishReason::Error);
    let mut top_tokens = [0i32; TBOOST_MAX_TOP_LOGPROBS];
    let mut top_logprobs = [0f32; TBOOST_MAX_TOP_LOGPROBS];
    let n_top = e.top_logprobs.len().min(TBOOST_MAX_TOP_LOGPROBS);
    for (i, &(t, lp)) in e.top_logprobs.iter().take(n_top).enumerate() {
        top_tokens[i] = t as i32;
        top_logprobs[i] = lp;
    }
    let t = e.timings;
    // Prompts and preemption counts fit u32: prompts are bounded by the KV cache.
    let n32 = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    tboost_event {
        struct_size: std::mem::size_of::<tboost_event>() as u32,
        // Token ids are below the vocabulary size, far below i32::MAX.
        token: e.token.map_or(-1, |t| t as i32),
        request_id: e.id,
        user_tag: e.tag,
        logprob: e.logprob.unwrap_or(f32::NAN),
        index: q.index,
        finish: tboost_finish_reason::from_engine(e.finish),
        error: if failed { Status::TBOOST_ERR_REQUEST_FAILED } else { Status::TBOOST_OK },
        n_top: n_top as u32,
        preemptions: t.map_or(0, |t| t.preemptions),
        prompt_tokens: t.map_or(0, |t| n32(t.prompt_tokens)),
        cached_prompt_tokens: t.map_or(0, |t| n32(t.cached_prompt_tokens)),
        queued_ms: t.map_or(0.0, |t| t.queued_ms),
        first_token_ms: t.and_then(|t| t.first_token_ms).unwrap_or(f64::NAN),
        total_ms: t.map_or(0.0, |t| t.total_ms),
        top_tokens,
        top_logprobs,
    }
}

pub(crate) static ENGINES: Registry<EngineInner> = Registry::new("engine");

/// Looks up a live, unpoisoned engine and records it so that a panic poisons it.
fn engine_of(ctx: &mut CallCtx, e: *const tboost_engine) -> FfiResult<Arc<EngineInner>> {
    let inner = ENGINES.get(e, "engine")?;
    if inner.ev.is_poisoned() {
        return Err(Error::Poisoned.into());
    }
    ctx.engine = Some(inner.clone());
    Ok(inner)
}

/// Creates an engine for `model` with the options in `cfg` (may be NULL: defaults): plans
/// the model, starts the compute threads and allocates the KV cache. The engine keeps what
/// it needs of the model. Returns `TBOOST_ERR_INVALID_ARGUMENT` naming the option at fault
/// (e.g. max_batched_tokens below max_seqs, a KV cache too small for one block). Free it
/// with `tboost_engine_free`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_new(
    model: *const tboost_model,
    cfg: *const tboost_config,
    out: *mut *mut tboost_engine,
) -> tboost_status {
    guard("tboost_engine_new", |_| {
        require(out, "out")?;
        let m = MODELS.get(model, "model")?;
        let s = settings_of(cfg)?;
        ensure_logger();
        let engine = Engine::new(s.engine.clone())?;
        engine.load_model(&m.model)?;
        let plan = engine.plan()?;
        let plan_json = plan.to_json().to_string();
        // Both below 64 (`tp`) or the MPI world's size, which is a C int.
        let (rank, world) = plan.tp.as_ref().map_or((0, 1), |t| (t.shard.rank as u32, t.shard.world as u32));
        let inner = EngineInner { ev: EventEngine::new(engine).with_step_faults(s.faults), plan_json, rank, world };
        let h = ENGINES.insert(Arc::new(inner));
        // SAFETY: `out` is non-null and valid per the contract.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees an engine: every request in flight is dropped with its KV blocks, unread events
/// are discarded, and threads blocked in `tboost_engine_wait` on it return
/// `TBOOST_ERR_INVALID_HANDLE`. A poisoned engine can (and should) be freed. NULL is a
/// no-op; a freed or unknown handle is `TBOOST_ERR_INVALID_HANDLE`. No other call on this
/// engine may start after it.
#[no_mangle]
pub extern "C" fn tboost_engine_free(engine: *mut tboost_engine) -> tboost_status {
    guard("tboost_engine_free", |_| {
        if engine.is_null() {
            return Ok(());
        }
        let inner = ENGINES.remove(engine, "engine")?;
        // A step running on another thread stops at its next op; the engine goes when it
        // returns (it holds the last reference).
        inner.ev.close();
        Ok(())
    })
}

/// Fills `params` with the defaults (greedy, 16 tokens, no penalties, no logprobs, priority
/// 0, tag 0) and sets `struct_size`. NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn tboost_sampling_params_init(params: *mut tboost_sampling_params) {
    super::guard::guard_value((), || {
        // SAFETY: NULL or valid for writes per the contract.
        unsafe { write_out(params, tboost_sampling_params::default()) }
    })
}

fn sampling(p: &tboost_sampling_params) -> FfiResult<SamplingParams> {
    let n = p.n_logit_bias as usize;
    // SAFETY: arrays of `n_logit_bias` elements per the contract (NULL only with 0).
    let tokens = unsafe { read_slice(p.logit_bias_tokens, n, "params->logit_bias_tokens") }?;
    let values = unsafe { read_slice(p.logit_bias_values, n, "params->logit_bias_values") }?;
    let logit_bias = token_ids(tokens, "params->logit_bias_tokens")?.into_iter().zip(values.iter().copied()).collect();
    let top_k = usize::try_from(p.top_k)
        .map_err(|_| Failure::invalid(format!("`top_k` = {} must be >= 0 (0 = off)", p.top_k)))?;
    let logprobs = match p.logprobs {
        -1 => None,
        n if n >= 0 => Some((n as usize).min(TBOOST_MAX_TOP_LOGPROBS)),
        n => return Err(Failure::invalid(format!("`logprobs` = {n} must be -1 (off) or >= 0"))),
    };
    Ok(SamplingParams {
        temperature: p.temperature,
        top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        logprobs,
        logit_bias,
    })
}

fn grammar(p: &tboost_sampling_params) -> FfiResult<Option<Grammar>> {
    let kind = p.grammar_kind;
    if kind == tboost_grammar_kind::TBOOST_GRAMMAR_NONE as i32 {
        return Ok(None);
    }
    // SAFETY: NULL or NUL-terminated per the contract.
    let text = unsafe { read_cstr(p.grammar, "params->grammar") }?.to_owned();
    Ok(Some(match kind {
        1 => Grammar::JsonSchema(text),
        2 => Grammar::Regex(text),
        3 => Grammar::Lark(text),
        4 => Grammar::Gbnf(text),
        k => {
            return Err(Failure::invalid(format!("`params->grammar_kind` = {k} is not a tboost_grammar_kind (0..=4)")))
        }
    }))
}

/// Queues a request; `*id_out` receives its id. Everything is copied before the call
/// returns, so the caller may free its arrays at once.
///
/// - `prompt`, `n_prompt`: token ids, each in [0, vocab_size); at least one.
/// - `params`: NULL for the defaults, else initialised with `tboost_sampling_params_init`.
/// - Stop sequences: `n_stop` sequences whose lengths are `stop_lens[0..n_stop]` (each at
///   least 1), their tokens concatenated in `stop_tokens`. Both may be NULL when `n_stop` is
///   0. A request stops once its output ends with one of them (kept in the output).
///
/// Returns `TBOOST_ERR_INVALID_ARGUMENT` naming the bad value (token out of range, empty
/// stop sequence, sampling value out of range), `TBOOST_ERR_KV_CAPACITY` when prompt +
/// max_tokens can never fit the KV cache, `TBOOST_ERR_QUEUE_FULL` at `queue_limit`.
/// Thread-safe; may be called while another thread steps.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_enqueue(
    engine: *mut tboost_engine,
    prompt: *const i32,
    n_prompt: usize,
    params: *const tboost_sampling_params,
    stop_tokens: *const i32,
    stop_lens: *const usize,
    n_stop: usize,
    id_out: *mut tboost_request_id,
) -> tboost_status {
    guard("tboost_engine_enqueue", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(id_out, "id_out")?;
        // SAFETY (all reads below): arrays of the given lengths per the contract.
        let prompt = token_ids(unsafe { read_slice(prompt, n_prompt, "prompt") }?, "prompt")?;
        let p = if params.is_null() {
            tboost_sampling_params::default()
        } else {
            unsafe { read_sized(params, tboost_sampling_params::default(), SAMPLING_PARAMS_V1, "params") }?
        };
        let lens = unsafe { read_slice(stop_lens, n_stop, "stop_lens") }?;
        let total = lens
            .iter()
            .try_fold(0usize, |a, &l| a.checked_add(l))
            .ok_or_else(|| Failure::invalid("`stop_lens` add up to more than memory can hold"))?;
        let flat = token_ids(unsafe { read_slice(stop_tokens, total, "stop_tokens") }?, "stop_tokens")?;
        let mut stop_sequences = Vec::with_capacity(lens.len());
        let mut at = 0;
        for (i, &l) in lens.iter().enumerate() {
            if l == 0 {
                return Err(Failure::invalid(format!("`stop_lens[{i}]` is 0: a stop sequence must not be empty")));
            }
            stop_sequences.push(flat[at..at + l].to_vec());
            at += l;
        }
        let req = Request {
            prompt,
            sampling: sampling(&p)?,
            max_tokens: p.max_tokens as usize,
            eos_ids: None,
            ignore_eos: p.ignore_eos != 0,
            stop_sequences,
            priority: p.priority,
            tag: p.user_tag,
            prompt_logprobs: p.prompt_logprobs != 0,
            grammar: grammar(&p)?,
        };
        let id = inner.ev.engine().enqueue(req)?;
        // SAFETY: checked non-null above.
        unsafe { write_out(id_out, id) };
        Ok(())
    })
}

/// Cancels a request. `TBOOST_OK` means its events end with a `TBOOST_FINISH_CANCELLED`
/// event, from the next step (also when the step running at that moment would have
/// finished it: its last token then comes with the cancelled finish); its KV blocks are
/// freed by that step. Idempotent: cancelling a request that is already cancelled (or whose
/// cancel is pending) returns `TBOOST_OK`. An unknown id, or a request that already
/// finished otherwise, is `TBOOST_ERR_NOT_FOUND` (not fatal: it may have finished just
/// before). Thread-safe.
#[no_mangle]
pub extern "C" fn tboost_engine_cancel(engine: *mut tboost_engine, id: tboost_request_id) -> tboost_status {
    guard("tboost_engine_cancel", |ctx| {
        let inner = engine_of(ctx, engine)?;
        Ok(inner.ev.engine().cancel(id)?)
    })
}

/// Runs one continuous-batching iteration: admits waiting requests, runs one batch of
/// prefill chunks and decodes, samples, and appends the resulting events to the engine's
/// queue (read them with `tboost_engine_read`). `*n_events_out` (may be NULL) receives how
/// many events this step appended. With nothing to do it returns at once with 0.
///
/// One thread at a time: a call while another thread is inside step returns
/// `TBOOST_ERR_BUSY`. A failure of the batch is reported per request (events with
/// `TBOOST_FINISH_ERROR`), not as the step's status.
///
/// On a tensor-parallel follower (rank > 0, `tboost_engine_rank`) the first step runs the
/// leader's steps until rank 0's engine is freed (`TBOOST_OK`) or the group fails (the
/// status and message of the failed collective, naming the rank); later steps return at
/// once with 0.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_step(engine: *mut tboost_engine, n_events_out: *mut usize) -> tboost_status {
    guard("tboost_engine_step", |ctx| {
        let inner = engine_of(ctx, engine)?;
        let n = inner.ev.step()?;
        // SAFETY: NULL or valid per the contract.
        unsafe { write_out(n_events_out, n) };
        Ok(())
    })
}

/// `*out` = true while any request is waiting, running or has a cancellation to report,
/// i.e. while `tboost_engine_step` has work. On a tensor-parallel follower
/// (`tboost_engine_rank`) it is true until its step has returned from following the leader.
/// Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_has_work(engine: *const tboost_engine, out: *mut bool) -> tboost_status {
    guard("tboost_engine_has_work", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(out, "out")?;
        let v = inner.ev.engine().has_work()?;
        // SAFETY: checked non-null above.
        unsafe { write_out(out, v) };
        Ok(())
    })
}

/// Moves up to `cap` events into `events` — those of request `id`, or of every request
/// for `TBOOST_ANY_REQUEST` — oldest first; `*n_out` receives how many were written. Each
/// event is read once; events stay queued until read (or the engine is freed). `event_size` is sizeof(tboost_event) from the caller's header (the
/// array stride; the library fills at most that much of each). With `cap` 0, nothing is
/// removed and `*n_out` is the number of events ready (`events` may then be NULL).
///
/// Returns `TBOOST_ERR_NOT_FOUND` for an id the engine never issued. Thread-safe: many
/// threads may read (e.g. one per request) while another steps.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_read(
    engine: *mut tboost_engine,
    id: tboost_request_id,
    events: *mut tboost_event,
    event_size: usize,
    cap: usize,
    n_out: *mut usize,
) -> tboost_status {
    guard("tboost_engine_read", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(n_out, "n_out")?;
        check_size(event_size, EVENT_V1, "event_size")?;
        if cap > 0 {
            require(events, "events")?;
            if cap.checked_mul(event_size).is_none_or(|b| b > isize::MAX as usize) {
                return Err(Failure::invalid(format!("`cap` {cap} x `event_size` {event_size} overflows")));
            }
        }
        if cap == 0 {
            let n = inner.ev.ready(which(id))?;
            // SAFETY: checked non-null above.
            unsafe { write_out(n_out, n) };
            return Ok(());
        }
        let taken = inner.ev.read(which(id), cap)?;
        for (i, e) in taken.iter().enumerate() {
            // SAFETY: element i of the caller's array of `cap` elements of `event_size` bytes.
            unsafe { write_sized(events.cast::<u8>().add(i * event_size), &to_c(e), event_size) };
        }
        // SAFETY: checked non-null above.
        unsafe { write_out(n_out, taken.len()) };
        Ok(())
    })
}

/// Blocks until at least one event of request `id` (or of any request, for
/// `TBOOST_ANY_REQUEST`) is ready to read, or `timeout_ms` passes (0 = just check).
/// `*n_ready_out` (may be NULL) receives the number of events ready; 0 means the timeout
/// passed. Someone else must be stepping the engine for events to come. Returns
/// `TBOOST_ERR_NOT_FOUND` at once for an id the engine never issued, or for a request that
/// has ended and whose events were all read (nothing more will come);
/// `TBOOST_ERR_INVALID_HANDLE` if the engine is freed meanwhile, `TBOOST_ERR_POISONED` if a
/// panic poisons it. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_wait(
    engine: *mut tboost_engine,
    id: tboost_request_id,
    timeout_ms: u32,
    n_ready_out: *mut usize,
) -> tboost_status {
    guard("tboost_engine_wait", |ctx| {
        let inner = engine_of(ctx, engine)?;
        let n = inner.ev.wait(which(id), Duration::from_millis(timeout_ms.into())).map_err(|e| match e {
            Error::Interrupted if inner.ev.is_closed() => {
                Failure::new(Status::TBOOST_ERR_INVALID_HANDLE, "the engine was freed while waiting")
            }
            e => e.into(),
        })?;
        // SAFETY: NULL or valid per the contract.
        unsafe { write_out(n_ready_out, n) };
        Ok(())
    })
}

/// Copies request `id`'s generated tokens so far into `tokens` (`*n_tokens_out` receives
/// their number; `TBOOST_ERR_BUFFER_TOO_SMALL` and nothing written when `cap` is smaller)
/// and its finish reason into `*finish_out` (may be NULL; `TBOOST_FINISH_NONE` while it
/// runs). Records of finished requests are kept for the last 65536 of them. Returns
/// `TBOOST_ERR_NOT_FOUND` for an unknown id. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_output(
    engine: *const tboost_engine,
    id: tboost_request_id,
    tokens: *mut i32,
    cap: usize,
    n_tokens_out: *mut usize,
    finish_out: *mut tboost_finish_reason,
) -> tboost_status {
    guard("tboost_engine_output", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(n_tokens_out, "n_tokens_out")?;
        let o = inner.ev.engine().output(id)?;
        // SAFETY: NULL or valid per the contract.
        unsafe { write_out(finish_out, tboost_finish_reason::from_engine(o.finish)) };
        let ids: Vec<i32> = o.tokens.iter().map(|&t| t as i32).collect();
        // SAFETY: `tokens` holds `cap` elements per the contract.
        unsafe { write_array(&ids, tokens, cap, n_tokens_out, "tokens") }
    })
}

/// Writes why request `id` failed (its `TBOOST_FINISH_ERROR` event) into `buf`; "" when it
/// did not fail. Buffer rules as in `tboost_last_error`. `TBOOST_ERR_NOT_FOUND` for an
/// unknown id. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_request_error(
    engine: *const tboost_engine,
    id: tboost_request_id,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_engine_request_error", |ctx| {
        let inner = engine_of(ctx, engine)?;
        let o = inner.ev.engine().output(id)?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(o.error.as_deref().unwrap_or(""), buf, cap, needed) }
    })
}

/// Copies request `id`'s prompt logprobs into `logprobs`: entry i is the natural-log
/// probability of prompt token i given tokens 0..i under the model's raw distribution
/// (entry 0, which has no context, is NaN); `*n_out` receives the prompt's length, and
/// `TBOOST_ERR_BUFFER_TOO_SMALL` with nothing written when `cap` is smaller. They are ready
/// once the request's first token event has come (its prompt was computed).
///
/// Returns `TBOOST_ERR_NOT_FOUND` for an unknown id, `TBOOST_ERR_INVALID_ARGUMENT` when the
/// request did not set `prompt_logprobs` or its prompt is not computed yet (both named in
/// the last error). Kept with the request's record (`tboost_engine_output`). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_prompt_logprobs(
    engine: *const tboost_engine,
    id: tboost_request_id,
    logprobs: *mut f32,
    cap: usize,
    n_out: *mut usize,
) -> tboost_status {
    guard("tboost_engine_prompt_logprobs", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(n_out, "n_out")?;
        let o = inner.ev.engine().output(id)?;
        let Some(lp) = o.prompt_logprobs else {
            return Err(Failure::invalid(format!(
                "request {id} has no prompt logprobs: it did not set `prompt_logprobs`, or its prompt is not \
                 computed yet (they come with its first token)"
            )));
        };
        // SAFETY: `logprobs` holds `cap` elements per the contract.
        unsafe { write_array(&lp, logprobs, cap, n_out, "logprobs") }
    })
}

/// Fills `*out` with the engine's counters as of the last step. Set `out->struct_size` to
/// sizeof(tboost_stats) first; the library fills at most that many bytes and sets
/// `struct_size` to the bytes it filled. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_stats(engine: *const tboost_engine, out: *mut tboost_stats) -> tboost_status {
    guard("tboost_engine_stats", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(out, "out")?;
        // SAFETY: non-null; the first field is the caller's struct_size.
        let size = unsafe { out.cast::<u32>().read_unaligned() } as usize;
        check_size(size, STATS_V1, "out->struct_size")?;
        let s = inner.ev.engine().stats()?;
        let v = tboost_stats {
            struct_size: std::mem::size_of::<tboost_stats>() as u32,
            block_size: s.block_size as u32,
            waiting: s.waiting as u64,
            running: s.running as u64,
            preempted: s.preempted as u64,
            preemptions_total: s.preemptions_total,
            kv_blocks_total: s.kv_blocks_total as u64,
            kv_blocks_used: s.kv_blocks_used as u64,
            kv_blocks_cached: s.kv_blocks_cached as u64,
            prefix_cache_hit_tokens: s.prefix_cache_hit_tokens,
            prompt_tokens: s.prompt_tokens,
            generated_tokens: s.generated_tokens,
            computed_tokens: s.computed_tokens,
            steps: s.steps,
            finished: s.finished,
            cancelled: s.cancelled,
            events_pending: inner.ev.pending() as u64,
            last_step_ms: s.last_step_ms,
            total_step_ms: s.total_step_ms,
        };
        // SAFETY: `size` bytes are writable at `out` per the contract.
        unsafe { write_sized(out.cast::<u8>(), &v, size) };
        Ok(())
    })
}

/// Writes the engine's operator plan as JSON (backend, architecture, disabled ops, and per
/// layer each op chosen with its reason and whether it is a fallback). Buffer rules as in
/// `tboost_last_error`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_plan_json(
    engine: *const tboost_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_engine_plan_json", |ctx| {
        let inner = engine_of(ctx, engine)?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&inner.plan_json, buf, cap, needed) }
    })
}

/// Text (`text_len` bytes of UTF-8, no NUL needed) to token ids with the model's tokenizer;
/// `add_special` adds BOS when the model asks for it. `*n_out` receives the number of ids;
/// `TBOOST_ERR_BUFFER_TOO_SMALL` and nothing written when `cap` is smaller. Returns
/// `TBOOST_ERR_NO_TOKENIZER` when the model has none (pass token ids to enqueue instead).
/// Thread-safe (it may wait for a step in progress).
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_tokenize(
    engine: *const tboost_engine,
    text: *const c_char,
    text_len: usize,
    add_special: bool,
    tokens: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> tboost_status {
    guard("tboost_engine_tokenize", |ctx| {
        let inner = engine_of(ctx, engine)?;
        require(n_out, "n_out")?;
        // SAFETY: `text_len` readable bytes per the contract.
        let bytes = unsafe { read_slice(text.cast::<u8>(), text_len, "text") }?;
        let text =
            std::str::from_utf8(bytes).map_err(|e| Failure::invalid(format!("`text` is not valid UTF-8: {e}")))?;
        let ids: Vec<i32> = inner.ev.engine().tokenize(text, add_special)?.iter().map(|&t| t as i32).collect();
        // SAFETY: `tokens` holds `cap` elements per the contract.
        unsafe { write_array(&ids, tokens, cap, n_out, "tokens") }
    })
}

/// Token ids to text with the model's tokenizer, written NUL-terminated into `buf` (buffer
/// rules as in `tboost_last_error`). Returns `TBOOST_ERR_NO_TOKENIZER` when the model has
/// none, `TBOOST_ERR_INVALID_ARGUMENT` for a negative id. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_detokenize(
    engine: *const tboost_engine,
    tokens: *const i32,
    n_tokens: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_engine_detokenize", |ctx| {
        let inner = engine_of(ctx, engine)?;
        // SAFETY: `n_tokens` readable elements per the contract.
        let ids = token_ids(unsafe { read_slice(tokens, n_tokens, "tokens") }?, "tokens")?;
        let text = inner.ev.engine().detokenize(&ids)?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&text, buf, cap, needed) }
    })
}

/// This engine's place in its tensor-parallel group: `*rank_out` receives its rank and
/// `*world_out` the number of ranks (either may be NULL). Without tensor parallelism it is
/// rank 0 of 1; with `tp` N and `comm` "local" the engine is rank 0 of N (the other ranks are
/// its threads); with `comm` "mpi" under `mpirun`, rank and size of MPI_COMM_WORLD.
///
/// Rank 0 is the leader: it takes the requests, samples and produces the events. A rank
/// other than 0 is a follower: `tboost_engine_enqueue` fails with
/// `TBOOST_ERR_INVALID_ARGUMENT` naming its rank, `tboost_engine_has_work` is true until
/// the group stops, and `tboost_engine_step` runs the leader's steps until then. A
/// follower's whole loop:
///
///   bool work = true;
///   while (work && tboost_engine_step(e, NULL) == TBOOST_OK) tboost_engine_has_work(e, &work);
///   tboost_engine_free(e); tboost_comm_finalize();
///
/// Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_engine_rank(
    engine: *const tboost_engine,
    rank_out: *mut u32,
    world_out: *mut u32,
) -> tboost_status {
    guard("tboost_engine_rank", |ctx| {
        let inner = engine_of(ctx, engine)?;
        // SAFETY: NULL or valid per the contract.
        unsafe {
            write_out(rank_out, inner.rank);
            write_out(world_out, inner.world);
        }
        Ok(())
    })
}

/// Ends MPI in this process when an engine with `comm` "mpi" started it (`MPI_Finalize`); a
/// no-op returning `TBOOST_OK` otherwise. Under `mpirun` every rank calls it once, after
/// freeing its engines and before it exits: `mpirun` counts a rank that exits without
/// ending MPI as failed. No engine with `comm` "mpi" may be made after it.
///
/// When a collective of this process failed (a rank died or hangs), the job cannot end
/// cleanly (the other ranks are dead or still inside a step), so this calls `MPI_Abort`,
/// which ends every rank and `mpirun` with a non-zero status and does not return; without
/// it, `mpirun` would wait for the dead rank. A host that called `MPI_Init` itself before
/// its first engine ends MPI itself and does not call this.
#[no_mangle]
pub extern "C" fn tboost_comm_finalize() -> tboost_status {
    guard("tboost_comm_finalize", |_| {
        ::tboost_engine::comm::mpi::finalize();
        Ok(())
    })
}
