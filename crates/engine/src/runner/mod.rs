//! Layer-by-layer data flow of one forward pass: turns a step (tokens plus the KV manager's
//! layout) into the ops the plan chose, launched on the backend the plan put each slot on.
//! Owns the device-resident weights, the activation and step buffers and the KV pools; the
//! scheduler and KV manager above it decide what goes in a step.
//!
//! - `buffers`: activation and step-input buffers.
//! - `exec`: per-op placement (primary, or the CPU beside it with counted copies).
//! - `graph`: the op sequence of the decoder.
//! - `weights`: weights made resident per slot, converted where the plan says.

mod buffers;
mod exec;
mod graph;
mod weights;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendExt, KvLayer, StepHost};
use crate::kv::{KvPools, StepLayout};
use crate::model::{Model, ModelConfig};
use crate::plan::{self, Placement, Plan, PlanOptions, Slot};
use crate::{Error, Result};

use buffers::{Buffers, Capacity};
use exec::{Exec, Fallback};
use weights::WeightIds;

/// One forward pass's input.
pub struct StepBatch<'a> {
    /// Every scheduled sequence's new tokens, flattened in the layout's order.
    pub tokens: &'a [u32],
    /// Positions, slot mapping, sequence lengths and block tables (from the KV manager).
    pub layout: &'a StepLayout,
    /// Rows of `tokens` whose logits are wanted, in output order.
    pub logit_rows: &'a [u32],
}

/// The KV pools of every layer: on the primary, on the CPU beside it, or both when layers
/// differ.
struct KvSet {
    placements: Vec<Placement>,
    primary: Option<KvPools>,
    cpu: Option<KvPools>,
    num_blocks: usize,
    block_size: usize,
}

pub struct ModelRunner {
    pub cfg: ModelConfig,
    pub plan: Plan,
    primary: Box<dyn Backend>,
    /// The CPU backend beside a device, when the plan put any slot on it.
    fallback: Option<Fallback>,
    ids: WeightIds,
    bufs: Option<Buffers>,
    /// KV pools per layer, on the backend the layer's attention runs on.
    kv: Option<KvSet>,
    weight_bytes: usize,
}

impl ModelRunner {
    /// Plans the model for `primary` (with a CPU beside it for the slots it cannot run, made
    /// with `cpu_threads`) and makes its weights resident.
    pub fn new(
        model: &Model,
        mut primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
    ) -> Result<ModelRunner> {
        let cfg = model.config.clone();
        let w = &model.weights;
        // A CPU primary has nothing to fall back to but itself.
        let mut cpu = if primary.name() == "cpu" { None } else { Some(CpuBackend::new(cpu_threads)?) };
        let plan = plan::build(&cfg, w, primary.as_ref(), cpu.as_ref().map(|c| c as &dyn Backend), opts)?;
        if !plan.uses_cpu_fallback() {
            cpu = None;
        }
        let mut ids = WeightIds::upload(&plan, w, primary.as_mut(), cpu.as_mut())?;
        ids.embed_scale = plan::embed_scale(&cfg, w.embed.dtype);
        Ok(ModelRunner {
            weight_bytes: w.total_bytes(),
            cfg,
            plan,
            primary,
            fallback: cpu.map(Fallback::new),
            ids,
            bufs: None,
            kv: None,
        })
    }

    /// Stops work in progress on every backend of this runner when `flag` is set.
    pub fn set_interrupt(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.primary.set_interrupt(flag.clone());
        if let Some(f) = self.fallback.as_mut() {
            f.be.set_interrupt(flag);
        }
    }

    pub fn backend(&self) -> &dyn Backend {
        self.primary.as_ref()
    }

    /// Bytes of all weights (what one decode step streams from memory, for dense models).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes copied between the primary backend and the CPU beside it so far.
    pub fn fallback_copied_bytes(&self) -> u64 {
        self.fallback.as_ref().map_or(0, |f| f.copied)
    }

