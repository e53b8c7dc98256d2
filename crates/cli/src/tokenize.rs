//! `tboost tokenize`: text → ids with the model's own tokenizer. Only the tokenizer is loaded
//! (GGUF metadata or `tokenizer.json`), so a vocabulary-only GGUF file works and no weight is
//! read.

use clap::Args;
use serde_json::json;

use super::print_json;
use tboost_engine::tokenizer::Tokenizer;
use tboost_engine::Result;

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    /// A GGUF file (a vocabulary-only one works) or a Hugging Face model directory.
    #[arg(long)]
    model: std::path::PathBuf,
    /// The text; repeat it to tokenize several texts with one load (one result per text, in
    /// order: with --json one JSON line each).
    #[arg(long, required = true)]
    text: Vec<String>,
    /// Do not add BOS even when the model asks for it.
    #[arg(long)]
    no_special: bool,
    /// Tokenize control tokens written in the text (`<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(a: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::load(&a.model)?;
    for (i, text) in a.text.iter().enumerate() {
        let ids = tok.encode_with(text, !a.no_special, !a.no_parse_special)?;
        if a.json {
            print_json(&json!({ "ids": ids }))?;
        } else {
            if i > 0 {
                println!();
            }
            for id in ids {
                let piece = tok.token_text(id).unwrap_or("?");
                println!("{id:>8} {piece:?}");
            }
        }
    }
    Ok(())
}
