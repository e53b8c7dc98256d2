//! Element types and memory formats as aclnn names them, and the byte view of host slices: the
//! vocabulary the runtime (copies) and the tensors (aclTensor descriptors) share.

use half::{bf16, f16};

use crate::raw;

/// Element types tboost moves through aclnn (the `aclDataType` values of research notes §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Bf16,
    F64,
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    Bool,
    /// INT4, two per byte (the A16W4 weight of `aclnnWeightQuantBatchMatmulV2`); element `2i` in the
    /// low nibble of byte `i` (an assumption no public doc states: on the README's "needs real hardware" list).
    I4,
}

impl DType {
    /// Bytes per element, rounded up (I4: 1); byte arithmetic on tensors uses [`DType::bits`].
    pub fn size(self) -> usize {
        match self {
            DType::I4 => 1,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            DType::I4 => 4,
            d => 8 * d.size(),
        }
    }

    pub fn to_acl(self) -> raw::aclDataType {
        match self {
            DType::I4 => raw::aclDataType_ACL_INT4,
            DType::F32 => raw::aclDataType_ACL_FLOAT,
            DType::F16 => raw::aclDataType_ACL_FLOAT16,
            DType::Bf16 => raw::aclDataType_ACL_BF16,
            DType::F64 => raw::aclDataType_ACL_DOUBLE,
            DType::I8 => raw::aclDataType_ACL_INT8,
            DType::U8 => raw::aclDataType_ACL_UINT8,
            DType::I16 => raw::aclDataType_ACL_INT16,
            DType::U16 => raw::aclDataType_ACL_UINT16,
            DType::I32 => raw::aclDataType_ACL_INT32,
            DType::U32 => raw::aclDataType_ACL_UINT32,
            DType::I64 => raw::aclDataType_ACL_INT64,
            DType::U64 => raw::aclDataType_ACL_UINT64,
            DType::Bool => raw::aclDataType_ACL_BOOL,
        }
    }
}

/// Storage formats (`aclFormat`): ND everywhere; FRACTAL_NZ is what 310P caches and weights use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Nd,
    FractalNz,
}

impl Format {
    pub fn to_acl(self) -> raw::aclFormat {
        match self {
            Format::Nd => raw::aclFormat_ACL_FORMAT_ND,
            Format::FractalNz => raw::aclFormat_ACL_FORMAT_FRACTAL_NZ,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Host element types with a matching [`DType`]; plain old data, so slices of them are byte slices.
pub trait Element: sealed::Sealed + Copy + Default + 'static {
    const DTYPE: DType;
}
macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => F32, f16 => F16, bf16 => Bf16, f64 => F64, i8 => I8, u8 => U8, i16 => I16, u16 => U16, i32 => I32,
    u32 => U32, i64 => I64, u64 => U64);

pub(crate) fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are plain old data without padding.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}
pub(crate) fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}
