//! Weight tensors as the CPU kernels see them, and weight conversion for backends that lack
//! a weight type (the plan's "convert at upload").

use tboost_kernels::gemm::dense::{amx_pair_panels, bf16_pair_panels, exact_panels};
use tboost_kernels::gemm::quant::{dequantize_row, panel_pack, panel_rows};
use tboost_kernels::{convert, Layout, WeightMat, WeightVec};
use tboost_ops::{DType, Precision};

use super::CpuBackend;
use crate::model::hugepages::{Arena, Region};
use crate::model::tensor::ROWS_PART_BYTES;
use crate::model::Tensor;
use crate::{Error, Result};

/// A tensor as a row-major matrix (a vector is one row).
pub(super) fn mat(t: &Tensor) -> WeightMat<'_> {
    let (r, c) = t.rows_cols();
    WeightMat { dtype: t.dtype, rows: r, cols: c, data: t.bytes(), layout: Default::default() }
}

pub(super) fn vec(t: &Tensor) -> WeightVec<'_> {
    WeightVec { dtype: t.dtype, len: t.numel(), data: t.bytes() }
}

/// A weight as the CPU kernels read it.
pub(super) enum CpuWeight {
    /// In the layout the model stores it: the file map, or a copy of it in huge pages.
    Stored(Tensor),
    /// A matmul weight repacked into 16-row panels (`layout`: see [`packable`]), in the
    /// backend's huge-page arena.
    Packed { name: String, dtype: DType, rows: usize, cols: usize, layout: Layout, bytes: Region },
}

impl CpuWeight {
    /// The weight as a matmul reads it (either layout).
    pub fn matmul(&self) -> WeightMat<'_> {
        match self {
            CpuWeight::Stored(t) => mat(t),
            CpuWeight::Packed { dtype, rows, cols, layout, bytes, .. } => WeightMat {
                dtype: *dtype,
                rows: *rows,
                cols: *cols,
                data: &bytes[..packed_len(*dtype, *layout, *rows, *cols)],
                layout: *layout,
            },
        }
    }

    /// Its dtype and the bytes it holds.
    pub fn resident(&self) -> (DType, &[u8]) {
        match self {
            CpuWeight::Stored(t) => (t.dtype, t.bytes()),
            CpuWeight::Packed { dtype, .. } => (*dtype, self.matmul().data),
        }
    }

    /// The weight as the embedding lookup reads its rows: as stored, or packed in a layout
    /// whose rows it can read ([`rows_readable_packed`]: a tied table kept only as the lm_head's
    /// panels).
    pub fn rows(&self, op: &str) -> Result<WeightMat<'_>> {
        match self {
            CpuWeight::Stored(t) => Ok(mat(t)),
            CpuWeight::Packed { dtype, layout, .. } if panel_rows::reads(*dtype, *layout) => Ok(self.matmul()),
            CpuWeight::Packed { name, .. } => Err(CpuBackend::err(format!(
                "{op}: weight `{name}` was repacked for matmuls in a layout whose rows cannot be read (a bug in the plan)"
            ))),
        }
    }

    /// The weight as stored, for ops that read rows (embedding, MoE experts).
    pub fn stored(&self, op: &str) -> Result<&Tensor> {
        match self {
            CpuWeight::Stored(t) => Ok(t),
            CpuWeight::Packed { name, .. } => Err(CpuBackend::err(format!(
                "{op}: weight `{name}` was repacked for matmuls and cannot be read as rows (a bug in the plan)"
            ))),
        }
    }
}

/// The layout [`pack`] gives `dtype` matmul weights run at `precision`, if any: GGUF block
/// types for the `Fast` integer kernels (1.5-2x the GEMV of the GGUF layout, which must
/// reduce every group across lanes), bf16 for `Fast`'s `vdpbf16ps` kernel where it runs, f16
/// for `Fast`'s AMX split kernel where AMX-BF16 runs, f16 and bf16 for the `Exact` kernels (1.3-1.7x the GEMV of the row layout); see
/// `gemm::quant::panel_pack`, `gemm::dense::exact_panels`, `gemm::dense::bf16_pair_panels` and `gemm::dense::amx_pair_panels`.
fn layout_for(dtype: DType, precision: Precision) -> Option<Layout> {
    match precision {
        Precision::Fast if panel_pack::packable(dtype) => Some(Layout::Panels),
        // BF16: the avx512bf16 kernel's panels (`bf16_pair_panels`), or AMX's (`amx_pair_panels`).
        Precision::Fast if dtype == DType::BF16 && (bf16_pair_panels::applies() || amx_pair_panels::applies()) => {
            Some(Layout::PairPanels)
        }
        Precision::Fast if dtype == DType::F16 && amx_pair_panels::applies() => Some(Layout::PairPanels),
        // Without AMX, F16 rounded once to BF16 for the `vdpbf16ps` kernel ([`as_bf16`]).
        Precision::Fast if dtype == DType::F16 && bf16_pair_panels::applies() => Some(Layout::PairPanels),
        Precision::Exact if exact_panels::pays(dtype) => Some(Layout::Panels),
        _ => None,
    }
}

/// Whether the embedding lookup reads rows of a `dtype` matrix that [`pack`] packed for
/// `precision` (block-quantized panels: `gemm::quant::panel_rows`).
pub(super) fn rows_readable_packed(dtype: DType, precision: Precision) -> bool {
    layout_for(dtype, precision).is_some_and(|l| panel_rows::reads(dtype, l))
}

/// Whether [`pack`] repacks `dtype` matmul weights run at `precision`.
pub(super) fn packable(dtype: DType, precision: Precision) -> bool {
    layout_for(dtype, precision).is_some()
}

