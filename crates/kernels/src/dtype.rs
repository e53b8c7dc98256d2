//! Element and block types: the orchestrator's vocabulary (`tboost-ops`), re-exported.

pub use tboost_ops::DType;
