//! GGUF block weights kept quantized on the Ascend backend (issue 45): the plan puts the matmuls of
//! Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q5_K weights on `aclnnWeightQuantBatchMatmulV2` (A16W8 / A16W4,
//! per-32 scales, per-32 antiquant offsets for the types with mins) on the CANN SIMULATOR
//! (ascend-sim, not an NPU; default SoC Ascend910B2), the logits stay within the simulator's f16
//! tolerance of the CPU backend's on the same file, and the device keeps those weights, and the
//! whole model (the embedding table stays on the host as stored), in no more bytes than the file
//! (at most 1.15x).
//!
//! Tolerance: `TestBackend::logit_tol` (f16 activations, about √R·u per logit, doubled). Keeping a
//! weight quantized adds no rounding beyond the f16 path: the simulator rounds each dequantized
//! weight `q·d` to f16, which is what the f16 conversion at upload does.
#![cfg(feature = "ascend")]

use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::model::{Mlp, Model};
use tboost_engine::plan::{Placement, PlanOptions, PrecisionPolicy, Slot, WeightMode};
use tboost_engine::runner::ModelRunner;
use tboost_engine::session::Session;
use tboost_ops::DType;
use tboost_testkit::backends::{Kind, TestBackend};
use tboost_testkit::gguf_write;

const WQBMM: &str = "aclnnWeightQuantBatchMatmulV2";

/// Greedy ids after `prompt` and the logits of every step (prefill's last row first).
fn run(r: &mut ModelRunner, block_size: usize, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    r.alloc_kv(512 / block_size, block_size).unwrap();
    let mut s = Session::new(r, prompt.len() + n).unwrap();
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

/// Values of the model's matmul weights stored in `dtype`.
fn matmul_values(model: &Model, dtype: DType) -> usize {
    matmul_tensors(model).iter().filter(|t| t.dtype == dtype).map(|t| t.numel()).sum()
}

/// File bytes of the model's matmul weights stored in `dtype`.
fn matmul_bytes(model: &Model, dtype: DType) -> usize {
    matmul_tensors(model).iter().filter(|t| t.dtype == dtype).map(|t| t.bytes().len()).sum()
}

/// The matmul weights of the model (every tensor an `aclnnMm`/WQBMM reads: not the embedding).
fn matmul_tensors(model: &Model) -> Vec<&tboost_engine::model::Tensor> {
    let w = &model.weights;
    let mut v = vec![&w.lm_head];
    for l in &w.layers {
        v.extend([&l.q, &l.k, &l.v, &l.o]);
        if let Mlp::Dense { gate, up, down } = &l.mlp {
            v.extend([gate, up, down]);
        }
    }
    v
}

#[test]
fn gguf_block_types_run_through_weight_quant_batch_matmul_within_tolerance_of_the_cpu() {
    let sim = TestBackend { name: "ascend", kind: Kind::AscendSim, block_size: 128 };
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..10).map(|i| 1 + (i * 173) % 4000).collect();
    let opts = PlanOptions { precision: PrecisionPolicy::Exact, ..Default::default() };
    // (type, shape, device bytes per value of the kept matrices: INT4 or INT8, f16 scales per 32,
    // f16 offsets per 32 for the types with mins)
    let cases = [
        (DType::Q8_0, "small", 1.0 + 2.0 / 32.0),
        (DType::Q4_0, "small", 0.5 + 2.0 / 32.0),
        (DType::Q4_1, "small", 0.5 + 4.0 / 32.0),
        (DType::Q5_0, "small", 1.0 + 2.0 / 32.0),
        (DType::Q4K, "small-k", 0.5 + 4.0 / 32.0),
        (DType::Q5K, "small-k", 1.0 + 4.0 / 32.0),
    ];
    for (dtype, shape, per_value) in cases {
        let path = dir.path().join(format!("{shape}-{dtype}.gguf"));
        gguf_write::write_synthetic(shape, dtype, 45, &path, &mut |_, _| {}).unwrap();
        let model = Model::load(&path).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        assert_eq!(model.weights.layers[0].q.dtype, dtype);
        let layers = model.config.num_layers;

        let mut cpu = ModelRunner::new(&model, Box::new(CpuBackend::new(2).unwrap()), &opts, 2).unwrap();
        let (want_ids, want) = run(&mut cpu, 16, &prompt, 4);
        drop(cpu);

        let _turn = sim.exclusive();
        let sim_opts = PlanOptions { block_size: sim.block_size, ..opts.clone() };
        let mut r = ModelRunner::new(&model, sim.open(2), &sim_opts, 2).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        // every matmul slot stays quantized on the primary and names the op
        let mut decisions: Vec<_> = r.plan.model.iter().filter(|d| d.slot == Slot::LmHead).collect();
        for l in &r.plan.layers {
            decisions.extend(l.decisions.iter().filter(|d| matches!(d.slot, Slot::Qkv | Slot::OProj | Slot::Mlp)));
        }
        assert_eq!(decisions.len(), 1 + 3 * layers);
        for d in decisions {
            assert_eq!(d.weights, WeightMode::Native, "{dtype} {:?}: {}", d.slot, d.reason);
            assert!(!d.fallback, "{dtype} {:?}: {}", d.slot, d.reason);
            assert!(d.kernel.as_deref().is_some_and(|k| k.contains(WQBMM)), "{dtype} {:?}: {:?}", d.slot, d.kernel);
        }
        // device bytes of the weights kept in `dtype`: the layout's, and for the 4- and 8-bit types
        // whose file has as many bits (Q8_0, Q4_0, Q4_1) or nearly (Q4_K) at most 1.15x the file's
        let dev = r.device_weight_bytes();
        let kept = dev.iter().find(|(d, _)| *d == dtype).map(|x| x.1).unwrap_or(0);
        let file = matmul_bytes(&model, dtype);
        let values = matmul_values(&model, dtype);
        assert_eq!(kept as f64, values as f64 * per_value, "{dtype}: device bytes of the kept matrices");
        if matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4K) {
            assert!(kept as f64 <= 1.15 * file as f64, "{dtype}: {kept} device bytes for {file} file bytes");
        }
        // The embedding table stays on the host as stored (aclnnEmbedding copies rows of the
        // activation dtype, so the device would hold it in f16): the whole model's device
        // bytes stay within 1.15x of the file's tensors too.
        let embed = r.plan.model.iter().find(|d| d.slot == Slot::Embed).unwrap();
        assert_eq!(embed.placement, Placement::Cpu, "{dtype}: {}", embed.reason);
        assert!(embed.reason.contains("stays on the host as stored"), "{dtype}: {}", embed.reason);
        let total_dev: usize = dev.iter().map(|x| x.1).sum();
        let total_file: usize = model.weights.tensors().iter().map(|t| t.bytes().len()).sum();
        if matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4K) {
            assert!(
                total_dev as f64 <= 1.15 * total_file as f64,
                "{dtype}: {total_dev} device bytes for {total_file} file bytes of every tensor"
            );
        }

        let (ids, got) = run(&mut r, sim.block_size, &prompt, 4);
        let mut worst = 0f32;
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let max_want = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let tol = sim.logit_tol(layers, max_want);
            let d = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d <= tol, "{dtype} step {step}: logits differ from the CPU's by {d} (tolerance {tol})");
            worst = worst.max(d / tol);
        }
        // greedy ids may part at a near-tie; the logits above are the check, the ids are reported
        let same = ids.iter().zip(&want_ids).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{dtype}: matmul weights {kept} device bytes for {file} in the file ({:.3}x); all weights {total_dev} \
             device bytes for {total_file} ({:.3}x; the embedding table on the host); worst logit diff \
             {worst:.2} of the tolerance; {same}/4 greedy ids as the CPU's; per dtype {dev:?}",
            kept as f64 / file as f64,
            total_dev as f64 / total_file as f64
        );
    }
}

