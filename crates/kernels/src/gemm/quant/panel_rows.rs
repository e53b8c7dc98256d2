//! One row of a block-quantized matrix in the packed layout ([`super::panel_pack`]) as f32:
//! the embedding lookup of a tied table whose only copy is the lm_head's packed panels.
//!
//! Each value is formed with the float steps of ggml's `dequantize_row_*` (`w · A`, `(A · sc) ·
//! w`, `A · w − M`, see `q8_activations`'s module doc for `w`, `A`, `sc`, `M`), so a row read
//! here is bit-identical to [`super::dequantize_row`] of the stored row.

use super::panel_pack;
use crate::gemm::gguf::GROUP;
use crate::{DType, Layout, WeightMat};

/// Whether [`row_to_f32`] reads rows of `dtype` in `layout`.
pub fn reads(dtype: DType, layout: Layout) -> bool {
    layout == Layout::Panels && dtype.is_quantized() && panel_pack::packable(dtype)
}

/// Row `j` of the packed matrix `w` into `out` (`w.cols` values).
pub fn row_to_f32(w: &WeightMat<'_>, j: usize, out: &mut [f32]) {
    assert!(reads(w.dtype, w.layout), "panel_rows: {} in {:?} is not a packed quantized matrix", w.dtype, w.layout);
    assert!(j < w.rows, "panel_rows: row {j} is outside the matrix ({} rows)", w.rows);
    assert_eq!(out.len(), w.cols, "panel_rows: the row has {} values, out {}", w.cols, out.len());
    for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
        let gr = panel_pack::group(w, j, g);
        for (e, o) in o.iter_mut().enumerate() {
            let q = gr.w[e] as f32;
            *o = match w.dtype {
                DType::Q4K | DType::Q5K => gr.a * q - gr.m,
                DType::Q6K => (gr.a * gr.sc[e / (GROUP / 2)] as f32) * q,
                _ => q * gr.a,
            };
        }
    }
}
