//! Attention over the paged KV cache: flash, paged decode and standard kernels, against a
//! causal f64 reference, over block tables with holes and garbage in unused slots.

use tboost_engine::backend::{AttnKind, DType, KvLayer, Op, OpQuery, SeqRange, StepHost};
use tboost_ops::{AttentionCase, AttnParams, AttnPhase};
use tboost_testkit::golden::Rng;

use super::measure::{Measured, R};
use super::numbers::{encode, round_to, tiny_act, u_act, MIN_NORMAL, U};
use super::suite::{empty_host, Dev, Suite};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Whole prompts: q_len = ctx_len.
    Prefill,
    /// Later chunks of prompts: q_len < ctx_len, earlier positions already in the cache.
    Chunked,
    /// One new token for several sequences at different lengths.
    Decode,
    /// A step as the scheduler builds it: decodes first, then prefill chunks (two launches).
    Mixed,
}

impl Phase {
    /// `(ctx_len, q_len)` of each sequence, and the block size of the case.
    fn seqs(self) -> (Vec<(usize, usize)>, usize) {
        match self {
            // 70 crosses a 64-position flash tile, 16 is exactly one query row block.
            Phase::Prefill => (vec![(37, 37), (70, 70), (16, 16)], 16),
            Phase::Chunked => (vec![(100, 30), (65, 17), (20, 3)], 32),
            // 1: a one-token context; 16/17: either side of a block edge; 64: exactly one
            // flash tile; 130: three tiles.
            Phase::Decode => (vec![(1, 1), (16, 1), (17, 1), (63, 1), (64, 1), (130, 1)], 16),
            Phase::Mixed => (vec![(40, 1), (5, 1), (80, 20), (9, 9)], 8),
        }
    }
}

const TOL_ATTN: &str =
    "per output (e^{2Δ} − 1 + (3·ctx + 32)·2⁻²⁴)·Σ_j p_j·|v_j|, Δ = max_j (hd + 2)·2⁻²⁴·scale·Σ|q·k_j|: \
                        f32 score error perturbs each softmax weight by at most e^{2Δ}, exp/sum/P·V roundings add \
                        O(ctx) ulps; reference reads K/V rounded to the kv dtype. 16-bit activations (q, k, v \
                        rounded first): + 2u·Σ_j p_j·|v_j| for P·V with P in the activation dtype (as flash \
                        kernels on NPUs feed it) and the rounded output";

struct AttnCase {
    kind: AttnKind,
    hd: usize,
    heads: usize,
    kv_heads: usize,
    kv: DType,
    phase: Phase,
    /// The backend's activation dtype.
    act: DType,
    /// Tokens per KV block: the phase's, or the backend's preferred size when it is larger than
    /// the CPU's 16 (FIA's paged prefill takes multiples of 128).
    block: usize,
    /// Sliding window (0 = causal over every earlier position): the query at `p` sees
    /// `p + 1 - window ..= p`; on Ascend FIA's band mode.
    window: usize,
}

