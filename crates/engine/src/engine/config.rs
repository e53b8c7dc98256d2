//! What an engine is configured with, and its validation.

use std::collections::BTreeSet;

use tboost_ops::{check_tile_kv, DType, MatMulTiling, MoeTiling, Tiling, Tunable};

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{self, Backend, BackendKind, BackendOptions, BackendSpec};
use crate::comm::{CommKind, Communicator};
use crate::model::Model;
use crate::plan::{PlanOptions, PrecisionPolicy};
use crate::runner::{ModelRunner, OpenBackend};
use crate::{Error, Result};

/// How much memory the KV cache gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSize {
    Bytes(usize),
    Blocks(usize),
    /// Room for this many tokens (rounded up to whole blocks).
    Tokens(usize),
}

/// Where a large model file's weights live once a CPU backend reads them in place.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPages {
    /// Copied into huge pages (when the kernel offers transparent huge pages).
    #[default]
    Huge,
    /// Stored weights stay in the file map (processes share one page-cache copy), repacked
    /// ones go into 4 KiB pages.
    Small,
}

/// An engine's options. Every field is a key of the configuration table (`engine::keys`),
/// which sets it by name; `default()` is the built-in defaults, `from_env()` those with the
/// environment's `TBOOST_*` defaults applied.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where ops run (`auto`: a device backend when its runtime loads, else the CPU).
    pub backend: BackendKind,
    /// CPU compute threads (0 = one per core); also the CPU beside a device backend.
    pub threads: usize,
    pub kv_size: KvSize,
    /// Tokens per KV block; `None` = what the backend's attention prefers (16 on the CPU).
    pub block_size: Option<usize>,
    /// KV cache element type; `None` = the backend's first choice (f32 on the CPU).
    pub kv_dtype: Option<DType>,
    /// Matmul activation precision (`Fast` only where the backend has it per weight type;
    /// `Auto`: fast for GGUF block-quantized weights, exact for float ones).
    pub precision: PrecisionPolicy,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Most tokens computed in one step (decodes + prefill chunks).
    pub max_batched_tokens: usize,
    pub prefix_caching: bool,
    /// Most requests waiting to start; `enqueue` fails beyond it.
    pub queue_limit: usize,
    /// Finished requests whose records `output` and `cancel` still answer for (oldest
    /// forgotten first). Every result is also in the step's events, so a host that reads
    /// events loses nothing however small this is.
    pub finished_records: usize,
    /// Ops and fusions to forbid (plan names; `TBOOST_DISABLE` is the default).
    pub disabled_ops: BTreeSet<String>,
    /// FlashAttention's KV tile in the attention slots (`tiling.attention.tile_kv`: 16, 32,
    /// 64, 128 or 256); `None` = 64. The plan reports it and refuses a non-default tile on a
    /// backend whose attention kernel tiles itself.
    pub attention_tile_kv: Option<usize>,
    /// The CPU matmul kernels' work split in every matmul slot (`tiling.matmul.*`: panel_rows,
    /// act_rows, tasks_per_thread, decode_task_min_bytes); unset = the op's default. The plan
    /// reports it and refuses it on a backend whose kernels tile themselves.
    pub matmul_tiling: MatMulTiling,
    /// The CPU grouped MoE's expert batching (`tiling.moe.*`: expert_batch_tokens,
    /// parallel_expert_batches), reported and refused likewise.
    pub moe_tiling: MoeTiling,
    /// Pin each CPU compute thread to its own CPU (`pin_threads`, `TBOOST_PIN_THREADS`).
    pub pin_threads: bool,
    /// Log the time per op type when the backend closes (`profile`, `TBOOST_PROFILE`).
    pub profile: bool,
    /// `weight_pages` (`TBOOST_WEIGHT_PAGES`).
    pub weight_pages: WeightPages,
    /// CANN op versions the Ascend backend refuses beside its built-in table
    /// (`ascend_known_bad`, `TBOOST_ASCEND_KNOWN_BAD`: `op@from..until` items separated by `;`).
    pub ascend_known_bad: String,
    /// Tensor-parallel ranks (`tp`); 1 = the whole model on one backend.
    pub tp: usize,
    /// This process's rank and the group's size (`rank`, `world`), when the host states them:
    /// checked against MPI_COMM_WORLD under `comm` = mpi, against 0 and `tp` otherwise.
    pub rank: Option<usize>,
    pub world: Option<usize>,
    /// How the ranks talk (`comm`).
    pub comm: crate::comm::CommKind,
    /// A collective's longest wait for the other ranks (`comm_timeout_ms`).
    pub comm_timeout_ms: u64,
    /// The Ascend devices of the ranks with `comm` = hccl (`devices`: `ascend:0,1`; empty: the
    /// backend's device and the next `tp - 1`).
    pub devices: String,
    /// Prompt-lookup speculative decoding (`spec_ngram`): requests propose up to this
    /// many tokens a step from an earlier occurrence of their last tokens, verified in one
    /// chunk; 0 = off.
    pub spec_ngram: usize,
    /// Speculative decoding with a draft model (`spec_draft_model`): a model file or
    /// directory sharing the target's vocabulary; empty = off.
    pub spec_draft_model: String,
    /// Tokens the draft model proposes a step, at most (`spec_draft_tokens`).
    pub spec_draft_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            threads: 0,
            kv_size: KvSize::Bytes(512 << 20),
            block_size: None,
            kv_dtype: None,
            precision: PrecisionPolicy::Auto,
            max_seqs: 64,
            max_batched_tokens: 512,
            prefix_caching: true,
            queue_limit: 4096,
            finished_records: 65536,
            disabled_ops: BTreeSet::new(),
            attention_tile_kv: None,
            matmul_tiling: MatMulTiling::default(),
            moe_tiling: MoeTiling::default(),
            pin_threads: false,
            profile: false,
            weight_pages: WeightPages::Huge,
            ascend_known_bad: String::new(),
            tp: 1,
            rank: None,
            world: None,
            spec_ngram: 0,
            spec_draft_model: String::new(),
            spec_draft_tokens: 4,
            comm: CommKind::Local,
            comm_timeout_ms: 60_000,
            devices: String::new(),
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |p: &str, m: String| Err(Error::invalid(p, m));
        if let Some(bs) = self.block_size.filter(|&b| b == 0 || b > 1024) {
            return bad("block_size", format!("{bs} is not in 1..=1024"));
        }
        if self.max_seqs == 0 {
            return bad("max_seqs", "must be at least 1".into());
        }
        if self.max_batched_tokens < self.max_seqs {
            return bad(
                "max_batched_tokens",
                format!(
                    "{} is below max_seqs {}: every running decode must fit in a step",
                    self.max_batched_tokens, self.max_seqs
                ),
            );
        }
        let cap = crate::formats::limits::MAX_BATCH_TOKENS;
        if self.max_batched_tokens > cap {
            return bad(
                "max_batched_tokens",
                format!("{} is above the {cap} every shape bound is derived from", self.max_batched_tokens),
            );
        }
        if self.tp == 0 {
            return bad("tp", "must be at least 1".into());
        }
        if self.queue_limit == 0 {
            return bad("queue_limit", "must be at least 1".into());
        }
        if let Some(d) = self.kv_dtype {
            if !d.is_float() && d != DType::Q8_0 {
                return bad("kv_dtype", format!("{d} is not one of f32, f16, bf16, q8_0"));
            }
        }
        match self.kv_size {
            KvSize::Blocks(0) | KvSize::Bytes(0) | KvSize::Tokens(0) => {
                bad("kv_cache", "the KV cache cannot be empty".into())
            }
            _ => Ok(()),
        }
    }

    /// The plan options this config asks for on `be`.
    pub fn plan_options(&self, be: &dyn Backend) -> Result<PlanOptions> {
        Ok(PlanOptions {
            disabled: self.disabled_ops.clone(),
            kv_dtype: self.kv_dtype,
            act_dtype: None,
            precision: self.precision,
            block_size: self.block_size.unwrap_or_else(|| be.preferred_block_size()),
            tile_kv: self.attention_tile_kv,
            matmul_tiling: self.matmul_tiling,
            moe_tiling: self.moe_tiling,
        })
    }

    /// The backend options of this config (pinning, profiling, weight pages, Ascend's
    /// known-bad versions).
    pub fn backend_options(&self) -> BackendOptions {
        BackendOptions {
            pin_threads: self.pin_threads,
            profile: self.profile,
            small_weight_pages: self.weight_pages == WeightPages::Small,
            ascend_known_bad: self.ascend_known_bad.clone(),
        }
    }

    /// Opens the backend this config names, with its options. With `tp` ranks in this
    /// process, each rank's backend gets its share of the threads.
    pub fn open_backend(&self) -> Result<Box<dyn Backend>> {
        let kind = match (self.backend, self.hccl_process()) {
            // one process per device: this process's device, not rank 0's
            (BackendKind::Ascend { device }, Some((local, local_ranks))) => {
                let devices = crate::comm::hccl::parse_devices(&self.devices, local_ranks, device)?;
                BackendKind::Ascend { device: devices[local] }
            }
            (kind, _) => kind,
        };
        backend::open_with(BackendSpec { kind, threads: self.rank_threads() }, &self.backend_options())
    }

    /// Under `mpirun` with `comm` = hccl, every process is one rank on one device: this
    /// process's (local rank, ranks on this node).
    fn hccl_process(&self) -> Option<(usize, usize)> {
        (self.comm == CommKind::Hccl).then(crate::comm::mpi::launched_locally).flatten()
    }

    /// Plans `model` on `be` and makes its weights resident: the whole model, or with `tp`
    /// ranks the leader's shard (its `local` followers started beside it), or under `comm`
    /// mpi this process's rank.
    pub fn runner(&self, model: &Model, be: Box<dyn Backend>, opts: &PlanOptions) -> Result<ModelRunner> {
        let timeout = Duration::from_millis(self.comm_timeout_ms);
        if self.hccl_process().is_some() {
            return self.hccl_process_runner(model, be, opts, timeout);
        }
        if self.comm != CommKind::Mpi {
            // The ranks are threads of this process, which the host drives as rank 0 of `tp`.
            let why = format!("with comm = {} the ranks are threads of this process: it is", self.comm.name());
            self.check_rank_world(0, self.tp, &why)?;
        }
        match (self.comm, self.tp) {
            (CommKind::Mpi, _) => {
                let comm = self.join_mpi(timeout)?;
                ModelRunner::new_rank(&model.config, &model.weights, be, opts, self.threads, Arc::new(comm))
            }
            (CommKind::Local | CommKind::Hccl, 1) => ModelRunner::new(model, be, opts, self.threads),
            (CommKind::Hccl, world) => self.hccl_runner(model, be, opts, world, timeout),
            (CommKind::Local, world) => {
                let c = self.clone();
                let open: OpenBackend = Arc::new(move |_| c.open_backend());
                ModelRunner::new_local_group(model, be, opts, self.rank_threads(), world, timeout, open)
            }
        }
    }

    /// This process's rank of `MPI_COMM_WORLD`, checked against `tp`, `rank` and `world`.
    fn join_mpi(&self, timeout: Duration) -> Result<crate::comm::mpi::MpiComm> {
        let comm = crate::comm::mpi::MpiComm::join_world(timeout)?;
        if self.tp > 1 && self.tp != comm.world() {
            return Err(Error::invalid(
                "tp",
                format!("tp = {} but mpirun started {} ranks (leave tp unset under mpirun)", self.tp, comm.world()),
            ));
        }
        self.check_rank_world(comm.rank(), comm.world(), "MPI_COMM_WORLD says")?;
        Ok(comm)
    }

    /// One rank of an `hccl` group whose ranks are the processes `mpirun` started, each on its
    /// own device (the backend's, see `open_backend`): rank 0 makes the HCCL root info, MPI
    /// carries it to the others, and every rank joins with `HcclCommInitRootInfo`. The step
    /// commands go over MPI, the activations over HCCL.
    #[cfg(feature = "ascend")]
    fn hccl_process_runner(
        &self,
        model: &Model,
        mut be: Box<dyn Backend>,
        opts: &PlanOptions,
        timeout: Duration,
    ) -> Result<ModelRunner> {
        if be.name() != "ascend" {
            return Err(Error::invalid(
                "comm",
                format!("comm = hccl needs backend = ascend (this rank's backend is {})", be.name()),
            ));
        }
        let comm = self.join_mpi(timeout)?;
        let (rank, world) = (comm.rank(), comm.world());
        // Rank 0 sends an empty root info when it could not make one, so the others fail now
        // instead of at HCCL_CONNECT_TIMEOUT.
        let mut root = Vec::new();
        let made = if rank == 0 { be.hccl_root_info().map(|r| root = r) } else { Ok(()) };
        comm.broadcast(0, &mut root)?;
        made?;
        if root.is_empty() {
            return Err(Error::Comm {
                rank,
                op: "HcclCommInitRootInfo".into(),
                msg: "rank 0 could not make the HCCL root info (its log says why)".into(),
            });
        }
        be.join_hccl(&root, world, rank)?;
        let ctl: Arc<dyn Communicator> = Arc::new(crate::comm::hccl::HcclControl(comm));
        ModelRunner::new_rank(&model.config, &model.weights, be, opts, self.threads, ctl)
    }

    #[cfg(not(feature = "ascend"))]
    fn hccl_process_runner(&self, _: &Model, _: Box<dyn Backend>, _: &PlanOptions, _: Duration) -> Result<ModelRunner> {
        Err(Error::Unsupported("comm = hccl needs the `ascend` feature".into()))
    }

    /// The stated `rank` and `world` (if any) against the ones the group has.
    fn check_rank_world(&self, rank: usize, world: usize, source: &str) -> Result<()> {
        if let Some(r) = self.rank.filter(|&r| r != rank) {
            return Err(Error::invalid(
                "rank",
                format!("rank = {r}, but {source} rank {rank} (leave rank unset: auto)"),
            ));
        }
        if let Some(w) = self.world.filter(|&w| w != world) {
            return Err(Error::invalid(
                "world",
                format!("world = {w}, but {source} {world} ranks (leave world unset: auto)"),
            ));
        }
        Ok(())
    }

    /// The leader of an `hccl` group of `world` ranks: threads of this process, rank i on the
    /// i-th of `devices`, with HCCL communicators from `HcclCommInitAll` for the data plane.
    #[cfg(feature = "ascend")]
    fn hccl_runner(
        &self,
        model: &Model,
        mut be: Box<dyn Backend>,
        opts: &PlanOptions,
        world: usize,
        timeout: Duration,
    ) -> Result<ModelRunner> {
        let first = match self.backend {
            BackendKind::Ascend { device } => device,
            _ if be.name() == "ascend" => 0,
            _ => {
                return Err(Error::invalid(
                    "comm",
                    format!("comm = hccl needs backend = ascend (the leader's backend is {})", be.name()),
                ))
            }
        };
        let devices = crate::comm::hccl::parse_devices(&self.devices, world, first)?;
        if devices[0] != first {
            return Err(Error::invalid(
                "devices",
                format!("rank 0 is the backend's device {first}, but `devices` puts it on {}", devices[0]),
            ));
        }
        let (ctl, mut dev_comms) = crate::comm::hccl::open_group(&devices, timeout)?;
        be.attach_hccl(dev_comms.remove(0))?;
        let rest: std::sync::Mutex<Vec<Option<ascend_sys::HcclComm>>> =
            std::sync::Mutex::new(dev_comms.into_iter().map(Some).collect());
        let c = self.clone();
        let open: OpenBackend = Arc::new(move |rank: usize| {
            let comm = rest.lock().unwrap_or_else(|p| p.into_inner()).get_mut(rank - 1).and_then(Option::take);
            let comm = comm.ok_or_else(|| Error::invalid("tp", format!("no HCCL communicator for rank {rank}")))?;
            let spec = BackendSpec { kind: BackendKind::Ascend { device: devices[rank] }, threads: c.rank_threads() };
            let mut be = backend::open_with(spec, &c.backend_options())?;
            be.attach_hccl(comm)?;
            Ok(be)
        });
        let comms: Vec<Arc<dyn Communicator>> = ctl.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
        ModelRunner::new_group(model, be, opts, self.rank_threads(), comms, open)
    }

    #[cfg(not(feature = "ascend"))]
    fn hccl_runner(
        &self,
        _: &Model,
        _: Box<dyn Backend>,
        _: &PlanOptions,
        _: usize,
        _: Duration,
    ) -> Result<ModelRunner> {
        Err(Error::Unsupported("comm = hccl needs the `ascend` feature".into()))
    }

    /// CPU threads of one rank: `threads` (0: one per core) shared by the `tp` ranks.
    pub fn rank_threads(&self) -> usize {
        if self.tp <= 1 || self.comm == CommKind::Mpi || self.hccl_process().is_some() {
            return self.threads;
        }
        let total = match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        (total / self.tp).max(1)
    }
}

