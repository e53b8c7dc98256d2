//! AVX-512 and AVX2 kernels for block-quantized weights.
//!
//! One generic body serves both instruction sets: a 16-lane f32 vector type
//! ([`F32x16Bytes`]: one zmm, or two ymm) and byte-level unpacking on 256-bit integer vectors (AVX2 instructions,
//! present in both). Every path computes exactly `reference::dot_ordered` of the
//! dequantized row: values are dequantized with ggml's f32 operations, lane `l` of a
//! 16-lane accumulator takes the fused multiply-adds of elements `16c + l` in increasing
//! `c`, and the lanes are summed with `reference::hsum16`'s tree. So the result is
//! bit-identical across ISAs, batch sizes and work splits.
//!
//! Two shapes of work:
//! - direct (fewer than `TILE_MIN_ROWS` activation rows, decode): the same block of 4 weight
//!   rows is unpacked into registers and multiplied straight into the accumulators of up to
//!   4 activation rows; weight bytes are prefetched 8 KiB ahead. This is the memory-bound
//!   GEMV, one pass over the weights;
//! - tiled (prefill): 6 weight rows (AVX-512; 2 on AVX2) are dequantized 512 values at a
//!   time into a 64-byte aligned f32 scratch that stays in L1, and a register-tiled
//!   micro-kernel (4x6; 2x2) runs every activation row of the task over that chunk, carrying
//!   its 16-lane accumulators across chunks in a scratch (so every lane still sees its
//!   products in increasing k). The next tile's activation rows are prefetched (each tile
//!   reads only 512 values per row, too short for the hardware prefetcher), and the final
//!   trees run 16 accumulators at a time with the same additions.
//!
//! All helpers are `#[inline(always)]` so that they compile inside the `#[target_feature]`
//! entry points at the bottom, where the intrinsics are allowed to inline.

// Kernels index several same-length arrays (rows, lanes, accumulators) with one counter.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ptr;

use crate::gemm::gguf::{
    iq4xs_scale, q3k_scale, with_block, Block, IQ4NL, IQ4XS, IQ4XS_QS, IQ4_LEVELS, Q2K, Q2K_D, Q2K_QS, Q3K, Q3K_D,
    Q3K_QS, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0,
};
use crate::simd::{Avx2x2, Avx512, F32x16Bytes};
use crate::DType;

/// Activation rows handled in one pass of the direct path.
const DIRECT_M: usize = 4;
/// Weight rows unpacked together in the direct path (independent accumulation chains).
const DIRECT_R: usize = 4;
/// How far ahead of the direct path's reads weight bytes are prefetched (measured: 8 KiB
/// and more reach full DRAM bandwidth on short rows, 2 KiB does not).
pub(super) const PREFETCH_BYTES: usize = 8192;

#[inline(always)]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline(always)]
pub(super) unsafe fn load32(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 16 packed bytes as 32 nibbles: low nibbles in bytes 0..16, high nibbles in 16..32.
#[inline(always)]
pub(super) unsafe fn nibbles16(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// 32 IQ4 level indices (bytes 0..16) as their signed levels.
#[inline(always)]
pub(super) unsafe fn iq4_levels(idx: __m256i) -> __m256i {
    let t = _mm_loadu_si128(IQ4_LEVELS.as_ptr() as *const __m128i);
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx)
}

/// The 32 five-bit quants of a Q5_0 / Q5_1 block whose qh is at `p` (nibbles after it):
/// unsigned, 0..32.
#[inline(always)]
pub(super) unsafe fn q5_quants<V: F32x16Bytes>(p: *const u8) -> __m256i {
    let qh = ptr::read_unaligned(p as *const u32);
    _mm256_or_si256(nibbles16(p.add(4)), _mm256_and_si256(V::bits_to_bytes(qh), _mm256_set1_epi8(16)))
}

/// Where dequantized 16-value chunks go: `put(c, v)` receives chunk `c` of the current
/// block for each of `R` weight rows, in increasing `c`.
pub(super) trait Sink<V: F32x16Bytes, const R: usize> {
    unsafe fn put(&mut self, c: usize, v: &[V; R]);
}

/// A GGUF block format, unpacked for `R` rows at once (the same block index in each).
pub(super) trait Format: Block {
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S);
}

