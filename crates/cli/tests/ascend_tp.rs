//! Tensor parallelism on the Ascend backend over HCCL (`comm` = hccl), on the CANN SIMULATOR and its
//! SIMULATED libhccl.so (ascend-sim: NOT CANN, NOT HCCL; ranks are threads of one process, each on its
//! own simulated device, the collectives run in host memory when every rank's stream reaches them).
//! Nothing here ran on Ascend hardware or measured HCCS.
//!
//! Every test runs in a process of its own (CANN state and the simulator's settings are per process),
//! with 4 simulated devices. The simulator comes from `TBOOST_ASCEND_SIM` (scripts/test.sh), else
//! scripts/build-ascend-sim.sh builds it; without it the tests fail saying so.

use tboost_testkit::backends::{simulator_home, Kind, TestBackend};
use tboost_testkit::golden::*;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tboost_engine::backend::ascend::AscendBackend;
use tboost_engine::backend::BackendKind;
use tboost_engine::comm::CommKind;
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::Model;
use tboost_engine::plan::PlanOptions;
use tboost_engine::runner::ModelRunner;
use tboost_engine::sched::Request;
use tboost_engine::session::{argmax, Session};

const CHILD: &str = "TBOOST_ASCEND_TP_TEST_CHILD";

fn tol(layers: usize, max_want: f32) -> f32 {
    TestBackend { name: "ascend", kind: Kind::AscendSim, block_size: 128 }.logit_tol(layers, max_want)
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

/// The child's command: this test binary with one test selected, the simulator only on the search
/// path, 4 simulated devices, and `env`.
fn child(name: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, "1");
    for v in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LD_LIBRARY_PATH", "TBOOST_BACKEND", "TBOOST_DISABLE"] {
        cmd.env_remove(v);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("TBOOST_SIM_") || k.starts_with("HCCL_") || k == "TBOOST_TP" || k == "TBOOST_COMM" {
            cmd.env_remove(k);
        }
    }
    cmd.env("ASCEND_HOME_PATH", simulator_home(&[])).env("TBOOST_SIM_DEVICE_COUNT", "4");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the test `name` in a child within `limit` (killed and failed past it); returns its stderr.
