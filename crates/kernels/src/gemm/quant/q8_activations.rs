//! The `Fast` precision of the quantized matmul: the activations are quantized to 8 bits once
//! per call (per row, per 32-value group), then every weight group meets them in exact
//! integer dot products, as llama.cpp's `q8_0` / `q8_K` paths do.
//!
//! ## The arithmetic (every path computes exactly this)
//!
//! Activations, per row and 32-value group `g` (values `x_e`):
//! - `amax = max |x_e|`; `X_g = amax / 127` and `inv = 127 / amax` in f32;
//! - `q_e = round_half_even(x_e * inv)` (f32 product, in -127..=127), `S_g = Σ q_e`, and the
//!   two 16-value half sums `H`;
//! - `Y_g = fl(X_g * S_g)` (used by formats with mins; Q2_K, whose mins are per 16-value half,
//!   uses `fl(X_g * (ms_0 H_0 + ms_1 H_1))` with its two 4-bit mins `ms`);
//! - a group with `amax < 2^-100` is all zero (`X_g = 0`, `q = 0`), so `127 / amax` never
//!   overflows; a group with a non-finite value has `X_g = NaN` (the output is NaN).
//!
//! Weights, per 32-value group: signed 8-bit values `w_e`, two 16-value integer scales `sc`
//! (1 except Q2_K / Q3_K / Q6_K), an f32 scale `A_g` and, for Q4_1 / Q5_1 / Q2_K / Q4_K / Q5_K, an f32 min
//! `M_g`:
//! - Q4_0 `w = nibble - 8`, Q5_0 `w = (nibble | high bit << 4) - 16`, Q8_0 `w = qs`, IQ4_NL
//!   `w = level[nibble]` (ggml's `kvalues_iq4nl`), all with `A = d`;
//! - Q4_1 / Q5_1 `w = q` (the 4 / 5-bit quant), `A = d`, `M = -m` (value `d q + m`);
//! - IQ4_XS `w = level[nibble]`, `A = fl(d * (ls - 32))` per group;
//! - Q4_K / Q5_K `w = q` (the 4 / 5-bit quant), `A = fl(d * sc_j)`, `M = fl(dmin * m_j)` (the
//!   sub-block scale and min exactly as ggml's dequantization rounds them);
//! - Q6_K `w = q - 32`, Q3_K `w = q - 4`, `sc` the two signed sub-block scales, `A = d`;
//! - Q2_K `w = q`, `sc` the two 4-bit sub-block scales, `A = d`, `M = dmin`.
//!
//! The group's integer dot product `D_g = Σ_h sc_h Σ_{e in half h} w_e q_e` is exact (in i32,
//! and exact in f32 too: `|D_g| < 2^24` for every format). Groups are summed in 16 chains,
//! `c = g mod 16`, each starting at `+0.0`, in increasing `g`:
//! `acc[c] = fma(f32(D_g), fl(A_g * X_g), acc[c])`, then for Q4_K / Q5_K
//! `acc[c] = fma(-M_g, Y_g, acc[c])`; the output is `reference::hsum16(acc) + bias`.
//!
//! Integer sums can be formed in any order, so the SIMD kernels are free to pick their
//! layouts (natural weight order with horizontal sums for few activation rows, weights
//! repacked with output rows in lanes for many); every float operation above is one IEEE
//! operation on the same operands. Results are therefore bit-identical across ISAs, `m`,
//! thread counts and splits.
//!
//! ## Error
//! Against the exact dot product of the f32 activations with the dequantized weights, the
//! activation rounding contributes at most `Σ_e |w_e| (X_g / 2 + 3.01·2^-24 |x_e|)` (half a
//! quantization step, plus the three f32 roundings in `x * inv` and `X`); the float chain at
//! most `(n + 5)·2^-24` times the sum of the magnitudes of its terms, `n` being the terms per
//! chain. [`super::fast_reference`] evaluates both bounds for a test.

use rayon::prelude::*;

use super::reference;
pub(crate) use crate::gemm::gguf::{group, has_mins, Group, GROUP};
pub(crate) use crate::gemm::reference::quant::{quantize_group, CHAINS, TINY};
use crate::DType;

