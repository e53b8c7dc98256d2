//! GGUF v3 writer, and the synthetic models (`synthetic`) written as GGUF files that
//! llama.cpp loads, so both engines can be measured on identical weights.
//! Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
//!
//! The header (metadata and tensor directory) is written first from the tensors' names,
//! shapes and types; the data then streams in, tensor by tensor in directory order, so a
//! multi-gigabyte model never has to be in memory at once.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tboost_ops::DType;

use crate::synthetic::{self, Generator};
use tboost_engine::formats::gguf::Value;
use tboost_engine::model::{Arch, ModelConfig, Tensor};
use tboost_engine::{Error, Result};

/// Data alignment of the files written here (GGUF's default, so no key is needed).
const ALIGNMENT: u64 = 32;

/// The GGML type id (`ggml_type`) of a tboost dtype, for the types GGUF stores as tensors.
pub fn ggml_type(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q2K => 10,
        DType::Q3K => 11,
        DType::IQ4NL => 20,
        DType::IQ4XS => 23,
        DType::Q4K => 12,
        DType::Q5K => 13,
        DType::Q6K => 14,
        DType::BF16 => 30,
        _ => return None,
    })
}

/// llama.cpp's `general.file_type` (`llama_ftype`) of a model whose matrices are `dtype`.
fn file_type(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q2K => 10,
        // MOSTLY_Q3_K_S: every matrix Q3_K.
        DType::Q3K => 11,
        DType::IQ4NL => 25,
        DType::IQ4XS => 30,
        DType::Q4K => 15,
        DType::Q5K => 17,
        DType::Q6K => 18,
        DType::BF16 => 32,
        _ => 0,
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    /// Outermost first, as `Tensor::shape` (written innermost first, as GGUF wants).
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorEntry {
    fn bytes(&self) -> Option<u64> {
        let n = self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        self.dtype.bytes_for(n).map(|b| b as u64)
    }
}

/// Writes one GGUF file: `create` writes the header, `write_tensor` each tensor's data in
/// directory order, `finish` checks that all came and flushes.
pub struct GgufWriter {
    out: BufWriter<File>,
    path: PathBuf,
    entries: Vec<TensorEntry>,
    sizes: Vec<u64>,
    next: usize,
}

/// GGUF's type tag of a metadata value.
pub fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// One header field of a written file: `width` bytes (4 or 8, little-endian) at `pos`, so a
/// test or fuzzer can overwrite counts, lengths, dims, types and offsets in place.
#[derive(Clone, Debug)]
pub struct Field {
    pub pos: usize,
    pub width: usize,
    pub what: String,
}

/// Where header fields are noted while encoding (`None`: nowhere).
pub type Fields<'a> = Option<&'a mut Vec<Field>>;

fn note(fields: &mut Fields, pos: usize, width: usize, what: impl FnOnce() -> String) {
    if let Some(f) = fields.as_deref_mut() {
        f.push(Field { pos, width, what: what() });
    }
}

/// A GGUF string: u64 length, then the bytes.
pub fn put_str(out: &mut Vec<u8>, fields: &mut Fields, s: &str, what: &str) {
    note(fields, out.len(), 8, || format!("length of {what}"));
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Array elements get field entries only for the first few (a vocabulary has 32000).
const ARRAY_FIELDS: usize = 4;

/// Encodes a value without its type tag. An array is tagged with its first element's type (an
/// empty one as u32) and each element is written as it is: `check_value` refuses mixed arrays
/// where a valid file is wanted; tests may write them on purpose.
pub fn put_value(out: &mut Vec<u8>, fields: &mut Fields, v: &Value, what: &str) {
    let scalar = |out: &mut Vec<u8>, fields: &mut Fields, bytes: &[u8]| {
        if bytes.len() == 4 || bytes.len() == 8 {
            note(fields, out.len(), bytes.len(), || format!("value of {what}"));
        }
        out.extend_from_slice(bytes);
    };
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => scalar(out, fields, &x.to_le_bytes()),
        Value::I32(x) => scalar(out, fields, &x.to_le_bytes()),
        Value::U64(x) => scalar(out, fields, &x.to_le_bytes()),
        Value::I64(x) => scalar(out, fields, &x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::String(s) => put_str(out, fields, s, what),
        Value::Array(a) => {
            note(fields, out.len(), 4, || format!("element type of {what}"));
            out.extend_from_slice(&a.first().map_or(4, value_type).to_le_bytes());
            note(fields, out.len(), 8, || format!("length of {what}"));
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for (i, x) in a.iter().enumerate() {
                let mut inner = if i < ARRAY_FIELDS { fields.as_deref_mut() } else { None };
                put_value(out, &mut inner, x, &format!("{what}[{i}]"));
            }
        }
    }
}

/// A metadata entry: key, type tag, value.
pub fn put_entry(out: &mut Vec<u8>, fields: &mut Fields, key: &str, v: &Value) {
    put_str(out, fields, key, &format!("key `{key}`"));
    note(fields, out.len(), 4, || format!("type of `{key}`"));
    out.extend_from_slice(&value_type(v).to_le_bytes());
    put_value(out, fields, v, &format!("`{key}`"));
}

/// Refuses what GGUF cannot hold: an array whose elements differ in type.
pub fn check_value(key: &str, v: &Value) -> std::result::Result<(), String> {
    if let Value::Array(a) = v {
        let ty = a.first().map_or(0, value_type);
        for (i, e) in a.iter().enumerate() {
            if value_type(e) != ty {
                return Err(format!(
                    "metadata `{key}`: element {i} is {} but the array holds {}",
                    e.type_name(),
                    a[0].type_name()
                ));
            }
            check_value(key, e)?;
        }
    }
    Ok(())
}

impl GgufWriter {
    /// Creates `path` and writes the header for `tensors` (whose data must then follow in
    /// this order through `write_tensor`).
    pub fn create(path: &Path, metadata: &[(String, Value)], tensors: Vec<TensorEntry>) -> Result<GgufWriter> {
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            check_value(k, v).map_err(|m| Error::format(path, m))?;
            put_entry(&mut head, &mut None, k, v);
        }
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in &tensors {
            let ty = ggml_type(t.dtype)
                .ok_or_else(|| Error::bad_tensor(path, &t.name, format!("{} cannot be stored in GGUF", t.dtype)))?;
            let inner = t.shape.last().copied().unwrap_or(1);
            let size =
                t.bytes().filter(|_| inner % t.dtype.block_elems() == 0 && !t.shape.is_empty()).ok_or_else(|| {
                    Error::bad_tensor(path, &t.name, format!("shape {:?} is not whole {} blocks", t.shape, t.dtype))
                })?;
            put_str(&mut head, &mut None, &t.name, "tensor name");
            head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                head.extend_from_slice(&(d as u64).to_le_bytes());
            }
            head.extend_from_slice(&ty.to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            sizes.push(size);
            offset += size.div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        head.resize((head.len() as u64).div_ceil(ALIGNMENT) as usize * ALIGNMENT as usize, 0);
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut out = BufWriter::with_capacity(4 << 20, file);
        out.write_all(&head).map_err(|e| Error::io(path, e))?;
        Ok(GgufWriter { out, path: path.to_path_buf(), entries: tensors, sizes, next: 0 })
    }

    /// Writes the data of the next tensor of the directory, which must be `name`.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let Some(e) = self.entries.get(self.next) else {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                "is not in the tensor directory (all tensors were written)",
            ));
        };
        if e.name != name {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                format!("written where the directory has `{}` next", e.name),
            ));
        }
        let size = self.sizes[self.next];
        if data.len() as u64 != size {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                format!("has {} bytes, the directory says {size}", data.len()),
            ));
        }
        let pad = (size.div_ceil(ALIGNMENT) * ALIGNMENT - size) as usize;
        self.out.write_all(data).map_err(|e| Error::io(&self.path, e))?;
        self.out.write_all(&[0u8; ALIGNMENT as usize][..pad]).map_err(|e| Error::io(&self.path, e))?;
        self.next += 1;
        Ok(())
    }

    /// Checks that every tensor was written, and flushes the file.
    pub fn finish(mut self) -> Result<()> {
        if let Some(e) = self.entries.get(self.next) {
            return Err(Error::bad_tensor(&self.path, &e.name, "was never written"));
        }
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        self.out.get_ref().sync_all().map_err(|e| Error::io(&self.path, e))
    }
}

