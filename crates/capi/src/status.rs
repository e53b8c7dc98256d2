//! Status codes, the per-thread last error, and the panic barrier every export runs under.

use std::cell::RefCell;
use std::ffi::CStr;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::engine::EngineInner;
use super::util::write_str;
use ::tboost_engine::Error;

/// What a call returned. The numbers are stable: new codes are only ever appended.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum tboost_status {
    /// Success.
    TBOOST_OK = 0,
    /// An argument is out of range or malformed (the message names it).
    TBOOST_ERR_INVALID_ARGUMENT = 1,
    /// A required pointer argument is NULL (the message names it).
    TBOOST_ERR_NULL_POINTER = 2,
    /// A handle is not a live handle of the expected kind (never created, already freed,
    /// or a handle of another kind).
    TBOOST_ERR_INVALID_HANDLE = 3,
    /// An output buffer is too small; the `needed` / count output says how much is needed.
    TBOOST_ERR_BUFFER_TOO_SMALL = 4,
    /// A request id (or other name) the engine does not know, or that already finished.
    TBOOST_ERR_NOT_FOUND = 5,
    /// A file could not be opened or read (the message names the file).
    TBOOST_ERR_IO = 6,
    /// A model file is truncated, corrupt or inconsistent (the message names the file and
    /// the tensor or key at fault).
    TBOOST_ERR_MODEL_FORMAT = 7,
    /// The model or option needs something this build or backend does not have.
    TBOOST_ERR_UNSUPPORTED = 8,
    /// The compute backend failed.
    TBOOST_ERR_BACKEND = 9,
    /// The model has no tokenizer: pass token ids instead of text.
    TBOOST_ERR_NO_TOKENIZER = 10,
    /// The request can never fit in the KV cache (prompt + max_tokens).
    TBOOST_ERR_KV_CAPACITY = 11,
    /// The waiting queue is at its limit (`queue_limit`); retry after some requests finish.
    TBOOST_ERR_QUEUE_FULL = 12,
    /// Another thread is inside `tboost_engine_step` on this engine.
    TBOOST_ERR_BUSY = 13,
    /// The operation was stopped by the host (a progress callback returned false).
    TBOOST_ERR_CANCELLED = 14,
    /// A request failed inside the engine (in events only; see `tboost_engine_request_error`).
    TBOOST_ERR_REQUEST_FAILED = 15,
    /// An internal panic was caught at the ABI boundary; the engine it happened in is poisoned.
    TBOOST_ERR_PANIC = 16,
    /// The engine is unusable after an earlier panic: free it and create a new one.
    TBOOST_ERR_POISONED = 17,
    /// A bug in tboost (please report the message).
    TBOOST_ERR_INTERNAL = 18,
}

pub(crate) use tboost_status as Status;

/// Every status with its C name, in number order (for `tboost_status_name`).
pub(crate) const NAMES: &[(Status, &CStr)] = &[
    (Status::TBOOST_OK, c"TBOOST_OK"),
    (Status::TBOOST_ERR_INVALID_ARGUMENT, c"TBOOST_ERR_INVALID_ARGUMENT"),
    (Status::TBOOST_ERR_NULL_POINTER, c"TBOOST_ERR_NULL_POINTER"),
    (Status::TBOOST_ERR_INVALID_HANDLE, c"TBOOST_ERR_INVALID_HANDLE"),
    (Status::TBOOST_ERR_BUFFER_TOO_SMALL, c"TBOOST_ERR_BUFFER_TOO_SMALL"),
    (Status::TBOOST_ERR_NOT_FOUND, c"TBOOST_ERR_NOT_FOUND"),
    (Status::TBOOST_ERR_IO, c"TBOOST_ERR_IO"),
    (Status::TBOOST_ERR_MODEL_FORMAT, c"TBOOST_ERR_MODEL_FORMAT"),
    (Status::TBOOST_ERR_UNSUPPORTED, c"TBOOST_ERR_UNSUPPORTED"),
    (Status::TBOOST_ERR_BACKEND, c"TBOOST_ERR_BACKEND"),
    (Status::TBOOST_ERR_NO_TOKENIZER, c"TBOOST_ERR_NO_TOKENIZER"),
    (Status::TBOOST_ERR_KV_CAPACITY, c"TBOOST_ERR_KV_CAPACITY"),
    (Status::TBOOST_ERR_QUEUE_FULL, c"TBOOST_ERR_QUEUE_FULL"),
    (Status::TBOOST_ERR_BUSY, c"TBOOST_ERR_BUSY"),
    (Status::TBOOST_ERR_CANCELLED, c"TBOOST_ERR_CANCELLED"),
    (Status::TBOOST_ERR_REQUEST_FAILED, c"TBOOST_ERR_REQUEST_FAILED"),
    (Status::TBOOST_ERR_PANIC, c"TBOOST_ERR_PANIC"),
    (Status::TBOOST_ERR_POISONED, c"TBOOST_ERR_POISONED"),
    (Status::TBOOST_ERR_INTERNAL, c"TBOOST_ERR_INTERNAL"),
];

