//! The operator mapping table: choices, fallbacks, the log lines that report them, and
//! forbidding ops and fusions.

use tboost_testkit::golden as common;

use std::sync::Mutex;

use common::*;
use tboost_engine::backend::Precision;
use tboost_engine::plan::{Choice, Decision, PlanOptions, PrecisionPolicy, Slot, Verdict};
use tboost_engine::session::Session;

/// Captures log records so tests can assert on what a user would read.
struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, r: &log::Record) {
        self.0.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
    }
    fn flush(&self) {}
}

static LOGS: Capture = Capture(Mutex::new(Vec::new()));

fn captured() -> Vec<String> {
    let _ = log::set_logger(&LOGS);
    log::set_max_level(log::LevelFilter::Info);
    LOGS.0.lock().unwrap().clone()
}

fn opts(disabled: &[&str]) -> PlanOptions {
    PlanOptions { disabled: disabled.iter().map(|s| s.to_string()).collect(), ..Default::default() }
}

fn last_logits(case: &str, o: &PlanOptions, tokens: &[u32]) -> Vec<f32> {
    let mut r = runner_with(&golden_dir(case), o, 2, 16);
    let mut s = Session::new(&mut r, tokens.len()).unwrap();
    s.feed(tokens, true).unwrap()
}

fn decision(r: &tboost_engine::runner::ModelRunner, layer: usize, slot: Slot) -> Decision {
    r.plan.layers[layer].get(slot).unwrap_or_else(|| panic!("layer {layer} has no {slot:?}")).clone()
}

#[test]
fn head_dim_24_falls_back_to_standard_attention_and_says_so() {
    captured();
    let r = runner(&golden_dir("llama_hd24"));
    let line = "attention_prefill: fallback to standard attention on cpu (flash_attention on cpu: head_dim=24 is not a multiple of 16)";
    assert!(r.plan.summary_lines().iter().any(|l| l.ends_with(line)), "{:#?}", r.plan.summary_lines());
    let logs = captured();
    assert!(logs.iter().any(|l| l.starts_with("WARN") && l.contains(line)), "log lacks `{line}`: {logs:#?}");
    for l in 0..r.plan.layers.len() {
        for slot in [Slot::AttentionPrefill, Slot::AttentionDecode] {
            let d = decision(&r, l, slot);
            assert_eq!(d.choice, Choice::StandardAttention, "{slot:?}");
            assert!(d.fallback);
            // The structured reason: which candidate, which parameter, which value.
            let rejected: Vec<(Choice, String, String)> = d
                .tried
                .iter()
                .filter_map(|t| match &t.verdict {
                    Verdict::Rejected { why, .. } => Some((t.candidate, why.param.to_string(), why.value.clone())),
                    _ => None,
                })
                .collect();
            assert!(rejected.contains(&(Choice::FlashAttention, "head_dim".into(), "24".into())), "{rejected:?}");
        }
    }
}

#[test]
fn head_dim_64_uses_flash_attention_for_prefill_and_paged_decode_and_logs_it() {
    captured();
    let r = runner(&golden_dir("mistral"));
    let logs = captured();
    assert!(logs.iter().any(|l| l.contains("attention_prefill: flash_attention on cpu (head_dim=64)")), "{logs:#?}");
    for l in 0..r.plan.layers.len() {
        assert_eq!(decision(&r, l, Slot::AttentionPrefill).choice, Choice::FlashAttention);
        assert_eq!(decision(&r, l, Slot::AttentionDecode).choice, Choice::PagedDecodeAttention);
        assert!(!decision(&r, l, Slot::AttentionPrefill).fallback);
    }
    let json = r.plan.to_json();
    let slots = json["layers"][0]["decisions"].as_array().unwrap();
    let pre = slots.iter().find(|d| d["slot"] == "attention_prefill").unwrap();
    assert_eq!(pre["choice"], "flash_attention");
    assert_eq!(pre["tried"][0]["verdict"], "chosen");
}