/// `(lo, hi)` scaled: `v * d` (ggml: `x * d`).
#[inline(always)]
unsafe fn scaled<V: F32x16Bytes>(q: __m256i, d: V) -> (V, V) {
    let (a, b) = V::from_i8x32(q);
    (V::mul(a, d), V::mul(b, d))
}

impl Format for Q8_0 {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
        for r in 0..R {
            (a[r], b[r]) = scaled(load32(p[r].add(2)), V::splat_f16(p[r]));
        }
        s.put(0, &a);
        s.put(1, &b);
    }
}

impl Format for Q4_0 {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
        for r in 0..R {
            let q = _mm256_sub_epi8(nibbles16(p[r].add(2)), _mm256_set1_epi8(8));
            (a[r], b[r]) = scaled(q, V::splat_f16(p[r]));
        }
        s.put(0, &a);
        s.put(1, &b);
    }
}

impl Format for Q5_0 {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
        for r in 0..R {
            let q = _mm256_sub_epi8(q5_quants::<V>(p[r].add(2)), _mm256_set1_epi8(16));
            (a[r], b[r]) = scaled(q, V::splat_f16(p[r]));
        }
        s.put(0, &a);
        s.put(1, &b);
    }
}

/// Q4_1 / Q5_1: the block's unsigned quants `q` as `q * d + m` (ggml: `x*d + m`, not fused).
#[inline(always)]
unsafe fn put_with_min<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(
    p: &[*const u8; R],
    s: &mut S,
    quants: impl Fn(*const u8) -> __m256i,
) {
    let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
    for r in 0..R {
        let (lo, hi) = scaled(quants(p[r]), V::splat_f16(p[r]));
        let m = V::splat_f16(p[r].add(2));
        (a[r], b[r]) = (V::add(lo, m), V::add(hi, m));
    }
    s.put(0, &a);
    s.put(1, &b);
}

impl Format for Q4_1 {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        put_with_min(p, s, |b| nibbles16(b.add(4)))
    }
}

impl Format for Q5_1 {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        put_with_min(p, s, |b| q5_quants::<V>(b.add(4)))
    }
}

impl Format for IQ4NL {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
        for r in 0..R {
            (a[r], b[r]) = scaled(iq4_levels(nibbles16(p[r].add(2))), V::splat_f16(p[r]));
        }
        s.put(0, &a);
        s.put(1, &b);
    }
}

impl Format for IQ4XS {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        // ggml: dl = d * (ls - 32), then dl * level.
        let mut dl = [[0f32; 8]; R];
        for r in 0..R {
            let (d, b) = (f16_at(p[r]), std::slice::from_raw_parts(p[r], IQ4XS_QS));
            for j in 0..8 {
                dl[r][j] = d * iq4xs_scale(b, j) as f32;
            }
        }
        for j in 0..8 {
            let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
            for r in 0..R {
                let q = iq4_levels(nibbles16(p[r].add(IQ4XS_QS + 16 * j)));
                (a[r], b[r]) = scaled(q, V::splat(dl[r][j]));
            }
            s.put(2 * j, &a);
            s.put(2 * j + 1, &b);
        }
    }
}

/// The 2-bit quants of group `j` (0..8) of a Q2_K / Q3_K super-block whose `qs` start at `qs`:
/// bits `2 (j % 4)` of `qs[32 (j / 4) + l]`.
#[inline(always)]
pub(super) unsafe fn two_bits(qs: *const u8, j: usize) -> __m256i {
    let raw = load32(qs.add(32 * (j / 4)));
    _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * (j % 4) as i32)), _mm256_set1_epi8(3))
}

/// The unsigned 3-bit quants (0..8) of group `j` of the Q3_K super-block at `p`: the two bits
/// of `qs`, the third bit `j` of `hmask[l]`.
#[inline(always)]
pub(super) unsafe fn q3k_quants(p: *const u8, j: usize) -> __m256i {
    _mm256_or_si256(two_bits(p.add(Q3K_QS), j), high_bit(load32(p), j, 4))
}

