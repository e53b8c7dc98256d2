//! The panic barrier every export runs under, the per-thread last error it stores, and the
//! names of statuses and finish reasons.

use std::cell::{Cell, RefCell};
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::status::{tboost_status, Failure, FfiResult, Status};
use super::util::write_str;

/// What a panic poisons: the engine a call was working on.
pub(crate) trait Poison: Send + Sync {
    fn poison(&self);
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The outermost export this thread is inside, to name it in a re-entry error.
    static CURRENT: Cell<Option<&'static str>> = const { Cell::new(None) };
    /// While this thread runs the host's log callback: the export that fired it, or "" for a
    /// record logged by one of tboost's own threads.
    static IN_LOG_CALLBACK: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Marks this thread as running the host's log callback until dropped.
pub(crate) struct LogCallbackScope(Option<&'static str>);

impl LogCallbackScope {
    pub fn enter() -> LogCallbackScope {
        let outer = CURRENT.try_with(Cell::get).ok().flatten().unwrap_or("");
        LogCallbackScope(IN_LOG_CALLBACK.try_with(|c| c.replace(Some(outer))).ok().flatten())
    }
}

impl Drop for LogCallbackScope {
    fn drop(&mut self) {
        let _ = IN_LOG_CALLBACK.try_with(|c| c.set(self.0));
    }
}

/// The error of a call made from a log callback. The outer call may hold the locks `func`
/// needs (the engine's, the log sink's), so running it could deadlock the host.
fn reentry() -> Option<Failure> {
    let outer = IN_LOG_CALLBACK.try_with(Cell::get).ok().flatten()?;
    let fired = if outer.is_empty() { "by one of tboost's threads".to_string() } else { format!("inside {outer}") };
    Some(Failure::new(
        Status::TBOOST_ERR_REENTRANT,
        format!(
            "called from a tboost log callback (fired {fired}); tboost functions other than \
             tboost_last_error and the *_name lookups must not be called from a log callback: \
             record what is needed and make the call after the callback returns"
        ),
    ))
}

/// Records `func` as this thread's outermost export until dropped.
struct CallScope(bool);

impl CallScope {
    fn enter(func: &'static str) -> CallScope {
        let outermost = CURRENT
            .try_with(|c| {
                let first = c.get().is_none();
                if first {
                    c.set(Some(func));
                }
                first
            })
            .unwrap_or(false);
        CallScope(outermost)
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        if self.0 {
            let _ = CURRENT.try_with(|c| c.set(None));
        }
    }
}

fn set_last_error(msg: String) {
    // `try_with`: during thread teardown the slot may be gone; the status still reports.
    let _ = LAST_ERROR.try_with(|s| *s.borrow_mut() = msg);
}

/// The engine a call works on, so that a panic in it can poison that engine.
#[derive(Default)]
pub(crate) struct CallCtx {
    pub engine: Option<Arc<dyn Poison>>,
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Drops a panic payload; its destructor could itself panic, which must not escape either.
fn drop_payload(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(|| drop(payload))) {
        std::mem::forget(again);
    }
}

/// The panic barrier for status-returning exports: runs `f`, turns a `Failure` into its
/// status plus the thread's last error (prefixed with the function name), and a panic into
/// `TBOOST_ERR_PANIC`, poisoning the engine the call was working on.
pub(crate) fn guard(func: &'static str, f: impl FnOnce(&mut CallCtx) -> FfiResult) -> tboost_status {
    if let Some(fail) = reentry() {
        set_last_error(format!("{func}: {}", fail.msg));
        return fail.status;
    }
    let _scope = CallScope::enter(func);
    let mut ctx = CallCtx::default();
    match catch_unwind(AssertUnwindSafe(|| f(&mut ctx))) {
        Ok(Ok(())) => Status::TBOOST_OK,
        Ok(Err(fail)) => {
            set_last_error(format!("{func}: {}", fail.msg));
            fail.status
        }
        Err(payload) => {
            let text = panic_text(payload.as_ref());
            drop_payload(payload);
            let mut msg = format!("{func}: internal panic: {text}");
            if let Some(e) = ctx.engine.take() {
                e.poison();
                msg.push_str(" (the engine is now poisoned; free it and create a new one)");
            }
            set_last_error(msg);
            Status::TBOOST_ERR_PANIC
        }
    }
}

/// The panic barrier for exports that return a value instead of a status: `fallback` on panic.
pub(crate) fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            drop_payload(payload);
            fallback
        }
    }
}

/// The C name of a status ("TBOOST_ERR_BUSY"); "TBOOST_UNKNOWN_STATUS" for a number no
/// version of tboost defines. A static string: never free it.
#[no_mangle]
pub extern "C" fn tboost_status_name(status: i32) -> *const c_char {
    guard_value(c"TBOOST_UNKNOWN_STATUS".as_ptr(), || {
        let name =
            super::status::NAMES.iter().find(|(s, _)| *s as i32 == status).map_or(c"TBOOST_UNKNOWN_STATUS", |(_, n)| n);
        name.as_ptr()
    })
}

/// The stable lowercase name of a finish reason ("length", "eos", "stop_sequence",
/// "cancelled", "error", "none"); "unknown" otherwise. A static string: never free it.
#[no_mangle]
pub extern "C" fn tboost_finish_reason_name(reason: i32) -> *const c_char {
    guard_value(c"unknown".as_ptr(), || {
        let name = match reason {
            0 => c"none",
            1 => c"length",
            2 => c"eos",
            3 => c"stop_sequence",
            4 => c"cancelled",
            5 => c"error",
            _ => c"unknown",
        };
        name.as_ptr()
    })
}

/// Copies the message of the most recent failed call *on this OS thread* into `buf`
/// (NUL-terminated, UTF-8). A successful call does not clear it; "" when nothing failed yet.
///
/// `*needed` (if not NULL) receives the message size in bytes including the NUL. When
/// `cap` is smaller, the first `cap - 1` bytes (cut at a character boundary) and a NUL are
/// written and `TBOOST_ERR_BUFFER_TOO_SMALL` is returned. `buf` may be NULL when `cap` is 0
/// (a size query). This function never changes the last error itself.
///
/// Go: goroutines move between OS threads between two cgo calls, so read the last error in
/// the same C call that failed (a `static inline` helper in the cgo preamble).
#[no_mangle]
pub unsafe extern "C" fn tboost_last_error(buf: *mut c_char, cap: usize, needed: *mut usize) -> tboost_status {
    guard_value(Status::TBOOST_ERR_PANIC, || {
        let msg = LAST_ERROR.try_with(|s| s.borrow().clone()).unwrap_or_default();
        // SAFETY: the caller promises `buf` holds `cap` bytes and `needed` is NULL or valid.
        match unsafe { write_str(&msg, buf, cap, needed) } {
            Ok(()) => Status::TBOOST_OK,
            Err(f) => f.status,
        }
    })
}
