//! `tboost_config`: engine and model options set by string keys, so a new option never
//! changes the ABI. The keys, their types, ranges, defaults and environment variables are
//! the engine crate's table (`tboost_engine::engine::keys`); this module only stores a config
//! per handle and maps errors to status codes.

use std::os::raw::c_char;
use std::sync::{Arc, Mutex};

use super::guard::guard;
use super::handle::Registry;
use super::log_bridge::ensure_logger;
use super::status::{tboost_status, FfiResult};
use super::types::tboost_config;
use super::util::{read_cstr, require, write_out, write_str};
use ::tboost_engine::engine::keys::Raw;
use ::tboost_engine::engine::{EngineConfig, StepFaults};

/// What a config holds: the engine's settings, and in a `fault-injection` build the faults
/// its engines' steps inject.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub engine: EngineConfig,
    pub faults: StepFaults,
}

impl Settings {
    /// The defaults: the table's, with the environment's `TBOOST_*` values applied.
    pub fn from_env() -> FfiResult<Settings> {
        Ok(Settings { engine: EngineConfig::from_env()?, faults: StepFaults::default() })
    }

    fn set(&mut self, key: &str, raw: Raw<'_>) -> FfiResult {
        #[cfg(feature = "fault-injection")]
        if let Some(done) = fault_key(&mut self.faults, key, raw) {
            return done;
        }
        Ok(self.engine.set(key, raw)?)
    }
}

/// The testing-only keys of a `fault-injection` build (`None`: not one of them).
#[cfg(feature = "fault-injection")]
fn fault_key(f: &mut StepFaults, key: &str, raw: Raw<'_>) -> Option<FfiResult> {
    use super::status::Failure;
    let max = match key {
        "test.panic_at_step" => i64::MAX,
        "test.step_delay_ms" => 60_000,
        _ => return None,
    };
    let v = match raw {
        Raw::Int(v) => Some(v),
        Raw::Str(s) => s.trim().parse::<i64>().ok(),
    };
    Some(match v {
        Some(v) if (0..=max).contains(&v) => {
            if key == "test.panic_at_step" {
                f.panic_at_step = v as u64;
            } else {
                f.step_delay = std::time::Duration::from_millis(v as u64);
            }
            Ok(())
        }
        _ => Err(Failure::invalid(format!("`{key}` takes an integer in [0, {max}]"))),
    })
}

pub(crate) struct ConfigInner {
    pub settings: Mutex<Settings>,
}

