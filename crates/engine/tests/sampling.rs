//! Sampler and stop-criteria behaviour: determinism, independence, penalties, greedy, logprobs,
//! parameter validation, non-finite logits, stop rules.

use tboost_engine::sample::{FinishReason, Sampler, SamplingParams, StopCriteria};

fn lcg_logits(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// A fixed 200-step "model": the logits of step i depend only on i.
fn step_logits(i: usize) -> Vec<f32> {
    lcg_logits(1000, i as u64 + 1, -4.0, 4.0)
}

fn varied_params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.1,
        presence_penalty: 0.2,
        frequency_penalty: 0.1,
        seed,
        logprobs: Some(3),
        logit_bias: vec![(7, -1.5), (11, 2.0)],
    }
}

/// Runs one sampler for `n` steps, feeding its own tokens back (as the engine does).
fn run(params: SamplingParams, n: usize) -> Vec<u32> {
    let prompt = [1u32, 2, 3];
    let mut s = Sampler::new(params).unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let t = s.sample(&step_logits(i), &prompt, &out).unwrap().token;
        out.push(t);
    }
    out
}

#[test]
fn same_seed_gives_the_same_200_tokens() {
    let a = run(varied_params(42), 200);
    assert_eq!(a, run(varied_params(42), 200));
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct.len() > 20, "fixture should not be near-deterministic: {} distinct tokens", distinct.len());
}

#[test]
fn different_seeds_give_different_tokens() {
    let a = run(varied_params(42), 200);
    let b = run(varied_params(43), 200);
    let c = run(varied_params(0), 200);
    let same_ab = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same_ab < 150, "seeds 42 and 43 agree on {same_ab} of 200 tokens");
    assert_ne!(a, c);
    assert_ne!(b, c);
}

#[test]
fn interleaved_samplers_match_their_solo_runs() {
    let pa = varied_params(7);
    let pb = SamplingParams { temperature: 1.3, top_k: 0, seed: 7, ..SamplingParams::default() };
    let pc = SamplingParams::greedy();
    let (solo_a, solo_b, solo_c) = (run(pa.clone(), 200), run(pb.clone(), 200), run(pc.clone(), 200));

    // Same prompt, but each request at its own position in its own stream, as in a batch
    // where requests start at different steps.
    let prompt = [1u32, 2, 3];
    let (mut sa, mut sb, mut sc) = (Sampler::new(pa).unwrap(), Sampler::new(pb).unwrap(), Sampler::new(pc).unwrap());
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..400 {
        if step % 2 == 0 && a.len() < 200 {
            let t = sa.sample(&step_logits(a.len()), &prompt, &a).unwrap().token;
            a.push(t);
        }
        if step >= 100 && b.len() < 200 {
            let t = sb.sample(&step_logits(b.len()), &prompt, &b).unwrap().token;
            b.push(t);
        }
        if step % 3 != 0 && c.len() < 200 {
            let t = sc.sample(&step_logits(c.len()), &prompt, &c).unwrap().token;
            c.push(t);
        }
    }
    assert_eq!(a.len(), 200);
    assert_eq!(b.len(), 200);
    assert_eq!(c.len(), 200);
    assert_eq!(a, solo_a);
    assert_eq!(b, solo_b);
    assert_eq!(c, solo_c);
}

#[test]
fn rng_advances_exactly_once_per_sampled_token() {
    // Step 1 differs (a single finite candidate vs a full row), step 2 is identical: the second
    // token agrees only if both samplers consumed exactly one draw in step 1.
    let p = SamplingParams { seed: 99, ..SamplingParams::default() };
    let full = lcg_logits(500, 3, -2.0, 2.0);
    let mut single = vec![f32::NEG_INFINITY; 500];
    single[17] = 0.0;
    let later = lcg_logits(500, 4, -1.0, 1.0);
    for trial in 0..20u64 {
        let p = SamplingParams { seed: trial, ..p.clone() };
        let (mut a, mut b) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p).unwrap());
        a.sample(&full, &[], &[]).unwrap();
        assert_eq!(b.sample(&single, &[], &[]).unwrap().token, 17);
        assert_eq!(a.sample(&later, &[], &[]).unwrap().token, b.sample(&later, &[], &[]).unwrap().token);
    }
}