/// Activations quantized for one call. Each row has `ngp` groups: `ng` rounded up to whole
/// chunks of 16 (the direct kernels read whole chunks), the padding all zero. The `chain`
/// arrays hold the same values with groups in chain-major order (all groups of chain 0 in
/// increasing `g`, then chain 1, ...), the order the packed GEMM walks them in.
#[derive(Default)]
pub(crate) struct QAct {
    pub k: usize,
    pub m: usize,
    pub ng: usize,
    pub ngp: usize,
    /// `[m + PAD_ROWS][ngp * 32]` quantized values (the arrays below have the padding rows
    /// too, all zero).
    pub xq: Vec<i8>,
    /// `[m + PAD_ROWS][ngp]` `X_g`, `Y_g` and `S_g`.
    pub xs: Vec<f32>,
    pub ys: Vec<f32>,
    pub s: Vec<i32>,
    /// `[m + PAD_ROWS][2 * ngp]` half sums.
    pub h: Vec<i16>,
    /// What `fill` was asked for: the chain-major copies below, biased or not.
    pub chain: Option<bool>,
    /// Chain-major copies (only when `chain` was asked for): `[m + PAD_ROWS][ng * 32]`
    /// values (XOR 0x80, i.e. `q + 128` as u8, when `biased`), `[m + PAD_ROWS][ng]` `X_g` and
    /// `Y_g`.
    pub cq: Vec<u8>,
    pub cxs: Vec<f32>,
    pub cys: Vec<f32>,
    /// `cxs` and `cys` again, per block of 16 rows with the rows side by side:
    /// `[(m + PAD_ROWS) / 16][ng][16]` (what an AMX tile's float steps read).
    pub txs: Vec<f32>,
    pub tys: Vec<f32>,
}

/// Zero rows after the last activation row of a [`QAct`] (one AMX tile's rows less one,
/// rounded up): a tile of 16 rows starting at any row stays inside the arrays.
pub(crate) const PAD_ROWS: usize = 16;

/// Positions in chain-major order of a row's `ng` groups: chain `c` starts where the
/// chains before it end, each holding `ceil((ng - c') / 16)` groups.
#[derive(Clone, Copy)]
pub(crate) struct ChainStarts([usize; CHAINS]);

impl ChainStarts {
    pub(crate) fn new(ng: usize) -> ChainStarts {
        let mut first = [0usize; CHAINS];
        for c in 1..CHAINS {
            first[c] = first[c - 1] + (ng + CHAINS - c) / CHAINS;
        }
        ChainStarts(first)
    }

    /// Position of group `g`.
    #[inline]
    pub(crate) fn pos(&self, g: usize) -> usize {
        self.0[g % CHAINS] + g / CHAINS
    }
}

/// Raw row pointers into a [`QAct`], shared by the threads that fill disjoint rows.
#[derive(Clone, Copy)]
struct ActPtrs {
    xq: *mut i8,
    xs: *mut f32,
    ys: *mut f32,
    s: *mut i32,
    h: *mut i16,
    cq: *mut u8,
    cxs: *mut f32,
    cys: *mut f32,
    txs: *mut f32,
    tys: *mut f32,
}
// SAFETY: only used to write disjoint rows while the QAct is mutably borrowed.
unsafe impl Send for ActPtrs {}
unsafe impl Sync for ActPtrs {}

/// How a row's groups are quantized: scalar, or a SIMD routine with the same results.
pub(crate) type GroupQuantizer = unsafe fn(x: *const f32, q: *mut i8) -> (f32, [i32; 2]);

/// Scalar [`GroupQuantizer`].
///
/// # Safety
/// `x` is readable for 32 f32, `q` writable for 32 bytes.
pub(crate) unsafe fn quantize_group_scalar(x: *const f32, q: *mut i8) -> (f32, [i32; 2]) {
    quantize_group(std::slice::from_raw_parts(x, GROUP), std::slice::from_raw_parts_mut(q, GROUP))
}

/// Work (values) from which rows are quantized in parallel.
const PAR_MIN_VALUES: usize = 1 << 16;

