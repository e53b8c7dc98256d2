//! Random-weight models of named shapes, built in memory, for benchmarks and tests.
//! Weights are drawn uniformly with the scale of a trained model (std ≈ 0.02, norm gains
//! near 1) so activations stay in a realistic range; outputs are meaningless by design.
//! `gguf_write::write_synthetic` writes the same tensors to a GGUF file.

use std::path::PathBuf;

use tboost_engine::backend::cpu::quantize_row_reference;
use tboost_ops::DType;
use tboost_ops::RopeStyle;

use tboost_engine::model::weights::{ExpertWeights, LayerWeights, Mlp, ModelWeights};
use tboost_engine::model::{Arch, Model, ModelConfig, ModelFormat, Tensor};
use tboost_engine::{Error, Result};

/// The named shapes: `(name, description)`.
pub const SHAPES: &[(&str, &str)] = &[
    ("tinyllama-1.1b", "hidden 2048, 22 layers, 32 heads / 4 KV heads, ffn 5632, vocab 32000"),
    ("small", "hidden 512, 4 layers, 8 heads / 2 KV heads, ffn 1408, vocab 4096 (quick runs)"),
    ("small-k", "hidden 512, 2 layers, 8 heads / 2 KV heads, ffn 1536, vocab 2048 (whole 256-value K blocks)"),
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
        features: Default::default(),
    };
    match name {
        "tinyllama-1.1b" => Ok(base(2048, 22, 32, 4, 5632, 32000)),
        "small" => Ok(base(512, 4, 8, 2, 1408, 4096)),
        "small-k" => Ok(base(512, 2, 8, 2, 1536, 2048)),
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

/// Draws a tensor's values; matrices of a quantized `dtype` are drawn as f32 and quantized
/// row by row with the kernels' reference quantizer (`quantize_row_reference`).
fn tensor(name: String, shape: Vec<usize>, dtype: DType, rng: &mut Rng, center: f32, spread: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let bad = |m: String| Error::bad_tensor("<synthetic>", name.clone(), m);
    let mut bytes = Vec::with_capacity(dtype.bytes_for(n).unwrap_or(n * 4));
    if dtype.is_quantized() {
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut row = vec![0f32; cols];
        for _ in 0..n / cols {
            for v in row.iter_mut() {
                *v = center + spread * rng.next_f32();
            }
            bytes.extend_from_slice(&quantize_row_reference(dtype, &row).map_err(bad)?);
        }
    } else {
        for _ in 0..n {
            let x = center + spread * rng.next_f32();
            match dtype {
                DType::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
                DType::F16 => bytes.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
                DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
                other => {
                    return Err(bad(format!("synthetic models are f32, f16, bf16 or block-quantized, not {other}")))
                }
            }
        }
    }
    Tensor::owned(name.clone(), dtype, shape, bytes).map_err(bad)
}

/// The weight types a synthetic model can be built with (`--dtype` of `bench` and `synth`).
pub const DTYPES: &[&str] = &[
    "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k",
];

/// Parses a `--dtype` value (one of `DTYPES`); the error names the parameter.
pub fn parse_dtype(s: &str) -> Result<DType> {
    if !DTYPES.contains(&s) {
        return Err(Error::invalid("dtype", format!("`{s}` is not one of {}", DTYPES.join(", "))));
    }
    DType::parse(s).ok_or_else(|| Error::invalid("dtype", format!("`{s}` is not a known dtype")))
}

/// One tensor of a synthetic model, in generation order: HF-style name, shape (outermost
/// first), the uniform range `center ± spread` of its values, and whether it takes the
/// model's weight type (`matrix`) or stays f32 (norm gains).
#[derive(Clone, Debug)]
pub struct Spec {
    pub name: String,
    pub shape: Vec<usize>,
    pub center: f32,
    pub spread: f32,
    pub matrix: bool,
}

/// Every tensor of a shape's model in the order its values are drawn from the generator.
pub fn specs(cfg: &ModelConfig) -> Vec<Spec> {
    // Uniform in [-a, a] has std a/√3: a = 0.035 gives std ≈ 0.02.
    let w = 0.035;
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mat = |name: String, rows: usize, cols: usize| Spec {
        name,
        shape: vec![rows, cols],
        center: 0.0,
        spread: w,
        matrix: true,
    };
    let gain = |name: String| Spec { name, shape: vec![h], center: 1.0, spread: 0.1, matrix: false };
    let mut v = Vec::new();
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        if cfg.arch.is_moe() {
            for e in 0..cfg.num_experts {
                let q = format!("{p}.block_sparse_moe.experts.{e}");
                v.push(mat(format!("{q}.w1.weight"), cfg.intermediate_size, h));
                v.push(mat(format!("{q}.w3.weight"), cfg.intermediate_size, h));
                v.push(mat(format!("{q}.w2.weight"), h, cfg.intermediate_size));
            }
            v.push(mat(format!("{p}.block_sparse_moe.gate.weight"), cfg.num_experts, h));
        } else {
            v.push(mat(format!("{p}.mlp.gate_proj.weight"), cfg.intermediate_size, h));
            v.push(mat(format!("{p}.mlp.up_proj.weight"), cfg.intermediate_size, h));
            v.push(mat(format!("{p}.mlp.down_proj.weight"), h, cfg.intermediate_size));
        }
        v.push(gain(format!("{p}.input_layernorm.weight")));
        v.push(mat(format!("{p}.self_attn.q_proj.weight"), cfg.num_heads * hd, h));
        v.push(mat(format!("{p}.self_attn.k_proj.weight"), cfg.num_kv_heads * hd, h));
        v.push(mat(format!("{p}.self_attn.v_proj.weight"), cfg.num_kv_heads * hd, h));
        v.push(mat(format!("{p}.self_attn.o_proj.weight"), h, cfg.num_heads * hd));
        v.push(gain(format!("{p}.post_attention_layernorm.weight")));
    }
    v.push(Spec { spread: 1.0, ..mat("model.embed_tokens.weight".into(), cfg.vocab_size, h) });
    v.push(gain("model.norm.weight".into()));
    v.push(mat("lm_head.weight".into(), cfg.vocab_size, h));
    v
}