#[test]
fn failed_call_does_not_consume_a_draw() {
    let p = SamplingParams { seed: 5, ..SamplingParams::default() };
    let row = lcg_logits(300, 8, -1.0, 1.0);
    let (mut a, mut b) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p).unwrap());
    assert!(a.sample(&[f32::NAN; 300], &[], &[]).is_err());
    for _ in 0..10 {
        assert_eq!(a.sample(&row, &[], &[]).unwrap().token, b.sample(&row, &[], &[]).unwrap().token);
    }
}

#[test]
fn penalties_match_hand_computed_values() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    };
    let logits = [2.0, -1.0, 0.5, 3.0, 0.0, 1.5];
    let prompt = [0, 1, 0];
    let generated = [2, 2, 1, 4];
    let mut s = Sampler::new(p).unwrap();
    let got = s.penalized_logits(&logits, &prompt, &generated).unwrap().to_vec();
    // id 0: prompt only → repetition only: 2 / 2 = 1 (once, though it appears twice).
    // id 1: prompt + generated once: -1 * 2 = -2, then -0.5 - 0.25*1 → -2.75.
    // id 2: generated twice: 0.5 / 2 = 0.25, then -0.5 - 0.25*2 → -0.75.
    // id 3: untouched. id 4: 0 * 2 = 0 (non-positive → multiplied), then -0.75 → -0.75.
    // id 5: untouched.
    let want = [1.0, -2.75, -0.75, 3.0, -0.75, 1.5];
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-6, "token {i}: got {g}, want {w}");
    }
}

#[test]
fn each_penalty_alone() {
    let logits = [2.0, -1.0, 0.5];
    let prompt = [0, 1];
    let generated = [1, 1];
    let check = |p: SamplingParams, want: [f32; 3]| {
        let mut s = Sampler::new(p.clone()).unwrap();
        let got = s.penalized_logits(&logits, &prompt, &generated).unwrap().to_vec();
        assert_eq!(got, want, "{p:?}");
    };
    let base = SamplingParams::default();
    check(SamplingParams { repetition_penalty: 0.5, ..base.clone() }, [4.0, -0.5, 0.5]);
    // Presence/frequency ignore the prompt: token 0 stays.
    check(SamplingParams { presence_penalty: 1.0, ..base.clone() }, [2.0, -2.0, 0.5]);
    check(SamplingParams { frequency_penalty: 1.5, ..base.clone() }, [2.0, -4.0, 0.5]);
    check(SamplingParams { presence_penalty: -1.0, ..base }, [2.0, 0.0, 0.5]);
}

#[test]
fn penalties_steer_greedy() {
    let logits = [1.0, 3.0, 2.9];
    let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..SamplingParams::greedy() }).unwrap();
    assert_eq!(s.sample(&logits, &[], &[]).unwrap().token, 1);
    assert_eq!(s.sample(&logits, &[1], &[]).unwrap().token, 2, "3.0 / 1.2 = 2.5 < 2.9");
}

#[test]
fn penalty_token_ids_are_checked() {
    let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() }).unwrap();
    let e = s.sample(&[0.0; 10], &[1, 10], &[]).unwrap_err().to_string();
    assert!(e.contains("prompt[1]") && e.contains("10"), "{e}");
    let e = s.sample(&[0.0; 10], &[1], &[3, 4, 99]).unwrap_err().to_string();
    assert!(e.contains("generated[2]") && e.contains("99"), "{e}");
    // The scratch counters must be clean after the errors: same result as a fresh sampler.
    let mut fresh = Sampler::new(s.params().clone()).unwrap();
    let a = s.penalized_logits(&[1.0; 10], &[2], &[3]).unwrap().to_vec();
    let b = fresh.penalized_logits(&[1.0; 10], &[2], &[3]).unwrap().to_vec();
    assert_eq!(a, b);
}

