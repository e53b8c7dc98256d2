//! The Ascend backend (`--backend ascend`) on the CANN SIMULATOR (`ascend-sim/`: NOT CANN, not an
//! NPU; reference math in f64 on host memory behind CANN's sonames and symbols). Nothing here ran on
//! Ascend hardware; `scripts/ascend-smoke.sh` runs the golden checks on a machine that has one.
//!
//! The simulator is found through `TBOOST_ASCEND_SIM` (set by `scripts/test.sh`), else built with
//! `scripts/build-ascend-sim.sh`. CANN state is per process (one `aclInit`, the simulator's counters
//! and `TBOOST_SIM_*` settings are read at init), so every test runs in a process of its own: the
//! `tboost` binary, or this test binary re-run as a child with one test selected.
//!
//! Tolerances: `TestBackend::logit_tol` of tboost-testkit's backends (f16 activations, with its
//! derivation). Greedy ids follow the golden README's margin rule with τ = 2·TOL (two logits may
//! each move by TOL).
//!
//! The engine scenarios (batch invariance, golden greedy continuations through the engine,
//! prefix cache, preemption, cancellation) run on the simulator in the engine's tests/engine.rs,
//! over every backend present; this file keeps what is about the CLI or Ascend itself.

use tboost_testkit::backends::{simulator_home, Kind, TestBackend};
use tboost_testkit::golden as common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;
use tboost_engine::backend::ascend::sys::{Cann, SimStats};
use tboost_engine::backend::ascend::AscendBackend;
use tboost_engine::backend::{Backend, BackendKind};
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::plan::PlanOptions;
use tboost_engine::runner::ModelRunner;
use tboost_engine::sample::FinishReason;
use tboost_engine::sched::Request;
use tboost_engine::session::{argmax, Session};

/// The simulator's logit tolerance (see the module doc).
fn tol(layers: usize, max_want: f32) -> f32 {
    let sim = TestBackend { name: "ascend", kind: Kind::AscendSim, block_size: 128 };
    sim.logit_tol(layers, max_want)
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

const CHILD: &str = "TBOOST_ASCEND_TEST_CHILD";

/// A command with the CANN search path pointing at the simulator only (and no inherited settings).
fn sim_env(cmd: &mut Command, env: &[(&str, String)]) {
    for v in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LD_LIBRARY_PATH", "TBOOST_BACKEND", "TBOOST_DISABLE"] {
        cmd.env_remove(v);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("TBOOST_SIM_") || k == "TBOOST_ASCEND_KNOWN_BAD" || k == "TBOOST_PROFILE" {
            cmd.env_remove(k);
        }
    }
    if !env.iter().any(|(k, _)| *k == "ASCEND_HOME_PATH") {
        cmd.env("ASCEND_HOME_PATH", simulator_home(&[]));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
}

/// Runs `body` in a fresh process of this test binary (the parent checks it ran and passed).
fn isolated(name: &str, env: &[(&str, String)], body: impl FnOnce()) {
    if std::env::var_os(CHILD).is_some() {
        body();
        return;
    }
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, "1");
    sim_env(&mut cmd, env);
    let out = cmd.output().expect("spawn the test child");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && so.contains("test result: ok. 1 passed"),
        "child process for {name} failed ({}):\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
    eprint!("{se}");
}

