//! SentencePiece-style BPE on raw UTF-8 (GGUF `tokenizer.ggml.model = "gemma4"`), as llama.cpp's
//! `llm_tokenizer_bpe` with `byte_encode = false`: spaces become `▁`, the text is cut only into
//! newline runs and the stretches between them, each stretch starts as one symbol per
//! character, and the ranked merges run on symbol *texts* (a merged text need not be a token).
//! A final symbol that is not a token falls back to its bytes' `<0xXX>` tokens.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::pretok::PreTokenizer;
use super::spm::SPACE;
use super::vocab::Vocab;
use crate::{Error, Result};

pub(crate) struct TextBpe {
    /// `left \0 right` → rank (the first occurrence of a pair wins, as llama.cpp's `emplace`).
    ranks: HashMap<String, u32>,
    /// Token id of `<0xXX>` for every byte (None when the vocabulary lacks it).
    byte_token: [Option<u32>; 256],
}

fn pair_key(buf: &mut String, left: &str, right: &str) {
    buf.clear();
    buf.push_str(left);
    buf.push('\0');
    buf.push_str(right);
}

impl TextBpe {
    pub fn new(vocab: &Vocab, merges: &[&str], source: &str) -> Result<TextBpe> {
        let mut ranks = HashMap::with_capacity(merges.len());
        let mut key = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let pos = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1).ok_or_else(|| {
                Error::config(source, "tokenizer.ggml.merges", format!("entry {rank} ({m:?}) has no space separator"))
            })?;
            pair_key(&mut key, &m[..pos], &m[pos + 1..]);
            ranks.entry(key.clone()).or_insert(rank as u32);
        }
        let mut byte_token = [None; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            *slot = vocab.id_of(&format!("<0x{b:02X}>"));
        }
        Ok(TextBpe { ranks, byte_token })
    }

    /// Tokenizes raw text (no special tokens inside) and appends the ids to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let escaped = text.replace(' ', SPACE.encode_utf8(&mut [0; 4]));
        for range in PreTokenizer::Gemma4.split(&escaped) {
            let word = &escaped[range];
            // A newline run is one token when the vocabulary has it (llama.cpp's Gemma 4 rule).
            if word.bytes().all(|b| b == b'\n') {
                if let Some(id) = vocab.id_of(word) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_word(vocab, word, out);
        }
    }

    fn encode_word(&self, vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
        // Symbols are byte ranges of `word` in a linked list; `len == 0` marks a merged-away one.
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
        }
        const NONE: usize = usize::MAX;
        let mut syms: Vec<Sym> = word
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Sym { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next: i + 1 })
            .collect();
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        if let Some(first) = syms.first_mut() {
            first.prev = NONE;
        }
        let text = |s: &Sym| &word[s.start..s.start + s.len];
        let mut key = String::new();
        // Heap of (rank, left index, left len, right len): lowest rank first, then leftmost.
        let mut heap = BinaryHeap::new();
        let mut push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            pair_key(&mut key, text(&syms[l]), text(&syms[r]));
            if let Some(&rank) = self.ranks.get(&key) {
                heap.push(Reverse((rank, l, syms[l].len, syms[r].len)));
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(Reverse((_, l, llen, rlen))) = heap.pop() {
            let r = syms[l].next;
            // Stale: either side grew or vanished since the pair was queued.
            if syms[l].len != llen || r == NONE || syms[r].len != rlen {
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
            push(&mut heap, &syms, lp, l);
            push(&mut heap, &syms, l, rn);
        }
        for s in syms.iter().filter(|s| s.len > 0) {
            let t = text(s);
            match vocab.id_of(t) {
                Some(id) => out.push(id),
                // Byte fallback; bytes without a `<0xXX>` token are dropped, as in llama.cpp.
                None => out.extend(t.bytes().filter_map(|b| self.byte_token[b as usize])),
            }
        }
    }
}
