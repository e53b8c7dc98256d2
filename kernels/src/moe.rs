//! Mixture of experts: router top-k and the grouped expert FFN.
//!
//! Mixtral routing: `p = softmax(router_logits)` over all experts, take the top-k of `p`,
//! renormalize those weights to sum to 1. The FFN then groups tokens by expert and runs each
//! expert's SwiGLU MLP only on the tokens routed to it (never all tokens through all experts),
//! and sums each token's expert outputs weighted, in rank order (fixed per token).

use crate::WeightMat;

/// One expert's SwiGLU MLP weights.
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate: WeightMat<'a>,
    pub up: WeightMat<'a>,
    pub down: WeightMat<'a>,
}

/// Top-k routing of `[tokens, n_experts]` router logits. Returns `(expert ids, weights)`,
/// each `[tokens, k]`, ranked by weight (ties: lower expert id first).
pub fn route_topk(logits: &[f32], n_experts: usize, k: usize, renormalize: bool) -> (Vec<u32>, Vec<f32>) {
    let _ = (logits, n_experts, k, renormalize);
    unimplemented!()
}

/// `out[t] = Σ_r weights[t, r] * expert[ids[t, r]](x[t])`, `x`/`out` are `[tokens, hidden]`.
pub fn moe_ffn(
    x: &[f32],
    tokens: usize,
    experts: &[Expert<'_>],
    ids: &[u32],
    weights: &[f32],
    k: usize,
    out: &mut [f32],
) {
    let _ = (x, tokens, experts, ids, weights, k, out);
    unimplemented!()
}
