//! The backends a test runs on: the CPU always, and with the `ascend` feature the Ascend backend
//! on the CANN SIMULATOR (ascend-sim: NOT CANN, not an NPU). A test loops over [`present`] and
//! runs its body on each, naming the backend in every assertion.
//!
//! The simulator comes from `TBOOST_ASCEND_SIM` (scripts/test.sh sets it), else from
//! scripts/build-ascend-sim.sh; when neither gives one the test fails saying how to get it (it
//! never skips). It is loaded from that directory only (no other CANN on the search path).
//!
//! The simulator keeps one current device per process (`aclrtResetDevice` of one backend unsets
//! it for all), so tests of one process take turns on it: hold [`TestBackend::exclusive`] while
//! anything opened on that backend is alive.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::{Backend, BackendKind};
use tboost_engine::engine::{Engine, EngineConfig};
use tboost_engine::model::Model;

/// f16 unit roundoff (the simulator's activations).
const U16: f64 = 1.0 / 2048.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Cpu,
    /// The Ascend backend on the CANN SIMULATOR.
    AscendSim,
}

/// One backend present in this build.
#[derive(Clone, Debug)]
pub struct TestBackend {
    pub name: &'static str,
    pub kind: Kind,
    /// Tokens per KV block the backend's attention prefers (what an engine on it uses).
    pub block_size: usize,
}

impl fmt::Display for TestBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Serializes every use of the simulator in this process (see the module doc).
static SIMULATOR: Mutex<()> = Mutex::new(());

/// The CPU backend alone (scenarios about its own kernels).
pub fn cpu() -> TestBackend {
    TestBackend { name: "cpu", kind: Kind::Cpu, block_size: 16 }
}

/// Every backend compiled into this build (a new backend adds one entry here). Each is opened
/// once per process to check it starts and prefers the block size listed.
pub fn present() -> Vec<TestBackend> {
    static PRESENT: OnceLock<Vec<TestBackend>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            #[allow(unused_mut)]
            let mut v = vec![cpu()];
            #[cfg(feature = "ascend")]
            v.push(TestBackend { name: "ascend", kind: Kind::AscendSim, block_size: 128 });
            for b in &v {
                let _turn = b.exclusive();
                let got = b.open(1).preferred_block_size();
                assert_eq!(got, b.block_size, "{b}: the backend prefers blocks of {got} tokens");
            }
            v
        })
        .clone()
}

impl TestBackend {
    /// The turn to use this backend: the simulator's lock, held by the caller while anything
    /// opened on it lives (`None` for the CPU, which tests share freely). A test that panicked
    /// holding it leaves nothing behind that the next one trips on, so poisoning is ignored.
    pub fn exclusive(&self) -> Option<MutexGuard<'static, ()>> {
        match self.kind {
            Kind::Cpu => None,
            Kind::AscendSim => Some(SIMULATOR.lock().unwrap_or_else(|p| p.into_inner())),
        }
    }

    /// The backend, opened (panics saying how to get it when it cannot be).
    pub fn open(&self, threads: usize) -> Box<dyn Backend> {
        match self.kind {
            Kind::Cpu => Box::new(
                CpuBackend::new(threads).unwrap_or_else(|e| panic!("the CPU backend ({threads} threads) starts: {e}")),
            ),
            Kind::AscendSim => open_simulator(),
        }
    }

    pub fn backend_kind(&self) -> BackendKind {
        match self.kind {
            Kind::Cpu => BackendKind::Cpu,
            Kind::AscendSim => BackendKind::Ascend { device: 0 },
        }
    }

    /// An engine on this backend with `cfg` (its `backend` set to this one), `model` loaded.
    pub fn engine_with(&self, cfg: EngineConfig, model: &Model) -> Engine {
        let threads = cfg.threads;
        let e = Engine::new(EngineConfig { backend: self.backend_kind(), ..cfg })
            .unwrap_or_else(|err| panic!("[{self}] engine config: {err}"));
        e.load_model_on(model, self.open(threads))
            .unwrap_or_else(|err| panic!("[{self}] loading {}: {err}", model.path.display()));
        e
    }

    /// An engine on this backend with `cfg`, the model file or directory `path` loaded.
    pub fn engine(&self, cfg: EngineConfig, path: &Path) -> Engine {
        let model = Model::load(path).unwrap_or_else(|err| panic!("[{self}] load {}: {err}", path.display()));
        self.engine_with(cfg, &model)
    }

    /// How far a logit may be from the f64 reference on this backend, for a model of `layers`
    /// decoder layers whose reference logits reach `max_want` in magnitude.
    ///
    /// CPU (f32 activations): 1e-3, the golden suites' bound. Simulator (f16 activations, u =
    /// 2⁻¹¹): every op rounds its output to f16, so a logit carries about R = 12 roundings per
    /// layer (norm, q/k/v, RoPE tables and RoPE, attention, o_proj, residual add, norm, gate/up,
    /// SwiGLU, down, residual add) plus 4 (final norm, lm_head, f32 cast, embedding); RMSNorm
    /// passes relative errors through, so the error is about √R·u·max|logit| when the roundings
    /// are independent. Twice that: `2·√(12·layers + 4)·u·max|want|` (llama_gqa: 0.062 for
    /// max|want| = 11.9).
    pub fn logit_tol(&self, layers: usize, max_want: f32) -> f32 {
        match self.kind {
            Kind::Cpu => 1e-3,
            Kind::AscendSim => (2.0 * ((12 * layers + 4) as f64).sqrt() * U16 * max_want as f64) as f32,
        }
    }

    /// τ of the golden README's margin rule for greedy ids: two logits may each move by
    /// [`Self::logit_tol`].
    pub fn greedy_tau(&self, layers: usize, max_want: f32) -> f64 {
        2.0 * self.logit_tol(layers, max_want) as f64
    }

    /// Checks after a scenario, once everything opened on the backend is dropped (call it while
    /// still holding [`Self::exclusive`]): on the simulator, no CANN rule (two-phase calls,
    /// object lifetimes) was broken and nothing (memory, handles, streams, queued work) is left.
    pub fn check_released(&self, what: &str) {
        match self.kind {
            Kind::Cpu => {}
            Kind::AscendSim => simulator_released(self, what),
        }
    }
}

