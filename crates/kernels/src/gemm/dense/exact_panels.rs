//! Dense weights (f32, f16, bf16) repacked into 16-row panels: the decode GEMV reads one
//! sequential stream and keeps the 16 output rows in the lanes of its vectors.
//!
//! The row layout makes the m = 1 GEMV read 8 weight rows at once (8 streams, `k` elements
//! apart) and reduce each output across lanes; measured on a Zen 4 VM it streamed f16 at 58%
//! of the machine's read bandwidth, where llama.cpp's reached nearly all of it.
//!
//! ## Layout
//! Panel `p` holds rows `16p..16p + 16` (zero rows pad the last panel); for each column `e`
//! in `0..k` it stores the 16 rows' values (row `r` at position `r`), so column `e` of a
//! panel is one 16-lane load, widened exactly. Panels follow each other. (Storing each block
//! of columns chain by chain instead made the several-row walk 10-30% faster but the GEMV,
//! the case this layout is for, 30% slower: measured, not kept.)
//!
//! ## Arithmetic
//! Exactly `lanes`'s canonical order, per output row: chain `l` takes
//! `fma(x[e], w[e], acc[l])` for `e ≡ l (mod 16)` in increasing `e` (a partial last block
//! pads its missing lanes with `fma(0, 0, acc)`, as every ISA does), then the fixed tree. With
//! rows in lanes the 16 chains are 16 accumulators: one activation row keeps them all in
//! registers and walks the panel in column order; several rows walk two chains at a time per
//! block of columns (`MR` rows share each weight load, the chains wait in memory between
//! blocks). So results are bit-identical to the row layout on every ISA, batch and split.

#![allow(clippy::needless_range_loop)] // lane, chain and row indices address several arrays at once

use rayon::prelude::*;

use super::lanes::{WKind, WBF16, WF16, WF32};
use crate::simd::{chain_tree as tree, unroll16, F32x16};
use crate::{DType, WeightMat, WeightVec};

/// Output rows per panel.
pub const PANEL: usize = 16;
/// Chains of the canonical order.
const CHAINS: usize = 16;

/// Whether `dtype` has a dense packed layout (every dense type; the CPU backend packs f16
/// and bf16, see `pays`).
pub fn packable(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Whether packing `dtype` weights pays for the exact kernels on this CPU (`isa::active`).
/// Measured with `cargo bench -p tboost-kernels --bench quant -- dense exact threads=2`,
/// 5632x2048:
/// - Zen 4 VM (AVX-512): f16 and bf16 GEMV 1.3-1.7x the row layout, m = 512 1.0-1.1x,
///   m = 16 0.86-0.89x; f32 GEMV 1.35x but m = 16 0.68x, so f32 stays in rows.
/// - Zen 2 VM (AVX2): packed loses everywhere, f16 / bf16 GEMV 0.85 / 0.68x, m = 16
///   0.70 / 0.64x, m = 512 0.73 / 0.74x (likely because a panel's 16 rows fill two ymm, not one
///   zmm), so below AVX-512 nothing is packed.
/// - Xeon VM (Sapphire-Rapids class, AVX-512), f16 / bf16: GEMV 0.96 / 1.0x (the row
///   GEMV's prefetch already streams at the roof there), m = 16 0.52 / 0.52x, m = 512
///   0.74 / 0.67x, so Intel CPUs keep rows.
pub fn pays(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && crate::isa::active() >= crate::isa::Isa::Avx512 && !crate::isa::intel()
}

/// Bytes of a packed `[rows, cols]` matrix (rows rounded up to whole panels).
pub fn packed_bytes(dtype: DType, rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL) * PANEL * cols * dtype.block_bytes()
}

/// Columns per block of [`panel_many`] (8 KiB of f16 per panel: a block and `MR` rows of x
/// stay in L1 while the chains walk it).
const KB: usize = 256;