/// Q2_K, Q3_K and Q6_K: 16 values per scale, `(d * sc_c) * q` for chunk `c` (ggml: `dl * q`),
/// minus `dmin * m_c` where there are mins (Q2_K; ggml: `dl * q - ml`).
#[inline(always)]
unsafe fn put_sub16<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(
    s: &mut S,
    c: usize,
    q: &[__m256i; R],
    ds: &[[f32; 16]; R],
    ms: Option<&[[f32; 16]; R]>,
) {
    let (mut va, mut vb) = ([V::zero(); R], [V::zero(); R]);
    for r in 0..R {
        let (lo, hi) = V::from_i8x32(q[r]);
        va[r] = V::mul(lo, V::splat(ds[r][c]));
        vb[r] = V::mul(hi, V::splat(ds[r][c + 1]));
        if let Some(ms) = ms {
            va[r] = V::sub(va[r], V::splat(ms[r][c]));
            vb[r] = V::sub(vb[r], V::splat(ms[r][c + 1]));
        }
    }
    s.put(c, &va);
    s.put(c + 1, &vb);
}

impl Format for Q2K {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut ds, mut ms) = ([[0f32; 16]; R], [[0f32; 16]; R]);
        for r in 0..R {
            let (d, dmin) = (f16_at(p[r].add(Q2K_D)), f16_at(p[r].add(Q2K_D + 2)));
            for c in 0..16 {
                let sc = *p[r].add(c);
                (ds[r][c], ms[r][c]) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
            }
        }
        for j in 0..8 {
            let mut q = [_mm256_setzero_si256(); R];
            for r in 0..R {
                q[r] = two_bits(p[r].add(Q2K_QS), j);
            }
            put_sub16(s, 2 * j, &q, &ds, Some(&ms));
        }
    }
}

impl Format for Q3K {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let mut ds = [[0f32; 16]; R];
        for r in 0..R {
            let (d, b) = (f16_at(p[r].add(Q3K_D)), std::slice::from_raw_parts(p[r], Q3K_D));
            for c in 0..16 {
                ds[r][c] = d * q3k_scale(b, c) as f32;
            }
        }
        for j in 0..8 {
            let mut q = [_mm256_setzero_si256(); R];
            for r in 0..R {
                q[r] = _mm256_sub_epi8(q3k_quants(p[r], j), _mm256_set1_epi8(4));
            }
            put_sub16(s, 2 * j, &q, &ds, None);
        }
    }
}

/// The 8 (d*sc, dmin*m) pairs of a Q4_K / Q5_K super-block, as ggml computes them.
#[inline(always)]
unsafe fn k_scales(p: *const u8) -> ([f32; 8], [f32; 8]) {
    let d = f16_at(p);
    let dmin = f16_at(p.add(2));
    let sc = std::slice::from_raw_parts(p.add(4), 12);
    let (mut ds, mut ms) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let (s, m) = crate::gemm::gguf::scale_min_k4(j, sc);
        ds[j] = d * s as f32;
        ms[j] = dmin * m as f32;
    }
    (ds, ms)
}

/// Puts sub-block `j` (32 values, chunks 2j and 2j+1): `d*q - m` per row (ggml: `d1*q - m1`).
#[inline(always)]
unsafe fn put_k_sub<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(
    s: &mut S,
    j: usize,
    q: &[__m256i; R],
    ds: &[[f32; 8]; R],
    ms: &[[f32; 8]; R],
) {
    let (mut a, mut b) = ([V::zero(); R], [V::zero(); R]);
    for r in 0..R {
        let (lo, hi) = V::from_i8x32(q[r]);
        let (d, m) = (V::splat(ds[r][j]), V::splat(ms[r][j]));
        a[r] = V::sub(V::mul(lo, d), m);
        b[r] = V::sub(V::mul(hi, d), m);
    }
    s.put(2 * j, &a);
    s.put(2 * j + 1, &b);
}

impl Format for Q4K {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut ds, mut ms) = ([[0f32; 8]; R], [[0f32; 8]; R]);
        for r in 0..R {
            (ds[r], ms[r]) = k_scales(p[r]);
        }
        let m4 = _mm256_set1_epi8(0x0F);
        for pair in 0..4 {
            let mut raw = [_mm256_setzero_si256(); R];
            for r in 0..R {
                raw[r] = load32(p[r].add(16 + 32 * pair));
            }
            let mut q = [_mm256_setzero_si256(); R];
            for r in 0..R {
                q[r] = _mm256_and_si256(raw[r], m4);
            }
            put_k_sub(s, 2 * pair, &q, &ds, &ms);
            for r in 0..R {
                q[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw[r]), m4);
            }
            put_k_sub(s, 2 * pair + 1, &q, &ds, &ms);
        }
    }
}

