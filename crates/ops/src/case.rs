//! What a capability check is asked about (the *case*), the parameters that define an op's
//! math, and the structured answer when an operator cannot take a case.

use std::borrow::Cow;
use std::fmt;

use serde::Serialize;

use crate::DType;

/// Why an operator does not take a case: which parameter, its value, and what the operator
/// needs instead. Plans record these as data (the JSON plan prints the three fields), so
/// nothing downstream has to match words in a message.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Unsupported {
    /// The parameter at fault (`head_dim`, `kv_dtype`, `symbol`, `cann_version`, ...).
    pub param: Cow<'static, str>,
    /// Its value in this case.
    pub value: String,
    /// What the operator accepts.
    pub need: String,
}

impl Unsupported {
    pub fn new(param: impl Into<Cow<'static, str>>, value: impl fmt::Display, need: impl Into<String>) -> Self {
        Unsupported { param: param.into(), value: value.to_string(), need: need.into() }
    }
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={} is not {}", self.param, self.value, self.need)
    }
}

impl std::error::Error for Unsupported {}

/// Which part of a step an attention operator serves: sequences catching up many tokens
/// (prefill chunks) or sequences one token behind (decodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnPhase {
    Prefill,
    Decode,
}

/// The full case an attention operator is asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct AttentionCase {
    pub phase: AttnPhase,
    pub head_dim: usize,
    pub n_heads: usize,
    pub kv_heads: usize,
    /// Element type of q and out.
    pub act_dtype: DType,
    pub kv_dtype: DType,
    /// Tokens per KV block of the paged cache.
    pub block_size: usize,
    /// Longest context a sequence may reach (the cache's capacity for one sequence).
    pub max_context: usize,
    /// Sliding-window attention: a query sees only the last `sliding_window` positions
    /// (itself included); 0 = every earlier position.
    pub sliding_window: usize,
}

/// KV positions per FlashAttention tile unless a caller chooses (`AttnParams::tile_kv`).
pub const DEFAULT_TILE_KV: usize = 64;

/// The FlashAttention KV tiles a caller may choose (the CPU kernel is compiled for each).
pub const TILE_KV_CHOICES: [usize; 5] = [16, 32, 64, 128, 256];

/// Whether `tile_kv` is one of [`TILE_KV_CHOICES`].
pub fn check_tile_kv(tile_kv: usize) -> Result<(), Unsupported> {
    if !TILE_KV_CHOICES.contains(&tile_kv) {
        return Err(Unsupported::new("tile_kv", tile_kv, "a power of two in 16..=256"));
    }
    Ok(())
}

/// Shape parameters of an attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// FlashAttention's KV tile (positions per tile, tiles at absolute multiples of it):
    /// a power of two in 16..=256, [`DEFAULT_TILE_KV`] by default. Other attention kernels
    /// ignore it.
    pub tile_kv: usize,
    /// Sliding window: the query at position `p` attends to positions `p + 1 - window ..= p`
    /// (clamped at 0); 0 = plain causal attention over every earlier position.
    pub window: usize,
}

impl AttnParams {
    /// First position the query at `pos` attends to.
    #[inline]
    pub fn first_visible(&self, pos: usize) -> usize {
        if self.window == 0 {
            0
        } else {
            (pos + 1).saturating_sub(self.window)
        }
    }

    /// Parameters with the default tile.
    pub fn new(n_heads: usize, kv_heads: usize, head_dim: usize, scale: f32) -> AttnParams {
        AttnParams { n_heads, kv_heads, head_dim, scale, tile_kv: DEFAULT_TILE_KV, window: 0 }
    }
}

/// How activations meet weights in a matmul: `Exact` keeps activations in the activation
/// dtype (f32 on the CPU) against dequantized weights; `Fast` may quantize activations (to
/// 8-bit, per row and block) to use integer dot products, as llama.cpp does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    Exact,
    Fast,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }

    pub fn parse(s: &str) -> Option<Precision> {
        match s {
            "exact" => Some(Precision::Exact),
            "fast" => Some(Precision::Fast),
            _ => None,
        }
    }
}

/// One weight matrix `[rows = out, cols = in]` of `dtype` meeting `act_dtype` activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct MatMulCase {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub act_dtype: DType,
    pub precision: Precision,
}

impl MatMulCase {
    /// An f32-activation, exact-precision case (the CPU default).
    pub fn f32(dtype: DType, rows: usize, cols: usize) -> MatMulCase {
        MatMulCase { dtype, rows, cols, act_dtype: DType::F32, precision: Precision::Exact }
    }
}
