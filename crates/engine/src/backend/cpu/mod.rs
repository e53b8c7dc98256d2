//! The CPU backend: host buffers, zero-copy weights, and a stream that is a queue: `launch`
//! and `write_async` append work, and the queue runs on the engine's own rayon pool (never
//! the host's global pool) when the host waits (`synchronize`, `read`, `wait_event`). A
//! whole forward pass therefore runs in one `install` on the pool, so no op pays a
//! cross-thread hand-off.
//!
//! This is the only module that knows the CPU kernels (`tboost-kernels`).

mod pool;
mod run;
mod views;
mod weights;

use std::alloc::{alloc, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tboost_kernels::{attention, convert, embed, gemm, isa, moe, norm, rope};
use tboost_ops::{AttnPhase, DType, MatMulTiling, MoeTiling, Precision, Tiling, Unsupported};

use super::op::{AttnKind, Op, OpQuery, StepViews, View};
use super::{Backend, BackendOptions, BufId, DeviceInfo, EventId, PendingRead, StepHost, WeightId};
use crate::model::Tensor;
use crate::{Error, Result};

/// Encodes f32 rows as a GGUF block type with the kernels' reference quantizer (synthetic
/// models, op benchmarks); only the CPU backend reaches into the kernel crate.
pub use tboost_kernels::gemm::quant::quantize_row_reference;
pub use weights::convert_weight;
use weights::CpuWeight;

/// Streaming-read bandwidth on `threads` threads over a buffer far larger than the caches
/// (the yardstick `tboost bench` reports decode speed against): the best of several runs,
/// since a limit is what the machine can reach, and a shared, noisy machine only ever makes
/// a run slower.
pub fn measure_bandwidth(threads: usize) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::invalid("threads", e.to_string()))?;
    // Twice the last-level cache, at least 256 MiB and at most 1 GiB: a read that partly
    // hits the cache is no memory roof (this Xeon's VM reports 480 MiB of L3; a 256 MiB probe
    // read 25-37 GB/s there depending on what the cache held, 1 GiB 31-34). Huge pages, as
    // the weights get (`hugepages`): with 4 KiB pages TLB misses cap a read well below the
    // bus, and a roof below what llama.cpp reaches is no roof.
    let bytes = (2 * last_level_cache_bytes()).clamp(256 << 20, 1 << 30);
    let mut buf = crate::model::hugepages::anon(bytes, true)
        .map_err(|e| Error::Io { path: "<bandwidth probe>".into(), source: e })?;
    buf.fill(1);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for i in 0..8 {
        // Alternating plain and prefetching reads: which one is faster depends on the CPU.
        let t = std::time::Instant::now();
        sink = sink.wrapping_add(pool.install(|| tboost_kernels::membw::stream_read_with(&buf[..], i % 2 == 1)));
        best = best.max(buf.len() as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    Ok(best)
}

/// The largest data cache of cpu0 (sysfs), 0 where it is not reported.
fn last_level_cache_bytes() -> usize {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("size")).ok())
        .filter_map(|s| cache_size_bytes(&s))
        .max()
        .unwrap_or(0)
}

