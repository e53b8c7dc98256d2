//! The per-request sampler: one logits row in, one token out.

use std::cmp::Ordering;

use super::params::SamplingParams;
use super::rng::RequestRng;
use crate::{Error, Result};

/// The token chosen for one step, with optional logprobs.
///
/// Logprobs describe the model's **raw** distribution: the log-softmax of the logits exactly as
/// the model produced them, before penalties, temperature and truncation (vLLM's default). So
/// a token outside the kept set still gets its true model logprob, and the numbers do not move
/// when a user changes temperature.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Raw logprob of `token`; `Some` iff `SamplingParams::logprobs` is `Some`.
    pub logprob: Option<f32>,
    /// The `n` most likely tokens under the raw distribution with their logprobs, most likely
    /// first, ties by lower id. Fewer than `n` when fewer logits are finite; empty when logprobs
    /// are off. It may or may not contain `token`.
    pub top: Vec<(u32, f32)>,
}

/// Turns logits into tokens for one request. The engine owns one per request and calls
/// [`Sampler::sample`] once per generated token; nothing in it depends on other requests.
///
/// Pipeline: penalties → greedy argmax if temperature is 0 → temperature → top-k → top-p →
/// min-p → renormalize → one uniform draw. Candidates are ordered by adjusted logit (= by
/// probability) descending, ties by lower id, and the draw walks them in that order, so the
/// result depends only on the seed and the logits.
///
/// Non-finite logits (NaN, ±inf) are never candidates: NaN and +inf are treated as -inf (a
/// warning is logged once per sampler), and a row without any finite logit is an error.
///
/// Cost: one pass over the row for greedy; otherwise a few sequential passes and one `exp`
/// per finite logit when top-k is off (with top-k, `exp` only for the k survivors). Candidates
/// are bucketed by logit and only what matters is sorted: the top-k survivors (lazily, as far
/// as the walk goes) or the one bucket where the top-p cut or the draw lands. Only a row of
/// massive exact ties degrades to sorting the tied tokens.
/// Scratch buffers are kept between calls, so steady-state sampling does not allocate except
/// for the returned `top` list; they hold a few ids per call in the common case, up to a
/// vocabulary-sized id list (plus a logits copy and a counter array when penalties are on).
pub struct Sampler {
    params: SamplingParams,
    rng: RequestRng,
    scratch: Scratch,
    /// Logits after sanitizing and penalties (only used when a penalty is on).
    work: Vec<f32>,
    /// Per-token counters for penalties; all zero between calls.
    marks: Vec<u32>,
    /// Ids whose `marks` entry is non-zero, to reset them cheaply.
    touched: Vec<u32>,
    warned_non_finite: bool,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").field("params", &self.params).finish_non_exhaustive()
    }
}

/// Reusable buffers of the truncation stages (their contents never outlive a call).
#[derive(Default)]
struct Scratch {
    /// Candidate ids: the top-k survivors, one bucket's tokens, or the logprob top-n.
    ids: Vec<u32>,
    /// Per-bucket token counts (top-k selection).
    counts: Vec<u32>,
    /// Per-bucket probability mass (draws without top-k).
    mass: Vec<f64>,
}

/// Histogram resolution for bucketing candidates by logit.
const BUCKETS: usize = 1024;
/// Buckets of the mass histogram cover this many nats below the top token; the last bucket
/// takes everything further down (weights under e^-64 ≈ 1.6e-28).
const MAX_NATS: f64 = 64.0;

/// Candidates are taken in chunks of this size (then ×4) when walking them in sorted order, so
/// a peaked distribution never pays for sorting the whole vocabulary.
const FIRST_CHUNK: usize = 64;