/// `tboost ARGS` on the simulator: (success, stdout, stderr).
fn tboost(args: &[&str], env: &[(&str, String)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tboost"));
    cmd.args(args);
    sim_env(&mut cmd, env);
    let out = cmd.output().expect("run tboost");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn sim_cann() -> Cann {
    let c = Cann::load().unwrap_or_else(|e| panic!("loading the CANN simulator: {e}"));
    assert!(c.is_simulator(), "these tests run on the CANN SIMULATOR only");
    c
}

fn stats() -> SimStats {
    sim_cann().sim_stats().expect("the simulator's counters")
}

/// The golden cases checked on the simulator: the six of `CASES` and the architectures added
/// after them (Qwen3, Qwen3-MoE, Gemma 3, Phi-3), which `CASES` leaves out so that the CPU tests
/// over it keep their meaning.
fn ascend_cases() -> impl Iterator<Item = &'static str> {
    CASES.iter().chain(NEW_ARCH_CASES).copied()
}

fn layers(g: &Value) -> usize {
    g["params"]["num_hidden_layers"].as_u64().expect("num_hidden_layers") as usize
}

fn ascend_runner(path: &Path, opts: &PlanOptions, kv_blocks: usize) -> ModelRunner {
    let model = Model::load(path).unwrap_or_else(|e| panic!("load {}: {e}", path.display()));
    let be = AscendBackend::open(0).unwrap_or_else(|e| panic!("open the Ascend backend on the simulator: {e}"));
    let mut r = ModelRunner::new(&model, Box::new(be), opts, 2).unwrap_or_else(|e| panic!("plan: {e}"));
    r.alloc_kv(kv_blocks, opts.block_size).unwrap();
    r
}

fn ascend_opts() -> PlanOptions {
    PlanOptions { block_size: 128, ..PlanOptions::default() }
}

fn ascend_engine(path: &Path, blocks: usize, max_batched: usize) -> Engine {
    let e = Engine::new(EngineConfig {
        backend: BackendKind::Ascend { device: 0 },
        threads: 2,
        kv_size: KvSize::Blocks(blocks),
        max_batched_tokens: max_batched,
        max_seqs: 16,
        ..Default::default()
    })
    .unwrap();
    e.load(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    e
}

fn greedy(prompt: Vec<u32>, n: usize) -> Request {
    Request { ignore_eos: true, ..Request::new(prompt, n) }
}

fn run_all(e: &Engine, reqs: &[Request]) -> Vec<Vec<u32>> {
    let ids: Vec<u64> = reqs.iter().map(|r| e.enqueue(r.clone()).unwrap()).collect();
    e.run_to_completion().unwrap();
    ids.iter()
        .map(|&id| {
            let o = e.output(id).unwrap();
            assert_eq!(o.finish, Some(FinishReason::Length), "request {id}: {:?}", o.error);
            o.tokens
        })
        .collect()
}

// ------------------------------------------------------------------------------- golden cases

#[test]
fn golden_logits_through_tboost_logits_on_the_simulator() {
    for case in ascend_cases() {
        let g = golden(case);
        let dir = golden_dir(case);
        for p in g["prompts"].as_array().unwrap() {
            let prompt = ids(&p["token_ids"]);
            let list: Vec<String> = prompt.iter().map(u32::to_string).collect();
            let (ok, out, err) = tboost(
                &[
                    "logits",
                    "--backend",
                    "ascend",
                    "--model",
                    dir.to_str().unwrap(),
                    "--tokens",
                    &list.join(","),
                    "--all-positions",
                ],
                &[],
            );
            assert!(ok, "{case}: tboost logits --backend ascend failed:\n{err}");
            let v: Value = serde_json::from_str(&out).expect("logits JSON");
            let rows: Vec<Vec<f32>> = v["logits"].as_array().unwrap().iter().map(floats).collect();
            let want = floats(&p["last_logits"]);
            let t = tol(layers(&g), max_abs(&want));
            let d = max_abs_diff(rows.last().unwrap(), &want);
            eprintln!(
                "{case}/{} tokens: last_logits max abs diff {d:.2e} (tol {t:.2e}) [ascend, SIMULATOR]",
                prompt.len()
            );
            assert!(d <= t, "{case}: last_logits max abs diff {d} > {t}");
            if let Some(all) = p.get("all_logits").filter(|v| !v.is_null()) {
                let want: Vec<f32> = all.as_array().unwrap().iter().flat_map(floats).collect();
                let got: Vec<f32> = rows.concat();
                let t = tol(layers(&g), max_abs(&want));
                let d = max_abs_diff(&got, &want);
                eprintln!("{case}/{} tokens: all_logits max abs diff {d:.2e} (tol {t:.2e})", prompt.len());
                assert!(d <= t, "{case}: all_logits max abs diff {d} > {t}");
            }
        }
    }
}

/// golden.rs's checks through a runner on the Ascend backend: the logits behind every greedy
/// step (while the continuation equals the reference) and the greedy ids under the margin rule.
fn check_case_on_ascend(case: &str) {
    let g = golden(case);
    let mut r = ascend_runner(&golden_dir(case), &ascend_opts(), 8);
    let n_layers = layers(&g);
    for p in g["prompts"].as_array().unwrap() {
        let prompt = ids(&p["token_ids"]);
        let mut s = Session::new(&mut r, prompt.len() + 16).unwrap();
        let mut cur = s.feed(&prompt, false).unwrap();
        let gr = &p["greedy"];
        let want = ids(&gr["tokens_f64"]);
        let steps = gr["steps"].as_array().unwrap();
        let margins: Vec<f64> = steps.iter().map(|s| s["top2_margin_f64"].as_f64().unwrap()).collect();
        let second: Vec<u32> = steps.iter().map(|s| ids(&s["top5_ids"])[1]).collect();
        let mut got = Vec::new();
        let mut worst = 0f32;
        let mut tau = 0f64;
        for (i, st) in steps.iter().enumerate() {
            let top5 = ids(&st["top5_ids"]);
            let want5 = floats(&st["top5_logits"]);
            let t = tol(n_layers, max_abs(&want5));
            tau = tau.max(2.0 * t as f64);
            if got == want[..i] {
                let have: Vec<f32> = top5.iter().map(|&x| cur[x as usize]).collect();
                let d = max_abs_diff(&have, &want5);
                worst = worst.max(d);
                assert!(d <= t, "{case}: step {i} top5 logits max abs diff {d} > {t}");
            }
            let next = argmax(&cur);
            got.push(next);
            if i + 1 < steps.len() {
                cur = s.feed(&[next], false).unwrap();
            }
        }
        eprintln!("{case}/{} tokens: greedy step logits max abs diff {worst:.2e} [ascend, SIMULATOR]", prompt.len());
        check_greedy(&format!("{case} (ascend)"), &got, &want, &margins, &second, tau);
    }
}

#[test]
fn golden_greedy_steps_through_the_runner_on_the_simulator() {
    isolated("golden_greedy_steps_through_the_runner_on_the_simulator", &[], || {
        for case in ascend_cases() {
            check_case_on_ascend(case);
        }
        assert_eq!(stats().rule_violations, 0, "two-phase / lifetime rule violations");
    });
}

/// Sliding windows on the device past a block: Mistral's weights with a window of 24 in every
/// layer (blocks of 128), a 200-token prompt in chunks of 150 and 50, then 30 decodes. Prefill runs
/// FIA's band (`sparseMode` 4), each decode the window's mask; for the second chunk and every
/// decode the block wholly behind the window is left out of the block table (the engine may have
/// given it back). Every position
/// matches the CPU backend's windowed attention within the f16 tolerance, and the window matters:
/// without it the CPU's logits move by far more than that tolerance.
#[test]
fn sliding_window_attention_past_a_block_matches_the_cpu_on_the_simulator() {
    use tboost_testkit::golden::runner;
    use tboost_testkit::model_files::hf::{dir_with_config, golden_config};
    isolated("sliding_window_attention_past_a_block_matches_the_cpu_on_the_simulator", &[], || {
        const WINDOW: usize = 24;
        let windowed = |w: Option<usize>| {
            let mut c = golden_config("mistral");
            c["sliding_window"] = w.map_or(Value::Null, |w| w.into());
            dir_with_config("mistral", &c)
        };
        let (dir, full) = (windowed(Some(WINDOW)), windowed(None));
        let layers = golden_config("mistral")["num_hidden_layers"].as_u64().unwrap() as usize;
        let prompt: Vec<u32> = (0..200u32).map(|i| 3 + (i * 7919 + 11) % 509).collect();
        let steps = 30;
        let mut asc = ascend_runner(dir.path(), &ascend_opts(), 8);
        for d in asc.plan.layers.iter().flat_map(|l| &l.decisions) {
            if matches!(d.slot.name(), "attention_prefill" | "attention_decode") {
                assert_eq!((d.backend.as_str(), d.fallback), ("ascend", false), "{}", d.reason);
                assert!(d.reason.contains(&format!("sliding_window={WINDOW}")), "{}", d.reason);
            }
        }
        let (mut cpu, mut no_window) = (runner(dir.path()), runner(full.path()));
        let vocab = cpu.cfg.vocab_size;
        let n = prompt.len() + steps;
        let (mut sa, mut sc, mut sf) = (
            Session::new(&mut asc, n).unwrap(),
            Session::new(&mut cpu, n).unwrap(),
            Session::new(&mut no_window, n).unwrap(),
        );
        // The device takes the prompt in two chunks: the second starts at 150, past a block and
        // the window, so its band runs over a trimmed block table.
        let mut la = sa.feed(&prompt[..150], true).unwrap();
        la.extend(sa.feed(&prompt[150..], true).unwrap());
        let (mut lc, mut lf) = (sc.feed(&prompt, true).unwrap(), sf.feed(&prompt, true).unwrap());
        let (mut worst, mut worst_tol, mut moved) = (0f32, f32::MAX, 0f32);
        for step in 0..=steps {
            let t = tol(layers, max_abs(&lc));
            let d = max_abs_diff(&la, &lc);
            assert!(d <= t, "step {step}: ascend vs cpu max abs diff {d} > {t}");
            (worst, worst_tol) = (worst.max(d), worst_tol.min(t));
            moved = moved.max(max_abs_diff(&lc[lc.len() - vocab..], &lf[lf.len() - vocab..]));
            if step < steps {
                let next = argmax(&lc[lc.len() - vocab..]);
                (la, lc, lf) = (
                    sa.feed(&[next], false).unwrap(),
                    sc.feed(&[next], false).unwrap(),
                    sf.feed(&[next], false).unwrap(),
                );
            }
        }
        eprintln!("window {WINDOW}: ascend vs cpu max abs diff {worst:.2e} (tol >= {worst_tol:.2e}); without the window the cpu's logits move by {moved:.2} [SIMULATOR]");
        assert!(moved > 20.0 * worst_tol, "the window must matter here: without it the logits moved by only {moved}");
        drop((sa, sc, sf));
        drop(asc);
        assert_eq!(stats().rule_violations, 0);
    });
}

// ------------------------------------------------------------------------------- the plan

fn plan_json(case: &str, extra: &[&str], env: &[(&str, String)]) -> Value {
    let dir = golden_dir(case);
    let mut args = vec!["plan", "--json", "--backend", "ascend", "--model", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (ok, out, err) = tboost(&args, env);
    assert!(ok, "tboost plan --backend ascend ({case}) failed:\n{err}");
    serde_json::from_str(&out).expect("plan JSON")
}

fn decision<'v>(plan: &'v Value, layer: usize, slot: &str) -> &'v Value {
    plan["layers"][layer]["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["slot"] == slot)
        .unwrap_or_else(|| panic!("layer {layer} has no {slot} decision"))
}

/// The first candidate the Ascend backend rejected, as `(param, value)`.
fn ascend_rejection(d: &Value) -> (String, String) {
    let t = d["tried"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["backend"] == "ascend" && t["verdict"] == "rejected")
        .unwrap_or_else(|| panic!("no ascend rejection in {d}"));
    (t["why"]["param"].as_str().unwrap().into(), t["why"]["value"].as_str().unwrap().into())
}

#[test]
fn the_plan_names_fused_infer_attention_and_every_fallback_with_its_reason() {
    // llama_gqa: FIA for both phases, on the device; the device facts say simulator and version.
    let p = plan_json("llama_gqa", &[], &[]);
    assert_eq!(p["device"]["backend"], "ascend");
    assert!(p["device"]["device"].as_str().unwrap().contains("Ascend910B2"), "{}", p["device"]);
    assert!(p["device"]["device"].as_str().unwrap().contains("SIMULATOR"), "{}", p["device"]);
    assert_eq!(p["device"]["runtime_version"], "CANN 8.1.RC1 (simulated)");
    assert_eq!(p["act_dtype"], "f16");
    assert_eq!(p["block_size"], 128);
    for l in 0..2 {
        for slot in ["attention_prefill", "attention_decode"] {
            let d = decision(&p, l, slot);
            assert_eq!(d["backend"], "ascend", "{d}");
            assert_eq!(d["placement"], "primary");
            assert_eq!(d["fallback"], false);
            assert!(d["kernel"].as_str().unwrap().contains("FusedInferAttentionScore"), "{d}");
        }
        assert_eq!(decision(&p, l, "kv_write")["kernel"], "aclnnScatterPaKvCache");
        assert_eq!(decision(&p, l, "mlp")["choice"], "fused_gate_up_swiglu");
        // f32 weights converted to f16 at upload (aclnnMm takes one dtype): the preferred op
        // still runs on the device, so that is no fallback, and the reason says why.
        for slot in ["qkv", "mlp", "ffn_norm"] {
            let d = decision(&p, l, slot);
            assert_eq!(d["weights"]["to"], "f16", "{d}");
            assert_eq!(d["fallback"], false, "a weight conversion is not a fallback: {d}");
            assert!(d["reason"].as_str().unwrap().contains("stored weights refused"), "{d}");
        }
    }
    assert_eq!(p["copy_bytes_per_token"], 0, "everything on the device");

    // llama_hd24: head_dim 24 is not 16-aligned: the attention group falls back to the CPU's
    // standard attention, and the log says so.
    let (ok, text, log) = tboost(
        &["plan", "--backend", "ascend", "--model", golden_dir("llama_hd24").to_str().unwrap()],
        &[("RUST_LOG", "info".into())],
    );
    assert!(ok, "{log}");
    let p = plan_json("llama_hd24", &[], &[]);
    for l in 0..3 {
        let d = decision(&p, l, "attention_prefill");
        assert_eq!((d["backend"].as_str(), d["placement"].as_str()), (Some("cpu"), Some("cpu")), "{d}");
        assert_eq!(d["choice"], "standard_attention");
        assert_eq!(d["fallback"], true);
        assert_eq!(ascend_rejection(d), ("head_dim".into(), "24".into()));
        assert_eq!(decision(&p, l, "kv_write")["placement"], "cpu", "the group stays together");
        assert_eq!(decision(&p, l, "qkv")["backend"], "ascend", "the rest stays on the device");
    }
    assert!(p["copy_bytes_per_token"].as_u64().unwrap() > 0);
    for out in [&text, &log] {
        assert!(out.contains("fallback to standard attention") && out.contains("head_dim=24"), "{out}");
    }
    assert!(log.contains("CANN SIMULATOR") && log.contains("Ascend910B2") && log.contains("8.1.RC1"), "{log}");

    // A CANN version in the known-bad table: attention falls back and names the version.
    let p = plan_json("llama_gqa", &[], &[("TBOOST_SIM_CANN_VERSION", "0.0.RC2".into())]);
    let d = decision(&p, 0, "attention_prefill");
    assert_eq!(d["placement"], "cpu");
    assert_eq!(ascend_rejection(d), ("cann_version".into(), "0.0.RC2".into()));
    assert!(d["reason"].as_str().unwrap().contains("cann_version=0.0.RC2"), "{d}");
    // ... and a range given at deployment (TBOOST_ASCEND_KNOWN_BAD) around the default version.
    let p = plan_json("llama_gqa", &[], &[("TBOOST_ASCEND_KNOWN_BAD", "aclnnRmsNorm@8.1.RC1..8.2.0".into())]);
    let d = decision(&p, 0, "attn_norm");
    assert_eq!((d["placement"].as_str(), d["fallback"].as_bool()), (Some("cpu"), Some(true)), "{d}");
    assert_eq!(ascend_rejection(d), ("cann_version".into(), "8.1.RC1".into()));

    // A SoC without bf16 (and without FIA kernels): f16 activations, attention on the CPU because
    // of the SoC; bf16 is not offered.
    let p = plan_json("llama_gqa_bf16", &[], &[("TBOOST_SIM_SOC", "Ascend310P3".into())]);
    assert!(p["device"]["device"].as_str().unwrap().contains("Ascend310P3"));
    assert_eq!(p["act_dtype"], "f16");
    let d = decision(&p, 0, "attention_prefill");
    assert_eq!(d["placement"], "cpu");
    assert_eq!(ascend_rejection(d), ("soc".into(), "Ascend310P3".into()));
    let p = plan_json("llama_gqa_bf16", &["--kv-dtype", "bf16"], &[("TBOOST_SIM_SOC", "Ascend310P3".into())]);
    let d = decision(&p, 0, "kv_write");
    assert_eq!(d["placement"], "cpu");
    assert_eq!(ascend_rejection(d), ("kv_dtype".into(), "bf16".into()));

    // --disable works for the Ascend ops like any other.
    let p = plan_json("llama_gqa", &["--disable", "flash_attention,fuse_gate_up"], &[]);
    let d = decision(&p, 0, "attention_prefill");
    assert!(d["tried"].as_array().unwrap().iter().any(|t| t["verdict"] == "disabled"), "{d}");
    assert_eq!(d["placement"], "cpu");
    assert_eq!(decision(&p, 0, "mlp")["choice"], "gate_up_matmuls_then_swiglu");
    assert_eq!(decision(&p, 0, "mlp")["backend"], "ascend");

    // An op the installation lacks (a simulator variant without aclnnSwiGlu): the MLP slots fall
    // back to the CPU and say which symbol is missing.
    let omit = simulator_home(&["--omit", "aclnnSwiGlu"]);
    let p = plan_json("llama_gqa", &[], &[("ASCEND_HOME_PATH", omit.display().to_string())]);
    let d = decision(&p, 0, "mlp");
    assert_eq!((d["placement"].as_str(), d["fallback"].as_bool()), (Some("cpu"), Some(true)), "{d}");
    assert_eq!(ascend_rejection(d), ("symbol".into(), "aclnnSwiGlu".into()));
    assert_eq!(decision(&p, 0, "qkv")["backend"], "ascend");

    // mixtral: MoE routing and the grouped experts on the device; the per-expert path is not.
    let p = plan_json("mixtral", &[], &[]);
    assert_eq!(decision(&p, 0, "moe_routing")["kernel"], "aclnnMm+aclnnMoeGatingTopKSoftmax");
    let d = decision(&p, 0, "mlp");
    assert_eq!((d["choice"].as_str(), d["backend"].as_str()), (Some("moe_grouped"), Some("ascend")));
    assert!(d["kernel"].as_str().unwrap().contains("aclnnGroupedMatmulV4"));
}

/// The SoC profiles (each rule cites its op doc in supports.rs and the simulator): Ascend950 runs
/// FusedInferAttentionScoreV5 (V1..V4 return 361001 there); the Atlas inference series (310P) has
/// no RotaryPositionEmbedding, FIA or ScatterPaKvCache kernels; 200I/500 A2 (310B) has no RmsNorm,
/// SwiGlu or Mm; the training series (910A) has no bf16. Each op falls back on its own and says why.
#[test]
fn soc_profiles_put_each_op_where_its_kernel_exists_and_say_why() {
    let soc = |name: &str| vec![("TBOOST_SIM_SOC", name.to_string())];

    let p = plan_json("llama_gqa", &[], &soc("Ascend950PR"));
    for slot in ["attention_prefill", "attention_decode"] {
        let d = decision(&p, 0, slot);
        assert_eq!((d["backend"].as_str(), d["placement"].as_str()), (Some("ascend"), Some("primary")), "{d}");
        assert_eq!(d["kernel"], "aclnnFusedInferAttentionScoreV5", "{d}");
    }
    assert_eq!(p["act_dtype"], "f16");

    let (ok, _, log) = tboost(
        &["plan", "--backend", "ascend", "--model", golden_dir("llama_gqa").to_str().unwrap()],
        &[("TBOOST_SIM_SOC", "Ascend310P3".into()), ("RUST_LOG", "info".into())],
    );
    assert!(ok, "{log}");
    let p = plan_json("llama_gqa", &[], &soc("Ascend310P3"));
    for slot in ["rope", "attention_prefill", "kv_write"] {
        let d = decision(&p, 0, slot);
        assert_eq!(d["placement"], "cpu", "{slot}: {d}");
        assert_eq!(ascend_rejection(d), ("soc".into(), "Ascend310P3".into()), "{slot}: {d}");
    }
    let r = decision(&p, 0, "rope");
    assert!(r["reason"].as_str().unwrap().contains("soc=Ascend310P3"), "{r}");
    assert!(log.contains("soc=Ascend310P3") && log.contains("aclnnRotaryPositionEmbedding"), "{log}");
    for slot in ["attn_norm", "qkv", "mlp"] {
        assert_eq!(decision(&p, 0, slot)["backend"], "ascend", "{slot} has its kernels on 310P");
    }

    let p = plan_json("llama_gqa", &[], &soc("Ascend310B1"));
    assert_eq!(p["act_dtype"], "f16", "no bf16 on 310B");
    for slot in ["attn_norm", "qkv", "mlp", "rope"] {
        let d = decision(&p, 0, slot);
        assert_eq!((d["placement"].as_str(), d["fallback"].as_bool()), (Some("cpu"), Some(true)), "{slot}: {d}");
        assert_eq!(ascend_rejection(d), ("soc".into(), "Ascend310B1".into()), "{slot}: {d}");
    }
    assert!(decision(&p, 0, "mlp")["reason"].as_str().unwrap().contains("aclnnMm"), "the reason names the op");

    let p = plan_json("llama_gqa_bf16", &[], &soc("Ascend910A"));
    assert_eq!(p["act_dtype"], "f16", "no bf16 on the training series");
    let d = decision(&p, 0, "rope");
    assert_eq!(ascend_rejection(d), ("soc".into(), "Ascend910A".into()), "{d}");
    assert_eq!(decision(&p, 0, "qkv")["backend"], "ascend");
}

fn model_decision<'v>(plan: &'v Value, slot: &str) -> &'v Value {
    plan["model"].as_array().unwrap().iter().find(|d| d["slot"] == slot).unwrap_or_else(|| panic!("no model {slot}"))
}

