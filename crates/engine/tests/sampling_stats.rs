//! Statistical tests of the sampler: empirical token frequencies against the exact
//! distribution computed independently in f64, with a chi-square goodness-of-fit test.
//!
//! Seeds are fixed, so every run draws the same tokens: the tests are deterministic, and a
//! p-value below 1e-3 means the sampler's distribution is wrong (or a seed is very unlucky,
//! which a fixed seed rules out once the test has passed).

use tboost_engine::sample::{Sampler, SamplingParams};

const DRAWS: usize = 20_000;
const P_MIN: f64 = 1e-3;

// ---------------------------------------------------------------------------------------------
// Chi-square survival function: Q(df/2, x/2), the regularized upper incomplete gamma function
// (series for x < a + 1, Lentz continued fraction otherwise; Numerical Recipes §6.2).

fn ln_gamma(x: f64) -> f64 {
    // Lanczos approximation, g = 7, n = 9 (relative error < 1e-15 for x > 0.5).
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let t = x + 7.5;
    let mut a = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut ap, mut sum, mut del) = (a, 1.0 / a, 1.0 / a);
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * front
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        front * h
    }
}

fn chi2_p_value(stat: f64, df: usize) -> f64 {
    gamma_q(df as f64 / 2.0, stat / 2.0)
}

#[test]
fn chi2_p_value_matches_tabulated_critical_values() {
    // (statistic, df, upper-tail p) from standard chi-square tables.
    for (x, df, p) in [
        (3.841_459, 1, 0.05),
        (6.634_897, 1, 0.01),
        (10.827_566, 1, 0.001),
        (18.307_038, 10, 0.05),
        (29.588_298, 10, 0.001),
        (124.342_113, 100, 0.05),
        (149.449_252, 100, 0.001),
        (2.0, 2, (-1.0f64).exp()),
    ] {
        let got = chi2_p_value(x, df);
        assert!((got - p).abs() < 1e-6 * p.max(1e-3), "chi2 sf({x}, {df}) = {got}, want {p}");
    }
}

// ---------------------------------------------------------------------------------------------
// The exact distribution, written straight from the specification in f64 (no lazy sorting,
// no unnormalized weights): penalties → temperature softmax → top-k → top-p → min-p.

