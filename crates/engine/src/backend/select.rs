//! The one place backends are created: `--backend` and the `backend` config key (whose
//! default `TBOOST_BACKEND` supplies) end here.
//!
//! - `cpu`: the CPU backend.
//! - `ascend` / `ascend:N`: the Ascend NPU `N` (default 0) through CANN, loaded at run time;
//!   compiled in with the `ascend` cargo feature (on by default: CANN is dlopened, so it builds
//!   everywhere). Without CANN: `CANN runtime not found; searched: ...`.
//! - `auto` (the default): a device backend when its runtime loads, else the CPU, with one
//!   info line saying why. The CANN SIMULATOR is never chosen by `auto`.
//!

use std::fmt;
use std::sync::Once;

use super::cpu::CpuBackend;
use super::Backend;
use crate::{Error, Result};

/// Every name `BackendKind::parse` accepts (for error messages).
pub const KNOWN: &[&str] = &["auto", "cpu", "ascend", "ascend:N"];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    #[default]
    Auto,
    Cpu,
    Ascend {
        device: u32,
    },
}

impl BackendKind {
    pub fn parse(s: &str) -> Result<BackendKind> {
        let s = s.trim();
        let bad = || Error::invalid("backend", format!("unknown backend `{s}`; known backends: {}", KNOWN.join(", ")));
        match s {
            "auto" => Ok(BackendKind::Auto),
            "cpu" => Ok(BackendKind::Cpu),
            "ascend" => Ok(BackendKind::Ascend { device: 0 }),
            _ => match s.strip_prefix("ascend:") {
                Some(n) => n.parse().map(|device| BackendKind::Ascend { device }).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendKind::Auto => f.write_str("auto"),
            BackendKind::Cpu => f.write_str("cpu"),
            BackendKind::Ascend { device } => write!(f, "ascend:{device}"),
        }
    }
}

/// What to open: which backend, and the CPU's thread count (also used by the CPU that runs
/// per-op fallbacks beside a device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSpec {
    pub kind: BackendKind,
    /// CPU compute threads (0 = one per core).
    pub threads: usize,
}

/// How a backend runs, beside what it is (the engine config's `backend_options`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// Pin each CPU compute thread to its own CPU.
    pub pin_threads: bool,
    /// Time each op type; logged when the backend closes.
    pub profile: bool,
    /// Keep a large model file's stored weights in the file map, repacked ones in 4 KiB pages.
    pub small_weight_pages: bool,
    /// Ascend: CANN op versions to refuse beside the built-in table (`op@from..until;...`).
    pub ascend_known_bad: String,
}

/// Opens the backend `spec` names with the default options.
pub fn open(spec: BackendSpec) -> Result<Box<dyn Backend>> {
    open_with(spec, &BackendOptions::default())
}

/// Opens the backend `spec` names with `opts`.
pub fn open_with(spec: BackendSpec, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    match spec.kind {
        BackendKind::Cpu => Ok(Box::new(CpuBackend::with_options(spec.threads, opts)?)),
        BackendKind::Ascend { device } => open_ascend(device, opts),
        BackendKind::Auto => match open_auto_device(opts) {
            Ok(be) => Ok(be),
            Err(why) => {
                static ONCE: Once = Once::new();
                ONCE.call_once(|| log::info!("backend auto: using the CPU ({why})"));
                Ok(Box::new(CpuBackend::with_options(spec.threads, opts)?))
            }
        },
    }
}

/// `auto`'s device: an Ascend NPU when CANN loads. The CANN SIMULATOR is never picked by `auto`
/// (it is a test double, far slower than the CPU): it runs only when asked for by name.
fn open_auto_device(opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "ascend")]
    {
        let cann = ascend_sys::Cann::load().map_err(|e| Error::Unsupported(e.to_string()))?;
        if cann.is_simulator() {
            return Err(Error::Unsupported(format!(
                "{} holds the CANN SIMULATOR (ascend-sim), which auto never picks; use --backend ascend to run on it",
                cann.lib_dir().display()
            )));
        }
        Ok(Box::new(super::ascend::AscendBackend::open_on_with(&cann, 0, opts)?))
    }
    #[cfg(not(feature = "ascend"))]
    open_ascend(0, opts)
}

#[cfg(feature = "ascend")]
fn open_ascend(device: u32, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    Ok(Box::new(super::ascend::AscendBackend::open_with(device, opts)?))
}

#[cfg(not(feature = "ascend"))]
fn open_ascend(device: u32, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    let _ = (device, opts);
    Err(Error::Unsupported("the ascend backend is not compiled into this build (cargo feature `ascend`)".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_names_list_the_known() {
        assert_eq!(BackendKind::parse("cpu").unwrap(), BackendKind::Cpu);
        assert_eq!(BackendKind::parse("ascend:3").unwrap(), BackendKind::Ascend { device: 3 });
        assert_eq!(BackendKind::parse(" auto ").unwrap(), BackendKind::Auto);
        let e = BackendKind::parse("nosuch").unwrap_err().to_string();
        assert!(e.contains("nosuch") && e.contains("cpu") && e.contains("ascend:N"), "{e}");
        assert!(BackendKind::parse("ascend:x").is_err());
    }
}