/// Causal attention in f64 over `k`/`v` given per sequence in position order (`[ctx,
/// kv_heads, hd]`, values as stored), within the case's window, with the bound of `TOL_ATTN`.
fn attention_ref(
    q: &[f32],
    seqs: &[(usize, usize, usize)],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    c: &AttnCase,
    scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    let (hd, nh, kvh) = (c.hd, c.heads, c.kv_heads);
    let group = nh / kvh;
    let scale = scale as f64;
    let (mut out, mut bound) = (vec![0f64; q.len()], vec![0f64; q.len()]);
    for (s, &(q_start, q_len, ctx)) in seqs.iter().enumerate() {
        for r in 0..q_len {
            let pos = ctx - q_len + r;
            for h in 0..nh {
                let g = h / group;
                let qo = ((q_start + r) * nh + h) * hd;
                let first = if c.window > 0 { (pos + 1).saturating_sub(c.window) } else { 0 };
                let mut scores = Vec::with_capacity(pos + 1);
                let mut delta = 0f64;
                for j in first..=pos {
                    let ko = (j * kvh + g) * hd;
                    let (mut dot, mut abs) = (0f64, 0f64);
                    for dd in 0..hd {
                        let p = q[qo + dd] as f64 * k[s][ko + dd] as f64;
                        dot += p;
                        abs += p.abs();
                    }
                    scores.push(dot * scale);
                    delta = delta.max((hd + 2) as f64 * U * scale * abs);
                }
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                let eps = (2.0 * delta).exp_m1() + (3 * (pos + 1 - first) + 32) as f64 * U;
                for dd in 0..hd {
                    let (mut acc, mut abs) = (0f64, 0f64);
                    for j in first..=pos {
                        let vv = v[s][(j * kvh + g) * hd + dd] as f64;
                        acc += e[j - first] * vv;
                        abs += e[j - first] * vv.abs();
                    }
                    out[qo + dd] = acc / sum;
                    bound[qo + dd] = (eps + 2.0 * u_act(c.act)) * abs / sum + MIN_NORMAL + tiny_act(c.act);
                }
            }
        }
    }
    (out, bound)
}

fn attention_case(d: &mut Dev<'_>, c: &AttnCase, runs: &[(AttnKind, usize, usize)], rng: &mut Rng) -> R<Measured> {
    let (lens, _) = c.phase.seqs();
    let (bs, act) = (c.block, c.act);
    let (hd, kvh, nh) = (c.hd, c.kv_heads, c.heads);
    let row = kvh * hd;
    // Block tables with holes: the pool has twice the blocks needed plus three, handed out
    // in shuffled order, so tables are non-contiguous, unordered, and skip unused blocks.
    let need: Vec<usize> = lens.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).collect();
    let num_blocks = 2 * need.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let max_blocks = need.iter().max().copied().unwrap_or(0) + 1;
    let mut tables = vec![u32::MAX; lens.len() * max_blocks];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        let t = &mut tables[s * max_blocks..s * max_blocks + n];
        t.copy_from_slice(&ids[next..next + n]);
        // Never in ascending order, whatever the shuffle gave.
        if n >= 2 && t[0] < t[1] {
            t.swap(0, 1);
        }
        next += n;
    }
    let slot = |s: usize, p: usize| tables[s * max_blocks + p / bs] * bs as u32 + (p % bs) as u32;
    // K/V of every position, and the values the cache holds after rounding to its dtype.
    // (As the activation dtype holds them: the K/V written come from activation buffers.)
    let kf: Vec<Vec<f32>> = lens.iter().map(|&(ctx, _)| round_to(act, &rng.vec(ctx * row, 1.5))).collect();
    let vf: Vec<Vec<f32>> = lens.iter().map(|&(ctx, _)| round_to(act, &rng.vec(ctx * row, 1.5))).collect();
    let ks: Vec<Vec<f32>> = kf.iter().map(|k| round_to(c.kv, k)).collect();
    let vs: Vec<Vec<f32>> = vf.iter().map(|v| round_to(c.kv, v)).collect();

    let n = num_blocks * bs * row;
    // Unused slots hold large garbage: reading one outside the causal window shows.
    let garbage = encode(c.kv, &(0..n).map(|i| if i % 2 == 0 { 300.0 } else { -250.0 }).collect::<Vec<_>>());
    let (kp, vp) = (d.raw(c.kv, n, &garbage)?, d.raw(c.kv, n, &garbage)?);
    let cache = KvLayer { k: kp.buf, v: vp.buf, dtype: c.kv, num_blocks, block_size: bs, kv_heads: kvh, head_dim: hd };

    // An earlier step wrote the cached positions (chunked prefill's earlier chunks, the
    // decodes' contexts).
    let (mut slots0, mut k0, mut v0) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &(ctx, q_len)) in lens.iter().enumerate() {
        for p in 0..ctx - q_len {
            slots0.push(slot(s, p));
            k0.extend_from_slice(&kf[s][p * row..(p + 1) * row]);
            v0.extend_from_slice(&vf[s][p * row..(p + 1) * row]);
        }
    }
    if !slots0.is_empty() {
        let sv = d.step(&StepHost { slots: &slots0, ..empty_host() }, 0)?;
        let (kv_, vv) = (d.acts(act, &k0)?, d.acts(act, &v0)?);
        d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
        d.sync()?;
    }

    // This step: the new tokens of every sequence.
    let (mut positions, mut slots, mut seq_table, mut k1, mut v1) = (vec![], vec![], vec![], vec![], vec![]);
    let mut spans = Vec::new();
    let mut rows = 0usize;
    for (s, &(ctx, q_len)) in lens.iter().enumerate() {
        seq_table.push([rows as u32, q_len as u32, ctx as u32]);
        spans.push((rows, q_len, ctx));
        for p in ctx - q_len..ctx {
            positions.push(p as u32);
            slots.push(slot(s, p));
            k1.extend_from_slice(&kf[s][p * row..(p + 1) * row]);
            v1.extend_from_slice(&vf[s][p * row..(p + 1) * row]);
        }
        rows += q_len;
    }
    let host =
        StepHost { positions: &positions, slots: &slots, seqs: &seq_table, block_tables: &tables, ..empty_host() };
    let sv = d.step(&host, max_blocks)?;
    let q = round_to(act, &rng.vec(rows * nh * hd, 1.5));
    let qv = d.acts(act, &q)?;
    let out = d.acts(act, &vec![12344.0; q.len()])?;
    let (kv_, vv) = (d.acts(act, &k1)?, d.acts(act, &v1)?);
    d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
    let scale = 1.0 / (hd as f32).sqrt();
    let params = AttnParams { window: c.window, ..AttnParams::new(nh, kvh, hd, scale) };
    for &(kind, first, count) in runs {
        let row_start = seq_table[first][0] as usize;
        let last = seq_table[first + count - 1];
        let seqs = SeqRange {
            seqs: sv.seqs.sub(first * 3, count * 3),
            block_tables: sv.block_tables.sub(first * max_blocks, count * max_blocks),
            max_blocks,
            first,
            count,
            row_start,
            rows: (last[0] + last[1]) as usize - row_start,
        };
        d.launch(Op::Attention { kind, q: qv, cache, seqs, params, out })?;
    }
    d.sync()?;
    let got = d.read_act(out)?;
    let (want, bound) = attention_ref(&q, &spans, &ks, &vs, c, scale);
    let mut m = Measured::default();
    m.close("out", &got, &want, |i| bound[i])?;
    Ok(m)
}

