//! Per-op fallback: a backend that takes no candidate of a slot still loads the model; the
//! slot runs on the CPU beside it, the plan says so (and what it copies), and the logits are
//! the CPU's bit for bit.
//!
//! The "device" here is a test backend wrapping a CPU backend that answers no for one kind
//! of op (it also names itself `picky`, so the runner makes a second, real CPU beside it).

use tboost_testkit::golden as common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use common::*;
use tboost_engine::backend::cpu::CpuBackend;
use tboost_engine::backend::{
    Backend, BufId, DType, DeviceInfo, EventId, Op, OpQuery, PendingRead, StepHost, StepViews, Unsupported, View,
    WeightId,
};
use tboost_engine::engine::{Engine, EngineConfig, KvSize};
use tboost_engine::model::{Model, Tensor};
use tboost_engine::plan::{Placement, PlanOptions, Slot, Verdict};
use tboost_engine::runner::ModelRunner;
use tboost_engine::sched::Request;
use tboost_engine::session::Session;

/// A CPU backend that rejects every query `reject` matches.
struct Picky {
    inner: CpuBackend,
    reject: fn(&OpQuery) -> bool,
}

impl Backend for Picky {
    fn name(&self) -> &'static str {
        "picky"
    }
    fn device(&self) -> DeviceInfo {
        DeviceInfo { backend: "picky".into(), device: "a CPU that lacks some ops".into(), runtime_version: None }
    }
    fn supports(&self, q: &OpQuery) -> Result<(), Unsupported> {
        if (self.reject)(q) {
            return Err(Unsupported::new(
                "op",
                format!("{q:?}").split_whitespace().next().unwrap_or("?"),
                "an op this test device has",
            ));
        }
        self.inner.supports(q)
    }
    fn activation_dtypes(&self) -> &'static [DType] {
        self.inner.activation_dtypes()
    }
    fn kv_dtypes(&self) -> &'static [DType] {
        self.inner.kv_dtypes()
    }
    fn alloc(&mut self, dtype: DType, len: usize) -> tboost_engine::Result<BufId> {
        self.inner.alloc(dtype, len)
    }
    fn free(&mut self, buf: BufId) {
        self.inner.free(buf)
    }
    fn buffer(&self, buf: BufId) -> Option<(DType, usize)> {
        self.inner.buffer(buf)
    }
    fn allocated_bytes(&self) -> usize {
        self.inner.allocated_bytes()
    }
    fn upload_weight(&mut self, t: &Tensor) -> tboost_engine::Result<WeightId> {
        self.inner.upload_weight(t)
    }
    fn write(&mut self, dst: View, src: &[u8]) -> tboost_engine::Result<()> {
        self.inner.write(dst, src)
    }
    fn write_async(&mut self, dst: View, src: &[u8]) -> tboost_engine::Result<()> {
        self.inner.write_async(dst, src)
    }
    fn read(&mut self, src: View, dst: &mut [u8]) -> tboost_engine::Result<()> {
        self.inner.read(src, dst)
    }
    fn read_async(&mut self, src: View) -> tboost_engine::Result<PendingRead> {
        self.inner.read_async(src)
    }
    fn finish_read(&mut self, r: PendingRead, dst: &mut [u8]) -> tboost_engine::Result<()> {
        self.inner.finish_read(r, dst)
    }
    fn set_step(&mut self, host: &StepHost<'_>, views: &StepViews) -> tboost_engine::Result<()> {
        self.inner.set_step(host, views)
    }
    fn launch(&mut self, op: &Op) -> tboost_engine::Result<()> {
        // What the plan rejected must never be launched here.
        let rejected = match op {
            Op::RmsNorm { .. } | Op::AddRmsNorm { .. } => (self.reject)(&OpQuery::RmsNorm {
                gain: DType::F32,
                act: DType::F32,
                fused_add: matches!(op, Op::AddRmsNorm { .. }),
            }),
            Op::Attention { .. } | Op::WriteKv { .. } => (self.reject)(&OpQuery::WriteKv {
                act: DType::F32,
                kv_dtype: DType::F32,
                block_size: 16,
                kv_heads: 1,
                head_dim: 1,
            }),
            _ => false,
        };
        assert!(!rejected, "{} was launched on the device that rejected it", op.name());
        self.inner.launch(op)
    }
    fn record_event(&mut self) -> tboost_engine::Result<EventId> {
        self.inner.record_event()
    }
    fn wait_event(&mut self, e: EventId) -> tboost_engine::Result<()> {
        self.inner.wait_event(e)
    }
    fn synchronize(&mut self) -> tboost_engine::Result<()> {
        self.inner.synchronize()
    }
    fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.inner.set_interrupt(flag)
    }
}

fn picky(reject: fn(&OpQuery) -> bool) -> Box<dyn Backend> {
    Box::new(Picky { inner: CpuBackend::new(1).unwrap(), reject })
}

fn no_norms(q: &OpQuery) -> bool {
    matches!(q, OpQuery::RmsNorm { .. })
}

/// No attention of any kind (and so no KV write: they share the KV pools).
fn no_attention(q: &OpQuery) -> bool {
    matches!(q, OpQuery::Attention { .. })
}

