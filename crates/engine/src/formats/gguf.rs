//! GGUF v2/v3 container reader: header, metadata, tensor directory. It knows nothing of
//! models; `model::gguf` maps a file onto a model and `tokenizer` reads its vocabulary.
//! Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
//!
//! Every length and offset read from the file is checked against the bytes that remain
//! and against its cap in [`super::limits`] before it is used, so a truncated or lying
//! header yields an error naming the file and the field, never a panic, an out-of-bounds
//! read or a huge allocation. Allocations proportional to a count are reserved fallibly.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use tboost_ops::DType;

use super::limits::{
    MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_METADATA_KEYS, MAX_METADATA_VALUES, MAX_STRING_BYTES, MAX_TENSORS,
};
use crate::{Error, Result};

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The GGUF name of this value's type (for error messages).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float, or an integer converted to f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Scalars as themselves, strings quoted, arrays by length (a vocabulary is long).
impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(v) => write!(f, "{v:?}"),
            Value::Array(a) => write!(f, "array of {} values", a.len()),
        }
    }
}

/// All metadata key/value pairs of a GGUF file.
pub type Metadata = BTreeMap<String, Value>;

/// One entry of the tensor directory, as stored in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: innermost first (`dims[0]` = number of columns).
    pub dims: Vec<u64>,
    /// GGML type id (`ggml_type`).
    pub ggml_type: u32,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
    /// Byte size, known when `ggml_type` is one tboost supports (then range-checked).
    pub size: Option<u64>,
}