/// `src`, a row-major `[rows, cols]` matrix of `dtype`, in the packed layout (panels in
/// parallel on the current rayon pool). Panics when `dtype` is not packable or the sizes
/// disagree (a caller bug).
pub fn pack(dtype: DType, rows: usize, cols: usize, src: &[u8], dst: &mut [u8]) {
    pack_panels(dtype, rows, cols, src, dst, 0..rows.div_ceil(PANEL))
}

/// [`pack`] of panels `panels` only (the rest of `dst` untouched). `src` holds the stored
/// rows of those panels only (rows `panels.start * PANEL` up to `panels.end * PANEL` or
/// `rows`), so a caller can read a large matrix in parts into a buffer of its own.
pub fn pack_panels(dtype: DType, rows: usize, cols: usize, src: &[u8], dst: &mut [u8], panels: std::ops::Range<usize>) {
    assert!(packable(dtype), "{dtype} has no dense packed layout");
    let es = dtype.block_bytes();
    let part_rows = (panels.end * PANEL).min(rows).saturating_sub(panels.start * PANEL);
    assert_eq!(src.len(), part_rows * cols * es, "{rows}x{cols} {dtype} source size of panels {panels:?}");
    assert_eq!(dst.len(), packed_bytes(dtype, rows, cols), "{rows}x{cols} {dtype} packed size");
    let pb = PANEL * cols * es;
    if pb == 0 {
        return;
    }
    let first = panels.start;
    dst[panels.start * pb..panels.end * pb].par_chunks_mut(pb).enumerate().for_each(|(i, d)| {
        let p = first + i;
        d.fill(0);
        for r in 0..PANEL.min(rows - p * PANEL) {
            let row = &src[(i * PANEL + r) * cols * es..][..cols * es];
            for (e, v) in row.chunks_exact(es).enumerate() {
                d[(e * PANEL + r) * es..][..es].copy_from_slice(v);
            }
        }
    });
}

/// The canonical padding: a `k` that is not a multiple of 16 leaves the chains past `k % 16`
/// one `fma(0, 0, acc)` of the zero-padded last group.
#[inline(always)]
unsafe fn pad<V: F32x16>(k: usize, chain: usize, acc: V) -> V {
    if !k.is_multiple_of(CHAINS) && chain >= k % CHAINS {
        V::fma(V::zero(), V::zero(), acc)
    } else {
        acc
    }
}

/// One activation row `x` against the panel at `w` (`k` columns): the 16 rows' sums.
#[inline(always)]
unsafe fn panel_one<V: F32x16, W: WKind>(w: *const u8, k: usize, x: *const f32) -> V {
    let col = PANEL * W::BYTES;
    let mut acc = [V::zero(); CHAINS];
    let mut e = 0;
    while e + CHAINS <= k {
        unroll16!(l => {
            acc[l] = V::fma(W::load::<V>(w.add((e + l) * col)), V::splat(*x.add(e + l)), acc[l]);
        });
        e += CHAINS;
    }
    unroll16!(l => {
        if e + l < k {
            acc[l] = V::fma(W::load::<V>(w.add((e + l) * col)), V::splat(*x.add(e + l)), acc[l]);
        }
        acc[l] = pad(k, l, acc[l]);
    });
    tree(&acc)
}

