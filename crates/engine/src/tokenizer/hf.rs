//! Hugging Face `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`).
//!
//! Encoding runs through the `tokenizers` crate (normalizers, pre-tokenizers, post-processor
//! exactly as in Python). Decoding uses per-token bytes derived from the file's decoder, so the
//! streaming decoder and `decode` share one definition: byte-level decoders map chars back to
//! bytes; SentencePiece-style decoders (`Metaspace`, `Replace ▁`, `ByteFallback`) turn `▁` into a
//! space and `<0xXX>` into the byte.

use std::path::Path;
use std::sync::OnceLock;

use serde_json::Value as Json;

use super::vocab::TokenAttr;
use super::{bpe, spm};
use crate::formats::{files, limits};
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HfDecoding {
    ByteLevel,
    /// SentencePiece-like; `strip_prefix_space`: the decoder drops the leading space that the
    /// normalizer/pre-tokenizer added.
    Metaspace {
        strip_prefix_space: bool,
    },
}

pub(crate) struct HfModel {
    pub tokenizer: tokenizers::Tokenizer,
    /// The same tokenizer with special-token parsing disabled, built on first use.
    literal: OnceLock<tokenizers::Tokenizer>,
    path: String,
}

/// Everything `Tokenizer::from_hf_dir` needs, read from the directory.
pub(crate) struct HfLoaded {
    pub model: HfModel,
    pub texts: Vec<String>,
    pub attrs: Vec<TokenAttr>,
    pub decoding: HfDecoding,
    pub eos_tokens: Vec<String>,
    pub eos_ids: Vec<u32>,
    pub bos_id: Option<u32>,
    pub unk_token: Option<String>,
    pub add_bos: bool,
}

/// A JSON file beside the model, read through `files` (regular files only, size-capped);
/// None when it does not exist. Returns the text too (the `tokenizers` crate parses it again).
fn read_json_text(path: &Path, max_bytes: u64) -> Result<Option<(String, Json)>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let Some(text) = files::read_text_opt(path, max_bytes, &name)? else { return Ok(None) };
    let json = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))?;
    Ok(Some((text, json)))
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    Ok(read_json_text(path, limits::MAX_SMALL_FILE_BYTES)?.map(|(_, j)| j))
}

/// Builds the `tokenizers` crate's tokenizer from the file's text. The crate is third-party
/// code fed untrusted input: a panic inside it becomes an error naming the file, so a load
/// returns Err instead of unwinding into the caller.
fn parse_tokenizer(text: &str, path: &Path) -> Result<tokenizers::Tokenizer> {
    let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| text.parse::<tokenizers::Tokenizer>()));
    match parsed {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(Error::format(path, e.to_string())),
        Err(p) => Err(Error::format(path, format!("the tokenizers library failed on this file: {}", panic_text(&*p)))),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// A special-token entry of tokenizer_config.json: a string or `{"content": ...}`.
pub(crate) fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Reads `tokenizer_config.json` (None when absent).
pub(crate) fn read_tokenizer_config(dir: &Path) -> Result<Option<Json>> {
    read_json(&dir.join("tokenizer_config.json"))
}

fn decoding_of(decoder: &Json) -> Option<HfDecoding> {
    let ty = decoder.get("type").and_then(Json::as_str)?;
    match ty {
        "ByteLevel" => Some(HfDecoding::ByteLevel),
        "Metaspace" => {
            let scheme = decoder.get("prepend_scheme").and_then(Json::as_str).unwrap_or("always");
            let legacy = decoder.get("add_prefix_space").and_then(Json::as_bool);
            Some(HfDecoding::Metaspace { strip_prefix_space: legacy.unwrap_or(scheme != "never") })
        }
        "Sequence" => {
            let parts = decoder.get("decoders").and_then(Json::as_array)?;
            if let Some(d) = parts.iter().find_map(|d| match decoding_of(d) {
                Some(HfDecoding::ByteLevel) => Some(HfDecoding::ByteLevel),
                _ => None,
            }) {
                return Some(d);
            }
            let types: Vec<&str> = parts.iter().filter_map(|d| d.get("type").and_then(Json::as_str)).collect();
            let replaces_space = parts.iter().any(|d| {
                d.get("type").and_then(Json::as_str) == Some("Replace")
                    && d.get("pattern").and_then(|p| p.get("String")).and_then(Json::as_str) == Some("\u{2581}")
            });
            if replaces_space || types.contains(&"Metaspace") || types.contains(&"ByteFallback") {
                let strip = types.contains(&"Strip")
                    || parts
                        .iter()
                        .any(|d| matches!(decoding_of(d), Some(HfDecoding::Metaspace { strip_prefix_space: true })));
                Some(HfDecoding::Metaspace { strip_prefix_space: strip })
            } else {
                None
            }
        }
        _ => None,
    }
}

impl HfModel {
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.tokenizer
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        // The crate can panic on a tokenizer.json it accepted (a post-processor naming a
        // special token it does not define): an error, never an unwind into the caller.
        let enc = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tok.encode(text, add_special)))
            .map_err(|p| {
                Error::invalid(
                    "text",
                    format!("{}: encoding failed inside the tokenizers library: {}", self.path, panic_text(&*p)),
                )
            })?
            .map_err(|e| Error::invalid("text", format!("{}: encoding failed: {e}", self.path)))?;
        Ok(enc.get_ids().to_vec())
    }
}