#[test]
fn every_slot_of_every_layer_is_decided() {
    for case in ["llama_gqa", "mixtral", "qwen2"] {
        let r = runner(&golden_dir(case));
        for l in &r.plan.layers {
            let mut want = vec![Slot::AttnNorm, Slot::Qkv, Slot::Rope, Slot::KvWrite, Slot::AttentionPrefill];
            want.extend([Slot::AttentionDecode, Slot::OProj, Slot::FfnNorm, Slot::Mlp]);
            if case == "mixtral" {
                want.push(Slot::MoeRouting);
            }
            for s in want {
                assert!(l.get(s).is_some(), "{case} layer {}: no {s:?}", l.layer);
            }
        }
        for s in [Slot::Embed, Slot::RopeTables, Slot::FinalNorm, Slot::LmHead] {
            assert!(r.plan.model_slot(s).is_some(), "{case}: no {s:?}");
        }
    }
}

#[test]
fn forbidding_flash_attention_gives_the_same_logits() {
    let tokens: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 500).collect();
    let flash = last_logits("mistral", &PlanOptions::default(), &tokens);
    let std = last_logits("mistral", &opts(&["flash_attention", "paged_decode_attention"]), &tokens);
    let d = max_abs_diff(&flash, &std);
    assert!(d <= 1e-4, "flash vs standard attention: max abs diff {d}");
}

#[test]
fn forbidding_fusions_and_grouped_moe_changes_no_bits() {
    let tokens: Vec<u32> = (0..23).map(|i| 3 + (i * 53) % 500).collect();
    for case in ["llama_gqa", "qwen2", "mixtral"] {
        let fused = last_logits(case, &PlanOptions::default(), &tokens);
        let unfused = last_logits(case, &opts(&["fuse_qkv", "fuse_gate_up", "fuse_add_norm", "moe_grouped"]), &tokens);
        assert_eq!(fused, unfused, "{case}: fusions must not change results");
    }
}

#[test]
fn forbidden_fusions_are_recorded_as_such() {
    let r = runner_with(&golden_dir("mixtral"), &opts(&["fuse_qkv", "moe_grouped", "fuse_add_norm"]), 1, 4);
    let qkv = decision(&r, 0, Slot::Qkv);
    assert_eq!(qkv.choice, Choice::SeparateQkvMatmuls);
    assert!(qkv.fallback);
    assert_eq!(qkv.tried[0].verdict, Verdict::Disabled { name: "fuse_qkv" });
    assert!(qkv.reason.contains("fuse_qkv"), "{qkv:?}");
    assert_eq!(decision(&r, 0, Slot::Mlp).choice, Choice::MoePerExpert);
    assert_eq!(decision(&r, 1, Slot::AttnNorm).choice, Choice::AddThenRmsNorm);
    assert_eq!(decision(&r, 0, Slot::AttnNorm).choice, Choice::RmsNorm, "layer 0 has no residual to add");
}

#[test]
fn forbidding_every_attention_op_is_a_clear_error() {
    let model = tboost_engine::model::Model::load(&golden_dir("llama_hd24")).unwrap();
    let be = Box::new(tboost_engine::backend::cpu::CpuBackend::new(1).unwrap());
    let err = tboost_engine::runner::ModelRunner::new(&model, be, &opts(&["standard_attention"]), 1)
        .err()
        .expect("must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("layer 0: no backend can run attention_prefill")
            && msg.contains("head_dim=24")
            && msg.contains("standard_attention disabled"),
        "{msg}"
    );
}

#[test]
fn unknown_names_are_rejected() {
    let err = PlanOptions::parse_disabled("flash_attention, warp_drive").unwrap_err().to_string();
    assert!(err.contains("warp_drive") && err.contains("fuse_qkv"), "{err}");
}