/// `MR` activation rows (stride `k`) against the panel at `w`: each row's 16 sums. Per
/// block of [`KB`] columns, two chains at a time (the two columns of a 64-byte line of f16),
/// `MR` rows sharing each weight load; the chains' accumulators wait in `chains` between
/// blocks (storing and reloading is exact).
#[inline(always)]
unsafe fn panel_many<V: F32x16, W: WKind, const MR: usize>(w: *const u8, k: usize, x: &[*const f32; MR]) -> [V; MR] {
    let col = PANEL * W::BYTES;
    let mut chains = [[V::zero(); CHAINS]; MR];
    let mut kb = 0;
    while kb < k {
        let ke = (kb + KB).min(k);
        for l in (0..CHAINS).step_by(2) {
            let (mut a, mut b) = ([V::zero(); MR], [V::zero(); MR]);
            for i in 0..MR {
                (a[i], b[i]) = (chains[i][l], chains[i][l + 1]);
            }
            let mut e = kb + l;
            while e + 1 < ke {
                let (wa, wb) = (W::load::<V>(w.add(e * col)), W::load::<V>(w.add((e + 1) * col)));
                for i in 0..MR {
                    a[i] = V::fma(wa, V::splat(*x[i].add(e)), a[i]);
                    b[i] = V::fma(wb, V::splat(*x[i].add(e + 1)), b[i]);
                }
                e += CHAINS;
            }
            if e < ke {
                let wa = W::load::<V>(w.add(e * col));
                for i in 0..MR {
                    a[i] = V::fma(wa, V::splat(*x[i].add(e)), a[i]);
                }
            }
            for i in 0..MR {
                (chains[i][l], chains[i][l + 1]) = (a[i], b[i]);
            }
        }
        kb = ke;
    }
    let mut out = [V::zero(); MR];
    for i in 0..MR {
        for l in 0..CHAINS {
            chains[i][l] = pad(k, l, chains[i][l]);
        }
        out[i] = tree(&chains[i]);
    }
    out
}

/// Where one task's sums go: plain (`+ bias`) or fused SwiGLU.
#[derive(Clone, Copy)]
pub(in crate::gemm) enum Sink<'a> {
    /// `out[i, j] = sum + bias[j]` (`ld` = the matrix's rows).
    Plain { out: *mut f32, ld: usize, bias: Option<WeightVec<'a>> },
    /// `out[i, j] = silu(gate sum) * up sum`: the up panel follows at `up`.
    Swiglu { out: *mut f32, ld: usize, up: *const u8 },
}

impl Sink<'_> {
    /// The up matrix a fused SwiGLU also reads.
    pub(in crate::gemm) fn up(&self) -> Option<*const u8> {
        match self {
            Sink::Swiglu { up, .. } => Some(*up),
            Sink::Plain { .. } => None,
        }
    }
}

/// Stores lanes `0..rows` of `v` (row `i`, panel rows from `j0`).
#[inline(always)]
unsafe fn put<V: F32x16>(v: V, up: Option<V>, sink: &Sink<'_>, i: usize, j0: usize, rows: usize) {
    put_lanes(|p| v.store(p), up.map(|u| move |p: *mut f32| u.store(p)), sink, i, j0, rows)
}

/// Stores the 16 sums `store_g` writes (and `store_u`'s, fused SwiGLU) for row `i`, panel rows
/// `j0..j0 + rows`, as `sink` says.
#[inline(always)]
pub(in crate::gemm) unsafe fn put_lanes(
    store_g: impl FnOnce(*mut f32),
    store_u: Option<impl FnOnce(*mut f32)>,
    sink: &Sink<'_>,
    i: usize,
    j0: usize,
    rows: usize,
) {
    let (mut s, mut u) = ([0f32; PANEL], [0f32; PANEL]);
    store_g(s.as_mut_ptr());
    if let Some(f) = store_u {
        f(u.as_mut_ptr());
    }
    match sink {
        Sink::Plain { out, ld, bias } => {
            let o = out.add(i * ld + j0);
            for r in 0..rows {
                // No bias means no `+ 0.0` (it would turn a -0.0 sum into +0.0).
                *o.add(r) = match bias {
                    Some(b) => s[r] + b.get(j0 + r),
                    None => s[r],
                };
            }
        }
        Sink::Swiglu { out, ld, .. } => {
            let o = std::slice::from_raw_parts_mut(out.add(i * ld + j0), rows);
            crate::activation::swiglu_serial(&s[..rows], &u[..rows], o);
        }
    }
}

