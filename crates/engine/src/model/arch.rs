//! The Llama family of decoder-only architectures tboost runs.
//!
//! All four share one graph (pre-norm decoder, RoPE, GQA attention, SwiGLU MLP); they differ
//! in options that `ModelConfig` carries:
//! - `llama`: Touvron et al. 2023 (arXiv:2302.13971, 2307.09288); Llama 3 rope scaling;
//!   tied or untied output. Reference: transformers `modeling_llama.py`.
//! - `mistral`: Jiang et al. 2023 (arXiv:2310.06825); explicit head_dim may differ from
//!   hidden/heads (Mistral-Nemo). Reference: `modeling_mistral.py`.
//! - `qwen2`: Qwen2 technical report (arXiv:2407.10671); q/k/v biases, tied embeddings in
//!   small models. Reference: `modeling_qwen2.py`.
//! - `mixtral`: Jiang et al. 2024 (arXiv:2401.04088); sparse MoE MLP: router softmax over
//!   all experts, top-k, renormalize. Reference: `modeling_mixtral.py`.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Mixtral,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Mixtral => "mixtral",
        }
    }

    /// From an HF `model_type` or a GGUF `general.architecture`.
    pub fn parse(s: &str) -> Option<Arch> {
        match s {
            "llama" => Some(Arch::Llama),
            "mistral" => Some(Arch::Mistral),
            "qwen2" => Some(Arch::Qwen2),
            "mixtral" => Some(Arch::Mixtral),
            _ => None,
        }
    }

    pub fn is_moe(self) -> bool {
        self == Arch::Mixtral
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
