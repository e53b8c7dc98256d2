//! Golden tests: every case in ../shared/testdata/golden (float64 Hugging Face references)
//! through the runner: last-position logits, all-position logits, the batch section, the
//! logits behind each greedy step, and greedy continuations under the margin rule.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::kv::{KvManager, SeqWork, StepLayout};
use tboost_engine::runner::StepBatch;
use tboost_engine::session::{argmax, Session};

const TOL: f32 = 1e-3;

fn check_case(case: &str) {
    check_model(case, &golden_dir(case));
}

/// The case through a GGUF conversion of the same weights (llama.cpp's names and layout,
/// written by the testkit into a tempdir).
fn check_case_gguf(case: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tboost_testkit::model_files::convert::hf_to_gguf(&golden_dir(case), tmp.path());
    check_model(case, &path);
}

fn check_model(case: &str, path: &std::path::Path) {
    let g = golden(case);
    let mut r = runner(path);
    let vocab = g["params"]["vocab_size"].as_u64().unwrap() as usize;
    for p in g["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().or(p["id"].as_str()).unwrap_or("?").to_string();
        let prompt = ids(&p["token_ids"]);

        // All positions (p7 has them) and the last position.
        let mut s = Session::new(&mut r, prompt.len() + 16).unwrap();
        let logits = s.feed(&prompt, true).unwrap();
        let last = &logits[(prompt.len() - 1) * vocab..];
        let d = max_abs_diff(last, &floats(&p["last_logits"]));
        eprintln!("{case}/{name}: last_logits max abs diff {d:.2e}");
        assert!(d <= TOL, "{case}/{name}: last_logits max abs diff {d}");
        if let Some(all) = p.get("all_logits").filter(|v| !v.is_null()) {
            let want: Vec<f32> = all.as_array().unwrap().iter().flat_map(floats).collect();
            let d = max_abs_diff(&logits, &want);
            assert!(d <= TOL, "{case}/{name}: all_logits max abs diff {d}");
        }

        // Greedy continuation, checking the logits behind every step on the way.
        let gr = &p["greedy"];
        let want = ids(&gr["tokens_f64"]);
        let steps = gr["steps"].as_array().unwrap();
        let margins: Vec<f64> = steps.iter().map(|s| s["top2_margin_f64"].as_f64().unwrap()).collect();
        let second: Vec<u32> = steps.iter().map(|s| ids(&s["top5_ids"])[1]).collect();
        let mut got = Vec::new();
        let mut cur = last.to_vec();
        for (i, st) in steps.iter().enumerate() {
            let top5 = ids(&st["top5_ids"]);
            let want5 = floats(&st["top5_logits"]);
            // Only while our continuation equals the reference do its logits apply.
            if got == want[..i] {
                let have: Vec<f32> = top5.iter().map(|&t| cur[t as usize]).collect();
                let d = max_abs_diff(&have, &want5);
                assert!(d <= TOL, "{case}/{name}: step {i} top5 logits max abs diff {d}");
            }
            let next = argmax(&cur);
            got.push(next);
            if i + 1 < steps.len() {
                cur = s.feed(&[next], false).unwrap();
            }
        }
        check_greedy(&format!("{case}/{name}"), &got, &want, &margins, &second, 2e-3);
    }

    // The batch section: all prompts in one forward pass, as separate sequences.
    if let Some(b) = g.get("batch").filter(|v| !v.is_null()) {
        let prompts: Vec<Vec<u32>> = b["token_ids"].as_array().unwrap().iter().map(ids).collect();
        let tokens: Vec<u32> = prompts.concat();
        let (blocks, bs) = r.kv_geometry().unwrap();
        let mut kv = KvManager::new(blocks, bs, false);
        let mut work = Vec::new();
        let mut rows = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            assert!(kv.grow(i as u64, p.len()), "{case}: the batch fits the cache");
            work.push(SeqWork { seq: i as u64, start: 0, n: p.len() });
            rows.push(work.iter().map(|w| w.n).sum::<usize>() as u32 - 1);
        }
        let mut layout = StepLayout::default();
        kv.layout(&work, &mut layout);
        let mut logits = Vec::new();
        r.forward(&StepBatch { tokens: &tokens, layout: &layout, logit_rows: &rows, argmax_only: false }, &mut logits)
            .unwrap();
        for (i, want) in b["last_logits"].as_array().unwrap().iter().enumerate() {
            let d = max_abs_diff(&logits[i * vocab..(i + 1) * vocab], &floats(want));
            assert!(d <= TOL, "{case}/batch[{i}]: last_logits max abs diff {d}");
        }
        // Greedy continuations of the batch prompts (every reference margin is above the
        // 2e-3 of the margin rule, so they must match exactly).
        for (i, p) in prompts.iter().enumerate() {
            let want = ids(&b["greedy_tokens_f64"][i]);
            let mut s = Session::new(&mut r, p.len() + want.len()).unwrap();
            let got = s.greedy(p, want.len()).unwrap();
            assert_eq!(got, want, "{case}/batch[{i}]: greedy continuation");
        }
    }
}

#[test]
fn llama_gqa() {
    check_case("llama_gqa");
}

#[test]
fn llama_gqa_bf16() {
    check_case("llama_gqa_bf16");
}

#[test]
fn llama_hd24() {
    check_case("llama_hd24");
}

#[test]
fn mistral() {
    check_case("mistral");
}

#[test]
fn mixtral() {
    check_case("mixtral");
}

#[test]
fn qwen2() {
    check_case("qwen2");
}

#[test]
fn qwen3() {
    check_case("qwen3");
}

#[test]
fn qwen3_gguf() {
    check_case_gguf("qwen3");
}

#[test]
fn qwen3_moe() {
    check_case("qwen3_moe");
}

#[test]
fn qwen3_moe_gguf() {
    check_case_gguf("qwen3_moe");
}

#[test]
fn gemma3() {
    check_case("gemma3");
}

#[test]
fn gemma3_gguf() {
    check_case_gguf("gemma3");
}

#[test]
fn phi3() {
    check_case("phi3");
}

#[test]
fn phi3_gguf() {
    check_case_gguf("phi3");
}
