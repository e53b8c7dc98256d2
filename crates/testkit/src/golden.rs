//! Where the shared test data lives, loading a model into a runner, and the golden files'
//! comparison rules.

use std::path::PathBuf;

use serde_json::Value;
use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::model::Model;
use tboost_engine::plan::PlanOptions;
use tboost_engine::runner::ModelRunner;

/// The repository's root (the workspace).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `../shared` next to the checkout (CI has it too); `TBOOST_SHARED` overrides.
pub fn shared_dir() -> PathBuf {
    let dir = std::env::var_os("TBOOST_SHARED").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared"));
    assert!(
        dir.join("testdata/golden").is_dir(),
        "shared test data not found at {}: check out the `shared` directory next to the repository or set TBOOST_SHARED",
        dir.display()
    );
    dir
}

pub fn golden_dir(case: &str) -> PathBuf {
    shared_dir().join("testdata/golden").join(case)
}

pub fn model_file(name: &str) -> PathBuf {
    let p = shared_dir().join("models").join(name);
    assert!(p.is_file(), "{} is missing: it ships in ../shared/models", p.display());
    p
}

pub const CASES: &[&str] = &["llama_gqa", "llama_gqa_bf16", "llama_hd24", "mistral", "mixtral", "qwen2"];
/// The cases of the architectures added after the first six (q/k norm, Qwen3-MoE, Gemma 3's
/// sliding window and norms, Phi-3's fused weights and LongRoPE).
pub const NEW_ARCH_CASES: &[&str] = &["qwen3", "qwen3_moe", "gemma3", "phi3"];

pub fn golden(case: &str) -> Value {
    let p = golden_dir(case).join("golden.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub fn runner_with(path: &std::path::Path, opts: &PlanOptions, threads: usize, kv_blocks: usize) -> ModelRunner {
    let model = Model::load(path).unwrap_or_else(|e| panic!("load {}: {e}", path.display()));
    let mut r = ModelRunner::new(&model, Box::new(CpuBackend::new(threads).unwrap()), opts, threads)
        .unwrap_or_else(|e| panic!("plan {}: {e}", path.display()));
    r.alloc_kv(kv_blocks, opts.block_size).unwrap();
    r
}

pub fn runner(path: &std::path::Path) -> ModelRunner {
    runner_with(path, &PlanOptions::default(), 2, 64)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("float list").iter().map(|x| x.as_f64().expect("float") as f32).collect()
}

/// log-softmax of `row` at `id`, in f64 (the tests' reference for logprobs).
pub fn log_softmax_at(row: &[f32], id: u32) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    row[id as usize] as f64 - lse
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The golden README's margin rule for greedy tokens: walk the steps; a mismatch is
/// accepted (and comparison stops) only when the reference margin at that step is at most
/// `tau` and the engine picked the reference's second choice.
pub fn check_greedy(what: &str, got: &[u32], want: &[u32], margins: &[f64], second: &[u32], tau: f64) {
    for (s, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        assert!(
            margins[s] <= tau && g == second[s],
            "{what}: step {s}: got {g}, want {w} (margin {}, second choice {}); got {got:?}, want {want:?}",
            margins[s],
            second[s]
        );
        return;
    }
    assert!(got.len() >= want.len(), "{what}: only {} of {} tokens", got.len(), want.len());
}

/// The demo model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M): `$TBOOST_DEMO_MODEL`, else
/// `${TBOOST_CACHE:-$HOME/.cache/tboost}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`. Fails (never
/// skips) with the command that fetches it when it is missing.
pub fn demo_model() -> PathBuf {
    let p = match std::env::var_os("TBOOST_DEMO_MODEL") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("TBOOST_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tboost"))
            .join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    };
    assert!(
        p.is_file(),
        "demo model {} is missing: run scripts/fetch-demo-model.sh (or set TBOOST_DEMO_MODEL)",
        p.display()
    );
    p
}

/// A small seeded xorshift64* generator (`rand` is not a dev-dependency of this crate).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }

    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u32 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * amp).collect()
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}