impl QAct {
    /// Quantizes `x` (`[m, k]`, `k` a multiple of 32) into `self`, reusing its buffers.
    /// `chain`: also build the chain-major copy, biased (`q + 128`) or not.
    pub(crate) fn fill(&mut self, x: &[f32], m: usize, k: usize, chain: Option<bool>, quant: GroupQuantizer) {
        assert!(k.is_multiple_of(GROUP) && x.len() == m * k);
        let ng = k / GROUP;
        let ngp = ng.next_multiple_of(CHAINS);
        (self.k, self.m, self.ng, self.ngp) = (k, m, ng, ngp);
        // Sized without clearing (no reallocation once grown): rows `0..m` are written whole
        // by `quantize_row`, padding groups included, so only the `PAD_ROWS` zero rows that
        // follow (a 16-row AMX tile may start at any row) are cleared here. Clearing every
        // array first was a serial memset of about 9 MB per prefill call at k = 5632 (m = 512).
        let rows = m + PAD_ROWS;
        zero_from(&mut self.xq, m * ngp * GROUP, rows * ngp * GROUP);
        zero_from(&mut self.xs, m * ngp, rows * ngp);
        zero_from(&mut self.ys, m * ngp, rows * ngp);
        zero_from(&mut self.s, m * ngp, rows * ngp);
        zero_from(&mut self.h, m * 2 * ngp, rows * 2 * ngp);
        self.chain = chain;
        if chain.is_some() {
            zero_from(&mut self.cq, m * ng * GROUP, rows * ng * GROUP);
            zero_from(&mut self.cxs, m * ng, rows * ng);
            zero_from(&mut self.cys, m * ng, rows * ng);
            // Rows side by side per block of 16: clear from the block that holds row `m`.
            zero_from(&mut self.txs, m / 16 * 16 * ng, rows.next_multiple_of(16) * ng);
            zero_from(&mut self.tys, m / 16 * 16 * ng, rows.next_multiple_of(16) * ng);
        }
        let p = ActPtrs {
            xq: self.xq.as_mut_ptr(),
            xs: self.xs.as_mut_ptr(),
            ys: self.ys.as_mut_ptr(),
            s: self.s.as_mut_ptr(),
            h: self.h.as_mut_ptr(),
            cq: self.cq.as_mut_ptr(),
            cxs: self.cxs.as_mut_ptr(),
            cys: self.cys.as_mut_ptr(),
            txs: self.txs.as_mut_ptr(),
            tys: self.tys.as_mut_ptr(),
        };
        let row = |i: usize| {
            // SAFETY: row i of every array is in bounds (sized above) and written by this
            // closure call only.
            unsafe { quantize_row(&x[i * k..(i + 1) * k], i, ng, ngp, p, chain, quant) }
        };
        if m * k >= PAR_MIN_VALUES && m > 1 && rayon::current_num_threads() > 1 {
            (0..m).into_par_iter().for_each(row);
        } else {
            (0..m).for_each(row);
        }
    }
}

/// `v` resized to `n` (keeping its allocation) with `v[from..n]` zero; `v[..from]` keeps
/// whatever it held, for the caller to overwrite.
fn zero_from<T: Copy + Default>(v: &mut Vec<T>, from: usize, n: usize) {
    v.truncate(from.min(n));
    v.resize(n, T::default());
}