#[test]
fn greedy_takes_argmax_ties_to_lowest_id() {
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &[], &[]).unwrap().token, 1);
    assert_eq!(s.sample(&[5.0, 5.0], &[], &[]).unwrap().token, 0);
    assert_eq!(s.sample(&[-1.0, -0.5, -0.5, -7.0], &[], &[]).unwrap().token, 1);
    // top-k / top-p / min-p cannot change a greedy choice.
    let mut s = Sampler::new(SamplingParams { top_k: 3, top_p: 0.1, min_p: 0.9, ..SamplingParams::greedy() }).unwrap();
    assert_eq!(s.sample(&[0.0, 9.0, 9.0], &[], &[]).unwrap().token, 1);
}

#[test]
fn greedy_equals_a_plain_scan_on_long_rows_with_ties_and_non_finite_values() {
    // The greedy pick runs 16 lanes then a search: check it against the one-pass definition
    // (first id of the largest finite logit) on rows of every length mod 16, with ties placed
    // in different lanes, NaN/±inf mixed in, and rows with no finite value.
    let scan = |l: &[f32]| {
        let mut best: Option<(usize, f32)> = None;
        for (i, &x) in l.iter().enumerate() {
            if x.is_finite() && best.is_none_or(|(_, b)| x > b) {
                best = Some((i, x));
            }
        }
        best.map(|(i, _)| i as u32)
    };
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    for len in [1usize, 15, 16, 17, 33, 250, 1000] {
        for case in 0..20 {
            let mut l: Vec<f32> = (0..len).map(|_| (next() % 50) as f32 - 25.0).collect();
            for _ in 0..case % 4 {
                let i = next() as usize % len;
                l[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][next() as usize % 3];
            }
            if case == 19 {
                l.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
            match (scan(&l), s.sample(&l, &[], &[])) {
                (Some(want), Ok(got)) => assert_eq!(got.token, want, "len {len} case {case}: {l:?}"),
                (None, Err(_)) => {}
                (want, got) => panic!("len {len} case {case}: want {want:?}, got {got:?}"),
            }
        }
    }
}

#[test]
fn top_k_ties_at_the_boundary_keep_lower_ids() {
    // Tokens 1, 2, 3 tie for first place; top_k = 2 keeps 1 and 2, never 3.
    let logits = [0.0, 2.0, 2.0, 2.0, 1.0];
    let mut s = Sampler::new(SamplingParams { top_k: 2, seed: 3, ..SamplingParams::default() }).unwrap();
    let mut seen = [0usize; 5];
    for _ in 0..2000 {
        seen[s.sample(&logits, &[], &[]).unwrap().token as usize] += 1;
    }
    assert_eq!([seen[0], seen[3], seen[4]], [0, 0, 0], "{seen:?}");
    assert!(seen[1] > 850 && seen[2] > 850, "{seen:?}");
}

#[test]
fn tiny_temperature_and_top_k_one_behave_like_greedy() {
    let logits = lcg_logits(2000, 11, -3.0, 3.0);
    let mut greedy = Sampler::new(SamplingParams::greedy()).unwrap();
    let want = greedy.sample(&logits, &[], &[]).unwrap().token;
    let mut cold = Sampler::new(SamplingParams { temperature: 1e-6, ..SamplingParams::default() }).unwrap();
    let mut k1 = Sampler::new(SamplingParams { top_k: 1, ..SamplingParams::default() }).unwrap();
    for _ in 0..100 {
        assert_eq!(cold.sample(&logits, &[], &[]).unwrap().token, want);
        assert_eq!(k1.sample(&logits, &[], &[]).unwrap().token, want);
    }
}

#[test]
fn logprobs_are_the_raw_log_softmax() {
    // log-softmax([1, 2, 3]) = x - 3.40760596444438 (computed by hand: 3 + ln(1 + e^-1 + e^-2)).
    let lse = 3.407_605_964_444_38_f64;
    let logits = [1.0, 2.0, 3.0];
    // Penalties and temperature change the draw, not the reported logprobs.
    let p = SamplingParams {
        temperature: 0.5,
        repetition_penalty: 1.5,
        frequency_penalty: 1.0,
        logprobs: Some(3),
        seed: 1,
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(p).unwrap();
    for _ in 0..20 {
        let out = s.sample(&logits, &[2], &[2, 2]).unwrap();
        let want = (logits[out.token as usize] as f64 - lse) as f32;
        assert!((out.logprob.unwrap() - want).abs() < 1e-6, "{out:?}");
        let ids: Vec<u32> = out.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [2, 1, 0]);
        for (id, lp) in &out.top {
            assert!((lp - (logits[*id as usize] as f64 - lse) as f32).abs() < 1e-6, "{out:?}");
        }
    }
}

#[test]
fn top_alternatives_are_ordered_with_ties_by_id_and_skip_non_finite() {
    let logits = [0.5, 2.0, f32::NAN, 2.0, -1.0, 1.0, f32::NEG_INFINITY];
    let mut s = Sampler::new(SamplingParams { logprobs: Some(4), ..SamplingParams::greedy() }).unwrap();
    let out = s.sample(&logits, &[], &[]).unwrap();
    assert_eq!(out.token, 1);
    assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 5, 0]);
    assert_eq!(out.top[0].1, out.top[1].1);
    assert!(out.top.windows(2).all(|w| w[0].1 >= w[1].1));
    // Token 1's logprob over the finite entries only: 2 - (2 + ln Σ e^(x-2)).
    let total: f64 = [0.5f64, 2.0, 2.0, -1.0, 1.0].iter().map(|x| (x - 2.0).exp()).sum();
    assert!((out.logprob.unwrap() as f64 + total.ln()).abs() < 1e-6, "{out:?}");

    // More alternatives than finite logits: only the finite ones.
    let mut s = Sampler::new(SamplingParams { logprobs: Some(100), ..SamplingParams::greedy() }).unwrap();
    assert_eq!(s.sample(&logits, &[], &[]).unwrap().top.len(), 5);
    // Some(0): the chosen token's logprob only. None: nothing.
    let mut s = Sampler::new(SamplingParams { logprobs: Some(0), ..SamplingParams::greedy() }).unwrap();
    let out = s.sample(&logits, &[], &[]).unwrap();
    assert!(out.logprob.is_some() && out.top.is_empty());
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    let out = s.sample(&logits, &[], &[]).unwrap();
    assert!(out.logprob.is_none() && out.top.is_empty());
}