/// The llama.cpp name of a synthetic (HF-named) tensor.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (i, part) = rest.split_once('.')?;
    let g = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{i}.{g}"))
}

/// Reorders the rows of a Q or K projection the way llama.cpp's converter does for llama
/// models, so that GGML's adjacent-pair RoPE on the file computes what half-split RoPE
/// computes on the original: within each head of `head_dim` rows, row `s * head_dim/2 + r`
/// moves to `2r + s`. Rows are whole (quantized rows included), so bytes move as units.
pub fn permute_qk_rows(data: &[u8], rows: usize, head_dim: usize) -> Vec<u8> {
    let rb = data.len() / rows.max(1);
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for dst in 0..rows {
        let (h, w) = (dst / head_dim, dst % head_dim);
        let (r, s) = (w / 2, w % 2);
        let src = h * head_dim + s * half + r;
        out[dst * rb..(dst + 1) * rb].copy_from_slice(&data[src * rb..(src + 1) * rb]);
    }
    out
}

/// A SentencePiece-style vocabulary of `n` tokens that llama.cpp accepts: `<unk>`, `<s>`,
/// `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>`, then unique placeholder pieces.
fn vocabulary(n: usize) -> (Vec<Value>, Vec<Value>, Vec<Value>) {
    let mut tokens = Vec::with_capacity(n);
    let mut scores = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for i in 0..n {
        let (piece, ty) = match i {
            0 => ("<unk>".to_string(), 2),
            1 => ("<s>".to_string(), 3),
            2 => ("</s>".to_string(), 3),
            3..=258 => (format!("<0x{:02X}>", i - 3), 6),
            _ => (format!("\u{2581}t{i}"), 1),
        };
        tokens.push(Value::String(piece));
        scores.push(Value::F32(if ty == 1 { -(i as f32) } else { 0.0 }));
        types.push(Value::I32(ty));
    }
    (tokens, scores, types)
}

