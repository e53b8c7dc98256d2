//! Random-weight models of named shapes, built in memory, for benchmarks and tests.
//! Weights are drawn uniformly with the scale of a trained model (std ≈ 0.02, norm gains
//! near 1) so activations stay in a realistic range; outputs are meaningless by design.

use std::path::PathBuf;

use tboost_ops::DType;
use tboost_ops::RopeStyle;

use super::weights::{ExpertWeights, LayerWeights, Mlp, ModelWeights};
use super::{Arch, Model, ModelConfig, ModelFormat, Tensor};
use crate::{Error, Result};

/// The named shapes: `(name, description)`.
pub const SHAPES: &[(&str, &str)] = &[
    ("tinyllama-1.1b", "hidden 2048, 22 layers, 32 heads / 4 KV heads, ffn 5632, vocab 32000"),
    ("small", "hidden 512, 4 layers, 8 heads / 2 KV heads, ffn 1408, vocab 4096 (quick runs)"),
    ("tiny-moe", "hidden 256, 2 layers, 8 heads / 2 KV heads, 4 experts top-2 of ffn 512, vocab 1024"),
];

/// The config of a named shape.
pub fn config(name: &str) -> Result<ModelConfig> {
    let base = |hidden, layers, heads, kv_heads, inter, vocab| ModelConfig {
        arch: Arch::Llama,
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
        rope_style: RopeStyle::HalfSplit,
        rms_eps: 1e-5,
        tie_word_embeddings: false,
        qkv_bias: false,
        num_experts: 0,
        experts_per_token: 0,
        max_position_embeddings: 2048,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    };
    match name {
        "tinyllama-1.1b" => Ok(base(2048, 22, 32, 4, 5632, 32000)),
        "small" => Ok(base(512, 4, 8, 2, 1408, 4096)),
        "tiny-moe" => Ok(ModelConfig {
            arch: Arch::Mixtral,
            num_experts: 4,
            experts_per_token: 2,
            ..base(256, 2, 8, 2, 512, 1024)
        }),
        other => {
            let names: Vec<&str> = SHAPES.iter().map(|s| s.0).collect();
            Err(Error::invalid("synthetic", format!("unknown shape `{other}`; known: {}", names.join(", "))))
        }
    }
}

/// xorshift64*: fast, deterministic, good enough for random weights.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 random bits
        bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 // uniform in [-1, 1)
    }
}

fn tensor(name: String, shape: Vec<usize>, dtype: DType, rng: &mut Rng, center: f32, spread: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut bytes = Vec::with_capacity(n * dtype.block_bytes());
    for _ in 0..n {
        let x = center + spread * rng.next_f32();
        match dtype {
            DType::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            other => {
                return Err(Error::invalid("dtype", format!("synthetic models are f32, f16 or bf16, not {other}")))
            }
        }
    }
    Tensor::owned(name.clone(), dtype, shape, bytes).map_err(|m| Error::bad_tensor("<synthetic>", name, m))
}

/// Builds a random model of a named shape with matrices in `dtype` (norms stay f32).
pub fn build(name: &str, dtype: DType, seed: u64) -> Result<Model> {
    let cfg = config(name)?;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    // Uniform in [-a, a] has std a/√3: a = 0.035 gives std ≈ 0.02.
    let w = 0.035;
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mat =
        |name: String, rows: usize, cols: usize, rng: &mut Rng| tensor(name, vec![rows, cols], dtype, rng, 0.0, w);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mlp = if cfg.arch.is_moe() {
            let experts = (0..cfg.num_experts)
                .map(|e| {
                    let q = format!("{p}.block_sparse_moe.experts.{e}");
                    Ok(ExpertWeights {
                        gate: mat(format!("{q}.w1.weight"), cfg.intermediate_size, h, &mut rng)?,
                        up: mat(format!("{q}.w3.weight"), cfg.intermediate_size, h, &mut rng)?,
                        down: mat(format!("{q}.w2.weight"), h, cfg.intermediate_size, &mut rng)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Mlp::Moe {
                router: mat(format!("{p}.block_sparse_moe.gate.weight"), cfg.num_experts, h, &mut rng)?,
                experts,
            }
        } else {
            Mlp::Dense {
                gate: mat(format!("{p}.mlp.gate_proj.weight"), cfg.intermediate_size, h, &mut rng)?,
                up: mat(format!("{p}.mlp.up_proj.weight"), cfg.intermediate_size, h, &mut rng)?,
                down: mat(format!("{p}.mlp.down_proj.weight"), h, cfg.intermediate_size, &mut rng)?,
            }
        };
        layers.push(LayerWeights {
            attn_norm: tensor(format!("{p}.input_layernorm.weight"), vec![h], DType::F32, &mut rng, 1.0, 0.1)?,
            q: mat(format!("{p}.self_attn.q_proj.weight"), cfg.num_heads * hd, h, &mut rng)?,
            k: mat(format!("{p}.self_attn.k_proj.weight"), cfg.num_kv_heads * hd, h, &mut rng)?,
            v: mat(format!("{p}.self_attn.v_proj.weight"), cfg.num_kv_heads * hd, h, &mut rng)?,
            o: mat(format!("{p}.self_attn.o_proj.weight"), h, cfg.num_heads * hd, &mut rng)?,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            ffn_norm: tensor(format!("{p}.post_attention_layernorm.weight"), vec![h], DType::F32, &mut rng, 1.0, 0.1)?,
            mlp,
        });
    }
    let weights = ModelWeights {
        embed: tensor("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], dtype, &mut rng, 0.0, 1.0)?,
        layers,
        norm: tensor("model.norm.weight".into(), vec![h], DType::F32, &mut rng, 1.0, 0.1)?,
        lm_head: mat("lm_head.weight".into(), cfg.vocab_size, h, &mut rng)?,
    };
    Ok(Model {
        path: PathBuf::from(format!("<synthetic:{name}>")),
        format: ModelFormat::Synthetic,
        config: cfg,
        weights,
        gguf_metadata: None,
        tokenizer: None,
        chat_template: None,
    })
}
