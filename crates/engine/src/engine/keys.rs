//! The configuration table: every engine option by key, with its type, range, default, doc
//! and the environment variable that supplies its default. The C ABI's `tboost_config_set_*`
//! and `tboost_config_to_json`, and the CLI's flags, set and show an [`EngineConfig`] through
//! these keys, so every surface takes the same names and values.
//!
//! Environment variables are only defaults: [`EngineConfig::apply_env`] is the one place that
//! reads them, when a config is made ([`EngineConfig::from_env`]); a value set on a config
//! then wins, and each engine keeps its own values. `EngineConfig::default()` reads nothing.
//!
//! Not in the table, on purpose: `TBOOST_ISA`, `TBOOST_ISA_DISABLE` and `TBOOST_PREFETCH`,
//! read by `tboost-kernels`. They override what the CPU's features select for every kernel
//! in the process (the dispatch is resolved once per process), so they stay process-wide
//! environment variables, not per-engine options.

use serde_json::{json, Value};

use super::config::{parse_kv_dtype, parse_precision, tiling_keys, EngineConfig, KvSize, WeightPages};
use crate::backend::{check_tile_kv, BackendKind};
use crate::plan::PlanOptions;
use crate::{Error, Result};

/// What a key takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyType {
    /// An integer in `min..=max`.
    Int {
        min: i64,
        max: i64,
    },
    /// A flag: 0/1 as an integer; true/false, on/off, yes/no or 1/0 as a string.
    Bool,
    Str,
}

/// One key of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    pub name: String,
    pub ty: KeyType,
    /// The built-in default, as `to_json` shows it.
    pub default: String,
    /// The environment variable whose value, when set, is the default instead.
    pub env: Option<&'static str>,
    pub doc: String,
}

const MAX: i64 = i64::MAX;

/// The fixed keys: (name, type, default, env, doc).
const FIXED: &[(&str, KeyType, &str, Option<&str>, &str)] = &[
    (
        "backend",
        KeyType::Str,
        "auto",
        Some("TBOOST_BACKEND"),
        "where ops run: auto, cpu, ascend or ascend:N (auto: a device when its runtime loads, else the CPU)",
    ),
    ("threads", KeyType::Int { min: 0, max: 1024 }, "0", None, "compute threads, 0 = one per core"),
    ("kv_cache_bytes", KeyType::Int { min: 1, max: MAX }, "536870912", None, "KV cache memory"),
    ("kv_cache_blocks", KeyType::Int { min: 1, max: MAX }, "", None, "KV cache size in blocks instead of bytes"),
    ("block_size", KeyType::Int { min: 1, max: 1024 }, "auto", None, "tokens per KV block (auto: the backend's)"),
    ("kv_dtype", KeyType::Str, "auto", None, "KV cache element type: auto, f32, f16, bf16 or q8_0 (int8 with an f16 scale per 32 values; needs head_dim % 32 == 0, else f16 with a logged reason)"),
    ("precision", KeyType::Str, "auto", Some("TBOOST_PRECISION"), "matmul activation precision: auto, exact or fast"),
    (
        "finished_records",
        KeyType::Int { min: 1, max: MAX },
        "65536",
        None,
        "finished requests whose records output and cancel still answer for",
    ),
    ("max_seqs", KeyType::Int { min: 1, max: MAX }, "64", None, "most sequences running at once"),
    ("max_batched_tokens", KeyType::Int { min: 1, max: MAX }, "512", None, "most tokens per step, >= max_seqs"),
    ("prefix_caching", KeyType::Bool, "true", None, "reuse cached prompt prefixes"),
    ("queue_limit", KeyType::Int { min: 1, max: MAX }, "4096", None, "most waiting requests"),
    (
        "spec_ngram",
        KeyType::Int { min: 0, max: 16 },
        "0",
        None,
        "prompt-lookup speculative decoding: requests draft up to this many tokens a step from \
         an earlier occurrence of their last tokens, verified in one chunk (0 = off)",
    ),
    (
        "spec_draft_model",
        KeyType::Str,
        "",
        None,
        "speculative decoding with a draft model: a GGUF file or HF directory of a smaller model with the \
         target's vocabulary whose greedy tokens are verified in one chunk (empty = off; not with spec_ngram)",
    ),
    (
        "spec_draft_tokens",
        KeyType::Int { min: 1, max: 16 },
        "4",
        None,
        "tokens the draft model proposes a step (at most; fewer after rejections)",
    ),
    (
        "disabled_ops",
        KeyType::Str,
        "",
        Some("TBOOST_DISABLE"),
        "ops and fusions the plan must not use, comma-separated",
    ),
    (
        "tiling.attention.tile_kv",
        KeyType::Int { min: 16, max: 256 },
        "auto",
        None,
        "FlashAttention's KV tile: 16, 32, 64, 128 or 256 (auto: 64)",
    ),
    ("pin_threads", KeyType::Bool, "false", Some("TBOOST_PIN_THREADS"), "pin each CPU compute thread to its own CPU"),
    ("profile", KeyType::Bool, "false", Some("TBOOST_PROFILE"), "log the time per op type when the backend closes"),
    (
        "weight_pages",
        KeyType::Str,
        "huge",
        Some("TBOOST_WEIGHT_PAGES"),
        "huge: large model files' weights are copied into huge pages; small (or file): into 4 KiB pages \
         (weights are never read from the file map after load)",
    ),
    (
        "ascend_known_bad",
        KeyType::Str,
        "",
        Some("TBOOST_ASCEND_KNOWN_BAD"),
        "CANN op versions to refuse on Ascend, `op@from..until` items separated by `;`",
    ),
    ("tp", KeyType::Int { min: 1, max: 64 }, "1", Some("TBOOST_TP"), "tensor-parallel ranks the model is split over"),
    (
        "rank",
        KeyType::Int { min: 0, max: 63 },
        "auto",
        None,
        "this process's rank (auto: MPI_COMM_WORLD's under comm = mpi, 0 otherwise); a value MPI contradicts is an \
         error",
    ),
    (
        "world",
        KeyType::Int { min: 1, max: 64 },
        "auto",
        None,
        "ranks in the group (auto: MPI_COMM_WORLD's size under comm = mpi, tp otherwise); a value that differs is \
         an error",
    ),
    (
        "comm",
        KeyType::Str,
        "local",
        Some("TBOOST_COMM"),
        "how tensor-parallel ranks talk: local (threads of this process), mpi (one process per rank under \
         mpirun), hccl (one Ascend device per rank, activations all-reduced by HCCL: threads of this process, or one \
         process per device under mpirun)",
    ),
    (
        "comm_timeout_ms",
        KeyType::Int { min: 1, max: 86_400_000 },
        "60000",
        Some("TBOOST_COMM_TIMEOUT_MS"),
        "longest wait of a collective for the other ranks before the step fails naming the missing rank",
    ),
    (
        "devices",
        KeyType::Str,
        "",
        Some("TBOOST_DEVICES"),
        "Ascend devices of the ranks with comm = hccl, rank i on the i-th (`ascend:0,1`; empty: the backend's \
         device and the next tp - 1); under mpirun, this node's devices by local rank",
    ),
];

