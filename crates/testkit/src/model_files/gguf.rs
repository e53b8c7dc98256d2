//! A GGUF writer for test files, and a reader that turns a real file into the same editable
//! form (through the library's own parser). `build` also returns where each header field
//! was written, so a fuzzer can overwrite counts, lengths, dims, types and offsets in place.

use std::path::{Path, PathBuf};

use tboost_engine::model::gguf::{self, Value};

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

/// One header field of a written file: `width` bytes (4 or 8, little-endian) at `pos`.
#[derive(Clone, Debug)]
pub struct Field {
    pub pos: usize,
    pub width: usize,
    pub what: String,
}

#[derive(Clone, Debug)]
pub struct GTensor {
    pub name: String,
    /// GGML order, innermost first.
    pub ne: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
    /// Written instead of the real offset (to make the header lie).
    pub offset_override: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub kv: Vec<(String, Value)>,
    pub tensors: Vec<GTensor>,
}

fn put_str(out: &mut Vec<u8>, fields: &mut Vec<Field>, s: &str, what: &str) {
    fields.push(Field { pos: out.len(), width: 8, what: format!("length of {what}") });
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Array elements get field entries only for the first few (a vocabulary has 32000).
const ARRAY_FIELDS: usize = 4;

fn put_value(out: &mut Vec<u8>, fields: &mut Vec<Field>, v: &Value, what: &str, record: bool) {
    let mut scalar = |out: &mut Vec<u8>, bytes: &[u8]| {
        if record && (bytes.len() == 4 || bytes.len() == 8) {
            fields.push(Field { pos: out.len(), width: bytes.len(), what: format!("value of {what}") });
        }
        out.extend(bytes);
    };
    match v {
        Value::U8(x) => out.extend(x.to_le_bytes()),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => scalar(out, &x.to_le_bytes()),
        Value::I32(x) => scalar(out, &x.to_le_bytes()),
        Value::U64(x) => scalar(out, &x.to_le_bytes()),
        Value::I64(x) => scalar(out, &x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(b) => out.push(*b as u8),
        Value::String(s) => {
            if record {
                put_str(out, fields, s, what);
            } else {
                out.extend((s.len() as u64).to_le_bytes());
                out.extend(s.as_bytes());
            }
        }
        Value::Array(a) => {
            if record {
                fields.push(Field { pos: out.len(), width: 4, what: format!("element type of {what}") });
            }
            out.extend(a.first().map_or(4, value_type).to_le_bytes());
            if record {
                fields.push(Field { pos: out.len(), width: 8, what: format!("length of {what}") });
            }
            out.extend((a.len() as u64).to_le_bytes());
            for (i, x) in a.iter().enumerate() {
                put_value(out, fields, x, &format!("{what}[{i}]"), record && i < ARRAY_FIELDS);
            }
        }
    }
}

impl Gguf {
    pub fn new() -> Gguf {
        Gguf { version: 3, kv: vec![], tensors: vec![] }
    }

    /// A real file in editable form: its metadata (in key order) and every tensor's bytes.
    pub fn from_file(path: &Path) -> Gguf {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let f = gguf::parse(&bytes, path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let tensors = f
            .tensors
            .iter()
            .map(|t| {
                let start = (f.data_offset + t.offset) as usize;
                let size = t.size.unwrap_or_else(|| panic!("{}: tensor {} of an unknown type", path.display(), t.name));
                GTensor {
                    name: t.name.clone(),
                    ne: t.dims.clone(),
                    ty: t.ggml_type,
                    data: bytes[start..start + size as usize].to_vec(),
                    offset_override: None,
                }
            })
            .collect();
        Gguf { version: f.version, kv: f.metadata.into_iter().collect(), tensors }
    }

    pub fn set(&mut self, key: &str, v: Value) {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some((_, old)) => *old = v,
            None => self.kv.push((key.to_string(), v)),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn remove(&mut self, key: &str) {
        self.kv.retain(|(k, _)| k != key);
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut GTensor {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// An f32 tensor with small deterministic values.
    pub fn add_f32(&mut self, name: &str, ne: &[u64]) {
        let n: u64 = ne.iter().product();
        let seed = self.tensors.len();
        let data =
            (0..n).flat_map(|i| (((i as usize * 5 + seed * 11) % 23) as f32 * 0.01 - 0.1).to_le_bytes()).collect();
        self.tensors.push(GTensor { name: name.into(), ne: ne.to_vec(), ty: 0, data, offset_override: None });
    }

    fn alignment(&self) -> usize {
        match self.get("general.alignment").and_then(Value::as_u64) {
            Some(a) if a.is_power_of_two() && a <= 1 << 16 => a as usize,
            _ => 32,
        }
    }

    /// The file's bytes and the header fields' positions.
    pub fn build(&self) -> (Vec<u8>, Vec<Field>) {
        let align = self.alignment();
        let mut fields = Vec::new();
        let mut out = b"GGUF".to_vec();
        fields.push(Field { pos: out.len(), width: 4, what: "version".into() });
        out.extend(self.version.to_le_bytes());
        fields.push(Field { pos: out.len(), width: 8, what: "tensor count".into() });
        out.extend((self.tensors.len() as u64).to_le_bytes());
        fields.push(Field { pos: out.len(), width: 8, what: "metadata count".into() });
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, &mut fields, k, &format!("key `{k}`"));
            fields.push(Field { pos: out.len(), width: 4, what: format!("type of `{k}`") });
            out.extend(value_type(v).to_le_bytes());
            put_value(&mut out, &mut fields, v, &format!("`{k}`"), true);
        }
        let mut offset = 0usize;
        let mut offsets = vec![];
        for t in &self.tensors {
            let n = &t.name;
            put_str(&mut out, &mut fields, n, &format!("tensor name `{n}`"));
            fields.push(Field { pos: out.len(), width: 4, what: format!("dimension count of `{n}`") });
            out.extend((t.ne.len() as u32).to_le_bytes());
            for (i, d) in t.ne.iter().enumerate() {
                fields.push(Field { pos: out.len(), width: 8, what: format!("dimension {i} of `{n}`") });
                out.extend(d.to_le_bytes());
            }
            fields.push(Field { pos: out.len(), width: 4, what: format!("type of `{n}`") });
            out.extend(t.ty.to_le_bytes());
            fields.push(Field { pos: out.len(), width: 8, what: format!("data offset of `{n}`") });
            out.extend(t.offset_override.unwrap_or(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        let data_start = out.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(&t.data);
        }
        (out, fields)
    }

    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.build().0).unwrap();
        p
    }
}

/// The shape of [`tiny_llama`]: the projections' row counts are given directly, so a test
/// can write the tensors a *wrapped* product (`head_count * key_length` mod 2^64) implies.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub vocab: u64,
    pub hidden: u64,
    pub layers: u64,
    pub q_rows: u64,
    pub kv_rows: u64,
    pub ffn: u64,
}

/// hidden 32, 2 heads of 16, 1 kv head, ffn 32, vocab 16, 2 layers.
pub const TINY: Shape = Shape { vocab: 16, hidden: 32, layers: 2, q_rows: 32, kv_rows: 16, ffn: 32 };

/// A consistent f32 llama of `s`'s shape (metadata for 2 heads of q_rows/2, one kv head).
pub fn tiny_llama(s: Shape) -> Gguf {
    let u = Value::U32;
    let mut g = Gguf::new();
    g.set("general.architecture", Value::String("llama".into()));
    g.set("general.name", Value::String("tiny".into()));
    g.set("llama.block_count", u(s.layers as u32));
    g.set("llama.context_length", u(64));
    g.set("llama.embedding_length", u(s.hidden as u32));
    g.set("llama.feed_forward_length", u(s.ffn as u32));
    g.set("llama.attention.head_count", u(2));
    g.set("llama.attention.head_count_kv", u(1));
    g.set("llama.attention.key_length", u((s.q_rows / 2) as u32));
    g.set("llama.rope.dimension_count", u((s.q_rows / 2) as u32));
    g.set("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    g.set("tokenizer.ggml.model", Value::String("llama".into()));
    g.set("tokenizer.ggml.tokens", Value::Array((0..s.vocab).map(|i| Value::String(format!("t{i}"))).collect()));
    g.set("tokenizer.ggml.scores", Value::Array((0..s.vocab).map(|i| Value::F32(-(i as f32))).collect()));
    g.set("tokenizer.ggml.bos_token_id", u(1));
    g.set("tokenizer.ggml.eos_token_id", u(2));
    let h = s.hidden;
    g.add_f32("token_embd.weight", &[h, s.vocab]);
    for i in 0..s.layers {
        g.add_f32(&format!("blk.{i}.attn_norm.weight"), &[h]);
        g.add_f32(&format!("blk.{i}.attn_q.weight"), &[h, s.q_rows]);
        g.add_f32(&format!("blk.{i}.attn_k.weight"), &[h, s.kv_rows]);
        g.add_f32(&format!("blk.{i}.attn_v.weight"), &[h, s.kv_rows]);
        g.add_f32(&format!("blk.{i}.attn_output.weight"), &[s.q_rows, h]);
        g.add_f32(&format!("blk.{i}.ffn_norm.weight"), &[h]);
        g.add_f32(&format!("blk.{i}.ffn_gate.weight"), &[h, s.ffn]);
        g.add_f32(&format!("blk.{i}.ffn_up.weight"), &[h, s.ffn]);
        g.add_f32(&format!("blk.{i}.ffn_down.weight"), &[s.ffn, h]);
    }
    g.add_f32("output_norm.weight", &[h]);
    g.add_f32("output.weight", &[h, s.vocab]);
    g
}

/// A tiny MoE (llama + experts = Mixtral) and a tiny qwen2 (biases, tied output) from the
/// generator, so the MoE and bias paths are fuzzed too.
pub fn tiny_moe() -> Gguf {
    let mut g = tiny_llama(TINY);
    g.set("llama.expert_count", Value::U32(3));
    g.set("llama.expert_used_count", Value::U32(2));
    for i in 0..2 {
        g.tensors.retain(|t| !t.name.starts_with(&format!("blk.{i}.ffn_")) || t.name.ends_with("norm.weight"));
        g.add_f32(&format!("blk.{i}.ffn_gate_inp.weight"), &[32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_gate_exps.weight"), &[32, 32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_up_exps.weight"), &[32, 32, 3]);
        g.add_f32(&format!("blk.{i}.ffn_down_exps.weight"), &[32, 32, 3]);
    }
    g
}

pub fn tiny_qwen2() -> Gguf {
    let mut g = tiny_llama(TINY);
    for (k, _) in &mut g.kv {
        *k = k.replace("llama.", "qwen2.");
    }
    g.set("general.architecture", Value::String("qwen2".into()));
    g.tensors.retain(|t| t.name != "output.weight");
    for i in 0..2 {
        g.add_f32(&format!("blk.{i}.attn_q.bias"), &[32]);
        g.add_f32(&format!("blk.{i}.attn_k.bias"), &[16]);
        g.add_f32(&format!("blk.{i}.attn_v.bias"), &[16]);
    }
    g
}