#[test]
fn invalid_params_are_rejected_by_name() {
    let base = SamplingParams::default();
    let cases: Vec<(SamplingParams, &str)> = vec![
        (SamplingParams { temperature: -0.1, ..base.clone() }, "temperature"),
        (SamplingParams { temperature: f32::NAN, ..base.clone() }, "temperature"),
        (SamplingParams { temperature: f32::INFINITY, ..base.clone() }, "temperature"),
        (SamplingParams { top_p: 0.0, ..base.clone() }, "top_p"),
        (SamplingParams { top_p: 1.01, ..base.clone() }, "top_p"),
        (SamplingParams { top_p: f32::NAN, ..base.clone() }, "top_p"),
        (SamplingParams { min_p: -0.01, ..base.clone() }, "min_p"),
        (SamplingParams { min_p: 1.5, ..base.clone() }, "min_p"),
        (SamplingParams { min_p: f32::NAN, ..base.clone() }, "min_p"),
        (SamplingParams { repetition_penalty: 0.0, ..base.clone() }, "repetition_penalty"),
        (SamplingParams { repetition_penalty: -1.0, ..base.clone() }, "repetition_penalty"),
        (SamplingParams { repetition_penalty: f32::NAN, ..base.clone() }, "repetition_penalty"),
        (SamplingParams { presence_penalty: f32::NAN, ..base.clone() }, "presence_penalty"),
        (SamplingParams { presence_penalty: 2.5, ..base.clone() }, "presence_penalty"),
        (SamplingParams { frequency_penalty: -3.0, ..base.clone() }, "frequency_penalty"),
        (SamplingParams { frequency_penalty: f32::NAN, ..base.clone() }, "frequency_penalty"),
    ];
    for (p, name) in cases {
        let e = Sampler::new(p.clone()).unwrap_err().to_string();
        assert!(e.contains(name), "{p:?}: error `{e}` does not name {name}");
        assert!(p.validate().is_err());
    }
    // Boundary values are accepted.
    for p in [
        SamplingParams { top_p: 1.0, min_p: 1.0, ..base.clone() },
        SamplingParams { min_p: 0.0, presence_penalty: -2.0, frequency_penalty: 2.0, ..base.clone() },
        SamplingParams { temperature: 0.0, repetition_penalty: 1e-3, ..base },
    ] {
        p.validate().unwrap();
    }
}

