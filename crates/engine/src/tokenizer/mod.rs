//! Tokenizers and chat templates.
//!
//! - GGUF `llama` vocabularies: SentencePiece BPE ([`spm`]), as llama.cpp's `llm_tokenizer_spm`.
//! - GGUF `gpt2` vocabularies: byte-level BPE ([`bpe`]) with the pre-tokenizer named by
//!   `tokenizer.ggml.pre` ([`pretok`]).
//! - GGUF `gemma4` vocabularies: SentencePiece-style BPE on raw UTF-8 ([`bpe_text`]).
//! - GGUF `bert` vocabularies: WordPiece ([`wpm`]).
//! - [`Tokenizer::load`] reads only a file's tokenizer: a vocabulary-only GGUF, any GGUF
//!   whatever its architecture, or a Hugging Face directory; no weights are touched.
//! - Hugging Face `tokenizer.json` through the `tokenizers` crate ([`hf`]).
//! - Streaming detokenization ([`Decoder`]) and chat templates ([`ChatTemplate`]).
//!
//! Behaviour follows llama.cpp (`src/llama-vocab.cpp`): special tokens written in the text are
//! cut out first (longest first), SentencePiece adds a leading space to the text and after each
//! special token, BOS is added when the model says so, and decoding drops the one leading space
//! SentencePiece added. Decoding is the exact concatenation of token bytes; the lossy
//! `clean_up_tokenization_spaces` rewrite is not applied.

pub mod bpe;
mod bpe_text;
mod hf;
pub mod pretok;
pub mod spm;
mod stream;
mod template;
mod vocab;
mod wpm;

use std::path::Path;

use crate::formats::gguf::{Metadata, Value};
use crate::{Error, Result};

pub use pretok::PreTokenizer;
pub use stream::Decoder;
pub use template::{ChatTemplate, Family, Message};
pub use vocab::TokenAttr;

use vocab::{Fragment, Vocab};

/// Which algorithm a [`Tokenizer`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// GGUF `llama`: SentencePiece BPE with scores and byte fallback.
    SentencePiece,
    /// GGUF `gpt2`: byte-level BPE with merges.
    ByteLevelBpe(PreTokenizer),
    /// Hugging Face `tokenizer.json`.
    HuggingFace,
    /// GGUF `gemma4`: SentencePiece-style BPE (`▁` for spaces) on raw UTF-8 with merges.
    SentencePieceBpe,
    /// GGUF `bert`: WordPiece.
    WordPiece,
}

enum Model {
    Spm(Box<spm::Spm>),
    Bpe(Box<bpe::Bpe>),
    TextBpe(Box<bpe_text::TextBpe>),
    Wpm(Box<wpm::Wpm>),
    Hf(Box<hf::HfModel>),
}

/// The algorithm a GGUF `tokenizer.ggml.model` names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GgufKind {
    Spm,
    Bpe,
    TextBpe,
    Wpm,
}

/// A model's tokenizer: text ↔ token ids.
pub struct Tokenizer {
    name: String,
    vocab: Vocab,
    model: Model,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

/// Token texts llama.cpp treats as end-of-turn / end-of-generation when the file does not say.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
];

struct Meta<'a> {
    meta: &'a Metadata,
    source: String,
}

impl<'a> Meta<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.meta.get(key)
    }
    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::config(self.source.clone(), key, msg)
    }
    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(Some).ok_or_else(|| self.err(key, format!("expected a string, got {}", v.type_name())))
            }
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.err(key, format!("expected a bool, got {}", v.type_name())))
            }
        }
    }
    /// A token id key; out-of-range ids are an error naming the key.
    fn id_opt(&self, key: &str, n_vocab: usize) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let id = v.as_u64().ok_or_else(|| self.err(key, format!("expected a token id, got {}", v.type_name())))?;
        if id as usize >= n_vocab {
            return Err(self.err(key, format!("token id {id} is outside the vocabulary (size {n_vocab})")));
        }
        Ok(Some(id as u32))
    }
    fn array(&self, key: &str) -> Result<Option<&'a [Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_array().map(Some).ok_or_else(|| self.err(key, format!("expected an array, got {}", v.type_name())))
            }
        }
    }
}

