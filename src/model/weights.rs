//! The weights of one model, grouped per layer, each checked against the config.

use super::{ModelConfig, Tensor};

/// The feed-forward part of a layer.
#[derive(Clone, Debug)]
pub enum Mlp {
    /// `down(silu(gate(x)) * up(x))`.
    Dense { gate: Tensor, up: Tensor, down: Tensor },
    /// Router `[n_experts, hidden]` and per-expert SwiGLU MLPs.
    Moe { router: Tensor, experts: Vec<ExpertWeights> },
}

#[derive(Clone, Debug)]
pub struct ExpertWeights {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub mlp: Mlp,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// `[vocab, hidden]`; the embedding itself when tied.
    pub lm_head: Tensor,
}

impl ModelWeights {
    /// Total bytes of all weights (what a decode step must stream, minus unused experts).
    pub fn total_bytes(&self) -> usize {
        let mut n = self.embed.bytes().len() + self.norm.bytes().len();
        if !std::ptr::eq(self.lm_head.bytes().as_ptr(), self.embed.bytes().as_ptr()) {
            n += self.lm_head.bytes().len();
        }
        for l in &self.layers {
            n += [&l.attn_norm, &l.q, &l.k, &l.v, &l.o, &l.ffn_norm].iter().map(|t| t.bytes().len()).sum::<usize>();
            n += [&l.q_bias, &l.k_bias, &l.v_bias]
                .iter()
                .filter_map(|t| t.as_ref())
                .map(|t| t.bytes().len())
                .sum::<usize>();
            n += match &l.mlp {
                Mlp::Dense { gate, up, down } => gate.bytes().len() + up.bytes().len() + down.bytes().len(),
                Mlp::Moe { router, experts } => {
                    router.bytes().len()
                        + experts
                            .iter()
                            .map(|e| e.gate.bytes().len() + e.up.bytes().len() + e.down.bytes().len())
                            .sum::<usize>()
                }
            };
        }
        n
    }
}

/// Checks every tensor's shape (and that matrices/vectors have usable dtypes) against the
/// config. Implemented by the loader work; see `check_shapes` callers in `hf` and `gguf`.
pub fn check_shapes(cfg: &ModelConfig, w: &ModelWeights, path: &std::path::Path) -> crate::Result<()> {
    let _ = (cfg, w, path);
    unimplemented!("check_shapes: being written")
}