/// On the device and not a fallback: the decision's backend, placement and kernel.
fn on_device(d: &Value, kernel: &str) {
    assert_eq!(
        (d["backend"].as_str(), d["placement"].as_str(), d["fallback"].as_bool()),
        (Some("ascend"), Some("primary"), Some(false)),
        "{d}"
    );
    assert!(d["kernel"].as_str().unwrap_or_default().contains(kernel), "{kernel} expected: {d}");
}

/// Qwen3, Qwen3-MoE, Gemma 3 and Phi-3 on Ascend: each new slot's decision names its aclnn op
/// (q/k norm: aclnnRmsNorm over `[tokens·heads, head_dim]`; Gemma's embedding scale: aclnnMul +
/// aclnnCast; GeGLU: aclnnGeluV2 (tanh) + aclnnMul + aclnnCast; post-norms: aclnnRmsNorm; sliding layers: FIA
/// with the window in the reason; the local and LongRoPE tables on the host of this backend), nothing
/// runs beside the device; and an installation without aclnnGeluV2 runs Gemma's MLP on the CPU,
/// saying why.
#[test]
fn the_plan_maps_the_new_architectures_slots_to_aclnn_ops() {
    for case in NEW_ARCH_CASES {
        let p = plan_json(case, &[], &[]);
        assert_eq!(p["copy_bytes_per_token"], 0, "{case}: every slot on the device");
        for d in p["layers"].as_array().unwrap().iter().flat_map(|l| l["decisions"].as_array().unwrap()) {
            assert_eq!((d["backend"].as_str(), d["fallback"].as_bool()), (Some("ascend"), Some(false)), "{case}: {d}");
        }
        if *case != "phi3" {
            for l in 0..layers(&golden(case)) {
                on_device(decision(&p, l, "qk_norm"), "aclnnRmsNorm");
            }
        }
    }
    let p = plan_json("qwen3_moe", &[], &[]);
    on_device(decision(&p, 0, "moe_routing"), "aclnnMoeGatingTopKSoftmax");
    on_device(decision(&p, 0, "mlp"), "aclnnGroupedMatmulV4");

    let p = plan_json("phi3", &[], &[]);
    let d = model_decision(&p, "rope_tables");
    assert_eq!((d["backend"].as_str(), d["fallback"].as_bool()), (Some("ascend"), Some(false)), "{d}");
    assert!(d["reason"].as_str().unwrap().contains("longrope"), "{d}");

    let p = plan_json("gemma3", &[], &[]);
    let d = model_decision(&p, "embed");
    assert_eq!(d["choice"], "embed_then_scale");
    on_device(d, "aclnnEmbedding+aclnnMul+aclnnCast");
    for slot in ["rope_tables", "rope_tables_local"] {
        let d = model_decision(&p, slot);
        assert_eq!((d["backend"].as_str(), d["fallback"].as_bool()), (Some("ascend"), Some(false)), "{d}");
    }
    // layer_types: sliding, sliding, full, sliding (window 8)
    for (l, sliding) in [(0, true), (1, true), (2, false), (3, true)] {
        for slot in ["attention_prefill", "attention_decode"] {
            let d = decision(&p, l, slot);
            on_device(d, "aclnnFusedInferAttentionScore");
            assert_eq!(d["reason"].as_str().unwrap().contains("sliding_window=8"), sliding, "layer {l}: {d}");
        }
        for slot in ["post_attn_norm", "post_ffn_norm"] {
            on_device(decision(&p, l, slot), "aclnnRmsNorm");
        }
        let d = decision(&p, l, "mlp");
        assert_eq!(d["choice"], "gate_up_matmuls_then_geglu");
        on_device(d, "aclnnMm+aclnnGeluV2+aclnnMul+aclnnCast");
    }
    // Without aclnnGeluV2 in libopapi the MLP slot falls back to the CPU and names the symbol.
    let omit = simulator_home(&["--omit", "aclnnGeluV2"]);
    let (ok, _, log) = tboost(
        &["plan", "--backend", "ascend", "--model", golden_dir("gemma3").to_str().unwrap()],
        &[("ASCEND_HOME_PATH", omit.display().to_string()), ("RUST_LOG", "info".into())],
    );
    assert!(ok, "{log}");
    assert!(
        log.contains("fallback to gate_up_matmuls_then_geglu on cpu") && log.contains("symbol=aclnnGeluV2"),
        "{log}"
    );
    let p = plan_json("gemma3", &[], &[("ASCEND_HOME_PATH", omit.display().to_string())]);
    for l in 0..4 {
        let d = decision(&p, l, "mlp");
        assert_eq!((d["placement"].as_str(), d["fallback"].as_bool()), (Some("cpu"), Some(true)), "{d}");
        assert_eq!(ascend_rejection(d), ("symbol".into(), "aclnnGeluV2".into()));
        assert_eq!(decision(&p, l, "qkv")["backend"], "ascend", "the rest stays on the device");
    }
    assert!(p["copy_bytes_per_token"].as_u64().unwrap() > 0);
}