impl Sampler {
    /// Validates `params` and seeds the request's random stream.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let rng = RequestRng::new(params.seed);
        Ok(Sampler {
            params,
            rng,
            scratch: Scratch::default(),
            work: Vec::new(),
            marks: Vec::new(),
            touched: Vec::new(),
            warned_non_finite: false,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one logits row (`logits.len()` = vocabulary size).
    ///
    /// `prompt` and `generated` are the request's token ids so far; they are only read when a
    /// penalty is on (then an id outside the vocabulary is an error naming its position).
    /// The random stream advances by exactly one draw per successful non-greedy call, however
    /// many candidates survive; greedy calls and failed calls do not touch it.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<Sampled> {
        check_row(logits)?;
        let mut saw_bad = if self.params.has_penalties() { self.penalize(logits, prompt, generated)? } else { false };
        let adjusted: &[f32] = if self.params.has_penalties() { &self.work } else { logits };

        let token = if self.params.temperature == 0.0 {
            let (best, bad) = argmax_finite(adjusted);
            saw_bad |= bad;
            best
        } else {
            let (token, bad) = draw(&self.params, adjusted, &mut self.scratch, &mut self.rng);
            saw_bad |= bad;
            token
        };
        if saw_bad && !self.warned_non_finite {
            self.warned_non_finite = true;
            log::warn!("sampler (seed {}): logits contain NaN or +inf; treating them as -inf", self.params.seed);
        }
        let token = token.ok_or_else(|| {
            Error::invalid("logits", format!("no finite logit left in a row of {} (NaN, ±inf or masked)", logits.len()))
        })?;

        let (logprob, top) = match self.params.logprobs {
            None => (None, Vec::new()),
            Some(n) => raw_logprobs(logits, token, n, &mut self.scratch),
        };
        Ok(Sampled { token, logprob, top })
    }

    /// The logits the truncation stages see: non-finite values replaced by -inf, then the
    /// repetition, presence and frequency penalties applied. For inspection and debugging;
    /// [`Sampler::sample`] does the same internally.
    pub fn penalized_logits(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<&[f32]> {
        check_row(logits)?;
        self.penalize(logits, prompt, generated)?;
        Ok(&self.work)
    }

    /// Fills `self.work` with sanitized, penalized logits. Returns whether NaN/+inf was seen.
    fn penalize(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<bool> {
        let p = &self.params;
        let vocab = logits.len();
        let repetition = p.repetition_penalty != 1.0;
        let additive = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        // Validate before touching `marks`, so an error cannot leave counters dirty.
        if repetition {
            check_ids("prompt", prompt, vocab)?;
        }
        if repetition || additive {
            check_ids("generated", generated, vocab)?;
        }
        if let Some(&(t, _)) = p.logit_bias.iter().find(|&&(t, _)| t as usize >= vocab) {
            return Err(Error::invalid("logit_bias", format!("token {t} is not below the vocabulary size {vocab}")));
        }

        let mut saw_bad = false;
        self.work.clear();
        self.work.extend(logits.iter().map(|&x| {
            if x.is_finite() {
                x
            } else {
                saw_bad |= x != f32::NEG_INFINITY;
                f32::NEG_INFINITY
            }
        }));
        self.marks.resize(vocab, 0);

        if repetition {
            let rp = p.repetition_penalty;
            for &t in prompt.iter().chain(generated) {
                if self.marks[t as usize] == 0 {
                    self.marks[t as usize] = 1;
                    self.touched.push(t);
                }
            }
            for &t in &self.touched {
                let l = &mut self.work[t as usize];
                *l = if *l > 0.0 { *l / rp } else { *l * rp };
                self.marks[t as usize] = 0;
            }
            self.touched.clear();
        }
        if additive {
            for &t in generated {
                if self.marks[t as usize] == 0 {
                    self.touched.push(t);
                }
                self.marks[t as usize] += 1;
            }
            for &t in &self.touched {
                let count = self.marks[t as usize] as f32;
                self.work[t as usize] -= p.presence_penalty + p.frequency_penalty * count;
                self.marks[t as usize] = 0;
            }
            self.touched.clear();
        }
        for &(t, b) in &p.logit_bias {
            self.work[t as usize] += b;
        }
        // A penalty can overflow an extreme logit; keep the rule "only finite logits compete".
        for l in &mut self.work {
            if !l.is_finite() {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(saw_bad)
    }
}

fn check_row(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::invalid("logits", "empty logits row"));
    }
    if logits.len() > u32::MAX as usize {
        return Err(Error::invalid("logits", format!("{} entries exceed the u32 token id range", logits.len())));
    }
    Ok(())
}

fn check_ids(name: &str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(Error::invalid(
            format!("{name}[{i}]"),
            format!("token id {} is outside the vocabulary of {vocab} logits", ids[i]),
        )),
        None => Ok(()),
    }
}

/// Whether a logit is NaN or +inf (a model fault, unlike -inf which is a deliberate mask).
fn is_bad(x: f32) -> bool {
    x.is_nan() || x == f32::INFINITY
}

/// Argmax over finite logits, ties → lowest id. Also reports whether NaN/+inf was seen.
fn argmax_finite(logits: &[f32]) -> (Option<u32>, bool) {
    // Two passes that vectorize (a branchy single pass measured 3% of a 16-request decode
    // step over a 152k vocabulary): the largest finite value in 16 lanes, then its first id.
    const L: usize = 16;
    let (mut lanes, mut bad) = ([f32::NEG_INFINITY; L], [false; L]);
    let chunks = logits.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..L {
            let x = c[j];
            lanes[j] = if x.is_finite() && x > lanes[j] { x } else { lanes[j] };
            bad[j] |= is_bad(x);
        }
    }
    for (j, &x) in tail.iter().enumerate() {
        lanes[j] = if x.is_finite() && x > lanes[j] { x } else { lanes[j] };
        bad[j] |= is_bad(x);
    }
    let saw_bad = bad.iter().any(|&b| b);
    let mx = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if mx == f32::NEG_INFINITY {
        return (None, saw_bad);
    }
    // The first (lowest id) of equal maxima; `mx` is finite, so only finite values match.
    (logits.iter().position(|&x| x == mx).map(|i| i as u32), saw_bad)
}

/// Total order of candidates: higher logit first, then lower id.
fn by_logit_desc(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

/// Makes `ids[..n]` sorted for a larger `n` than `sorted`, given that `ids[..sorted]` is
/// sorted and holds the `sorted` best ids. Returns the new sorted length.
fn extend_sorted(ids: &mut [u32], sorted: usize, cmp: &impl Fn(&u32, &u32) -> Ordering) -> usize {
    let want = (sorted * 4).max(FIRST_CHUNK).min(ids.len());
    let rest = &mut ids[sorted..];
    let k = want - sorted;
    if k < rest.len() {
        rest.select_nth_unstable_by(k - 1, cmp);
    }
    rest[..k].sort_unstable_by(cmp);
    want
}

/// Finite range of a row: (max, min, number of finite entries, NaN/+inf seen).
fn finite_range(logits: &[f32]) -> (f32, f32, usize, bool) {
    let (mut max, mut min, mut n, mut saw_bad) = (f32::NEG_INFINITY, f32::INFINITY, 0, false);
    for &x in logits {
        if x.is_finite() {
            // Plain comparisons: `x` is finite, so f32::max's NaN handling is wasted work.
            n += 1;
            if x > max {
                max = x;
            }
            if x < min {
                min = x;
            }
        } else {
            saw_bad |= is_bad(x);
        }
    }
    (max, min, n, saw_bad)
}

/// Leaves in `ids` (unsorted) the `k` best finite entries under [`by_logit_desc`], for
/// `0 < k < n_finite`. A count histogram over the logit range finds the bucket holding the
/// k-th best, so only the entries down to that bucket are gathered and partially sorted:
/// two sequential passes instead of a selection over the whole vocabulary.
fn top_k_ids(logits: &[f32], max: f32, min: f32, k: usize, ids: &mut Vec<u32>, counts: &mut Vec<u32>) {
    let (max, min) = (max as f64, min as f64);
    let scale = if max > min { BUCKETS as f64 / (max - min) } else { 0.0 };
    // Monotone in x, so bucket order never contradicts the candidate order.
    let bucket = |x: f32| (((max - x as f64) * scale) as usize).min(BUCKETS - 1);
    counts.clear();
    counts.resize(BUCKETS, 0);
    for &x in logits {
        if x.is_finite() {
            counts[bucket(x)] += 1;
        }
    }
    let mut cum = 0usize;
    let last = counts
        .iter()
        .position(|&c| {
            cum += c as usize;
            cum >= k
        })
        .unwrap_or(BUCKETS - 1);
    ids.clear();
    ids.extend(logits.iter().enumerate().filter(|(_, &x)| x.is_finite() && bucket(x) <= last).map(|(i, _)| i as u32));
    if ids.len() > k {
        ids.select_nth_unstable_by(k - 1, by_logit_desc(logits));
        ids.truncate(k);
    }
}

/// Temperature → top-k → top-p → min-p → draw. Returns the token (None if no logit is
/// finite) and whether NaN/+inf was seen.
fn draw(p: &SamplingParams, logits: &[f32], s: &mut Scratch, rng: &mut RequestRng) -> (Option<u32>, bool) {
    let (max, min, n, saw_bad) = finite_range(logits);
    if n == 0 {
        return (None, saw_bad);
    }
    let token = if p.top_k > 0 && p.top_k < n {
        top_k_ids(logits, max, min, p.top_k, &mut s.ids, &mut s.counts);
        draw_from_ids(p, logits, max, &mut s.ids, rng)
    } else {
        draw_by_buckets(p, logits, max, min, s, rng)
    };
    (Some(token), saw_bad)
}

/// The unnormalized probability after temperature. The top token weighs exactly 1, so
/// min-p's "fraction of the top probability" is a plain threshold on the weight.
fn weight(x: f32, max: f64, t: f64) -> f64 {
    ((x as f64 - max) / t).exp()
}

/// Top-p → min-p → draw over an explicit candidate list (the top-k survivors).
fn draw_from_ids(p: &SamplingParams, logits: &[f32], max: f32, ids: &mut [u32], rng: &mut RequestRng) -> u32 {
    let (t, max) = (p.temperature as f64, max as f64);
    let weight = |id: u32| weight(logits[id as usize], max, t);
    let cmp = by_logit_desc(logits);

    // Top-p is measured against the mass that survives top-k, before min-p.
    let top_p_target =
        if p.top_p < 1.0 { Some(p.top_p as f64 * ids.iter().map(|&i| weight(i)).sum::<f64>()) } else { None };
    // Min-p keeps a prefix of the sorted order and top-p keeps a prefix too, so applying the
    // cheap min-p filter first and then searching for the top-p cut inside what remains gives
    // the same set as top-p followed by min-p, without sorting the tokens min-p removes.
    let mut len = ids.len();
    if p.min_p > 0.0 {
        let threshold = p.min_p as f64;
        let mut kept = 0;
        for i in 0..len {
            if weight(ids[i]) >= threshold {
                ids.swap(kept, i);
                kept += 1;
            }
        }
        len = kept;
    }
    let mut ids = &mut ids[..len];

    let mut sorted = 0;
    let kept_mass = match top_p_target {
        Some(target) => {
            let mut cum = 0.0;
            let mut kept = ids.len();
            for i in 0..ids.len() {
                if i == sorted {
                    sorted = extend_sorted(ids, sorted, &cmp);
                }
                cum += weight(ids[i]);
                if cum >= target {
                    kept = i + 1;
                    break;
                }
            }
            ids = &mut ids[..kept];
            sorted = sorted.min(kept);
            cum
        }
        None => ids.iter().map(|&i| weight(i)).sum::<f64>(),
    };

    let target = rng.next_f64() * kept_mass;
    let mut cum = 0.0;
    let mut last_positive = ids[0];
    for i in 0..ids.len() {
        if i == sorted {
            sorted = extend_sorted(ids, sorted, &cmp);
        }
        let w = weight(ids[i]);
        if w > 0.0 {
            last_positive = ids[i];
        }
        cum += w;
        if target < cum {
            return ids[i];
        }
    }
    // Only reachable through rounding (kept_mass summed in another order).
    last_positive
}

/// Top-p → min-p → draw over the whole row (no top-k), without sorting it.
///
/// One pass computes every weight and adds it to a histogram bucket chosen by the token's
/// distance below the top logit in nats (monotone, so the buckets are consecutive runs of
/// the sorted order). The top-p cut and the draw then locate their bucket from the bucket
/// masses, and only that bucket's tokens are gathered and sorted. Beyond [`MAX_NATS`] the
/// last bucket collects weights below e^-64, which no 53-bit uniform can reach in practice
/// but which stay exactly drawable.
fn draw_by_buckets(
    p: &SamplingParams,
    logits: &[f32],
    max: f32,
    min: f32,
    s: &mut Scratch,
    rng: &mut RequestRng,
) -> u32 {
    let (t, max) = (p.temperature as f64, max as f64);
    let span = ((max - min as f64) / t).min(MAX_NATS);
    // Buckets per logit unit (not per nat): saves a division per token in every pass.
    let scale = if span > 0.0 { BUCKETS as f64 / span / t } else { 0.0 };
    let bucket = |x: f32| (((max - x as f64) * scale) as usize).min(BUCKETS - 1);
    let min_p = p.min_p as f64;

    s.mass.clear();
    s.mass.resize(BUCKETS, 0.0);
    let mut total = 0.0;
    for &x in logits {
        if x.is_finite() {
            let w = weight(x, max, t);
            total += w;
            // Min-p drops a tail of the sorted order; the top-p cut searched inside what is
            // left is the same as top-p's cut on the full order whenever it falls there.
            if w >= min_p {
                s.mass[bucket(x)] += w;
            }
        }
    }
    // Gathers one bucket's surviving tokens, sorted.
    let load = |b: usize, ids: &mut Vec<u32>| {
        ids.clear();
        ids.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &x)| x.is_finite() && bucket(x) == b && (min_p == 0.0 || weight(x, max, t) >= min_p))
                .map(|(i, _)| i as u32),
        );
        ids.sort_unstable_by(by_logit_desc(logits));
    };
    let last_nonempty = s.mass.iter().rposition(|&m| m > 0.0).unwrap_or(0);

    // The kept set ends at (limit_bucket, limit_len tokens of it).
    let (mut limit_bucket, mut limit_len) = (last_nonempty, usize::MAX);
    let mut loaded = None;
    let kept_mass = if p.top_p < 1.0 {
        let target = p.top_p as f64 * total;
        let mut cum = 0.0;
        let mut b = 0;
        while b < last_nonempty && cum + s.mass[b] < target {
            cum += s.mass[b];
            b += 1;
        }
        load(b, &mut s.ids);
        loaded = Some(b);
        let mut len = s.ids.len();
        for (j, &id) in s.ids.iter().enumerate() {
            cum += weight(logits[id as usize], max, t);
            if cum >= target {
                len = j + 1;
                break;
            }
        }
        (limit_bucket, limit_len) = (b, len);
        cum
    } else {
        s.mass.iter().sum()
    };

    let target = rng.next_f64() * kept_mass;
    let mut cum = 0.0;
    let mut b = 0;
    while b < limit_bucket && target >= cum + s.mass[b] {
        cum += s.mass[b];
        b += 1;
    }
    if loaded != Some(b) {
        load(b, &mut s.ids);
    }
    let end = if b == limit_bucket { limit_len.min(s.ids.len()) } else { s.ids.len() };
    let mut last_positive = s.ids[0];
    for &id in &s.ids[..end] {
        let w = weight(logits[id as usize], max, t);
        if w > 0.0 {
            last_positive = id;
        }
        cum += w;
        if target < cum {
            return id;
        }
    }
    // Only reachable through rounding (bucket sums and the walk add in different orders).
    last_positive
}