impl TensorInfo {
    /// Shape outermost first, as `Tensor` wants it.
    pub fn shape(&self) -> Vec<usize> {
        // `parse` checked that every dim fits in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file (everything but the tensor data).
#[derive(Clone, Debug)]
pub struct GgufFile {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

impl GgufFile {
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;

/// GGML type name for error messages (`ggml.h` enum `ggml_type`).
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// The tboost dtype of a GGML type id, if tboost supports it.
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        30 => DType::BF16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        20 => DType::IQ4NL,
        23 => DType::IQ4XS,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        _ => return None,
    })
}

/// Bytes of a GGUF file read at a time while its header is parsed ([`Reader::take`]): a
/// 150k-token vocabulary (about 6 MB) takes a few reads, and the buffer ends at most this
/// far past the tensor directory.
const READ_STEP: u64 = 1 << 20;

/// Reads only the header and metadata of a GGUF file (tokenizers need no more) with
/// `pread` (nothing is mapped). The tensor directory is not parsed, so a vocabulary-only
/// file or one with unsupported tensor types works too.
pub fn read_metadata(path: &Path) -> Result<Metadata> {
    let (file, len) = super::files::open_regular(path)?;
    let mut read = |at: u64, dst: &mut [u8]| super::files::read_exact_at(&file, path, len, at, dst, "the GGUF header");
    let mut r = Reader::reading(&mut read, len, READ_STEP, path);
    let (_, _, n_kv) = r.header()?;
    r.metadata(n_kv)
}

/// [`parse`] of a mapped GGUF file from its bytes read with `pread` as the parse needs them
/// ([`MappedFile::read_head`](super::files::MappedFile::read_head)), never through the map:
/// a file truncated while a model loads is then an error naming it, not a SIGBUS. Every
/// check is against the length of the map, with the same errors as [`parse`] of the whole
/// file.
pub fn parse_mapped(map: &super::files::MappedFile, path: &Path) -> Result<GgufFile> {
    let mut read = |at: u64, dst: &mut [u8]| map.read_head(at, dst, "the GGUF header");
    parse_from(&mut Reader::reading(&mut read, map.len() as u64, READ_STEP, path))
}

/// Parses the whole directory of an in-memory GGUF file and checks every tensor's byte
/// range against `bytes.len()`. `path` is only used in error messages.
pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufFile> {
    parse_from(&mut Reader::new(bytes, path))
}

/// [`parse`] from `r`, checking tensor ranges against the file's length `r.len`.
fn parse_from(r: &mut Reader<'_>) -> Result<GgufFile> {
    let path = r.path;
    let (version, n_tensors, n_kv) = r.header()?;
    let metadata = r.metadata(n_kv)?;

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 30 => a,
            _ => return Err(r.err(format!("metadata `general.alignment` must be a power of two, got {v}"))),
        },
    };

    // Each tensor info takes at least 8 (name len) + 4 (n_dims) + 8 (one dim) + 4 + 8 bytes.
    r.cap(n_tensors, MAX_TENSORS, "the tensor count")?;
    let n_tensors = r.count(n_tensors, 32, || "the tensor count".to_string())?;
    let mut tensors = Vec::new();
    r.reserve(&mut tensors, n_tensors, "the tensor directory")?;
    let mut seen = HashSet::new();
    seen.try_reserve(n_tensors).map_err(|e| r.err(format!("cannot allocate the tensor directory's index: {e}")))?;
    for i in 0..n_tensors {
        let name = r.string(&|| format!("the name of tensor #{i}"))?;
        let ctx = |field: &str| format!("tensor `{name}` (#{i}): {field}");
        let n_dims = r.u32(&|| ctx("dimension count"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.err(ctx(&format!("has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}"))));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let v = r.u64(&|| ctx(&format!("dimension {d}")))?;
            if v == 0 || usize::try_from(v).is_err() || v > i64::MAX as u64 {
                return Err(r.err(ctx(&format!("dimension {d} is {v}"))));
            }
            dims.push(v);
        }
        let ggml_type = r.u32(&|| ctx("type"))?;
        let offset = r.u64(&|| ctx("data offset"))?;
        if !seen.insert(name.clone()) {
            return Err(r.err(format!("tensor `{name}` appears twice in the tensor directory")));
        }
        tensors.push(TensorInfo { name, dims, ggml_type, offset, size: None });
    }

    let end_of_infos = r.pos as u64;
    let data_offset = end_of_infos.div_ceil(alignment) * alignment;
    let file_len = r.len;
    if !tensors.is_empty() && data_offset > file_len {
        return Err(r.err(format!(
            "the data section would start at byte {data_offset}, beyond the end of the file ({file_len} bytes); the file is truncated"
        )));
    }
    let data_len = file_len.saturating_sub(data_offset);

    for t in &mut tensors {
        let bad = |msg: String| Error::bad_tensor(path, t.name.clone(), msg);
        if t.offset % alignment != 0 {
            return Err(bad(format!("data offset {} is not a multiple of the alignment {alignment}", t.offset)));
        }
        if t.offset > data_len {
            return Err(bad(format!(
                "data offset {} lies beyond the end of the data section ({data_len} bytes); the file is truncated or the header is wrong",
                t.offset
            )));
        }
        let Some(dtype) = dtype_from_ggml(t.ggml_type) else { continue };
        if t.dims[0] % dtype.block_elems() as u64 != 0 {
            return Err(bad(format!(
                "rows of {} values (dims {:?}) are not whole blocks of {} values of type {}",
                t.dims[0],
                t.dims,
                dtype.block_elems(),
                ggml_type_name(t.ggml_type)
            )));
        }
        let size = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| dtype.bytes_for(n))
            .map(|b| b as u64)
            .ok_or_else(|| bad(format!("dims {:?} overflow: the tensor would be larger than memory", t.dims)))?;
        match t.offset.checked_add(size) {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(bad(format!(
                    "{size} bytes at data offset {} run beyond the end of the data section ({data_len} bytes); the file is truncated or the header is wrong",
                    t.offset
                )))
            }
        }
        t.size = Some(size);
    }

    // Ranges of tensors with known sizes must not overlap.
    let mut ranges: Vec<(u64, u64, &str)> =
        tensors.iter().filter_map(|t| t.size.map(|s| (t.offset, t.offset + s, t.name.as_str()))).collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::bad_tensor(
                path,
                w[1].2,
                format!("data {}..{} overlaps tensor `{}` ({}..{})", w[1].0, w[1].1, w[0].2, w[0].0, w[0].1),
            ));
        }
    }

    Ok(GgufFile { version, metadata, tensors, alignment, data_offset })
}

