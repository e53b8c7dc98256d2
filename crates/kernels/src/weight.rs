//! Borrowed views of weight tensors as kernels see them.

use crate::DType;

/// A matrix `[rows = out_features, cols = in_features]` stored in `dtype`: row-major
/// (`data` holds exactly `rows * row_bytes` bytes, checked by `new`), or for some block
/// types repacked into 16-row panels for the `Fast` kernels (`panel_pack`).
#[derive(Clone, Copy, Debug)]
pub struct WeightMat<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    pub layout: Layout,
}

/// How a [`WeightMat`]'s bytes are arranged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Row after row, as GGUF and safetensors store them.
    #[default]
    Rows,
    /// 16 rows interleaved: per 32-value group for block-quantized weights at `Fast`
    /// (`crate::gemm::quant::panel_pack`), per column for dense weights at `Exact`
    /// (`crate::gemm::dense::exact_panels`).
    Panels,
    /// BF16 weights, 16 rows interleaved per pair of values, for `Fast`'s `vdpbf16ps` kernel
    /// (`crate::gemm::dense::bf16_pair_panels`); F16 weights the same way for `Fast`'s AMX split
    /// kernel (`crate::gemm::dense::amx_pair_panels`).
    PairPanels,
}

impl<'a> WeightMat<'a> {
    /// Checks that `data` has exactly the size the shape and dtype need.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let row_bytes = dtype.bytes_for(cols).ok_or_else(|| {
            format!("{cols} columns is not a whole number of {dtype} blocks ({} values each)", dtype.block_elems())
        })?;
        let need = row_bytes.checked_mul(rows).ok_or_else(|| format!("{rows}x{cols} {dtype} overflows"))?;
        if data.len() != need {
            return Err(format!("{rows}x{cols} {dtype} needs {need} bytes, got {}", data.len()));
        }
        Ok(WeightMat { dtype, rows, cols, data, layout: Layout::Rows })
    }

    /// Views `data`, the output of `quant::panel_pack::pack` (block types) or
    /// `dense::exact_panels::pack` (f32, f16, bf16) for a `[rows, cols]` matrix.
    pub fn packed(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        use crate::gemm::{dense::exact_panels, quant::panel_pack};
        let need = if panel_pack::packable(dtype) && cols.is_multiple_of(panel_pack::GROUP_VALUES) {
            panel_pack::packed_bytes(dtype, rows, cols)
        } else if exact_panels::packable(dtype) {
            exact_panels::packed_bytes(dtype, rows, cols)
        } else {
            return Err(format!("{rows}x{cols} {dtype} has no packed layout"));
        };
        if data.len() != need {
            return Err(format!("packed {rows}x{cols} {dtype} needs {need} bytes, got {}", data.len()));
        }
        Ok(WeightMat { dtype, rows, cols, data, layout: Layout::Panels })
    }

    /// An f32 matrix viewing `v` (`rows * cols` values), for tests and computed weights.
    pub fn from_f32(v: &'a [f32], rows: usize, cols: usize) -> Result<Self, String> {
        // SAFETY: any f32 slice is a valid byte slice of 4x the length.
        let data = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
        Self::new(DType::F32, rows, cols, data)
    }

    /// Views `data`, the output of `bf16_pair_panels::pack` for a `[rows, cols]` BF16
    /// matrix.
    pub fn pair_panels(rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let need = crate::gemm::dense::bf16_pair_panels::packed_bytes(rows, cols);
        if data.len() != need {
            return Err(format!("bf16 pair panels of {rows}x{cols} need {need} bytes, got {}", data.len()));
        }
        Ok(WeightMat { dtype: DType::BF16, rows, cols, data, layout: Layout::PairPanels })
    }

    /// Views `data`, the output of `amx_pair_panels::pack` for a `[rows, cols]` F16
    /// matrix.
    pub fn f16_pair_panels(rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let need = crate::gemm::dense::amx_pair_panels::packed_bytes(rows, cols);
        if data.len() != need {
            return Err(format!("f16 pair panels of {rows}x{cols} need {need} bytes, got {}", data.len()));
        }
        Ok(WeightMat { dtype: DType::F16, rows, cols, data, layout: Layout::PairPanels })
    }

    /// Bytes of one row (for packed panels: the same count, `panel bytes / 16`).
    pub fn row_bytes(&self) -> usize {
        match self.layout {
            Layout::PairPanels => self.cols * 2,
            Layout::Rows => self.data.len() / self.rows.max(1),
            Layout::Panels if self.dtype.is_quantized() => {
                crate::gemm::quant::panel_pack::panel_bytes(self.dtype, self.cols)
                    / crate::gemm::quant::panel_pack::PANEL
            }
            Layout::Panels => self.cols * self.dtype.block_bytes(),
        }
    }

    /// The bytes of row `r` (row-major layout only).
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert_eq!(self.layout, Layout::Rows, "WeightMat::row on a packed matrix");
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `start..end` as a smaller matrix (used to split work across threads; row-major
    /// layout only).
    pub fn rows_range(&self, start: usize, end: usize) -> WeightMat<'a> {
        assert_eq!(self.layout, Layout::Rows, "WeightMat::rows_range on a packed matrix");
        let rb = self.row_bytes();
        WeightMat {
            dtype: self.dtype,
            rows: end - start,
            cols: self.cols,
            data: &self.data[start * rb..end * rb],
            layout: Layout::Rows,
        }
    }
}

