//! The conformance suite's parts: the reference numbers, the comparison, the driver, and the
//! case table by op family (one module each).

pub mod attention;
pub mod data;
pub mod kv_cache;
pub mod matmul;
pub mod measure;
pub mod moe;
pub mod norm;
pub mod numbers;
pub mod rope;
pub mod suite;
