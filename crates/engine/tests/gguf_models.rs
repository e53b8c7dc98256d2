//! The GGUF models in ../shared/models reproduce the greedy ids llama.cpp produced
//! (../shared/research/golden-llamacpp.md), fed the listed prompt ids.

use tboost_testkit::golden as common;

use common::*;
use tboost_engine::session::Session;

fn greedy(file: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut r = runner(&model_file(file));
    let mut s = Session::new(&mut r, prompt.len() + n).unwrap();
    s.greedy(prompt, n).unwrap()
}

/// llama.cpp's 32 greedy ids for `llama-2-tiny-random.gguf` after [`LLAMA2_TINY_PROMPT`].
const LLAMA2_TINY_IDS: [u32; 32] = [
    17196, 5211, 21440, 25431, 7455, 3285, 29710, 4660, 29509, 31364, 19741, 8021, 29710, 4660, 29509, 31364, 28253,
    12321, 12681, 14340, 1189, 30070, 29182, 9645, 20945, 16138, 2451, 19209, 19982, 8317, 15492, 19741,
];
const LLAMA2_TINY_PROMPT: [u32; 5] = [1, 9038, 2501, 263, 931];

#[test]
fn llama2_tiny_random_f16_matches_llama_cpp() {
    assert_eq!(greedy("llama-2-tiny-random.gguf", &LLAMA2_TINY_PROMPT, 32), LLAMA2_TINY_IDS);
}

/// At `precision: fast` the f16 weights take the AMX split kernel where the CPU has
/// AMX-BF16 (`gemm::dense::amx_pair_panels`), or are rounded to bf16 for the `vdpbf16ps` kernel
/// where it has AVX512_BF16 and no AMX (exact kernels elsewhere): the greedy ids stay llama.cpp's,
/// and the logits stay within 1e-3 of the exact path's (the split keeps 16 bits of each
/// activation) or within the bf16 bound (8 bits of weights and activations), yet differ from
/// them where a fast kernel runs.
#[test]
fn llama2_tiny_random_f16_at_fast_precision_matches_llama_cpp() {
    use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
    let path = model_file("llama-2-tiny-random.gguf");
    let prompt = LLAMA2_TINY_PROMPT;
    let fast = PlanOptions { precision: PrecisionPolicy::Fast, ..Default::default() };
    let mut r = runner_with(&path, &fast, 2, 64);
    let mut s = Session::new(&mut r, prompt.len() + 32).unwrap();
    let ids = s.greedy(&prompt, 32).unwrap();
    assert_eq!(ids, LLAMA2_TINY_IDS, "fast greedy ids differ from llama.cpp's");
    let logits = |o: &PlanOptions| {
        let mut r = runner_with(&path, o, 2, 64);
        let mut s = Session::new(&mut r, prompt.len()).unwrap();
        s.feed(&prompt, true).unwrap()
    };
    let (e, f) = (logits(&PlanOptions::default()), logits(&fast));
    let d = e.iter().zip(&f).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("llama-2-tiny-random f16: fast vs exact max |diff| {d:.3e}");
    let scale = e.iter().fold(1f32, |m, v| m.max(v.abs()));
    if tboost_kernels::gemm::dense::amx_pair_panels::applies() {
        assert!(d <= 1e-3, "fast moved the logits by {d}");
        assert!(d > 0.0, "fast must run the f16 split kernel here");
    } else if tboost_kernels::gemm::dense::bf16_pair_panels::applies() {
        assert!(d <= 2f32.powi(-6) * scale, "rounding to bf16 moved the logits by {d} (scale {scale})");
        assert!(d > 0.0, "fast must run the bf16 kernel on the rounded weights here");
    } else {
        assert_eq!(d, 0.0, "without AMX-BF16 or AVX512_BF16, fast f16 is exact");
    }
}

#[test]
fn stories260k_f32_matches_llama_cpp() {
    let want = [
        461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435, 299, 362, 409, 283, 264, 283, 452, 288, 13, 431, 431,
        431, 431, 431, 431, 431, 431, 431, 431, 431, 431,
    ];
    assert_eq!(greedy("stories260K-placeholder-vocab.gguf", &[1], 32), want);
}