#[test]
fn params_deserialize_with_defaults_and_reject_unknown_fields() {
    let p: SamplingParams = serde_json::from_str("{}").unwrap();
    assert_eq!(p, SamplingParams::default());
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.5, "seed": 18446744073709551615}"#).unwrap();
    assert_eq!(p.temperature, 0.5);
    assert_eq!(p.seed, u64::MAX);
    assert_eq!(p.top_p, 1.0);
    let e = serde_json::from_str::<SamplingParams>(r#"{"top-p": 0.5}"#).unwrap_err().to_string();
    assert!(e.contains("top-p"), "{e}");
    let p = varied_params(3);
    let round: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(round, p);
}

#[test]
fn all_non_finite_logits_are_an_error_not_a_panic() {
    let rows: [&[f32]; 4] =
        [&[f32::NAN; 8], &[f32::NEG_INFINITY; 8], &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY], &[]];
    let configs = [
        SamplingParams::default(),
        SamplingParams::greedy(),
        SamplingParams { repetition_penalty: 1.3, top_k: 2, top_p: 0.5, min_p: 0.1, ..SamplingParams::default() },
        SamplingParams { logprobs: Some(3), ..SamplingParams::default() },
    ];
    for p in configs {
        let mut s = Sampler::new(p.clone()).unwrap();
        for row in rows {
            let e = s.sample(row, &[0], &[]).unwrap_err().to_string();
            assert!(e.contains("logits"), "{p:?} {row:?}: {e}");
        }
    }
}

#[test]
fn nan_and_pos_inf_are_never_chosen() {
    let logits = [f32::NAN, -1.0, f32::INFINITY, 0.5, f32::NAN];
    for p in [
        SamplingParams::greedy(),
        SamplingParams { seed: 4, temperature: 5.0, ..SamplingParams::default() },
        SamplingParams { seed: 4, frequency_penalty: 0.5, logprobs: Some(5), ..SamplingParams::default() },
    ] {
        let mut s = Sampler::new(p.clone()).unwrap();
        let mut seen = [0usize; 5];
        for _ in 0..500 {
            let out = s.sample(&logits, &[], &[3]).unwrap();
            seen[out.token as usize] += 1;
            if let Some(lp) = out.logprob {
                assert!(lp.is_finite());
                assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), [3, 1]);
            }
        }
        assert_eq!([seen[0], seen[2], seen[4]], [0, 0, 0], "{p:?}: {seen:?}");
    }
}

#[test]
fn vocab_sized_rows_work_and_reuse_buffers() {
    // A Qwen-sized row, many steps on one sampler, vocabulary changing size between calls.
    let row = lcg_logits(151_936, 21, -10.0, 10.0);
    let mut s = Sampler::new(SamplingParams { top_k: 40, top_p: 0.9, seed: 1, ..SamplingParams::default() }).unwrap();
    let mut generated = Vec::new();
    for _ in 0..20 {
        let t = s.sample(&row, &[5, 6], &generated).unwrap().token;
        assert!((t as usize) < row.len());
        generated.push(t);
    }
    let small = [0.0, 1.0, 2.0];
    assert!(s.sample(&small, &[], &[]).unwrap().token < 3);
}

// ---- stop criteria ----------------------------------------------------------------------------

/// Feeds `tokens` one at a time, as the engine does, and returns the step (1-based) and reason
/// of the first stop.
fn first_stop(c: &StopCriteria, tokens: &[u32]) -> Option<(usize, FinishReason)> {
    (1..=tokens.len()).find_map(|n| c.check(&tokens[..n]).map(|r| (n, r)))
}