/// A sysfs cache `size` ("48K", "2048K", "491520K", "32M") in bytes; `None` for anything
/// else, so an unknown format shrinks no probe.
fn cache_size_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: usize = num.parse().ok()?;
    let shift = match unit {
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// A zero-filled, 64-byte aligned host allocation.
struct HostBuf {
    ptr: *mut u8,
    bytes: usize,
    dtype: DType,
    len: usize,
}

// SAFETY: HostBuf uniquely owns its allocation.
unsafe impl Send for HostBuf {}

/// Bytes per parallel piece when a new buffer is zeroed.
const ZERO_PIECE: usize = 1 << 20;

impl HostBuf {
    /// A zeroed buffer whose pages are already faulted in: the zeros are written here, on
    /// `pool`, not left to the kernel's lazy zero pages. A lazily backed buffer would be
    /// faulted in by the first step that writes it, inside that step's time: on a VM whose
    /// host takes back free memory a fresh page costs microseconds, and the first 512-token
    /// prefill of tinyllama-1.1b first-touched about 130 MB (KV cache and activations).
    /// llama.cpp clears its KV cache at context creation for the same reason.
    fn new(dtype: DType, len: usize, pool: &rayon::ThreadPool) -> Option<HostBuf> {
        use rayon::prelude::*;
        let bytes = dtype.bytes_for(len)?;
        let layout = Layout::from_size_align(bytes.max(64), 64).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return None;
        }
        let size = layout.size();
        let base = ptr as usize;
        // SAFETY: each piece `at..at + n` lies inside the fresh allocation of `size` bytes,
        // owned here alone, and the pieces are disjoint.
        let zero = |at: usize, n: usize| unsafe { (base as *mut u8).add(at).write_bytes(0, n) };
        if size > ZERO_PIECE {
            pool.install(|| {
                (0..size.div_ceil(ZERO_PIECE)).into_par_iter().for_each(|i| {
                    let at = i * ZERO_PIECE;
                    zero(at, ZERO_PIECE.min(size - at))
                })
            });
        } else {
            zero(0, size);
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

/// One queued piece of work.
enum Work {
    Op(Op),
    /// Copy `len` staged bytes at `at` of the staging arena into `dst`.
    Write {
        dst: View,
        at: usize,
        len: usize,
    },
    /// Copy `src` into staged read `id`.
    Read {
        src: View,
        id: u64,
    },
}

pub struct CpuBackend {
    /// Per-op (count, seconds) with the `profile` key; printed when the backend drops.
    profile: Option<BTreeMap<&'static str, (u64, f64)>>,
    /// The `weight_pages` key is `small`: weights in 4 KiB pages.
    small_weight_pages: bool,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    bufs: Vec<Option<HostBuf>>,
    free_ids: Vec<u32>,
    allocated: usize,
    weights: Vec<CpuWeight>,
    /// Huge-page copies `upload_weight` made, by the address and length of the file bytes
    /// they hold: a range uploaded twice shares one copy.
    copies: std::collections::HashMap<(usize, usize), Tensor>,
    /// Huge-page memory of the repacked weights (4 KiB pages with `weight_pages` = small).
    arena: crate::model::hugepages::Arena,
    /// 4 KiB-page copies of the stored weights of small files.
    small_arena: crate::model::hugepages::Arena,
    queue: Vec<Work>,
    /// Bytes of queued `write_async` calls (reused: no allocation in a steady step).
    staging: Vec<u8>,
    /// Finished `read_async` copies by id.
    reads: Vec<(u64, Vec<u8>)>,
    next_read: u64,
    /// Work items enqueued / completed since creation (events are positions in this count).
    enqueued: u64,
    completed: u64,
    interrupt: Option<Arc<AtomicBool>>,
}

impl CpuBackend {
    /// A backend with its own pool of `threads` compute threads (0 = one per core) and the
    /// default options.
    pub fn new(threads: usize) -> Result<CpuBackend> {
        Self::with_options(threads, &BackendOptions::default())
    }

    /// `new` with an engine config's backend options (pinning, profile, weight pages).
    pub fn with_options(threads: usize, opts: &BackendOptions) -> Result<CpuBackend> {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = pool::build_pool(threads, opts.pin_threads).map_err(Self::err)?;
        let profile = opts.profile.then(Default::default);
        Ok(CpuBackend {
            small_weight_pages: opts.small_weight_pages,
            profile,
            pool: Arc::new(pool),
            threads,
            bufs: Vec::new(),
            free_ids: Vec::new(),
            allocated: 0,
            weights: Vec::new(),
            arena: crate::model::hugepages::Arena::new(!opts.small_weight_pages),
            small_arena: crate::model::hugepages::Arena::new(false),
            copies: Default::default(),
            queue: Vec::new(),
            staging: Vec::new(),
            reads: Vec::new(),
            next_read: 0,
            enqueued: 0,
            completed: 0,
            interrupt: None,
        })
    }

    /// Compute threads of this backend's pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The SIMD level the kernels use (`avx512`, `avx2`, `scalar`).
    pub fn isa_name() -> &'static str {
        isa::active().name()
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

    fn weight(&self, id: WeightId) -> Result<&CpuWeight> {
        self.weights.get(id.0 as usize).ok_or_else(|| Self::err(format!("unknown weight {}", id.0)))
    }

    /// Runs every queued piece of work, in order, on the pool. The first failure drops the
    /// rest of the queue (as a device stream stops at a failed kernel) and is returned.
    fn flush(&mut self) -> Result<()> {
        if self.queue.is_empty() {
            return Ok(());
        }
        let queue = std::mem::take(&mut self.queue);
        let n = queue.len() as u64;
        let pool = self.pool.clone();
        let mut result = Ok(());
        // Inside `install` this thread is one of the pool's workers, so the kernels' own
        // parallel loops use the whole pool without a hand-off per op; the other workers poll
        // for those loops' tasks through the whole queue rather than sleep between ops.
        pool.install(|| {
            pool::with_workers_polling(|| {
                for w in &queue {
                    if self.interrupt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed)) {
                        result = Err(Error::Interrupted);
                        break;
                    }
                    let r = match w {
                        Work::Op(op) => self.timed(op),
                        Work::Write { dst, at, len } => self.copy_in(*dst, *at, *len),
                        Work::Read { src, id } => self.copy_out(*src, *id),
                    };
                    if let Err(e) = r {
                        result = Err(e);
                        break;
                    }
                }
            })
        });
        // Give the queue's allocation back for the next step.
        let mut queue = queue;
        queue.clear();
        self.queue = queue;
        self.staging.clear();
        self.completed += n;
        result
    }

    fn timed(&mut self, op: &Op) -> Result<()> {
        let t0 = self.profile.as_ref().map(|_| std::time::Instant::now());
        let r = self.run_op(op);
        if let (Some(t0), Some(p)) = (t0, self.profile.as_mut()) {
            let e = p.entry(op.name()).or_default();
            e.0 += 1;
            e.1 += t0.elapsed().as_secs_f64();
        }
        r.map_err(|e| match e {
            Error::Backend { backend, msg } => Error::Backend { backend, msg: format!("{}: {msg}", op.name()) },
            other => other,
        })
    }

    fn copy_in(&mut self, dst: View, at: usize, len: usize) -> Result<()> {
        let mut vs = views::Views::new(self);
        let d = vs.bytes_mut(dst)?;
        if d.len() != len {
            return Err(Self::err(format!("write of {len} bytes into a view of {} bytes", d.len())));
        }
        d.copy_from_slice(&self.staging[at..at + len]);
        Ok(())
    }

    fn copy_out(&mut self, src: View, id: u64) -> Result<()> {
        let bytes = views::Views::new(self).bytes(src)?.to_vec();
        self.reads.push((id, bytes));
        Ok(())
    }

    fn view_bytes(&self, v: View) -> Result<usize> {
        let hb = self.buf(v.buf)?;
        hb.dtype
            .bytes_for(v.len)
            .ok_or_else(|| Self::err(format!("a view of {} elements is not whole {} blocks", v.len, hb.dtype)))
    }
}

fn f32_act(act: DType) -> Result<(), Unsupported> {
    if act != DType::F32 {
        return Err(Unsupported::new("act_dtype", act, "f32"));
    }
    Ok(())
}

fn exact(p: Precision) -> Result<(), Unsupported> {
    if p != Precision::Exact {
        return Err(Unsupported::new("precision", p.name(), "exact (f32 activations)"));
    }
    Ok(())
}

/// Whether this CPU has a `precision` kernel for `case`'s weights: `Exact` always; `Fast`
/// for block-quantized weights (activations quantized to 8 bits per 32 values, integer dot
/// products: VNNI where present, any x86 level otherwise), for bf16 weights where the CPU
/// has AMX or AVX512_BF16 (activations rounded to bf16) and for f16 weights where it has
/// AMX-BF16 (weights and activations split into two bf16 parts each) or else AVX512_BF16
/// (weights rounded to bf16 once at upload, activations per step).
fn precision_for(case: &tboost_ops::MatMulCase) -> Result<(), Unsupported> {
    match case.precision {
        Precision::Exact => Ok(()),
        Precision::Fast if case.dtype.is_quantized() => Ok(()),
        Precision::Fast if case.dtype.is_float() && gemm::fast_bf16_applies(case.dtype) => Ok(()),
        Precision::Fast => Err(Unsupported::new(
            "precision",
            "fast",
            format!(
                "exact for {} weights here (fast: GGUF block types; bf16 and f16 weights on a CPU with AMX or AVX512_BF16)",
                case.dtype
            ),
        )),
    }
}

/// The instruction-set extensions the kernels use here, as `+name` each (the plan's device
/// line: which integer and bf16 units a fast matmul runs on).
fn extensions() -> String {
    let mut s = String::new();
    for (on, name) in [
        (isa::vnni_active(), "vnni"),
        (isa::amx_int8(), "amx-int8"),
        (isa::avx512bf16(), "avx512bf16"),
        (isa::amx_bf16(), "amx-bf16"),
    ] {
        if on {
            s.push('+');
            s.push_str(name);
        }
    }
    s
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cpu".into(),
            device: format!(
                "cpu {}{} x{} threads{}",
                isa::active().name(),
                extensions(),
                self.threads,
                if isa::weight_prefetch() { ", weight prefetch" } else { "" }
            ),
            runtime_version: None,
        }
    }

    fn supports(&self, query: &OpQuery) -> Result<(), Unsupported> {
        match *query {
            OpQuery::Embed { table, act } => f32_act(act).and(embed::supports(table)),
            OpQuery::RmsNorm { gain, act, .. } => f32_act(act).and(norm::supports(gain)),
            OpQuery::Add { act } | OpQuery::SwiGlu { act } | OpQuery::GatherRows { act } => f32_act(act),
            OpQuery::GeGlu { act } | OpQuery::Scale { act } => f32_act(act),
            OpQuery::MoeScatterCombine { act } => f32_act(act),
            OpQuery::MatMul(case) => precision_for(&case).and(gemm::supports(&case)),
            OpQuery::MatMulFused { cases } => {
                let mut cols = None;
                for case in cases.iter().flatten() {
                    precision_for(case).and(gemm::supports(case))?;
                    if *cols.get_or_insert(case.cols) != case.cols {
                        return Err(Unsupported::new("cols", case.cols, "equal for every fused weight"));
                    }
                }
                Ok(())
            }
            OpQuery::MatMulSwiGlu { gate, up } => {
                for c in [&gate, &up] {
                    precision_for(c).and(gemm::supports(c))?;
                }
                // The fused kernel takes one dense dtype for both, or two block-quantized types.
                let pair = gate.dtype == up.dtype || (gate.dtype.is_quantized() && up.dtype.is_quantized());
                if !pair || (gate.rows, gate.cols) != (up.rows, up.cols) {
                    let need = format!(
                        "gate's shape and dtype ({} {}x{}), or both block-quantized",
                        gate.dtype, gate.rows, gate.cols
                    );
                    return Err(Unsupported::new("up", format!("{} {}x{}", up.dtype, up.rows, up.cols), need));
                }
                Ok(())
            }
            OpQuery::RopeTables { rope } => {
                if rope.dim == 0 || !rope.dim.is_multiple_of(2) {
                    return Err(Unsupported::new("rope_dim", rope.dim, "even and positive"));
                }
                Ok(())
            }
            OpQuery::Rope { head_dim, rot_dim, act, .. } => f32_act(act).and(rope::supports(head_dim, rot_dim)),
            OpQuery::WriteKv { act, kv_dtype, head_dim, .. } => {
                f32_act(act)?;
                if kv_dtype == DType::Q8_0 {
                    if !head_dim.is_multiple_of(32) {
                        return Err(Unsupported::new("head_dim", head_dim, "a multiple of 32 for a q8_0 KV cache"));
                    }
                } else if !kv_dtype.is_float() {
                    return Err(Unsupported::new("kv_dtype", kv_dtype, "f32, f16, bf16 or q8_0"));
                }
                Ok(())
            }
            OpQuery::Attention { kind, case } => match kind {
                // The flash kernel serves both phases; its decode path reads each K/V row once
                // for the whole GQA group.
                AttnKind::Flash => attention::flash_supports(&case),
                AttnKind::PagedDecode => {
                    if case.phase != AttnPhase::Decode {
                        return Err(Unsupported::new("phase", "prefill", "decode (one query row per sequence)"));
                    }
                    attention::flash_supports(&case)
                }
                AttnKind::Standard => attention::standard_supports(&case),
            },
            OpQuery::MoeRoute { experts, top_k } => moe::supports(experts, top_k),
            OpQuery::MoeGrouped { experts, top_k, gate, down } => {
                moe::supports(experts, top_k)?;
                exact(gate.precision).and(gemm::supports(&gate)).and(gemm::supports(&down))
            }
            OpQuery::Convert { from, to } => convert::supports(from, to),
        }
    }

    /// Every tunable in its range; the bf16 kernels of fast precision (AMX, AVX512_BF16) keep
    /// their own split, so a case they compute takes only the default.
    fn supports_matmul_tiling(&self, query: &OpQuery, tiling: &MatMulTiling) -> Result<(), Unsupported> {
        tiling.check()?;
        let cases: Vec<_> = match *query {
            OpQuery::MatMul(c) => vec![c],
            OpQuery::MatMulFused { cases } => cases.into_iter().flatten().collect(),
            OpQuery::MatMulSwiGlu { gate, up } if gate.dtype == up.dtype => vec![gate],
            _ => Vec::new(),
        };
        let bf16 = cases.iter().find(|c| c.precision == Precision::Fast && gemm::fast_bf16_applies(c.dtype));
        match (bf16, tiling.set_values().first()) {
            (Some(c), Some(&(name, v))) => Err(Unsupported::new(
                name,
                v,
                format!(
                    "the default (unset) for {} weights at fast precision: the {} kernel splits its own work",
                    c.dtype,
                    gemm::FastBf16::best().name()
                ),
            )),
            _ => Ok(()),
        }
    }

    fn supports_moe_tiling(&self, tiling: &MoeTiling) -> Result<(), Unsupported> {
        tiling.check()
    }

    fn activation_dtypes(&self) -> &'static [DType] {
        &[DType::F32]
    }

    fn kv_dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F16, DType::BF16, DType::Q8_0]
    }

    fn alloc(&mut self, dtype: DType, len: usize) -> Result<BufId> {
        let hb = HostBuf::new(dtype, len, &self.pool)
            .ok_or_else(|| Self::err(format!("cannot allocate {len} x {dtype}")))?;
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
        // Queued work may still name the buffer: complete it first. A failure here belongs
        // to the work that failed, which its own wait reports; freeing goes on.
        if !self.queue.is_empty() {
            let _ = self.flush();
        }
        if let Some(slot) = self.bufs.get_mut(buf.0 as usize) {
            if let Some(hb) = slot.take() {
                self.allocated -= hb.bytes;
                self.free_ids.push(buf.0);
            }
        }
    }

    fn buffer(&self, buf: BufId) -> Option<(DType, usize)> {
        self.bufs.get(buf.0 as usize).and_then(|b| b.as_ref()).map(|b| (b.dtype, b.len))
    }

    fn allocated_bytes(&self) -> usize {
        self.allocated
    }

    fn weight_bytes_by_dtype(&self) -> Vec<(DType, usize)> {
        // Weights that share bytes (a copy serving two uploads of one file range, a packed
        // table serving the embedding and the lm_head) count once.
        let mut seen = std::collections::HashSet::new();
        let mut by: Vec<(DType, usize)> = Vec::new();
        for w in &self.weights {
            let (dtype, bytes) = w.resident();
            if !seen.insert(bytes.as_ptr() as usize) {
                continue;
            }
            match by.iter_mut().find(|(d, _)| *d == dtype) {
                Some((_, n)) => *n += bytes.len(),
                None => by.push((dtype, bytes.len())),
            }
        }
        by
    }

    fn upload_weight(&mut self, tensor: &Tensor) -> Result<WeightId> {
        // A tensor read from the file map would kill the host with SIGBUS if the file were
        // truncated or replaced in place while the engine runs or is built (rolling deploys
        // do that), so every mapped tensor gets its own copy in anonymous memory, read with
        // `pread` (`Tensor::copied_into`): huge pages for a large file (see
        // `model::hugepages`), 4 KiB pages with `weight_pages` = small or a small file.
        // Owned tensors (shards, converted weights) are used as they are.
        let stored = if tensor.is_mapped() {
            let huge = !self.small_weight_pages && tensor.wants_huge_pages();
            // One copy per range of the file: a tied embedding table is also the lm_head.
            // (The address only names the range; nothing reads the map.)
            let key = (tensor.bytes().as_ptr() as usize, tensor.bytes().len());
            match self.copies.get(&key) {
                Some(copy) => tensor.over_bytes_of(copy),
                None => {
                    let arena = if huge { &mut self.arena } else { &mut self.small_arena };
                    let len = key.1;
                    let region = arena.alloc(len).map_err(|e| {
                        Self::err(format!(
                            "tensor `{}`: no memory for its {len} bytes ({e}); tboost does not read weights from \
                             the file map, which a change to the file would turn into a crash",
                            tensor.name,
                        ))
                    })?;
                    let t = self.pool.install(|| tensor.copied_into(region))?;
                    self.copies.insert(key, t.clone());
                    t
                }
            }
        } else {
            tensor.clone()
        };
        self.weights.push(CpuWeight::Stored(stored));
        Ok(WeightId((self.weights.len() - 1) as u32))
    }

    fn reads_mapped_weights(&self) -> bool {
        // `upload_weight` reads a mapped tensor into its arena (`Tensor::copied_into`) and
        // `upload_packed` packs it from parts read with `Tensor::rows_in_parts`.
        true
    }

    fn packs(&self, dtype: DType, precision: Precision) -> bool {
        weights::packable(dtype, precision)
    }

    fn embeds_packed(&self, dtype: DType, precision: Precision) -> bool {
        weights::rows_readable_packed(dtype, precision)
    }

    fn upload_packed(&mut self, tensor: &Tensor, precision: Precision) -> Result<WeightId> {
        match weights::pack(tensor, precision, &self.pool, &mut self.arena)? {
            Some(w) => {
                self.weights.push(w);
                Ok(WeightId((self.weights.len() - 1) as u32))
            }
            None => self.upload_weight(tensor),
        }
    }

    fn write(&mut self, dst: View, src: &[u8]) -> Result<()> {
        self.write_async(dst, src)?;
        self.flush()
    }

    fn write_async(&mut self, dst: View, src: &[u8]) -> Result<()> {
        let want = self.view_bytes(dst)?;
        if src.len() != want {
            return Err(Self::err(format!("write of {} bytes into a view of {want} bytes", src.len())));
        }
        let at = self.staging.len();
        self.staging.extend_from_slice(src);
        self.queue.push(Work::Write { dst, at, len: src.len() });
        self.enqueued += 1;
        Ok(())
    }

    fn read(&mut self, src: View, dst: &mut [u8]) -> Result<()> {
        self.flush()?;
        let mut vs = views::Views::new(self);
        let s = vs.bytes(src)?;
        if s.len() != dst.len() {
            return Err(Self::err(format!("read of a view of {} bytes into {} bytes", s.len(), dst.len())));
        }
        dst.copy_from_slice(s);
        Ok(())
    }

    fn read_async(&mut self, src: View) -> Result<PendingRead> {
        let bytes = self.view_bytes(src)?;
        let id = self.next_read;
        self.next_read += 1;
        self.queue.push(Work::Read { src, id });
        self.enqueued += 1;
        Ok(PendingRead { id, bytes })
    }

    fn finish_read(&mut self, read: PendingRead, dst: &mut [u8]) -> Result<()> {
        if dst.len() != read.bytes {
            return Err(Self::err(format!("finish_read of {} bytes into {} bytes", read.bytes, dst.len())));
        }
        if !self.reads.iter().any(|(id, _)| *id == read.id) {
            self.flush()?;
        }
        let at = self
            .reads
            .iter()
            .position(|(id, _)| *id == read.id)
            .ok_or_else(|| Self::err(format!("read {} was never enqueued or already taken", read.id)))?;
        let (_, bytes) = self.reads.swap_remove(at);
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    fn set_step(&mut self, host: &StepHost<'_>, v: &StepViews) -> Result<()> {
        let seqs: &[u32] = host.seqs.as_flattened();
        for (view, data) in [
            (v.ids, host.ids),
            (v.positions, host.positions),
            (v.slots, host.slots),
            (v.seqs, seqs),
            (v.block_tables, host.block_tables),
            (v.logit_rows, host.logit_rows),
        ] {
            if view.len > 0 {
                super::BackendExt::write_typed_async(self, view, data)?;
            }
        }
        Ok(())
    }

    fn launch(&mut self, op: &Op) -> Result<()> {
        self.queue.push(Work::Op(*op));
        self.enqueued += 1;
        Ok(())
    }

    fn record_event(&mut self) -> Result<EventId> {
        Ok(EventId(self.enqueued))
    }

    fn wait_event(&mut self, event: EventId) -> Result<()> {
        if self.completed < event.0 {
            self.flush()?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.flush()
    }

    fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.interrupt = Some(flag);
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
                    "  {name:<24} {n:>8} calls {:>10.3} ms {:>5.1}%",
                    secs * 1e3,
                    100.0 * secs / total.max(1e-12)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The probe's size comes from these strings: a misread L3 would shrink it back into
    /// the cache (or past 1 GiB, where it is clamped).
    #[test]
    fn sysfs_cache_sizes_parse_to_bytes() {
        assert_eq!(cache_size_bytes("491520K\n"), Some(480 << 20));
        assert_eq!(cache_size_bytes("48K"), Some(48 << 10));
        assert_eq!(cache_size_bytes("32M"), Some(32 << 20));
        assert_eq!(cache_size_bytes("1G"), Some(1 << 30));
        for bad in ["", "K", "12", "12 KB", "x12K"] {
            assert_eq!(cache_size_bytes(bad), None, "{bad:?}");
        }
    }

    /// A file range uploaded twice as stored (a tied embedding table and lm_head) gets one
    /// huge-page copy, not two; each weight keeps its own name.
    #[test]
    fn a_range_uploaded_twice_shares_one_copy() {
        let len = 64 << 20; // the smallest file whose tensors are copied
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        f.write_all(&bytes).unwrap();
        f.flush().unwrap();
        let storage = crate::model::map_weights(f.path()).unwrap();
        let t = |name: &str| Tensor::new(name, DType::U8, vec![len], storage.clone(), 0, len).unwrap();
        let (embed, head) = (t("embed"), t("lm_head"));
        if !embed.wants_huge_pages() {
            eprintln!("SKIPPED: this kernel offers no transparent huge pages (no copies are made)");
            return;
        }
        let mut be = CpuBackend::new(2).unwrap();
        let (a, b) = (be.upload_weight(&embed).unwrap(), be.upload_weight(&head).unwrap());
        let stored = |id: WeightId| match &be.weights[id.0 as usize] {
            CpuWeight::Stored(t) => (t.name.clone(), t.bytes().as_ptr(), t.bytes() == &bytes[..]),
            CpuWeight::Packed { .. } => panic!("a stored upload was packed"),
        };
        let ((na, pa, ea), (nb, pb, eb)) = (stored(a), stored(b));
        assert!(ea && eb, "a copy differs from the file");
        assert_eq!((na.as_str(), nb.as_str()), ("embed", "lm_head"));
        assert_eq!(pa, pb, "the second upload made a second copy");
        assert_ne!(pa, storage.bytes().as_ptr(), "the weights were not copied out of the file map");
    }
}