/// `v` where bit `j` of byte `l` of `qh` is set, else 0: the high bit of value `l` of
/// sub-block `j` (Q5_K: `v` = 16, Q3_K: 4).
#[inline(always)]
pub(super) unsafe fn high_bit(qh: __m256i, j: usize, v: i8) -> __m256i {
    let bit = _mm256_set1_epi8((1u8 << j) as i8);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(v))
}

impl Format for Q5K {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        let (mut ds, mut ms) = ([[0f32; 8]; R], [[0f32; 8]; R]);
        for r in 0..R {
            (ds[r], ms[r]) = k_scales(p[r]);
        }
        let m4 = _mm256_set1_epi8(0x0F);
        for pair in 0..4 {
            let (mut raw, mut qh) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for r in 0..R {
                raw[r] = load32(p[r].add(48 + 32 * pair));
                qh[r] = load32(p[r].add(16));
            }
            let mut q = [_mm256_setzero_si256(); R];
            for r in 0..R {
                q[r] = _mm256_or_si256(_mm256_and_si256(raw[r], m4), high_bit(qh[r], 2 * pair, 16));
            }
            put_k_sub(s, 2 * pair, &q, &ds, &ms);
            for r in 0..R {
                let nib = _mm256_and_si256(_mm256_srli_epi16::<4>(raw[r]), m4);
                q[r] = _mm256_or_si256(nib, high_bit(qh[r], 2 * pair + 1, 16));
            }
            put_k_sub(s, 2 * pair + 1, &q, &ds, &ms);
        }
    }
}

impl Format for Q6K {
    #[inline(always)]
    unsafe fn decode<V: F32x16Bytes, S: Sink<V, R>, const R: usize>(p: &[*const u8; R], s: &mut S) {
        // ggml: (d * sc) * q, one scale per 16 values, so chunk c uses scale c.
        let mut ds = [[0f32; 16]; R];
        for r in 0..R {
            let d = f16_at(p[r].add(208));
            for c in 0..16 {
                ds[r][c] = d * (*p[r].add(192 + c) as i8) as f32;
            }
        }
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let k32 = _mm256_set1_epi8(32);
        for half in 0..2 {
            let (mut a, mut b, mut h) =
                ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for r in 0..R {
                a[r] = load32(p[r].add(64 * half));
                b[r] = load32(p[r].add(64 * half + 32));
                h[r] = load32(p[r].add(128 + 32 * half));
            }
            // Quarter g holds values 128*half + 32*g + l: a low nibble (g = 0, 1: ql[l], ql[l+32])
            // or high nibble (g = 2, 3) plus bits 2g..2g+2 of qh[l] as bits 4..6.
            for g in 0..4 {
                let mut q = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let src = if g % 2 == 0 { a[r] } else { b[r] };
                    let lo = if g < 2 { src } else { _mm256_srli_epi16::<4>(src) };
                    let hb = match g {
                        0 => _mm256_slli_epi16::<4>(h[r]),
                        1 => _mm256_slli_epi16::<2>(h[r]),
                        2 => h[r],
                        _ => _mm256_srli_epi16::<2>(h[r]),
                    };
                    let v = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hb, m30));
                    q[r] = _mm256_sub_epi8(v, k32);
                }
                put_sub16(s, 8 * half + 2 * g, &q, &ds, None);
            }
        }
    }
}

/// Multiplies dequantized chunks into the accumulators of `M` activation rows.
struct DotSink<V: F32x16Bytes, const R: usize, const M: usize> {
    acc: [[V; M]; R],
    x: [*const f32; M],
    /// Element offset of the current block in the row.
    base: usize,
}

impl<V: F32x16Bytes, const R: usize, const M: usize> Sink<V, R> for DotSink<V, R, M> {
    #[inline(always)]
    unsafe fn put(&mut self, c: usize, v: &[V; R]) {
        let off = self.base + 16 * c;
        for i in 0..M {
            let xv = V::load(self.x[i].add(off));
            for r in 0..R {
                self.acc[r][i] = V::fma(xv, v[r], self.acc[r][i]);
            }
        }
    }
}

/// Stores dequantized chunks into `R` rows of an f32 scratch.
struct StoreSink<const R: usize> {
    dst: [*mut f32; R],
    base: usize,
}