/// Where a [`Reader`] finds the file's bytes.
enum Source<'a> {
    /// The whole file, in memory ([`parse`]).
    Memory(&'a [u8]),
    /// The first `buf.len()` bytes of the file, read with `read(offset, dst)` as they are
    /// needed, at least `step` bytes at a time.
    Reads { read: &'a mut dyn FnMut(u64, &mut [u8]) -> Result<()>, buf: Vec<u8>, step: u64 },
}

/// A bounds-checked little-endian cursor over a file of `len` bytes. Every check is against
/// `len`, so a parse of bytes read as they are needed fails, when it fails, with the error of
/// a parse of the whole file.
struct Reader<'a> {
    src: Source<'a>,
    len: u64,
    pos: usize,
    path: &'a Path,
    values: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], path: &'a Path) -> Self {
        Reader { src: Source::Memory(bytes), len: bytes.len() as u64, pos: 0, path, values: 0 }
    }

    /// A reader of a file of `len` bytes that reads them with `read` as [`Reader::take`]
    /// needs them, `step` bytes or more at a time.
    fn reading(read: &'a mut dyn FnMut(u64, &mut [u8]) -> Result<()>, len: u64, step: u64, path: &'a Path) -> Self {
        let src = Source::Reads { read, buf: Vec::new(), step: step.max(1) };
        Reader { src, len, pos: 0, path, values: 0 }
    }

    fn err(&self, msg: String) -> Error {
        Error::format(self.path, msg)
    }

    /// Bytes of the file after the cursor.
    fn remaining(&self) -> u64 {
        self.len - self.pos as u64
    }

    /// The next `n` bytes, as a range for [`Reader::bytes`].
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<std::ops::Range<usize>> {
        if n as u64 > self.remaining() {
            return Err(self.err(format!(
                "truncated: {} needs {n} bytes at offset {} but the file has only {} bytes",
                what(),
                self.pos,
                self.len
            )));
        }
        // `pos + n <= len`, and the bytes before `pos` are in memory: this fits in usize.
        let end = self.pos + n;
        if let Source::Reads { read, buf, step } = &mut self.src {
            let have = buf.len();
            if end > have {
                // At most `len`, which is at least `end`.
                let want = (end as u64).max(have as u64 + *step).min(self.len) as usize;
                // Amortized growth: the capacity doubles, only the bytes read are touched.
                buf.try_reserve(want - have).map_err(|e| {
                    Error::format(self.path, format!("cannot allocate {want} bytes for the GGUF header: {e}"))
                })?;
                buf.resize(want, 0);
                read(have as u64, &mut buf[have..])?;
            }
        }
        let r = self.pos..end;
        self.pos = end;
        Ok(r)
    }

    /// The bytes of a range [`Reader::take`] returned.
    fn bytes(&self, r: std::ops::Range<usize>) -> &[u8] {
        match &self.src {
            Source::Memory(b) => &b[r],
            Source::Reads { buf, .. } => &buf[r],
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let r = self.take(N, what)?;
        // `take` returned exactly N bytes.
        Ok(self.bytes(r).try_into().unwrap())
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks a count of items each at least `min_bytes` long against the bytes left, so a
    /// lying count fails here instead of in a giant allocation.
    fn count(&self, n: u64, min_bytes: usize, what: impl Fn() -> String) -> Result<usize> {
        let fits = usize::try_from(n).ok().and_then(|n| n.checked_mul(min_bytes).map(|b| (n, b)));
        match fits {
            Some((n, b)) if b as u64 <= self.remaining() => Ok(n),
            _ => Err(self.err(format!(
                "{} is {n}, more than the {} bytes left in the file can hold; the file is truncated or corrupt",
                what(),
                self.remaining()
            ))),
        }
    }

    /// A count read from the file against its cap in `limits`.
    fn cap(&self, n: u64, cap: usize, what: &str) -> Result<()> {
        if n > cap as u64 {
            return Err(self.err(format!(
                "{what} is {n}, above tboost's limit of {cap} (at offset {}); the file is corrupt or hostile",
                self.pos
            )));
        }
        Ok(())
    }

    /// Reserves room for `n` items without aborting when memory is short.
    fn reserve<T>(&self, v: &mut Vec<T>, n: usize, what: &str) -> Result<()> {
        v.try_reserve_exact(n).map_err(|e| self.err(format!("cannot allocate {n} entries for {what}: {e}")))
    }

    fn bytes_str(&mut self, what: &dyn Fn() -> String) -> Result<std::ops::Range<usize>> {
        let n = self.u64(&|| format!("the length of {}", what()))?;
        self.cap(n, MAX_STRING_BYTES, &format!("the length of {}", what()))?;
        let n = self.count(n, 1, || format!("the length of {}", what()))?;
        self.take(n, what)
    }

    /// A string that must be valid UTF-8 (keys, tensor names, architecture names).
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let r = self.bytes_str(what)?;
        match std::str::from_utf8(self.bytes(r)) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.err(format!("{} is not valid UTF-8: {e}", what()))),
        }
    }

    /// (version, tensor count, metadata count).
    fn header(&mut self) -> Result<(u32, u64, u64)> {
        let r = self.take(4, &|| "the GGUF magic".to_string())?;
        let magic = self.bytes(r);
        if magic != MAGIC {
            return Err(self.err(format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\"")));
        }
        let version = self.u32(&|| "the GGUF version".to_string())?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF version 1 (re-convert the model with a current llama.cpp)",
                    self.path.display()
                )))
            }
            v if matches!(v.swap_bytes(), 2 | 3) => {
                return Err(Error::Unsupported(format!(
                    "{}: big-endian GGUF; tboost reads little-endian files only",
                    self.path.display()
                )))
            }
            v => return Err(self.err(format!("unknown GGUF version {v} (tboost reads 2 and 3)"))),
        }
        let n_tensors = self.u64(&|| "the tensor count".to_string())?;
        let n_kv = self.u64(&|| "the metadata count".to_string())?;
        Ok((version, n_tensors, n_kv))
    }

    fn metadata(&mut self, n_kv: u64) -> Result<Metadata> {
        // A key/value takes at least 8 (key length) + 4 (type) + 1 bytes.
        self.cap(n_kv, MAX_METADATA_KEYS, "the metadata count")?;
        let n_kv = self.count(n_kv, 13, || "the metadata count".to_string())?;
        let mut md = Metadata::new();
        for i in 0..n_kv {
            let key = self.string(&|| format!("metadata key #{i}"))?;
            let ty = self.u32(&|| format!("the type of metadata `{key}`"))?;
            let v = self.value(ty, &key, 0)?;
            if md.insert(key.clone(), v).is_some() {
                return Err(self.err(format!("metadata key `{key}` appears twice")));
            }
        }
        Ok(md)
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("metadata `{key}`");
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(&what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("metadata `{key}`: bool byte is {b}, not 0 or 1"))),
            },
            8 => {
                let r = self.bytes_str(&what)?;
                let b = self.bytes(r);
                // Vocabulary entries are not always valid UTF-8 in the wild; keep the value
                // (with replacement characters) but say so.
                match std::str::from_utf8(b) {
                    Ok(s) => Value::String(s.to_owned()),
                    Err(_) => {
                        log::warn!(
                            "{}: metadata `{key}` holds a string that is not valid UTF-8; invalid bytes replaced",
                            self.path.display()
                        );
                        Value::String(String::from_utf8_lossy(b).into_owned())
                    }
                }
            }
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(
                        self.err(format!("metadata `{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"))
                    );
                }
                let ety = self.u32(&|| format!("the element type of metadata `{key}`"))?;
                let min = min_value_bytes(ety)
                    .ok_or_else(|| self.err(format!("metadata `{key}`: unknown array element type {ety}")))?;
                let n = self.u64(&|| format!("the length of metadata `{key}`"))?;
                self.cap(n, MAX_ARRAY_LEN, &format!("the length of metadata array `{key}`"))?;
                let n = self.count(n, min, || format!("the length of metadata array `{key}`"))?;
                self.values = self.values.saturating_add(n);
                if self.values > MAX_METADATA_VALUES {
                    return Err(self.err(format!(
                        "metadata `{key}`: more than tboost's limit of {MAX_METADATA_VALUES} metadata values in total; refusing to load"
                    )));
                }
                let mut out = Vec::new();
                self.reserve(&mut out, n, &format!("metadata array `{key}`"))?;
                for _ in 0..n {
                    out.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(self.err(format!("metadata `{key}`: unknown value type {t}"))),
        })
    }
}

