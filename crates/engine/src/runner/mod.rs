//! Layer-by-layer data flow of one forward pass: turns a step (tokens plus the KV manager's
//! layout) into the ops the plan chose, launched on the backend the plan put each slot on.
//! Owns the device-resident weights, the activation and step buffers and the KV pools; the
//! scheduler and KV manager above it decide what goes in a step.
//!
//! - `buffers`: activation and step-input buffers.
//! - `exec`: per-op placement (primary, or the CPU beside it with counted copies).
//! - `graph`: the op sequence of the decoder.
//! - `weights`: weights made resident per slot, converted where the plan says.
//! - `shard`, `tp`: a tensor-parallel rank's weights, collectives and commands.

mod buffers;
mod exec;
mod graph;
mod shard;
mod tp;
mod weights;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendExt, KvLayer, StepHost, View};
use crate::comm::{Communicator, LocalGroup};
use crate::kv::{KvPools, StepLayout};
use crate::model::{Model, ModelConfig, ModelWeights};
use crate::plan::{self, Placement, Plan, PlanOptions, Slot, TpReport};
use crate::{Error, Result};

pub use tp::OpenBackend;

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
    /// Every logits row is read only for its argmax (greedy sampling with no penalty, bias,
    /// logprobs or grammar). A tensor-parallel leader that gathers logits on the host then
    /// gathers each rank's best candidate of a row (8 bytes) instead of its vocabulary part;
    /// the other entries of the row are -inf.
    pub argmax_only: bool,
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
    /// The model's config (a tensor-parallel rank's own part is `local`).
    pub cfg: ModelConfig,
    /// What this rank holds: `cfg` itself, or its heads, intermediate part and vocabulary.
    local: ModelConfig,
    pub plan: Plan,
    primary: Box<dyn Backend>,
    /// The CPU backend beside a device, when the plan put any slot on it.
    fallback: Option<Fallback>,
    ids: WeightIds,
    bufs: Option<Buffers>,
    /// KV pools per layer, on the backend the layer's attention runs on.
    kv: Option<KvSet>,
    weight_bytes: usize,
    tp: Option<tp::TpLink>,
    /// A rank's logits before the all-gather, and after it.
    part: Vec<f32>,
    gathered: Vec<f32>,
    /// Bytes of logits the all-gathers brought to this rank (every rank's contribution).
    gathered_bytes: u64,
}

impl ModelRunner {
    /// Plans the model for `primary` (with a CPU beside it for the slots it cannot run, made
    /// with `cpu_threads`) and makes its weights resident.
    pub fn new(
        model: &Model,
        primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
    ) -> Result<ModelRunner> {
        Self::build(&model.config, &model.weights, primary, opts, cpu_threads, None)
    }

    /// Rank `comm.rank()` of a tensor-parallel group: plans and makes resident only its
    /// shard. Rank 0 (the leader) is driven like any runner and drives the others; the
    /// others run [`ModelRunner::follow`].
    pub fn new_rank(
        cfg: &ModelConfig,
        w: &ModelWeights,
        primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
        comm: Arc<dyn Communicator>,
    ) -> Result<ModelRunner> {
        Self::build(cfg, w, primary, opts, cpu_threads, Some(comm))
    }

    /// The leader of a `local` group of `world` ranks (threads of this process, each on a
    /// backend `open` makes) whose collectives wait at most `timeout`.
    pub fn new_local_group(
        model: &Model,
        primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
        world: usize,
        timeout: Duration,
        open: OpenBackend,
    ) -> Result<ModelRunner> {
        let comms = LocalGroup::new(world, timeout).into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
        Self::new_group(model, primary, opts, cpu_threads, comms, open)
    }

    /// The leader of a group whose ranks are threads of this process, `comms[r]` rank r's end
    /// (`local`, or the host side of `hccl`); each follower's backend is `open(r)`.
    pub fn new_group(
        model: &Model,
        primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
        mut comms: Vec<Arc<dyn Communicator>>,
        open: OpenBackend,
    ) -> Result<ModelRunner> {
        let followers = comms.split_off(1);
        let leader = comms.remove(0);
        let (cfg, w) = (&model.config, &model.weights);
        // The followers load while the leader does; a failure on either side reaches the
        // other through the group (a rank that left).
        let (handles, ended) = tp::spawn_followers(cfg, w, opts, cpu_threads, open, followers)?;
        let made = Self::build(cfg, w, primary, opts, cpu_threads, Some(leader.clone()));
        let mut runner = match made {
            Ok(r) => r,
            Err(e) => {
                leader.abandon(&e.to_string());
                return Err(e);
            }
        };
        if let Some(link) = runner.tp.as_mut() {
            link.followers = handles;
            link.ended = Some(ended);
        }
        Ok(runner)
    }

