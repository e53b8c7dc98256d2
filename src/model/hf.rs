//! Hugging Face model directories: `config.json` (legacy and transformers-5 formats) plus
//! `model.safetensors` or sharded `model-0000N-of-0000M.safetensors` with an index.

use std::path::Path;

use super::Model;
use crate::Result;

pub fn load(dir: &Path) -> Result<Model> {
    let _ = dir;
    unimplemented!("hf::load: being written")
}