/// Every key: the fixed ones, then `tiling.matmul.*` and `tiling.moe.*`.
pub fn keys() -> Vec<Key> {
    let fixed = FIXED.iter().map(|(name, ty, default, env, doc)| Key {
        name: name.to_string(),
        ty: *ty,
        default: default.to_string(),
        env: *env,
        doc: doc.to_string(),
    });
    let tiling = tiling_keys().into_iter().map(|(name, t)| Key {
        name,
        ty: KeyType::Int { min: t.min as i64, max: t.max as i64 },
        default: "auto".into(),
        env: None,
        doc: format!("{} ({})", t.what, t.need()),
    });
    fixed.chain(tiling).collect()
}

/// The key named `name`, or an error listing every key.
pub fn key(name: &str) -> Result<Key> {
    let all = keys();
    match all.iter().find(|k| k.name == name) {
        Some(k) => Ok(k.clone()),
        None => {
            let names: Vec<&str> = all.iter().map(|k| k.name.as_str()).collect();
            Err(Error::invalid(name, format!("unknown config key `{name}`; known keys: {}", names.join(", "))))
        }
    }
}

/// A value on its way into a config: an integer (`tboost_config_set_int`) or text
/// (`tboost_config_set_str`, a CLI flag, an environment variable).
#[derive(Clone, Copy, Debug)]
pub enum Raw<'a> {
    Int(i64),
    Str(&'a str),
}

/// A checked value of a key's type.
enum Typed<'a> {
    Int(i64),
    Bool(bool),
    Str(&'a str),
}