/// Log-softmax of the raw row at `token` (prompt logprobs, perplexity).
pub fn token_logprob(logits: &[f32], token: u32) -> f32 {
    (logits[token as usize] as f64 - log_sum_exp(logits, finite_range(logits).0)) as f32
}

/// log Σ exp over the finite entries, `max` their largest, in f64.
fn log_sum_exp(logits: &[f32], max: f32) -> f64 {
    let sum: f64 = logits.iter().filter(|x| x.is_finite()).map(|&x| (x as f64 - max as f64).exp()).sum();
    max as f64 + sum.ln()
}

/// Log-softmax of the raw row for `token` plus its `n` best entries.
fn raw_logprobs(logits: &[f32], token: u32, n: usize, s: &mut Scratch) -> (Option<f32>, Vec<(u32, f32)>) {
    let (max, min, n_finite, _) = finite_range(logits);
    let lse = log_sum_exp(logits, max);
    let logprob = |id: u32| (logits[id as usize] as f64 - lse) as f32;

    let mut top = Vec::new();
    let n = n.min(n_finite);
    if n > 0 {
        if n < n_finite {
            top_k_ids(logits, max, min, n, &mut s.ids, &mut s.counts);
        } else {
            s.ids.clear();
            s.ids.extend((0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()));
        }
        s.ids.sort_unstable_by(by_logit_desc(logits));
        top.extend(s.ids.iter().map(|&i| (i, logprob(i))));
    }
    (Some(logprob(token)), top)
}
