//! SentencePiece BPE (GGUF `tokenizer.ggml.model = "llama"`), as llama.cpp's `llm_tokenizer_spm`.
//!
//! Spaces become `▁`; the text starts as one symbol per UTF-8 char; the adjacent pair whose
//! concatenation is a vocabulary token with the highest score is merged (leftmost on ties)
//! until no pair is a token. Symbols that are not tokens fall back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;
use crate::{Error, Result};

pub const SPACE: char = '\u{2581}'; // ▁

pub(crate) struct Spm {
    scores: Vec<f32>,
    /// `<0xXX>` token of every byte (None when the vocabulary has neither it nor the raw byte).
    byte_token: [Option<u32>; 256],
    unk: Option<u32>,
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl Spm {
    pub fn new(vocab: &Vocab, scores: Vec<f32>, unk: Option<u32>) -> Spm {
        let mut byte_token = [None; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            // llama.cpp's byte_to_token: `<0xXX>`, else the byte itself as a one-char token.
            *slot = vocab.id_of(&format!("<0x{b:02X}>")).or_else(|| {
                let b = b as u8;
                if b.is_ascii() {
                    vocab.id_of(std::str::from_utf8(&[b]).unwrap_or_default())
                } else {
                    None
                }
            });
        }
        Spm { scores, byte_token, unk }
    }

    /// Tokenizes one text fragment (already prefixed with a space when llama.cpp would) and
    /// appends the ids to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let text: String = text.chars().map(|c| if c == ' ' { SPACE } else { c }).collect();
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
        }
        const NONE: usize = usize::MAX;
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let next = if start + c.len_utf8() == text.len() { NONE } else { i + 1 };
            syms.push(Sym { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next });
        }
        if let Some(first) = syms.first_mut() {
            first.prev = NONE;
        }
        let mut heap = BinaryHeap::new();
        let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &Vec<Sym>, l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            let s = &text[syms[l].start..syms[l].start + syms[l].len + syms[r].len];
            if let Some(id) = vocab.id_of(s) {
                let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
                heap.push(Bigram { score, left: l, right: r, size: s.len() });
            }
        };
        for i in 1..syms.len() {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            // Stale: one side was merged away or grew since the pair was queued.
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let rn = syms[r].next;
            syms[l].next = rn;
            if rn != NONE {
                syms[rn].prev = l;
            }
            let lp = syms[l].prev;
            try_add(&mut heap, &syms, lp, l);
            try_add(&mut heap, &syms, l, rn);
        }
        let mut i = if syms.is_empty() { NONE } else { 0 };
        while i != NONE {
            let s = &text[syms[i].start..syms[i].start + syms[i].len];
            match vocab.id_of(s) {
                Some(id) => out.push(id),
                None => {
                    for &b in s.as_bytes() {
                        let id = self.byte_token[b as usize].or(self.unk).ok_or_else(|| {
                            Error::invalid(
                                "text",
                                format!(
                                    "byte 0x{b:02X} of {s:?} has no <0x{b:02X}> token and the vocabulary has no unk"
                                ),
                            )
                        })?;
                        out.push(id);
                    }
                }
            }
            i = syms[i].next;
        }
        Ok(())
    }
}

/// The bytes an SPM token decodes to: `▁` → space for normal tokens, the byte for `<0xXX>`.
pub fn token_text_to_bytes(text: &str, byte_token: bool) -> Vec<u8> {
    if byte_token {
        if let Some(b) = parse_byte_token(text) {
            return vec![b];
        }
    }
    text.replace(SPACE, " ").into_bytes()
}

/// `<0xXX>` → the byte.
pub fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