impl ConfigInner {
    pub fn snapshot(&self) -> Settings {
        self.settings.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

pub(crate) static CONFIGS: Registry<ConfigInner> = Registry::new("config");

/// The settings behind an optional config handle (NULL = the defaults).
pub(crate) fn settings_of(cfg: *const tboost_config) -> FfiResult<Settings> {
    if cfg.is_null() {
        Settings::from_env()
    } else {
        Ok(CONFIGS.get(cfg, "cfg")?.snapshot())
    }
}

fn set(cfg: *mut tboost_config, key: &str, raw: Raw<'_>) -> FfiResult {
    let c = CONFIGS.get(cfg, "cfg")?;
    let mut s = c.settings.lock().unwrap_or_else(|e| e.into_inner());
    // `set` applies a value fully or not at all: a rejected one leaves the config unchanged.
    s.set(key, raw)
}

/// Creates a config with every default: each key's own, or the value of its environment
/// variable when that is set (see `tboost_config_set_int` / `_set_str`); an invalid
/// environment value is `TBOOST_ERR_INVALID_ARGUMENT` naming the variable. Free it with
/// `tboost_config_free`; models and engines copy what they need, so it may be freed right
/// after use.
#[no_mangle]
pub unsafe extern "C" fn tboost_config_new(out: *mut *mut tboost_config) -> tboost_status {
    guard("tboost_config_new", |_| {
        require(out, "out")?;
        ensure_logger();
        let settings = Settings::from_env()?;
        let h = CONFIGS.insert(Arc::new(ConfigInner { settings: Mutex::new(settings) }));
        // SAFETY: `out` is non-null and valid per the contract.
        unsafe { write_out(out, h) };
        Ok(())
    })
}

/// Frees a config. NULL is a no-op; a freed or unknown handle is `TBOOST_ERR_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn tboost_config_free(cfg: *mut tboost_config) -> tboost_status {
    guard("tboost_config_free", |_| {
        if !cfg.is_null() {
            CONFIGS.remove(cfg, "cfg")?;
        }
        Ok(())
    })
}

/// Sets an integer or flag option. Keys (range in brackets); each key's default is the one
/// given, or the value of its environment variable when that is set (read when the config is
/// created; a NULL config means these defaults too):
/// - `threads` [0, 1024]: compute threads, 0 = one per core (default 0)
/// - `kv_cache_bytes` [1, ..]: KV cache memory (default 512 MiB)
/// - `kv_cache_blocks` [1, ..]: KV cache size in blocks instead of bytes
/// - `block_size` [1, 1024]: tokens per KV block (default: the backend's choice, 16 on
///   the CPU, 128 on Ascend)
/// - `max_seqs` [1, ..]: most sequences running at once (default 64)
/// - `max_batched_tokens` [1, ..]: most tokens per step, >= max_seqs (default 512)
/// - `prefix_caching` 0/1: reuse cached prompt prefixes (default 1)
/// - `queue_limit` [1, ..]: most waiting requests; enqueue beyond it is
///   `TBOOST_ERR_QUEUE_FULL` (default 4096)
/// - `spec_ngram` [0, 16]: prompt-lookup speculative decoding (greedy and sampled requests):
///   up to
///   this many tokens drafted from an earlier occurrence of a request's last tokens and
///   verified in one chunk; the output is unchanged, a step may bring several events of one
///   request (default 0: off)
/// - `spec_draft_tokens` [1, 16]: with `spec_draft_model`, the most tokens the draft model
///   proposes a step (default 4)
/// - `finished_records` [1, ..]: finished requests whose records `tboost_engine_output`
///   and `tboost_engine_cancel` still answer for (default 65536; events lose nothing)
/// - `pin_threads` 0/1: pin each CPU compute thread to its own CPU (default 0;
///   env `TBOOST_PIN_THREADS`)
/// - `profile` 0/1: log the time spent per op type when the engine's backend closes
///   (default 0; env `TBOOST_PROFILE`)
/// - `tiling.attention.tile_kv` [16, 256]: FlashAttention's KV tile in the attention slots,
///   16, 32, 64, 128 or 256 (default 64); the plan reports it, and a non-default tile on a
///   backend whose attention kernel tiles itself fails `tboost_engine_new` /
///   `tboost_model_info_json` with `TBOOST_ERR_UNSUPPORTED`
/// - `tiling.matmul.panel_rows` [16, 4096], a multiple of 16: weight rows (output features) per
///   task of the CPU matmul kernels
/// - `tiling.matmul.act_rows` [1, 65536]: activation rows (tokens) per matmul task
/// - `tiling.matmul.tasks_per_thread` [1, 64]: matmul tasks per thread the split aims at
///   (default 8 in decode, 4 otherwise; by default a decode split's last tasks shrink so the
///   threads finish together, a set value gives even tasks)
/// - `tiling.matmul.decode_task_min_bytes` [4096, 16777216], a multiple of 1024: least weight
///   bytes of a block-quantized decode task (default 32768)
/// - `tiling.moe.expert_batch_tokens` [1, 65536]: most tokens in one expert batch of the grouped
///   MoE (default: all of an expert's tokens)
/// - `tiling.moe.parallel_expert_batches` [1, 64]: expert batches run at once (default 1)
/// - `tp` [1, 64]: tensor-parallel ranks the model is split over (default 1; env `TBOOST_TP`).
///   With `comm` "local" the ranks are threads of this engine and `threads` is shared between
///   them; under `mpirun` (`comm` "mpi") leave it unset: the ranks are the MPI processes
/// - `rank` [0, 63] and `world` [1, 64]: this process's rank and the group's size, when the host
///   states them (default auto: MPI_COMM_WORLD's under `comm` "mpi"; rank 0 of `tp` otherwise).
///   A stated value the group contradicts fails `tboost_engine_new` with
///   `TBOOST_ERR_INVALID_ARGUMENT` naming the key and what the group says; `tboost_engine_rank`
///   reports the group's
/// - `comm_timeout_ms` [1, 86400000]: longest wait of a collective for the other ranks
///   (default 60000; env `TBOOST_COMM_TIMEOUT_MS`); past it the step's requests end with
///   `TBOOST_FINISH_ERROR` naming the missing rank and the engine must be re-created
///
///   Unset tiling keys are the op's defaults; none changes a result, only speed. The plan
///   reports them (`matmul_tiling`, `moe_tiling`), and a set one on a backend whose kernels
///   tile themselves (Ascend) fails `tboost_engine_new` / `tboost_model_info_json` with
///   `TBOOST_ERR_UNSUPPORTED` naming the key, the slot and the backend
///
/// An unknown key, a value out of range or a string key is `TBOOST_ERR_INVALID_ARGUMENT`
/// and leaves the config unchanged. Cross-key rules (max_batched_tokens >= max_seqs) are
/// checked by `tboost_engine_new`.
///
/// Testing only: a library built with the cargo feature `fault-injection` (never a release;
/// CMake option `TBOOST_FAULT_INJECTION`) also takes `test.panic_at_step` [0, ..] (the n-th
/// `tboost_engine_step` panics, 0 = never) and `test.step_delay_ms` [0, 60000] (each step
/// first holds the engine this long). Any other build rejects them as unknown keys.
#[no_mangle]
pub unsafe extern "C" fn tboost_config_set_int(
    cfg: *mut tboost_config,
    key: *const c_char,
    value: i64,
) -> tboost_status {
    guard("tboost_config_set_int", |_| {
        // SAFETY: `key` is NULL or a NUL-terminated string per the contract.
        let key = unsafe { read_cstr(key, "key") }?;
        set(cfg, key, Raw::Int(value))
    })
}

/// Sets any option from a string: integers in decimal, flags as true/false/on/off/1/0, and
/// the string keys:
/// - `backend`: "auto" (default: a device backend when its runtime loads, else the CPU),
///   "cpu", "ascend" or "ascend:N"; an unknown name is `TBOOST_ERR_INVALID_ARGUMENT`
///   listing the known ones, and a known backend that cannot start (no runtime, not
///   compiled in) fails `tboost_engine_new` / `tboost_model_info_json` with
///   `TBOOST_ERR_UNSUPPORTED`. Env `TBOOST_BACKEND` sets the default.
/// - `kv_dtype`: KV cache element type, "auto" (default: the backend's choice, f32 on the
///   CPU), "f32", "f16", "bf16" or "q8_0" (int8 with an f16 scale per 32 values, as
///   llama.cpp's `-ctk q8_0`; a model whose head_dim is not a multiple of 32, or a backend
///   without the path, gets f16 and the plan says why)
/// - `precision`: matmul activation precision, "auto" (default: "fast" for GGUF
///   block-quantized weights, "exact" for float weights), "exact" (f32 activations) or
///   "fast" (8-bit activations with integer dot products where the backend has them); env
///   `TBOOST_PRECISION`
/// - `disabled_ops`: comma-separated ops and fusions the operator plan must not use
///   (flash_attention, paged_decode_attention, standard_attention, moe_grouped,
///   convert_weights, pack_weights, fuse_qkv, fuse_gate_up, fuse_add_norm); env
///   `TBOOST_DISABLE` sets the default
/// - `weight_pages`: "huge" (default: a large model file's weights are copied into huge pages
///   when the kernel offers them) or "small" (old name "file": stored weights stay in the file
///   map, which processes share; repacked ones go into 4 KiB pages); env `TBOOST_WEIGHT_PAGES`
/// - `ascend_known_bad`: CANN op versions the Ascend backend refuses beside its built-in table,
///   `op@from..until` items separated by `;` (e.g. `aclnnRmsNorm@8.0.RC1..8.0.RC3`); env
///   `TBOOST_ASCEND_KNOWN_BAD`
/// - `comm`: how tensor-parallel ranks talk: "local" (default: threads of this process) or
///   "mpi" (one rank per process under `mpirun`, Open MPI's libmpi.so.40 loaded at run time;
///   rank and world from MPI_COMM_WORLD). On a rank other than 0 the engine is a follower:
///   `tboost_engine_enqueue` fails with `TBOOST_ERR_INVALID_ARGUMENT` and
///   `tboost_engine_step` runs the leader's steps until rank 0's engine is freed. Or "hccl"
///   (`tp` ranks as threads of this process, one Ascend device each, the activations'
///   all-reduce and the logits' all-gather by HCCL on the devices; needs backend "ascend"
///   and libhccl.so beside CANN). Under `mpirun`, "hccl" makes every process one rank on
///   one device (HcclCommInitRootInfo, the root info sent from rank 0 over MPI; the step
///   commands over MPI, followers as with "mpi"). Env `TBOOST_COMM`
/// - `devices`: with `comm` "hccl", the Ascend devices of the ranks, rank i on the i-th
///   (`ascend:0,1`; default: the backend's device and the next `tp` - 1); under `mpirun`, the
///   devices of this node's processes, local rank i on the i-th (default: the backend's device
///   plus the local rank); env `TBOOST_DEVICES`
/// - `spec_draft_model`: speculative decoding with a draft model: the path of a GGUF file or
///   Hugging Face directory of a smaller model with the target's vocabulary, loaded beside the
///   model by `tboost_engine_new`; its greedy tokens are drafts the model verifies in one chunk
///   (greedy output unchanged, sampled output by the rejection rule). A file that cannot be
///   loaded, or whose vocabulary size differs, fails `tboost_engine_new` naming it; not with
///   `spec_ngram` (default "": off)
///
/// Errors as for `tboost_config_set_int`.
#[no_mangle]
pub unsafe extern "C" fn tboost_config_set_str(
    cfg: *mut tboost_config,
    key: *const c_char,
    value: *const c_char,
) -> tboost_status {
    guard("tboost_config_set_str", |_| {
        // SAFETY: NULL or NUL-terminated strings per the contract.
        let (key, value) = unsafe { (read_cstr(key, "key")?, read_cstr(value, "value")?) };
        set(cfg, key, Raw::Str(value))
    })
}

/// Writes the config's effective settings as a JSON object into `buf` (see
/// `tboost_last_error` for the buffer rules; `*needed` includes the NUL).
#[no_mangle]
pub unsafe extern "C" fn tboost_config_to_json(
    cfg: *const tboost_config,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> tboost_status {
    guard("tboost_config_to_json", |_| {
        let s = CONFIGS.get(cfg, "cfg")?.snapshot();
        #[allow(unused_mut)]
        let mut v = s.engine.to_json();
        #[cfg(feature = "fault-injection")]
        {
            v["test.panic_at_step"] = s.faults.panic_at_step.into();
            v["test.step_delay_ms"] = (s.faults.step_delay.as_millis() as u64).into();
        }
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&v.to_string(), buf, cap, needed) }
    })
}
