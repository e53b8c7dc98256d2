//! Model files → a resolved config and typed, memory-mapped weights. The file formats
//! themselves (GGUF container, file opening, size caps) are `crate::formats`.
//!
//! - `config`: the resolved hyper-parameters (`ModelConfig`) and their validation.
//! - `hf`: Hugging Face directories (config.json + single or sharded safetensors).
//! - `gguf`: a GGUF file's metadata and tensors mapped onto the config and weights.
//! - `tensor`: a named weight view over a memory map (no copy) or an owned buffer.
//! - `weights`: the per-layer weight set an architecture needs, checked against the config.
//! - `arch`: architecture rules and per-checkpoint features (llama, mistral, qwen2, mixtral,
//!   qwen3, qwen3moe, gemma3, phi3).

pub mod arch;
pub mod config;
pub mod gguf;
pub mod hf;
pub mod hugepages;
pub mod prefault;
pub mod tensor;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use arch::{Arch, ArchFeatures, MlpAct};
pub use config::ModelConfig;
pub use tensor::{Storage, Tensor};
pub use weights::{ExpertWeights, LayerExtras, LayerWeights, Mlp, ModelWeights, RopeFactors};

use crate::tokenizer::{ChatTemplate, Family, Tokenizer};
use crate::{Error, Result};

/// Where a model came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    HuggingFace,
    Gguf,
    Synthetic,
}

/// A loaded model: config, weights, (for GGUF) the raw metadata, and the tokenizer and chat
/// template when the files carry them.
pub struct Model {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub gguf_metadata: Option<crate::formats::gguf::Metadata>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
}

/// Short form: the GGUF metadata (a whole vocabulary) is summarised by its key count.
impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("config", &self.config)
            .field("layers", &self.weights.layers.len())
            .field("gguf_metadata_keys", &self.gguf_metadata.as_ref().map(|m| m.len()))
            .finish()
    }
}

impl Model {
    /// Loads a Hugging Face directory (or a `.json` / `.safetensors` file in it) or a GGUF
    /// file (any other file).
    pub fn load(path: &Path) -> Result<Model> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
        if !meta.is_dir() {
            // A FIFO, device or socket: say what it is instead of opening it (which could
            // block forever).
            crate::formats::files::open_regular(path)?;
        }
        let mut model = if meta.is_dir() {
            hf::load(path)?
        } else if name.ends_with(".json") || name.ends_with(".safetensors") {
            // `parent()` of a bare file name is "", which means the current directory.
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            hf::load(dir)?
        } else {
            gguf::load(path)?
        };
        model.attach_tokenizer()?;
        Ok(model)
    }

    /// Reads the tokenizer and chat template the model files carry (GGUF metadata, or
    /// `tokenizer.json` / `tokenizer_config.json` beside an HF checkpoint). Generation stops
    /// at every end-of-generation token the tokenizer knows (`<|im_end|>`, `<|eot_id|>`...),
    /// as llama.cpp does, besides the config's EOS ids.
    fn attach_tokenizer(&mut self) -> Result<()> {
        let (tok, tmpl) = match (&self.format, &self.gguf_metadata) {
            (ModelFormat::Gguf, Some(md)) => (Tokenizer::from_gguf(md), ChatTemplate::from_gguf(md)),
            (ModelFormat::HuggingFace, _) => {
                (Tokenizer::from_hf_dir(&self.path), ChatTemplate::from_hf_dir(&self.path)?)
            }
            _ => (Ok(None), None),
        };
        // A broken tokenizer must not stop a model that is driven by token ids: say why once
        // and go on without it (text requests then fail with "no tokenizer").
        let tok = tok.unwrap_or_else(|e| {
            log::warn!("{}: tokenizer unusable, continuing without one: {e}", self.path.display());
            None
        });
        if let Some(t) = &tok {
            if t.vocab_size() > self.config.vocab_size {
                return Err(Error::format(
                    &self.path,
                    format!(
                        "the tokenizer has {} tokens but the model only {} embeddings",
                        t.vocab_size(),
                        self.config.vocab_size
                    ),
                ));
            }
            for &e in t.eos_ids() {
                if !self.config.eos_token_ids.contains(&e) {
                    self.config.eos_token_ids.push(e);
                }
            }
        }
        // A file without a template gets its family's conventional one (only with a tokenizer:
        // without one the rendered text could not be tokenized anyway).
        let tmpl = tmpl.or_else(|| {
            let family = match self.config.arch {
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => Family::ChatMl,
                Arch::Gemma3 => Family::Gemma,
                Arch::Phi3 => Family::Phi3,
                Arch::Llama => Family::Llama,
                Arch::Mistral | Arch::Mixtral => Family::Mistral,
            };
            let t = ChatTemplate::builtin(family, tok.as_ref()?, self.config.arch.name());
            log::info!("{}: no chat template in the file; using the {}", self.path.display(), t.origin());
            Some(t)
        });
        self.tokenizer = tok.map(Arc::new);
        self.chat_template = tmpl;
        Ok(())
    }
}

/// Maps a weight file. Nothing is copied here: the CPU backend copies or repacks each
/// tensor into huge pages as it uploads it (see `hugepages`).
pub fn map_weights(path: &Path) -> Result<Storage> {
    Ok(Storage::Mmap(crate::formats::files::map_file(path)?))
}
