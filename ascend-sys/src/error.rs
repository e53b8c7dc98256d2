//! Errors: one enum for everything the bindings can report.
//!
//! A failing CANN call becomes [`AclError::Runtime`] (AscendCL `aclError`) or [`AclError::Op`]
//! (aclnn `aclnnStatus`); both carry the call or op name, the numeric code, its documented name
//! when known, and the text of `aclGetRecentErrMsg()` read right after the failure (the code alone
//! is rarely enough: research notes §5.2).

use std::fmt;
use std::path::PathBuf;

/// Which half of the two-phase aclnn protocol failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `aclnnXxxGetWorkspaceSize`: argument checks, shape inference, tiling.
    GetWorkspaceSize,
    /// `aclnnXxx`: the launch on the stream.
    Execute,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::GetWorkspaceSize => "GetWorkspaceSize",
            Phase::Execute => "execute",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AclError {
    /// None of the search directories holds the library.
    #[error("{what} not found; searched: {}", join(.searched))]
    NotFound { what: &'static str, searched: Vec<PathBuf> },
    /// dlopen failed (missing dependency, wrong architecture, ...).
    #[error("failed to load {}: {reason}", .path.display())]
    Load { path: PathBuf, reason: String },
    /// A symbol every CANN version has is missing: the file is not (a complete) CANN.
    #[error("{} lacks {symbol}, which every supported CANN version exports", .library.display())]
    MissingSymbol { library: PathBuf, symbol: &'static str },
    /// The op's `GetWorkspaceSize`/execute pair is not exported by any operator library.
    #[error("{op} is not available in this CANN installation (searched {})", join(.libraries))]
    OpUnavailable { op: String, libraries: Vec<PathBuf> },
    /// An optional runtime function this call needs is missing.
    #[error("{symbol} is not exported by this CANN runtime ({})", .library.display())]
    FunctionUnavailable { library: PathBuf, symbol: &'static str },
    /// An AscendCL call returned a non-zero `aclError`.
    #[error("{call} failed with {code}{}{}", code_name(*.code).map(|n| format!(" ({n})")).unwrap_or_default(), msg(.message))]
    Runtime { call: &'static str, code: i32, message: String },
    /// An aclnn op returned a non-zero `aclnnStatus`.
    #[error("{op} {phase} failed with {status}{}{}", code_name(*.status).map(|n| format!(" ({n})")).unwrap_or_default(), msg(.message))]
    Op { op: &'static str, phase: Phase, status: i32, message: String },
    /// A create function (aclCreateTensor, ...) returned NULL.
    #[error("{call} returned NULL{}", msg(.message))]
    NullHandle { call: &'static str, message: String },
    /// An HCCL call returned a non-zero `HcclResult`.
    #[error("{call} failed with {code} ({}){}", hccl_result_name(*.code), msg(.message))]
    Hccl { call: &'static str, code: u32, message: String },
    /// A caller error caught before calling CANN: shapes, bounds, dtypes.
    #[error("{0}")]
    Invalid(String),
}

impl AclError {
    /// The numeric CANN code, for `Runtime` and `Op` errors.
    pub fn code(&self) -> Option<i32> {
        match self {
            AclError::Runtime { code, .. } => Some(*code),
            AclError::Op { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// `aclGetRecentErrMsg()` as read after the failure (empty when CANN had none).
    pub fn message(&self) -> &str {
        match self {
            AclError::Runtime { message, .. }
            | AclError::Op { message, .. }
            | AclError::NullHandle { message, .. }
            | AclError::Hccl { message, .. } => message,
            _ => "",
        }
    }
}

pub type Result<T, E = AclError> = std::result::Result<T, E>;

fn join(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

fn msg(m: &str) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!(": {m}")
    }
}

/// The documented name of an `aclError` or `aclnnStatus` code (research notes §2.2, §3.1).
pub fn code_name(code: i32) -> Option<&'static str> {
    Some(match code {
        100000 => "ACL_ERROR_INVALID_PARAM",
        100001 => "ACL_ERROR_UNINITIALIZE",
        100002 => "ACL_ERROR_REPEAT_INITIALIZE",
        100003 => "ACL_ERROR_INVALID_FILE",
        100037 => "ACL_ERROR_REPEAT_FINALIZE",
        107002 => "ACL_ERROR_RT_CONTEXT_NULL: no current device on this thread (aclrtSetDevice)",
        200000 => "ACL_ERROR_BAD_ALLOC",
        200001 => "ACL_ERROR_API_NOT_SUPPORT",
        200002 => "ACL_ERROR_INVALID_DEVICE",
        500000 => "ACL_ERROR_INTERNAL_ERROR",
        500001 => "ACL_ERROR_FAILURE",
        500003 => "ACL_ERROR_RT_FAILURE",
        500004 => "ACL_ERROR_DRV_FAILURE",
        161001 => "ACLNN_ERR_PARAM_NULLPTR",
        161002 => "ACLNN_ERR_PARAM_INVALID",
        361001 => "ACLNN_ERR_RUNTIME_ERROR",
        561000 => "ACLNN_ERR_INNER",
        561001 => "ACLNN_ERR_INNER_INFERSHAPE_ERROR",
        561002 => "ACLNN_ERR_INNER_TILING_ERROR",
        561003 => "ACLNN_ERR_INNER_FIND_KERNEL_ERROR: possibly the operator binary package is not installed",
        _ => return None,
    })
}

/// The documented name of an `HcclResult` (HCOMM `hccl_types.h`, research notes §4.1).
pub fn hccl_result_name(code: u32) -> &'static str {
    match code {
        0 => "HCCL_SUCCESS",
        1 => "HCCL_E_PARA",
        2 => "HCCL_E_PTR",
        3 => "HCCL_E_MEMORY",
        4 => "HCCL_E_INTERNAL",
        5 => "HCCL_E_NOT_SUPPORT",
        6 => "HCCL_E_NOT_FOUND",
        7 => "HCCL_E_UNAVAIL",
        8 => "HCCL_E_SYSCALL",
        9 => "HCCL_E_TIMEOUT",
        10 => "HCCL_E_OPEN_FILE_FAILURE",
        11 => "HCCL_E_TCP_CONNECT",
        12 => "HCCL_E_ROCE_CONNECT",
        15 => "HCCL_E_RUNTIME",
        24 => "HCCL_E_OOM",
        _ => "unknown HcclResult",
    }
}
