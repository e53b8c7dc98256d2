//! The vocabulary shared by every tokenizer kind: token texts, attributes, and the bytes each
//! token decodes to.

use std::collections::HashMap;

/// What kind of token an id is (GGUF `tokenizer.ggml.token_type`, llama.cpp's attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenAttr {
    /// Ordinary text piece.
    Normal,
    /// The unknown token (`<unk>`): decodes to nothing unless special tokens are rendered.
    Unknown,
    /// Control token (`<s>`, `<|im_start|>`...): parsed from text with `parse_special`,
    /// decodes to nothing unless special tokens are rendered.
    Control,
    /// Added token that is plain text (always parsed from text, always decoded).
    UserDefined,
    /// Reserved, never produced by the tokenizer, decodes to nothing.
    Unused,
    /// SentencePiece byte-fallback token `<0xXX>`.
    Byte,
    /// Unknown type code in the file: treated like `Unused`.
    Undefined,
}

impl TokenAttr {
    /// GGUF token type codes (llama.cpp `llama_token_type`).
    pub fn from_gguf(code: i64) -> TokenAttr {
        match code {
            1 => TokenAttr::Normal,
            2 => TokenAttr::Unknown,
            3 => TokenAttr::Control,
            4 => TokenAttr::UserDefined,
            5 => TokenAttr::Unused,
            6 => TokenAttr::Byte,
            _ => TokenAttr::Undefined,
        }
    }

    /// Control and unknown tokens: hidden from decoded text unless asked for.
    pub fn is_special(self) -> bool {
        matches!(self, TokenAttr::Control | TokenAttr::Unknown)
    }
}

pub(crate) struct Vocab {
    texts: Vec<String>,
    attrs: Vec<TokenAttr>,
    to_id: HashMap<String, u32>,
    /// Decoded bytes of every token, concatenated; token i is `pieces[offsets[i]..offsets[i+1]]`.
    pieces: Vec<u8>,
    offsets: Vec<usize>,
    /// Tokens matched literally in input text before tokenization (control, user-defined,
    /// unknown), longest text first, as llama.cpp's `cache_special_tokens`.
    specials: Vec<u32>,
}

impl Vocab {
    /// `piece_of` gives the decoded bytes of a token from its text and attribute.
    /// Duplicate texts keep the first id (a GGUF with duplicates is rejected by the caller).
    pub fn new(texts: Vec<String>, attrs: Vec<TokenAttr>, piece_of: impl Fn(&str, TokenAttr) -> Vec<u8>) -> Vocab {
        debug_assert_eq!(texts.len(), attrs.len());
        let mut to_id = HashMap::with_capacity(texts.len());
        for (i, t) in texts.iter().enumerate() {
            to_id.entry(t.clone()).or_insert(i as u32);
        }
        let mut pieces = Vec::new();
        let mut offsets = Vec::with_capacity(texts.len() + 1);
        offsets.push(0);
        for (t, a) in texts.iter().zip(&attrs) {
            pieces.extend_from_slice(&piece_of(t, *a));
            offsets.push(pieces.len());
        }
        let mut v = Vocab { texts, attrs, to_id, pieces, offsets, specials: Vec::new() };
        v.refresh_specials();
        v
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.to_id.get(text).copied()
    }

    pub fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    pub fn attr(&self, id: u32) -> Option<TokenAttr> {
        self.attrs.get(id as usize).copied()
    }

    /// Decoded bytes of `id` (special tokens: their text; unused: empty).
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if i >= self.texts.len() {
            return None;
        }
        Some(&self.pieces[self.offsets[i]..self.offsets[i + 1]])
    }

    pub fn specials(&self) -> &[u32] {
        &self.specials
    }

    /// Rebuilds the special-token list (after attributes changed).
    fn refresh_specials(&mut self) {
        let mut specials: Vec<u32> = (0..self.texts.len() as u32)
            .filter(|&i| {
                matches!(self.attrs[i as usize], TokenAttr::Control | TokenAttr::UserDefined | TokenAttr::Unknown)
                    && !self.texts[i as usize].is_empty()
            })
            .collect();
        // Longest first so that a special token containing another is matched whole; ties by
        // id for a deterministic order.
        specials.sort_by_key(|&i| (std::cmp::Reverse(self.texts[i as usize].len()), i));
        self.specials = specials;
    }
}

/// A piece of input text after special tokens were cut out.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Cuts every occurrence of a special token out of `text`, longest tokens first, as llama.cpp's
/// `tokenizer_st_partition`. With `parse_special` false only user-defined tokens are cut.
pub(crate) fn partition<'a>(vocab: &Vocab, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
    let mut frags = vec![Fragment::Text(text)];
    if text.is_empty() {
        return Vec::new();
    }
    for &id in vocab.specials() {
        let attr = vocab.attrs[id as usize];
        if !parse_special && attr.is_special() {
            continue;
        }
        let tok = vocab.texts[id as usize].as_str();
        // Cheap pre-check: most special tokens never occur in a given text.
        if !frags.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(tok))) {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len() + 2);
        for f in frags {
            match f {
                Fragment::Text(t) => {
                    let mut rest = t;
                    while let Some(pos) = rest.find(tok) {
                        if pos > 0 {
                            next.push(Fragment::Text(&rest[..pos]));
                        }
                        next.push(Fragment::Token(id));
                        rest = &rest[pos + tok.len()..];
                    }
                    if !rest.is_empty() {
                        next.push(Fragment::Text(rest));
                    }
                }
                tokf => next.push(tokf),
            }
        }
        frags = next;
    }
    frags
}