/// The simulator's directory (its `ASCEND_HOME_PATH`): `TBOOST_ASCEND_SIM`, else what
/// scripts/build-ascend-sim.sh with `args` prints (the script rebuilds only what changed).
pub fn simulator_home(args: &[&str]) -> PathBuf {
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
    let script = crate::golden::repo_root().join("scripts/build-ascend-sim.sh");
    let out = std::process::Command::new("bash").arg(&script).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run {} ({e}): the Ascend tests need the CANN simulator (it needs bash and gcc)",
            script.display()
        )
    });
    assert!(
        out.status.success(),
        "building the CANN simulator failed (scripts/build-ascend-sim.sh needs gcc); set TBOOST_ASCEND_SIM to \
         the directory scripts/build-ascend-sim.sh prints:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[cfg(feature = "ascend")]
fn simulator_cann() -> tboost_engine::backend::ascend::sys::Cann {
    use tboost_engine::backend::ascend::sys::{Cann, SearchOrder};
    let dir = simulator_home(&[]);
    let cann = Cann::load_from(&SearchOrder::dirs_only([dir.join("lib64")])).unwrap_or_else(|e| {
        panic!(
            "the CANN simulator at {} does not load ({e}): rebuild it with scripts/build-ascend-sim.sh",
            dir.display()
        )
    });
    assert!(cann.is_simulator(), "{} is not the CANN simulator", dir.display());
    cann
}

#[cfg(feature = "ascend")]
fn open_simulator() -> Box<dyn Backend> {
    let cann = simulator_cann();
    Box::new(
        tboost_engine::backend::ascend::AscendBackend::open_on(&cann, 0)
            .unwrap_or_else(|e| panic!("the Ascend backend opens on the simulator: {e}")),
    )
}

#[cfg(not(feature = "ascend"))]
fn open_simulator() -> Box<dyn Backend> {
    panic!("the ascend backend is not compiled into this build (cargo feature `ascend` of tboost-testkit)")
}

#[cfg(feature = "ascend")]
fn simulator_released(b: &TestBackend, what: &str) {
    let s = simulator_cann().sim_stats().expect("the simulator's counters");
    assert_eq!(s.rule_violations, 0, "[{b}] {what}: CANN two-phase / lifetime rule violations: {s:?}");
    assert!(s.is_clean(), "[{b}] {what}: simulator resources outstanding after every engine was freed: {s:?}");
}

#[cfg(not(feature = "ascend"))]
fn simulator_released(_: &TestBackend, _: &str) {}
