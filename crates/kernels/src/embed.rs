//! Embedding lookup: copies (and converts to f32) one table row per id.
//!
//! Dense tables (f32, f16, bf16) convert element by element; GGUF block-quantized tables
//! dequantize the one row through `crate::gemm::quant::dequantize_row` (never the whole table).

use rayon::prelude::*;

use crate::{DType, WeightMat};

/// Every table dtype is supported: dense rows convert, block-quantized rows dequantize (stored,
/// or packed in panels: `gemm::quant::panel_rows`).
pub fn supports(dtype: DType) -> Result<(), tboost_ops::Unsupported> {
    let _ = dtype;
    Ok(())
}

/// `out[i] = table[ids[i]]` as f32. Ids must be `< table.rows` (the orchestrator checks
/// them against the vocabulary first and reports bad ids as a user error).
pub fn embed(ids: &[u32], table: WeightMat<'_>, out: &mut [f32]) {
    let cols = table.cols;
    assert_eq!(
        out.len(),
        ids.len() * cols,
        "embed: {} ids of {cols} values need {} outputs, got {}",
        ids.len(),
        ids.len() * cols,
        out.len()
    );
    if cols == 0 {
        return;
    }
    out.par_chunks_mut(cols).zip(ids.par_iter()).with_min_len(16).for_each(|(o, &id)| {
        assert!((id as usize) < table.rows, "embed: id {id} is outside the table ({} rows)", table.rows);
        row_to_f32(table, id as usize, o);
    });
}

/// Converts one weight row to f32 (any supported dtype).
pub fn row_to_f32(table: WeightMat<'_>, row: usize, out: &mut [f32]) {
    assert!(row < table.rows, "row_to_f32: row {row} is outside the table ({} rows)", table.rows);
    assert_eq!(out.len(), table.cols, "row_to_f32: the row has {} values, out {}", table.cols, out.len());
    if table.layout != crate::Layout::Rows {
        // A tied table kept only as the lm_head's packed panels.
        return crate::gemm::quant::panel_rows::row_to_f32(&table, row, out);
    }
    let bytes = table.row(row);
    match table.dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        q => {
            // The table was checked at load time (whole blocks per row), so this cannot fail.
            if let Err(e) = crate::gemm::quant::dequantize_row(q, bytes, out) {
                panic!("embed: {q} row {row}: {e}");
            }
        }
    }
}
