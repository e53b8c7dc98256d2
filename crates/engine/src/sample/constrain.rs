//! Structured output: a request's JSON schema, regular expression, Lark grammar or GBNF grammar
//! (llama.cpp's format, converted to Lark by [`super::gbnf`]), enforced token by token with
//! llguidance (the constraint engine of llama.cpp, mistral.rs and ORT GenAI). An engine builds
//! one [`Grammars`] from its tokenizer (the token trie of the vocabulary, shared by every
//! request) and one [`Constraint`] per constrained request.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

use super::gbnf::gbnf_to_lark_with_vocab;
use crate::tokenizer::{TokenAttr, Tokenizer};
use crate::{Error, Result};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grammar {
    /// A JSON schema (as JSON text): the output is one JSON value that validates.
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark(String),
    /// A grammar in llama.cpp's GBNF (`root ::= ...`), converted to Lark ([`super::gbnf`]).
    Gbnf(String),
}

impl Grammar {
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "lark",
            Grammar::Gbnf(_) => "gbnf",
        }
    }
}

/// The tokenizer's side of every grammar: built once per engine.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// `vocab` is the model's (its logits' length; ids past the tokenizer's are never allowed);
    /// `eos` is the token a finished grammar allows.
    pub fn new(tok: &Tokenizer, vocab: usize, eos: u32) -> Result<Grammars> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tok.token_attr(id) {
                // Special tokens are named in the trie behind a 0xFF marker, as llguidance
                // expects: grammars can refer to them and text never produces them.
                Some(TokenAttr::Control | TokenAttr::Unknown) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                    w
                }
                Some(TokenAttr::Unused | TokenAttr::Undefined) | None => Vec::new(),
                Some(_) => tok.token_bytes(id).unwrap_or_default().to_vec(),
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::invalid("grammar", format!("the tokenizer's token trie: {e}")))?;
        factory.set_stderr_log_level(0);
        Ok(Grammars { factory })
    }

    /// A fresh constraint for one request; a grammar that does not compile is an error
    /// naming its kind and llguidance's message (with the line and column of Lark syntax), or
    /// for GBNF the converter's (`line L col C: ...`, in the GBNF text).
    pub fn constraint(&self, g: &Grammar) -> Result<Constraint> {
        let bad = |e: String| Error::invalid(format!("grammar ({})", g.kind()), e);
        let top = match g {
            Grammar::JsonSchema(s) => {
                let v = serde_json::from_str(s).map_err(|e| bad(format!("the schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(v)
            }
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
            Grammar::Gbnf(src) => {
                // `<text>` is the one token whose text that is: a special token (named behind
                // the trie's marker) or an ordinary one.
                let trie = self.factory.tok_env().tok_trie();
                let token_id = |t: &str| {
                    let mut special = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    special.extend_from_slice(t.as_bytes());
                    trie.token_id(&special).or_else(|| trie.token_id(t.as_bytes()))
                };
                let lark = gbnf_to_lark_with_vocab(src, &token_id).map_err(|e| bad(e.to_string()))?;
                TopLevelGrammar::from_lark(lark)
            }
        };
        // What llguidance says of a converted GBNF grammar is about the Lark text: said so.
        let compiled = |e: String| match g {
            Grammar::Gbnf(_) => bad(format!("in its Lark conversion: {e}")),
            _ => bad(e),
        };
        let parser = self.factory.create_parser(top).map_err(|e| compiled(e.to_string()))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(compiled(e)),
            None => Ok(Constraint { m }),
        }
    }
}

/// One request's grammar state.
pub struct Constraint {
    m: Matcher,
}

impl Constraint {
    /// The tokens allowed next.
    pub fn mask(&mut self) -> Result<SimpleVob> {
        self.m.compute_mask().map_err(|e| Error::invalid("grammar", e.to_string()))
    }

    /// Advances past a sampled token.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.m.consume_token(token).map_err(|e| Error::invalid("grammar", format!("token {token}: {e}")))
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }
}

/// Sets every logit `mask` forbids to -inf.
pub fn apply_mask(row: &mut [f32], mask: &SimpleVob) {
    for (i, l) in row.iter_mut().enumerate() {
        if !mask.is_allowed(i as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}
