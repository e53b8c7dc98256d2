//! The weights of one model, grouped per layer, each checked against the config.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::{ModelConfig, Tensor};
use crate::{Error, Result};

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
    /// The norms beyond the Llama layer (absent there).
    pub extra: LayerExtras,
}

/// Per-layer norms some architectures add; gains are as the graph uses them (Gemma's `1 + w`
/// already added by the loader).
#[derive(Clone, Debug, Default)]
pub struct LayerExtras {
    /// `[head_dim]` RMSNorm gains applied to every q head and every k head before RoPE.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// `[hidden]` RMSNorm of the attention output and of the MLP output before each residual add.
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
}

impl LayerExtras {
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        [&self.q_norm, &self.k_norm, &self.post_attn_norm, &self.post_ffn_norm].into_iter().flatten()
    }
}

/// LongRoPE's per-frequency factors (`[rope_dim / 2]` f32 each): the short list for sequences
/// within the original context length, the long one beyond it.
#[derive(Clone, Debug)]
pub struct RopeFactors {
    pub short: Tensor,
    pub long: Tensor,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// `[vocab, hidden]`; the embedding itself when tied.
    pub lm_head: Tensor,
    /// LongRoPE's factors, when the config's rope scaling is LongRoPE.
    pub rope_factors: Option<RopeFactors>,
}

impl ModelWeights {
    /// Every tensor once, in file-ish order (embedding, layers, norm, output). A tied
    /// output (same bytes as the embedding) is listed once.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.embed];
        for l in &self.layers {
            v.extend([&l.attn_norm, &l.q, &l.k, &l.v, &l.o, &l.ffn_norm]);
            v.extend([&l.q_bias, &l.k_bias, &l.v_bias].into_iter().flatten());
            v.extend(l.extra.tensors());
            match &l.mlp {
                Mlp::Dense { gate, up, down } => v.extend([gate, up, down]),
                Mlp::Moe { router, experts } => {
                    v.push(router);
                    for e in experts {
                        v.extend([&e.gate, &e.up, &e.down]);
                    }
                }
            }
        }
        v.push(&self.norm);
        if let Some(f) = &self.rope_factors {
            v.extend([&f.short, &f.long]);
        }
        if !std::ptr::eq(self.lm_head.bytes().as_ptr(), self.embed.bytes().as_ptr()) {
            v.push(&self.lm_head);
        }
        v
    }

    /// Total bytes of all weights (what a dense decode step streams from memory).
    pub fn total_bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.bytes().len()).sum()
    }
}

/// Checks every tensor's shape against the config, and that vectors (norm gains, biases)
/// use a dense dtype. `path` is the file named in the error.
pub fn check_shapes(cfg: &ModelConfig, w: &ModelWeights, path: &Path) -> Result<()> {
    let h = cfg.hidden_size;
    let q = cfg.num_heads * cfg.head_dim;
    let kv = cfg.num_kv_heads * cfg.head_dim;
    let inter = cfg.intermediate_size;
    let check = |t: &Tensor, want: &[usize], what: &str| -> Result<()> {
        if t.shape != want {
            return Err(Error::bad_tensor(
                path,
                &t.name,
                format!("expected shape {want:?} ({what}), got {:?}", t.shape),
            ));
        }
        if want.len() == 1 && t.dtype.is_quantized() {
            return Err(Error::bad_tensor(
                path,
                &t.name,
                format!("is {}, but a norm gain or bias must be f32, f16 or bf16", t.dtype),
            ));
        }
        Ok(())
    };
    check(&w.embed, &[cfg.vocab_size, h], "vocab_size, hidden_size")?;
    if w.layers.len() != cfg.num_layers {
        return Err(Error::config(
            path.display().to_string(),
            "num_hidden_layers",
            format!("config says {} layers but the weights have {}", cfg.num_layers, w.layers.len()),
        ));
    }
    for l in &w.layers {
        check(&l.attn_norm, &[h], "hidden_size")?;
        check(&l.q, &[q, h], "num_attention_heads*head_dim, hidden_size")?;
        check(&l.k, &[kv, h], "num_key_value_heads*head_dim, hidden_size")?;
        check(&l.v, &[kv, h], "num_key_value_heads*head_dim, hidden_size")?;
        check(&l.o, &[h, q], "hidden_size, num_attention_heads*head_dim")?;
        for (b, n, what) in [
            (&l.q_bias, q, "num_attention_heads*head_dim"),
            (&l.k_bias, kv, "num_key_value_heads*head_dim"),
            (&l.v_bias, kv, "num_key_value_heads*head_dim"),
        ] {
            if let Some(b) = b {
                check(b, &[n], what)?;
            }
        }
        check(&l.ffn_norm, &[h], "hidden_size")?;
        let x = &l.extra;
        for (t, want, what, on) in [
            (&x.q_norm, cfg.head_dim, "head_dim", cfg.features.qk_norm),
            (&x.k_norm, cfg.head_dim, "head_dim", cfg.features.qk_norm),
            (&x.post_attn_norm, h, "hidden_size", cfg.features.post_norms),
            (&x.post_ffn_norm, h, "hidden_size", cfg.features.post_norms),
        ] {
            match t {
                Some(t) => check(t, &[want], what)?,
                None if on => {
                    return Err(Error::config(
                        path.display().to_string(),
                        "architecture",
                        format!("{} needs per-layer norms the weights lack", cfg.arch),
                    ))
                }
                None => {}
            }
        }
        match &l.mlp {
            Mlp::Dense { gate, up, down } => {
                if cfg.num_experts != 0 {
                    return Err(Error::bad_tensor(
                        path,
                        &gate.name,
                        format!("is a dense MLP weight, but the config has {} experts", cfg.num_experts),
                    ));
                }
                check(gate, &[inter, h], "intermediate_size, hidden_size")?;
                check(up, &[inter, h], "intermediate_size, hidden_size")?;
                check(down, &[h, inter], "hidden_size, intermediate_size")?;
            }
            Mlp::Moe { router, experts } => {
                check(router, &[cfg.num_experts, h], "num_local_experts, hidden_size")?;
                if experts.len() != cfg.num_experts {
                    return Err(Error::bad_tensor(
                        path,
                        &router.name,
                        format!("the layer has {} experts but the config says {}", experts.len(), cfg.num_experts),
                    ));
                }
                for e in experts {
                    check(&e.gate, &[inter, h], "intermediate_size, hidden_size")?;
                    check(&e.up, &[inter, h], "intermediate_size, hidden_size")?;
                    check(&e.down, &[h, inter], "hidden_size, intermediate_size")?;
                }
            }
        }
    }
    check(&w.norm, &[h], "hidden_size")?;
    check(&w.lm_head, &[cfg.vocab_size, h], "vocab_size, hidden_size")?;
    let needs_factors = matches!(cfg.rope_scaling, Some(tboost_ops::RopeScaling::LongRope { .. }));
    match &w.rope_factors {
        Some(f) => {
            for t in [&f.short, &f.long] {
                check(t, &[cfg.rope_dim / 2], "rope_dim / 2 (LongRoPE factors)")?;
            }
        }
        None if needs_factors => {
            return Err(Error::config(
                path.display().to_string(),
                "rope_scaling",
                "LongRoPE needs its short and long factors",
            ))
        }
        None => {}
    }
    Ok(())
}

