//! The decoder-only architectures tboost runs.
//!
//! All share one graph (pre-norm decoder, RoPE, GQA attention, gated MLP or MoE); they differ
//! in options that `ModelConfig` (and its [`ArchFeatures`]) carries:
//! - `llama`: Touvron et al. 2023 (arXiv:2302.13971, 2307.09288); Llama 3 rope scaling;
//!   tied or untied output. Reference: transformers `modeling_llama.py`.
//! - `mistral`: Jiang et al. 2023 (arXiv:2310.06825); explicit head_dim may differ from
//!   hidden/heads (Mistral-Nemo); sliding-window attention. Reference: `modeling_mistral.py`.
//! - `qwen2`: Qwen2 technical report (arXiv:2407.10671); q/k/v biases, tied embeddings in
//!   small models. Reference: `modeling_qwen2.py`.
//! - `mixtral`: Jiang et al. 2024 (arXiv:2401.04088); sparse MoE MLP: router softmax over
//!   all experts, top-k, renormalize. Reference: `modeling_mixtral.py`.
//! - `qwen3`: Qwen3 technical report (arXiv:2505.09388); no q/k/v biases, per-head RMSNorm of
//!   q and k before RoPE. Reference: `modeling_qwen3.py`.
//! - `qwen3moe`: Qwen3 with a sparse MoE MLP in every layer (top-k of the softmax, renormalized
//!   when `norm_topk_prob`). Reference: `modeling_qwen3_moe.py`.
//! - `gemma3`: Gemma 3 technical report (arXiv:2503.19786); `(1 + w)` RMSNorm gains, four norms
//!   per layer, GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), q/k norm, sliding-window
//!   layers with their own RoPE base interleaved with global ones. Reference: `modeling_gemma3.py`.
//! - `phi3`: Abdin et al. 2024 (arXiv:2404.14219); fused qkv and gate_up projections in the file
//!   (split into views at load), LongRoPE (Ding et al. 2024, arXiv:2402.13753). Reference:
//!   `modeling_phi3.py`.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Mixtral,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    Phi3,
}

/// What `Arch::parse` accepts, for error messages.
pub const SUPPORTED: &str =
    "llama, mistral, qwen2, mixtral, qwen3, qwen3_moe (qwen3moe), gemma3 (gemma3_text) and phi3";

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Mixtral => "mixtral",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    /// From an HF `model_type` or a GGUF `general.architecture`.
    pub fn parse(s: &str) -> Option<Arch> {
        match s {
            "llama" => Some(Arch::Llama),
            "mistral" => Some(Arch::Mistral),
            "qwen2" => Some(Arch::Qwen2),
            "mixtral" => Some(Arch::Mixtral),
            "qwen3" => Some(Arch::Qwen3),
            "qwen3_moe" | "qwen3moe" => Some(Arch::Qwen3Moe),
            "gemma3" | "gemma3_text" => Some(Arch::Gemma3),
            "phi3" => Some(Arch::Phi3),
            _ => None,
        }
    }

    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Mixtral | Arch::Qwen3Moe)
    }

    /// The options every checkpoint of this architecture has (config keys may add a sliding
    /// window or a different attention scale).
    pub fn features(self) -> ArchFeatures {
        let mut f = ArchFeatures::default();
        match self {
            Arch::Qwen3 | Arch::Qwen3Moe => f.qk_norm = true,
            Arch::Gemma3 => {
                f.qk_norm = true;
                f.norm_plus_one = true;
                f.post_norms = true;
                f.mlp_act = MlpAct::GeluTanh;
                f.embed_scale = true;
            }
            _ => {}
        }
        f
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The gate activation of the MLP: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlpAct {
    /// SwiGLU: `silu(g) = g / (1 + exp(-g))`.
    #[default]
    Silu,
    /// GeGLU with the tanh GELU (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// The options beyond the Llama graph, resolved per checkpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ArchFeatures {
    /// Per-head RMSNorm of q and k (one `[head_dim]` gain each) after the projections and
    /// before RoPE.
    pub qk_norm: bool,
    /// Norm gains are stored as offsets from 1 (`x / rms * (1 + w)`); the loaders add the 1.
    pub norm_plus_one: bool,
    /// Each sublayer's output is RMS-normed before the residual add (post-attention and
    /// post-feedforward norms).
    pub post_norms: bool,
    pub mlp_act: MlpAct,
    /// The embedding output is multiplied by sqrt(hidden_size) rounded to the embedding's
    /// dtype (the tied LM head uses the unscaled table).
    pub embed_scale: bool,
    /// The attention scale when it is not 1/sqrt(head_dim).
    pub attn_scale: Option<f64>,
    /// Sliding window (keys per query, itself included); 0 = none.
    pub sliding_window: usize,
    /// Which layers use the window (empty: none).
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers when it differs from `rope_theta`.
    pub rope_local_theta: Option<f64>,
}

impl ArchFeatures {
    /// The window of layer `i` (0 = full causal attention).
    pub fn window(&self, i: usize) -> usize {
        if self.sliding_layers.get(i).copied().unwrap_or(false) {
            self.sliding_window
        } else {
            0
        }
    }

    /// Whether layer `i` rotates with the local RoPE base.
    pub fn local_rope(&self, i: usize) -> bool {
        self.rope_local_theta.is_some() && self.window(i) > 0
    }

    /// Whether every layer has the same window (>0): blocks behind it can be freed.
    pub fn uniform_window(&self) -> Option<usize> {
        (self.sliding_window > 0 && !self.sliding_layers.is_empty() && self.sliding_layers.iter().all(|&s| s))
            .then_some(self.sliding_window)
    }
}