#[test]
fn stop_sequence_straddling_steps_is_found_when_completed() {
    let c = StopCriteria { stop_sequences: vec![vec![7, 8, 9]], ..StopCriteria::new(100, vec![2]) };
    c.validate().unwrap();
    let tokens = [1, 7, 8, 9, 4];
    assert_eq!(c.check(&tokens[..3]), None);
    assert_eq!(first_stop(&c, &tokens), Some((4, FinishReason::StopSequence)));
    assert_eq!(c.matched_stop_sequence(&tokens[..4]), Some(0));
    // A false start followed by the real sequence (naive streaming matchers that reset on a
    // mismatch miss this one).
    let c = StopCriteria { stop_sequences: vec![vec![1, 1, 2]], ..StopCriteria::new(100, vec![]) };
    assert_eq!(first_stop(&c, &[1, 1, 1, 2]), Some((4, FinishReason::StopSequence)));
    assert_eq!(first_stop(&c, &[1, 2, 1, 3, 1]), None);
}

#[test]
fn overlapping_stop_sequences() {
    // Sequences sharing tokens: whichever completes first stops generation.
    let c = StopCriteria { stop_sequences: vec![vec![6, 5, 4], vec![5, 6, 5]], ..StopCriteria::new(100, vec![]) };
    assert_eq!(first_stop(&c, &[5, 6, 5, 4]), Some((3, FinishReason::StopSequence)));
    assert_eq!(c.matched_stop_sequence(&[5, 6, 5]), Some(1));
    assert_eq!(first_stop(&c, &[6, 5, 4]), Some((3, FinishReason::StopSequence)));
    assert_eq!(c.matched_stop_sequence(&[6, 5, 4]), Some(0));
    // Both complete on the same token: the first listed wins.
    let c = StopCriteria { stop_sequences: vec![vec![2, 3], vec![1, 2, 3]], ..StopCriteria::new(100, vec![]) };
    assert_eq!(c.matched_stop_sequence(&[1, 2, 3]), Some(0));
    let c = StopCriteria { stop_sequences: vec![vec![1, 2, 3], vec![2, 3]], ..StopCriteria::new(100, vec![]) };
    assert_eq!(c.matched_stop_sequence(&[1, 2, 3]), Some(0));
    assert_eq!(c.matched_stop_sequence(&[0, 2, 3]), Some(1));
}

#[test]
fn eos_stops_unless_ignored() {
    let c = StopCriteria::new(10, vec![2, 99]);
    assert_eq!(first_stop(&c, &[5, 6, 99, 7]), Some((3, FinishReason::Eos)));
    assert_eq!(first_stop(&c, &[2]), Some((1, FinishReason::Eos)));
    let ignoring = StopCriteria { ignore_eos: true, ..c.clone() };
    assert_eq!(first_stop(&ignoring, &[5, 6, 99, 7, 2, 2]), None);
    // Ignoring EOS does not ignore the length limit or stop sequences.
    assert_eq!(first_stop(&ignoring, &[2; 12]), Some((10, FinishReason::Length)));
    let with_stop = StopCriteria { stop_sequences: vec![vec![99, 7]], ..ignoring };
    assert_eq!(first_stop(&with_stop, &[5, 99, 7]), Some((3, FinishReason::StopSequence)));
}

#[test]
fn max_tokens_and_precedence() {
    let c = StopCriteria { stop_sequences: vec![vec![4, 5]], ..StopCriteria::new(3, vec![9]) };
    assert_eq!(c.check(&[]), None);
    assert_eq!(first_stop(&c, &[1, 1, 1, 1]), Some((3, FinishReason::Length)));
    // A natural end on the last allowed token reports the natural reason.
    assert_eq!(c.check(&[1, 1, 9]), Some(FinishReason::Eos));
    assert_eq!(c.check(&[1, 4, 5]), Some(FinishReason::StopSequence));
    let one = StopCriteria::new(1, vec![]);
    assert_eq!(one.check(&[0]), Some(FinishReason::Length));
}

#[test]
fn stop_criteria_validation_names_the_parameter() {
    let e = StopCriteria::new(0, vec![]).validate().unwrap_err().to_string();
    assert!(e.contains("max_tokens"), "{e}");
    let c = StopCriteria { stop_sequences: vec![vec![1], vec![]], ..StopCriteria::new(5, vec![]) };
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("stop_sequences[1]"), "{e}");
}