/// # Safety
/// `p` points at arrays sized for row `i` as `QAct::fill` sizes them; no other thread writes
/// row `i`.
unsafe fn quantize_row(
    x: &[f32],
    i: usize,
    ng: usize,
    ngp: usize,
    p: ActPtrs,
    chain: Option<bool>,
    quant: GroupQuantizer,
) {
    let q = p.xq.add(i * ngp * GROUP);
    let starts = ChainStarts::new(ng);
    for g in 0..ng {
        let (xg, [h0, h1]) = quant(x.as_ptr().add(g * GROUP), q.add(g * GROUP));
        let s = h0 + h1;
        let r = i * ngp + g;
        *p.xs.add(r) = xg;
        *p.s.add(r) = s;
        *p.ys.add(r) = xg * s as f32;
        *p.h.add(2 * r) = h0 as i16;
        *p.h.add(2 * r + 1) = h1 as i16;
        if let Some(biased) = chain {
            let cp = starts.pos(g);
            let pos = i * ng + cp;
            *p.cxs.add(pos) = xg;
            *p.cys.add(pos) = xg * s as f32;
            let tpos = (i / 16 * ng + cp) * 16 + i % 16;
            *p.txs.add(tpos) = xg;
            *p.tys.add(tpos) = xg * s as f32;
            // Four 8-byte words (the bias flips each byte's top bit).
            let (src, dst) = (q.add(g * GROUP) as *const u64, p.cq.add(pos * GROUP) as *mut u64);
            let flip = if biased { 0x8080_8080_8080_8080u64 } else { 0 };
            for w in 0..GROUP / 8 {
                dst.add(w).write_unaligned(src.add(w).read_unaligned() ^ flip);
            }
        }
    }
    // The padding groups `ng..ngp`, which the direct kernels read as whole chunks.
    let (r, pad) = (i * ngp + ng, ngp - ng);
    std::ptr::write_bytes(q.add(ng * GROUP), 0, pad * GROUP);
    std::ptr::write_bytes(p.xs.add(r), 0, pad);
    std::ptr::write_bytes(p.ys.add(r), 0, pad);
    std::ptr::write_bytes(p.s.add(r), 0, pad);
    std::ptr::write_bytes(p.h.add(2 * r), 0, 2 * pad);
}

/// Activation buffers between calls, grown to the largest call and then reused: one per
/// call in flight at once (one, unless a rayon worker runs another matmul while it waits
/// inside one). Process-wide rather than per thread, because a step's ops run on whichever
/// pool worker takes the step: a per-thread buffer grew again on each thread's first call
/// of a size, long after warm-up.
static ACTS: std::sync::Mutex<Vec<QAct>> = std::sync::Mutex::new(Vec::new());

/// Runs `f` with a reusable [`QAct`]: the largest free one (a new one if none is free).
pub(crate) fn with_act<T>(f: impl FnOnce(&mut QAct) -> T) -> T {
    let mut a = {
        let mut free = ACTS.lock().unwrap_or_else(|e| e.into_inner());
        let largest = (0..free.len()).max_by_key(|&i| free[i].xq.capacity());
        largest.map(|i| free.swap_remove(i)).unwrap_or_default()
    };
    let out = f(&mut a);
    ACTS.lock().unwrap_or_else(|e| e.into_inner()).push(a);
    out
}

