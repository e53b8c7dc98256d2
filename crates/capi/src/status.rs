//! Status codes and the failure every call reports with them. The bottom of the crate: it
//! imports nothing else from it.

use std::ffi::CStr;

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
    /// A tboost call made from inside a tboost log callback (it would deadlock on the
    /// outer call's locks); the message names both calls. The outer call completes.
    TBOOST_ERR_REENTRANT = 19,
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
    (Status::TBOOST_ERR_REENTRANT, c"TBOOST_ERR_REENTRANT"),
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
            // A collective between tensor-parallel ranks: the ranks are the engine's devices.
            Error::Backend { .. } | Error::Comm { .. } => Status::TBOOST_ERR_BACKEND,
            // The C ABI reports a failed request in its finish event, never as this.
            Error::Request(_) => Status::TBOOST_ERR_INTERNAL,
        };
        Failure { status, msg: e.to_string() }
    }
}