    /// Bytes of the weights rank `rank` of `world` holds (its shards and the replicated
    /// tensors), without loading anything onto a backend.
    pub fn shard_weight_bytes(cfg: &ModelConfig, w: &ModelWeights, world: usize, rank: usize) -> Result<usize> {
        let spec = plan::shard::decide(cfg, w, world, rank)?;
        Ok(shard::shard(cfg, w, &spec)?.1.total_bytes())
    }

    fn build(
        cfg: &ModelConfig,
        w: &ModelWeights,
        mut primary: Box<dyn Backend>,
        opts: &PlanOptions,
        cpu_threads: usize,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<ModelRunner> {
        // A file truncated since load fails here, before anything is read. Sharding,
        // converting and uploading then read the weights with `pread`, never from the file
        // maps (`Tensor::read_range`), so a truncation during the build is an error naming
        // the file and the tensor too, not a SIGBUS.
        for t in w.tensors() {
            t.check_source()?;
        }
        let (spec, local, lw) = match &comm {
            Some(c) => {
                let spec = plan::shard::decide(cfg, w, c.world(), c.rank())?;
                let (local, lw) = shard::shard(cfg, w, &spec)?;
                (Some(spec), local, Cow::Owned(lw))
            }
            None => (None, cfg.clone(), Cow::Borrowed(w)),
        };
        // A CPU primary has nothing to fall back to but itself.
        let mut cpu = if primary.name() == "cpu" { None } else { Some(CpuBackend::new(cpu_threads)?) };
        let mut plan = plan::build(&local, &lw, primary.as_ref(), cpu.as_ref().map(|c| c as &dyn Backend), opts)?;
        if !plan.uses_cpu_fallback() {
            cpu = None;
        }
        let tp = match (comm, spec) {
            (Some(comm), Some(spec)) => {
                let device = primary.device_collective().map(|d| d.collective_name());
                if device.is_none() && plan.act_dtype != tboost_ops::DType::F32 {
                    return Err(Error::Unsupported(format!(
                        "tensor parallelism on {} with {} activations: the host collectives take f32 (comm = hccl \
                         runs them on the device)",
                        primary.name(),
                        plan.act_dtype
                    )));
                }
                let even_vocab = spec.vocab_splits.iter().all(|r| r.len() == spec.vocab_max());
                let act_bytes = if device.is_some() { plan.act_dtype.block_bytes() } else { 4 };
                let fused = primary
                    .device_collective()
                    .map_or(Err(tboost_ops::Unsupported::new("backend", "none", "a device collective")), |d| {
                        d.fused_matmul_all_reduce()
                    });
                let mc2 = device.is_some() && fused.is_ok();
                let offer = plan::shard::CollectiveOffer { device, fused, act_bytes, even_vocab };
                let collectives =
                    plan::shard::collective_decisions(primary.name(), comm.name(), cfg, comm.world(), offer);
                let report = TpReport {
                    comm: comm.name().to_string(),
                    resident_weight_bytes: lw.total_bytes(),
                    model_weight_bytes: w.total_bytes(),
                    all_reduce_bytes_per_token: act_bytes * cfg.hidden_size * (1 + 2 * cfg.num_layers),
                    all_gather_bytes_per_row: 4 * spec.vocab_max(),
                    shard: spec.clone(),
                };
                log::info!(target: "tboost::plan", "{}", report.line());
                for d in &collectives {
                    log::info!(target: "tboost::plan", "model: {}", d.line());
                }
                plan.model.extend(collectives);
                plan.tp = Some(report);
                let (device_reduce, device_gather) = (device.is_some(), device.is_some() && even_vocab);
                Some(tp::TpLink { comm, spec, device_reduce, device_gather, mc2, followers: Vec::new(), ended: None })
            }
            _ => None,
        };
        let mut ids = WeightIds::upload(&plan, &lw, primary.as_mut(), cpu.as_mut())?;
        ids.embed_scale = plan::embed_scale(cfg, lw.embed.dtype);
        Ok(ModelRunner {
            weight_bytes: lw.total_bytes(),
            cfg: cfg.clone(),
            local,
            plan,
            primary,
            fallback: cpu.map(Fallback::new),
            ids,
            bufs: None,
            kv: None,
            tp,
            part: Vec::new(),
            gathered: Vec::new(),
            gathered_bytes: 0,
        })
    }

    /// Sends `cmd` to the followers when this runner leads a group; a follower refuses to
    /// be driven by anyone but its leader.
    fn lead(&self, cmd: impl FnOnce() -> tp::Cmd) -> Result<()> {
        match &self.tp {
            Some(t) if t.comm.rank() == 0 => t.send(&cmd()),
            Some(t) => Err(Error::invalid(
                "rank",
                format!("rank {} is a tensor-parallel follower: only the leader (rank 0) takes work", t.comm.rank()),
            )),
            None => Ok(()),
        }
    }

    /// This runner's rank when it is a tensor-parallel follower (rank > 0).
    pub fn follower_rank(&self) -> Option<usize> {
        self.tp.as_ref().map(|t| t.comm.rank()).filter(|&r| r != 0)
    }

    /// A follower's loop: runs every command the leader broadcasts until it says stop. An
    /// error (a failed step, a collective that timed out) ends it.
    pub fn follow(&mut self) -> Result<()> {
        let comm = match &self.tp {
            Some(t) if t.comm.rank() != 0 => t.comm.clone(),
            _ => return Err(Error::invalid("rank", "only a tensor-parallel follower (rank > 0) follows")),
        };
        let mut logits = Vec::new();
        loop {
            let mut bytes = Vec::new();
            comm.broadcast(0, &mut bytes)?;
            match tp::Cmd::decode(&bytes)? {
                tp::Cmd::Stop => return Ok(()),
                tp::Cmd::AllocKv { blocks, block_size } => self.alloc_kv_local(blocks, block_size)?,
                tp::Cmd::Reserve { tokens, rows, seqs, max_blocks } => {
                    self.ensure_buffers(Capacity { tokens, rows, seqs, max_blocks })?
                }
                tp::Cmd::Forward { tokens, layout, logit_rows, argmax_only } => {
                    let b = StepBatch { tokens: &tokens, layout: &layout, logit_rows: &logit_rows, argmax_only };
                    self.validate(&b)?;
                    self.forward_local(&b, &mut logits)?;
                }
            }
        }
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
    /// Bytes of logits the all-gathers brought to this rank so far (0 without tensor
    /// parallelism, or with the all-gather on the device).
    pub fn gathered_logit_bytes(&self) -> u64 {
        self.gathered_bytes
    }

    pub fn fallback_copied_bytes(&self) -> u64 {
        self.fallback.as_ref().map_or(0, |f| f.copied)
    }

    /// Allocates the KV pools (replacing any previous ones) in the plan's KV dtype, each
    /// layer's on the backend its attention runs on.
    pub fn alloc_kv(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        self.lead(|| tp::Cmd::AllocKv { blocks: num_blocks, block_size })?;
        self.alloc_kv_local(num_blocks, block_size)
    }

    fn alloc_kv_local(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
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
            true => Some(KvPools::new(self.primary.as_mut(), &self.local, num_blocks, block_size, dtype)?),
            false => None,
        };
        let cpu = match (&mut self.fallback, wants(Placement::Cpu)) {
            (Some(f), true) => match KvPools::new(&mut f.be, &self.local, num_blocks, block_size, dtype) {
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

    /// Device bytes of the primary backend's weights per model dtype (see
    /// [`Backend::weight_bytes_by_dtype`]); empty for a backend that does not count them.
    pub fn device_weight_bytes(&self) -> Vec<(tboost_ops::DType, usize)> {
        self.primary.weight_bytes_by_dtype()
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
        self.lead(|| tp::Cmd::Reserve { tokens, rows, seqs, max_blocks })?;
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
            Some(Buffers::alloc(self.primary.as_mut(), &self.local, self.plan.act_dtype, want, old_cap.as_ref())?);
        Ok(())
    }

    /// Runs the model on a batch; `logits` receives `[logit_rows.len(), vocab]` in f32. The
    /// leader of a tensor-parallel group sends the batch to every rank first.
    pub fn forward(&mut self, b: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<()> {
        self.validate(b)?;
        self.lead(|| tp::Cmd::Forward {
            tokens: b.tokens.to_vec(),
            layout: b.layout.clone(),
            logit_rows: b.logit_rows.to_vec(),
            argmax_only: b.argmax_only,
        })?;
        self.forward_local(b, logits).map_err(|e| self.with_departed_cause(e))
    }

    /// A leader's failed step, with the cause of a rank that left the group first: a device
    /// error on a follower surfaces on the leader as a collective that timed out, while the
    /// follower has already left with the real cause (the op, its device and status).
    fn with_departed_cause(&self, e: Error) -> Error {
        let Some(link) = self.tp.as_ref() else { return e };
        // The follower leaves as soon as its launch fails, long before the leader's timeout;
        // a short wait covers a failure found at the same moment on both sides.
        let until = std::time::Instant::now() + Duration::from_millis(200);
        loop {
            if let Some((rank, why)) = link.comm.departed() {
                let text = e.to_string();
                return if text.contains(&why) { e } else { e.with_note(&format!("; rank {rank} had failed: {why}")) };
            }
            if std::time::Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// This rank's part of a forward pass (the whole pass without tensor parallelism).
    fn forward_local(&mut self, b: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<()> {
        let caches = self.layer_caches()?;
        let l = b.layout;
        let (t, r) = (b.tokens.len(), b.logit_rows.len());
        self.ensure_buffers(Capacity { tokens: t, rows: r, seqs: l.seqs.len(), max_blocks: l.max_blocks })?;
        let ModelRunner { cfg, local, plan, primary, fallback, ids, bufs, tp, part, gathered, gathered_bytes, .. } =
            self;
        let bufs = bufs.as_ref().ok_or_else(|| Error::invalid("buffers", "activation buffers missing"))?;
        let views = bufs.step_views(t, l.seqs.len(), l.max_blocks, r);
        // A rank embeds the tokens of its vocabulary part; the others read its row 0 and are
        // zeroed before the all-reduce.
        let (local_ids, held): (Cow<'_, [u32]>, Vec<bool>) = match tp {
            Some(link) => {
                let v = link.spec.vocab();
                let held: Vec<bool> = b.tokens.iter().map(|&id| v.contains(&(id as usize))).collect();
                let ids = b.tokens.iter().zip(&held).map(|(&id, &h)| if h { id - v.start as u32 } else { 0 }).collect();
                (Cow::Owned(ids), held)
            }
            None => (Cow::Borrowed(b.tokens), Vec::new()),
        };
        let host = StepHost {
            ids: &local_ids,
            positions: &l.positions,
            slots: &l.slots,
            seqs: &l.seqs,
            block_tables: &l.block_tables,
            logit_rows: b.logit_rows,
        };
        primary.set_step(&host, &views)?;
        let mut ex = Exec { primary: primary.as_mut(), cpu: fallback.as_mut() };
        let step_comm = tp.as_ref().map(|link| tp::StepComm {
            comm: link.comm.as_ref(),
            held: &held,
            device: link.device_reduce,
            // MC2 in prefill steps only (its doc: incremental steps do not use it).
            mc2: link.mc2 && t > l.seqs.len(),
        });
        let g = graph::Graph {
            c: local,
            plan,
            ids,
            bufs,
            caches: &caches,
            views: &views,
            layout: l,
            tokens: t,
            rows: r,
            tp: step_comm,
        };
        let out = g.launch(&mut ex)?;
        // With device collectives, every rank's logits are gathered on the device before the
        // one synchronize of the step.
        let (vloc, vmax) = (local.vocab_size, tp.as_ref().map_or(0, |l| l.spec.vocab_max()));
        let dev_gather = match tp.as_ref() {
            Some(link) if link.device_gather && r > 0 => {
                let len = link.spec.world * r * vmax;
                let buf = primary.alloc(tboost_ops::DType::F32, len)?;
                let dst = View::new(buf, 0, len);
                let rank = link.comm.rank();
                let queued = match primary.device_collective() {
                    Some(dc) => dc.all_gather(out, dst),
                    None => Err(crate::comm::error(rank, "all_gather", "the backend lost its device collective")),
                };
                if let Err(e) = queued {
                    let _ = primary.synchronize();
                    primary.free(buf);
                    return Err(crate::comm::error(rank, "all_gather (hccl)", e.to_string()));
                }
                Some(dst)
            }
            _ => None,
        };
        if let Err(e) = primary.synchronize() {
            if let Some(d) = dev_gather {
                primary.free(d.buf);
            }
            return Err(match tp.as_ref() {
                // a failed or timed-out HCCL collective surfaces here, at the stream's synchronize
                Some(link) if link.device_reduce => {
                    crate::comm::error(link.comm.rank(), "hccl collective", e.to_string())
                }
                _ => e,
            });
        }
        let Some(link) = tp else {
            logits.resize(r * cfg.vocab_size, 0.0);
            if r > 0 {
                primary.read_typed(out, logits)?;
            }
            return Ok(());
        };
        let world = link.spec.world;
        if let Some(d) = dev_gather {
            gathered.resize(world * r * vmax, 0.0);
            let read = primary.read_typed(d, gathered);
            primary.free(d.buf);
            read?;
        } else if b.argmax_only && cfg.vocab_size <= MAX_EXACT_INDEX {
            self::host_argmax_gather(link, primary.as_mut(), out, r, vloc, part, gathered)?;
            *gathered_bytes += (gathered.len() * 4) as u64;
            // Each rank's best (value, index) of each row; the rest of the row stays -inf,
            // so a row's argmax (first index of the largest) is the whole row's.
            logits.clear();
            logits.resize(r * cfg.vocab_size, f32::NEG_INFINITY);
            for (k, range) in link.spec.vocab_splits.iter().enumerate() {
                for row in 0..r {
                    let (value, index) = (gathered[(k * r + row) * 2], gathered[(k * r + row) * 2 + 1] as usize);
                    if value > f32::NEG_INFINITY && index < range.len() {
                        logits[row * cfg.vocab_size + range.start + index] = value;
                    }
                }
            }
            return Ok(());
        } else {
            self::host_gather(link, primary.as_mut(), out, r, vloc, part, gathered)?;
        }
        *gathered_bytes += (gathered.len() * 4) as u64;
        logits.resize(r * cfg.vocab_size, 0.0);
        for (k, range) in link.spec.vocab_splits.iter().enumerate() {
            for row in 0..r {
                let src = &gathered[(k * r + row) * vmax..][..range.len()];
                logits[row * cfg.vocab_size + range.start..][..range.len()].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// This rank's logits, `r` rows of its `vloc` vocabulary entries, into `part`.
fn read_part(primary: &mut dyn Backend, out: View, r: usize, vloc: usize, part: &mut Vec<f32>) -> Result<()> {
    part.resize(r * vloc, 0.0);
    if r > 0 {
        primary.read_typed(out, part)?;
    }
    Ok(())
}

/// Token indices travel as f32 in the argmax gather: exact up to 2^24.
const MAX_EXACT_INDEX: usize = 1 << 24;

/// The argmax gather through the host: each rank's best finite logit of every row and its
/// index in the rank's part, as `[value, index]` pairs (`-inf, 0` for a row with none). The
/// first of equal values wins, as in the sampler's argmax; NaN and +inf count as -inf.
fn host_argmax_gather(
    link: &tp::TpLink,
    primary: &mut dyn Backend,
    out: View,
    r: usize,
    vloc: usize,
    part: &mut Vec<f32>,
    gathered: &mut Vec<f32>,
) -> Result<()> {
    read_part(primary, out, r, vloc, part)?;
    let mut best = Vec::with_capacity(2 * r);
    for row in part.chunks(vloc.max(1)).take(r) {
        let (mut value, mut index) = (f32::NEG_INFINITY, 0usize);
        for (i, &x) in row.iter().enumerate() {
            if x > value && x.is_finite() {
                (value, index) = (x, i);
            }
        }
        best.extend([value, index as f32]);
    }
    gathered.resize(link.spec.world * 2 * r, 0.0);
    link.comm.all_gather(&best, gathered)
}

/// The logits all-gather through the host: every rank's vocabulary part of every row, padded to
/// the longest part.
fn host_gather(
    link: &tp::TpLink,
    primary: &mut dyn Backend,
    out: View,
    r: usize,
    vloc: usize,
    part: &mut Vec<f32>,
    gathered: &mut Vec<f32>,
) -> Result<()> {
    let (vmax, world) = (link.spec.vocab_max(), link.spec.world);
    read_part(primary, out, r, vloc, part)?;
    let mut padded = vec![0f32; r * vmax];
    for (dst, src) in padded.chunks_mut(vmax).zip(part.chunks(vloc.max(1))) {
        dst[..vloc].copy_from_slice(src);
    }
    gathered.resize(world * r * vmax, 0.0);
    link.comm.all_gather(&padded, gathered)
}

impl Drop for ModelRunner {
    fn drop(&mut self) {
        if let Some(link) = self.tp.as_mut() {
            link.stop();
        }
        if let Some(b) = self.bufs.take() {
            b.free(self.primary.as_mut());
        }
        self.free_kv();
        if let Some(f) = self.fallback.as_mut() {
            f.forget();
        }
    }
}
