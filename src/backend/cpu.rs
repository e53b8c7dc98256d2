//! The CPU backend: host buffers, zero-copy weights, kernels run at once on the engine's
//! own rayon pool (never the host's global pool).

use std::alloc::{alloc_zeroed, dealloc, Layout};

use tboost_kernels::attention::{self, KvPool, KvPoolMut};
use tboost_kernels::matmul::{self, MatSeg};
use tboost_kernels::{activation, embed, isa, moe, norm, rope, DType, WeightMat, WeightVec};

use super::op::{AttnKind, KvLayer, Op, OpQuery, View};
use super::{Backend, BufId, WeightId};
use crate::model::Tensor;
use crate::{Error, Result};

/// A zero-filled, 64-byte aligned host allocation.
struct HostBuf {
    ptr: *mut u8,
    bytes: usize,
    dtype: DType,
    len: usize,
}

// SAFETY: HostBuf uniquely owns its allocation.
unsafe impl Send for HostBuf {}

impl HostBuf {
    fn new(dtype: DType, len: usize) -> Option<HostBuf> {
        let bytes = dtype.bytes_for(len)?;
        let layout = Layout::from_size_align(bytes.max(64), 64).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        Some(HostBuf { ptr, bytes, dtype, len })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.bytes.max(64), 64)) }
    }
}

pub struct CpuBackend {
    /// Per-op (count, seconds) when `TBOOST_PROFILE` is set; printed when the backend drops.
    profile: Option<std::collections::BTreeMap<&'static str, (u64, f64)>>,
    pool: std::sync::Arc<rayon::ThreadPool>,
    threads: usize,
    bufs: Vec<Option<HostBuf>>,
    free_ids: Vec<u32>,
    allocated: usize,
    weights: Vec<Tensor>,
}

impl CpuBackend {
    /// A backend with its own pool of `threads` compute threads (0 = one per core).
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = super::cpu_pool::build_pool(threads).map_err(|msg| Error::Backend { backend: "cpu".into(), msg })?;
        let profile = std::env::var_os("TBOOST_PROFILE").map(|_| Default::default());
        Ok(CpuBackend {
            profile,
            pool: std::sync::Arc::new(pool),
            threads,
            bufs: Vec::new(),
            free_ids: Vec::new(),
            allocated: 0,
            weights: Vec::new(),
        })
    }

    fn err(msg: impl Into<String>) -> Error {
        Error::Backend { backend: "cpu".into(), msg: msg.into() }
    }

    fn buf(&self, id: BufId) -> Result<&HostBuf> {
        self.bufs
            .get(id.0 as usize)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| Self::err(format!("unknown buffer {}", id.0)))
    }

    fn weight(&self, id: WeightId) -> Result<&Tensor> {
        self.weights.get(id.0 as usize).ok_or_else(|| Self::err(format!("unknown weight {}", id.0)))
    }

    fn mat(&self, id: WeightId) -> Result<WeightMat<'_>> {
        Ok(self.weight(id)?.as_mat())
    }

    fn vec(&self, id: WeightId) -> Result<WeightVec<'_>> {
        Ok(self.weight(id)?.as_vec())
    }
}

/// Resolves the views of one op to slices, checking bounds, dtypes and that every written
/// view overlaps no other view of the op (so handing out `&mut` slices is sound).
struct Views<'b> {
    be: &'b CpuBackend,
    spans: Vec<(BufId, usize, usize, bool)>,
}

impl<'b> Views<'b> {
    fn new(be: &'b CpuBackend) -> Self {
        Views { be, spans: Vec::with_capacity(8) }
    }

    fn claim(&mut self, buf: BufId, start_byte: usize, end_byte: usize, write: bool) -> Result<()> {
        for &(b, s, e, w) in &self.spans {
            if b == buf && start_byte < e && s < end_byte && (write || w) {
                return Err(CpuBackend::err(format!(
                    "op views overlap in buffer {} (a bug in the graph builder)",
                    buf.0
                )));
            }
        }
        self.spans.push((buf, start_byte, end_byte, write));
        Ok(())
    }

