//! `tboost_model`: a loaded model (config + memory-mapped weights) and its description.

use std::os::raw::{c_char, c_void};
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::config::settings_of;
use super::guard::guard;
use super::handle::Registry;
use super::log_bridge::ensure_logger;
use super::status::{tboost_status, Failure, FfiResult, Status};
use super::types::{tboost_config, tboost_model, tboost_progress_fn};
use super::util::{read_cstr, require, write_array, write_out, write_str};
use ::tboost_engine::engine::{model_info, EngineConfig};
use ::tboost_engine::model::Model;
use ::tboost_engine::tokenizer::ChatTemplate;

pub(crate) struct ModelInner {
    pub model: Model,
    /// The config the load was given: `tboost_model_info_json` plans with it.
    config: EngineConfig,
    /// `tboost_model_info_json`'s answer, built at its first successful call.
    info: Mutex<Option<Arc<String>>>,
}

impl ModelInner {
    fn info(&self) -> FfiResult<Arc<String>> {
        let mut info = self.info.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = info.as_ref() {
            return Ok(s.clone());
        }
        let path = self.model.path.display().to_string();
        let json = model_info(&self.model, &self.config).map_err(|e| named(&path, e.into()))?;
        let s = Arc::new(json.to_string());
        *info = Some(s.clone());
        Ok(s)
    }
}

pub(crate) static MODELS: Registry<ModelInner> = Registry::new("model");

/// `f` with a message that names `path` (loader errors usually do already).
fn named(path: &str, f: Failure) -> Failure {
    if f.msg.contains(path) {
        f
    } else {
        Failure::new(f.status, format!("{path}: {}", f.msg))
    }
}

/// Loads a model: a Hugging Face directory (config.json + safetensors), a file inside one,
/// or a GGUF file. `cfg` (may be NULL: the defaults) supplies `backend`, `threads`,
/// `kv_dtype`, `precision`, `block_size`, `disabled_ops` and the tiling keys for the operator
/// plan reported by `tboost_model_info_json`. No backend is opened here: on a device backend
/// the load touches no device.
///
/// `progress` (may be NULL) is called on this thread with increasing values ending at 1
/// while the weights are read in; returning false aborts with `TBOOST_ERR_CANCELLED`.
///
/// Returns `TBOOST_ERR_IO` for a missing or unreadable file, `TBOOST_ERR_MODEL_FORMAT` for a
/// truncated, corrupt or inconsistent one, `TBOOST_ERR_UNSUPPORTED` for an architecture or
/// dtype this build cannot run; the last error names the file. On success `*out` is a new
/// handle to free with `tboost_model_free`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_model_load(
    path: *const c_char,
    cfg: *const tboost_config,
    progress: tboost_progress_fn,
    user_data: *mut c_void,
    out: *mut *mut tboost_model,
) -> tboost_status {
    guard("tboost_model_load", |_| {
        require(out, "out")?;
        // SAFETY: NULL or NUL-terminated per the contract.
        let path = unsafe { read_cstr(path, "path") }?;
        let s = settings_of(cfg)?;
        ensure_logger();
        let report = |p: f32| -> FfiResult {
            if let Some(cb) = progress {
                // SAFETY: the host's callback with the host's user_data.
                if !unsafe { cb(p, user_data) } {
                    return Err(Failure::new(
                        Status::TBOOST_ERR_CANCELLED,
                        format!("loading {path} was cancelled by the progress callback at {:.0}%", p * 100.0),
                    ));
                }
            }
            Ok(())
        };
        report(0.0)?;
        let model = Model::load(Path::new(path)).map_err(|e| named(path, e.into()))?;
        // Reading the weights once is the slow part of a load: report it per 8 MiB, and let
        // the host stop it.
        let mut stopped = None;
        let complete = model.weights.touch(&mut |done, total| {
            let p = 0.05 + 0.85 * done as f32 / total.max(1) as f32;
            match report(p) {
                Ok(()) => true,
                Err(f) => {
                    stopped = Some(f);
                    false
                }
            }
        });
        if let (false, Some(f)) = (complete, stopped) {
            return Err(f);
        }
        report(1.0)?;
        let h = MODELS.insert(Arc::new(ModelInner { model, config: s.engine, info: Mutex::new(None) }));
        // SAFETY: `out` is non-null and valid per the contract.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees a model. Engines made from it keep working. NULL is a no-op; a freed or unknown
/// handle is `TBOOST_ERR_INVALID_HANDLE`. Must not race with other calls on this handle.
#[no_mangle]
pub extern "C" fn tboost_model_free(model: *mut tboost_model) -> tboost_status {
    guard("tboost_model_free", |_| {
        if !model.is_null() {
            MODELS.remove(model, "model")?;
        }
        Ok(())
    })
}

/// Writes a JSON object describing the model into `buf`: path, format, architecture,
/// weights_dtype, vocab_size, context_length, hidden_size, intermediate_size, num_layers,
/// num_heads, num_kv_heads, head_dim, num_experts, experts_per_token, bos_token_id (or
/// null), eos_token_ids, and plan (per layer, each op chosen and why). Buffer rules as in
/// `tboost_last_error`. Thread-safe.
///
/// The plan is the one an engine made with the load's config would run. It is built at the
/// first call (not at load, so that loading opens no backend and, on a device backend, no
/// device), which opens the config's backend once; later calls return the same text. So the
/// plan's errors come from here: an unsupported option (a tiling key on Ascend) or a backend
/// that cannot start is `TBOOST_ERR_UNSUPPORTED` / `TBOOST_ERR_BACKEND` from this call (and
/// from `tboost_engine_new`), naming the file.
#[no_mangle]
pub unsafe extern "C" fn tboost_model_info_json(
    model: *const tboost_model,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_model_info_json", |_| {
        let m = MODELS.get(model, "model")?;
        let info = m.info()?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&info, buf, cap, needed) }
    })
}

