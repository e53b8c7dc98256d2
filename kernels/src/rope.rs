//! Rotary position embedding, both pairings, with llama3 frequency scaling.
//!
//! - `HalfSplit` (HF `rotate_half`, GGML "NeoX"): dim `i` pairs with `i + head_dim/2`.
//! - `Adjacent` (GGML "normal", llama2.c, GGUF llama q/k): dim `2i` pairs with `2i+1`.
//! Both rotate pair `i` by angle `pos * inv_freq[i]`.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    HalfSplit,
    Adjacent,
}

/// llama3 frequency scaling (transformers `_compute_llama3_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// Inverse frequencies `theta^(-2i/rot_dim)` for `i in 0..rot_dim/2`, adjusted by the
/// scaling if given. Computed in f64.
pub fn inv_freq(rot_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f64> {
    let _ = (rot_dim, theta, scaling);
    unimplemented!()
}

/// cos/sin tables `[positions.len(), inv_freq.len()]` (angles computed in f64, stored f32).
pub fn cos_sin(positions: &[u32], inv_freq: &[f64]) -> (Vec<f32>, Vec<f32>) {
    let _ = (positions, inv_freq);
    unimplemented!()
}

/// Rotates `x` (`[rows, heads, head_dim]`, row `r` at the position whose tables are row `r`
/// of `cos`/`sin`) in place. Only the first `2 * cos-row-len` dims of each head rotate.
pub fn apply(x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32], style: RopeStyle) {
    let _ = (x, heads, head_dim, cos, sin, style);
    unimplemented!()
}
