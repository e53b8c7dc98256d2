//! The definition of rotary position embedding: pairing styles, frequencies and scaling.
//!
//! - `HalfSplit` (HF `rotate_half`, GGML "NeoX"): dim `i` pairs with `i + rot_dim/2`.
//! - `Adjacent` (GGML "normal", llama2.c, GGUF llama q/k): dim `2i` pairs with `2i+1`.
//!
//! Pair `i` of a token at position `pos` rotates by `pos * inv_freq[i]`, and the rotated
//! values are multiplied by [`RopeParams::attention_factor`] (YaRN's and LongRoPE's
//! "mscale": HF multiplies its cos/sin tables by it). What a backend computes its cos/sin
//! tables from is [`RopeParams`] (plus, for LongRoPE, the per-frequency factors, a weight);
//! [`RopeParams::inv_freq`] is the definition every backend follows (in f64). The formulas are
//! transformers' `modeling_rope_utils` (`_compute_{linear_scaling,llama3,yarn,longrope}_parameters`).

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

/// YaRN (Peng et al. 2023, arXiv:2309.00071; transformers `_compute_yarn_parameters`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Multiplier of cos/sin (resolved: the config's `attention_factor`, else from `mscale`).
    pub attention_factor: f64,
    /// Round the correction range outwards (HF `truncate`, default true).
    pub truncate: bool,
}

/// The RoPE scaling kinds tboost implements.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    Llama3(Llama3Scaling),
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    Yarn(YarnScaling),
    /// LongRoPE (Phi-3): frequency `i` divided by a per-dimension factor (the short or the
    /// long list, chosen per sequence by its length; the lists are weights, not parameters)
    /// and cos/sin multiplied by `attention_factor`.
    LongRope {
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
}

impl RopeScaling {
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Llama3(_) => "llama3",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Yarn(_) => "yarn",
            RopeScaling::LongRope { .. } => "longrope",
        }
    }
}

/// Everything that defines a model's rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RopeParams {
    /// Rotated dimensions of each head (even, at most head_dim).
    pub dim: usize,
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
    pub style: RopeStyle,
}

impl RopeParams {
    /// Inverse frequencies `theta^(-2i/dim)` for `i in 0..dim/2`, adjusted by the scaling
    /// if given. Computed in f64. LongRoPE's per-dimension factors are not applied here
    /// (see [`RopeParams::inv_freq_with`]).
    ///
    /// llama3: with `wavelen = 2π / inv`, `low = orig_max / low_freq_factor` and
    /// `high = orig_max / high_freq_factor`: wavelengths below `high` keep their frequency,
    /// above `low` are divided by `factor`, and in between blend with
    /// `smooth = (orig_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`
    /// as `(1 - smooth) * inv / factor + smooth * inv`.
    pub fn inv_freq(&self) -> Vec<f64> {
        inv_freq_scaled(self.dim, self.theta, self.scaling.as_ref())
    }

    /// [`RopeParams::inv_freq`] with frequency `i` divided by `factors[i]` (LongRoPE's short or
    /// long list, llama.cpp's `rope_freqs`), when given.
    pub fn inv_freq_with(&self, factors: Option<&[f32]>) -> Vec<f64> {
        let mut inv = self.inv_freq();
        if let Some(f) = factors {
            for (v, &e) in inv.iter_mut().zip(f) {
                *v /= e as f64;
            }
        }
        inv
    }

    /// The factor cos and sin are multiplied by (1 without YaRN or LongRoPE).
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            Some(RopeScaling::Yarn(y)) => y.attention_factor,
            Some(RopeScaling::LongRope { attention_factor, .. }) => attention_factor,
            _ => 1.0,
        }
    }

    /// Whether the tables need per-frequency factors (LongRoPE).
    pub fn needs_factors(&self) -> bool {
        matches!(self.scaling, Some(RopeScaling::LongRope { .. }))
    }
}

/// Unscaled or llama3-scaled inverse frequencies (kept for callers of the llama3-only form).
pub fn inv_freq(rot_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f64> {
    inv_freq_scaled(rot_dim, theta, scaling.map(|s| RopeScaling::Llama3(*s)).as_ref())
}

/// See [`RopeParams::inv_freq`].
pub fn inv_freq_scaled(rot_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let half = rot_dim / 2;
    let base: Vec<f64> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f64 / rot_dim as f64)).collect();
    match scaling {
        None | Some(RopeScaling::LongRope { .. }) => base,
        Some(RopeScaling::Llama3(s)) => base.into_iter().map(|inv| llama3(inv, s)).collect(),
        Some(RopeScaling::Linear { factor }) => base.into_iter().map(|inv| inv / factor).collect(),
        Some(RopeScaling::Yarn(y)) => {
            let (low, high) = yarn_correction_range(y, rot_dim, theta);
            let high = if low == high { high + 0.001 } else { high };
            base.into_iter()
                .enumerate()
                .map(|(i, inv)| {
                    // HF: extrapolation weight `1 - clamp((i - low) / (high - low), 0, 1)`.
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extra = 1.0 - ramp;
                    (inv / y.factor) * (1.0 - extra) + inv * extra
                })
                .collect()
        }
    }
}

