//! The crate's error type: every message names the file, tensor, shape or parameter at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    /// The file exists but its contents are not a valid model of the claimed format.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },

    /// A required tensor is absent.
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },

    /// A tensor exists but has the wrong shape or dtype for the model's config.
    #[error("{path}: tensor `{tensor}`: {msg}")]
    BadTensor { path: PathBuf, tensor: String, msg: String },

    /// A configuration value is missing, out of range or inconsistent.
    #[error("{source_name}: config `{param}`: {msg}")]
    Config { source_name: String, param: String, msg: String },

    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A caller passed a bad argument (token id out of range, empty prompt, ...).
    #[error("invalid argument `{param}`: {msg}")]
    InvalidArgument { param: String, msg: String },

    /// No model is loaded in the engine yet.
    #[error("no model is loaded")]
    NoModel,

    /// The model carries no tokenizer (the golden test models, for instance): pass token ids.
    #[error("model {0} has no tokenizer; pass token ids instead of text")]
    NoTokenizer(String),

    /// A request id (or other handle) the engine does not know, or no longer tracks.
    #[error("not found: {0}")]
    NotFound(String),

    /// The request can never fit the KV cache.
    #[error("KV cache capacity: {0}")]
    KvCapacity(String),

    /// The waiting queue is at its limit.
    #[error("the request queue is full ({0} waiting requests); retry after some finish")]
    QueueFull(usize),

    /// Another thread is inside `step` on this engine.
    #[error("another thread is stepping this engine")]
    Busy,

    /// An earlier panic inside the engine left it unusable.
    #[error("the engine is poisoned by an earlier internal panic; create a new one")]
    Poisoned,

    /// The host interrupted the engine (it is being freed): the work in progress stopped.
    #[error("interrupted: the engine is shutting down")]
    Interrupted,

    #[error("backend {backend}: {msg}")]
    Backend { backend: String, msg: String },

    /// A collective between tensor-parallel ranks failed (timeout, a rank that left).
    #[error("tensor-parallel rank {rank}: {op}: {msg}")]
    Comm { rank: usize, op: String, msg: String },

    /// A request ended with an error (its finish event's text), for a caller that runs one
    /// request and reports its failure as its own.
    #[error("the request failed: {0}")]
    Request(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: msg.into() }
    }
    pub fn bad_tensor(path: impl Into<PathBuf>, tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::BadTensor { path: path.into(), tensor: tensor.into(), msg: msg.into() }
    }
    pub fn config(source_name: impl Into<String>, param: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Config { source_name: source_name.into(), param: param.into(), msg: msg.into() }
    }
    pub fn invalid(param: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::InvalidArgument { param: param.into(), msg: msg.into() }
    }

    /// This error with `note` appended to its message, keeping its kind (and so the C ABI
    /// status it maps to). Kinds without a free-text message stay as they are.
    pub fn with_note(mut self, note: &str) -> Self {
        match &mut self {
            Error::Backend { msg, .. } | Error::Comm { msg, .. } | Error::InvalidArgument { msg, .. } => {
                msg.push_str(note)
            }
            Error::Unsupported(msg) => msg.push_str(note),
            _ => {}
        }
        self
    }
}
