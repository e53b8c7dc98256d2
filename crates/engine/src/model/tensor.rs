//! A named weight tensor: a checked view into a memory map or an owned buffer.

use std::sync::Arc;

use tboost_ops::DType;

use super::hugepages::{self, Arena, Region};
use crate::formats::files::MappedFile;
use crate::formats::limits::{MAX_TENSOR_DIMS, MAX_TENSOR_ELEMENTS};

/// Bytes that back one or more tensors.
#[derive(Clone)]
pub enum Storage {
    /// A read-only map of a file.
    Mmap(Arc<MappedFile>),
    /// One tensor's bytes copied into a backend's huge-page arena ([`Tensor::copied_into`]).
    Region(Arc<Region>),
    Owned(Arc<Vec<u8>>),
}

impl Storage {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Region(r) => r,
            Storage::Owned(v) => v,
        }
    }
}

/// One tensor. `shape` is outermost first, HF-style: a matrix is `[rows = out, cols = in]`.
/// Constructed only through `Tensor::new`, which checks that `offset..offset+len` lies inside
/// the storage and that `len` matches shape and dtype.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    storage: Storage,
    offset: usize,
    len: usize,
}

impl Tensor {
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        storage: Storage,
        offset: usize,
        len: usize,
    ) -> Result<Tensor, String> {
        let name = name.into();
        if shape.len() > MAX_TENSOR_DIMS {
            return Err(format!(
                "shape {shape:?} has {} dimensions, above tboost's limit of {MAX_TENSOR_DIMS}",
                shape.len()
            ));
        }
        let elems = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&n| n as u64 <= MAX_TENSOR_ELEMENTS)
            .ok_or_else(|| format!("shape {shape:?} has more than tboost's limit of {MAX_TENSOR_ELEMENTS} elements"))?;
        let inner = shape.last().copied().unwrap_or(1);
        if dtype.is_quantized() && inner % dtype.block_elems() != 0 {
            return Err(format!(
                "shape {shape:?}: row length {inner} is not a multiple of the {dtype} block size {}",
                dtype.block_elems()
            ));
        }
        let need = dtype
            .bytes_for(elems)
            .ok_or_else(|| format!("shape {shape:?} of {dtype} has no whole number of blocks"))?;
        if need != len {
            return Err(format!("shape {shape:?} of {dtype} needs {need} bytes but the file gives {len}"));
        }
        let end = offset.checked_add(len).ok_or_else(|| "offset + size overflows".to_string())?;
        if end > storage.bytes().len() {
            return Err(format!(
                "data range {offset}..{end} lies beyond the end of the data ({} bytes)",
                storage.bytes().len()
            ));
        }
        Ok(Tensor { name, dtype, shape, storage, offset, len })
    }

    /// An owned tensor (synthetic models, tests).
    pub fn owned(name: impl Into<String>, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Tensor, String> {
        let len = bytes.len();
        Tensor::new(name, dtype, shape, Storage::Owned(Arc::new(bytes)), 0, len)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.offset..self.offset + self.len]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows and columns when viewed as a matrix (a vector is one row).
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [] => (1, 1),
            [n] => (1, *n),
            [.., c] => (self.numel() / c.max(&1), *c),
        }
    }

    /// Sub-tensor `i` along the outermost dimension (one expert of a stacked `[E, rows, cols]`
    /// GGUF tensor), sharing the same storage: no copy.
    pub fn slice_outer(&self, i: usize, name: impl Into<String>) -> Result<Tensor, String> {
        let (&n, inner) = self.shape.split_first().ok_or_else(|| "a scalar has no outer dimension".to_string())?;
        if i >= n {
            return Err(format!("index {i} is out of range for outer dimension {n} of shape {:?}", self.shape));
        }
        // `new` checked len == n * (bytes of one slice), so this divides exactly.
        let each = self.len / n;
        Tensor::new(name, self.dtype, inner.to_vec(), self.storage.clone(), self.offset + i * each, each)
    }

    /// Rows `start..start + count` of a matrix (q, k or v of a fused qkv projection), sharing
    /// the same storage: no copy. Rows of every dtype, block types included, are whole bytes.
    pub fn slice_rows(&self, start: usize, count: usize, name: impl Into<String>) -> Result<Tensor, String> {
        let &[rows, cols] = self.shape.as_slice() else {
            return Err(format!("shape {:?} is not a matrix", self.shape));
        };
        if start.checked_add(count).is_none_or(|e| e > rows) || count == 0 {
            return Err(format!(
                "rows {start}..{} are not within the {rows} rows of shape {:?}",
                start + count,
                self.shape
            ));
        }
        let each = self.len / rows;
        let t = Tensor::new(
            name,
            self.dtype,
            vec![count, cols],
            self.storage.clone(),
            self.offset + start * each,
            count * each,
        )?;
        Ok(t)
    }

    /// The values of a float tensor (f32, f16, bf16) as f32; `None` for block types.
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        let b = self.bytes();
        Some(match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => return None,
        })
    }

    /// An owned f32 tensor of `values` with this tensor's name and shape.
    pub fn with_f32(&self, values: &[f32]) -> Result<Tensor, String> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::owned(self.name.clone(), DType::F32, self.shape.clone(), bytes)
    }

    /// Rows `r` of a matrix (elements `r` of a vector), sharing the same storage: no copy,
    /// so only the pages of those rows are ever read (a tensor-parallel rank's shard).
    pub fn rows(&self, r: std::ops::Range<usize>) -> Result<Tensor, String> {
        let (rows, cols) = self.rows_cols();
        let (n, unit, shape) = match self.shape.len() {
            1 => (cols, 1, vec![r.len()]),
            2 => (rows, cols, vec![r.len(), cols]),
            _ => return Err(format!("rows of a tensor of shape {:?}", self.shape)),
        };
        if r.start > r.end || r.end > n {
            return Err(format!("rows {}..{} of shape {:?}", r.start, r.end, self.shape));
        }
        let bytes = |k: usize| self.dtype.bytes_for(k * unit).ok_or_else(|| format!("{k} rows of {}", self.dtype));
        let name = format!("{}[{}..{}]", self.name, r.start, r.end);
        Tensor::new(name, self.dtype, shape, self.storage.clone(), self.offset + bytes(r.start)?, bytes(r.len())?)
    }

    /// Columns `c` of a matrix, copied into an owned tensor. Block-quantized columns must
    /// start and end on block boundaries.
    pub fn cols(&self, c: std::ops::Range<usize>) -> Result<Tensor, String> {
        let (rows, cols) = self.rows_cols();
        if self.shape.len() != 2 || c.start > c.end || c.end > cols {
            return Err(format!("columns {}..{} of shape {:?}", c.start, c.end, self.shape));
        }
        let block = self.dtype.block_elems();
        if !c.start.is_multiple_of(block) || !c.end.is_multiple_of(block) {
            return Err(format!(
                "columns {}..{} of shape {:?} do not fall on {} block boundaries ({block})",
                c.start, c.end, self.shape, self.dtype
            ));
        }
        let at = |k: usize| self.dtype.bytes_for(k).ok_or_else(|| format!("{k} values of {}", self.dtype));
        let (row_bytes, from, len) = (at(cols)?, at(c.start)?, at(c.len())?);
        let src = self.bytes();
        let mut out = Vec::with_capacity(rows * len);
        for i in 0..rows {
            out.extend_from_slice(&src[i * row_bytes + from..i * row_bytes + from + len]);
        }
        Tensor::owned(format!("{}[:, {}..{}]", self.name, c.start, c.end), self.dtype, vec![rows, c.len()], out)
    }

    /// True when the bytes are a map of the model file (not yet in memory until touched).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mmap(_))
    }

    /// An error naming the file when the file this tensor is mapped from has shrunk since
    /// it was loaded ([`MappedFile::check_intact`]); reading the bytes would crash.
    pub fn check_source(&self) -> crate::Result<()> {
        match &self.storage {
            Storage::Mmap(m) => m.check_intact(),
            _ => Ok(()),
        }
    }

    /// Whether a backend that reads this tensor in place should copy it into huge pages
    /// ([`Tensor::copied_into`]): it is mapped from a large file and `TBOOST_WEIGHT_PAGES`
    /// does not keep the file map (see `hugepages`).
    pub fn wants_huge_pages(&self) -> bool {
        matches!(&self.storage, Storage::Mmap(m) if hugepages::wanted(m.len()))
    }

    /// This tensor with its bytes copied into `arena` (on the current rayon pool); its file
    /// pages are then dropped from the process ([`Tensor::release_resident`]).
    pub fn copied_into(&self, arena: &mut Arena) -> std::io::Result<Tensor> {
        let region = hugepages::copy_into(arena, self.bytes())?;
        self.release_resident();
        let (name, dtype, shape) = (self.name.clone(), self.dtype, self.shape.clone());
        Ok(Tensor { name, dtype, shape, storage: Storage::Region(Arc::new(region)), offset: 0, len: self.len })
    }

    /// This tensor (name, dtype, shape) over the bytes of `copy`, a copy of the same bytes
    /// ([`Tensor::copied_into`] of a tensor over the same range).
    pub fn over_bytes_of(&self, copy: &Tensor) -> Tensor {
        assert_eq!(self.len, copy.len, "tensor `{}`: a copy of {} bytes for {}", self.name, copy.len, self.len);
        let (name, dtype, shape) = (self.name.clone(), self.dtype, self.shape.clone());
        Tensor { name, dtype, shape, storage: copy.storage.clone(), offset: copy.offset, len: self.len }
    }

    /// Gives back the memory of this tensor's whole pages of a file map, for a backend that
    /// keeps its own copy (repacked or copied weights) so the bytes are not resident twice.
    /// The bytes stay readable and unchanged: the pages are dropped from this process only
    /// (the page cache keeps them, a later read maps them again). Copies and owned tensors,
    /// and platforms other than Linux, keep their memory.
    pub fn release_resident(&self) {
        self.release_resident_range(0, self.len)
    }

    /// [`Tensor::release_resident`] of the whole pages inside bytes `start..start + len` of
    /// this tensor.
    pub fn release_resident_range(&self, start: usize, len: usize) {
        if let Storage::Mmap(m) = &self.storage {
            let len = len.min(self.len.saturating_sub(start));
            hugepages::release_file_pages(m, self.offset + start, len)
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {} {:?})", self.name, self.dtype, self.shape)
    }
}