#[test]
fn finish_reason_names_are_stable() {
    use FinishReason::*;
    let names: Vec<String> =
        [Length, Eos, StopSequence, Cancelled, Error].iter().map(|r| serde_json::to_string(r).unwrap()).collect();
    assert_eq!(names, [r#""length""#, r#""eos""#, r#""stop_sequence""#, r#""cancelled""#, r#""error""#]);
    assert_eq!(StopSequence.to_string(), "stop_sequence");
}

/// The documented random stream: ChaCha8 keyed with four SplitMix64 outputs of the seed,
/// one u64 per draw, u = (x >> 11) · 2^-53.
fn documented_uniforms(seed: u64, n: usize) -> Vec<f64> {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let mut state = seed;
    let mut key = [0u8; 32];
    for chunk in key.chunks_exact_mut(8) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    let mut rng = rand_chacha::ChaCha8Rng::from_seed(key);
    (0..n).map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64).collect()
}

#[test]
fn draws_invert_the_sorted_cdf_with_one_uniform_per_token() {
    // Token i is the first, in (probability desc, id asc) order, whose cumulative probability
    // exceeds u_i. This pins the seed → token mapping across versions and platforms.
    let logits = [0.3f32, 1.2, -0.4, 1.2, 2.0, 0.0, -1.5, 0.9];
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let t = 0.8f64;
    let w: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - 2.0) / t).exp()).collect();
    let z: f64 = w.iter().sum();
    for seed in [0u64, 1, 42, u64::MAX] {
        let mut s = Sampler::new(SamplingParams { temperature: 0.8, seed, ..SamplingParams::default() }).unwrap();
        for u in documented_uniforms(seed, 100) {
            let mut cum = 0.0;
            let want = order.iter().zip(&w).find(|(_, wi)| {
                cum += *wi / z;
                u < cum
            });
            let want = want.map_or(order[order.len() - 1], |(&i, _)| i) as u32;
            assert_eq!(s.sample(&logits, &[], &[]).unwrap().token, want, "seed {seed}, u = {u}");
        }
    }
}

/// A large row with few distinct values (many ties across histogram buckets).
fn tied_row(n: usize) -> Vec<f32> {
    lcg_logits(n, 77, 0.0, 1.0).iter().map(|x| (x * 37.0).floor() * 0.27 - 5.0).collect()
}

fn brute_force_order(row: &[f32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..row.len() as u32).filter(|&i| row[i as usize].is_finite()).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    order
}

#[test]
fn top_k_with_ties_keeps_exactly_the_best_k() {
    let mut row = tied_row(20_000);
    row[5] = f32::NAN;
    row[6] = f32::NEG_INFINITY;
    let order = brute_force_order(&row);
    let k = 777;
    let allowed: std::collections::HashSet<u32> = order[..k].iter().copied().collect();
    // A huge temperature makes the kept set nearly uniform, so the draws cover it.
    let mut s =
        Sampler::new(SamplingParams { top_k: k, temperature: 1e4, seed: 2, ..SamplingParams::default() }).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..10_000 {
        let t = s.sample(&row, &[], &[]).unwrap().token;
        assert!(allowed.contains(&t), "token {t} (logit {}) is outside the top {k}", row[t as usize]);
        seen.insert(t);
    }
    assert!(seen.len() > 760, "only {} of {k} kept tokens drawn", seen.len());
}

#[test]
fn top_logprobs_match_a_full_sort_on_a_vocab_sized_row() {
    let mut row = tied_row(151_936);
    row[0] = f32::NAN;
    row[99] = 9.0;
    let order = brute_force_order(&row);
    for n in [1, 5, 20, 1000] {
        let mut s = Sampler::new(SamplingParams { logprobs: Some(n), ..SamplingParams::greedy() }).unwrap();
        let out = s.sample(&row, &[], &[]).unwrap();
        assert_eq!(out.token, 99);
        let ids: Vec<u32> = out.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, order[..n], "top-{n}");
    }
}
