//! `tboost_tokenizer`: a model file's tokenizer on its own, without weights (a vocabulary-only
//! GGUF, any GGUF whatever its architecture, or a Hugging Face directory).

use std::os::raw::c_char;
use std::path::Path;
use std::sync::Arc;

use super::guard::guard;
use super::handle::Registry;
use super::log_bridge::ensure_logger;
use super::status::{tboost_status, Failure};
use super::types::tboost_tokenizer;
use super::util::{read_cstr, read_slice, require, token_ids, write_array, write_out, write_str};
use ::tboost_engine::tokenizer::Tokenizer;

static TOKENIZERS: Registry<Tokenizer> = Registry::new("tokenizer");

/// Loads only the tokenizer of the model at `path` (a GGUF file, or a Hugging Face directory
/// or a `.json` / `.safetensors` file in one); no weight is read, so a vocabulary-only GGUF
/// file works. Returns `TBOOST_ERR_IO` for a missing file, `TBOOST_ERR_MODEL_FORMAT` for a
/// corrupt one, `TBOOST_ERR_UNSUPPORTED` for a tokenizer kind or pre-tokenizer this build
/// lacks, `TBOOST_ERR_NO_TOKENIZER` when the file has none; the last error names the file.
/// On success `*out` is a new handle to free with `tboost_tokenizer_free`. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_tokenizer_load(path: *const c_char, out: *mut *mut tboost_tokenizer) -> tboost_status {
    guard("tboost_tokenizer_load", |_| {
        require(out, "out")?;
        // SAFETY: NULL or NUL-terminated per the contract.
        let path = unsafe { read_cstr(path, "path") }?;
        ensure_logger();
        let tok = Tokenizer::load(Path::new(path))?;
        let h = TOKENIZERS.insert(Arc::new(tok));
        // SAFETY: `out` is non-null and valid per the contract.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees a tokenizer. NULL is a no-op; a freed or unknown handle is
/// `TBOOST_ERR_INVALID_HANDLE`. Must not race with other calls on this handle.
#[no_mangle]
pub extern "C" fn tboost_tokenizer_free(tokenizer: *mut tboost_tokenizer) -> tboost_status {
    guard("tboost_tokenizer_free", |_| {
        if !tokenizer.is_null() {
            TOKENIZERS.remove(tokenizer, "tokenizer")?;
        }
        Ok(())
    })
}

/// Text (`text_len` bytes of UTF-8, no NUL needed) to token ids. `add_special` adds BOS (and
/// EOS) when the vocabulary asks for it; `parse_special` makes control tokens written in the
/// text (`<|im_start|>`) single tokens, otherwise they are tokenized as plain text (llama.cpp's
/// `parse_special`). `*n_out` receives the number of ids; `TBOOST_ERR_BUFFER_TOO_SMALL` and
/// nothing written when `cap` is smaller. Thread-safe.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tboost_tokenizer_tokenize(
    tokenizer: *const tboost_tokenizer,
    text: *const c_char,
    text_len: usize,
    add_special: bool,
    parse_special: bool,
    tokens: *mut i32,
    cap: usize,
    n_out: *mut usize,
) -> tboost_status {
    guard("tboost_tokenizer_tokenize", |_| {
        let tok = TOKENIZERS.get(tokenizer, "tokenizer")?;
        require(n_out, "n_out")?;
        // SAFETY: `text_len` readable bytes per the contract.
        let bytes = unsafe { read_slice(text.cast::<u8>(), text_len, "text") }?;
        let text =
            std::str::from_utf8(bytes).map_err(|e| Failure::invalid(format!("`text` is not valid UTF-8: {e}")))?;
        let ids: Vec<i32> = tok.encode_with(text, add_special, parse_special)?.iter().map(|&t| t as i32).collect();
        // SAFETY: `tokens` holds `cap` elements per the contract.
        unsafe { write_array(&ids, tokens, cap, n_out, "tokens") }
    })
}

/// Token ids to text, written NUL-terminated into `buf` (buffer rules as in
/// `tboost_last_error`); control tokens are left out. `TBOOST_ERR_INVALID_ARGUMENT` for a
/// negative id or one outside the vocabulary. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn tboost_tokenizer_detokenize(
    tokenizer: *const tboost_tokenizer,
    tokens: *const i32,
    n_tokens: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_tokenizer_detokenize", |_| {
        let tok = TOKENIZERS.get(tokenizer, "tokenizer")?;
        // SAFETY: `n_tokens` readable elements per the contract.
        let ids = token_ids(unsafe { read_slice(tokens, n_tokens, "tokens") }?, "tokens")?;
        let text = tok.decode(&ids)?;
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&text, buf, cap, needed) }
    })
}