/// `precision: fast` is a per-matmul decision: bf16 weights get the fast kernel where the
/// CPU has one (AMX / AVX512_BF16), the rest stay exact, and the plan records which. Fast
/// rounds activations to bf16 (8 bits of mantissa), so the logits move by about
/// 2^-8 of their scale; the golden tolerance (1e-3) is for exact only.
#[test]
fn fast_precision_is_recorded_per_matmul_and_stays_near_exact() {
    let tokens: Vec<u32> = (0..30).map(|i| 3 + (i * 41) % 500).collect();
    let fast_opts = PlanOptions { precision: PrecisionPolicy::Fast, ..Default::default() };
    let exact = last_logits("llama_gqa_bf16", &PlanOptions::default(), &tokens);
    let fast = last_logits("llama_gqa_bf16", &fast_opts, &tokens);
    let r = runner_with(&golden_dir("llama_gqa_bf16"), &fast_opts, 1, 4);
    let has_fast = tboost_kernels::gemm::fast_bf16_applies(tboost_engine::backend::DType::BF16);
    for l in 0..r.plan.layers.len() {
        let d = decision(&r, l, Slot::Qkv);
        let want = if has_fast { Precision::Fast } else { Precision::Exact };
        assert_eq!(d.precision, want, "layer {l}: {d:?}");
    }
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = max_abs_diff(&exact, &fast);
    eprintln!("fast vs exact: max abs diff {d:.3e} (logit scale {scale:.3})");
    if has_fast {
        assert!(d > 0.0, "fast must actually run the bf16 kernel");
        assert!(d <= 0.05 * scale.max(1.0), "fast moved the logits by {d}");
    } else {
        assert_eq!(d, 0.0, "without a fast kernel, fast is exact");
    }
}

/// `precision: fast` on block-quantized weights: every matmul takes the integer kernel (8-bit
/// activations per 32 values, the way llama.cpp's q8 dot products work) and the plan records
/// it; the logits stay within the activation-quantization error of exact (2^-8 of the scale
/// per matmul input, here ~1% of the logit scale), and differ from exact at all (the fast
/// kernel really ran).
#[test]
fn fast_precision_on_quantized_weights_takes_the_integer_kernel() {
    use tboost_engine::backend::cpu::CpuBackend;
    use tboost_engine::runner::ModelRunner;
    use tboost_ops::DType;
    use tboost_testkit::synthetic;
    let tokens: Vec<u32> = (0..20).map(|i| 3 + (i * 97) % 4000).collect();
    for dtype in [DType::Q4_0, DType::Q8_0, DType::Q5_0] {
        let model = synthetic::build("small", dtype, 7).unwrap();
        let logits = |o: &PlanOptions| {
            let mut r = ModelRunner::new(&model, Box::new(CpuBackend::new(2).unwrap()), o, 2).unwrap();
            r.alloc_kv(8, 16).unwrap();
            let precisions: Vec<Precision> = (0..r.plan.layers.len())
                .flat_map(|l| [Slot::Qkv, Slot::OProj, Slot::Mlp].map(|s| decision(&r, l, s).precision))
                .collect();
            let mut s = Session::new(&mut r, tokens.len()).unwrap();
            (s.feed(&tokens, true).unwrap(), precisions)
        };
        let (exact, pe) = logits(&PlanOptions { precision: PrecisionPolicy::Exact, ..Default::default() });
        // The default (auto) is fast for block-quantized weights: the same decisions and bits.
        let (auto, pa) = logits(&PlanOptions::default());
        assert_eq!(PlanOptions::default().precision, PrecisionPolicy::Auto);
        let (fast, pf) = logits(&PlanOptions { precision: PrecisionPolicy::Fast, ..Default::default() });
        assert!(pe.iter().all(|&p| p == Precision::Exact), "{dtype}: {pe:?}");
        assert!(pf.iter().all(|&p| p == Precision::Fast), "{dtype}: every quantized matmul is fast: {pf:?}");
        assert_eq!((&pa, &auto), (&pf, &fast), "{dtype}: auto is fast for quantized weights");
        let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&exact, &fast);
        eprintln!("{dtype}: fast vs exact max abs diff {d:.3e} (logit scale {scale:.3})");
        assert!(d > 0.0, "{dtype}: fast must run the integer kernel");
        assert!(d <= 0.05 * scale.max(1.0), "{dtype}: fast moved the logits by {d} (scale {scale})");
    }
}

