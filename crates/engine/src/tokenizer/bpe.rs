//! Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`), as llama.cpp's `llm_tokenizer_bpe`.
//!
//! Each pre-token's bytes start as one symbol each (the GPT-2 byte→char mapping makes every
//! byte a vocabulary entry); the adjacent pair with the lowest merge rank is merged, leftmost
//! first on ties, until no ranked pair remains.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use super::pretok::PreTokenizer;
use super::vocab::Vocab;
use crate::{Error, Result};

/// The GPT-2 byte→char table: printable Latin-1 bytes map to themselves, the other 68 bytes to
/// U+0100.. in byte order, so that every byte is a visible, non-space character.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let cp = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        // Every value is below 0x200: always a valid char.
        table[b as usize] = char::from_u32(cp).expect("byte-level code point below 0x200");
    }
    table
}

/// The inverse of [`byte_to_char_table`] (None for chars outside the mapping).
pub fn char_to_byte(c: char) -> Option<u8> {
    static INVERSE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    let inv = INVERSE.get_or_init(|| {
        let mut inv = [None; 324];
        for (b, c) in byte_to_char_table().iter().enumerate() {
            inv[*c as usize] = Some(b as u8);
        }
        inv
    });
    inv.get(c as usize).copied().flatten()
}

pub(crate) struct Bpe {
    pre: PreTokenizer,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Token id of each raw byte's byte-level char (None when the vocabulary lacks it).
    byte_token: [Option<u32>; 256],
    byte_char: [char; 256],
}

impl Bpe {
    /// `merges` are the GGUF `tokenizer.ggml.merges` strings (`"left right"`), rank = index.
    /// A merge whose parts or result are not tokens can never produce a token and is dropped.
    pub fn new(vocab: &Vocab, merges: &[&str], pre: PreTokenizer, source: &str) -> Result<Bpe> {
        let byte_char = byte_to_char_table();
        let mut byte_token = [None; 256];
        for (b, c) in byte_char.iter().enumerate() {
            byte_token[b] = vocab.id_of(c.encode_utf8(&mut [0; 4]));
        }
        let mut map = HashMap::with_capacity(merges.len());
        let mut merged = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let pos = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1).ok_or_else(|| {
                Error::config(source, "tokenizer.ggml.merges", format!("entry {rank} ({m:?}) has no space separator"))
            })?;
            let (left, right) = (&m[..pos], &m[pos + 1..]);
            let (Some(l), Some(r)) = (vocab.id_of(left), vocab.id_of(right)) else { continue };
            merged.clear();
            merged.push_str(left);
            merged.push_str(right);
            let Some(id) = vocab.id_of(&merged) else { continue };
            // The first occurrence of a pair wins, as in llama.cpp's `emplace`.
            map.entry((l, r)).or_insert((rank as u32, id));
        }
        Ok(Bpe { pre, merges: map, byte_token, byte_char })
    }

    pub fn pre(&self) -> PreTokenizer {
        self.pre
    }

    /// Tokenizes raw text (no special tokens inside) and appends the ids to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut word = String::new();
        for range in self.pre.split(text) {
            let bytes = &text.as_bytes()[range];
            if self.pre.ignore_merges() {
                word.clear();
                word.extend(bytes.iter().map(|&b| self.byte_char[b as usize]));
                if let Some(id) = vocab.id_of(&word) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_word(bytes, out)?;
        }
        Ok(())
    }

    fn encode_word(&self, bytes: &[u8], out: &mut Vec<u32>) -> Result<()> {
        // Symbols: token id, alive flag (id stays valid), linked list over the word.
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        const NONE: usize = usize::MAX;
        let mut syms = Vec::with_capacity(bytes.len());
        for (i, &b) in bytes.iter().enumerate() {
            let id = self.byte_token[b as usize].ok_or_else(|| {
                Error::invalid("text", format!("byte 0x{b:02X} has no byte-level token in this vocabulary"))
            })?;
            let next = if i + 1 < bytes.len() { i + 1 } else { NONE };
            syms.push(Sym { id, prev: i.wrapping_sub(1), next, alive: true });
        }
        if let Some(first) = syms.first_mut() {
            first.prev = NONE;
        }
        // Heap of (rank, left index, left id, right id); min-heap via Reverse.
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &Vec<Sym>, l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            if let Some(&(rank, _)) = self.merges.get(&(syms[l].id, syms[r].id)) {
                heap.push(Reverse((rank, l, syms[l].id, syms[r].id)));
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(Reverse((_, l, lid, rid))) = heap.pop() {
            let r = syms[l].next;
            // Skip pairs made stale by an earlier merge on either side.
            if !syms[l].alive || r == NONE || !syms[r].alive || syms[l].id != lid || syms[r].id != rid {
                continue;
            }
            let (_, merged) = self.merges[&(lid, rid)];
            syms[l].id = merged;
            syms[r].alive = false;
            let rn = syms[r].next;
            syms[l].next = rn;
            if rn != NONE {
                syms[rn].prev = l;
            }
            let lp = syms[l].prev;
            push(&mut heap, &syms, lp, l);
            push(&mut heap, &syms, l, rn);
        }
        out.extend(syms.iter().filter(|s| s.alive).map(|s| s.id));
        Ok(())
    }
}

/// The bytes a byte-level token text stands for. Chars outside the GPT-2 mapping (which a
/// well-formed vocabulary does not have) are kept as their own UTF-8 bytes.
pub fn token_text_to_bytes(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_mapping_round_trips_all_bytes() {
        let t = byte_to_char_table();
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b), "byte {b}");
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }
}