fn logits_on(model: &Model, be: Box<dyn Backend>, tokens: &[u32]) -> (Vec<f32>, ModelRunner) {
    let mut r = ModelRunner::new(model, be, &PlanOptions::default(), 1).unwrap();
    r.alloc_kv(8, 16).unwrap();
    let logits = {
        let mut s = Session::new(&mut r, tokens.len() + 2).unwrap();
        let mut l = s.feed(tokens, true).unwrap();
        // One decode step too, so the decode slots run.
        l.extend(s.feed(&[7], false).unwrap());
        l
    };
    (logits, r)
}

#[test]
fn a_device_without_rmsnorm_runs_norms_on_the_cpu_with_counted_copies_and_equal_logits() {
    let model = Model::load(&golden_dir("llama_gqa")).unwrap();
    let tokens: Vec<u32> = (0..21).map(|i| 3 + i * 11).collect();
    let (want, _) = logits_on(&model, Box::new(CpuBackend::new(1).unwrap()), &tokens);
    let (got, r) = logits_on(&model, picky(no_norms), &tokens);
    assert_eq!(got, want, "logits must equal the CPU's");

    let plan = &r.plan;
    assert!(plan.copy_bytes_per_token > 0);
    for l in &plan.layers {
        for slot in [Slot::AttnNorm, Slot::FfnNorm] {
            let d = l.get(slot).unwrap();
            assert_eq!((d.placement, d.backend.as_str()), (Placement::Cpu, "cpu"), "layer {} {slot:?}", l.layer);
            assert!(d.fallback && d.copy_bytes_per_token > 0);
            assert!(
                d.tried.iter().any(|t| t.backend == "picky"
                    && matches!(&t.verdict, Verdict::Rejected { why, .. } if why.need == "an op this test device has")),
                "{d:?}"
            );
        }
        // Everything else stays on the device.
        assert_eq!(l.get(Slot::Qkv).unwrap().placement, Placement::Primary);
        assert_eq!(l.get(Slot::AttentionPrefill).unwrap().placement, Placement::Primary);
    }
    assert_eq!(plan.model_slot(Slot::FinalNorm).unwrap().placement, Placement::Cpu);
    assert!(r.fallback_copied_bytes() > 0, "copies are counted");
    let text = plan.summary_lines().join("\n");
    assert!(text.contains("bytes per token copied to and from the cpu"), "{text}");
}

#[test]
fn a_device_without_attention_keeps_the_kv_cache_on_the_cpu_and_equal_logits() {
    let model = Model::load(&golden_dir("mistral")).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| 5 + i * 7).collect();
    let (want, _) = logits_on(&model, Box::new(CpuBackend::new(1).unwrap()), &tokens);
    let (got, r) = logits_on(&model, picky(no_attention), &tokens);
    assert_eq!(got, want);
    for l in &r.plan.layers {
        for slot in [Slot::KvWrite, Slot::AttentionPrefill, Slot::AttentionDecode] {
            assert_eq!(l.get(slot).unwrap().placement, Placement::Cpu, "{slot:?} goes with the KV pools");
        }
        assert_eq!(l.get(Slot::Rope).unwrap().placement, Placement::Primary);
    }
}

#[test]
fn the_engine_serves_requests_through_a_fallback_and_reports_the_copies() {
    let model = Model::load(&golden_dir("qwen2")).unwrap();
    let cfg = EngineConfig { threads: 1, kv_size: KvSize::Blocks(32), ..Default::default() };
    let prompts: Vec<Vec<u32>> =
        (0..4).map(|k| (0..(5 + 3 * k)).map(|i| 3 + ((i * 13 + k) % 200) as u32).collect()).collect();
    let run = |be: Box<dyn Backend>| {
        let e = Engine::new(cfg.clone()).unwrap();
        e.load_model_on(&model, be).unwrap();
        let ids: Vec<_> = prompts.iter().map(|p| e.enqueue(Request::new(p.clone(), 6)).unwrap()).collect();
        e.run_to_completion().unwrap();
        let outs: Vec<Vec<u32>> = ids.iter().map(|&id| e.output(id).unwrap().tokens).collect();
        (outs, e.stats().unwrap())
    };
    let (want, cpu_stats) = run(Box::new(CpuBackend::new(1).unwrap()));
    let (got, st) = run(picky(no_norms));
    assert_eq!(got, want);
    assert_eq!(cpu_stats.fallback_copied_bytes, 0);
    assert!(st.fallback_copied_bytes > 0, "{st:?}");
    assert_eq!(st.kv_blocks_used, 0);
}

#[test]
fn a_slot_no_backend_can_run_fails_the_load_naming_layer_slot_and_case() {
    let model = Model::load(&golden_dir("llama_hd24")).unwrap();
    let opts = PlanOptions { disabled: ["standard_attention".to_string()].into(), ..Default::default() };
    let err = ModelRunner::new(&model, picky(no_attention), &opts, 1).err().expect("must fail").to_string();
    assert!(err.contains("layer 0") && err.contains("attention") && err.contains("head_dim=24"), "{err}");
    assert!(err.contains("picky") && err.contains("cpu"), "both backends were asked: {err}");
}