#[test]
fn attention_tile_kv_is_an_engine_setting_reported_in_the_plan() {
    // mistral: head_dim 64, flash attention in both phases on the CPU.
    let tiled = PlanOptions { tile_kv: Some(128), ..Default::default() };
    let r = runner_with(&golden_dir("mistral"), &tiled, 2, 64);
    assert_eq!(r.plan.attention_tile_kv, 128);
    assert!(r.plan.to_text().contains("tiling: attention.tile_kv=128"), "{}", r.plan.to_text());
    assert_eq!(r.plan.to_json()["attention_tile_kv"], 128);
    assert_eq!(runner(&golden_dir("mistral")).plan.to_json()["attention_tile_kv"], 64);
    // The tile changes where the online softmax rescales, not the math. A context inside one
    // tile of every size (12 tokens) gives the same bits for every tile; a context of 240
    // spans several tiles of every size, so the summation order differs: the logits then
    // agree with the default tile's to float rounding (golden tolerance 1e-3), and differ at
    // all (the tile really changed).
    let short: Vec<u32> = (0..12).map(|i| 3 + (i * 37) % 500).collect();
    let long: Vec<u32> = (0..240).map(|i| 3 + (i * 37) % 500).collect();
    let (base_short, base_long) = (
        last_logits("mistral", &PlanOptions::default(), &short),
        last_logits("mistral", &PlanOptions::default(), &long),
    );
    for t in [16, 32, 128, 256] {
        let o = PlanOptions { tile_kv: Some(t), ..Default::default() };
        assert_eq!(last_logits("mistral", &o, &short), base_short, "tile_kv={t}: one tile, other bits");
        let d = max_abs_diff(&last_logits("mistral", &o, &long), &base_long);
        eprintln!("tile_kv={t}: 240-token context, logits max abs diff vs tile 64: {d:.2e}");
        assert!(d > 0.0 && d <= 1e-3, "tile_kv={t}: logits differ by {d}");
    }
    // A tile the kernel does not take is a config error naming the key.
    let model = tboost_engine::model::Model::load(&golden_dir("mistral")).unwrap();
    let bad = PlanOptions { tile_kv: Some(48), ..Default::default() };
    let be = Box::new(tboost_engine::backend::cpu::CpuBackend::new(1).unwrap());
    let e = tboost_engine::runner::ModelRunner::new(&model, be, &bad, 1).err().expect("refused").to_string();
    assert_eq!(e, "engine config: config `tiling.attention.tile_kv`: tile_kv=48 is not a power of two in 16..=256");
}