/// `aclrtSetDevice` binds the *calling thread*, and hosts drive the engine from any thread
/// (`Backend: Send`): the backend makes its device current on every entry. The simulator keeps
/// the current device per thread, so a thread that never set one gets CANN's "context is null".
#[test]
fn steps_driven_from_another_host_thread_run_on_the_device() {
    isolated("steps_driven_from_another_host_thread_run_on_the_device", &[], || {
        let g = golden("llama_gqa");
        let prompt = ids(&g["prompts"][0]["token_ids"]);
        let mut r = ascend_runner(&golden_dir("llama_gqa"), &ascend_opts(), 8);
        let here = Session::new(&mut r, prompt.len() + 4).unwrap().feed(&prompt, false).unwrap();
        let p2 = prompt.clone();
        let (r, there) = std::thread::spawn(move || {
            let logits = Session::new(&mut r, p2.len() + 4)
                .unwrap()
                .feed(&p2, false)
                .unwrap_or_else(|e| panic!("a step on a second host thread: {e}"));
            (r, logits)
        })
        .join()
        .expect("the second thread");
        assert_eq!(here, there, "the same step on another thread gives the same logits");
        drop(r);
        let s = stats();
        assert!(s.is_clean(), "{s:?}");
        assert_eq!(s.rule_violations, 0);
    });
}