/// The tensors of a checkpoint by name, taken out one by one while the weights are
/// assembled; what is left at the end is an error (a weight the graph would silently
/// ignore, like an o_proj bias, must not load as if it were absent).
pub(crate) struct TensorSet {
    map: HashMap<String, Tensor>,
    /// File each tensor came from (for errors in sharded checkpoints).
    file_of: HashMap<String, PathBuf>,
    /// The file or directory named when a tensor is missing.
    path: PathBuf,
}

impl TensorSet {
    pub(crate) fn new(path: &Path) -> Self {
        TensorSet { map: HashMap::new(), file_of: HashMap::new(), path: path.to_path_buf() }
    }

    /// Adds a tensor read from `file`; a name seen twice is an error.
    pub(crate) fn insert(&mut self, t: Tensor, file: &Path) -> Result<()> {
        if let Some(prev) = self.file_of.get(&t.name) {
            return Err(Error::bad_tensor(file, &t.name, format!("appears twice (also in {})", prev.display())));
        }
        self.file_of.insert(t.name.clone(), file.to_path_buf());
        self.map.insert(t.name.clone(), t);
        Ok(())
    }

    /// Tensors added so far (taken ones included).
    pub(crate) fn len(&self) -> usize {
        self.file_of.len()
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    pub(crate) fn take(&mut self, name: &str) -> Result<Tensor> {
        self.map.remove(name).ok_or_else(|| Error::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
    }

    pub(crate) fn take_opt(&mut self, name: &str) -> Option<Tensor> {
        self.map.remove(name)
    }

    /// The file a tensor came from (its name may carry an `[expert N]` suffix).
    pub(crate) fn file_of(&self, name: &str) -> &Path {
        let base = name.split('[').next().unwrap_or(name);
        self.file_of.get(base).map(PathBuf::as_path).unwrap_or(&self.path)
    }

    /// The file a tensor of exactly this name came from.
    pub(crate) fn file_of_exact(&self, name: &str) -> Option<&Path> {
        self.file_of.get(name).map(PathBuf::as_path)
    }

    /// Fails when tensors are left that no weight slot took.
    pub(crate) fn finish(&self) -> Result<()> {
        if self.map.is_empty() {
            return Ok(());
        }
        let mut names: Vec<&str> = self.map.keys().map(String::as_str).collect();
        names.sort_unstable();
        let shown: Vec<String> = names.iter().take(5).map(|n| format!("`{n}`")).collect();
        let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
        Err(Error::format(
            &self.path,
            format!(
                "{} tensor(s) that this architecture does not use: {}{more} (unsupported variant, or the config does not match the weights)",
                names.len(),
                shown.join(", ")
            ),
        ))
    }
}

/// Runs `check_shapes` and names the file a bad tensor came from.
pub(crate) fn check_shapes_in(cfg: &ModelConfig, w: &ModelWeights, set: &TensorSet, path: &Path) -> Result<()> {
    check_shapes(cfg, w, path).map_err(|e| match e {
        Error::BadTensor { tensor, msg, .. } => {
            let path = set.file_of(&tensor).to_path_buf();
            Error::BadTensor { path, tensor, msg }
        }
        e => e,
    })
}