/// The matmul and MoE tunables (`tiling.matmul.*`, `tiling.moe.*`): engine settings the plan
/// reports (text and JSON), that change no bit of the logits. Every kernel computes an output
/// with one reduction order whatever the split, so a prefill of 40 tokens (the tiled kernels)
/// and the decode step after it (the GEMV path) give the default's bits under tilings that cut
/// the work very differently: f32 MoE and bf16 golden models, a synthetic MoE in Q4_K at both
/// precisions and in Q8_0. Values out of range are config errors naming key and range.
#[test]
fn matmul_and_moe_tiling_are_engine_settings_reported_in_the_plan_that_change_no_bit() {
    use tboost_engine::backend::cpu::CpuBackend;
    use tboost_engine::backend::{MatMulTiling, MoeTiling};
    use tboost_engine::model::Model;
    use tboost_engine::runner::ModelRunner;
    use tboost_ops::DType;
    use tboost_testkit::synthetic;
    let tilings = [
        (
            MatMulTiling {
                panel_rows: Some(16),
                act_rows: Some(3),
                tasks_per_thread: Some(1),
                decode_task_min_bytes: Some(4096),
            },
            MoeTiling { expert_batch_tokens: Some(2), parallel_expert_batches: Some(3) },
        ),
        (
            MatMulTiling {
                panel_rows: Some(4096),
                act_rows: Some(65536),
                tasks_per_thread: Some(64),
                decode_task_min_bytes: Some(16 << 20),
            },
            MoeTiling { expert_batch_tokens: Some(1), parallel_expert_batches: Some(64) },
        ),
        (MatMulTiling { act_rows: Some(7), ..Default::default() }, MoeTiling::default()),
    ];
    let tokens: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 500).collect();
    // Prefill logits of every position, then one decode step.
    let run = |model: &Model, o: &PlanOptions| -> (Vec<f32>, Vec<f32>, String) {
        let mut r = ModelRunner::new(model, Box::new(CpuBackend::new(2).unwrap()), o, 2).unwrap();
        r.alloc_kv(8, 16).unwrap();
        let text = r.plan.to_text();
        let mut s = Session::new(&mut r, tokens.len() + 1).unwrap();
        (s.feed(&tokens, true).unwrap(), s.feed(&[7], false).unwrap(), text)
    };
    let mut models: Vec<(String, Model, PrecisionPolicy)> = Vec::new();
    for case in ["mixtral", "llama_gqa_bf16"] {
        models.push((case.into(), Model::load(&golden_dir(case)).unwrap(), PrecisionPolicy::Auto));
    }
    for (dtype, precision) in [(DType::Q4K, PrecisionPolicy::Fast), (DType::Q4K, PrecisionPolicy::Exact)] {
        models.push((
            format!("tiny-moe {dtype} {precision:?}"),
            synthetic::build("tiny-moe", dtype, 5).unwrap(),
            precision,
        ));
    }
    models.push(("small q8_0".into(), synthetic::build("small", DType::Q8_0, 5).unwrap(), PrecisionPolicy::Auto));
    for (name, model, precision) in &models {
        let base = PlanOptions { precision: *precision, ..Default::default() };
        let (prefill, decode, text) = run(model, &base);
        assert!(!text.contains("tiling:"), "{name}: the defaults print no tiling line:\n{text}");
        for (mt, et) in tilings {
            let o = PlanOptions { matmul_tiling: mt, moe_tiling: et, ..base.clone() };
            let (p, d, text) = run(model, &o);
            assert!(p == prefill && d == decode, "{name}: {mt:?} {et:?} changed the logits");
            assert!(text.contains("tiling: matmul."), "{name}: the plan reports the tiling:\n{text}");
        }
    }

    // The report: the text line (MoE ones marked unused on a dense model) and the JSON.
    let (mt, et) = tilings[0];
    let o = PlanOptions { matmul_tiling: mt, moe_tiling: et, tile_kv: Some(128), ..Default::default() };
    let moe = runner_with(&golden_dir("mixtral"), &o, 2, 16);
    let line = "tiling: attention.tile_kv=128 matmul.panel_rows=16 matmul.act_rows=3 matmul.tasks_per_thread=1 \
                matmul.decode_task_min_bytes=4096 moe.expert_batch_tokens=2 moe.parallel_expert_batches=3\n";
    assert!(moe.plan.to_text().contains(line), "{}", moe.plan.to_text());
    let j = moe.plan.to_json();
    assert_eq!(j["matmul_tiling"]["panel_rows"], 16);
    assert_eq!(j["matmul_tiling"]["decode_task_min_bytes"], 4096);
    assert_eq!(j["moe_tiling"]["expert_batch_tokens"], 2);
    let dense = runner_with(&golden_dir("mistral"), &o, 2, 16).plan.clone();
    assert!(dense.to_text().contains("moe.expert_batch_tokens=2 (unused: no moe_grouped slot)"), "{}", dense.to_text());
    let j = runner(&golden_dir("mixtral")).plan.to_json();
    assert!(j["matmul_tiling"]["panel_rows"].is_null() && j["moe_tiling"]["parallel_expert_batches"].is_null(), "{j}");

    // Out of range: a config error naming the key and the accepted range.
    let model = Model::load(&golden_dir("mixtral")).unwrap();
    let refuse = |o: PlanOptions| {
        let be = Box::new(CpuBackend::new(1).unwrap());
        ModelRunner::new(&model, be, &o, 1).err().expect("refused").to_string()
    };
    let bad = MatMulTiling { panel_rows: Some(20), ..Default::default() };
    assert_eq!(
        refuse(PlanOptions { matmul_tiling: bad, ..Default::default() }),
        "engine config: config `tiling.matmul.panel_rows`: panel_rows=20 is not a multiple of 16 in 16..=4096"
    );
    let bad = MoeTiling { parallel_expert_batches: Some(0), ..Default::default() };
    assert_eq!(
        refuse(PlanOptions { moe_tiling: bad, ..Default::default() }),
        "engine config: config `tiling.moe.parallel_expert_batches`: parallel_expert_batches=0 is not in 1..=64"
    );
}

