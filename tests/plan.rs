//! The operator mapping table: choices, fallbacks, the log lines that report them, and
//! forbidding ops and fusions.

mod common;

use std::sync::Mutex;

use common::*;
use tboost::plan::PlanOptions;
use tboost::session::Session;

/// Captures log records so tests can assert on what a user would read.
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, r: &log::Record) {
        self.0.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
    }
    fn flush(&self) {}
}

static LOGS: Capture = Capture(Mutex::new(Vec::new()));

fn captured() -> Vec<String> {
    let _ = log::set_logger(&LOGS);
    log::set_max_level(log::LevelFilter::Info);
    LOGS.0.lock().unwrap().clone()
}

fn opts(disabled: &[&str]) -> PlanOptions {
    PlanOptions { disabled: disabled.iter().map(|s| s.to_string()).collect(), ..Default::default() }
}

fn last_logits(case: &str, o: &PlanOptions, tokens: &[u32]) -> Vec<f32> {
    let mut r = runner_with(&golden_dir(case), o, 2, 16);
    let mut s = Session::new(&mut r, tokens.len()).unwrap();
    s.feed(tokens, true).unwrap()
}

#[test]
fn head_dim_24_falls_back_to_standard_attention_and_says_so() {
    captured();
    let r = runner(&golden_dir("llama_hd24"));
    let line = "attention: fallback to standard attention (head_dim=24 is not a multiple of 16)";
    assert!(r.plan.summary_lines().iter().any(|l| l.ends_with(line)), "{:?}", r.plan.summary_lines());
    let logs = captured();
    assert!(logs.iter().any(|l| l.contains(line)), "log lacks `{line}`: {logs:?}");
    for l in &r.plan.layers {
        assert_eq!(l.choices[0].op, "standard_attention");
        assert!(l.choices[0].fallback);
    }
}

#[test]
fn head_dim_64_uses_flash_attention_and_logs_it() {
    captured();
    let r = runner(&golden_dir("mistral"));
    let logs = captured();
    assert!(logs.iter().any(|l| l.contains("attention: flash_attention (head_dim=64)")), "{logs:?}");
    assert!(r.plan.layers.iter().all(|l| l.choices[0].op == "flash_attention"));
    let json = r.plan.to_json();
    assert_eq!(json["layers"][0]["choices"][0]["op"], "flash_attention");
}

#[test]
fn forbidding_flash_attention_gives_the_same_logits() {
    let tokens: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 500).collect();
    let flash = last_logits("mistral", &PlanOptions::default(), &tokens);
    let std = last_logits("mistral", &opts(&["flash_attention"]), &tokens);
    let d = max_abs_diff(&flash, &std);
    assert!(d <= 1e-4, "flash vs standard attention: max abs diff {d}");
    assert!(d > 0.0 || flash == std);
}

#[test]
fn forbidding_fusions_changes_no_bits() {
    let tokens: Vec<u32> = (0..23).map(|i| 3 + (i * 53) % 500).collect();
    for case in ["llama_gqa", "qwen2", "mixtral"] {
        let fused = last_logits(case, &PlanOptions::default(), &tokens);
        let unfused = last_logits(case, &opts(&["fuse_qkv", "fuse_gate_up", "fuse_add_norm"]), &tokens);
        assert_eq!(fused, unfused, "{case}: fusions must not change results");
    }
}

#[test]
fn forbidden_fusions_are_recorded_as_such() {
    let r = runner_with(&golden_dir("llama_gqa"), &opts(&["fuse_qkv"]), 1, 4);
    let c = &r.plan.layers[0].choices;
    let qkv = c.iter().find(|c| c.slot == "qkv_projection").unwrap();
    assert_eq!(qkv.op, "separate_q_k_v_matmuls");
    assert!(qkv.reason.contains("fuse_qkv disabled"), "{qkv:?}");
}

#[test]
fn forbidding_every_attention_op_is_a_clear_error() {
    let model = tboost::model::Model::load(&golden_dir("llama_hd24")).unwrap();
    let be = Box::new(tboost::backend::cpu::CpuBackend::new(1).unwrap());
    let err = tboost::runner::ModelRunner::new(&model, be, &opts(&["standard_attention"])).err().expect("must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("no attention operator")
            && msg.contains("head_dim=24")
            && msg.contains("standard_attention disabled"),
        "{msg}"
    );
}

#[test]
fn unknown_names_are_rejected() {
    let err = PlanOptions::parse_disabled("flash_attention, warp_drive").unwrap_err().to_string();
    assert!(err.contains("warp_drive") && err.contains("fuse_qkv"), "{err}");
}