    fn raw(&mut self, v: View, dtype: DType, write: bool) -> Result<*mut u8> {
        let hb = self.be.buf(v.buf)?;
        if hb.dtype != dtype {
            return Err(CpuBackend::err(format!("buffer {} holds {} where {} was expected", v.buf.0, hb.dtype, dtype)));
        }
        let end = v.offset.checked_add(v.len).filter(|&e| e <= hb.len).ok_or_else(|| {
            CpuBackend::err(format!(
                "view {}..{}+{} out of buffer {} of {}",
                v.offset, v.offset, v.len, v.buf.0, hb.len
            ))
        })?;
        let es = dtype.block_bytes();
        self.claim(v.buf, v.offset * es, end * es, write)?;
        // SAFETY: offset is within the allocation (checked above).
        Ok(unsafe { hb.ptr.add(v.offset * es) })
    }

    fn f32(&mut self, v: View) -> Result<&'b [f32]> {
        let p = self.raw(v, DType::F32, false)?;
        // SAFETY: in bounds, aligned (64-byte base, 4-byte elements), not written by this op.
        Ok(unsafe { std::slice::from_raw_parts(p as *const f32, v.len) })
    }

    #[allow(clippy::mut_from_ref)]
    fn f32_mut(&mut self, v: View) -> Result<&'b mut [f32]> {
        let p = self.raw(v, DType::F32, true)?;
        // SAFETY: in bounds, aligned, and no other view of this op overlaps it.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut f32, v.len) })
    }

    /// A whole buffer as bytes (KV pools).
    fn whole(&mut self, buf: BufId, dtype: DType, write: bool) -> Result<(*mut u8, usize)> {
        let len = self.be.buf(buf)?.len;
        let p = self.raw(View::new(buf, 0, len), dtype, write)?;
        Ok((p, dtype.bytes_for(len).unwrap_or(0)))
    }

    fn pool(&mut self, c: &KvLayer) -> Result<KvPool<'b>> {
        let (k, kb) = self.whole(c.k, c.dtype, false)?;
        let (v, vb) = self.whole(c.v, c.dtype, false)?;
        // SAFETY: whole buffers, read-only in this op.
        let (k, v) = unsafe { (std::slice::from_raw_parts(k, kb), std::slice::from_raw_parts(v, vb)) };
        Ok(KvPool { dtype: c.dtype, block_size: c.block_size, kv_heads: c.kv_heads, head_dim: c.head_dim, k, v })
    }

    fn pool_mut(&mut self, c: &KvLayer) -> Result<KvPoolMut<'b>> {
        let (k, kb) = self.whole(c.k, c.dtype, true)?;
        let (v, vb) = self.whole(c.v, c.dtype, true)?;
        // SAFETY: whole buffers, exclusively claimed by this op.
        let (k, v) = unsafe { (std::slice::from_raw_parts_mut(k, kb), std::slice::from_raw_parts_mut(v, vb)) };
        Ok(KvPoolMut { dtype: c.dtype, block_size: c.block_size, kv_heads: c.kv_heads, head_dim: c.head_dim, k, v })
    }
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(CpuBackend::err(format!(
            "{what}: {got} elements where {want} were expected (a bug in the graph builder)"
        )));
    }
    Ok(())
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn describe(&self) -> String {
        format!("cpu {} x{} threads", isa::active().name(), self.threads)
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn supports(&self, query: &OpQuery) -> Result<(), tboost_ops::Unsupported> {
        match query {
            OpQuery::Attention(AttnKind::Flash, case) => attention::flash_supports(case),
            OpQuery::Attention(AttnKind::Standard, case) => attention::standard_supports(case),
            OpQuery::MatMul(case) => matmul::supports(case),
            OpQuery::Embed(dtype) => embed::supports(*dtype),
            OpQuery::RmsNorm(dtype) => norm::supports(*dtype),
            OpQuery::Rope { head_dim, rot_dim } => rope::supports(*head_dim, *rot_dim),
            OpQuery::Moe { experts, top_k } => moe::supports(*experts, *top_k),
        }
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId> {
        let hb = HostBuf::new(dtype, len).ok_or_else(|| Self::err(format!("cannot allocate {len} x {dtype}")))?;
        self.allocated += hb.bytes;
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.bufs[id as usize] = Some(hb);
                id
            }
            None => {
                self.bufs.push(Some(hb));
                (self.bufs.len() - 1) as u32
            }
        };
        Ok(BufId(id))
    }

    fn free(&mut self, buf: BufId) {
        if let Some(slot) = self.bufs.get_mut(buf.0 as usize) {
            if let Some(hb) = slot.take() {
                self.allocated -= hb.bytes;
                self.free_ids.push(buf.0);
            }
        }
    }

    fn allocated_bytes(&self) -> usize {
        self.allocated
    }

    fn upload_weight(&mut self, tensor: &Tensor) -> Result<WeightId> {
        // Zero-copy: the tensor keeps its memory map (or owned buffer) alive.
        self.weights.push(tensor.clone());
        Ok(WeightId((self.weights.len() - 1) as u32))
    }

    fn write(&mut self, view: View, data: &[f32]) -> Result<()> {
        check_len("write", data.len(), view.len)?;
        let mut vs = Views::new(self);
        vs.f32_mut(view)?.copy_from_slice(data);
        Ok(())
    }

    fn read(&mut self, view: View, out: &mut [f32]) -> Result<()> {
        check_len("read", out.len(), view.len)?;
        let mut vs = Views::new(self);
        out.copy_from_slice(vs.f32(view)?);
        Ok(())
    }

    fn launch(&mut self, op: &Op<'_>) -> Result<()> {
        let t0 = self.profile.as_ref().map(|_| std::time::Instant::now());
        let r = self.run_op(op);
        if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
            let e = p.entry(op.name()).or_default();
            e.0 += 1;
            e.1 += t0.elapsed().as_secs_f64();
        }
        r
    }

    fn with_stream(&mut self, work: &mut (dyn FnMut(&mut dyn Backend) -> Result<()> + Send)) -> Result<()> {
        let pool = self.pool.clone();
        // Inside `install` this thread is one of the pool's workers, so the ops' own
        // `install` calls run inline and their parallel loops use the whole pool.
        pool.install(|| work(self))
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        if let Some(p) = self.profile.take() {
            let total: f64 = p.values().map(|v| v.1).sum();
            eprintln!("tboost profile (cpu backend, {} threads): {:.3} s in ops", self.threads, total);
            let mut rows: Vec<_> = p.into_iter().collect();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            for (name, (n, secs)) in rows {
                eprintln!(
                    "  {name:<20} {n:>8} calls {:>10.3} ms {:>5.1}%",
                    secs * 1e3,
                    100.0 * secs / total.max(1e-12)
                );
            }
        }
    }
}

