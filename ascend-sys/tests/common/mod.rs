//! Test support: builds and finds the CANN SIMULATOR, runs each test in its own process (the simulator's
//! state, like CANN's, is per process: one aclInit, process-wide counters and fault-injection settings),
//! and reference math.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use ascend_sys::{Cann, Device, DeviceBuffer, Element, SimStats};
use half::{bf16, f16};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The simulator directory (to use as ASCEND_HOME_PATH) for `args` of scripts/build-ascend-sim.sh.
/// The default variant may be given by TBOOST_ASCEND_SIM (scripts/test.sh builds it first).
pub fn sim_home(args: &[&str]) -> PathBuf {
    if args.is_empty() {
        if let Some(dir) = std::env::var_os("TBOOST_ASCEND_SIM") {
            let dir = PathBuf::from(dir);
            assert!(
                dir.join("lib64/libascendcl.so").is_file(),
                "TBOOST_ASCEND_SIM={} holds no lib64/libascendcl.so: build the CANN simulator with \
                 scripts/build-ascend-sim.sh and point TBOOST_ASCEND_SIM at the directory it prints",
                dir.display()
            );
            return dir;
        }
    }
    let script = repo_root().join("scripts/build-ascend-sim.sh");
    let out = Command::new("bash").arg(&script).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {} ({e}): build the CANN simulator with scripts/build-ascend-sim.sh", script.display())
    });
    assert!(
        out.status.success(),
        "scripts/build-ascend-sim.sh {} failed; the CANN simulator is needed by these tests (it needs gcc):\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        dir.join("lib64/libascendcl.so").is_file(),
        "build-ascend-sim.sh printed {}, which has no simulator",
        dir.display()
    );
    dir
}

const CHILD: &str = "ASCEND_SYS_TEST_CHILD";

/// True in the child process that runs a test body.
pub fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs `body` in a fresh process of this test binary with `env` set (ASCEND_HOME_PATH defaults to the
/// default simulator). The parent asserts the child ran exactly this test and it passed.
pub fn isolated(name: &str, env: &[(&str, String)], body: impl FnOnce()) {
    isolated_case(name, "main", env, body)
}

/// Like [`isolated`], for a test with several cases: the child runs only the case named `case`.
pub fn isolated_case(name: &str, case: &str, env: &[(&str, String)], body: impl FnOnce()) {
    let _ = isolated_output(name, case, env, body);
}

/// Like [`isolated_case`]; returns the child's stderr (empty in the child itself).
pub fn isolated_output(name: &str, case: &str, env: &[(&str, String)], body: impl FnOnce()) -> String {
    if let Some(c) = std::env::var_os(CHILD) {
        if c == case {
            body();
        }
        return String::new();
    }
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, case);
    for v in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LD_LIBRARY_PATH"] {
        cmd.env_remove(v);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("TBOOST_SIM_") {
            cmd.env_remove(k);
        }
    }
    if !env.iter().any(|(k, _)| *k == "ASCEND_HOME_PATH") {
        cmd.env("ASCEND_HOME_PATH", sim_home(&[]));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the test child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "child process for {name} ({case}) failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    stderr.into_owned()
}

/// Loads CANN through the real search order (ASCEND_HOME_PATH etc., as the child's environment says).
pub fn load() -> Cann {
    Cann::load().unwrap_or_else(|e| panic!("loading the CANN simulator failed: {e}"))
}

pub fn device() -> (Cann, Device) {
    let cann = load();
    assert!(cann.is_simulator(), "these tests need the CANN SIMULATOR, not real CANN");
    let dev = cann.device(0).unwrap_or_else(|e| panic!("aclrtSetDevice(0): {e}"));
    (cann, dev)
}

pub fn stats(cann: &Cann) -> SimStats {
    cann.sim_stats().expect("the simulator exports tboostSimGetStats")
}

/// After every handle is dropped: nothing outstanding, no rule broken.
pub fn assert_clean(cann: &Cann) {
    let s = stats(cann);
    assert!(s.is_clean(), "outstanding simulator resources at the end of the test: {s:?}");
    assert_eq!(s.rule_violations, 0, "two-phase / lifetime rule violations: {s:?}");
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn to_f16(v: &[f32]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f32(x)).collect()
}
pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}
pub fn f16_to_f64(v: &[f16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}
pub fn bf16_to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}
pub fn f32_to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

pub fn upload<T: Element>(dev: &Device, v: &[T]) -> DeviceBuffer {
    dev.upload(v).unwrap_or_else(|e| panic!("upload: {e}"))
}

pub fn alloc(dev: &Device, bytes: usize) -> DeviceBuffer {
    dev.alloc(bytes).unwrap_or_else(|e| panic!("alloc: {e}"))
}

pub fn read<T: Element>(buf: &DeviceBuffer, n: usize) -> Vec<T> {
    buf.to_vec(0, n).unwrap_or_else(|e| panic!("read back: {e}"))
}

/// |got - want| <= abs + rel * |want| elementwise, with the first offender in the message.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], abs: f64, rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= abs + rel * w.abs() && g.is_finite() == w.is_finite(),
            "{what}[{i}]: got {g}, want {w} (tolerance {abs} + {rel}*|want|)"
        );
    }
}

/// Half-precision rounding of a reference value (what an fp16 output can hold).
pub fn round_f16(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| f16::from_f64(x).to_f64()).collect()
}
pub fn round_bf16(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| bf16::from_f64(x).to_f64()).collect()
}

/// Reference attention of one query row over visible keys (f64).
pub fn attend(q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], scale: f64) -> Vec<f64> {
    let d = values.first().map_or(0, Vec::len);
    if keys.is_empty() {
        return vec![0.0; d];
    }
    let s: Vec<f64> = keys.iter().map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..d).map(|j| e.iter().zip(values).map(|(w, v)| w / z * v[j]).sum()).collect()
}