/// YaRN's `find_correction_range(beta_fast, beta_slow, dim, base, original_max)`.
fn yarn_correction_range(y: &YarnScaling, dim: usize, base: f64) -> (f64, f64) {
    let corr = |rot: f64| {
        (dim as f64 * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

/// YaRN's `get_mscale(scale, mscale)`: `0.1 * mscale * ln(scale) + 1` above 1, else 1.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(scaling: Option<RopeScaling>) -> RopeParams {
        RopeParams { dim: 64, theta: 10000.0, scaling, style: RopeStyle::HalfSplit }
    }

    /// Linear: every frequency divided by the factor, any factor.
    #[test]
    fn linear_divides_every_frequency() {
        let plain = params(None).inv_freq();
        for factor in [0.5, 2.0, 3.7, 16.0] {
            let s = params(Some(RopeScaling::Linear { factor })).inv_freq();
            for (a, b) in s.iter().zip(&plain) {
                assert!((a - b / factor).abs() <= 1e-18 * b.abs().max(1.0), "factor {factor}");
            }
            assert_eq!(params(Some(RopeScaling::Linear { factor })).attention_factor(), 1.0);
        }
    }

    /// YaRN against the formulas of `_compute_yarn_parameters` written out by hand for
    /// dim 64, base 10000, factor 4, original 2048, beta 32/1: the correction range is
    /// floor(dim*ln(2048/(32*2π))/(2 ln 1e4)) = floor(8.06) = 8 to ceil(dim*ln(2048/(2π))/(2 ln 1e4))
    /// = ceil(20.11) = 21; frequencies below index 8 are kept, above 21 divided by 4, and in
    /// between blended linearly.
    #[test]
    fn yarn_matches_the_hf_formulas() {
        let y = YarnScaling {
            factor: 4.0,
            original_max_position_embeddings: 2048.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_mscale(4.0, 1.0),
            truncate: true,
        };
        let (low, high) = yarn_correction_range(&y, 64, 10000.0);
        let want_low = (64.0 * (2048.0 / (32.0 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 10000f64.ln())).floor();
        let want_high = (64.0 * (2048.0 / (2.0 * std::f64::consts::PI)).ln() / (2.0 * 10000f64.ln())).ceil();
        assert_eq!((low, high), (want_low, want_high));
        assert_eq!((low, high), (8.0, 21.0));
        let plain = params(None).inv_freq();
        let s = params(Some(RopeScaling::Yarn(y))).inv_freq();
        for i in 0..32 {
            let ramp = ((i as f64 - 8.0) / 13.0).clamp(0.0, 1.0);
            let want = plain[i] / 4.0 * ramp + plain[i] * (1.0 - ramp);
            assert!((s[i] - want).abs() <= 1e-15 * want, "dim pair {i}: {} vs {want}", s[i]);
        }
        assert_eq!(s[0], plain[0]);
        assert!((s[31] - plain[31] / 4.0).abs() < 1e-20);
        // mscale: 0.1 ln 4 + 1.
        let p = params(Some(RopeScaling::Yarn(y)));
        assert!((p.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        assert_eq!(yarn_mscale(1.0, 1.0), 1.0);
        // Without truncation the range is fractional.
        let nt = YarnScaling { truncate: false, ..y };
        let (l, h) = yarn_correction_range(&nt, 64, 10000.0);
        assert!(l > 8.0 && l < 9.0 && h > 20.0 && h < 21.0, "{l} {h}");
    }

    /// LongRoPE: `inv_freq_i = theta^(-2i/d) / ext_i`, cos/sin times the attention factor.
    #[test]
    fn longrope_divides_by_the_factors() {
        let att = (1.0 + (256f64 / 32.0).ln() / 32f64.ln()).sqrt();
        let p = params(Some(RopeScaling::LongRope { original_max_position_embeddings: 32.0, attention_factor: att }));
        let ext: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.25).collect();
        let plain = params(None).inv_freq();
        for (i, v) in p.inv_freq_with(Some(&ext)).iter().enumerate() {
            assert!((v - plain[i] / ext[i] as f64).abs() <= 1e-18);
        }
        assert!((p.attention_factor() - 1.264_911_064).abs() < 1e-9);
        assert!(p.needs_factors());
    }
}