/// Loads `dir/tokenizer.json`; Ok(None) when the directory has none.
pub(crate) fn load(dir: &Path) -> Result<Option<HfLoaded>> {
    let path = dir.join("tokenizer.json");
    let Some((text, json)) = read_json_text(&path, limits::MAX_TOKENIZER_JSON_BYTES)? else { return Ok(None) };
    let tokenizer = parse_tokenizer(&text, &path)?;
    drop(text);
    // The crate checks little of a file's pipeline when it parses it: run it once on a
    // short text, with and without special tokens, so a broken normalizer, pre-tokenizer or
    // post-processor is a load error naming the file rather than a failure of every request.
    let probe = HfModel { tokenizer, literal: OnceLock::new(), path: path.display().to_string() };
    for add_special in [false, true] {
        probe.encode("Hi 1", add_special, true).map_err(|e| {
            Error::format(&path, format!("the tokenizer fails on a test text (add_special_tokens={add_special}): {e}"))
        })?;
    }
    let tokenizer = probe.tokenizer;

    let decoder = json.get("decoder").filter(|d| !d.is_null());
    let decoding = match decoder {
        Some(d) => decoding_of(d).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: decoder {} (supported: ByteLevel, Metaspace, or a Sequence with Replace ▁/ByteFallback)",
                path.display(),
                d.get("type").and_then(Json::as_str).unwrap_or("?")
            ))
        })?,
        None => return Err(Error::format(&path, "no `decoder`: cannot tell how token ids map back to text")),
    };

    // The id space: every id up to the largest one the file defines (ids need not be
    // contiguous), capped before anything proportional to it is allocated.
    let max_id = tokenizer.get_vocab(true).into_values().max().map_or(0, |m| m as u64 + 1);
    let n = (tokenizer.get_vocab_size(true) as u64).max(max_id);
    limits::check_cap(
        &path.display().to_string(),
        "vocabulary size (largest token id + 1)",
        n,
        limits::MAX_VOCAB as u64,
    )?;
    let n = n as usize;
    let added = tokenizer.get_added_tokens_decoder();
    let unk_token = json.get("model").and_then(|m| m.get("unk_token")).and_then(Json::as_str).map(str::to_owned);
    let mut texts = Vec::new();
    let mut attrs = Vec::new();
    let oom = |e: std::collections::TryReserveError| {
        Error::format(&path, format!("cannot allocate the vocabulary of {n} tokens: {e}"))
    };
    texts.try_reserve_exact(n).map_err(oom)?;
    attrs.try_reserve_exact(n).map_err(oom)?;
    for id in 0..n as u32 {
        let (text, attr) = if let Some(a) = added.get(&id) {
            (a.content.clone(), if a.special { TokenAttr::Control } else { TokenAttr::UserDefined })
        } else if let Some(t) = tokenizer.id_to_token(id) {
            let attr = if unk_token.as_deref() == Some(t.as_str()) {
                TokenAttr::Unknown
            } else if matches!(decoding, HfDecoding::Metaspace { .. }) && spm::parse_byte_token(&t).is_some() {
                TokenAttr::Byte
            } else {
                TokenAttr::Normal
            };
            (t, attr)
        } else {
            // A hole in the id space (ids are not contiguous): never produced, decodes to nothing.
            (String::new(), TokenAttr::Unused)
        };
        texts.push(text);
        attrs.push(attr);
    }

    let config = read_tokenizer_config(dir)?;
    let cfg = |k: &str| config.as_ref().and_then(|c| c.get(k));
    let bos_token = token_string(cfg("bos_token"));
    let mut eos_tokens: Vec<String> = token_string(cfg("eos_token")).into_iter().collect();
    let add_bos = cfg("add_bos_token").and_then(Json::as_bool).unwrap_or(false);

    // generation_config.json (or config.json) may list several end-of-generation ids. Each
    // must be a token of this vocabulary: a stop token the model can never produce is a
    // broken file, not something to drop silently.
    let mut eos_ids = Vec::new();
    for name in ["generation_config.json", "config.json"] {
        let file = dir.join(name);
        if let Some(g) = read_json(&file)? {
            let listed: Vec<&Json> = match g.get("eos_token_id") {
                Some(Json::Array(a)) => a.iter().collect(),
                None | Some(Json::Null) => Vec::new(),
                Some(v) => vec![v],
            };
            for v in listed {
                match v.as_u64() {
                    Some(id) if id < n as u64 => eos_ids.push(id as u32),
                    _ => {
                        return Err(Error::config(
                            file.display().to_string(),
                            "eos_token_id",
                            format!("{v} is not a token id below the vocabulary size {n} of {}", path.display()),
                        ))
                    }
                }
            }
            if !eos_ids.is_empty() {
                break;
            }
        }
    }
    let bos_id = bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
    eos_tokens.dedup();

    Ok(Some(HfLoaded {
        model: HfModel { tokenizer, literal: OnceLock::new(), path: path.display().to_string() },
        texts,
        attrs,
        decoding,
        eos_tokens,
        eos_ids,
        bos_id,
        unk_token,
        add_bos,
    }))
}

/// Decoded bytes of an HF token.
pub(crate) fn piece_bytes(decoding: HfDecoding, text: &str, attr: TokenAttr) -> Vec<u8> {
    match attr {
        TokenAttr::Control | TokenAttr::UserDefined | TokenAttr::Unknown => text.as_bytes().to_vec(),
        TokenAttr::Unused | TokenAttr::Undefined => Vec::new(),
        TokenAttr::Normal | TokenAttr::Byte => match decoding {
            HfDecoding::ByteLevel => bpe::token_text_to_bytes(text),
            HfDecoding::Metaspace { .. } => spm::token_text_to_bytes(text, attr == TokenAttr::Byte),
        },
    }
}