/// `aclrtMemcpyAsync` wants both addresses 64-byte aligned, and the simulator refuses an on-chip
/// copy that is not. Views sit at any element offset: the backend copies those with a kernel
/// (here the SwiGLU staging of gate/up views 4 bytes off alignment), never with a misaligned memcpy.
#[test]
fn unaligned_views_are_copied_by_a_kernel_never_by_a_misaligned_memcpy() {
    use tboost_engine::backend::{BackendExt, DType, Op, View};
    isolated("unaligned_views_are_copied_by_a_kernel_never_by_a_misaligned_memcpy", &[], || {
        let mut be = AscendBackend::open(0).unwrap();
        let n = 40;
        let (a, o) = (be.alloc(DType::F32, 1 + 2 * n).unwrap(), be.alloc(DType::F32, n).unwrap());
        let vals: Vec<f32> = (0..2 * n).map(|i| (i as f32 - 40.0) / 16.0).collect();
        be.write_typed_async(View::new(a, 1, 2 * n), &vals).unwrap();
        be.launch(&Op::SwiGlu { gate: View::new(a, 1, n), up: View::new(a, 1 + n, n), out: View::new(o, 0, n) })
            .unwrap_or_else(|e| panic!("swiglu over unaligned views: {e}"));
        let mut got = vec![0f32; n];
        be.read_typed(View::new(o, 0, n), &mut got).unwrap();
        for i in 0..n {
            let (g, u) = (vals[i] as f64, vals[n + i] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!((got[i] as f64 - want).abs() < 1e-5, "element {i}: {} vs {want}", got[i]);
        }
        be.free(a);
        be.free(o);
        drop(be);
        let s = stats();
        assert!(s.is_clean(), "{s:?}");
        assert_eq!(s.rule_violations, 0, "no misaligned aclrtMemcpyAsync was issued");
    });
}

/// The CPU kernels' work-split tunables do not apply to aclnn ops: the plan refuses them on a
/// slot the device runs, naming the key, the slot and the backend, instead of dropping them.
#[test]
fn cpu_tiling_tunables_are_refused_on_ascend_naming_the_key_and_the_slot() {
    let dir = golden_dir("mixtral");
    for (tiling, want) in [
        ("matmul.panel_rows=32", "tiling.matmul.panel_rows=32 is not the default (unset) on ascend, whose kernels choose their own tiling (layer 0: qkv runs fused_qkv_matmul on ascend)"),
        ("moe.expert_batch_tokens=4", "tiling.moe.expert_batch_tokens=4 is not the default (unset) on ascend, whose kernels choose their own tiling (layer 0: mlp runs moe_grouped on ascend)"),
    ] {
        let (ok, _, err) = tboost(&["plan", "--backend", "ascend", "--model", dir.to_str().unwrap(), "--tiling", tiling], &[]);
        assert!(!ok && err.contains(want), "--tiling {tiling}: {err}");
    }
    // The same tunables on the CPU backend are taken and reported.
    let (ok, out, err) = tboost(
        &["plan", "--backend", "cpu", "--model", dir.to_str().unwrap(), "--tiling", "matmul.panel_rows=32"],
        &[],
    );
    assert!(ok && out.contains("tiling: matmul.panel_rows=32"), "{out}{err}");
}

#[test]
fn backend_ascend_without_cann_fails_clearly_and_auto_never_picks_the_simulator() {
    let (ok, _, err) = tboost(
        &["plan", "--backend", "ascend", "--model", golden_dir("llama_gqa").to_str().unwrap()],
        &[("ASCEND_HOME_PATH", "/nonexistent-cann".into())],
    );
    assert!(!ok);
    assert!(
        err.contains("CANN runtime not found; searched:") && err.contains("/nonexistent-cann/lib64/libascendcl.so"),
        "{err}"
    );
    let (ok, out, err) = tboost(
        &["plan", "--json", "--model", golden_dir("llama_gqa").to_str().unwrap()],
        &[("RUST_LOG", "info".into())],
    );
    assert!(ok, "{err}");
    let p: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(p["device"]["backend"], "cpu", "auto must not run on the simulator");
    assert!(err.contains("CANN SIMULATOR") && err.contains("auto never picks"), "{err}");
}

#[test]
fn profile_reports_per_op_device_time() {
    let dir = golden_dir("mixtral");
    let (ok, _, err) = tboost(
        &["logits", "--backend", "ascend", "--model", dir.to_str().unwrap(), "--tokens", "5,17,42,99"],
        &[("TBOOST_PROFILE", "1".into())],
    );
    assert!(ok, "{err}");
    assert!(err.contains("tboost profile (ascend backend") && err.contains("aclrtEventElapsedTime"), "{err}");
    for op in ["matmul", "flash_attention", "moe_grouped", "moe_route", "rope", "write_kv", "add_rmsnorm"] {
        assert!(err.lines().any(|l| l.trim_start().starts_with(op) && l.contains("calls")), "no {op} row:\n{err}");
    }
}

// ------------------------------------------------------------------------------- faults

#[test]
fn an_allocation_failure_at_load_is_a_clear_error_and_leaks_nothing() {
    isolated(
        "an_allocation_failure_at_load_is_a_clear_error_and_leaks_nothing",
        // the 20th aclrtMalloc: in the middle of the weight uploads
        &[("TBOOST_SIM_FAIL_MALLOC_AT", "20".into())],
        || {
            let e =
                Engine::new(EngineConfig { backend: BackendKind::Ascend { device: 0 }, ..Default::default() }).unwrap();
            let err = e.load(&golden_dir("llama_gqa")).expect_err("the 20th device allocation fails").to_string();
            eprintln!("load error: {err}");
            assert!(err.contains("backend ascend") && err.contains("upload_weight"), "{err}");
            assert!(err.contains("aclrtMalloc") && err.contains("200000") && err.contains("SIMULATOR"), "{err}");
            drop(e);
            let s = stats();
            assert!(s.is_clean(), "outstanding simulator resources after the failed load: {s:?}");
            assert_eq!(s.rule_violations, 0);
        },
    );
}

#[test]
fn an_op_failure_fails_its_step_and_the_engine_serves_the_next_requests() {
    isolated(
        "an_op_failure_fails_its_step_and_the_engine_serves_the_next_requests",
        // the 3rd FIA call of the process: layer 0 of the second step
        &[("TBOOST_SIM_FAIL_OP", "aclnnFusedInferAttentionScoreV4:3:161002".into())],
        || {
            let path = golden_dir("llama_gqa");
            let e = ascend_engine(&path, 16, 64);
            let a = e.enqueue(greedy(vec![5, 17, 42, 99, 7], 4)).unwrap();
            e.run_to_completion().unwrap();
            let oa = e.output(a).unwrap();
            assert_eq!(oa.finish, Some(FinishReason::Error), "{oa:?}");
            let msg = oa.error.unwrap();
            eprintln!("failed request: {msg}");
            assert!(
                msg.contains("flash_attention") || msg.contains("paged_decode_attention"),
                "the message names the tboost op: {msg}"
            );
            assert!(msg.contains("aclnnFusedInferAttentionScoreV4") && msg.contains("161002"), "{msg}");
            assert!(msg.contains("fault injection") && msg.contains("SIMULATOR"), "aclGetRecentErrMsg: {msg}");
            // The engine goes on: the next request runs to the end, with the tokens a fresh engine gives.
            let b = greedy(vec![5, 17, 42, 99, 7], 6);
            let got = run_all(&e, std::slice::from_ref(&b));
            let want = run_all(&ascend_engine(&path, 16, 64), std::slice::from_ref(&b));
            assert_eq!(got, want);
            drop(e);
            let s = stats();
            assert!(s.is_clean(), "0 outstanding allocations and executors at engine free: {s:?}");
            assert_eq!(s.rule_violations, 0);
        },
    );
}

#[test]
fn execute_and_stream_failures_fail_their_step_only() {
    isolated(
        "execute_and_stream_failures_fail_their_step_only",
        &[
            // the 2nd launch of aclnnRmsNorm is refused by its execute phase; the 4th synchronize of
            // the process fails after running its work (a failure found when the stream runs)
            ("TBOOST_SIM_FAIL_OP", "aclnnRmsNorm:2:561002:exec".into()),
            ("TBOOST_SIM_FAIL_SYNC_AT", "4".into()),
        ],
        || {
            let e = ascend_engine(&golden_dir("qwen2"), 16, 64);
            let mut outs = Vec::new();
            for _ in 0..3 {
                let id = e.enqueue(greedy(vec![9, 8, 7], 3)).unwrap();
                e.run_to_completion().unwrap();
                outs.push(e.output(id).unwrap());
            }
            let msg = |i: usize| outs[i].error.clone().unwrap_or_default();
            eprintln!("execute-phase failure: {}\nstream failure: {}", msg(0), msg(1));
            assert_eq!(outs[0].finish, Some(FinishReason::Error), "{:?}", outs[0]);
            assert!(
                msg(0).contains("rmsnorm") && msg(0).contains("aclnnRmsNorm") && msg(0).contains("561002"),
                "{}",
                msg(0)
            );
            assert_eq!(outs[1].finish, Some(FinishReason::Error), "{:?}", outs[1]);
            assert!(msg(1).contains("aclrtSynchronizeStream") && msg(1).contains("500003"), "{}", msg(1));
            assert!(msg(1).contains("SIMULATOR"), "{}", msg(1));
            assert_eq!(outs[2].finish, Some(FinishReason::Length), "{:?}", outs[2]);
            assert_eq!(outs[2].tokens.len(), 3);
            drop(e);
            assert!(stats().is_clean(), "{:?}", stats());
        },
    );
}

// ------------------------------------------------------------------------------- the trait contract

#[test]
fn buffers_weights_copies_events_and_interrupt_on_the_simulator() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use tboost_engine::backend::{BackendExt, DType, Op, StepHost, StepViews, View};
    use tboost_engine::model::Tensor;
    isolated("buffers_weights_copies_events_and_interrupt_on_the_simulator", &[], || {
        let mut be = AscendBackend::open(0).unwrap();
        assert!(be.is_simulator());
        assert_eq!(be.activation_dtypes(), &[DType::F16, DType::BF16]);
        assert_eq!(be.preferred_block_size(), 128);
        // weights: consecutive ids
        let w: Vec<_> = (0..4)
            .map(|i| {
                let t = Tensor::owned(format!("w{i}"), DType::F32, vec![2], vec![0u8; 8]).unwrap();
                be.upload_weight(&t).unwrap()
            })
            .collect();
        assert!(w.windows(2).all(|p| p[1].0 == p[0].0 + 1), "{w:?}");
        // buffers start zeroed; allocated_bytes follows alloc/free
        let a = be.alloc(DType::F32, 10).unwrap();
        assert_eq!(be.allocated_bytes(), 40);
        let mut z = [1f32; 10];
        be.read_typed(View::new(a, 0, 10), &mut z).unwrap();
        assert_eq!(z, [0.0; 10]);
        be.write_typed_async(View::new(a, 2, 3), &[1.5f32, 2.5, 3.5]).unwrap();
        let ev = be.record_event().unwrap();
        be.wait_event(ev).unwrap();
        let r = be.read_async(View::new(a, 1, 4)).unwrap();
        let mut got = [0u8; 16];
        be.finish_read(r, &mut got).unwrap();
        let got: Vec<f32> = got.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, [0.0, 1.5, 2.5, 3.5]);
        be.launch(&Op::Zero { dst: View::new(a, 3, 1) }).unwrap();
        be.read_typed(View::new(a, 0, 10), &mut z).unwrap();
        assert_eq!(z[..5], [0.0, 0.0, 1.5, 0.0, 3.5]);
        // a step id aclnn's INT32 cannot hold is refused before anything is queued
        let big = be.alloc(DType::U32, 1).unwrap();
        let e = |b| View::new(b, 0, 0);
        let views = StepViews {
            ids: View::new(big, 0, 1),
            positions: e(big),
            slots: e(big),
            seqs: e(big),
            block_tables: e(big),
            max_blocks: 0,
            logit_rows: e(big),
        };
        let host =
            StepHost { ids: &[1 << 31], positions: &[], slots: &[], seqs: &[], block_tables: &[], logit_rows: &[] };
        let err = be.set_step(&host, &views).expect_err("id 2^31").to_string();
        assert!(err.contains("2^31"), "{err}");
        // interrupt: the next launch stops
        let flag = Arc::new(AtomicBool::new(true));
        be.set_interrupt(flag);
        assert!(matches!(be.launch(&Op::Zero { dst: View::new(a, 0, 1) }), Err(tboost_engine::Error::Interrupted)));
        be.free(a);
        be.free(big);
        assert_eq!(be.allocated_bytes(), 0);
        drop(be);
        let s = stats();
        assert!(s.is_clean(), "{s:?}");
        assert_eq!(s.rule_violations, 0);
    });
}

