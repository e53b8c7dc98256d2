//! Every GGUF block type added for issue 46 (Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q3_K, Q2_K) runs a whole
//! model: a synthetic llama written as a GGUF file in that type (`tboost synth`'s writer) loads,
//! and its greedy ids and logits at exact precision equal those of the same model with every
//! matrix dequantized to f32 by the reference (ggml's dequantization), within f32 rounding.

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::model::{Mlp, Model, Tensor};
use tboost_engine::plan::{PlanOptions, PrecisionPolicy};
use tboost_engine::runner::ModelRunner;
use tboost_engine::session::Session;
use tboost_kernels::gemm::quant::dequantize_row;
use tboost_ops::DType;
use tboost_testkit::gguf_write;

const NEW_TYPES: [DType; 6] = [DType::Q4_1, DType::Q5_1, DType::IQ4NL, DType::IQ4XS, DType::Q3K, DType::Q2K];

/// `t` as f32 values (the reference dequantization for block types).
fn to_f32(t: &Tensor) -> Tensor {
    if !t.dtype.is_quantized() {
        return t.clone();
    }
    let mut v = vec![0f32; t.numel()];
    dequantize_row(t.dtype, t.bytes(), &mut v).unwrap();
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Tensor::owned(t.name.clone(), DType::F32, t.shape.clone(), bytes).unwrap()
}

fn dequantized(model: &Model) -> Model {
    // Model is not Clone (the GGUF metadata can be a whole vocabulary); the test needs only
    // the config and weights.
    let mut m = Model {
        path: model.path.clone(),
        format: model.format.clone(),
        config: model.config.clone(),
        weights: model.weights.clone(),
        gguf_metadata: None,
        tokenizer: model.tokenizer.clone(),
        chat_template: model.chat_template.clone(),
    };
    let w = &mut m.weights;
    for t in [&mut w.embed, &mut w.norm, &mut w.lm_head] {
        *t = to_f32(t);
    }
    for l in &mut w.layers {
        for t in [&mut l.q, &mut l.k, &mut l.v, &mut l.o, &mut l.attn_norm, &mut l.ffn_norm] {
            *t = to_f32(t);
        }
        match &mut l.mlp {
            Mlp::Dense { gate, up, down } => {
                for t in [gate, up, down] {
                    *t = to_f32(t);
                }
            }
            Mlp::Moe { .. } => unreachable!("the synthetic llama is dense"),
        }
    }
    m
}

/// Greedy ids after `prompt`, and the logits of every step (prefill's last row first).
fn run(model: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let opts = PlanOptions { precision: PrecisionPolicy::Exact, ..Default::default() };
    let mut r = ModelRunner::new(model, Box::new(CpuBackend::new(2).unwrap()), &opts, 2).unwrap();
    r.alloc_kv(8, 16).unwrap();
    let mut s = Session::new(&mut r, prompt.len() + n).unwrap();
    let mut logits = vec![s.feed(prompt, false).unwrap()];
    let mut ids = Vec::new();
    for _ in 0..n {
        let last = logits.last().unwrap();
        let id = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as u32;
        ids.push(id);
        logits.push(s.feed(&[id], false).unwrap());
    }
    (ids, logits)
}

#[test]
fn a_model_in_each_new_gguf_type_loads_and_runs_as_its_dequantized_f32_twin() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| 1 + (i * 131) % 2000).collect();
    for dtype in NEW_TYPES {
        let path = dir.path().join(format!("small-k-{dtype}.gguf"));
        gguf_write::write_synthetic("small-k", dtype, 46, &path, &mut |_, _| {}).unwrap();
        let model = Model::load(&path).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        let l0 = &model.weights.layers[0];
        assert!(l0.q.dtype == dtype && model.weights.lm_head.dtype == dtype, "{dtype}: matrices in {}", l0.q.dtype);
        let (ids, logits) = run(&model, &prompt, 16);
        let (want_ids, want_logits) = run(&dequantized(&model), &prompt, 16);
        // Same weights, different summation order (the block kernels' canonical order vs the f32
        // kernels'): logits agree to f32 rounding of dot products of a few thousand terms.
        let mut worst = 0f32;
        for (step, (g, w)) in logits.iter().zip(&want_logits).enumerate() {
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            let d = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d <= 1e-4 * scale, "{dtype} step {step}: logits differ by {d} (scale {scale})");
            worst = worst.max(d / scale);
        }
        assert_eq!(ids, want_ids, "{dtype}: greedy ids differ from the dequantized f32 model's");
        assert!(ids.iter().collect::<std::collections::HashSet<_>>().len() > 1, "{dtype}: degenerate run {ids:?}");
        eprintln!("{dtype}: 16 greedy ids equal, worst logit diff {worst:.2e} of the largest logit");
    }
}
