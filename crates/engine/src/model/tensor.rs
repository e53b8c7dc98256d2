//! A named weight tensor: a checked view into a memory map or an owned buffer.

use std::sync::Arc;

use tboost_ops::DType;

use super::hugepages::{self, Region, RegionMut};
use crate::formats::files::MappedFile;
use crate::formats::limits::{MAX_TENSOR_DIMS, MAX_TENSOR_ELEMENTS};

/// Stored bytes per part when a mapped tensor is read in parts of rows
/// ([`Tensor::rows_in_parts`]) to be converted or cut.
pub const ROWS_PART_BYTES: usize = 4 << 20;

/// Bytes per parallel `pread` into the reused buffer of [`Tensor::rows_in_parts`] (memory
/// already touched: small pieces keep every thread busy on a tensor of a few MiB).
const READ_PIECE: usize = 512 << 10;

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

    /// The bytes in place. For a mapped tensor that is the file map: do not read it (a read
    /// of a page past the end of a file truncated since it was mapped would be SIGBUS);
    /// [`Tensor::read_range`], [`Tensor::rows_in_parts`] and [`Tensor::owned_copy`] read with
    /// `pread`. Its address and length are safe to use.
    pub fn bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.offset..self.offset + self.len]
    }

    /// Copies bytes `start..start + dst.len()` of this tensor into `dst`: with `pread` for a
    /// mapped tensor ([`MappedFile::read_range`]: a file that shrank since load is an error
    /// naming the file, this tensor and both sizes, never a SIGBUS), a plain copy otherwise.
    pub fn read_range(&self, start: usize, dst: &mut [u8]) -> crate::Result<()> {
        if start.checked_add(dst.len()).is_none_or(|end| end > self.len) {
            return Err(crate::Error::invalid(
                "range",
                format!("bytes {start}..+{} of tensor `{}` ({} bytes)", dst.len(), self.name, self.len),
            ));
        }
        match &self.storage {
            Storage::Mmap(m) => m.read_range(self.offset + start, dst, &self.name),
            _ => {
                dst.copy_from_slice(&self.bytes()[start..start + dst.len()]);
                Ok(())
            }
        }
    }

    /// Calls `f(rows, bytes)` for consecutive parts of at most `per_part` rows of this tensor
    /// seen as a matrix ([`Tensor::rows_cols`]), `bytes` those rows as stored. A mapped
    /// tensor's parts are read with `pread` into one buffer reused from part to part (so at
    /// most one part is held twice, and a file that shrank is an error, not a SIGBUS), in
    /// pieces on `pool` when one is given; other tensors pass their own bytes.
    pub fn rows_in_parts(
        &self,
        per_part: usize,
        pool: Option<&rayon::ThreadPool>,
        mut f: impl FnMut(std::ops::Range<usize>, &[u8]) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let (rows, _) = self.rows_cols();
        let row_bytes = self.len / rows.max(1);
        let mut buf = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let r1 = r0.saturating_add(per_part.max(1)).min(rows);
            let (at, n) = (r0 * row_bytes, (r1 - r0) * row_bytes);
            if self.is_mapped() {
                if buf.len() < n {
                    buf.try_reserve_exact(n - buf.len()).map_err(|e| {
                        crate::Error::Unsupported(format!("tensor `{}`: no memory to read {n} bytes: {e}", self.name))
                    })?;
                    buf.resize(n, 0);
                }
                let part = &mut buf[..n];
                match pool {
                    Some(pool) => {
                        let read = |o, d: &mut [u8]| self.read_range(at + o, d);
                        pool.install(|| hugepages::fill_in_pieces(part, READ_PIECE, read))?
                    }
                    None => self.read_range(at, part)?,
                }
                f(r0..r1, &buf[..n])?;
            } else {
                f(r0..r1, &self.bytes()[at..at + n])?;
            }
            r0 = r1;
        }
        Ok(())
    }

    /// This tensor with its bytes in memory tboost owns: a mapped tensor read with `pread`
    /// ([`Tensor::read_range`]) into an owned buffer, any other one as it is (no copy). For
    /// a backend that reads the bytes of a tensor it is given (a device upload's host
    /// staging).
    pub fn owned_copy(&self) -> crate::Result<Tensor> {
        if !self.is_mapped() {
            return Ok(self.clone());
        }
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(self.len).map_err(|e| {
            crate::Error::Unsupported(format!("tensor `{}`: no memory for its {} bytes: {e}", self.name, self.len))
        })?;
        bytes.resize(self.len, 0);
        self.read_range(0, &mut bytes)?;
        let (name, dtype, shape) = (self.name.clone(), self.dtype, self.shape.clone());
        Ok(Tensor { name, dtype, shape, storage: Storage::Owned(Arc::new(bytes)), offset: 0, len: self.len })
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

    /// The values of a float tensor (f32, f16, bf16) as f32; `None` for block types. A
    /// mapped tensor is read with `pread` ([`Tensor::owned_copy`]): a file that shrank is an
    /// error naming it and this tensor, not a SIGBUS. For `Model::load` (Gemma's norm gains)
    /// and tests.
    pub fn to_f32(&self) -> crate::Result<Option<Vec<f32>>> {
        if !matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Ok(None);
        }
        let copy = self.owned_copy()?;
        let b = copy.bytes();
        Ok(Some(match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => return Ok(None),
        }))
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

    /// Columns `c` of a matrix, copied into an owned tensor (read in parts of rows:
    /// [`Tensor::rows_in_parts`]). Block-quantized columns must start and end on block
    /// boundaries.
    pub fn cols(&self, c: std::ops::Range<usize>) -> crate::Result<Tensor> {
        let bad = |m: String| crate::Error::Unsupported(format!("tensor `{}`: {m}", self.name));
        let (rows, cols) = self.rows_cols();
        if self.shape.len() != 2 || c.start > c.end || c.end > cols {
            return Err(bad(format!("columns {}..{} of shape {:?}", c.start, c.end, self.shape)));
        }
        let block = self.dtype.block_elems();
        if !c.start.is_multiple_of(block) || !c.end.is_multiple_of(block) {
            return Err(bad(format!(
                "columns {}..{} of shape {:?} do not fall on {} block boundaries ({block})",
                c.start, c.end, self.shape, self.dtype
            )));
        }
        let at = |k: usize| self.dtype.bytes_for(k).ok_or_else(|| bad(format!("{k} values of {}", self.dtype)));
        let (row_bytes, from, len) = (at(cols)?, at(c.start)?, at(c.len())?);
        let mut out = Vec::with_capacity(rows * len);
        // No rows of bytes to cut when the matrix has no columns.
        if let Some(per_part) = ROWS_PART_BYTES.checked_div(row_bytes) {
            self.rows_in_parts(per_part, None, |_, src| {
                for row in src.chunks_exact(row_bytes) {
                    out.extend_from_slice(&row[from..from + len]);
                }
                Ok(())
            })?;
        }
        Tensor::owned(format!("{}[:, {}..{}]", self.name, c.start, c.end), self.dtype, vec![rows, c.len()], out)
            .map_err(bad)
    }

    /// True when the bytes are a map of the model file (not yet in memory until touched).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mmap(_))
    }

    /// The file this tensor is mapped from and where its bytes start in it (`None` for an
    /// owned tensor).
    pub fn mapped_from(&self) -> Option<(&MappedFile, usize)> {
        match &self.storage {
            Storage::Mmap(m) => Some((m, self.offset)),
            _ => None,
        }
    }

    /// An error naming the file when the file this tensor is mapped from has shrunk since
    /// it was loaded ([`MappedFile::check_intact`]): a quick check before an engine build
    /// reads anything (the reads themselves, [`Tensor::read_range`], catch a later change).
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

    /// This tensor with its bytes read into `dst`, a region of a backend's arena as long as
    /// the tensor, in pieces on the current rayon pool ([`Tensor::read_range`]: `pread` for a
    /// mapped tensor); its file pages are then dropped from the process
    /// ([`Tensor::release_resident`]).
    pub fn copied_into(&self, mut dst: RegionMut) -> crate::Result<Tensor> {
        if dst.len() != self.len {
            return Err(crate::Error::invalid(
                "region",
                format!("{} bytes for tensor `{}` of {} bytes", dst.len(), self.name, self.len),
            ));
        }
        hugepages::fill_in_pieces(&mut dst, hugepages::FRESH_PIECE, |at, piece| self.read_range(at, piece))?;
        self.release_resident();
        let (name, dtype, shape) = (self.name.clone(), self.dtype, self.shape.clone());
        Ok(Tensor { name, dtype, shape, storage: Storage::Region(Arc::new(dst.freeze())), offset: 0, len: self.len })
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