/// Draws the tensors of `specs` one after another: the same seed gives the same values
/// whether a model is built in memory (`build`) or written to a file tensor by tensor.
pub struct Generator(Rng);

impl Generator {
    pub fn new(seed: u64) -> Generator {
        Generator(Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1))
    }

    /// The next tensor: `spec` in `dtype` if it is a matrix, else in f32.
    pub fn next(&mut self, spec: &Spec, dtype: DType) -> Result<Tensor> {
        let dt = if spec.matrix { dtype } else { DType::F32 };
        tensor(spec.name.clone(), spec.shape.clone(), dt, &mut self.0, spec.center, spec.spread)
    }
}

/// Builds a random model of a named shape with matrices in `dtype` (norms stay f32).
pub fn build(name: &str, dtype: DType, seed: u64) -> Result<Model> {
    let cfg = config(name)?;
    let mut gen = Generator::new(seed);
    let mut all = std::collections::HashMap::new();
    for s in specs(&cfg) {
        all.insert(s.name.clone(), gen.next(&s, dtype)?);
    }
    let mut take = |n: String| {
        all.remove(&n).ok_or_else(|| Error::bad_tensor("<synthetic>", n, "missing from the generated set".to_string()))
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mlp = if cfg.arch.is_moe() {
            let experts = (0..cfg.num_experts)
                .map(|e| {
                    let q = format!("{p}.block_sparse_moe.experts.{e}");
                    Ok(ExpertWeights {
                        gate: take(format!("{q}.w1.weight"))?,
                        up: take(format!("{q}.w3.weight"))?,
                        down: take(format!("{q}.w2.weight"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Mlp::Moe { router: take(format!("{p}.block_sparse_moe.gate.weight"))?, experts }
        } else {
            Mlp::Dense {
                gate: take(format!("{p}.mlp.gate_proj.weight"))?,
                up: take(format!("{p}.mlp.up_proj.weight"))?,
                down: take(format!("{p}.mlp.down_proj.weight"))?,
            }
        };
        layers.push(LayerWeights {
            attn_norm: take(format!("{p}.input_layernorm.weight"))?,
            q: take(format!("{p}.self_attn.q_proj.weight"))?,
            k: take(format!("{p}.self_attn.k_proj.weight"))?,
            v: take(format!("{p}.self_attn.v_proj.weight"))?,
            o: take(format!("{p}.self_attn.o_proj.weight"))?,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            ffn_norm: take(format!("{p}.post_attention_layernorm.weight"))?,
            mlp,
            extra: Default::default(),
        });
    }
    let weights = ModelWeights {
        embed: take("model.embed_tokens.weight".into())?,
        layers,
        norm: take("model.norm.weight".into())?,
        lm_head: take("lm_head.weight".into())?,
        rope_factors: None,
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_synthetic_shapes_are_within_the_caps() {
        for (name, _) in super::SHAPES {
            super::config(name).unwrap().validate(name).unwrap();
        }
    }
}