/// Renders chat messages with the model's chat template into the prompt text (NUL-terminated
/// UTF-8 in `buf`; buffer rules as in `tboost_last_error`). Tokenize the text with
/// `tboost_engine_tokenize` and `add_special` false: the template writes BOS itself.
///
/// `messages_json` (NUL-terminated UTF-8) is an array of messages, e.g.
/// `[{"role":"system","content":"..."},{"role":"user","content":"..."}]`, or an object
/// with `messages` and other variables the template reads, e.g. `tools` (a list of
/// function schemas), as in an OpenAI chat request. Message fields other than `role`
/// (`content`, `tool_calls`, `name`...) reach the template as given. `add_generation_prompt`
/// appends the opening of the assistant's turn.
///
/// A model file without a template uses its family's conventional one (ChatML for Qwen,
/// Gemma's turns, Phi-3's tags, Llama 3 headers or Llama 2 / Mistral `[INST]`), logged at
/// load. Returns `TBOOST_ERR_UNSUPPORTED` when the model has no template and no tokenizer,
/// `TBOOST_ERR_INVALID_ARGUMENT` for JSON that does not parse (line and column named), a
/// message without a string `role`, or a template that fails on these messages (its
/// `raise_exception` message and the template line named). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_model_chat_apply(
    model: *const tboost_model,
    messages_json: *const c_char,
    add_generation_prompt: bool,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_model_chat_apply", |_| {
        let m = MODELS.get(model, "model")?;
        // SAFETY: NUL-terminated per the contract.
        let prompt = unsafe { render_chat(&m.model, messages_json, add_generation_prompt) }?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&prompt, buf, cap, needed) }
    })
}

/// `tboost_model_chat_apply`, then the text to token ids with the model's tokenizer (no BOS added:
/// the template writes it), ready for `tboost_engine_enqueue`. `*n_out` receives the number of
/// ids; `TBOOST_ERR_BUFFER_TOO_SMALL` and nothing written when `cap` is smaller (ask with `cap` 0).
/// Errors as `tboost_model_chat_apply`, and `TBOOST_ERR_NO_TOKENIZER` for a model without a
/// tokenizer. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_model_chat_tokens(
    model: *const tboost_model,
    messages_json: *const c_char,
    add_generation_prompt: bool,
    tokens: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> tboost_status {
    guard("tboost_model_chat_tokens", |_| {
        let m = MODELS.get(model, "model")?;
        require(n_out, "n_out")?;
        // SAFETY: NUL-terminated per the contract.
        let prompt = unsafe { render_chat(&m.model, messages_json, add_generation_prompt) }?;
        let tk = m
            .model
            .tokenizer
            .as_ref()
            .ok_or_else(|| ::tboost_engine::Error::NoTokenizer(m.model.path.display().to_string()))?;
        let ids: Vec<i32> = tk.encode(&prompt, false)?.iter().map(|&t| t as i32).collect();
        // SAFETY: `tokens` holds `cap` elements per the contract.
        unsafe { write_array(&ids, tokens, cap, n_out, "tokens") }
    })
}

/// The prompt text of chat messages (`tboost_model_chat_apply`'s rules).
///
/// # Safety
/// `messages_json` is NULL or a NUL-terminated string.
unsafe fn render_chat(
    model: &Model,
    messages_json: *const c_char,
    add_generation_prompt: bool,
) -> Result<String, Failure> {
    // SAFETY: as the caller promised.
    let text = unsafe { read_cstr(messages_json, "messages_json") }?;
    let request: serde_json::Value =
        serde_json::from_str(text).map_err(|e| Failure::invalid(format!("`messages_json` is not valid JSON: {e}")))?;
    let path = model.path.display().to_string();
    let tmpl = model.chat_template.as_ref().ok_or_else(|| {
        Failure::new(
            Status::TBOOST_ERR_UNSUPPORTED,
            format!("{path}: the model has no chat template (no `tokenizer.chat_template` / `chat_template`)"),
        )
    })?;
    Ok(tmpl.render_json(&request, add_generation_prompt, "messages_json")?)
}

/// Writes the model's chat stop strings as a JSON array of strings into `buf` (buffer rules
/// as in `tboost_last_error`): the texts of its end-of-generation tokens, e.g.
/// `["<|im_end|>","<|endoftext|>"]`. The engine already stops on these tokens; a host that
/// matches text (or runs another engine) uses the strings. `[]` for a model without a
/// tokenizer. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_model_chat_stops(
    model: *const tboost_model,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_model_chat_stops", |_| {
        let m = MODELS.get(model, "model")?;
        let stops = m.model.tokenizer.as_deref().map(ChatTemplate::stop_strings).unwrap_or_default();
        let json = serde_json::Value::from(stops).to_string();
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&json, buf, cap, needed) }
    })
}