/// A vector (norm gain, bias) stored in a dense dtype (f32, f16 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct WeightVec<'a> {
    pub dtype: DType,
    pub len: usize,
    pub data: &'a [u8],
}

impl<'a> WeightVec<'a> {
    pub fn new(dtype: DType, len: usize, data: &'a [u8]) -> Result<Self, String> {
        if dtype.is_quantized() {
            return Err(format!("a vector must be f32, f16 or bf16, not {dtype}"));
        }
        let need = dtype.bytes_for(len).ok_or_else(|| format!("{len} x {dtype} overflows"))?;
        if data.len() != need {
            return Err(format!("{len} x {dtype} needs {need} bytes, got {}", data.len()));
        }
        Ok(WeightVec { dtype, len, data })
    }

    pub fn from_f32(v: &'a [f32]) -> Self {
        // SAFETY: any f32 slice is a valid byte slice of 4x the length.
        let data = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) };
        WeightVec { dtype: DType::F32, len: v.len(), data }
    }

    /// Value `i` converted to f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self.dtype {
            DType::F32 => f32::from_le_bytes(self.data[4 * i..4 * i + 4].try_into().unwrap()),
            DType::F16 => half::f16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]).to_f32(),
            DType::BF16 => half::bf16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]).to_f32(),
            _ => unreachable!("WeightVec::new rejects quantized dtypes"),
        }
    }

    /// The whole vector as f32 (small vectors only: norm gains, biases).
    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.len).map(|i| self.get(i)).collect()
    }

    /// The vector as f32: borrowed when it is stored as aligned f32 (norm gains on the CPU
    /// backend, so a norm call allocates nothing), else converted (`to_f32`).
    pub fn as_f32(&self) -> std::borrow::Cow<'a, [f32]> {
        // The fields are public: check the length here rather than trust `new` did.
        let whole = self.len.checked_mul(4) == Some(self.data.len());
        if self.dtype == DType::F32
            && whole
            && (self.data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>())
        {
            // SAFETY: `data` is exactly `len` f32 (4 bytes each), checked just above, and
            // aligned; every bit pattern is an f32 (little-endian targets, as `get` reads).
            #[cfg(target_endian = "little")]
            return std::borrow::Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(self.data.as_ptr() as *const f32, self.len)
            });
        }
        std::borrow::Cow::Owned(self.to_f32())
    }
}