impl<V: F32x16Bytes, const R: usize> Sink<V, R> for StoreSink<R> {
    #[inline(always)]
    unsafe fn put(&mut self, c: usize, v: &[V; R]) {
        for r in 0..R {
            v[r].store(self.dst[r].add(self.base + 16 * c));
        }
    }
}

/// Shape of one call: weight rows `w` (row stride `row_bytes`), activations `x` (row stride
/// `k`), results `dst[i * ld + j]` (raw dot products, no bias).
#[derive(Clone, Copy)]
pub(super) struct Job {
    pub w: *const u8,
    pub row_bytes: usize,
    pub n: usize,
    pub x: *const f32,
    pub m: usize,
    pub k: usize,
    pub dst: *mut f32,
    pub ld: usize,
}

/// Dot products of `R` weight rows (starting at `w`) with `M` activation rows.
#[inline(always)]
unsafe fn rows_direct<V: F32x16Bytes, D: Format, const R: usize, const M: usize>(
    w: *const u8,
    row_bytes: usize,
    x: [*const f32; M],
    k: usize,
) -> [[f32; M]; R] {
    let mut sink = DotSink::<V, R, M> { acc: [[V::zero(); M]; R], x, base: 0 };
    let mut p = [w; R];
    for r in 0..R {
        p[r] = w.add(r * row_bytes);
    }
    // Rows are often short (under 1 KiB), too short for the hardware prefetcher to lock on
    // to each of the R interleaved streams: fetch the bytes `dist` ahead explicitly. Over
    // the R rows these addresses sweep the contiguous weight bytes that follow.
    let dist = (R * row_bytes).max(PREFETCH_BYTES);
    for _ in 0..k / D::ELEMS {
        for r in 0..R {
            let mut o = 0;
            while o < D::BYTES {
                _mm_prefetch::<_MM_HINT_T0>(p[r].wrapping_add(dist + o) as *const i8);
                o += 64;
            }
        }
        D::decode::<V, _, R>(&p, &mut sink);
        for q in p.iter_mut() {
            *q = q.add(D::BYTES);
        }
        sink.base += D::ELEMS;
    }
    let mut out = [[0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            out[r][i] = sink.acc[r][i].reduce();
        }
    }
    out
}

#[inline(always)]
unsafe fn direct_m<V: F32x16Bytes, D: Format, const M: usize>(job: &Job, i0: usize) {
    let mut x = [job.x; M];
    for i in 0..M {
        x[i] = job.x.add((i0 + i) * job.k);
    }
    let mut j = 0;
    while j + DIRECT_R <= job.n {
        let res = rows_direct::<V, D, DIRECT_R, M>(job.w.add(j * job.row_bytes), job.row_bytes, x, job.k);
        for r in 0..DIRECT_R {
            for i in 0..M {
                *job.dst.add((i0 + i) * job.ld + j + r) = res[r][i];
            }
        }
        j += DIRECT_R;
    }
    while j < job.n {
        let res = rows_direct::<V, D, 1, M>(job.w.add(j * job.row_bytes), job.row_bytes, x, job.k);
        for i in 0..M {
            *job.dst.add((i0 + i) * job.ld + j) = res[0][i];
        }
        j += 1;
    }
}

/// Direct path: activation rows in groups of up to `DIRECT_M`.
#[inline(always)]
unsafe fn direct<V: F32x16Bytes, D: Format>(job: &Job) {
    let mut i = 0;
    while i < job.m {
        let mm = (job.m - i).min(DIRECT_M);
        match mm {
            1 => direct_m::<V, D, 1>(job, i),
            2 => direct_m::<V, D, 2>(job, i),
            3 => direct_m::<V, D, 3>(job, i),
            _ => direct_m::<V, D, 4>(job, i),
        }
        i += mm;
    }
}

/// Values of `k` one tiled chunk covers: the chunk's dequantized weight rows stay in L1
/// (6 rows x 512 x 4 bytes = 12 KiB on AVX-512) while the activation rows stream past. A
/// multiple of every block size (256).
const TILE_KC: usize = 512;

