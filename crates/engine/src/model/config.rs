//! Resolved model hyper-parameters, whatever file format they came from.

use tboost_ops::{RopeScaling, RopeStyle};

use super::{Arch, ArchFeatures};
use crate::formats::limits;
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
    pub rope_scaling: Option<RopeScaling>,
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
    /// The options beyond the Llama graph (q/k norm, Gemma's norms and scales, sliding
    /// windows): all off for llama, mistral without a window, qwen2 and mixtral.
    pub features: ArchFeatures,
}

impl ModelConfig {
    /// Checks ranges and consistency. `source` names the file for the error message.
    ///
    /// INVARIANT (what the rest of the engine relies on): a config that passes has every
    /// size at or below its cap in [`limits`], `num_heads` a multiple of `num_kv_heads`,
    /// `rope_dim` even and ≤ `head_dim`, `experts_per_token` ≤ `num_experts` and a context
    /// length ≥ 1. Hence, for any `tokens ≤ limits::MAX_BATCH_TOKENS` (2^24):
    /// - every per-token width (hidden, `num_heads*head_dim` ≤ 2^20, `num_kv_heads*head_dim`,
    ///   intermediate, vocab ≤ 2^22) times `tokens` is ≤ 2^46 elements, ≤ 2^49 bytes as f32;
    /// - the MoE scratch `tokens*experts_per_token*hidden` is ≤ 2^46;
    /// - KV bytes per token `2*layers*kv_heads*head_dim*4` ≤ 2^33, and times the context
    ///   length ≤ 2^57; a block count times any of these is checked where it is formed;
    /// - FlashAttention's per-thread scratch `16*group*(head_dim+2) + 3*64*head_dim + …`
    ///   floats is below 2^25;
    /// - every weight the config implies (`[vocab, hidden]`, `[experts, hidden]`,
    ///   `[intermediate, hidden]`, `[num_heads*head_dim, hidden]`) has ≤ 2^40 elements.
    ///
    /// So none of these products can wrap in 64-bit arithmetic: a shape the loaders accept
    /// is one the plan and the kernels can index. `caps_keep_every_product_in_range` below
    /// recomputes the worst cases with checked arithmetic.
    pub fn validate(&self, source: &str) -> Result<()> {
        let err = |p: &str, m: String| Err(Error::config(source, p, m));
        for (name, v, cap) in [
            ("vocab_size", self.vocab_size, limits::MAX_VOCAB),
            ("hidden_size", self.hidden_size, limits::MAX_HIDDEN),
            ("intermediate_size", self.intermediate_size, limits::MAX_INTERMEDIATE),
            ("num_hidden_layers", self.num_layers, limits::MAX_LAYERS),
            ("num_attention_heads", self.num_heads, limits::MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, limits::MAX_KV_HEADS),
            ("head_dim", self.head_dim, limits::MAX_HEAD_DIM),
            ("max_position_embeddings", self.max_position_embeddings, limits::MAX_CONTEXT),
        ] {
            if v == 0 {
                return err(name, "must be > 0, got 0".into());
            }
            limits::check_cap(source, name, v as u64, cap as u64)?;
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
        let pos = |v: f64| v.is_finite() && v > 0.0;
        let scaling_ok = match &self.rope_scaling {
            None => true,
            Some(RopeScaling::Llama3(s)) => {
                pos(s.factor)
                    && pos(s.low_freq_factor)
                    && s.high_freq_factor.is_finite()
                    && s.high_freq_factor > s.low_freq_factor
                    && pos(s.original_max_position_embeddings)
            }
            Some(RopeScaling::Linear { factor }) => pos(*factor),
            Some(RopeScaling::Yarn(y)) => {
                pos(y.factor)
                    && pos(y.original_max_position_embeddings)
                    && pos(y.beta_fast)
                    && pos(y.beta_slow)
                    && pos(y.attention_factor)
            }
            Some(RopeScaling::LongRope { original_max_position_embeddings, attention_factor }) => {
                pos(*original_max_position_embeddings) && pos(*attention_factor)
            }
        };
        if !scaling_ok {
            let s = self.rope_scaling.as_ref().map_or("", |s| s.name());
            return err("rope_scaling", format!("{s} parameters out of range: {:?}", self.rope_scaling));
        }
        let f = &self.features;
        if !f.sliding_layers.is_empty() && f.sliding_layers.len() != self.num_layers {
            return err(
                "layer_types",
                format!("lists {} layers but num_hidden_layers is {}", f.sliding_layers.len(), self.num_layers),
            );
        }
        if f.sliding_layers.iter().any(|&s| s) && f.sliding_window == 0 {
            return err("sliding_window", "must be > 0 for sliding-attention layers".into());
        }
        if let Some(t) = f.rope_local_theta.filter(|t| !pos(*t)) {
            return err("rope_local_base_freq", format!("must be a positive number, got {t}"));
        }
        if let Some(a) = f.attn_scale.filter(|a| !pos(*a)) {
            return err("query_pre_attn_scalar", format!("gives the attention scale {a}, which is not positive"));
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
            limits::check_cap(source, "num_local_experts", self.num_experts as u64, limits::MAX_EXPERTS as u64)?;
            limits::check_cap(
                source,
                "num_experts_per_tok",
                self.experts_per_token as u64,
                limits::MAX_EXPERTS_PER_TOKEN as u64,
            )?;
        } else if self.num_experts != 0 {
            return err("num_local_experts", format!("{} has no experts, got {}", self.arch, self.num_experts));
        }
        // The caps make these products small; compute them checked anyway so that a raised
        // cap can never turn into wrapping arithmetic unnoticed.
        for (name, a, b, what) in [
            ("num_attention_heads", self.num_heads, self.head_dim, "num_attention_heads*head_dim"),
            ("num_key_value_heads", self.num_kv_heads, self.head_dim, "num_key_value_heads*head_dim"),
            ("vocab_size", self.vocab_size, self.hidden_size, "vocab_size*hidden_size"),
            ("intermediate_size", self.intermediate_size, self.hidden_size, "intermediate_size*hidden_size"),
        ] {
            match a.checked_mul(b) {
                Some(n) if n as u64 <= limits::MAX_TENSOR_ELEMENTS => {}
                _ => {
                    return err(
                        name,
                        format!("{what} = {a}*{b} is above tboost's limit of {}", limits::MAX_TENSOR_ELEMENTS),
                    )
                }
            }
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

    /// The attention scale: 1/sqrt(head_dim) unless the architecture sets another.
    pub fn attn_scale(&self) -> f32 {
        self.features.attn_scale.unwrap_or(1.0 / (self.head_dim as f64).sqrt()) as f32
    }
}

/// A Llama-architecture config of the given shape, for unit tests.
#[cfg(test)]
pub(crate) fn llama_shape(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    vocab: usize,
) -> ModelConfig {
    ModelConfig {
        arch: crate::model::Arch::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        rope_dim: hidden / heads,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_style: tboost_ops::RopeStyle::HalfSplit,
        rms_eps: 1e-5,
        tie_word_embeddings: false,
        qkv_bias: false,
        num_experts: 0,
        experts_per_token: 0,
        max_position_embeddings: 2048,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        features: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use limits::*;

    /// The products that `validate`'s invariant promises, at the caps, in checked u64
    /// arithmetic with the stated bounds.
    #[test]
    fn caps_keep_every_product_in_range() {
        let m = |xs: &[usize]| xs.iter().try_fold(1u64, |a, &x| a.checked_mul(x as u64)).expect("overflow");
        let t = MAX_BATCH_TOKENS;
        let widths = [MAX_HIDDEN, MAX_HEADS * MAX_HEAD_DIM, MAX_INTERMEDIATE, MAX_VOCAB];
        for w in widths {
            assert!(m(&[t, w, 4]) <= 1 << 49, "tokens x {w} x f32");
        }
        const { assert!(MAX_HEADS * MAX_HEAD_DIM <= 1 << 20) };
        assert!(m(&[t, MAX_EXPERTS_PER_TOKEN, MAX_HIDDEN]) <= 1 << 46);
        let kv_per_token = m(&[2, MAX_LAYERS, MAX_KV_HEADS, MAX_HEAD_DIM, 4]);
        assert!(kv_per_token <= 1 << 33);
        assert!(kv_per_token.checked_mul(MAX_CONTEXT as u64).unwrap() <= 1 << 57);
        // FlashAttention scratch floats (kernels/src/attention/flash.rs: scratch_floats).
        let flash = m(&[16, MAX_HEADS, MAX_HEAD_DIM + 2]) + m(&[3, 64, MAX_HEAD_DIM]) + MAX_HEAD_DIM as u64;
        assert!(flash < 1 << 25);
        for w in [
            m(&[MAX_VOCAB, MAX_HIDDEN]),
            m(&[MAX_INTERMEDIATE, MAX_HIDDEN]),
            m(&[MAX_HEADS * MAX_HEAD_DIM, MAX_HIDDEN]),
        ] {
            assert!(w <= MAX_TENSOR_ELEMENTS);
        }
        assert!(m(&[MAX_TENSOR_ELEMENTS as usize, 8]) <= isize::MAX as u64);
        const { assert!(MAX_ARRAY_LEN <= MAX_METADATA_VALUES && MAX_VOCAB <= MAX_ARRAY_LEN) };
        const { assert!(MAX_KV_HEADS <= MAX_HEADS && MAX_EXPERTS_PER_TOKEN <= MAX_EXPERTS) };
    }

    fn tiny() -> ModelConfig {
        llama_shape(512, 4, 8, 2, 1408, 4096)
    }

    #[test]
    fn every_capped_field_is_named_with_its_value() {
        type Set = fn(&mut ModelConfig, usize);
        let cases: [(&str, Set, usize); 8] = [
            ("num_hidden_layers", |c, v| c.num_layers = v, MAX_LAYERS),
            ("num_attention_heads", |c, v| c.num_heads = v, MAX_HEADS),
            ("num_key_value_heads", |c, v| c.num_kv_heads = v, MAX_KV_HEADS),
            ("head_dim", |c, v| c.head_dim = v, MAX_HEAD_DIM),
            ("hidden_size", |c, v| c.hidden_size = v, MAX_HIDDEN),
            ("intermediate_size", |c, v| c.intermediate_size = v, MAX_INTERMEDIATE),
            ("vocab_size", |c, v| c.vocab_size = v, MAX_VOCAB),
            ("max_position_embeddings", |c, v| c.max_position_embeddings = v, MAX_CONTEXT),
        ];
        for (field, set, cap) in cases {
            for v in [cap + 1, 1 << 40, (1 << 62) + 2, usize::MAX] {
                let mut c = tiny();
                set(&mut c, v);
                let e = c.validate("model.gguf").unwrap_err().to_string();
                assert!(
                    e.contains("model.gguf") && e.contains(field) && e.contains(&v.to_string()) && e.contains("limit"),
                    "{field}={v}: {e}"
                );
            }
        }
    }

    #[test]
    fn context_length_zero_is_an_error() {
        let mut c = tiny();
        c.max_position_embeddings = 0;
        let e = c.validate("config.json").unwrap_err().to_string();
        assert!(e.contains("max_position_embeddings") && e.contains("must be > 0"), "{e}");
    }
}
