//! WordPiece (GGUF `tokenizer.ggml.model = "bert"`), as llama.cpp's `llm_tokenizer_wpm`.
//!
//! The text is normalized (NFD and accents dropped, lower case, when the vocabulary is
//! lower-cased), cut at whitespace, and every punctuation mark, ASCII symbol and CJK ideograph
//! becomes a word of its own; control characters vanish. Each word, with a `▁` in front (the
//! GGUF conversion marks word starts that way instead of `##` on continuations), is covered
//! greedily by the longest tokens from the left; a word that cannot be covered is `[UNK]`.

use std::sync::OnceLock;

use super::pretok::unicode_class;
use super::spm::SPACE;
use super::vocab::Vocab;

pub(crate) struct Wpm {
    unk: Option<u32>,
    lowercase: bool,
    /// Longest token text in bytes: bounds the greedy search.
    max_token_len: usize,
}

struct Classes {
    punct: Vec<(char, char)>,
    symbol: Vec<(char, char)>,
    control: Vec<(char, char)>,
    mark: Vec<(char, char)>,
}

fn classes() -> &'static Classes {
    static C: OnceLock<Classes> = OnceLock::new();
    C.get_or_init(|| Classes {
        punct: unicode_class(r"\p{P}"),
        symbol: unicode_class(r"\p{S}"),
        control: unicode_class(r"\p{C}"),
        mark: unicode_class(r"\p{M}"),
    })
}

fn has(ranges: &[(char, char)], c: char) -> bool {
    super::pretok::in_ranges(ranges, c)
}

/// The CJK ideograph blocks BERT splits character by character (as Hugging Face's, including
/// its 0x2B920 start of the fifth range).
fn is_chinese(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F |
        0x2B740..=0x2B81F | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

impl Wpm {
    pub fn new(vocab: &Vocab, unk: Option<u32>, lowercase: bool) -> Wpm {
        let max_token_len = (0..vocab.len() as u32).filter_map(|i| vocab.text(i)).map(str::len).max().unwrap_or(0);
        Wpm { unk, lowercase, max_token_len }
    }

    fn words(&self, text: &str) -> Vec<String> {
        let cls = classes();
        // Accents are stripped exactly when the text is lower-cased (llama.cpp's rule).
        let strip_accents = self.lowercase;
        let normalized;
        let text = if strip_accents {
            let mut n = tokenizers::NormalizedString::from(text);
            n.nfd();
            normalized = n.get().to_owned();
            normalized.as_str()
        } else {
            text
        };
        let mut words = vec![String::new()];
        for c in text.chars() {
            if c.is_whitespace() {
                if !words.last().is_some_and(String::is_empty) {
                    words.push(String::new());
                }
                continue;
            }
            if c == '\0' || c == '\u{FFFD}' || has(&cls.control, c) {
                continue;
            }
            if strip_accents && has(&cls.mark, c) {
                continue;
            }
            // Simple lower-case mapping: one char (the first of a full mapping, e.g. İ → i).
            let c = if self.lowercase { c.to_lowercase().next().unwrap_or(c) } else { c };
            let isolated = has(&cls.punct, c) || (c < '\u{7F}' && has(&cls.symbol, c)) || is_chinese(c);
            if isolated {
                if !words.last().is_some_and(String::is_empty) {
                    words.push(String::new());
                }
                if let Some(w) = words.last_mut() {
                    w.push(c);
                }
                words.push(String::new());
            } else if let Some(w) = words.last_mut() {
                w.push(c);
            }
        }
        if words.last().is_some_and(String::is_empty) {
            words.pop();
        }
        words
    }

    /// Tokenizes raw text (no special tokens inside) and appends the ids to `out`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        for word in self.words(text) {
            if word.is_empty() {
                continue;
            }
            let w = format!("{SPACE}{word}");
            let n = w.len();
            let before = out.len();
            let mut i = 0;
            while i < n {
                let longest = (i + 1..=n.min(i + self.max_token_len + 1))
                    .rev()
                    .find_map(|j| w.get(i..j).and_then(|t| vocab.id_of(t)).map(|id| (id, j)));
                match longest {
                    Some((id, j)) => {
                        out.push(id);
                        i = j;
                    }
                    None => {
                        // Not coverable: the whole word becomes unknown.
                        out.truncate(before);
                        break;
                    }
                }
            }
            if out.len() == before {
                out.extend(self.unk);
            }
        }
    }
}