/// The tiling keys `tiling.matmul.<name>` and `tiling.moe.<name>` with their tunables (the
/// engine config, the C ABI's config keys and the CLI's `--tiling` take them).
pub fn tiling_keys() -> Vec<(String, Tunable)> {
    fn of<T: Tiling>() -> impl Iterator<Item = (String, Tunable)> {
        T::TUNABLES.iter().map(|t| (format!("tiling.{}.{}", T::GROUP, t.name), *t))
    }
    of::<MatMulTiling>().chain(of::<MoeTiling>()).collect()
}

impl EngineConfig {
    /// Every matmul and MoE tiling key with its value (`None`: the op's default).
    pub fn tiling_settings(&self) -> Vec<(String, Option<usize>)> {
        fn of<T: Tiling>(t: &T) -> impl Iterator<Item = (String, Option<usize>)> {
            T::TUNABLES.iter().zip(t.values()).map(|(u, v)| (format!("tiling.{}.{}", T::GROUP, u.name), v))
        }
        of(&self.matmul_tiling).chain(of(&self.moe_tiling)).collect()
    }

    /// Sets tiling key `key` (`tiling.matmul.panel_rows`, `tiling.moe.expert_batch_tokens`,
    /// `tiling.attention.tile_kv`, ...) to `value`. An unknown key, or a value outside the
    /// tunable's range, is an error naming the key and the accepted values; nothing changes then.
    pub fn set_tiling(&mut self, key: &str, value: usize) -> Result<()> {
        let (group, name) = key.strip_prefix("tiling.").and_then(|k| k.split_once('.')).unwrap_or(("", key));
        let answer = match group {
            "matmul" => self.matmul_tiling.set(name, value),
            "moe" => self.moe_tiling.set(name, value),
            "attention" if name == "tile_kv" => check_tile_kv(value).map(|()| self.attention_tile_kv = Some(value)),
            _ => {
                let mut known: Vec<String> = tiling_keys().into_iter().map(|(k, _)| k).collect();
                known.insert(0, "tiling.attention.tile_kv".into());
                return Err(Error::invalid("tiling", format!("unknown key `{key}`; known: {}", known.join(", "))));
            }
        };
        answer.map_err(|u| Error::invalid(key, u.to_string()))
    }
}

/// Parses a KV cache dtype name (`auto` = the backend's choice).
pub fn parse_kv_dtype(s: &str) -> Result<Option<DType>> {
    match s {
        "auto" => Ok(None),
        "f32" => Ok(Some(DType::F32)),
        "f16" => Ok(Some(DType::F16)),
        "bf16" => Ok(Some(DType::BF16)),
        "q8_0" => Ok(Some(DType::Q8_0)),
        other => Err(Error::invalid("kv_dtype", format!("`{other}` is not one of auto, f32, f16, bf16, q8_0"))),
    }
}

/// Parses a precision name.
pub fn parse_precision(s: &str) -> Result<PrecisionPolicy> {
    PrecisionPolicy::parse(s)
        .ok_or_else(|| Error::invalid("precision", format!("`{s}` is not one of {}", PrecisionPolicy::NAMES)))
}