#[test]
fn packing_weights_into_panels_changes_no_bit_but_fast_bf16s_and_is_recorded() {
    use tboost_engine::backend::cpu::CpuBackend;
    use tboost_engine::plan::WeightMode;
    use tboost_engine::runner::ModelRunner;
    use tboost_ops::DType;
    use tboost_testkit::synthetic;
    let tokens: Vec<u32> = (0..20).map(|i| 3 + (i * 97) % 1000).collect();
    // Block types pack for fast, f16 and bf16 for exact, bf16 also for fast's bf16 dot
    // products or AMX tiles and f16 for fast's AMX split kernel where the CPU has them
    // (otherwise those stay as stored: nothing to compare).
    let cases = [
        (DType::Q4_0, PrecisionPolicy::Auto),
        (DType::Q5_0, PrecisionPolicy::Auto),
        (DType::Q8_0, PrecisionPolicy::Auto),
        (DType::Q4K, PrecisionPolicy::Auto),
        (DType::Q6K, PrecisionPolicy::Auto),
        (DType::F16, PrecisionPolicy::Auto),
        (DType::BF16, PrecisionPolicy::Auto),
        (DType::BF16, PrecisionPolicy::Fast),
        (DType::F16, PrecisionPolicy::Fast),
    ];
    for (dtype, precision) in cases {
        // "small"'s ffn (1408) is no whole number of 256-value k-quant blocks; tiny-moe's
        // dims are, and its attention and lm_head pack (the experts stay as stored).
        let shape = if matches!(dtype, DType::Q4K | DType::Q6K) { "tiny-moe" } else { "small" };
        let slots: &[Slot] =
            if shape == "small" { &[Slot::Qkv, Slot::OProj, Slot::Mlp] } else { &[Slot::Qkv, Slot::OProj] };
        let model = synthetic::build(shape, dtype, 11).unwrap();
        let run = |disabled: &[&str]| {
            let o = PlanOptions { precision, ..opts(disabled) };
            let mut r = ModelRunner::new(&model, Box::new(CpuBackend::new(2).unwrap()), &o, 2).unwrap();
            r.alloc_kv(8, 16).unwrap();
            let modes: Vec<WeightMode> = (0..r.plan.layers.len())
                .flat_map(|l| slots.iter().map(move |&s| (l, s)))
                .map(|(l, s)| decision(&r, l, s).weights)
                .chain(r.plan.model_slot(Slot::LmHead).map(|d| d.weights))
                .collect();
            let mut s = Session::new(&mut r, tokens.len()).unwrap();
            // A prefill (many rows) and a decode step (one row): both kernel shapes.
            let mut logits = s.feed(&tokens[..tokens.len() - 1], true).unwrap();
            logits.extend(s.feed(&tokens[tokens.len() - 1..], true).unwrap());
            (logits, modes, r.plan.to_text())
        };
        let (packed, pm, text) = run(&[]);
        let (rows, rm, _) = run(&["pack_weights"]);
        let what = format!("{dtype} {precision:?}");
        assert!(rm.iter().all(|&m| m == WeightMode::Native), "{what}: pack_weights disabled: {rm:?}");
        // Block types always pack; f16 and bf16 (exact) only where dense panels pay (from
        // AVX-512, `gemm::dense::exact_panels::pays`); fast bf16 only where its dot-product or AMX
        // kernel runs.
        let amx_tiles = tboost_kernels::gemm::dense::amx_pair_panels::applies();
        let expect_packed = match (dtype, precision) {
            (DType::BF16, PrecisionPolicy::Fast) => {
                tboost_kernels::gemm::dense::bf16_pair_panels::applies() || amx_tiles
            }
            // Without AMX, fast f16 is rounded to bf16 for the dot-product kernel where it runs,
            // else falls back to the exact kernel, which packs where it pays.
            (DType::F16, PrecisionPolicy::Fast) => {
                amx_tiles
                    || tboost_kernels::gemm::dense::bf16_pair_panels::applies()
                    || tboost_kernels::gemm::dense::exact_panels::pays(DType::F16)
            }
            _ if dtype.is_float() => tboost_kernels::gemm::dense::exact_panels::pays(dtype),
            _ => true,
        };
        if !expect_packed {
            assert!(pm.iter().all(|&m| m == WeightMode::Native), "{what}: this CPU keeps rows: {pm:?}");
            eprintln!("{what}: this CPU keeps these weights in rows; nothing packed");
            continue;
        }
        assert!(pm.iter().all(|&m| m == WeightMode::Packed), "{what}: every matmul slot packed: {pm:?}");
        assert!(text.contains("repacked into cpu's panel layout at upload"), "{what}: the plan says so:\n{text}");
        // With AMX, bf16 panels take the row kernel's tile products (`gemm::dense::amx_pair_panels`):
        // the same bits, checked below.
        // Where a fast kernel runs on the panels but not on the rows, the two differ within a
        // bound, and must differ (else the kernel did not run); elsewhere they are the same bits.
        let bf16_dot = tboost_kernels::gemm::dense::bf16_pair_panels::applies();
        let bound = match (dtype, precision) {
            // One chain per output in the pair panels, 16 chains and a tree in rows
            // (`gemm::dense::bf16_pair_panels`): both within the bf16 bound (2^-8 of O(1) logits).
            (DType::BF16, PrecisionPolicy::Fast) if !amx_tiles => Some(("pair panels", -7)),
            // Without AMX, f16 weights rounded to bf16 once at upload (at most 2^-9 each) and
            // activations per step, for `vdpbf16ps`, against exact f16 rows.
            (DType::F16, PrecisionPolicy::Fast) if !amx_tiles && bf16_dot => Some(("bf16-rounded pair panels", -6)),
            // With AMX, the split kernel keeps 16 bits of each activation
            // (`gemm::dense::amx_pair_panels`), against exact f16 rows.
            (DType::F16, PrecisionPolicy::Fast) if amx_tiles => Some(("split pair panels", -12)),
            _ => None,
        };
        if let Some((kernel, exp)) = bound {
            let scale = rows.iter().fold(0f32, |a, v| a.max(v.abs()));
            let diff = max_abs_diff(&packed, &rows);
            eprintln!("{what}: {kernel} against rows: max |diff| {diff}, logit scale {scale}");
            assert!(diff > 0.0, "{what}: {kernel} gave the rows' bits (is its kernel running?)");
            assert!(diff <= 2f32.powi(exp) * scale, "{what}: {kernel} moved the logits by {diff} (scale {scale})");
            continue;
        }
        assert!(
            packed.iter().zip(&rows).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: packed panels changed the logits (max abs diff {})",
            max_abs_diff(&packed, &rows)
        );
    }
}
