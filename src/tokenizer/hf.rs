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

fn read_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s).map(Some).map_err(|e| Error::format(path, format!("invalid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
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
        let enc = tok
            .encode(text, add_special)
            .map_err(|e| Error::invalid("text", format!("{}: encoding failed: {e}", self.path)))?;
        Ok(enc.get_ids().to_vec())
    }
}

/// Loads `dir/tokenizer.json`; Ok(None) when the directory has none.
pub(crate) fn load(dir: &Path) -> Result<Option<HfLoaded>> {
    let path = dir.join("tokenizer.json");
    let Some(json) = read_json(&path)? else { return Ok(None) };
    let tokenizer = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::format(&path, e.to_string()))?;

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

    let n = tokenizer.get_vocab_size(true);
    let added = tokenizer.get_added_tokens_decoder();
    let unk_token = json.get("model").and_then(|m| m.get("unk_token")).and_then(Json::as_str).map(str::to_owned);
    let mut texts = Vec::with_capacity(n);
    let mut attrs = Vec::with_capacity(n);
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

    // generation_config.json (or config.json) may list several end-of-generation ids.
    let mut eos_ids = Vec::new();
    for name in ["generation_config.json", "config.json"] {
        if let Some(g) = read_json(&dir.join(name))? {
            match g.get("eos_token_id") {
                Some(Json::Number(n)) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
                Some(Json::Array(a)) => eos_ids.extend(a.iter().filter_map(Json::as_u64).map(|v| v as u32)),
                _ => {}
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