/// A failed call: its status and the message stored as the thread's last error.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: Status,
    pub msg: String,
}

pub(crate) type FfiResult<T = ()> = Result<T, Failure>;

impl Failure {
    pub fn new(status: Status, msg: impl Into<String>) -> Failure {
        Failure { status, msg: msg.into() }
    }
    pub fn invalid(msg: impl Into<String>) -> Failure {
        Failure::new(Status::TBOOST_ERR_INVALID_ARGUMENT, msg)
    }
    pub fn null(param: &str) -> Failure {
        Failure::new(Status::TBOOST_ERR_NULL_POINTER, format!("`{param}` is NULL"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        // Exhaustive on purpose: a new engine error must get a deliberate status.
        let status = match &e {
            Error::Io { .. } => Status::TBOOST_ERR_IO,
            Error::Format { .. } | Error::MissingTensor { .. } | Error::BadTensor { .. } | Error::Config { .. } => {
                Status::TBOOST_ERR_MODEL_FORMAT
            }
            Error::Unsupported(_) => Status::TBOOST_ERR_UNSUPPORTED,
            Error::InvalidArgument { .. } => Status::TBOOST_ERR_INVALID_ARGUMENT,
            // Every C engine is created with its model, so this is a bug if it shows.
            Error::NoModel => Status::TBOOST_ERR_INTERNAL,
            Error::NoTokenizer(_) => Status::TBOOST_ERR_NO_TOKENIZER,
            Error::NotFound(_) => Status::TBOOST_ERR_NOT_FOUND,
            Error::KvCapacity(_) => Status::TBOOST_ERR_KV_CAPACITY,
            Error::QueueFull(_) => Status::TBOOST_ERR_QUEUE_FULL,
            Error::Busy => Status::TBOOST_ERR_BUSY,
            // Work stopped because the host is freeing the engine.
            Error::Interrupted => Status::TBOOST_ERR_CANCELLED,
            Error::Poisoned => Status::TBOOST_ERR_POISONED,
            Error::Backend { .. } => Status::TBOOST_ERR_BACKEND,
        };
        Failure { status, msg: e.to_string() }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_last_error(msg: String) {
    // `try_with`: during thread teardown the slot may be gone; the status still reports.
    let _ = LAST_ERROR.try_with(|s| *s.borrow_mut() = msg);
}

/// The engine a call works on, so that a panic in it can poison that engine.
#[derive(Default)]
pub(crate) struct CallCtx {
    pub engine: Option<Arc<EngineInner>>,
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
pub(crate) fn guard(func: &str, f: impl FnOnce(&mut CallCtx) -> FfiResult) -> tboost_status {
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
        let name = NAMES.iter().find(|(s, _)| *s as i32 == status).map_or(c"TBOOST_UNKNOWN_STATUS", |(_, n)| n);
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
