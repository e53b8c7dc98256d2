//! Element type conversion between f32, f16 and bf16 (round to nearest even), in bytes.

use half::{bf16, f16};

use crate::DType;

/// Whether `convert` handles `from` → `to`.
pub fn supports(from: DType, to: DType) -> Result<(), tboost_ops::Unsupported> {
    for d in [from, to] {
        if !d.is_float() {
            return Err(tboost_ops::Unsupported::new("dtype", d, "f32, f16 or bf16"));
        }
    }
    Ok(())
}

fn get(dtype: DType, b: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
        DType::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        other => panic!("convert: {other} is not a float type"),
    }
}

fn put(dtype: DType, b: &mut [u8], i: usize, v: f32) {
    match dtype {
        DType::F32 => b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        DType::F16 => b[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        DType::BF16 => b[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        other => panic!("convert: {other} is not a float type"),
    }
}

/// `dst = src` converted, `n` elements.
///
/// # Panics
/// On non-float dtypes or buffers that do not hold `n` elements.
pub fn convert(from: DType, src: &[u8], to: DType, dst: &mut [u8], n: usize) {
    assert!(
        Some(src.len()) == from.bytes_for(n) && Some(dst.len()) == to.bytes_for(n),
        "convert: {} and {} bytes for {n} elements of {from} -> {to}",
        src.len(),
        dst.len()
    );
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    for i in 0..n {
        put(to, dst, i, get(from, src, i));
    }
}
