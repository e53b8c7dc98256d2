//! Resolved model hyper-parameters, whatever file format they came from.

use tboost_ops::{Llama3Scaling, RopeStyle};

use super::Arch;
use crate::{Error, Result};

/// Every value the graph needs, resolved (defaults applied, `head_dim: null` filled in).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (GGUF `rope.dimension_count`; = head_dim in HF).
    pub rope_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    /// Pairing of rotated dims: HF checkpoints and GGUF qwen2 use half-split; GGUF llama q/k
    /// are permuted for the adjacent-pair form.
    pub rope_style: RopeStyle,
    pub rms_eps: f64,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// MoE: experts per layer (0 = dense MLP) and experts per token.
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Checks ranges and consistency. `source` names the file for the error message.
    pub fn validate(&self, source: &str) -> Result<()> {
        let err = |p: &str, m: String| Err(Error::config(source, p, m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return err(name, "must be > 0, got 0".into());
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return err(
                "num_key_value_heads",
                format!(
                    "num_attention_heads {} is not divisible by num_key_value_heads {}",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        if self.rope_dim == 0 || self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return err("rope_dim", format!("{} must be even and in 2..=head_dim ({})", self.rope_dim, self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return err("rope_theta", format!("must be a positive number, got {}", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return err("rms_norm_eps", format!("must be a non-negative number, got {}", self.rms_eps));
        }
        if let Some(s) = &self.rope_scaling {
            if !(s.factor > 0.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.original_max_position_embeddings > 0.0)
            {
                return err("rope_scaling", format!("llama3 parameters out of range: {s:?}"));
            }
        }
        if self.arch.is_moe() {
            if self.num_experts == 0 || self.experts_per_token == 0 || self.experts_per_token > self.num_experts {
                return err(
                    "num_experts_per_tok",
                    format!(
                        "{} experts per token of {} experts is out of range",
                        self.experts_per_token, self.num_experts
                    ),
                );
            }
        } else if self.num_experts != 0 {
            return err("num_local_experts", format!("{} has no experts, got {}", self.arch, self.num_experts));
        }
        if let Some(b) = self.bos_token_id {
            if b as usize >= self.vocab_size {
                return err("bos_token_id", format!("{b} is not below vocab_size {}", self.vocab_size));
            }
        }
        for &e in &self.eos_token_ids {
            if e as usize >= self.vocab_size {
                return err("eos_token_id", format!("{e} is not below vocab_size {}", self.vocab_size));
            }
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}
