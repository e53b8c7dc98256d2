//! Where each op runs: the primary backend, or the CPU beside it for slots the plan put
//! there. An op on the CPU gets copies of the primary buffers it reads (mirrors, converted
//! to f32 when the primary computes in f16/bf16) and its outputs are copied back; every byte
//! is counted. With a CPU primary nothing of this is used.

use std::collections::HashMap;

use crate::backend::cpu::CpuBackend;
use crate::backend::op::Access;
use crate::backend::{Backend, BufId, DType, Op, View};
use crate::plan::Placement;
use crate::{Error, Result};

/// A primary buffer's copies on the CPU: `raw` in the primary's dtype, `f32` the one the CPU
/// ops use when that dtype is a 16-bit float.
#[derive(Clone, Copy)]
struct Mirror {
    raw: BufId,
    f32: Option<BufId>,
}

pub(crate) struct Fallback {
    pub be: CpuBackend,
    mirrors: HashMap<BufId, Mirror>,
    bytes: Vec<u8>,
    /// Bytes copied between the backends so far.
    pub copied: u64,
}

impl Fallback {
    pub fn new(be: CpuBackend) -> Fallback {
        Fallback { be, mirrors: HashMap::new(), bytes: Vec::new(), copied: 0 }
    }

    fn mirror(&mut self, primary: &dyn Backend, buf: BufId) -> Result<Mirror> {
        if let Some(m) = self.mirrors.get(&buf) {
            return Ok(*m);
        }
        let (dtype, len) = primary.buffer(buf).ok_or_else(|| Error::Backend {
            backend: primary.name().into(),
            msg: format!("unknown buffer {}", buf.0),
        })?;
        let raw = self.be.alloc(dtype, len)?;
        let f32 = if matches!(dtype, DType::F16 | DType::BF16) { Some(self.be.alloc(DType::F32, len)?) } else { None };
        let m = Mirror { raw, f32 };
        self.mirrors.insert(buf, m);
        Ok(m)
    }

    /// Runs `op` (naming primary buffers) on the CPU.
    fn run(&mut self, primary: &mut dyn Backend, op: &Op) -> Result<()> {
        let mut views: Vec<(View, Access)> = Vec::with_capacity(8);
        op.views(&mut |v, a| views.push((v, a)));
        let mut map: Vec<(BufId, Mirror)> = Vec::with_capacity(views.len());
        for &(v, access) in &views {
            let m = self.mirror(primary, v.buf)?;
            map.push((v.buf, m));
            if access != Access::Write {
                let n = byte_len(primary, v)?;
                self.bytes.resize(n, 0);
                primary.read(v, &mut self.bytes)?;
                let raw = View { buf: m.raw, ..v };
                self.be.write_async(raw, &self.bytes)?;
                if let Some(f) = m.f32 {
                    self.be.launch(&Op::Convert { src: raw, dst: View { buf: f, ..v } })?;
                }
                self.copied += n as u64;
            }
        }
        let lookup = |v: View| -> View {
            match map.iter().find(|(b, _)| *b == v.buf) {
                Some((_, m)) => View { buf: m.f32.unwrap_or(m.raw), ..v },
                None => v,
            }
        };
        self.be.launch(&op.remap(&lookup, &|w| w))?;
        for &(v, access) in &views {
            if access == Access::Read {
                continue;
            }
            let m = self.mirror(primary, v.buf)?;
            let raw = View { buf: m.raw, ..v };
            if let Some(f) = m.f32 {
                self.be.launch(&Op::Convert { src: View { buf: f, ..v }, dst: raw })?;
            }
            let n = byte_len(primary, v)?;
            self.bytes.resize(n, 0);
            self.be.read(raw, &mut self.bytes)?;
            primary.write_async(v, &self.bytes)?;
            self.copied += n as u64;
        }
        Ok(())
    }

    /// Drops the mirrors (the primary buffers they copy are being freed or replaced).
    pub fn forget(&mut self) {
        for (_, m) in self.mirrors.drain() {
            self.be.free(m.raw);
            if let Some(f) = m.f32 {
                self.be.free(f);
            }
        }
    }
}

fn byte_len(be: &dyn Backend, v: View) -> Result<usize> {
    be.buffer(v.buf)
        .and_then(|(d, _)| d.bytes_for(v.len))
        .ok_or_else(|| Error::Backend { backend: be.name().into(), msg: format!("bad view of buffer {}", v.buf.0) })
}

/// The backends a forward pass launches on.
pub(crate) struct Exec<'e> {
    pub primary: &'e mut dyn Backend,
    pub cpu: Option<&'e mut Fallback>,
}

impl Exec<'_> {
    pub fn launch(&mut self, at: Placement, op: &Op) -> Result<()> {
        match (at, self.cpu.as_deref_mut()) {
            (Placement::Primary, _) => self.primary.launch(op),
            (Placement::Cpu, Some(f)) => f.run(self.primary, op),
            (Placement::Cpu, None) => Err(Error::Backend {
                backend: "cpu".into(),
                msg: format!("{} is planned on the CPU fallback, which was not created (a bug)", op.name()),
            }),
        }
    }
}
