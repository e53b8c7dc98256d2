//! The GGUF models in ../shared/models reproduce the greedy ids llama.cpp produced
//! (../shared/research/golden-llamacpp.md), fed the listed prompt ids.

mod common;

use common::*;
use tboost::session::Session;

fn greedy(file: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut r = runner(&model_file(file));
    let mut s = Session::new(&mut r, prompt.len() + n).unwrap();
    s.greedy(prompt, n).unwrap()
}

#[test]
fn llama2_tiny_random_f16_matches_llama_cpp() {
    let want = [
        17196, 5211, 21440, 25431, 7455, 3285, 29710, 4660, 29509, 31364, 19741, 8021, 29710, 4660, 29509, 31364,
        28253, 12321, 12681, 14340, 1189, 30070, 29182, 9645, 20945, 16138, 2451, 19209, 19982, 8317, 15492, 19741,
    ];
    assert_eq!(greedy("llama-2-tiny-random.gguf", &[1, 9038, 2501, 263, 931], 32), want);
}

#[test]
fn stories260k_f32_matches_llama_cpp() {
    let want = [
        461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435, 299, 362, 409, 283, 264, 283, 452, 288, 13, 431, 431,
        431, 431, 431, 431, 431, 431, 431, 431, 431, 431,
    ];
    assert_eq!(greedy("stories260K-placeholder-vocab.gguf", &[1], 32), want);
}
