//! `tboost tokenize`: text → ids with the model's own tokenizer.

use clap::Args;
use serde_json::json;

use super::print_json;
use tboost_engine::model::Model;
use tboost_engine::{Error, Result};

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    #[arg(long)]
    model: std::path::PathBuf,
    #[arg(long)]
    text: String,
    /// Do not add BOS even when the model asks for it.
    #[arg(long)]
    no_special: bool,
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(a: TokenizeArgs) -> Result<()> {
    let model = Model::load(&a.model)?;
    let tok = model.tokenizer.as_ref().ok_or_else(|| Error::NoTokenizer(a.model.display().to_string()))?;
    let ids = tok.encode(&a.text, !a.no_special)?;
    if a.json {
        print_json(&json!({ "ids": ids }))
    } else {
        for id in ids {
            let piece = tok.token_text(id).unwrap_or("?");
            println!("{id:>8} {piece:?}");
        }
        Ok(())
    }
}
