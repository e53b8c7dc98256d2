//! The definition of rotary position embedding: pairing styles and frequencies.
//!
//! - `HalfSplit` (HF `rotate_half`, GGML "NeoX"): dim `i` pairs with `i + rot_dim/2`.
//! - `Adjacent` (GGML "normal", llama2.c, GGUF llama q/k): dim `2i` pairs with `2i+1`.
//!
//! Pair `i` of a token at position `pos` rotates by `pos * inv_freq[i]`. What a backend
//! computes its cos/sin tables from is [`RopeParams`]; [`RopeParams::inv_freq`] is the
//! definition every backend follows (in f64).

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    HalfSplit,
    Adjacent,
}

/// llama3 frequency scaling (transformers `_compute_llama3_parameters`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// Everything that defines a model's rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RopeParams {
    /// Rotated dimensions of each head (even, at most head_dim).
    pub dim: usize,
    pub theta: f64,
    pub scaling: Option<Llama3Scaling>,
    pub style: RopeStyle,
}

impl RopeParams {
    /// Inverse frequencies `theta^(-2i/dim)` for `i in 0..dim/2`, adjusted by the scaling
    /// if given. Computed in f64.
    ///
    /// llama3: with `wavelen = 2π / inv`, `low = orig_max / low_freq_factor` and
    /// `high = orig_max / high_freq_factor`: wavelengths below `high` keep their frequency,
    /// above `low` are divided by `factor`, and in between blend with
    /// `smooth = (orig_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`
    /// as `(1 - smooth) * inv / factor + smooth * inv`.
    pub fn inv_freq(&self) -> Vec<f64> {
        inv_freq(self.dim, self.theta, self.scaling.as_ref())
    }
}

/// See [`RopeParams::inv_freq`].
pub fn inv_freq(rot_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f64> {
    (0..rot_dim / 2)
        .map(|i| {
            let inv = 1.0 / theta.powf((2 * i) as f64 / rot_dim as f64);
            match scaling {
                None => inv,
                Some(s) => llama3(inv, s),
            }
        })
        .collect()
}

fn llama3(inv: f64, s: &Llama3Scaling) -> f64 {
    let orig = s.original_max_position_embeddings;
    let low_freq_wavelen = orig / s.low_freq_factor;
    let high_freq_wavelen = orig / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / inv;
    if wavelen < high_freq_wavelen {
        inv
    } else if wavelen > low_freq_wavelen {
        inv / s.factor
    } else {
        let smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv / s.factor + smooth * inv
    }
}