/// Dequantizes blocks `b0..b0 + nb` of `R` consecutive weight rows into `dst` rows of stride
/// `ld`.
#[inline(always)]
unsafe fn dequant_chunk<V: F32x16Bytes, D: Format, const R: usize>(
    w: *const u8,
    row_bytes: usize,
    (b0, nb): (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    let mut sink = StoreSink::<R> { dst: [dst; R], base: 0 };
    let mut p = [w; R];
    for r in 0..R {
        p[r] = w.add(r * row_bytes + b0 * D::BYTES);
        sink.dst[r] = dst.add(r * ld);
    }
    for _ in 0..nb {
        D::decode::<V, _, R>(&p, &mut sink);
        for q in p.iter_mut() {
            *q = q.add(D::BYTES);
        }
        sink.base += D::ELEMS;
    }
}

/// `MR` activation rows (stride `ldx`) times `NR` dequantized weight rows (stride `ldw`) over
/// `kc` values, in the fixed order, continuing the 16-lane accumulators at `c` (accumulator
/// `(i, r)` at `c[16 * (i * NR + r)..]`, started from zero when `first`).
#[inline(always)]
unsafe fn micro_kc<V: F32x16Bytes, const MR: usize, const NR: usize>(
    (x, ldx): (*const f32, usize),
    (w, ldw): (*const f32, usize),
    kc: usize,
    c: *mut f32,
    first: bool,
) {
    let mut acc = [[V::zero(); NR]; MR];
    if !first {
        for i in 0..MR {
            for r in 0..NR {
                acc[i][r] = V::load(c.add(16 * (i * NR + r)));
            }
        }
    }
    let mut off = 0;
    while off < kc {
        let mut xv = [V::zero(); MR];
        for i in 0..MR {
            xv[i] = V::load(x.add(i * ldx + off));
            // The next tile's rows: each tile reads only `kc` values per row, too short a
            // stream for the hardware prefetcher to hide L2 latency.
            _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add((MR + i) * ldx + off) as *const i8);
        }
        for r in 0..NR {
            let wv = V::load(w.add(r * ldw + off));
            for i in 0..MR {
                acc[i][r] = V::fma(xv[i], wv, acc[i][r]);
            }
        }
        off += 16;
    }
    for i in 0..MR {
        for r in 0..NR {
            acc[i][r].store(c.add(16 * (i * NR + r)));
        }
    }
}

/// Tiled path: `NR` weight rows at a time, dequantized `TILE_KC` values at a time into `ws`
/// (L1), against all `m` activation rows in tiles of `MR` (activations stream from L2, each
/// load feeding `NR` fused multiply-adds). The accumulators carry across chunks in `c` (so
/// every lane still sees its products in increasing k), then the canonical tree sums them.
///
/// `ws` holds `NR * TILE_KC` f32, `c` holds `16 * NR * m`.
#[inline(always)]
unsafe fn tiled<V: F32x16Bytes, D: Format, const MR: usize, const NR: usize>(job: &Job, ws: *mut f32, c: *mut f32) {
    const { assert!(MR == 2 || MR == 4, "remainder tiles cover 1 to 3 rows") };
    let mut j = 0;
    while j < job.n {
        let nr = (job.n - j).min(NR);
        let wj = job.w.add(j * job.row_bytes);
        if nr < NR {
            // The missing rows multiply as zeros; their sums are dropped.
            ptr::write_bytes(ws, 0, NR * TILE_KC);
        }
        let mut k0 = 0;
        while k0 < job.k {
            let kc = (job.k - k0).min(TILE_KC);
            let blocks = (k0 / D::ELEMS, kc / D::ELEMS);
            if nr == NR {
                dequant_chunk::<V, D, NR>(wj, job.row_bytes, blocks, ws, TILE_KC);
            } else {
                for r in 0..nr {
                    dequant_chunk::<V, D, 1>(
                        wj.add(r * job.row_bytes),
                        job.row_bytes,
                        blocks,
                        ws.add(r * TILE_KC),
                        TILE_KC,
                    );
                }
            }
            let first = k0 == 0;
            let mut i = 0;
            while i < job.m {
                let mr = (job.m - i).min(MR);
                let (x, ci) = ((job.x.add(i * job.k + k0), job.k), c.add(16 * NR * i));
                match mr {
                    1 => micro_kc::<V, 1, NR>(x, (ws, TILE_KC), kc, ci, first),
                    2 if MR > 2 => micro_kc::<V, 2, NR>(x, (ws, TILE_KC), kc, ci, first),
                    3 if MR > 3 => micro_kc::<V, 3, NR>(x, (ws, TILE_KC), kc, ci, first),
                    _ => micro_kc::<V, MR, NR>(x, (ws, TILE_KC), kc, ci, first),
                }
                i += mr;
            }
            k0 += kc;
        }
        // Accumulator a = i * NR + r is output (i, j + r); sum 16 at a time.
        let total = job.m * NR;
        let mut a = 0;
        while a < total {
            let cnt = (total - a).min(16);
            let sums = if cnt == 16 { V::hsum16x(c.add(16 * a)) } else { [0f32; 16] };
            for t in 0..cnt {
                let (i, r) = ((a + t) / NR, (a + t) % NR);
                if r < nr {
                    let v = if cnt == 16 { sums[t] } else { V::load(c.add(16 * (a + t))).reduce() };
                    *job.dst.add(i * job.ld + j + r) = v;
                }
            }
            a += cnt;
        }
        j += nr;
    }
}