/// Smallest encoding of one value of GGUF type `ty` (None: unknown type).
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small GGUF v3 file: a few metadata values (a string array among them), two F32
    /// tensors and their data.
    fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, v: &str| {
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.as_bytes());
        };
        b.extend(MAGIC);
        b.extend(3u32.to_le_bytes());
        b.extend(2u64.to_le_bytes()); // tensors
        b.extend(3u64.to_le_bytes()); // metadata
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(40u64.to_le_bytes());
        for i in 0..40 {
            s(&mut b, &format!("token{i}"));
        }
        s(&mut b, "llama.block_count");
        b.extend(4u32.to_le_bytes());
        b.extend(2u32.to_le_bytes());
        for (name, dims, offset) in [("a.weight", &[8u64][..], 0u64), ("b.weight", &[8, 4][..], 32)] {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(0u32.to_le_bytes()); // F32
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        b.extend((0..(8 + 32) * 4).map(|i| i as u8));
        b
    }

    /// [`parse_from`] of `bytes` as a file read `step` bytes at a time.
    fn parse_in_reads(bytes: &[u8], step: u64) -> Result<GgufFile> {
        let path = Path::new("tiny.gguf");
        let mut read = |at: u64, dst: &mut [u8]| {
            dst.copy_from_slice(&bytes[at as usize..at as usize + dst.len()]);
            Ok(())
        };
        parse_from(&mut Reader::reading(&mut read, bytes.len() as u64, step, path))
    }

    /// Read in steps of any size, a file parses as it does whole, and every truncated copy
    /// fails with the very error of a parse of the whole (truncated) file.
    #[test]
    fn a_parse_of_a_prefix_read_in_parts_is_a_parse_of_the_whole_file() {
        let full = tiny_gguf();
        let whole = parse(&full, Path::new("tiny.gguf")).unwrap();
        assert_eq!(whole.tensors.len(), 2);
        for step in [0, 1, 7, 64, 100, 333, full.len() as u64, 1 << 20] {
            let got = parse_in_reads(&full, step).unwrap();
            assert_eq!(format!("{got:?}"), format!("{whole:?}"), "reads of {step} bytes");
        }
        for cut in 0..full.len() {
            let want = parse(&full[..cut], Path::new("tiny.gguf")).map(|f| format!("{f:?}"));
            for step in [1, 16, 200] {
                let got = parse_in_reads(&full[..cut], step).map(|f| format!("{f:?}"));
                assert_eq!(
                    got.as_ref().map_err(|e| e.to_string()),
                    want.as_ref().map_err(|e| e.to_string()),
                    "cut {cut}, reads of {step} bytes"
                );
            }
        }
    }
}