fn reference(logits: &[f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) -> Vec<f64> {
    let mut l: Vec<f64> = logits.iter().map(|&x| if x.is_finite() { x as f64 } else { f64::NEG_INFINITY }).collect();
    let rp = p.repetition_penalty as f64;
    let mut seen = vec![false; l.len()];
    for &t in prompt.iter().chain(generated) {
        seen[t as usize] = true;
    }
    for (t, s) in seen.iter().enumerate() {
        if *s {
            l[t] = if l[t] > 0.0 { l[t] / rp } else { l[t] * rp };
        }
    }
    let mut count = vec![0usize; l.len()];
    for &t in generated {
        count[t as usize] += 1;
    }
    for (t, &c) in count.iter().enumerate() {
        if c > 0 {
            l[t] -= p.presence_penalty as f64 + p.frequency_penalty as f64 * c as f64;
        }
    }

    let mut order: Vec<usize> = (0..l.len()).filter(|&i| l[i].is_finite()).collect();
    order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let t = p.temperature as f64;
    let m = l[order[0]];
    let w: Vec<f64> = order.iter().map(|&i| ((l[i] - m) / t).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut probs: Vec<f64> = w.iter().map(|x| x / z).collect();

    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let top_p = p.top_p as f64;
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= top_p {
                // The cut must not sit on a rounding knife-edge, or the test would be fragile.
                assert!((cum - top_p).abs() > 1e-6 && (cum - q - top_p).abs() > 1e-6, "top-p cut too close");
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let threshold = p.min_p as f64 * probs[0];
        for (i, q) in probs.iter().enumerate().take(keep) {
            assert!((q - threshold).abs() > 1e-9, "min-p threshold too close to token {}", order[i]);
        }
        keep = keep.min(probs.iter().take_while(|&&q| q >= threshold).count());
    }
    probs.truncate(keep);
    let z: f64 = probs.iter().sum();
    let mut out = vec![0.0; l.len()];
    for (i, q) in probs.iter().enumerate() {
        out[order[i]] = q / z;
    }
    out
}

/// Draws `DRAWS` tokens from one sampler on a fixed row and returns the token counts.
fn histogram(logits: &[f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) -> Vec<usize> {
    let mut s = Sampler::new(p.clone()).unwrap();
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..DRAWS {
        counts[s.sample(logits, prompt, generated).unwrap().token as usize] += 1;
    }
    counts
}

/// Chi-square p-value of `counts` against `probs`. Tokens are grouped into bins, in order of
/// decreasing probability, until each bin expects at least `min_expected` draws; tokens with
/// probability 0 are checked separately by the caller.
fn goodness_of_fit(counts: &[usize], probs: &[f64], min_expected: f64) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
    order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap());
    let mut bins: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
    let (mut obs, mut exp) = (0.0, 0.0);
    for &i in &order {
        obs += counts[i] as f64;
        exp += probs[i] * n as f64;
        if exp >= min_expected {
            bins.push((obs, exp));
            (obs, exp) = (0.0, 0.0);
        }
    }
    if exp > 0.0 {
        match bins.last_mut() {
            Some(last) => {
                last.0 += obs;
                last.1 += exp;
            }
            None => bins.push((obs, exp)),
        }
    }
    let stat: f64 = bins.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    let df = bins.len().saturating_sub(1);
    (if df == 0 { 1.0 } else { chi2_p_value(stat, df) }, bins.len())
}

/// Samples and checks both claims: excluded tokens never appear, kept tokens follow `ref`.
fn check_fit(name: &str, logits: &[f32], p: &SamplingParams, prompt: &[u32], generated: &[u32], min_expected: f64) {
    let probs = reference(logits, p, prompt, generated);
    let counts = histogram(logits, p, prompt, generated);
    for (t, (&c, &q)) in counts.iter().zip(&probs).enumerate() {
        assert!(q > 0.0 || c == 0, "{name}: excluded token {t} drawn {c} times");
    }
    let kept = probs.iter().filter(|&&q| q > 0.0).count();
    let (pv, bins) = goodness_of_fit(&counts, &probs, min_expected);
    println!("{name}: {kept} kept tokens, {bins} bins, p = {pv:.4}");
    assert!(pv > P_MIN, "{name}: chi-square p-value {pv:.3e} < {P_MIN} over {bins} bins ({kept} kept tokens)");
}

/// Deterministic pseudo-random logits in [lo, hi) (a 64-bit LCG; the values only need to be
/// fixed and irregular).
fn lcg_logits(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// 40 logits with ties, a NaN, a +inf and masked (-inf) entries.
fn small_row() -> Vec<f32> {
    let mut l = lcg_logits(40, 1, -3.0, 4.0);
    l[7] = l[3]; // a tie
    l[11] = f32::NEG_INFINITY;
    l[12] = f32::NAN;
    l[13] = f32::INFINITY;
    l
}

/// Parameters with their own seed per test, so no two tests share a random stream.
fn params(seed: u64, f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { seed, ..SamplingParams::default() };
    f(&mut p);
    p
}

#[test]
fn temperature_one_matches_softmax() {
    check_fit("t=1", &small_row(), &params(101, |_| {}), &[], &[], 5.0);
}

#[test]
fn low_temperature_sharpens() {
    check_fit("t=0.6", &small_row(), &params(102, |p| p.temperature = 0.6), &[], &[], 5.0);
}

#[test]
fn high_temperature_flattens() {
    check_fit("t=1.7", &small_row(), &params(103, |p| p.temperature = 1.7), &[], &[], 5.0);
}

#[test]
fn top_k_keeps_k_tokens() {
    let p = params(104, |p| p.top_k = 5);
    assert_eq!(reference(&small_row(), &p, &[], &[]).iter().filter(|&&q| q > 0.0).count(), 5);
    check_fit("top_k=5", &small_row(), &p, &[], &[], 5.0);
}

#[test]
fn top_p_keeps_the_nucleus() {
    check_fit("top_p=0.8", &small_row(), &params(105, |p| p.top_p = 0.8), &[], &[], 5.0);
}

#[test]
fn min_p_drops_unlikely_tokens() {
    check_fit("min_p=0.1", &small_row(), &params(106, |p| p.min_p = 0.1), &[], &[], 5.0);
}

#[test]
fn min_p_is_relative_to_the_tempered_distribution() {
    // At temperature 0.7 more tokens fall under 0.2 × p_max than at temperature 1.
    let row = small_row();
    let cold = params(107, |p| {
        p.temperature = 0.7;
        p.min_p = 0.2;
    });
    let warm = params(108, |p| p.min_p = 0.2);
    let kept = |p: &SamplingParams| reference(&row, p, &[], &[]).iter().filter(|&&q| q > 0.0).count();
    assert!(kept(&cold) < kept(&warm), "fixture should make temperature matter for min-p");
    check_fit("t=0.7 min_p=0.2", &row, &cold, &[], &[], 5.0);
}

#[test]
fn all_stages_combined() {
    let p = params(109, |p| {
        p.temperature = 0.8;
        p.top_k = 12;
        p.top_p = 0.9;
        p.min_p = 0.05;
    });
    check_fit("t=0.8 k=12 p=0.9 min_p=0.05", &small_row(), &p, &[], &[], 5.0);
}

#[test]
fn top_p_and_min_p_each_binding() {
    // Top-p is computed before min-p, but the sampler applies min-p's filter first as an
    // optimisation; check both regimes: the top-p cut inside the min-p set, and the reverse.
    let row = small_row();
    let kept = |p: &SamplingParams| reference(&row, p, &[], &[]).iter().filter(|&&q| q > 0.0).count();
    for (top_p, min_p, seed) in [(0.6, 0.05, 31), (0.97, 0.3, 32)] {
        let both = params(seed, |p| {
            p.top_p = top_p;
            p.min_p = min_p;
        });
        let only_top_p = params(seed, |p| p.top_p = top_p);
        let only_min_p = params(seed, |p| p.min_p = min_p);
        println!("top_p {top_p}: {}, min_p {min_p}: {}, both: {}", kept(&only_top_p), kept(&only_min_p), kept(&both));
        assert_eq!(kept(&both), kept(&only_top_p).min(kept(&only_min_p)));
        assert_ne!(kept(&only_top_p), kept(&only_min_p), "fixture should make one stage bind");
        check_fit(&format!("top_p={top_p} min_p={min_p}"), &row, &both, &[], &[], 5.0);
    }
}

#[test]
fn penalties_then_truncation() {
    let p = params(110, |p| {
        p.temperature = 0.9;
        p.top_p = 0.95;
        p.repetition_penalty = 1.3;
        p.presence_penalty = 0.4;
        p.frequency_penalty = 0.3;
    });
    let prompt = [0, 1, 2, 3, 5, 8];
    let generated = [8, 8, 21, 34, 3, 21, 8];
    check_fit("penalties + t=0.9 p=0.95", &small_row(), &p, &prompt, &generated, 5.0);
}

#[test]
fn large_flat_vocabulary() {
    // Flat logits make the draw walk deep into the candidate list, through every growth step
    // of the lazily sorted prefix.
    let row = lcg_logits(3000, 7, -1.0, 1.0);
    check_fit("V=3000 t=1", &row, &params(111, |_| {}), &[], &[], 400.0);
}

#[test]
fn large_vocabulary_top_p_and_top_k() {
    let row = lcg_logits(3000, 9, -2.0, 2.0);
    check_fit("V=3000 top_p=0.5", &row, &params(112, |p| p.top_p = 0.5), &[], &[], 100.0);
    let p = params(113, |p| {
        p.top_k = 1000;
        p.top_p = 0.9;
        p.temperature = 1.3;
    });
    check_fit("V=3000 k=1000 p=0.9 t=1.3", &row, &p, &[], &[], 100.0);
}

#[test]
fn the_fit_test_rejects_a_wrong_distribution() {
    // The harness must be able to fail: samples at temperature 1 judged against the
    // temperature-1.2 distribution, and top-k 6 judged against top-k 5 plus one token.
    let row = small_row();
    let counts = histogram(&row, &params(114, |_| {}), &[], &[]);
    let wrong = reference(&row, &params(115, |p| p.temperature = 1.2), &[], &[]);
    let (pv, _) = goodness_of_fit(&counts, &wrong, 5.0);
    assert!(pv < P_MIN, "temperature 1 vs 1.2 not detected: p = {pv}");

    let counts = histogram(&row, &params(116, |p| p.top_p = 0.85), &[], &[]);
    let wrong = reference(&row, &params(117, |p| p.top_p = 0.8), &[], &[]);
    let leaked = counts.iter().zip(&wrong).any(|(&c, &q)| q == 0.0 && c > 0);
    assert!(leaked, "top_p 0.85 samples should contain tokens top_p 0.8 excludes");
}

#[test]
fn extreme_logit_ranges() {
    // Tokens hundreds of nats below the top share the histogram's last bucket; a very cold
    // temperature pushes almost every token there.
    let mut row = lcg_logits(60, 5, -3.0, 3.0);
    for (i, x) in row.iter_mut().enumerate().skip(40) {
        *x = -200.0 - i as f32;
    }
    check_fit("wide range t=1", &row, &params(120, |_| {}), &[], &[], 5.0);
    check_fit("wide range t=0.05", &row, &params(121, |p| p.temperature = 0.05), &[], &[], 5.0);
    check_fit("wide range t=40", &row, &params(122, |p| p.temperature = 40.0), &[], &[], 5.0);
}

#[test]
fn equal_logits_are_uniform_and_cut_by_id() {
    let row = vec![0.25f32; 40];
    check_fit("all equal", &row, &params(123, |_| {}), &[], &[], 5.0);
    let p = params(124, |p| p.top_p = 0.31);
    let probs = reference(&row, &p, &[], &[]);
    assert!(probs[..13].iter().all(|&q| q > 0.0) && probs[13..].iter().all(|&q| q == 0.0));
    check_fit("all equal top_p=0.31", &row, &p, &[], &[], 5.0);
    let p = params(125, |p| p.top_k = 7);
    check_fit("all equal top_k=7", &row, &p, &[], &[], 5.0);
}

#[test]
fn top_p_cut_inside_a_large_tie() {
    // 600 tokens tie below three leaders, above a low tail: the nucleus ends inside the tie,
    // which is ordered by id, and spans many tokens of one histogram bucket.
    let mut row = vec![-3.0f32; 2000];
    row[1500] = 4.0;
    row[10] = 3.5;
    row[700] = 3.0;
    for x in row.iter_mut().skip(800).take(600) {
        *x = 0.5;
    }
    let p = params(126, |p| p.top_p = 0.9);
    let kept = reference(&row, &p, &[], &[]).iter().filter(|&&q| q > 0.0).count();
    assert!(kept > 100 && kept < 603, "fixture should cut inside the tie: {kept}");
    check_fit("tie cut top_p=0.9", &row, &p, &[], &[], 100.0);
}

#[test]
fn min_p_threshold_inside_a_histogram_bucket() {
    // 8k tokens spread over 4 logits put ~8 tokens in each histogram bucket, so the min-p
    // threshold splits a bucket whose excluded part must never be drawn, also when top-p
    // would reach further than min-p allows.
    let row = lcg_logits(8_000, 13, -2.0, 2.0);
    check_fit("V=8000 min_p=0.5", &row, &params(127, |p| p.min_p = 0.5), &[], &[], 100.0);
    let p = params(128, |p| {
        p.min_p = 0.5;
        p.top_p = 0.98;
        p.temperature = 0.9;
    });
    let kept = |p: &SamplingParams| reference(&row, p, &[], &[]).iter().filter(|&&q| q > 0.0).count();
    assert!(kept(&p) < kept(&SamplingParams { min_p: 0.0, ..p.clone() }), "fixture: min-p should bind");
    check_fit("V=8000 min_p=0.5 top_p=0.98 t=0.9", &row, &p, &[], &[], 100.0);
}