/// Scalar Fast kernel: weight rows `j0..j1` (of `w`, row stride `row_bytes`) against
/// activation rows `i0..i1` of `act`; raw dot products to `dst[(i - i0) * ld + (j - j0)]`.
///
/// # Safety
/// `dst` is writable for that rectangle.
pub(crate) unsafe fn dots_scalar(
    dtype: DType,
    w: &crate::WeightMat<'_>,
    rows: (usize, usize),
    act: &QAct,
    acts: (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    dots_scalar_of(|j, g| group(dtype, w.row(j), g), has_mins(dtype), rows, act, acts, dst, ld)
}

/// As [`dots_scalar`], with group `g` of weight row `j` given by `group_of` (whatever the
/// weights' layout).
///
/// # Safety
/// `dst` is writable for the `rows` x `acts` rectangle.
pub(crate) unsafe fn dots_scalar_of(
    group_of: impl Fn(usize, usize) -> Group,
    mins: bool,
    (j0, j1): (usize, usize),
    act: &QAct,
    (i0, i1): (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    let ng = act.ng;
    let mut groups = Vec::with_capacity(ng);
    for j in j0..j1 {
        groups.clear();
        groups.extend((0..ng).map(|g| group_of(j, g)));
        for i in i0..i1 {
            *dst.add((i - i0) * ld + (j - j0)) = dot_groups(&groups, mins, act, i);
        }
    }
}

/// The canonical Fast dot product (module doc) of one weight row, given as its groups, with
/// activation row `i` of `act`.
pub(crate) fn dot_groups(groups: &[Group], mins: bool, act: &QAct, i: usize) -> f32 {
    let base = i * act.ngp;
    let xq = &act.xq[base * GROUP..];
    let mut acc = [0f32; CHAINS];
    for (g, gr) in groups.iter().enumerate() {
        let q = &xq[g * GROUP..(g + 1) * GROUP];
        let d: i32 = (0..2)
            .map(|h| {
                let s: i32 = (16 * h..16 * h + 16).map(|e| gr.w[e] as i32 * q[e] as i32).sum();
                gr.sc[h] * s
            })
            .sum();
        let c = g % CHAINS;
        acc[c] = (d as f32).mul_add(gr.a * act.xs[base + g], acc[c]);
        if mins {
            let y = if gr.ms == [1, 1] {
                act.ys[base + g]
            } else {
                let h = &act.h[2 * (base + g)..];
                act.xs[base + g] * (gr.ms[0] * h[0] as i32 + gr.ms[1] * h[1] as i32) as f32
            };
            acc[c] = (-gr.m).mul_add(y, acc[c]);
        }
    }
    reference::hsum16(&acc)
}

/// One activation row of a [`QAct`] (natural layout): where its arrays start.
#[derive(Clone, Copy)]
pub(super) struct ActRow {
    pub xq: *const u8,
    pub xs: *const f32,
    pub ys: *const f32,
    pub s: *const i32,
    pub h: *const i16,
}

impl ActRow {
    pub(super) fn of(a: &QAct, i: usize) -> ActRow {
        let g = i * a.ngp;
        // SAFETY: row i exists (i < a.m), so these offsets stay inside the arrays.
        unsafe {
            ActRow {
                xq: a.xq.as_ptr().add(g * GROUP) as *const u8,
                xs: a.xs.as_ptr().add(g),
                ys: a.ys.as_ptr().add(g),
                s: a.s.as_ptr().add(g),
                h: a.h.as_ptr().add(2 * g),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every array of `a` (floats as their bits), for comparing two fills.
    fn arrays(a: &QAct) -> Vec<Vec<i64>> {
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits() as i64).collect();
        vec![
            a.xq.iter().map(|&v| v as i64).collect(),
            f(&a.xs),
            f(&a.ys),
            a.s.iter().map(|&v| v as i64).collect(),
            a.h.iter().map(|&v| v as i64).collect(),
            a.cq.iter().map(|&v| v as i64).collect(),
            f(&a.cxs),
            f(&a.cys),
            f(&a.txs),
            f(&a.tys),
        ]
    }

    /// `fill` clears only the padding rows and writes every other value, so a buffer reused
    /// after a larger call (its padding groups and rows full of that call's values) must
    /// hold exactly what a fresh one does: the padding zero.
    #[test]
    fn reused_buffers_equal_fresh_ones() {
        let x = |m: usize, k: usize, seed: u32| -> Vec<f32> {
            (0..m * k)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 / 500.0 - 2.0)
                .collect()
        };
        // (m, k) of the large call, then of the small one: fewer rows, fewer groups (a
        // padding group where the large call had values), a row count not a multiple of 16.
        for chain in [None, Some(false), Some(true)] {
            for (big, small) in [((40, 1024), (5, 96)), ((33, 512), (17, 512)), ((64, 2048), (1, 32))] {
                let mut reused = QAct::default();
                reused.fill(&x(big.0, big.1, 7), big.0, big.1, chain, quantize_group_scalar);
                let xs = x(small.0, small.1, 3);
                reused.fill(&xs, small.0, small.1, chain, quantize_group_scalar);
                let mut fresh = QAct::default();
                fresh.fill(&xs, small.0, small.1, chain, quantize_group_scalar);
                assert!(arrays(&reused) == arrays(&fresh), "chain {chain:?}: {big:?} then {small:?}");
            }
        }
    }

    /// Chain-major order: all groups of chain 0 in increasing `g`, then chain 1, ...: the
    /// positions, visited in that order, are 0, 1, 2, ...
    #[test]
    fn chain_positions_are_chain_major() {
        for ng in [1, 5, 15, 16, 17, 31, 64, 65, 176] {
            let starts = ChainStarts::new(ng);
            let order: Vec<usize> = (0..CHAINS).flat_map(|c| (c..ng).step_by(CHAINS)).collect();
            let pos: Vec<usize> = order.iter().map(|&g| starts.pos(g)).collect();
            assert_eq!(pos, (0..ng).collect::<Vec<_>>(), "ng {ng}");
        }
    }
}