fn isolated(name: &str, env: &[(&str, &str)], limit: Duration, body: impl FnOnce()) -> String {
    if std::env::var_os(CHILD).is_some() {
        body();
        return String::new();
    }
    let t = Instant::now();
    let mut c = child(name, env).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let (so, se) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let (so, se) = (read(Box::new(so)), read(Box::new(se)));
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            panic!("{name}: still running after {limit:?} (a hang): stderr {}", se.join().unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (so, se) = (so.join().unwrap(), se.join().unwrap());
    assert!(
        status.success() && so.contains("test result: ok. 1 passed"),
        "child process for {name} failed ({status}):\n--- stdout\n{so}\n--- stderr\n{se}"
    );
    eprint!("{se}");
    se
}

fn opts() -> PlanOptions {
    PlanOptions { block_size: 128, ..PlanOptions::default() }
}

fn hccl_config(tp: usize) -> EngineConfig {
    EngineConfig {
        backend: BackendKind::Ascend { device: 0 },
        threads: 2,
        tp,
        comm: CommKind::Hccl,
        comm_timeout_ms: 20_000,
        ..Default::default()
    }
}

/// A tp-rank runner over HCCL on the simulator (Err: the plan refused the split).
fn hccl_runner(model: &Model, tp: usize) -> tboost_engine::Result<ModelRunner> {
    let cfg = hccl_config(tp);
    let be = cfg.open_backend()?;
    let mut r = cfg.runner(model, be, &opts())?;
    r.alloc_kv(8, 128)?;
    Ok(r)
}

/// The logits of a prefill of `prompt` and of feeding `next` one at a time after it.
fn logits_along(r: &mut ModelRunner, prompt: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut s = Session::new(r, prompt.len() + next.len() + 1).unwrap();
    let mut out = vec![s.feed(prompt, false).unwrap()];
    for &t in next {
        out.push(s.feed(&[t], false).unwrap());
    }
    out
}

fn layers(g: &Value) -> usize {
    g["params"]["num_hidden_layers"].as_u64().expect("num_hidden_layers") as usize
}

/// Every golden case at tp = 2 (and 4 where the heads allow) over simulated HCCL: the logits of a
/// prefill and four greedy steps against the reference (top 5, within the f16 tolerance) and against
/// tp = 1 on the simulator (every logit).
fn golden_case_over_hccl(case: &str, tp4_ran: &mut Vec<String>, tp4_refused: &mut Vec<String>) {
    let g = golden(case);
    let model = Model::load(&golden_dir(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
    let n_layers = layers(&g);
    let p = &g["prompts"][0];
    let prompt = ids(&p["token_ids"]);
    let gr = &p["greedy"];
    let want = ids(&gr["tokens_f64"]);
    let steps = gr["steps"].as_array().unwrap();
    let n = steps.len().min(5);
    // tp = 1 on the simulator picks the path (its own greedy ids)
    let be = AscendBackend::open(0).unwrap_or_else(|e| panic!("open the Ascend backend on the simulator: {e}"));
    let mut r1 = ModelRunner::new(&model, Box::new(be), &opts(), 2).unwrap();
    r1.alloc_kv(8, 128).unwrap();
    let mut path = Vec::new();
    {
        let mut s = Session::new(&mut r1, prompt.len() + n + 1).unwrap();
        let mut cur = s.feed(&prompt, false).unwrap();
        for i in 0..n - 1 {
            let t = argmax(&cur);
            path.push(t);
            if i + 1 < n - 1 {
                cur = s.feed(&[t], false).unwrap();
            }
        }
    }
    let one = logits_along(&mut r1, &prompt, &path);
    drop(r1);
    for tp in [2usize, 4] {
        let mut r = match hccl_runner(&model, tp) {
            Ok(r) => r,
            Err(e) if tp == 4 => {
                tp4_refused.push(format!("{case}: {e}"));
                continue;
            }
            Err(e) => panic!("{case} at tp = {tp} over hccl: {e}"),
        };
        let ar = r.plan.model.iter().find(|d| d.slot.name() == "all_reduce").expect("an all_reduce slot");
        // The default SoC (Atlas A2) has MC2 for 2 and 4 ranks: prefill fuses o_proj and down with
        // their all-reduce; decode and the embedding use HcclAllReduce.
        assert_eq!(ar.choice.name(), "matmul_all_reduce", "{case} tp {tp}: {}", ar.reason);
        assert!(ar.reason.contains("aclnnMatmulAllReduce"), "{}", ar.reason);
        assert!(ar.reason.contains("hccl all-reduce on device memory"), "{}", ar.reason);
        let got = logits_along(&mut r, &prompt, &path);
        let mut worst_ref = 0f32;
        let mut worst_one = 0f32;
        for (i, (l, l1)) in got.iter().zip(&one).enumerate() {
            let t1 = tol(n_layers, max_abs(l1));
            let d1 = max_abs_diff(l, l1);
            worst_one = worst_one.max(d1);
            assert!(d1 <= t1, "{case} tp {tp} step {i}: max |tp{tp} - tp1| = {d1} > {t1} [SIMULATOR]");
            // against the reference while the path is the reference's
            if path[..i] == want[..i] {
                let top5 = ids(&steps[i]["top5_ids"]);
                let want5 = floats(&steps[i]["top5_logits"]);
                let have: Vec<f32> = top5.iter().map(|&x| l[x as usize]).collect();
                let d = max_abs_diff(&have, &want5);
                let t = tol(n_layers, max_abs(&want5));
                worst_ref = worst_ref.max(d);
                assert!(d <= t, "{case} tp {tp} step {i}: top5 vs reference {d} > {t} [SIMULATOR]");
            }
        }
        eprintln!(
            "{case} tp={tp} over simulated hccl: max |Δ| vs tp=1 {worst_one:.2e}, top5 vs reference {worst_ref:.2e} \
             [ascend, SIMULATOR]"
        );
        if tp == 4 {
            tp4_ran.push(case.to_string());
        }
    }
}

/// [`golden_case_over_hccl`] for each of `cases` in a child process: at least one runs at tp = 4,
/// any refusal at tp = 4 is for its heads, and the simulator saw no rule broken.
fn cases_over_hccl(name: &str, cases: &[&str]) {
    isolated(name, &[], Duration::from_secs(1800), || {
        let (mut ran, mut refused) = (Vec::new(), Vec::new());
        for case in cases {
            golden_case_over_hccl(case, &mut ran, &mut refused);
        }
        eprintln!("tp = 4 ran on {ran:?}; refused by the plan: {refused:?}");
        assert!(!ran.is_empty(), "no golden case ran at tp = 4: {refused:?}");
        for r in &refused {
            assert!(r.contains("head") || r.contains("kv"), "tp = 4 refused for a reason other than heads: {r}");
        }
        let s = tboost_engine::backend::ascend::sys::Cann::load().unwrap().sim_stats().unwrap();
        assert_eq!(s.rule_violations, 0, "simulator rule violations (HCCL or aclnn): {s:?}");
    });
}

#[test]
fn golden_cases_at_tp_2_and_4_over_simulated_hccl_match_the_reference_and_tp_1() {
    cases_over_hccl("golden_cases_at_tp_2_and_4_over_simulated_hccl_match_the_reference_and_tp_1", CASES);
}

/// The architectures added later (Qwen3's q/k norms, Qwen3-MoE's experts, Gemma 3's sliding
/// window and extra norms, Phi-3's fused weights) the same way: each rank's shard of the new
/// slots runs on its simulated device.
#[test]
fn new_architectures_at_tp_2_and_4_over_simulated_hccl_match_the_reference_and_tp_1() {
    cases_over_hccl("new_architectures_at_tp_2_and_4_over_simulated_hccl_match_the_reference_and_tp_1", NEW_ARCH_CASES);
}

/// MC2 runs where the plan says: with a fault injected into aclnnMatmulAllReduce's execute on
/// device 0, a prefill fails naming the op (so the fused op ran, not Mm + HcclAllReduce).
#[test]
fn mc2_runs_in_prefill_steps_and_a_fault_in_it_names_the_op() {
    let name = "mc2_runs_in_prefill_steps_and_a_fault_in_it_names_the_op";
    let env = [("TBOOST_SIM_FAIL_OP", "aclnnMatmulAllReduce:1:561002:exec@0"), ("HCCL_EXEC_TIMEOUT", "2")];
    isolated(name, &env, Duration::from_secs(120), || {
        let model = Model::load(&golden_dir("llama_gqa")).unwrap();
        let mut r = hccl_runner(&model, 2).unwrap();
        let ar = r.plan.model.iter().find(|d| d.slot.name() == "all_reduce").unwrap();
        assert_eq!(ar.choice.name(), "matmul_all_reduce", "{}", ar.reason);
        let mut s = Session::new(&mut r, 16).unwrap();
        let err = s.feed(&[1, 2, 3, 4], false).unwrap_err().to_string();
        assert!(err.contains("aclnnMatmulAllReduce") && err.contains("561002"), "{err}");
        eprintln!("prefill with MC2's execute failing on device 0: {err}");
    });
}

/// On Atlas A3, which MC2's product table leaves out, the plan keeps HcclAllReduce and says why;
/// the logits still match tp = 1.
#[test]
fn on_atlas_a3_mc2_is_refused_with_the_reason() {
    let name = "on_atlas_a3_mc2_is_refused_with_the_reason";
    isolated(name, &[("TBOOST_SIM_SOC", "Ascend910_9391")], Duration::from_secs(120), || {
        let model = Model::load(&golden_dir("llama_gqa")).unwrap();
        let r = hccl_runner(&model, 2).unwrap();
        let ar = r.plan.model.iter().find(|d| d.slot.name() == "all_reduce").unwrap();
        assert_eq!(ar.choice.name(), "device_all_reduce", "{}", ar.reason);
        assert!(ar.reason.contains("Atlas A2 or Ascend950"), "{}", ar.reason);
        eprintln!("A3: {}", ar.reason);
    });
}

/// A tp = 2 HCCL engine on llama_gqa running two requests to their (failing) end: the engine,
/// the prompt, the request ids and how long they took.
fn two_requests_on_a_failing_group() -> (Engine, Vec<u32>, Vec<u64>, Duration) {
    let e = Engine::new(EngineConfig {
        kv_size: KvSize::Blocks(16),
        max_seqs: 4,
        comm_timeout_ms: 10_000,
        ..hccl_config(2)
    })
    .unwrap();
    e.load(&golden_dir("llama_gqa")).unwrap();
    let prompt: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7];
    let reqs: Vec<u64> =
        (0..2).map(|_| e.enqueue(Request { ignore_eos: true, ..Request::new(prompt.clone(), 4) }).unwrap()).collect();
    let t = Instant::now();
    let _ = e.run_to_completion();
    (e, prompt, reqs, t.elapsed())
}

#[test]
fn an_hccl_timeout_on_one_rank_fails_every_request_naming_the_rank_and_the_engine_says_recreate() {
    let name = "an_hccl_timeout_on_one_rank_fails_every_request_naming_the_rank_and_the_engine_says_recreate";
    // rank 1 never arrives at its 5th collective (inside the first prefill's layers)
    let env = [("HCCL_EXEC_TIMEOUT", "2"), ("TBOOST_SIM_HCCL_FAULT", "timeout@5:1")];
    isolated(name, &env, Duration::from_secs(120), || {
        let (e, prompt, reqs, took) = two_requests_on_a_failing_group();
        for id in reqs {
            let o = e.output(id).unwrap();
            let err = o.error.unwrap_or_else(|| panic!("request {id} finished without an error: {:?}", o.finish));
            assert!(err.contains("HcclAllReduce"), "the collective is named: {err}");
            assert!(err.contains("rank 1 did not arrive"), "the missing rank is named: {err}");
            assert!(err.contains("HCCL_EXEC_TIMEOUT=2s"), "{err}");
            eprintln!("request {id}: {err}");
        }
        assert!(took < Duration::from_secs(8), "the requests ended {took:?} after the start (HCCL_EXEC_TIMEOUT 2 s)");
        // the group is broken now: a new request fails at once, saying the engine must be re-created
        let id = e.enqueue(Request::new(prompt, 2)).unwrap();
        let t = Instant::now();
        let _ = e.run_to_completion();
        let o = e.output(id).unwrap();
        let err = o.error.unwrap_or_else(|| panic!("a request on a broken group finished: {:?}", o.finish));
        assert!(err.contains("re-create the engine") || err.contains("left the group"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
        eprintln!("after the timeout: {err} ({:?}); the first requests ended after {took:?}", t.elapsed());
    });
}

#[test]
fn comm_hccl_on_the_cpu_backend_is_refused_naming_what_it_needs() {
    let e = Engine::new(EngineConfig { backend: BackendKind::Cpu, tp: 2, comm: CommKind::Hccl, ..Default::default() })
        .unwrap();
    let err = e.load(&golden_dir("llama_gqa")).unwrap_err().to_string();
    assert!(err.contains("comm = hccl needs backend = ascend"), "{err}");
}

/// A device error on one rank only (rank 1's third RmsNorm fails on device 1; device 0 never
/// errs): rank 0 waits at its next device all-reduce until HCCL_EXEC_TIMEOUT, and the
/// in-flight requests fail within it, naming the collective, the missing rank and its cause
/// (rank 1 left the host group with it when its launch failed: op, device, status); the next
/// request fails at once with the same cause, and the engine asks to be re-created.
#[test]
fn a_device_error_on_one_rank_fails_the_requests_and_then_names_the_cause() {
    let name = "a_device_error_on_one_rank_fails_the_requests_and_then_names_the_cause";
    let env = [("HCCL_EXEC_TIMEOUT", "2"), ("TBOOST_SIM_FAIL_OP", "aclnnRmsNorm:3:561002:exec@1")];
    isolated(name, &env, Duration::from_secs(120), || {
        let (e, prompt, reqs, took) = two_requests_on_a_failing_group();
        for id in reqs {
            let o = e.output(id).unwrap();
            let err = o.error.unwrap_or_else(|| panic!("request {id} finished without an error: {:?}", o.finish));
            assert!(err.contains("HcclAllReduce") && err.contains("rank 1 did not arrive"), "{err}");
            // and the cause: rank 1's failed op, its device and status
            assert!(err.contains("rank 1 had failed") && err.contains("aclnnRmsNorm"), "{err}");
            assert!(err.contains("on device 1") && err.contains("561002"), "{err}");
            eprintln!("request {id}: {err}");
        }
        assert!(took < Duration::from_secs(8), "the requests ended {took:?} after the start (HCCL_EXEC_TIMEOUT 2 s)");
        let id = e.enqueue(Request::new(prompt, 2)).unwrap();
        let t = Instant::now();
        let _ = e.run_to_completion();
        let err = e.output(id).unwrap().error.expect("a request on a broken group fails");
        assert!(err.contains("rank 1 left the group"), "{err}");
        assert!(err.contains("aclnnRmsNorm") && err.contains("on device 1") && err.contains("561002"), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        eprintln!("next request: {err}");
    });
}
