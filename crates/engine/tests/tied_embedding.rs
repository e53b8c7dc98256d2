//! A tied embedding table (one tensor, also the lm_head) whose lm_head the CPU backend packs
//! into panels at `fast` precision is resident once: the embedding lookup reads its rows from
//! the panels (`gemm::quant::panel_rows`). The logits are bit-identical to the same model with
//! an untied copy of the table, which keeps a stored copy for the lookup.

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::model::{Model, Tensor};
use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
use tboost_engine::runner::ModelRunner;
use tboost_engine::session::Session;
use tboost_ops::DType;
use tboost_testkit::synthetic;

/// The logits of a prompt and 6 greedy steps, and the backend's resident weight bytes.
fn run(model: &Model) -> (Vec<Vec<f32>>, usize) {
    let opts = PlanOptions { precision: PrecisionPolicy::Fast, ..Default::default() };
    let mut r = ModelRunner::new(model, Box::new(CpuBackend::new(2).unwrap()), &opts, 2).unwrap();
    let resident = r.device_weight_bytes().iter().map(|(_, n)| n).sum();
    r.alloc_kv(8, 16).unwrap();
    let mut s = Session::new(&mut r, 32).unwrap();
    let prompt: Vec<u32> = (0..9).map(|i| 3 + (i * 397) % 2000).collect();
    let mut logits = vec![s.feed(&prompt, false).unwrap()];
    for _ in 0..6 {
        let last = logits.last().unwrap();
        let id = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as u32;
        logits.push(s.feed(&[id], false).unwrap());
    }
    (logits, resident)
}

#[test]
fn a_tied_quantized_table_is_resident_once_with_the_untied_logits() {
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q6K] {
        let shape = if dtype == DType::Q6K { "small-k" } else { "small" };
        let mut tied = synthetic::build(shape, dtype, 7).unwrap();
        tied.config.tie_word_embeddings = true;
        tied.weights.lm_head = tied.weights.embed.clone();
        let mut untied = synthetic::build(shape, dtype, 7).unwrap();
        let e = &untied.weights.embed;
        untied.weights.lm_head =
            Tensor::owned("lm_head.weight".to_string(), e.dtype, e.shape.clone(), e.bytes().to_vec()).unwrap();
        let table = e.bytes().len();
        assert_eq!(e.dtype, dtype, "the synthetic table is in {}", e.dtype);

        let (got, tied_bytes) = run(&tied);
        let (want, untied_bytes) = run(&untied);
        assert_eq!(got, want, "{dtype}: the tied model's logits differ from the untied copy's");
        assert!(tied_bytes > 0, "{dtype}: the CPU backend counts its weights");
        // The packed panels are as large as the stored table; only the stored copy goes.
        assert_eq!(untied_bytes - tied_bytes, table, "{dtype}: {untied_bytes} untied, {tied_bytes} tied");
        eprintln!("{dtype}: tied {tied_bytes} bytes, untied {untied_bytes} (table {table})");
    }
}
