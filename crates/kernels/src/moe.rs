//! Mixture of experts: router top-k and the grouped expert FFN.
//!
//! Mixtral routing: `p = softmax(router_logits)` over all experts, take the top-k of `p`,
//! renormalize those weights to sum to 1. The FFN then groups tokens by expert and runs each
//! expert's SwiGLU MLP only on the tokens routed to it (never all tokens through all experts),
//! and sums each token's expert outputs weighted, in rank order (fixed per token).
//!
//! Batch invariance: routing is per token; an expert's matmuls give each row the same bits
//! whatever the other rows (see `matmul`); the weighted sum runs in rank order. So a token's
//! output does not depend on which other tokens share the batch or the experts.
//!
//! Expert batching ([`MoeTiling`], the last parameter of [`moe_ffn`]): by default each
//! expert runs all its tokens as one batch, experts one after another, each batch's matmuls
//! split over the pool. `expert_batch_tokens` caps the tokens of a batch (an expert with more
//! runs several), `parallel_expert_batches` runs that many batches at once as parallel tasks.
//! By the invariance above neither changes a bit of the output.

use crate::gemm::{self, MatSeg};
use crate::WeightMat;
use rayon::prelude::*;
pub use tboost_ops::MoeTiling;
use tboost_ops::Tiling;

/// One expert's SwiGLU MLP weights.
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate: WeightMat<'a>,
    pub up: WeightMat<'a>,
    pub down: WeightMat<'a>,
}

/// Whether `gemm::matmul_swiglu` takes this gate/up pair: the same dense dtype, or both
/// quantized (each block type dequantized on its own).
pub fn swiglu_fusable(gate: &WeightMat<'_>, up: &WeightMat<'_>) -> bool {
    gate.dtype == up.dtype || (gate.dtype.is_quantized() && up.dtype.is_quantized())
}

/// Routing needs `1 <= k <= n_experts`.
pub fn supports(n_experts: usize, k: usize) -> Result<(), tboost_ops::Unsupported> {
    if k == 0 || k > n_experts {
        return Err(tboost_ops::Unsupported::new("top_k", k, format!("in 1..={n_experts} (experts)")));
    }
    Ok(())
}

/// Top-k routing of `[tokens, n_experts]` router logits. Returns `(expert ids, weights)`,
/// each `[tokens, k]`, ranked by weight (ties: lower expert id first).
///
/// Per token: `p = softmax(logits)` in f32 (max subtracted, the sum of exponentials taken
/// in expert order), the `k` largest `p`, and when `renormalize` each divided by their sum
/// (taken in rank order); otherwise the weights are the `p` themselves.
///
/// # Panics
/// When `n_experts` is 0, `logits` is not a whole number of rows, or `k` is not in
/// `1..=n_experts` (the orchestrator validates these against the model config).
pub fn route_topk(logits: &[f32], n_experts: usize, k: usize, renormalize: bool) -> (Vec<u32>, Vec<f32>) {
    assert!(n_experts > 0, "route_topk: n_experts must be positive");
    assert!(
        logits.len().is_multiple_of(n_experts),
        "route_topk: {} logits are not rows of {n_experts} experts",
        logits.len()
    );
    assert!((1..=n_experts).contains(&k), "route_topk: k = {k} must be in 1..={n_experts}");
    let tokens = logits.len() / n_experts;
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    let mut p = vec![0f32; n_experts];
    let mut order: Vec<u32> = Vec::with_capacity(n_experts);
    for row in logits.chunks_exact(n_experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (pe, &l) in p.iter_mut().zip(row) {
            *pe = (l - max).exp();
            sum += *pe;
        }
        for pe in p.iter_mut() {
            *pe /= sum;
        }
        order.clear();
        order.extend(0..n_experts as u32);
        // A stable sort on descending weight keeps lower ids first among equal weights.
        order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
        let top = &order[..k];
        let norm = top.iter().fold(0f32, |s, &e| s + p[e as usize]);
        for &e in top {
            ids.push(e);
            weights.push(if renormalize { p[e as usize] / norm } else { p[e as usize] });
        }
    }
    (ids, weights)
}