/// Raw dot products for `job` with weights of format `D` on `isa`'s kernels.
macro_rules! entry_points {
    ($direct:ident, $tiled:ident, $v:ty, $mr:literal, $nr:literal, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $direct<D: Format>(job: &Job) {
            direct::<$v, D>(job)
        }

        #[target_feature(enable = $features)]
        unsafe fn $tiled<D: Format>(job: &Job, ws: *mut f32, c: *mut f32) {
            tiled::<$v, D, $mr, $nr>(job, ws, c)
        }
    };
}

entry_points!(direct_avx512, tiled_avx512, Avx512, 4, 6, "avx512f,avx512bw,avx512vl,avx2,fma,f16c");
entry_points!(direct_avx2, tiled_avx2, Avx2x2, 2, 2, "avx2,fma,f16c");

/// Register tiles of the tiled path: (activation rows, weight rows). 4 x 6 measured best of
/// 3 x 8, 6 x 4, 4 x 6 and 2 x 12 on AVX-512 (L1-resident, aligned operands).
const TILE_AVX512: (usize, usize) = (4, 6);
const TILE_AVX2: (usize, usize) = (2, 2);

thread_local! {
    /// Per-thread dequantized chunk and accumulators of the tiled path, reused.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Activation rows from which the tiled path is faster than unpacking the blocks again for
/// every group of `DIRECT_M` rows (measured on both instruction sets: direct wins up to 3
/// rows, ties at 4, loses from 5).
pub(super) const TILE_MIN_ROWS: usize = DIRECT_M + 1;

/// Runs `job` on AVX-512 (`avx512 == true`) or AVX2.
///
/// # Safety
/// The CPU must support the chosen instruction set (checked by the caller through
/// `isa::detected`), and `job` must describe valid memory: `n` rows of `row_bytes` bytes of
/// `dtype` blocks covering `k` values, `m` rows of `k` f32, and a writable `dst`.
pub(super) unsafe fn dots(avx512: bool, dtype: DType, job: &Job) {
    macro_rules! go {
        ($f:ident, $($arg:expr),*) => {
            with_block!(dtype, F => $f::<F>($($arg),*), _ => unreachable!("checked by matmul_quant"))
        };
    }
    if job.m < TILE_MIN_ROWS {
        return if avx512 { go!(direct_avx512, job) } else { go!(direct_avx2, job) };
    }
    let nr = if avx512 { TILE_AVX512.1 } else { TILE_AVX2.1 };
    // 64-byte aligned operands: split loads cost this loop a third of its speed. The engine's
    // activations are aligned already; others are copied into aligned scratch.
    let copy_x = !(job.x as usize).is_multiple_of(64);
    let (wlen, clen) = (nr * TILE_KC, 16 * nr * job.m);
    let need = wlen + clen + if copy_x { job.m * job.k } else { 0 } + 16;
    let run = |buf: &mut [f32]| {
        let base = buf.as_mut_ptr();
        let ws = base.add(base.align_offset(64));
        let c = ws.add(wlen);
        let mut job = *job;
        if copy_x {
            let xs = c.add(clen);
            ptr::copy_nonoverlapping(job.x, xs, job.m * job.k);
            job.x = xs;
        }
        if avx512 {
            go!(tiled_avx512, &job, ws, c)
        } else {
            go!(tiled_avx2, &job, ws, c)
        }
    };
    TILE.with(|t| match t.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < need {
                v.resize(need, 0.0);
            }
            run(&mut v)
        }
        Err(_) => run(&mut vec![0.0; need]),
    })
}
