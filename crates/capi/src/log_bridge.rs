//! The bridge from the `log` crate to the host: a callback, or stderr by default.

use std::ffi::CString;
use std::os::raw::c_void;
use std::sync::{Once, RwLock};

use log::{Level, LevelFilter, Log, Metadata, Record};

use super::guard::{guard, LogCallbackScope};
use super::status::{tboost_status, Failure, Status};
use super::types::{tboost_log_fn, tboost_log_level};

struct Sink {
    cb: tboost_log_fn,
    /// The host's `user_data`, kept as an integer: tboost never dereferences it.
    user: usize,
    level: LevelFilter,
}

/// Until the host says otherwise: warnings and errors to stderr.
static SINK: RwLock<Sink> = RwLock::new(Sink { cb: None, user: 0, level: LevelFilter::Warn });
static INSTALL: Once = Once::new();
static BRIDGE: Bridge = Bridge;

struct Bridge;

fn sink() -> std::sync::RwLockReadGuard<'static, Sink> {
    SINK.read().unwrap_or_else(|e| e.into_inner())
}

impl Log for Bridge {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level() <= sink().level
    }

    fn log(&self, r: &Record) {
        // The read lock is held during the callback, so once `tboost_log_set` returns the
        // previous callback is never called again and its user_data may be released.
        let s = sink();
        if r.level() > s.level {
            return;
        }
        match s.cb {
            Some(cb) => {
                let text = |v: String| CString::new(v.replace('\0', "\\0")).unwrap_or_default();
                let target = text(r.target().to_string());
                let msg = text(r.args().to_string());
                let level = match r.level() {
                    Level::Error => tboost_log_level::TBOOST_LOG_ERROR,
                    Level::Warn => tboost_log_level::TBOOST_LOG_WARN,
                    Level::Info => tboost_log_level::TBOOST_LOG_INFO,
                    Level::Debug => tboost_log_level::TBOOST_LOG_DEBUG,
                    Level::Trace => tboost_log_level::TBOOST_LOG_TRACE,
                };
                // A tboost call from the callback is refused, not run: it could deadlock
                // on the locks this thread holds (this read lock, the engine's).
                let _scope = LogCallbackScope::enter();
                // SAFETY: the host registered `cb` with this user_data; the strings live
                // until it returns.
                unsafe { cb(level, target.as_ptr(), msg.as_ptr(), s.user as *mut c_void) };
            }
            None => eprintln!("tboost {} {}: {}", r.level(), r.target(), r.args()),
        }
    }

    fn flush(&self) {}
}

/// Installs the bridge as the process's `log` logger once. Called by every entry point that
/// can log, so the default (warnings to stderr) holds even if the host never sets a sink.
pub(crate) fn ensure_logger() {
    INSTALL.call_once(|| {
        if log::set_logger(&BRIDGE).is_ok() {
            log::set_max_level(sink().level);
        }
    });
}

fn is_ours() -> bool {
    // `log::logger()` returns a no-op logger until one is set; compare addresses.
    std::ptr::addr_eq(log::logger() as *const dyn Log, &BRIDGE as *const Bridge)
}

/// Sends tboost's log records at `max_level` (a `TBOOST_LOG_*`) or more severe to `cb`;
/// `cb` NULL sends them to stderr. The default, before any call, is warnings and errors to
/// stderr. Process-wide and thread-safe; when it returns, the previous callback is no longer
/// running nor called again.
///
/// Returns `TBOOST_ERR_INVALID_ARGUMENT` for an unknown level, `TBOOST_ERR_UNSUPPORTED` when
/// another `log` logger already owns this process (a Rust host that links tboost's rlib).
#[no_mangle]
pub extern "C" fn tboost_log_set(cb: tboost_log_fn, user_data: *mut c_void, max_level: i32) -> tboost_status {
    guard("tboost_log_set", |_| {
        let level = match max_level {
            0 => LevelFilter::Off,
            1 => LevelFilter::Error,
            2 => LevelFilter::Warn,
            3 => LevelFilter::Info,
            4 => LevelFilter::Debug,
            5 => LevelFilter::Trace,
            _ => {
                return Err(Failure::invalid(format!(
                    "`max_level` {max_level} is not a TBOOST_LOG_* level (0 = off .. 5 = trace)"
                )))
            }
        };
        ensure_logger();
        if !is_ours() {
            return Err(Failure::new(
                Status::TBOOST_ERR_UNSUPPORTED,
                "another `log` logger is installed in this process; tboost logs go there",
            ));
        }
        {
            let mut s = SINK.write().unwrap_or_else(|e| e.into_inner());
            *s = Sink { cb, user: user_data as usize, level };
        }
        log::set_max_level(level);
        Ok(())
    })
}
