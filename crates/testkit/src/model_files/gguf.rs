//! GGUF files as editable values for tests: written with `gguf_write`'s encoder, read back from
//! real files through the library's own parser. `build` also returns where each header field
//! was written, so a fuzzer can overwrite counts, lengths, dims, types and offsets in place.

use std::path::{Path, PathBuf};

use tboost_engine::formats::gguf::{self, Value};

pub use crate::gguf_write::Field;
use crate::gguf_write::{put_entry, put_str};

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

/// Byte positions of the sections of a written file.
#[derive(Clone, Copy, Debug)]
pub struct Sections {
    pub metadata_start: usize,
    pub infos_start: usize,
    pub data_start: usize,
}

#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub kv: Vec<(String, Value)>,
    pub tensors: Vec<GTensor>,
}

impl Default for Gguf {
    fn default() -> Gguf {
        Gguf::new()
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
        let (out, fields, _) = self.encode();
        (out, fields)
    }

    /// The file's bytes and where its sections start.
    pub fn build_sections(&self) -> (Vec<u8>, Sections) {
        let (out, _, sections) = self.encode();
        (out, sections)
    }

    fn encode(&self) -> (Vec<u8>, Vec<Field>, Sections) {
        let align = self.alignment();
        let mut fields = Vec::new();
        let f = &mut Some(&mut fields);
        let mut out = b"GGUF".to_vec();
        let field = |f: &mut Option<&mut Vec<Field>>, pos, width, what: &str| {
            if let Some(v) = f.as_deref_mut() {
                v.push(Field { pos, width, what: what.to_string() });
            }
        };
        field(f, out.len(), 4, "version");
        out.extend(self.version.to_le_bytes());
        field(f, out.len(), 8, "tensor count");
        out.extend((self.tensors.len() as u64).to_le_bytes());
        field(f, out.len(), 8, "metadata count");
        out.extend((self.kv.len() as u64).to_le_bytes());
        let metadata_start = out.len();
        for (k, v) in &self.kv {
            put_entry(&mut out, f, k, v);
        }
        let infos_start = out.len();
        let mut offset = 0usize;
        let mut offsets = vec![];
        for t in &self.tensors {
            let n = &t.name;
            put_str(&mut out, f, n, &format!("tensor name `{n}`"));
            field(f, out.len(), 4, &format!("dimension count of `{n}`"));
            out.extend((t.ne.len() as u32).to_le_bytes());
            for (i, d) in t.ne.iter().enumerate() {
                field(f, out.len(), 8, &format!("dimension {i} of `{n}`"));
                out.extend(d.to_le_bytes());
            }
            field(f, out.len(), 4, &format!("type of `{n}`"));
            out.extend(t.ty.to_le_bytes());
            field(f, out.len(), 8, &format!("data offset of `{n}`"));
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
        (out, fields, Sections { metadata_start, infos_start, data_start })
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
