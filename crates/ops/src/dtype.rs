//! Element and block types of weights, activations, caches and index buffers.

use std::fmt;

/// Storage type of a tensor or buffer. Dense types have one element per "block"; quantized
/// types (GGUF block formats) pack `block_elems()` values in `block_bytes()` bytes. Integer
/// types hold the per-step index buffers (token ids, positions, slot mapping, block tables,
/// sequence lengths) and quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(into = "&'static str")]
pub enum DType {
    F32,
    F16,
    BF16,
    I64,
    I32,
    U32,
    I8,
    U8,
    Q4_0,
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    Q4_1,
    Q5_1,
    IQ4NL,
    IQ4XS,
    Q2K,
    Q3K,
}

impl From<DType> for &'static str {
    fn from(d: DType) -> &'static str {
        d.name()
    }
}

impl DType {
    pub const ALL: [DType; 20] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U32,
        DType::I8,
        DType::U8,
        DType::Q4_0,
        DType::Q5_0,
        DType::Q8_0,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        // Appended: the C ABI's `tboost_dtype` numbers are indices into this list.
        DType::Q4_1,
        DType::Q5_1,
        DType::IQ4NL,
        DType::IQ4XS,
        DType::Q2K,
        DType::Q3K,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::IQ4NL => "iq4_nl",
            DType::IQ4XS => "iq4_xs",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    /// The dtype called `name` (as `name()` spells it).
    pub fn parse(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Number of values stored in one block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::IQ4NL => 32,
            DType::IQ4XS | DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
            _ => 1,
        }
    }

    /// Bytes of one block (GGUF layouts: ggml-common.h); of one element for dense types.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
            DType::Q4_0 => 2 + 16,
            DType::Q4_1 => 2 + 2 + 16,
            DType::Q5_0 => 2 + 4 + 16,
            DType::Q5_1 => 2 + 2 + 4 + 16,
            DType::Q8_0 => 2 + 32,
            DType::IQ4NL => 2 + 16,
            DType::IQ4XS => 2 + 2 + 4 + 128,
            DType::Q2K => 16 + 64 + 2 + 2,
            DType::Q3K => 32 + 64 + 12 + 2,
            DType::Q4K => 2 + 2 + 12 + 128,
            DType::Q5K => 2 + 2 + 12 + 32 + 128,
            DType::Q6K => 128 + 64 + 16 + 2,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// f32, f16 or bf16: a type activations, KV caches and norm gains can be.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    pub fn is_integer(self) -> bool {
        matches!(self, DType::I64 | DType::I32 | DType::U32 | DType::I8 | DType::U8)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_are_whole() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(d.bytes_for(d.block_elems()), Some(d.block_bytes()));
        }
        assert_eq!(DType::Q4K.bytes_for(255), None);
        assert_eq!(DType::F32.bytes_for(usize::MAX), None);
    }
}