fn typed<'a>(k: &Key, raw: Raw<'a>) -> Result<Typed<'a>> {
    let name = k.name.as_str();
    let bad = |m: String| Err(Error::invalid(name, m));
    let in_range = |v: i64, min: i64, max: i64| {
        if v < min || v > max {
            bad(format!("`{name}` = {v} is out of range [{min}, {max}]"))
        } else {
            Ok(Typed::Int(v))
        }
    };
    match (k.ty, raw) {
        (KeyType::Int { min, max }, Raw::Int(v)) => in_range(v, min, max),
        (KeyType::Int { min, max }, Raw::Str(s)) => match s.trim().parse::<i64>() {
            Ok(v) => in_range(v, min, max),
            Err(_) => bad(format!("`{name}` = `{s}` is not an integer")),
        },
        (KeyType::Bool, Raw::Int(v)) => match v {
            0 | 1 => Ok(Typed::Bool(v == 1)),
            _ => bad(format!("`{name}` is a flag: 0 or 1, got {v}")),
        },
        (KeyType::Bool, Raw::Str(s)) => match s.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "on" | "yes" => Ok(Typed::Bool(true)),
            "0" | "false" | "off" | "no" => Ok(Typed::Bool(false)),
            _ => bad(format!("`{name}` is a flag: true/false, on/off or 1/0, got `{s}`")),
        },
        (KeyType::Str, Raw::Str(s)) => Ok(Typed::Str(s)),
        (KeyType::Str, Raw::Int(v)) => {
            bad(format!("`{name}` takes a string (tboost_config_set_str), got the integer {v}"))
        }
    }
}

impl EngineConfig {
    /// The built-in defaults with every key's environment variable applied: what a new
    /// C ABI config, a NULL config and the CLI start from.
    pub fn from_env() -> Result<EngineConfig> {
        let mut c = EngineConfig::default();
        c.apply_env(|name| std::env::var(name).ok())?;
        Ok(c)
    }

