//! One tensor-parallel rank's part of a model: its config (its heads, intermediate part and
//! vocabulary rows) and its weights, cut as `plan::shard` decided. Row parts share the file's
//! storage (a backend reads only their bytes, with `pread`); column parts are copied, read
//! with `pread` in parts of rows.

use std::ops::Range;

use tboost_ops::DType;

use crate::backend::cpu::convert_weight;
use crate::model::{ExpertWeights, LayerWeights, Mlp, ModelConfig, ModelWeights, Tensor};
use crate::plan::ShardSpec;
use crate::{Error, Result};

fn cut(t: &Tensor, what: Result<Tensor, String>) -> Result<Tensor> {
    what.map_err(|e| Error::Unsupported(format!("tensor-parallel shard of `{}`: {e}", t.name)))
}

fn rows(t: &Tensor, r: Range<usize>) -> Result<Tensor> {
    cut(t, t.rows(r))
}

/// Columns `c` of `t`, copied (read from the file with `pread`: `Tensor::rows_in_parts`).
fn cols(t: &Tensor, c: Range<usize>, to_f32: bool) -> Result<Tensor> {
    if to_f32 && t.dtype != DType::F32 {
        return convert_weight(t, DType::F32)?.cols(c);
    }
    t.cols(c)
}

fn scale(r: &Range<usize>, k: usize) -> Range<usize> {
    r.start * k..r.end * k
}

/// The dense SwiGLU MLP (or one expert) of a rank: gate/up rows, down columns.
fn mlp(gate: &Tensor, up: &Tensor, down: &Tensor, s: &ShardSpec) -> Result<ExpertWeights> {
    let i = s.intermediate.clone();
    Ok(ExpertWeights { gate: rows(gate, i.clone())?, up: rows(up, i.clone())?, down: cols(down, i, false)? })
}

/// Rank `s.rank`'s config and weights.
pub(crate) fn shard(cfg: &ModelConfig, w: &ModelWeights, s: &ShardSpec) -> Result<(ModelConfig, ModelWeights)> {
    let hd = cfg.head_dim;
    let (q, kv) = (scale(&s.heads, hd), scale(&s.kv_heads, hd));
    let vocab = s.vocab();
    let mut local = cfg.clone();
    local.num_heads = s.heads.len();
    local.num_kv_heads = s.kv_heads.len();
    local.intermediate_size = s.intermediate.len();
    local.vocab_size = vocab.len();
    let bias = |b: &Option<Tensor>, r: &Range<usize>| b.as_ref().map(|b| rows(b, r.clone())).transpose();
    let mut layers = Vec::with_capacity(w.layers.len());
    for l in &w.layers {
        layers.push(LayerWeights {
            attn_norm: l.attn_norm.clone(),
            q: rows(&l.q, q.clone())?,
            k: rows(&l.k, kv.clone())?,
            v: rows(&l.v, kv.clone())?,
            o: cols(&l.o, q.clone(), s.o_proj_to_f32)?,
            q_bias: bias(&l.q_bias, &q)?,
            k_bias: bias(&l.k_bias, &kv)?,
            v_bias: bias(&l.v_bias, &kv)?,
            ffn_norm: l.ffn_norm.clone(),
            // Per-head q/k norm gains and the hidden-size post norms are the same on every rank.
            extra: l.extra.clone(),
            mlp: match &l.mlp {
                Mlp::Dense { gate, up, down } => {
                    let e = mlp(gate, up, down, s)?;
                    Mlp::Dense { gate: e.gate, up: e.up, down: e.down }
                }
                Mlp::Moe { router, experts } => Mlp::Moe {
                    router: router.clone(),
                    experts: experts.iter().map(|e| mlp(&e.gate, &e.up, &e.down, s)).collect::<Result<_>>()?,
                },
            },
        });
    }
    let weights = ModelWeights {
        embed: rows(&w.embed, vocab.clone())?,
        layers,
        norm: w.norm.clone(),
        lm_head: rows(&w.lm_head, vocab)?,
        rope_factors: w.rope_factors.clone(),
    };
    Ok((local, weights))
}