    /// Allocates the KV pools (replacing any previous ones) in the plan's KV dtype, each
    /// layer's on the backend its attention runs on.
    pub fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        if block_size != self.plan.block_size {
            return Err(Error::invalid(
                "block_size",
                format!("{block_size} differs from the {} the plan was made for", self.plan.block_size),
            ));
        }
        self.free_kv();
        let dtype = self.plan.kv_dtype;
        let placements: Vec<Placement> =
            self.plan.layers.iter().map(|l| l.get(Slot::KvWrite).map_or(Placement::Primary, |d| d.placement)).collect();
        let wants = |p| placements.contains(&p);
        let primary = match wants(Placement::Primary) {
            true => Some(KvPools::new(self.primary.as_mut(), &self.cfg, num_blocks, block_size, dtype)?),
            false => None,
        };
        let cpu = match (&mut self.fallback, wants(Placement::Cpu)) {
            (Some(f), true) => match KvPools::new(&mut f.be, &self.cfg, num_blocks, block_size, dtype) {
                Ok(p) => Some(p),
                Err(e) => {
                    if let Some(mut p) = primary {
                        p.free(self.primary.as_mut());
                    }
                    return Err(e);
                }
            },
            (None, true) => {
                return Err(Error::invalid("kv cache", "the plan puts attention on a CPU that was not made"))
            }
            _ => None,
        };
        self.kv = Some(KvSet { placements, primary, cpu, num_blocks, block_size });
        Ok(())
    }

    fn free_kv(&mut self) {
        if let Some(kv) = self.kv.take() {
            if let Some(mut p) = kv.primary {
                p.free(self.primary.as_mut());
            }
            if let (Some(mut c), Some(f)) = (kv.cpu, self.fallback.as_mut()) {
                c.free(&mut f.be);
            }
        }
    }

    /// The KV pools' geometry: (blocks, tokens per block).
    pub fn kv_geometry(&self) -> Option<(usize, usize)> {
        self.kv.as_ref().map(|k| (k.num_blocks, k.block_size))
    }

    /// Bytes allocated on the primary device for activations and the KV cache.
    pub fn device_bytes(&self) -> usize {
        self.primary.allocated_bytes()
    }

    fn layer_caches(&self) -> Result<Vec<KvLayer>> {
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| Error::invalid("kv cache", "no KV cache allocated (call alloc_kv first)"))?;
        kv.placements
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let pools = match p {
                    Placement::Primary => kv.primary.as_ref(),
                    Placement::Cpu => kv.cpu.as_ref(),
                };
                pools.and_then(|p| p.layers.get(i).copied()).ok_or_else(|| Error::invalid("kv cache", "pool missing"))
            })
            .collect()
    }

    /// Checks a batch against the model and the cache before anything is launched, so that
    /// a bad batch is a clear error and leaves nothing half-done.
    fn validate(&self, b: &StepBatch<'_>) -> Result<()> {
        let n = b.tokens.len();
        let l = b.layout;
        if n == 0 {
            return Err(Error::invalid("tokens", "the batch is empty"));
        }
        if l.positions.len() != n || l.slots.len() != n {
            return Err(Error::invalid(
                "batch",
                format!("{n} tokens but {} positions and {} slots", l.positions.len(), l.slots.len()),
            ));
        }
        if let Some(&bad) = b.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::invalid(
                "token id",
                format!("{bad} is not below the vocabulary size {}", self.cfg.vocab_size),
            ));
        }
        if let Some(&bad) = b.logit_rows.iter().find(|&&r| r as usize >= n) {
            return Err(Error::invalid("logit_rows", format!("row {bad} is beyond the batch of {n} tokens")));
        }
        let (blocks, bs) = self.kv_geometry().ok_or_else(|| Error::invalid("kv cache", "no KV cache allocated"))?;
        if let Some(&bad) = l.slots.iter().find(|&&s| s as usize >= blocks * bs) {
            return Err(Error::invalid("slots", format!("slot {bad} is beyond the cache's {} slots", blocks * bs)));
        }
        if l.block_tables.len() != l.seqs.len() * l.max_blocks {
            return Err(Error::invalid("batch", "block tables do not match the sequence count"));
        }
        let mut covered = 0u32;
        for (i, &[q_start, q_len, ctx_len]) in l.seqs.iter().enumerate() {
            let used = (ctx_len as usize).div_ceil(bs);
            let table = &l.block_tables[i * l.max_blocks..(i + 1) * l.max_blocks];
            if q_start != covered || q_len == 0 || q_len > ctx_len || used > l.max_blocks {
                return Err(Error::invalid(
                    "batch",
                    format!("sequence {i} [{q_start}, {q_len}, {ctx_len}] does not follow row {covered}"),
                ));
            }
            // With one sliding window in every layer, blocks behind the first row's window may
            // have been given back (`KvManager::set_window`): they are never read.
            let first = (ctx_len - q_len) as usize;
            let skip = match self.cfg.features.uniform_window() {
                Some(w) => ((first + 1).saturating_sub(w) / bs).min(used),
                None => 0,
            };
            if let Some(&b) = table[skip..used].iter().find(|&&b| b as usize >= blocks) {
                return Err(Error::invalid("block_tables", format!("sequence {i} names block {b} of {blocks}")));
            }
            covered += q_len;
        }
        if covered as usize != n {
            return Err(Error::invalid("batch", format!("sequences cover {covered} of {n} tokens")));
        }
        Ok(())
    }

    /// Allocates the activation buffers for steps of up to `tokens` tokens, `rows` logit
    /// rows, `seqs` sequences and `max_blocks` KV blocks per sequence now, at load, rather
    /// than in the first step that needs them: allocating faults their memory in (on the CPU,
    /// see `HostBuf`), which in a step would count against that step's time.
    pub fn reserve(&mut self, tokens: usize, rows: usize, seqs: usize, max_blocks: usize) -> Result<()> {
        self.ensure_buffers(Capacity { tokens, rows, seqs, max_blocks })
    }

    /// Activation buffers covering `want` (grown, never shrunk).
    fn ensure_buffers(&mut self, want: Capacity) -> Result<()> {
        if self.bufs.as_ref().is_some_and(|bf| bf.covers(&want)) {
            return Ok(());
        }
        let old = self.bufs.take();
        let old_cap = old.as_ref().map(|o| o.cap);
        if let Some(o) = old {
            o.free(self.primary.as_mut());
        }
        if let Some(f) = self.fallback.as_mut() {
            f.forget();
        }
        self.bufs =
            Some(Buffers::alloc(self.primary.as_mut(), &self.cfg, self.plan.act_dtype, want, old_cap.as_ref())?);
        Ok(())
    }

    /// Runs the model on a batch; `logits` receives `[logit_rows.len(), vocab]` in f32.
    pub fn forward(&mut self, b: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<()> {
        self.validate(b)?;
        let caches = self.layer_caches()?;
        let l = b.layout;
        let (t, r) = (b.tokens.len(), b.logit_rows.len());
        self.ensure_buffers(Capacity { tokens: t, rows: r, seqs: l.seqs.len(), max_blocks: l.max_blocks })?;
        let ModelRunner { cfg, plan, primary, fallback, ids, bufs, .. } = self;
        let bufs = bufs.as_ref().ok_or_else(|| Error::invalid("buffers", "activation buffers missing"))?;
        let views = bufs.step_views(t, l.seqs.len(), l.max_blocks, r);
        let host = StepHost {
            ids: b.tokens,
            positions: &l.positions,
            slots: &l.slots,
            seqs: &l.seqs,
            block_tables: &l.block_tables,
            logit_rows: b.logit_rows,
        };
        primary.set_step(&host, &views)?;
        let mut ex = Exec { primary: primary.as_mut(), cpu: fallback.as_mut() };
        let g = graph::Graph { c: cfg, plan, ids, bufs, caches: &caches, views: &views, layout: l, tokens: t, rows: r };
        let out = g.launch(&mut ex)?;
        primary.synchronize()?;
        logits.resize(r * cfg.vocab_size, 0.0);
        if r > 0 {
            primary.read_typed(out, logits)?;
        }
        Ok(())
    }
}

impl Drop for ModelRunner {
    fn drop(&mut self) {
        if let Some(b) = self.bufs.take() {
            b.free(self.primary.as_mut());
        }
        self.free_kv();
        if let Some(f) = self.fallback.as_mut() {
            f.forget();
        }
    }
}
