//! Elementwise activations and softmax.

/// `out = silu(gate) * up`, `silu(g) = g / (1 + exp(-g))`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let _ = (gate, up, out);
    unimplemented!()
}

/// In-place softmax of each row of `cols` values (max-subtracted).
pub fn softmax_rows(x: &mut [f32], cols: usize) {
    let _ = (x, cols);
    unimplemented!()
}