/// `out[t] = Σ_r weights[t, r] * expert[ids[t, r]](x[t])`, `x`/`out` are `[tokens, hidden]`,
/// with the expert batching of `tiling` (`MoeTiling::default()`: each expert's tokens in one
/// batch, experts one after another; no tiling changes a bit of the output).
///
/// Each expert computes `down · (silu(gate · x) * (up · x))` with `matmul_swiglu` and
/// `matmul` on the rows of the tokens routed to it only. The weighted sum per element is
/// `((0 + w0*y0) + w1*y1) + ...` in rank order, each product and sum rounded to f32.
///
/// # Panics
/// On shapes that disagree (experts with different shapes, `gate`/`up` not
/// `[inter, hidden]`, `down` not `[hidden, inter]`, `x`/`out` not `[tokens, hidden]`,
/// `ids`/`weights` not `[tokens, k]`), no experts, an expert id out of range, or a tiling
/// value outside its range (`tboost_ops::check_moe_tiling`).
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    x: &[f32],
    tokens: usize,
    experts: &[Expert<'_>],
    ids: &[u32],
    weights: &[f32],
    k: usize,
    out: &mut [f32],
    tiling: &MoeTiling,
) {
    if let Err(e) = tiling.check() {
        panic!("moe_ffn: tiling: {e}");
    }
    let first = experts.first().expect("moe_ffn: no experts");
    let (inter, hidden) = (first.gate.rows, first.gate.cols);
    for (e, ex) in experts.iter().enumerate() {
        let shapes = [(ex.gate.rows, ex.gate.cols), (ex.up.rows, ex.up.cols), (ex.down.rows, ex.down.cols)];
        assert!(
            shapes == [(inter, hidden), (inter, hidden), (hidden, inter)],
            "moe_ffn: expert {e} has gate/up/down {shapes:?}, expected [{inter}, {hidden}] x2 and [{hidden}, {inter}]"
        );
    }
    assert_eq!(x.len(), tokens * hidden, "moe_ffn: x has {} values, expected [{tokens}, {hidden}]", x.len());
    assert_eq!(out.len(), tokens * hidden, "moe_ffn: out has {} values, expected [{tokens}, {hidden}]", out.len());
    assert_eq!(ids.len(), tokens * k, "moe_ffn: ids has {} values, expected [{tokens}, {k}]", ids.len());
    assert_eq!(weights.len(), tokens * k, "moe_ffn: weights has {} values, expected [{tokens}, {k}]", weights.len());

    // Slots (t * k + r) routed to each expert, in token order.
    let mut slots: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
    for (slot, &e) in ids.iter().enumerate() {
        let n_exp = experts.len();
        let list = slots
            .get_mut(e as usize)
            .unwrap_or_else(|| panic!("moe_ffn: token {} rank {} routes to expert {e} of {n_exp}", slot / k, slot % k));
        list.push(slot);
    }

    // ys[slot] = expert output for (token, rank); each expert runs on its tokens only.
    // Reserved fallibly: a failed allocation is a panic naming the shape (which the C ABI
    // turns into a status), not an abort of the host process.
    let n = tokens
        .checked_mul(k)
        .and_then(|n| n.checked_mul(hidden))
        .unwrap_or_else(|| panic!("moe_ffn: {tokens} tokens x top-{k} x hidden {hidden} overflows"));
    let mut ys = Vec::new();
    if let Err(e) = ys.try_reserve_exact(n) {
        panic!("moe_ffn: cannot allocate {n} floats for {tokens} tokens x top-{k} x hidden {hidden}: {e}");
    }
    ys.resize(n, 0f32);
    // Expert batches, in expert order: (expert, the slots it runs), at most
    // `expert_batch_tokens` slots each; experts with no tokens have none.
    let per_batch = tiling.expert_batch_tokens.unwrap_or(usize::MAX).max(1);
    let batches: Vec<(&Expert<'_>, &[usize])> =
        experts.iter().zip(&slots).flat_map(|(ex, list)| list.chunks(per_batch).map(move |c| (ex, c))).collect();
    let mut put = |list: &[usize], y: &[f32]| {
        for (row, &slot) in y.chunks_exact(hidden).zip(list) {
            ys[slot * hidden..(slot + 1) * hidden].copy_from_slice(row);
        }
    };
    match tiling.parallel_expert_batches.unwrap_or(1) {
        0 | 1 => {
            let mut s = BatchScratch::default();
            for &(ex, list) in &batches {
                expert_batch(x, k, ex, list, &mut s);
                put(list, &s.y);
            }
        }
        at_once => {
            for group in batches.chunks(at_once) {
                let done: Vec<BatchScratch> = group
                    .par_iter()
                    .map(|&(ex, list)| {
                        let mut s = BatchScratch::default();
                        expert_batch(x, k, ex, list, &mut s);
                        s
                    })
                    .collect();
                for (&(_, list), s) in group.iter().zip(&done) {
                    put(list, &s.y);
                }
            }
        }
    }

    combine(&ys, weights, k, hidden, out);
}

/// The buffers of one expert batch (reused across batches run one after another).
#[derive(Default)]
struct BatchScratch {
    xs: Vec<f32>,
    h: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    /// The batch's expert outputs, `[list.len(), hidden]`.
    y: Vec<f32>,
}

/// One expert over the tokens of `list` (slots `t * k + r`): `s.y` = its outputs, in `list`
/// order.
fn expert_batch(x: &[f32], k: usize, ex: &Expert<'_>, list: &[usize], s: &mut BatchScratch) {
    let (inter, hidden, cnt) = (ex.gate.rows, ex.gate.cols, list.len());
    s.xs.clear();
    for &slot in list {
        let t = slot / k;
        s.xs.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
    }
    s.h.resize(cnt * inter, 0.0);
    if swiglu_fusable(&ex.gate, &ex.up) {
        gemm::matmul_swiglu(&s.xs, cnt, ex.gate, ex.up, &mut s.h);
    } else {
        // Gate and up of different dtype families (a file may quantize them apart): two
        // matmuls and the activation, the same arithmetic per element.
        s.g.resize(cnt * inter, 0.0);
        s.u.resize(cnt * inter, 0.0);
        gemm::matmul(&s.xs, cnt, &mut [MatSeg { w: ex.gate, bias: None, out: &mut s.g }]);
        gemm::matmul(&s.xs, cnt, &mut [MatSeg { w: ex.up, bias: None, out: &mut s.u }]);
        crate::activation::swiglu(&s.g, &s.u, &mut s.h);
    }
    s.y.resize(cnt * hidden, 0.0);
    gemm::matmul(&s.h, cnt, &mut [MatSeg { w: ex.down, bias: None, out: &mut s.y }]);
}

/// `out[t] = Σ_r weights[t, r] * ys[t * k + r]`, rows of `hidden` values, summed in rank
/// order from zero: the one combine both MoE paths (grouped and per expert) use.
///
/// # Panics
/// When `ys` is not `[out rows * k, hidden]` or `weights` not `[out rows, k]`.
pub fn combine(ys: &[f32], weights: &[f32], k: usize, hidden: usize, out: &mut [f32]) {
    if hidden == 0 {
        return;
    }
    let tokens = out.len() / hidden;
    assert_eq!(
        ys.len(),
        tokens * k * hidden,
        "moe combine: ys has {} values, expected [{tokens} x {k}, {hidden}]",
        ys.len()
    );
    assert_eq!(
        weights.len(),
        tokens * k,
        "moe combine: weights has {} values, expected [{tokens}, {k}]",
        weights.len()
    );
    out.par_chunks_mut(hidden).enumerate().for_each(|(t, o)| {
        o.fill(0.0);
        for r in 0..k {
            let w = weights[t * k + r];
            let yr = &ys[(t * k + r) * hidden..(t * k + r + 1) * hidden];
            for (o, &v) in o.iter_mut().zip(yr) {
                *o += w * v;
            }
        }
    });
}

/// Plain reference for the tests: every token through its routed experts, in f64.
pub mod reference {
    use super::Expert;
    use crate::gemm::reference::weight_at;
    use crate::WeightMat;

    /// One token: `Σ_r w_r * down · (silu(gate · x) * (up · x))`, all in f64.
    pub fn moe_token(x: &[f32], experts: &[Expert<'_>], ids: &[u32], weights: &[f32]) -> Vec<f64> {
        let dot = |m: &WeightMat<'_>, r: usize, v: &[f64]| -> f64 {
            v.iter().enumerate().map(|(c, &a)| a * weight_at(m, r, c) as f64).sum()
        };
        let xd: Vec<f64> = x.iter().map(|&a| a as f64).collect();
        let mut out = vec![0f64; x.len()];
        for (&e, &w) in ids.iter().zip(weights) {
            let ex = &experts[e as usize];
            let h: Vec<f64> = (0..ex.gate.rows)
                .map(|i| {
                    let g = dot(&ex.gate, i, &xd);
                    g / (1.0 + (-g).exp()) * dot(&ex.up, i, &xd)
                })
                .collect();
            for (j, o) in out.iter_mut().enumerate() {
                *o += w as f64 * dot(&ex.down, j, &h);
            }
        }
        out
    }
}