/// The metadata llama.cpp's `llama` architecture reads, for a synthetic model.
fn metadata(shape: &str, cfg: &ModelConfig, dtype: DType) -> Vec<(String, Value)> {
    let a = |k: &str| format!("llama.{k}");
    let u = |v: usize| Value::U32(v as u32);
    let (tokens, scores, types) = vocabulary(cfg.vocab_size);
    vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.name".into(), Value::String(format!("tboost synthetic {shape} {dtype}"))),
        ("general.file_type".into(), Value::U32(file_type(dtype))),
        (a("vocab_size"), u(cfg.vocab_size)),
        (a("context_length"), u(cfg.max_position_embeddings)),
        (a("embedding_length"), u(cfg.hidden_size)),
        (a("block_count"), u(cfg.num_layers)),
        (a("feed_forward_length"), u(cfg.intermediate_size)),
        (a("attention.head_count"), u(cfg.num_heads)),
        (a("attention.head_count_kv"), u(cfg.num_kv_heads)),
        (a("rope.dimension_count"), u(cfg.rope_dim)),
        (a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_eps as f32)),
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.scores".into(), Value::Array(scores)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(cfg.bos_token_id.unwrap_or(1))),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(cfg.eos_token_ids.first().copied().unwrap_or(2))),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
    ]
}

/// The GGUF form of one generated tensor: its llama.cpp name and its bytes (Q and K rows
/// permuted as llama.cpp's converter does).
pub fn to_gguf(t: &Tensor, cfg: &ModelConfig) -> Result<(String, Vec<u8>)> {
    let name = gguf_name(&t.name)
        .ok_or_else(|| Error::bad_tensor("<synthetic>", &t.name, "has no llama.cpp name".to_string()))?;
    let bytes = if name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
        permute_qk_rows(t.bytes(), t.shape[0], cfg.head_dim)
    } else {
        t.bytes().to_vec()
    };
    Ok((name, bytes))
}

/// Writes the synthetic model `shape` with matrices in `dtype` (norm gains f32) and `seed`
/// as a GGUF file llama.cpp loads (architecture `llama`, an SPM vocabulary of placeholder
/// pieces). The weights are those `synthetic::build(shape, dtype, seed)` makes, with Q/K
/// rows in llama.cpp's order; tboost reads the file as the same model. Calls
/// `progress(done, total)` in bytes.
pub fn write_synthetic(
    shape: &str,
    dtype: DType,
    seed: u64,
    path: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let cfg = synthetic::config(shape)?;
    if cfg.arch != Arch::Llama {
        return Err(Error::Unsupported(format!(
            "synth: shape `{shape}` is a {:?} model; GGUF files are written for dense llama shapes",
            cfg.arch
        )));
    }
    let specs = synthetic::specs(&cfg);
    let entries: Vec<TensorEntry> = specs
        .iter()
        .map(|s| {
            let name = gguf_name(&s.name)
                .ok_or_else(|| Error::bad_tensor("<synthetic>", &s.name, "has no llama.cpp name".to_string()))?;
            Ok(TensorEntry { name, shape: s.shape.clone(), dtype: if s.matrix { dtype } else { DType::F32 } })
        })
        .collect::<Result<_>>()?;
    let total: u64 = entries.iter().filter_map(TensorEntry::bytes).sum();
    let mut w = GgufWriter::create(path, &metadata(shape, &cfg, dtype), entries)?;
    let mut gen = Generator::new(seed);
    let mut done = 0u64;
    progress(0, total);
    for s in &specs {
        let t = gen.next(s, dtype)?;
        let (name, bytes) = to_gguf(&t, &cfg)?;
        w.write_tensor(&name, &bytes)?;
        done += bytes.len() as u64;
        progress(done, total);
    }
    w.finish()
}
