//! Weight tensors as the CPU kernels see them, and weight conversion for backends that lack
//! a weight type (the plan's "convert at upload").

use tboost_kernels::quant::dequantize_row;
use tboost_kernels::{convert, WeightMat, WeightVec};
use tboost_ops::DType;

use crate::model::Tensor;
use crate::{Error, Result};

/// A tensor as a row-major matrix (a vector is one row).
pub(super) fn mat(t: &Tensor) -> WeightMat<'_> {
    let (r, c) = t.rows_cols();
    WeightMat { dtype: t.dtype, rows: r, cols: c, data: t.bytes() }
}

pub(super) fn vec(t: &Tensor) -> WeightVec<'_> {
    WeightVec { dtype: t.dtype, len: t.numel(), data: t.bytes() }
}

/// `t` converted to `to` (f32, f16 or bf16): block-quantized rows are dequantized one at a
/// time (ggml's values), dense types converted with round-to-nearest-even. The result is an
/// owned tensor of the same name and shape.
pub fn convert_weight(t: &Tensor, to: DType) -> Result<Tensor> {
    if !to.is_float() {
        return Err(Error::Unsupported(format!("tensor `{}`: cannot convert weights to {to}", t.name)));
    }
    let (rows, cols) = t.rows_cols();
    let out_bytes = to
        .bytes_for(rows * cols)
        .ok_or_else(|| Error::Unsupported(format!("tensor `{}`: {rows}x{cols} {to} overflows", t.name)))?;
    let mut out = Vec::new();
    out.try_reserve_exact(out_bytes)
        .map_err(|_| Error::Unsupported(format!("tensor `{}`: cannot allocate {out_bytes} bytes", t.name)))?;
    out.resize(out_bytes, 0);
    let w = mat(t);
    let row_out = to.block_bytes() * cols;
    let mut f = vec![0f32; cols];
    for r in 0..rows {
        let dst = &mut out[r * row_out..(r + 1) * row_out];
        if t.dtype.is_quantized() {
            dequantize_row(t.dtype, w.row(r), &mut f)
                .map_err(|e| Error::Unsupported(format!("tensor `{}`: {e}", t.name)))?;
            let src: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
            convert::convert(DType::F32, &src, to, dst, cols);
        } else if t.dtype.is_float() {
            convert::convert(t.dtype, w.row(r), to, dst, cols);
        } else {
            return Err(Error::Unsupported(format!("tensor `{}`: {} weights cannot be converted", t.name, t.dtype)));
        }
    }
    Tensor::owned(t.name.clone(), to, t.shape.clone(), out)
        .map_err(|e| Error::Unsupported(format!("tensor `{}`: {e}", t.name)))
}