impl CpuBackend {
    fn run_op(&mut self, op: &Op<'_>) -> Result<()> {
        let mut vs = Views::new(self);
        match op {
            Op::Embed { ids, table, out } => {
                let t = self.mat(*table)?;
                check_len("embed out", out.len, ids.len() * t.cols)?;
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= t.rows) {
                    return Err(Error::invalid(
                        "token id",
                        format!("{bad} is not below the vocabulary size {}", t.rows),
                    ));
                }
                let out = vs.f32_mut(*out)?;
                self.pool.install(|| embed::embed(ids, t, out));
            }
            Op::RmsNorm { x, w, eps, out } => {
                let w = self.vec(*w)?;
                check_len("rmsnorm", x.len, out.len)?;
                let (x, out) = (vs.f32(*x)?, vs.f32_mut(*out)?);
                self.pool.install(|| norm::rmsnorm(x, w, *eps, out));
            }
            Op::AddRmsNorm { residual, x, w, eps, out } => {
                let w = self.vec(*w)?;
                check_len("add_rmsnorm", x.len, residual.len)?;
                check_len("add_rmsnorm", out.len, residual.len)?;
                let (r, x, out) = (vs.f32_mut(*residual)?, vs.f32(*x)?, vs.f32_mut(*out)?);
                self.pool.install(|| norm::add_rmsnorm(r, x, w, *eps, out));
            }
            Op::Add { dst, src } => {
                check_len("add", src.len, dst.len)?;
                let (d, s) = (vs.f32_mut(*dst)?, vs.f32(*src)?);
                self.pool.install(|| norm::add(d, s));
            }
            Op::MatMul { x, m, segs } => {
                let xs = vs.f32(*x)?;
                let mut ms = Vec::with_capacity(segs.len());
                for s in segs.iter() {
                    let w = self.mat(s.w)?;
                    check_len("matmul x", xs.len(), m * w.cols)?;
                    check_len("matmul out", s.out.len, m * w.rows)?;
                    let bias = match s.bias {
                        Some(b) => Some(self.vec(b)?),
                        None => None,
                    };
                    ms.push(MatSeg { w, bias, out: vs.f32_mut(s.out)? });
                }
                self.pool.install(|| matmul::matmul(xs, *m, &mut ms));
            }
            Op::MatMulSwiGlu { x, m, gate, up, out } => {
                let (g, u) = (self.mat(*gate)?, self.mat(*up)?);
                check_len("matmul_swiglu x", x.len, m * g.cols)?;
                check_len("matmul_swiglu out", out.len, m * g.rows)?;
                let (xs, out) = (vs.f32(*x)?, vs.f32_mut(*out)?);
                self.pool.install(|| matmul::matmul_swiglu(xs, *m, g, u, out));
            }
            Op::SwiGlu { gate, up, out } => {
                check_len("swiglu", up.len, gate.len)?;
                check_len("swiglu", out.len, gate.len)?;
                let (g, u, o) = (vs.f32(*gate)?, vs.f32(*up)?, vs.f32_mut(*out)?);
                self.pool.install(|| activation::swiglu(g, u, o));
            }
            Op::RopeTables { positions, inv_freq, cos, sin } => {
                check_len("rope cos", cos.len, positions.len() * inv_freq.len())?;
                check_len("rope sin", sin.len, positions.len() * inv_freq.len())?;
                let (c, s) = rope::cos_sin(positions, inv_freq);
                vs.f32_mut(*cos)?.copy_from_slice(&c);
                vs.f32_mut(*sin)?.copy_from_slice(&s);
            }
            Op::Rope { x, heads, head_dim, cos, sin, style } => {
                let (c, s, x) = (vs.f32(*cos)?, vs.f32(*sin)?, vs.f32_mut(*x)?);
                self.pool.install(|| rope::apply(x, *heads, *head_dim, c, s, *style));
            }
            Op::WriteKv { k, v, slots, cache } => {
                let row = cache.kv_heads * cache.head_dim;
                check_len("write_kv k", k.len, slots.len() * row)?;
                check_len("write_kv v", v.len, slots.len() * row)?;
                let (k, v, mut pool) = (vs.f32(*k)?, vs.f32(*v)?, vs.pool_mut(cache)?);
                let capacity = pool.k.len() / (row * cache.dtype.block_bytes());
                if let Some(&bad) = slots.iter().find(|&&s| s as usize >= capacity) {
                    return Err(Self::err(format!("KV slot {bad} beyond the pool's {capacity} slots")));
                }
                self.pool.install(|| attention::write_kv(k, v, slots, &mut pool));
            }
            Op::Attention { kind, q, cache, seqs, params, out } => {
                let (q, pool, out) = (vs.f32(*q)?, vs.pool(cache)?, vs.f32_mut(*out)?);
                let blocks =
                    pool.k.len() / (cache.block_size * cache.kv_heads * cache.head_dim * cache.dtype.block_bytes());
                for s in seqs.iter() {
                    if s.ctx_len > s.block_table.len() * cache.block_size || s.q_len > s.ctx_len {
                        return Err(Self::err(format!(
                            "sequence of {} positions has a block table of {}",
                            s.ctx_len,
                            s.block_table.len()
                        )));
                    }
                    if s.block_table.iter().any(|&b| b as usize >= blocks) {
                        return Err(Self::err(format!("block table names a block beyond the pool's {blocks}")));
                    }
                }
                self.pool.install(|| match kind {
                    AttnKind::Flash => attention::flash_attention(q, &pool, seqs, params, out),
                    AttnKind::Standard => attention::standard_attention(q, &pool, seqs, params, out),
                });
            }
            Op::Moe { x, m, router, experts, top_k, out } => {
                let r = self.mat(*router)?;
                let mut ex = Vec::with_capacity(experts.len());
                for e in experts.iter() {
                    ex.push(moe::Expert { gate: self.mat(e.gate)?, up: self.mat(e.up)?, down: self.mat(e.down)? });
                }
                let (xs, out) = (vs.f32(*x)?, vs.f32_mut(*out)?);
                self.pool.install(|| {
                    let mut logits = vec![0f32; m * r.rows];
                    matmul::matmul(xs, *m, &mut [MatSeg { w: r, bias: None, out: &mut logits }]);
                    let (ids, wts) = moe::route_topk(&logits, r.rows, *top_k, true);
                    moe::moe_ffn(xs, *m, &ex, &ids, &wts, *top_k, out);
                });
            }
            Op::GatherRows { x, cols, rows, out } => {
                check_len("gather out", out.len, rows.len() * cols)?;
                let (xs, o) = (vs.f32(*x)?, vs.f32_mut(*out)?);
                for (i, &r) in rows.iter().enumerate() {
                    let src = xs
                        .get(r as usize * cols..(r as usize + 1) * cols)
                        .ok_or_else(|| Self::err("gather row out of range"))?;
                    o[i * cols..(i + 1) * cols].copy_from_slice(src);
                }
            }
        }
        Ok(())
    }
}