const CHILD: &str = "TBOOST_ASCEND_QUANT_CHILD";

/// On Atlas inference (310P) the plan keeps no weight quantized: every matmul slot converts its Q8_0
/// weights to f16 at upload and says why. The SoC is read at `aclInit`, so this runs in a child
/// process of this test binary with `TBOOST_SIM_SOC` set.
#[test]
fn on_310p_q8_0_weights_fall_back_to_the_f16_conversion_with_the_reason() {
    let name = "on_310p_q8_0_weights_fall_back_to_the_f16_conversion_with_the_reason";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("TBOOST_SIM_SOC", "Ascend310P3")
            .output()
            .expect("spawn the test child");
        let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success() && so.contains("test result: ok. 1 passed"),
            "child on Ascend310P3 failed:\n{so}\n{se}"
        );
        return;
    }
    let sim = TestBackend { name: "ascend", kind: Kind::AscendSim, block_size: 128 };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small-q8_0.gguf");
    gguf_write::write_synthetic("small", DType::Q8_0, 45, &path, &mut |_, _| {}).unwrap();
    let model = Model::load(&path).unwrap();
    let opts = PlanOptions { precision: PrecisionPolicy::Exact, block_size: sim.block_size, ..Default::default() };
    let _turn = sim.exclusive();
    let r = ModelRunner::new(&model, sim.open(2), &opts, 2).unwrap_or_else(|e| panic!("310P: {e}"));
    let qkv = r.plan.layers[0].get(Slot::Qkv).expect("a qkv decision");
    eprintln!("310P qkv: {:?} on {} ({:?}): {}", qkv.weights, qkv.backend, qkv.kernel, qkv.reason);
    assert_eq!(qkv.weights, WeightMode::Convert(DType::F16), "{}", qkv.reason);
    assert_eq!(qkv.kernel.as_deref(), Some("aclnnMm"));
    assert!(
        qkv.reason.contains("stored weights refused")
            && qkv.reason.contains(WQBMM)
            && qkv.reason.contains("Ascend310P3"),
        "the reason names the op and the SoC: {}",
        qkv.reason
    );
    let dev = r.device_weight_bytes();
    assert!(dev.iter().all(|(d, _)| !d.is_quantized()), "nothing kept quantized on 310P: {dev:?}");
}