/// `tboost plan --backend ascend` on Q4_0 and Q8_0 GGUFs: the matmul slots name
/// aclnnWeightQuantBatchMatmulV2 and keep the weights as stored, and the report's device bytes of the
/// kept dtype stay within 1.15x of the file's bytes of the same tensors (less: the converted embedding
/// table is counted under f16) (issue 45).
#[test]
fn plan_keeps_q4_0_and_q8_0_weights_quantized_and_reports_device_weight_bytes() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in ["q4_0", "q8_0"] {
        let path = dir.path().join(format!("small-{dtype}.gguf"));
        let p = path.to_str().unwrap();
        let (ok, _, err) = tboost(&["synth", "--shape", "small", "--dtype", dtype, "--out", p], &[]);
        assert!(ok, "synth {dtype}: {err}");
        let (ok, out, err) = tboost(&["plan", "--json", "--backend", "ascend", "--model", p], &[]);
        assert!(ok, "plan {dtype}: {err}");
        let plan: Value = serde_json::from_str(&out).expect("plan JSON");
        let qkv = decision(&plan, 0, "qkv");
        assert_eq!(qkv["kernel"], "aclnnWeightQuantBatchMatmulV2", "{dtype}: {qkv}");
        assert_eq!(qkv["weights"]["mode"], "native", "{dtype}: {qkv}");
        let per = &plan["device_weight_bytes"][dtype];
        let (dev, file) = (per["device_bytes"].as_u64().unwrap(), per["file_bytes"].as_u64().unwrap());
        assert!(dev > 0 && dev as f64 <= 1.15 * file as f64, "{dtype}: {dev} device bytes for {file} in the file");
    }
}
