//! RoPE: the tables on the host, the rotation with `aclnnRotaryPositionEmbedding`.
//!
//! - `RopeTables`: cos/sin of `position · inv_freq[i]` computed in f64 on the host from the step's
//!   positions (the host copy `set_step` kept) and `RopeParams::inv_freq()`, rounded to the tables'
//!   dtype and uploaded (staged) into the `[positions, rope_dim/2]` views the runner named.
//!   `RopeTablesScaled` (LongRoPE, Phi-3): the same with frequency `i` divided by the factor list the
//!   graph chose for those rows (short or long), read back from its f32 weight once and kept on the
//!   host; linear/llama3/YaRN scaling is already in `inv_freq()` and the attention factor.
//! - `Rope`: the op wants full-width tables `[1, tokens, 1, head_dim]` (mode 0 "half": dim d uses
//!   frequency d mod D/2; mode 1 "interleave": frequency d/2), so the half tables are widened on the
//!   device with a broadcast `aclnnAdd` of zeros (exact), the rotation of `x` as BSND
//!   `[1, tokens, heads, head_dim]` goes to scratch, and a stream copy puts it back over `x` (the
//!   op's output does not alias its input). Taken only for a rotation of the whole head (rot_dim ==
//!   head_dim), D even and below 896 (research §2.4).

use ascend_sys::aclnn::{self, RopeMode};
use half::{bf16, f16};
use tboost_ops::{DType, RopeParams, RopeStyle};

use super::memory::{Const, Scratch};
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{Backend, View, WeightId};
use crate::Result;

fn encode(dtype: DType, v: &[f64]) -> Result<Vec<u8>> {
    Ok(match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| f16::from_f64(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f64(x).to_le_bytes()).collect(),
        other => return Err(be_err(format!("rope_tables: tables of {other}"))),
    })
}

impl AscendBackend {
    pub(super) fn rope_tables(&mut self, positions: View, rope: &RopeParams, cos: View, sin: View) -> Result<()> {
        self.rope_tables_with(positions, rope, None, cos, sin)
    }

    /// LongRoPE's tables: frequency `i` divided by `factors[i]` (the short or long list the graph
    /// picked for these rows), cos/sin times the attention factor; on the host like the others.
    pub(super) fn rope_tables_scaled(
        &mut self,
        positions: View,
        rope: &RopeParams,
        factors: WeightId,
        cos: View,
        sin: View,
    ) -> Result<()> {
        let f = self.mem.weight_host_f32(factors)?.to_vec();
        if f.len() != rope.dim / 2 {
            return Err(be_err(format!("rope_tables: {} factors for {} frequencies", f.len(), rope.dim / 2)));
        }
        self.rope_tables_with(positions, rope, Some(&f), cos, sin)
    }

    fn rope_tables_with(
        &mut self,
        positions: View,
        rope: &RopeParams,
        factors: Option<&[f32]>,
        cos: View,
        sin: View,
    ) -> Result<()> {
        let half = rope.dim / 2;
        if cos.len != positions.len * half || sin.len != cos.len {
            return Err(be_err(format!(
                "rope_tables: {} / {} table values for {} positions of {half} frequencies",
                cos.len, sin.len, positions.len
            )));
        }
        let pos: Vec<u32> = match self.step_host(positions, |v| v.positions, |s| &s.positions) {
            Some(p) => p.to_vec(),
            None => {
                // Not the step's positions: read them back (a synchronize; the runner never does this).
                let mut b = vec![0u8; positions.len * 4];
                self.read(positions, &mut b)?;
                b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
        };
        let inv = rope.inv_freq_with(factors);
        // YaRN's attention factor scales both tables (1 otherwise).
        let scale = rope.attention_factor();
        let (mut c, mut s) = (Vec::with_capacity(cos.len), Vec::with_capacity(cos.len));
        for &p in &pos {
            for &f in &inv {
                let (sn, cs) = (p as f64 * f).sin_cos();
                c.push(cs * scale);
                s.push(sn * scale);
            }
        }
        let (cd, sd) = (self.mem.dtype(cos)?, self.mem.dtype(sin)?);
        self.write_async(cos, &encode(cd, &c)?)?;
        self.write_async(sin, &encode(sd, &s)?)
    }

    pub(super) fn rope(
        &mut self,
        x: View,
        heads: usize,
        head_dim: usize,
        cos: View,
        sin: View,
        style: RopeStyle,
    ) -> Result<()> {
        let row = heads * head_dim;
        let act = self.mem.dtype(x)?;
        if row == 0 || !x.len.is_multiple_of(row) || cos.len != sin.len {
            return Err(be_err(format!("rope: {} values are not rows of {heads}x{head_dim}", x.len)));
        }
        let rows = x.len / row;
        let half = head_dim / 2;
        if rows == 0 {
            return Ok(());
        }
        if cos.len != rows * half {
            return Err(be_err(format!(
                "rope: tables of {} values for {rows} rows of head_dim {head_dim} (Ascend rotates whole heads: \
                 partial rotary is not taken)",
                cos.len
            )));
        }
        if self.mem.dtype(cos)? != act || self.mem.dtype(sin)? != act {
            return Err(be_err(format!("rope: tables must be {act} like x")));
        }
        let esz = act.block_bytes();
        self.mem.ensure(Scratch::RopeCos, rows * head_dim * esz)?;
        self.mem.ensure(Scratch::RopeSin, rows * head_dim * esz)?;
        self.mem.ensure(Scratch::RopeOut, x.len * esz)?;
        self.mem.ensure_const(Const::Zeros)?;
        let (ctx, m) = (&mut self.ctx, &self.mem);
        // [rows, 1, half] + zeros [1, 2, 1] -> [rows, 2, half] (half); [rows, half, 1] + [1, 1, 2] (interleave)
        let (tab, zero, wide, mode) = match style {
            RopeStyle::HalfSplit => ([rows, 1, half], [1, 2, 1], [rows, 2, half], RopeMode::Half),
            RopeStyle::Adjacent => ([rows, half, 1], [1, 1, 2], [rows, half, 2], RopeMode::Interleave),
        };
        let zeros = m.constant(Const::Zeros, act, &zero)?;
        for (t, s) in [(cos, Scratch::RopeCos), (sin, Scratch::RopeSin)] {
            let src = m.tensor(t, &tab)?;
            let dst = m.scratch(s, act, 0, &wide)?;
            aclnn::add(ctx, &src, &zeros, 1.0, &dst).map_err(|e| acl_err("aclnnAdd (rope tables)", e))?;
        }
        let shape = [1, rows, heads, head_dim];
        let table = [1, rows, 1, head_dim];
        let (c, s) = (m.scratch(Scratch::RopeCos, act, 0, &table)?, m.scratch(Scratch::RopeSin, act, 0, &table)?);
        let (xt, out) = (m.tensor(x, &shape)?, m.scratch(Scratch::RopeOut, act, 0, &shape)?);
        aclnn::rotary_position_embedding(ctx, &xt, &c, &s, mode, &out)
            .map_err(|e| acl_err("aclnnRotaryPositionEmbedding", e))?;
        let (dst, at, bytes) = m.bytes_of(x)?;
        // scratch and orchestrator buffers are freed only after a synchronize
        m.copy(ctx, act, (m.scratch_buf(Scratch::RopeOut)?, 0), (dst, at), bytes, "rope: copy back")
    }
}
