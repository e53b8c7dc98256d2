//! `tboost_config`: engine and model options set by string keys, so a new option never
//! changes the ABI.

use std::os::raw::c_char;
use std::sync::{Arc, Mutex};

use serde_json::json;

use super::guard::guard;
use super::handle::Registry;
use super::log_bridge::ensure_logger;
use super::status::{tboost_status, Failure, FfiResult, Status};
use super::types::tboost_config;
use super::util::{read_cstr, require, write_out, write_str};
use ::tboost_engine::backend::BackendKind;
use ::tboost_engine::engine::{parse_kv_dtype, parse_precision, tiling_keys, EngineConfig, KvSize};
use ::tboost_engine::plan::PlanOptions;

/// What a config holds: the engine's settings plus the ABI-level ones.
#[derive(Clone, Debug, Default)]
pub(crate) struct Settings {
    pub engine: EngineConfig,
    /// Testing only: the n-th `tboost_engine_step` call panics inside the barrier.
    pub debug_panic_at_step: u64,
    /// Testing only: every `tboost_engine_step` call holds the engine this long first.
    pub debug_step_delay_ms: u64,
}

impl Settings {
    /// The testing faults the engine's steps inject.
    pub fn step_faults(&self) -> ::tboost_engine::engine::StepFaults {
        ::tboost_engine::engine::StepFaults {
            panic_at_step: self.debug_panic_at_step,
            step_delay: std::time::Duration::from_millis(self.debug_step_delay_ms),
        }
    }
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

/// The settings behind an optional config handle (NULL = defaults).
pub(crate) fn settings_of(cfg: *const tboost_config) -> FfiResult<Settings> {
    if cfg.is_null() {
        Ok(Settings::default())
    } else {
        Ok(CONFIGS.get(cfg, "cfg")?.snapshot())
    }
}

enum Kind {
    Int { min: i64, max: i64 },
    Bool,
    Str,
}

/// Every key, its kind, and what it sets. Listed in errors and in tboost.h.
const KEYS: &[(&str, Kind)] = &[
    ("backend", Kind::Str),
    ("threads", Kind::Int { min: 0, max: 1024 }),
    ("kv_cache_bytes", Kind::Int { min: 1, max: i64::MAX }),
    ("kv_cache_blocks", Kind::Int { min: 1, max: i64::MAX }),
    ("block_size", Kind::Int { min: 1, max: 1024 }),
    ("kv_dtype", Kind::Str),
    ("precision", Kind::Str),
    ("finished_records", Kind::Int { min: 1, max: i64::MAX }),
    ("max_seqs", Kind::Int { min: 1, max: i64::MAX }),
    ("max_batched_tokens", Kind::Int { min: 1, max: i64::MAX }),
    ("prefix_caching", Kind::Bool),
    ("queue_limit", Kind::Int { min: 1, max: i64::MAX }),
    ("disabled_ops", Kind::Str),
    ("tiling.attention.tile_kv", Kind::Int { min: 16, max: 256 }),
    ("debug_panic_at_step", Kind::Int { min: 0, max: i64::MAX }),
    ("debug_step_delay_ms", Kind::Int { min: 0, max: 60_000 }),
];

fn key_names() -> String {
    let tiling = tiling_keys().into_iter().map(|(k, _)| k);
    KEYS.iter().map(|(k, _)| k.to_string()).chain(tiling).collect::<Vec<_>>().join(", ")
}

/// A key's kind: the table's, or an integer in its tunable's range for the matmul and MoE
/// tiling keys (`tiling.matmul.panel_rows`, ...).
fn kind_of(key: &str) -> FfiResult<Kind> {
    if let Some((_, kind)) = KEYS.iter().find(|(k, _)| *k == key) {
        return Ok(match kind {
            Kind::Int { min, max } => Kind::Int { min: *min, max: *max },
            Kind::Bool => Kind::Bool,
            Kind::Str => Kind::Str,
        });
    }
    match tiling_keys().into_iter().find(|(k, _)| k == key) {
        Some((_, t)) => Ok(Kind::Int { min: t.min as i64, max: t.max as i64 }),
        None => Err(Failure::invalid(format!("unknown config key `{key}`; known keys: {}", key_names()))),
    }
}

/// A typed value after parsing.
enum Value<'a> {
    Int(i64),
    Bool(bool),
    Str(&'a str),
}

fn apply(s: &mut Settings, key: &str, v: Value<'_>) -> FfiResult {
    let usize_of = |v: i64| usize::try_from(v).map_err(|_| Failure::invalid(format!("`{key}` = {v} is too large")));
    match (key, v) {
        ("backend", Value::Str(b)) => {
            s.engine.backend = BackendKind::parse(b).map_err(|e| Failure::invalid(format!("`backend`: {e}")))?
        }
        ("threads", Value::Int(v)) => s.engine.threads = usize_of(v)?,
        ("kv_cache_bytes", Value::Int(v)) => s.engine.kv_size = KvSize::Bytes(usize_of(v)?),
        ("kv_cache_blocks", Value::Int(v)) => s.engine.kv_size = KvSize::Blocks(usize_of(v)?),
        ("block_size", Value::Int(v)) => s.engine.block_size = Some(usize_of(v)?),
        ("kv_dtype", Value::Str(d)) => {
            s.engine.kv_dtype = parse_kv_dtype(d)
                .map_err(|_| Failure::invalid(format!("`kv_dtype` = `{d}` is not one of auto, f32, f16, bf16")))?
        }
        ("precision", Value::Str(p)) => {
            s.engine.precision = parse_precision(p)
                .map_err(|_| Failure::invalid(format!("`precision` = `{p}` is not one of auto, exact, fast")))?
        }
        ("finished_records", Value::Int(v)) => s.engine.finished_records = usize_of(v)?,
        ("max_seqs", Value::Int(v)) => s.engine.max_seqs = usize_of(v)?,
        ("max_batched_tokens", Value::Int(v)) => s.engine.max_batched_tokens = usize_of(v)?,
        ("prefix_caching", Value::Bool(b)) => s.engine.prefix_caching = b,
        ("queue_limit", Value::Int(v)) => s.engine.queue_limit = usize_of(v)?,
        ("tiling.attention.tile_kv", Value::Int(v)) => {
            let t = usize_of(v)?;
            ::tboost_engine::backend::check_tile_kv(t)
                .map_err(|u| Failure::invalid(format!("`tiling.attention.tile_kv`: {u} (16, 32, 64, 128 or 256)")))?;
            s.engine.attention_tile_kv = Some(t)
        }
        ("disabled_ops", Value::Str(list)) => {
            s.engine.disabled_ops =
                PlanOptions::parse_disabled(list).map_err(|e| Failure::invalid(format!("`disabled_ops`: {e}")))?
        }
        (k, Value::Int(v)) if k.starts_with("tiling.") => {
            s.engine.set_tiling(k, usize_of(v)?).map_err(|e| Failure::invalid(format!("`{k}`: {}", tiling_why(&e))))?
        }
        ("debug_panic_at_step", Value::Int(v)) => s.debug_panic_at_step = v as u64,
        ("debug_step_delay_ms", Value::Int(v)) => s.debug_step_delay_ms = v as u64,
        (k, _) => return Err(Failure::new(Status::TBOOST_ERR_INTERNAL, format!("config key `{k}` has no setter"))),
    }
    Ok(())
}

/// The reason of a tiling key's error without the key (the message names it already).
fn tiling_why(e: &::tboost_engine::Error) -> String {
    match e {
        ::tboost_engine::Error::InvalidArgument { msg, .. } => msg.clone(),
        other => other.to_string(),
    }
}

fn set(cfg: *mut tboost_config, key: &str, raw: Raw<'_>) -> FfiResult {
    let c = CONFIGS.get(cfg, "cfg")?;
    let value = match (kind_of(key)?, raw) {
        (Kind::Int { min, max }, Raw::Int(v)) => {
            if v < min || v > max {
                return Err(Failure::invalid(format!("`{key}` = {v} is out of range [{min}, {max}]")));
            }
            Value::Int(v)
        }
        (Kind::Int { min, max }, Raw::Str(s)) => {
            let v: i64 =
                s.trim().parse().map_err(|_| Failure::invalid(format!("`{key}` = `{s}` is not an integer")))?;
            if v < min || v > max {
                return Err(Failure::invalid(format!("`{key}` = {v} is out of range [{min}, {max}]")));
            }
            Value::Int(v)
        }
        (Kind::Bool, Raw::Int(v)) => match v {
            0 | 1 => Value::Bool(v == 1),
            _ => return Err(Failure::invalid(format!("`{key}` is a flag: 0 or 1, got {v}"))),
        },
        (Kind::Bool, Raw::Str(s)) => match s.trim() {
            "1" | "true" | "on" | "yes" => Value::Bool(true),
            "0" | "false" | "off" | "no" => Value::Bool(false),
            _ => return Err(Failure::invalid(format!("`{key}` is a flag: true/false, on/off or 1/0, got `{s}`"))),
        },
        (Kind::Str, Raw::Str(s)) => Value::Str(s),
        (Kind::Str, Raw::Int(v)) => {
            return Err(Failure::invalid(format!(
                "`{key}` takes a string (tboost_config_set_str), got the integer {v}"
            )))
        }
    };
    let mut s = c.settings.lock().unwrap_or_else(|e| e.into_inner());
    // Apply to a copy so that a rejected value leaves the config unchanged.
    let mut next = s.clone();
    apply(&mut next, key, value)?;
    *s = next;
    Ok(())
}

enum Raw<'a> {
    Int(i64),
    Str(&'a str),
}

/// Creates a config with every default. Free it with `tboost_config_free`; models and
/// engines copy what they need, so it may be freed right after use.
#[no_mangle]
pub unsafe extern "C" fn tboost_config_new(out: *mut *mut tboost_config) -> tboost_status {
    guard("tboost_config_new", |_| {
        require(out, "out")?;
        ensure_logger();
        let h = CONFIGS.insert(Arc::new(ConfigInner { settings: Mutex::new(Settings::default()) }));
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

/// Sets an integer or flag option. Keys (range in brackets):
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
/// - `finished_records` [1, ..]: finished requests whose records `tboost_engine_output`
///   and `tboost_engine_cancel` still answer for (default 65536; events lose nothing)
/// - `tiling.attention.tile_kv` [16, 256]: FlashAttention's KV tile in the attention slots,
///   16, 32, 64, 128 or 256 (default 64); the plan reports it, and a non-default tile on a
///   backend whose attention kernel tiles itself fails `tboost_engine_new` /
///   `tboost_model_load` with `TBOOST_ERR_UNSUPPORTED`
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
///
///   Unset tiling keys are the op's defaults; none changes a result, only speed. The plan
///   reports them (`matmul_tiling`, `moe_tiling`), and a set one on a backend whose kernels
///   tile themselves (Ascend) fails `tboost_engine_new` / `tboost_model_load` with
///   `TBOOST_ERR_UNSUPPORTED` naming the key, the slot and the backend
/// - `debug_panic_at_step` [0, ..]: testing only, the n-th step panics (0 = never)
/// - `debug_step_delay_ms` [0, 60000]: testing only, each step first sleeps this long
///
/// An unknown key, a value out of range or a string key is `TBOOST_ERR_INVALID_ARGUMENT`
/// and leaves the config unchanged. Cross-key rules (max_batched_tokens >= max_seqs) are
/// checked by `tboost_engine_new`.
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
///   compiled in) fails `tboost_model_load` / `tboost_engine_new` with
///   `TBOOST_ERR_UNSUPPORTED`. With "auto", `TBOOST_BACKEND` in the environment decides.
/// - `kv_dtype`: KV cache element type, "auto" (default: the backend's choice, f32 on the
///   CPU), "f32", "f16" or "bf16"
/// - `precision`: matmul activation precision, "auto" (default: "fast" for GGUF
///   block-quantized weights, "exact" for float weights), "exact" (f32 activations) or
///   "fast" (8-bit activations with integer dot products where the backend has them)
/// - `disabled_ops`: comma-separated ops and fusions the operator plan must not use
///   (flash_attention, paged_decode_attention, standard_attention, moe_grouped,
///   convert_weights, pack_weights, fuse_qkv, fuse_gate_up, fuse_add_norm)
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
        let e = &s.engine;
        let (kv_bytes, kv_blocks) = match e.kv_size {
            KvSize::Bytes(b) => (Some(b), None),
            KvSize::Blocks(b) => (None, Some(b)),
            // Not settable through the C ABI; reported as the blocks it makes at 16 tokens.
            KvSize::Tokens(t) => (None, Some(t.div_ceil(16))),
        };
        let v = json!({
            "backend": e.backend.to_string(),
            "threads": e.threads,
            "kv_cache_bytes": kv_bytes,
            "kv_cache_blocks": kv_blocks,
            "block_size": e.block_size.map_or(serde_json::Value::from("auto"), serde_json::Value::from),
            "kv_dtype": e.kv_dtype.map_or("auto", |d| d.name()),
            "precision": e.precision.name(),
            "finished_records": e.finished_records,
            "max_seqs": e.max_seqs,
            "max_batched_tokens": e.max_batched_tokens,
            "prefix_caching": e.prefix_caching,
            "queue_limit": e.queue_limit,
            "disabled_ops": e.disabled_ops.iter().cloned().collect::<Vec<_>>().join(","),
            "tiling.attention.tile_kv": e.attention_tile_kv.map_or(serde_json::Value::from("auto"), serde_json::Value::from),
            "debug_panic_at_step": s.debug_panic_at_step,
            "debug_step_delay_ms": s.debug_step_delay_ms,
        });
        let mut v = v;
        for (key, value) in e.tiling_settings() {
            v[key.as_str()] = value.map_or(json!("auto"), |x| json!(x));
        }
        // SAFETY: buffer contract as documented.
        unsafe { write_str(&v.to_string(), buf, cap, needed) }
    })
}