/// One task: panels `p0..p1` of the matrix at `w` (`n` rows, `k` columns) against activation
/// rows `i0..i1` of `x`.
#[inline(always)]
unsafe fn run<V: F32x16, W: WKind, const MR: usize>(
    w: *const u8,
    (n, k): (usize, usize),
    (p0, p1): (usize, usize),
    x: *const f32,
    (i0, i1): (usize, usize),
    sink: &Sink<'_>,
) {
    let pb = PANEL * k * W::BYTES;
    let up = sink.up();
    for p in p0..p1 {
        let (wp, j0) = (w.add(p * pb), p * PANEL);
        let rows = (n - j0).min(PANEL);
        if i1 - i0 == 1 {
            let g = panel_one::<V, W>(wp, k, x.add(i0 * k));
            let u = up.map(|u| panel_one::<V, W>(u.add(p * pb), k, x.add(i0 * k)));
            put(g, u, sink, i0, j0, rows);
            continue;
        }
        let mut i = i0;
        while i < i1 {
            // A short last block repeats its last row (results dropped).
            let mut xs = [x; MR];
            for t in 0..MR {
                xs[t] = x.add((i + t).min(i1 - 1) * k);
            }
            let g = panel_many::<V, W, MR>(wp, k, &xs);
            let u = up.map(|u| panel_many::<V, W, MR>(u.add(p * pb), k, &xs));
            for t in 0..MR.min(i1 - i) {
                put(g[t], u.map(|u| u[t]), sink, i + t, j0, rows);
            }
            i += MR;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn run_avx512<W: WKind>(
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    x: *const f32,
    ir: (usize, usize),
    sink: &Sink<'_>,
) {
    run::<crate::simd::Avx512, W, 4>(w, nk, pr, x, ir, sink)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<W: WKind>(
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    x: *const f32,
    ir: (usize, usize),
    sink: &Sink<'_>,
) {
    run::<crate::simd::Avx2x2, W, 2>(w, nk, pr, x, ir, sink)
}

/// Runs one task on `isa` for `dtype`.
///
/// # Safety
/// `w` is a packed `[n, k]` matrix of `dtype`, `x` covers rows `ir`, the sink covers the
/// task's outputs, and this CPU supports `isa`.
#[allow(clippy::too_many_arguments)]
pub(in crate::gemm) unsafe fn task(
    isa: crate::isa::Isa,
    dtype: DType,
    w: *const u8,
    nk: (usize, usize),
    pr: (usize, usize),
    x: *const f32,
    ir: (usize, usize),
    sink: &Sink<'_>,
) {
    use crate::isa::Isa;
    macro_rules! go {
        ($f:ident) => {
            match dtype {
                DType::F32 => $f::<WF32>(w, nk, pr, x, ir, sink),
                DType::F16 => $f::<WF16>(w, nk, pr, x, ir, sink),
                DType::BF16 => $f::<WBF16>(w, nk, pr, x, ir, sink),
                _ => unreachable!("dense packed layout is only defined for f32, f16, bf16"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go!(run_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go!(run_avx2),
        _ => {
            use crate::simd::Scalar16;
            match dtype {
                DType::F32 => run::<Scalar16, WF32, 4>(w, nk, pr, x, ir, sink),
                DType::F16 => run::<Scalar16, WF16, 4>(w, nk, pr, x, ir, sink),
                DType::BF16 => run::<Scalar16, WBF16, 4>(w, nk, pr, x, ir, sink),
                _ => unreachable!("dense packed layout is only defined for f32, f16, bf16"),
            }
        }
    }
}

/// Checks a packed dense matrix's size (its fields are public).
pub(in crate::gemm) fn check(w: &WeightMat<'_>, what: std::fmt::Arguments<'_>) {
    assert!(packable(w.dtype), "{what}: {} has no dense packed layout", w.dtype);
    assert_eq!(
        w.data.len(),
        packed_bytes(w.dtype, w.rows, w.cols),
        "{what}: packed {}x{} {} weight has {} bytes",
        w.rows,
        w.cols,
        w.dtype,
        w.data.len()
    );
}
