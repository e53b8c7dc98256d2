//! Streaming detokenization: one id in, only complete UTF-8 text out.

use super::Tokenizer;
use crate::Result;

/// Turns generated ids into text as they arrive. A token may end in the middle of a UTF-8
/// sequence (byte-fallback and byte-level tokens often do); those bytes wait for the next
/// token. Bytes that can never become valid UTF-8 are emitted as U+FFFD, exactly as
/// `String::from_utf8_lossy` would over the whole output, so the concatenation of every chunk
/// plus [`Decoder::finish`] equals the one-shot decode.
#[derive(Clone, Debug, Default)]
pub struct Decoder {
    pending: Vec<u8>,
    strip_space: bool,
    special: bool,
}

impl Decoder {
    /// For a continuation (generated text after a prompt): every token's text is kept as is,
    /// including SentencePiece's leading space on the first token, as llama.cpp prints it.
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// For ids that start a sequence: behaves like [`Tokenizer::decode`], i.e. drops the one
    /// leading space that SentencePiece adds to the first token (llama.cpp's detokenize rule).
    pub fn at_sequence_start(tok: &Tokenizer) -> Decoder {
        Decoder { strip_space: tok.add_space_prefix(), ..Decoder::default() }
    }

    /// Also render control tokens (`<|im_end|>`...) as their text.
    pub fn with_special(mut self, special: bool) -> Decoder {
        self.special = special;
        self
    }

    /// Adds one id; returns the text that became complete (possibly empty).
    /// Errors when `id` is outside the vocabulary.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        let mut piece = tok.piece(id, self.special)?;
        if self.strip_space {
            piece = piece.strip_prefix(b" ").unwrap_or(piece);
            self.strip_space = false;
        }
        self.pending.extend_from_slice(piece);
        Ok(self.drain_complete())
    }

    /// Ends the stream: bytes still waiting (an incomplete UTF-8 sequence) become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back, waiting for the rest of a UTF-8 sequence.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Valid by construction of `valid_up_to`.
                    out.push_str(std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += valid + n;
                        }
                        None => {
                            // An incomplete sequence at the end: keep it for the next token.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
