//! Element and block types of weights and caches.

use std::fmt;

/// Storage type of a tensor. Dense types have one element per "block"; quantized types
/// (GGUF block formats) pack `block_elems()` values in `block_bytes()` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q4_0 => "q4_0",
            DType::Q5_0 => "q5_0",
            DType::Q8_0 => "q8_0",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    /// Number of values stored in one block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => 32,
            DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes of one block (GGUF layouts: ggml-common.h).
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 2 + 16,
            DType::Q5_0 => 2 + 4 + 16,
            DType::Q8_0 => 2 + 32,
            DType::Q4K => 2 + 2 + 12 + 128,
            DType::Q5K => 2 + 2 + 12 + 32 + 128,
            DType::Q6K => 128 + 64 + 16 + 2,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes needed for `n` values, or `None` when `n` is not a whole number of blocks
    /// (or the size overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