fn source_name(meta: &Metadata) -> String {
    match meta.get("general.name").and_then(Value::as_str) {
        Some(n) => format!("GGUF model `{n}`"),
        None => "GGUF metadata".to_string(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer stored in GGUF metadata; Ok(None) when the file has none
    /// (`tokenizer.ggml.model` absent or `no_vocab`/`none`).
    pub fn from_gguf(meta: &Metadata) -> Result<Option<Tokenizer>> {
        let m = Meta { meta, source: source_name(meta) };
        let Some(kind) = m.str_opt("tokenizer.ggml.model")? else { return Ok(None) };
        let kind = match kind {
            "no_vocab" | "none" => return Ok(None),
            "llama" => GgufKind::Spm,
            "gpt2" => GgufKind::Bpe,
            "gemma4" => GgufKind::TextBpe,
            "bert" => GgufKind::Wpm,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: tokenizer.ggml.model = `{other}` (supported: llama, gpt2, gemma4, bert)",
                    m.source
                )))
            }
        };
        let spm = kind == GgufKind::Spm;
        // Tokens whose `▁` stands for a space and `<0xXX>` for a byte (decoding).
        let spm_pieces = kind != GgufKind::Bpe;

        let tokens = m.array("tokenizer.ggml.tokens")?.ok_or_else(|| m.err("tokenizer.ggml.tokens", "missing"))?;
        let n = tokens.len();
        if n == 0 {
            return Err(m.err("tokenizer.ggml.tokens", "empty vocabulary"));
        }
        // n is at most limits::MAX_ARRAY_LEN (the GGUF reader caps arrays); reserve fallibly.
        let mut texts = Vec::new();
        let mut seen = std::collections::HashMap::new();
        texts
            .try_reserve_exact(n)
            .map_err(|e| m.err("tokenizer.ggml.tokens", format!("cannot allocate {n} tokens: {e}")))?;
        seen.try_reserve(n).map_err(|e| m.err("tokenizer.ggml.tokens", format!("cannot allocate {n} tokens: {e}")))?;
        for (i, t) in tokens.iter().enumerate() {
            let s = t.as_str().ok_or_else(|| m.err("tokenizer.ggml.tokens", format!("entry {i} is not a string")))?;
            // llama.cpp renames empty tokens so that every text is unique.
            let s = if s.is_empty() { format!("[EMPTY_{i}]") } else { s.to_owned() };
            if let Some(prev) = seen.insert(s.clone(), i) {
                return Err(m.err("tokenizer.ggml.tokens", format!("duplicate token {s:?} at ids {prev} and {i}")));
            }
            texts.push(s);
        }
        let scores: Vec<f32> = match m.array("tokenizer.ggml.scores")? {
            None => vec![0.0; n],
            Some(a) => {
                if a.len() < n {
                    return Err(m.err("tokenizer.ggml.scores", format!("{} scores for {n} tokens", a.len())));
                }
                a.iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_f64()
                            .map(|f| f as f32)
                            .ok_or_else(|| m.err("tokenizer.ggml.scores", format!("entry {i} is not a number")))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let mut attrs: Vec<TokenAttr> = match m.array("tokenizer.ggml.token_type")? {
            None => vec![TokenAttr::Normal; n],
            Some(a) => {
                if a.len() < n {
                    return Err(m.err("tokenizer.ggml.token_type", format!("{} types for {n} tokens", a.len())));
                }
                a.iter()
                    .take(n)
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_i64()
                            .map(TokenAttr::from_gguf)
                            .ok_or_else(|| m.err("tokenizer.ggml.token_type", format!("entry {i} is not an integer")))
                    })
                    .collect::<Result<_>>()?
            }
        };

        // Special ids: llama.cpp's per-model defaults, overridden by the file.
        let default = |id: u32| if (id as usize) < n { Some(id) } else { None };
        let (mut bos, mut eos, mut unk) = match kind {
            GgufKind::Spm => (default(1), default(2), default(0)),
            GgufKind::Bpe => (default(11), default(11), None),
            GgufKind::TextBpe => (None, None, None),
            // BERT: [CLS] opens and [SEP] closes a sequence; [UNK] = 100.
            GgufKind::Wpm => (default(101), default(102), default(100)),
        };
        if kind == GgufKind::Wpm {
            if let Some(id) = m.id_opt("tokenizer.ggml.cls_token_id", n)? {
                bos = Some(id);
            }
            if let Some(id) = m.id_opt("tokenizer.ggml.seperator_token_id", n)? {
                eos = Some(id);
            }
        }
        if let Some(id) = m.id_opt("tokenizer.ggml.bos_token_id", n)? {
            bos = Some(id);
        }
        if let Some(id) = m.id_opt("tokenizer.ggml.eos_token_id", n)? {
            eos = Some(id);
        }
        if let Some(id) = m.id_opt("tokenizer.ggml.unknown_token_id", n)? {
            unk = Some(id);
        }
        let eot = m.id_opt("tokenizer.ggml.eot_token_id", n)?;
        let eom = m.id_opt("tokenizer.ggml.eom_token_id", n)?;

        let pre = if kind == GgufKind::Bpe {
            // A missing pre-tokenizer means llama.cpp's `default`.
            Some(PreTokenizer::from_gguf_name(m.str_opt("tokenizer.ggml.pre")?.unwrap_or("default"))?)
        } else {
            None
        };
        let wpm = kind == GgufKind::Wpm;
        let add_bos =
            m.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(spm || wpm || pre == Some(PreTokenizer::Llama3));
        let add_eos = m.bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(wpm);
        let add_space_prefix = m.bool_opt("tokenizer.ggml.add_space_prefix")?.unwrap_or(spm);
        if add_bos && bos.is_none() {
            return Err(m.err("tokenizer.ggml.add_bos_token", "is true but the model has no BOS token id"));
        }
        if add_eos && eos.is_none() {
            return Err(m.err("tokenizer.ggml.add_eos_token", "is true but the model has no EOS token id"));
        }

        // End of generation: eos, eot, eom and the well-known end-of-turn texts; llama.cpp
        // forces these to be control tokens so they never print as text.
        let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for t in EOG_TEXTS {
            if let Some(&i) = seen.get(*t) {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();
        for &id in &eog {
            if attrs[id as usize] != TokenAttr::Control {
                attrs[id as usize] = TokenAttr::Control;
            }
        }
        drop(seen);

        let piece_of = |text: &str, attr: TokenAttr| -> Vec<u8> {
            match attr {
                TokenAttr::Control | TokenAttr::Unknown | TokenAttr::UserDefined => text.as_bytes().to_vec(),
                TokenAttr::Unused | TokenAttr::Undefined => Vec::new(),
                TokenAttr::Normal => {
                    if spm_pieces {
                        spm::token_text_to_bytes(text, false)
                    } else {
                        bpe::token_text_to_bytes(text)
                    }
                }
                TokenAttr::Byte => {
                    if spm_pieces {
                        spm::token_text_to_bytes(text, true)
                    } else {
                        // llama.cpp prints nothing for byte-typed tokens of a gpt2 vocabulary.
                        Vec::new()
                    }
                }
            }
        };
        let vocab = Vocab::new(texts, attrs, piece_of);

        let merges = || -> Result<Vec<&str>> {
            let merges = m.array("tokenizer.ggml.merges")?.ok_or_else(|| m.err("tokenizer.ggml.merges", "missing"))?;
            merges
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().ok_or_else(|| m.err("tokenizer.ggml.merges", format!("entry {i} is not a string")))
                })
                .collect()
        };
        let model = match (kind, pre) {
            (GgufKind::Bpe, Some(pre)) => Model::Bpe(Box::new(bpe::Bpe::new(&vocab, &merges()?, pre, &m.source)?)),
            (GgufKind::TextBpe, _) => Model::TextBpe(Box::new(bpe_text::TextBpe::new(&vocab, &merges()?, &m.source)?)),
            (GgufKind::Wpm, _) => {
                let lowercase = m.bool_opt("tokenizer.ggml.normalizer.lowercase")?.unwrap_or(true);
                Model::Wpm(Box::new(wpm::Wpm::new(&vocab, unk, lowercase)))
            }
            _ => Model::Spm(Box::new(spm::Spm::new(&vocab, scores, unk))),
        };

        Ok(Some(Tokenizer { name: m.source, vocab, model, bos, eos, eog, unk, add_bos, add_eos, add_space_prefix }))
    }

    /// Loads only the tokenizer of a model file, without its weights: a GGUF file (a
    /// vocabulary-only one, or any model whatever its architecture: only the header and
    /// metadata are read) or a Hugging Face directory (or a `.json` / `.safetensors` file in
    /// it). Errors name the file; a file without a tokenizer is `Error::NoTokenizer`.
    pub fn load(path: &Path) -> Result<Tokenizer> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
        let tok = if meta.is_dir() {
            Tokenizer::from_hf_dir(path)?
        } else if name.ends_with(".json") || name.ends_with(".safetensors") {
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            Tokenizer::from_hf_dir(dir)?
        } else {
            // A FIFO, device or socket is named, not opened (opening could block forever).
            crate::formats::files::open_regular(path)?;
            let md = crate::formats::gguf::read_metadata(path)?;
            // Name the file: metadata errors only know the model's `general.name`.
            Tokenizer::from_gguf(&md).map_err(|e| match e {
                Error::Unsupported(msg) => Error::Unsupported(format!("{}: {msg}", path.display())),
                Error::Config { source_name, param, msg } => {
                    Error::Config { source_name: format!("{} ({source_name})", path.display()), param, msg }
                }
                other => other,
            })?
        };
        tok.ok_or_else(|| Error::NoTokenizer(path.display().to_string()))
    }

    /// Loads a Hugging Face tokenizer from `dir/tokenizer.json` (with `tokenizer_config.json`
    /// and `generation_config.json` when present); Ok(None) when there is no tokenizer.json.
    pub fn from_hf_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let Some(l) = hf::load(dir)? else { return Ok(None) };
        let decoding = l.decoding;
        let vocab = Vocab::new(l.texts, l.attrs, |t, a| hf::piece_bytes(decoding, t, a));
        // EOS: tokenizer_config's eos_token, else the first id generation_config lists.
        let eos = l.eos_tokens.iter().find_map(|t| vocab.id_of(t)).or(l.eos_ids.first().copied());
        let mut eog = l.eos_ids;
        eog.extend(eos);
        for t in EOG_TEXTS {
            eog.extend(vocab.id_of(t).filter(|&id| vocab.attr(id) == Some(TokenAttr::Control)));
        }
        let n = vocab.len();
        eog.retain(|&id| (id as usize) < n);
        eog.sort_unstable();
        eog.dedup();
        let unk = l.unk_token.as_deref().and_then(|t| vocab.id_of(t));
        Ok(Some(Tokenizer {
            name: format!("Hugging Face tokenizer in {}", dir.display()),
            vocab,
            model: Model::Hf(Box::new(l.model)),
            bos: l.bos_id,
            eos,
            eog,
            unk,
            add_bos: l.add_bos,
            add_eos: false,
            add_space_prefix: matches!(decoding, hf::HfDecoding::Metaspace { strip_prefix_space: true }),
        }))
    }

    /// Text → ids. Special tokens written in the text (`<|im_start|>`, `<s>`) become single
    /// tokens. `add_special`: add BOS (and EOS) when the model asks for it
    /// (`tokenizer.ggml.add_bos_token`; default true for SentencePiece, false for gpt2 except
    /// llama3). For Hugging Face tokenizers it is the `add_special_tokens` flag.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// As [`Tokenizer::encode`]; with `parse_special` false, control tokens in the text are
    /// tokenized as plain text (user-defined tokens are still matched, as in llama.cpp).
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        if let Model::Hf(h) = &self.model {
            return h.encode(text, add_special, parse_special);
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            // Checked at load: add_bos implies a BOS id.
            out.extend(self.bos);
        }
        let frags = vocab::partition(&self.vocab, text, parse_special);
        match &self.model {
            Model::Spm(s) => {
                // SentencePiece: a space before the text and after every special token.
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Fragment::Text(t) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push(' ');
                            }
                            buf.push_str(t);
                            s.encode(&self.vocab, &buf, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe(b) => {
                for f in frags {
                    match f {
                        Fragment::Text(t) => b.encode(&self.vocab, t, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::TextBpe(b) => {
                for f in frags {
                    match f {
                        Fragment::Text(t) => b.encode(&self.vocab, t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::Wpm(w) => {
                for f in frags {
                    match f {
                        Fragment::Text(t) => w.encode(&self.vocab, t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::Hf(_) => unreachable!("handled above"),
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// Ids → text (control tokens omitted), as llama.cpp's detokenize: the first token loses
    /// the one leading space SentencePiece added. Bytes that do not form valid UTF-8 (a
    /// sequence cut short) become U+FFFD. Errors name an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids, false)?).into_owned())
    }

    /// As [`Tokenizer::decode`] but control tokens are written as their text.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids, true)?).into_owned())
    }

    /// The exact bytes of [`Tokenizer::decode`] (no UTF-8 repair).
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        let mut strip = self.add_space_prefix;
        for &id in ids {
            let p = self.piece(id, special)?;
            out.extend_from_slice(if strip { p.strip_prefix(b" ").unwrap_or(p) } else { p });
            strip = false;
        }
        Ok(out)
    }

    /// The bytes `id` contributes to decoded text (control tokens: their text; unused: empty).
    /// None when `id` is outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.vocab.piece(id)
    }

    /// The token's text as stored in the vocabulary (`▁Once`, `Ġthe`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.text(id)
    }

    pub fn token_attr(&self, id: u32) -> Option<TokenAttr> {
        self.vocab.attr(id)
    }

    /// The id whose stored text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id_of(text)
    }

    pub(crate) fn piece(&self, id: u32, special: bool) -> Result<&[u8]> {
        let attr = self.vocab.attr(id).ok_or_else(|| {
            Error::invalid(
                "token id",
                format!("{id} is outside the vocabulary of {} (size {})", self.name, self.vocab.len()),
            )
        })?;
        if !special && attr.is_special() {
            return Ok(&[]);
        }
        Ok(self.vocab.piece(id).unwrap_or_default())
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The model's EOS token (`tokenizer.ggml.eos_token_id`).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every id that ends generation: EOS, end-of-turn (`tokenizer.ggml.eot_token_id`, or by
    /// text: `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`...) and end-of-message. Sorted.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// SentencePiece's leading space (added on encode, removed from the first token on decode).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    pub fn kind(&self) -> TokenizerKind {
        match &self.model {
            Model::Spm(_) => TokenizerKind::SentencePiece,
            Model::Bpe(b) => TokenizerKind::ByteLevelBpe(b.pre()),
            Model::TextBpe(_) => TokenizerKind::SentencePieceBpe,
            Model::Wpm(_) => TokenizerKind::WordPiece,
            Model::Hf(_) => TokenizerKind::HuggingFace,
        }
    }

    /// Names the model the tokenizer came from (for messages).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab.len())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eog)
            .finish()
    }
}