/// Whether [`pack`] rounds `dtype` weights packed in `layout` to BF16: F16 at `Fast` on a CPU
/// with `vdpbf16ps` and no AMX. Exact f16 through BF16 needs two or three `vdpbf16ps` per
/// product, no faster than f32 FMA; one, on weights rounded to BF16 (a relative error of at most
/// 2^-9 a weight, below that of `Fast`'s 8-bit activations for block types), doubles the
/// multiply rate. `Exact` keeps the f16 values.
fn as_bf16(dtype: DType, layout: Layout) -> bool {
    dtype == DType::F16 && layout == Layout::PairPanels && !amx_pair_panels::applies()
}

/// Bytes of a packed `[rows, cols]` matrix.
fn packed_len(dtype: DType, layout: Layout, rows: usize, cols: usize) -> usize {
    match layout {
        Layout::PairPanels if dtype == DType::F16 && amx_pair_panels::applies() => {
            amx_pair_panels::packed_bytes(rows, cols)
        }
        Layout::PairPanels => bf16_pair_panels::packed_bytes(rows, cols),
        _ if dtype.is_quantized() => panel_pack::packed_bytes(dtype, rows, cols),
        _ => exact_panels::packed_bytes(dtype, rows, cols),
    }
}

/// Rows of a panel, in every packed layout.
const PANEL: usize = panel_pack::PANEL;
const _: () = assert!(exact_panels::PANEL == PANEL);
/// Stored bytes packed before their file pages are given back.
const PACK_PART_BYTES: usize = 16 << 20;

/// `t` repacked into panels on `pool` for matmuls at `precision`, or `None` when it is not a
/// matrix [`packable`] covers (then it is used as stored). The tensor's own pages are handed
/// back (`Tensor::release_resident`), so the weights are not resident twice.
pub(super) fn pack(
    t: &Tensor,
    precision: Precision,
    pool: &rayon::ThreadPool,
    arena: &mut Arena,
) -> Result<Option<CpuWeight>> {
    let (rows, cols) = t.rows_cols();
    let block = t.dtype.is_quantized();
    let Some(layout) = layout_for(t.dtype, precision) else { return Ok(None) };
    if t.shape.len() != 2 || (block && !cols.is_multiple_of(panel_pack::GROUP_VALUES)) {
        return Ok(None);
    }
    let round = as_bf16(t.dtype, layout);
    let dtype = if round { DType::BF16 } else { t.dtype };
    let n = packed_len(dtype, layout, rows, cols);
    let mut bytes = arena
        .alloc(n)
        .map_err(|e| CpuBackend::err(format!("tensor `{}`: no memory for its {n} repacked bytes: {e}", t.name)))?;
    // In parts of about PACK_PART_BYTES of stored rows (whole panels), each read with `pread`
    // on the pool into one reused buffer (`Tensor::rows_in_parts`: a file truncated meanwhile
    // is an error, not a SIGBUS) and packed, its file pages given back in case a prefault
    // mapped them: a large matrix (an lm_head) is then never resident twice, which set the
    // load's peak RSS.
    let row_bytes = t.bytes().len() / rows.max(1);
    let per_part = (PACK_PART_BYTES / (row_bytes * PANEL).max(1)).max(1);
    let mut rounded = Vec::new();
    t.rows_in_parts(per_part * PANEL, Some(pool), |r, src| {
        let (part, dst) = (r.start / PANEL..r.end.div_ceil(PANEL), &mut bytes[..n]);
        let src = if round {
            rounded.resize(src.len(), 0);
            convert::convert(DType::F16, src, DType::BF16, &mut rounded, src.len() / 2);
            &rounded[..]
        } else {
            src
        };
        pool.install(|| match layout {
            // F16 pair panels hold the stored 2-byte values as BF16 ones do.
            Layout::PairPanels => bf16_pair_panels::pack_panels(rows, cols, src, dst, part),
            _ if block => panel_pack::pack_panels(t.dtype, rows, cols, src, dst, part),
            _ => exact_panels::pack_panels(t.dtype, rows, cols, src, dst, part),
        });
        t.release_resident_range(r.start * row_bytes, r.len() * row_bytes);
        Ok(())
    })?;
    let bytes = bytes.freeze();
    t.release_resident();
    log::debug!("tensor `{}`: {rows}x{cols} {} repacked into 16-row panels as {dtype} ({n} bytes)", t.name, t.dtype);
    Ok(Some(CpuWeight::Packed { name: t.name.clone(), dtype, rows, cols, layout, bytes }))
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
    if !t.dtype.is_quantized() && !t.dtype.is_float() {
        return Err(Error::Unsupported(format!("tensor `{}`: {} weights cannot be converted", t.name, t.dtype)));
    }
    let row_out = to.block_bytes() * cols;
    let row_in = t.bytes().len() / rows.max(1);
    let mut f = vec![0f32; cols];
    // The stored rows are read with `pread` in parts (`Tensor::rows_in_parts`), never from
    // the file map.
    t.rows_in_parts(ROWS_PART_BYTES / row_in.max(1), None, |part, src| {
        for (r, row) in part.zip(src.chunks_exact(row_in.max(1))) {
            let dst = &mut out[r * row_out..(r + 1) * row_out];
            if t.dtype.is_quantized() {
                dequantize_row(t.dtype, row, &mut f)
                    .map_err(|e| Error::Unsupported(format!("tensor `{}`: {e}", t.name)))?;
                let src: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
                convert::convert(DType::F32, &src, to, dst, cols);
            } else {
                convert::convert(t.dtype, row, to, dst, cols);
            }
        }
        Ok(())
    })?;
    Tensor::owned(t.name.clone(), to, t.shape.clone(), out)
        .map_err(|e| Error::Unsupported(format!("tensor `{}`: {e}", t.name)))
}