    /// Sets each key whose environment variable `get` finds (and is not empty) to its value:
    /// the one place the `TBOOST_*` engine variables are read. An invalid value is an error
    /// naming the variable.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        for k in keys() {
            let Some(var) = k.env else { continue };
            let Some(v) = get(var).filter(|v| !v.trim().is_empty()) else { continue };
            // `TBOOST_PROFILE=anything` turned profiling on before it was a key.
            let v = if k.name == "profile" && typed(&k, Raw::Str(&v)).is_err() { "1".to_string() } else { v };
            self.set(&k.name, Raw::Str(&v)).map_err(|e| Error::invalid(var, e.to_string()))?;
        }
        Ok(())
    }

    /// Sets `key` to `value`, checked against the key's type and range. An unknown key or a
    /// bad value is `InvalidArgument` naming both, and changes nothing.
    pub fn set(&mut self, key: &str, value: Raw<'_>) -> Result<()> {
        let k = self::key(key)?;
        let v = typed(&k, value)?;
        let mut next = self.clone();
        next.apply(key, v)?;
        next.check_cross_key()?;
        *self = next;
        Ok(())
    }

    fn apply(&mut self, key: &str, v: Typed<'_>) -> Result<()> {
        let usize_of =
            |v: i64| usize::try_from(v).map_err(|_| Error::invalid(key, format!("`{key}` = {v} is too large")));
        let named = |e: Error| Error::invalid(key, format!("`{key}`: {}", reason(&e)));
        match (key, v) {
            ("backend", Typed::Str(b)) => self.backend = BackendKind::parse(b).map_err(named)?,
            ("threads", Typed::Int(v)) => self.threads = usize_of(v)?,
            ("kv_cache_bytes", Typed::Int(v)) => self.kv_size = KvSize::Bytes(usize_of(v)?),
            ("kv_cache_blocks", Typed::Int(v)) => self.kv_size = KvSize::Blocks(usize_of(v)?),
            ("block_size", Typed::Int(v)) => self.block_size = Some(usize_of(v)?),
            ("kv_dtype", Typed::Str(d)) => {
                self.kv_dtype = parse_kv_dtype(d).map_err(|_| {
                    Error::invalid(key, format!("`kv_dtype` = `{d}` is not one of auto, f32, f16, bf16, q8_0"))
                })?
            }
            ("precision", Typed::Str(p)) => {
                self.precision = parse_precision(p)
                    .map_err(|_| Error::invalid(key, format!("`precision` = `{p}` is not one of auto, exact, fast")))?
            }
            ("finished_records", Typed::Int(v)) => self.finished_records = usize_of(v)?,
            ("max_seqs", Typed::Int(v)) => self.max_seqs = usize_of(v)?,
            ("max_batched_tokens", Typed::Int(v)) => self.max_batched_tokens = usize_of(v)?,
            ("prefix_caching", Typed::Bool(b)) => self.prefix_caching = b,
            ("queue_limit", Typed::Int(v)) => self.queue_limit = usize_of(v)?,
            ("spec_ngram", Typed::Int(v)) => self.spec_ngram = usize_of(v)?,
            ("spec_draft_model", Typed::Str(p)) => self.spec_draft_model = p.trim().to_string(),
            ("spec_draft_tokens", Typed::Int(v)) => self.spec_draft_tokens = usize_of(v)?,
            ("disabled_ops", Typed::Str(list)) => {
                self.disabled_ops = PlanOptions::parse_disabled(list).map_err(named)?
            }
            ("tiling.attention.tile_kv", Typed::Int(v)) => {
                let t = usize_of(v)?;
                check_tile_kv(t).map_err(|u| {
                    Error::invalid(key, format!("`tiling.attention.tile_kv`: {u} (16, 32, 64, 128 or 256)"))
                })?;
                self.attention_tile_kv = Some(t)
            }
            (k, Typed::Int(v)) if k.starts_with("tiling.") => self.set_tiling(k, usize_of(v)?).map_err(named)?,
            ("pin_threads", Typed::Bool(b)) => self.pin_threads = b,
            ("profile", Typed::Bool(b)) => self.profile = b,
            ("weight_pages", Typed::Str(p)) => {
                self.weight_pages = match p.trim() {
                    "huge" => WeightPages::Huge,
                    "small" | "file" => WeightPages::Small,
                    other => {
                        return Err(Error::invalid(key, format!("`weight_pages` = `{other}` is not huge or small")))
                    }
                }
            }
            ("ascend_known_bad", Typed::Str(s)) => {
                #[cfg(feature = "ascend")]
                crate::backend::ascend::supports::parse_known_bad(s)
                    .map_err(|e| Error::invalid(key, format!("`{key}`: {e}")))?;
                self.ascend_known_bad = s.trim().to_string()
            }
            ("tp", Typed::Int(v)) => self.tp = usize_of(v)?,
            ("rank", Typed::Int(v)) => self.rank = Some(usize_of(v)?),
            ("world", Typed::Int(v)) => self.world = Some(usize_of(v)?),
            ("comm", Typed::Str(c)) => self.comm = crate::comm::CommKind::parse(c).map_err(named)?,
            ("comm_timeout_ms", Typed::Int(v)) => self.comm_timeout_ms = v as u64,
            ("devices", Typed::Str(d)) => {
                let n = d.trim().strip_prefix("ascend:").unwrap_or(d.trim()).split(',').count();
                if !d.trim().is_empty() {
                    crate::comm::hccl::parse_devices(d, n, 0).map_err(named)?;
                }
                self.devices = d.trim().to_string()
            }
            (k, _) => return Err(Error::invalid(k, format!("config key `{k}` has no setter"))),
        }
        Ok(())
    }

    /// Rules between keys that a single set can break: none today beyond `validate`'s, which
    /// run when the engine is made (so that keys can be set in any order).
    fn check_cross_key(&self) -> Result<()> {
        Ok(())
    }

    /// Every key with its value (`"auto"` where the backend or op decides).
    pub fn to_json(&self) -> Value {
        let auto = |v: Option<usize>| v.map_or(json!("auto"), |x| json!(x));
        let (bytes, blocks) = match self.kv_size {
            KvSize::Bytes(b) => (json!(b), Value::Null),
            KvSize::Blocks(n) => (Value::Null, json!(n)),
            KvSize::Tokens(t) => (Value::Null, json!(format!("{t} tokens"))),
        };
        let mut v = json!({
            "backend": self.backend.to_string(),
            "threads": self.threads,
            "kv_cache_bytes": bytes,
            "kv_cache_blocks": blocks,
            "block_size": auto(self.block_size),
            "kv_dtype": self.kv_dtype.map_or("auto", |d| d.name()),
            "precision": self.precision.name(),
            "finished_records": self.finished_records,
            "max_seqs": self.max_seqs,
            "max_batched_tokens": self.max_batched_tokens,
            "prefix_caching": self.prefix_caching,
            "queue_limit": self.queue_limit,
            "spec_ngram": self.spec_ngram,
            "spec_draft_model": self.spec_draft_model,
            "spec_draft_tokens": self.spec_draft_tokens,
            "disabled_ops": self.disabled_ops.iter().cloned().collect::<Vec<_>>().join(","),
            "tiling.attention.tile_kv": auto(self.attention_tile_kv),
            "pin_threads": self.pin_threads,
            "profile": self.profile,
            "weight_pages": match self.weight_pages { WeightPages::Huge => "huge", WeightPages::Small => "small" },
            "ascend_known_bad": self.ascend_known_bad,
            "tp": self.tp,
            "rank": auto(self.rank),
            "world": auto(self.world),
            "comm": self.comm.name(),
            "comm_timeout_ms": self.comm_timeout_ms,
            "devices": self.devices,
        });
        for (key, value) in self.tiling_settings() {
            v[key.as_str()] = auto(value);
        }
        v
    }
}

/// An error's reason without its parameter prefix (the message names the key already).
fn reason(e: &Error) -> String {
    match e {
        Error::InvalidArgument { msg, .. } => msg.clone(),
        other => other.to_string(),
    }
}