pub fn flash(s: &mut Suite<'_>, rng: &mut Rng) {
    attention(s, rng, AttnKind::Flash);
}

pub fn paged_decode(s: &mut Suite<'_>, rng: &mut Rng) {
    attention(s, rng, AttnKind::PagedDecode);
}

pub fn standard(s: &mut Suite<'_>, rng: &mut Rng) {
    attention(s, rng, AttnKind::Standard);
}

/// Every case of one attention kernel: head dims, GQA groups, phases and KV dtypes.
fn attention(s: &mut Suite<'_>, rng: &mut Rng, kind: AttnKind) {
    let act = s.act;
    let block = |phase: Phase| if s.min_block > 16 { s.min_block } else { phase.seqs().1 };
    let mut cases = Vec::new();
    for hd in [24usize, 64, 128] {
        for (heads, kv_heads) in [(4usize, 4usize), (8, 2)] {
            for phase in [Phase::Prefill, Phase::Chunked, Phase::Decode, Phase::Mixed] {
                for kv in [DType::F32, DType::F16] {
                    cases.push(AttnCase { kind, hd, heads, kv_heads, kv, phase, act, block: block(phase), window: 0 });
                }
            }
        }
    }
    if matches!(kind, AttnKind::Flash | AttnKind::Standard) {
        let phase = Phase::Chunked;
        let (kv, block) = (DType::BF16, block(phase));
        cases.push(AttnCase { kind, hd: 64, heads: 8, kv_heads: 2, kv, phase, act, block, window: 0 });
    }
    // An odd GQA group: Qwen2.5-0.5B's 14 query heads over 2 kv heads of 64.
    for phase in [Phase::Prefill, Phase::Chunked, Phase::Decode, Phase::Mixed] {
        let block = block(phase);
        cases.push(AttnCase { kind, hd: 64, heads: 14, kv_heads: 2, kv: DType::F16, phase, act, block, window: 0 });
    }
    // Sliding windows (Mistral, Gemma 3's local layers): 24 positions, shorter than most
    // contexts of every phase, so each sequence's early blocks fall outside it; 1 (only itself).
    for window in [24, 1] {
        for phase in [Phase::Prefill, Phase::Chunked, Phase::Decode, Phase::Mixed] {
            let block = block(phase);
            cases.push(AttnCase { kind, hd: 64, heads: 8, kv_heads: 2, kv: DType::F16, phase, act, block, window });
        }
    }
    for c in cases {
        let (lens, _) = c.phase.seqs();
        let bs = c.block;
        let case = |phase| AttentionCase {
            phase,
            head_dim: c.hd,
            n_heads: c.heads,
            kv_heads: c.kv_heads,
            act_dtype: act,
            kv_dtype: c.kv,
            block_size: bs,
            max_context: 4096,
            sliding_window: c.window,
        };
        // The launches of the step (kind, first sequence, count) and what the plan asks.
        let runs: Vec<(AttnKind, usize, usize)> = match c.phase {
            Phase::Prefill | Phase::Chunked | Phase::Decode => vec![(c.kind, 0, lens.len())],
            // Decodes with the case's kind; the prefill run with flash when the case is the
            // decode-only kernel (as a plan would pair them).
            Phase::Mixed => {
                let pk = if c.kind == AttnKind::PagedDecode { AttnKind::Flash } else { c.kind };
                vec![(c.kind, 0, 2), (pk, 2, 2)]
            }
        };
        let queries: Vec<OpQuery> = runs
            .iter()
            .map(|&(kind, first, _)| {
                let phase = if lens[first].1 == 1 { AttnPhase::Decode } else { AttnPhase::Prefill };
                OpQuery::Attention { kind, case: case(phase) }
            })
            .collect();
        let group = format!("attention {}", c.kind.name());
        let ratio = c.heads / c.kv_heads;
        let window = if c.window > 0 { format!(" window={}", c.window) } else { String::new() };
        let name = format!(
            "{:?} hd={} heads {}/{} (gqa {ratio}) kv {} bs={bs}{window} seqs(ctx,q)={lens:?}",
            c.phase, c.hd, c.heads, c.kv_heads, c.kv
        );
        // The plan-level rule: a paged decode kernel takes decodes only, and says so through
        // the `phase` parameter (the case is then listed as skipped).
        if !s.dry && c.kind == AttnKind::PagedDecode && matches!(c.phase, Phase::Prefill | Phase::Chunked) {
            match s.be.supports(&queries[0]) {
                Err(u) if u.param == "phase" => {}
                other => s.fail(
                    &group,
                    &name,
                    format!("paged decode attention must be rejected for a prefill with param `phase`, got {other:?}"),
                ),
            }
        }
        let seed = rng.u64();
        s.case(&group, TOL_ATTN, name, &queries, &[9, 10], |d| attention_case(d, &c, &runs, &mut Rng::new(seed)));
    }
    if kind != AttnKind::PagedDecode || s.dry {
        return;
    }
    let g = s.group("attention paged_decode_attention", TOL_ATTN);
    g.lines.push(
        "  rule checked: paged decode is rejected for every prefill and chunked-prefill case, with param \
         `phase` (those cases are among the skips above)"
            .into(),
    );
}
