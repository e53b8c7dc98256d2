//! AVX-512 and AVX2 kernels of the `Fast` precision (the arithmetic is in `q8_activations`'s module
//! doc), with and without VNNI.
//!
//! One generic body per shape of work, instantiated four times (`entry_points!` at the
//! bottom): 16 i32 lanes as one zmm ([`Avx512i`]) or two ymm ([`Avx2x2i`]), and `VNNI` choosing
//! `vpdpbusd` / `vpdpwssd` or their `vpmaddubsw` + `vpmaddwd` emulation (exact: no pair sum
//! can saturate, see [`I32x16::dot`]). Weight bytes are unpacked with 256-bit AVX2 instructions
//! present in all four, 32 values (one group) per register, as in `dequant_fma`.
//!
//! Direct path (few activation rows, decode): the weights in their GGUF layout, one pass.
//! A chunk of 16 groups of a row gives 8 units of 64 values; per unit and activation row one
//! integer dot product leaves 16 i32 lanes of partial sums (8 per group), and a three-level
//! tree of pairwise sums (`comb1..3`) turns the 8 units into one vector holding `D'_g` of
//! the 16 groups in order. Offsets (`-8 S_g` for Q4_0, ...) are subtracted as integers,
//! then the float chain step runs on 16 groups at once: lane `c` of the accumulator is chain
//! `c`, exactly the canonical order.
//!
//! Tiled path (many activation rows, prefill): 16 weight rows are packed once per task into
//! a panel with the rows in lanes (per group: 8 quads of 16 rows x 4 signed bytes, then the
//! group's scales, all in chain-major group order), and each activation quad is broadcast
//! against it: one `vpdpbusd` per 64 multiply-adds, the float step once per group for 16
//! outputs. Chains are walked one at a time, so a chain's weights (1/16 of the panel) stay
//! in L1 while all activation rows stream past; the 16 chain sums per output meet in the
//! same tree as the direct path's lanes. With VNNI the activations are biased to unsigned
//! (`q + 128`) and the accumulator starts at `-128 Σ w`; without it the sign trick keeps
//! `vpmaddubsw` exact.

// Kernels index several same-length arrays (rows, lanes, accumulators) with one counter.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ptr;

use super::dequant_fma::{
    f16_at, high_bit, iq4_levels, load32, nibbles16, q3k_quants, q5_quants, two_bits, PREFETCH_BYTES,
};
use super::q8_activations::{ActRow, QAct, CHAINS, GROUP};
use crate::gemm::gguf::{
    iq4xs_scale, q3k_scale, with_block, Block, IQ4NL, IQ4XS, IQ4XS_QS, Q2K, Q2K_D, Q2K_QS, Q3K, Q3K_D, Q4K, Q4_0, Q4_1,
    Q5K, Q5_0, Q5_1, Q6K, Q8_0,
};
use crate::simd::{Avx2x2i, Avx512, Avx512i, F32x16, F32x16Bytes, I32x16};
use crate::DType;

/// How a lane type packs weight rows into a panel (see [`pack`]): AVX-512 has its own
/// transposing packer.
pub(super) trait PanelPack: I32x16 {
    unsafe fn pack<F: FF, const VNNI: bool>(w: *const u8, row_bytes: usize, rows: usize, ng: usize, panel: *mut u8) {
        pack::<Self::F, F>(w, row_bytes, rows, ng, panel)
    }
}

impl PanelPack for Avx2x2i {}

impl PanelPack for Avx512i {
    #[inline(always)]
    unsafe fn pack<F: FF, const VNNI: bool>(w: *const u8, row_bytes: usize, rows: usize, ng: usize, panel: *mut u8) {
        pack_z::<F, VNNI>(w, row_bytes, rows, ng, panel)
    }
}

/// A chunk's 16-value half scales (`HALVES` formats), then its half mins (`HALF_MINS`), as
/// i16: 32 of each.
type HalfScales = [i16; 64];

/// A GGUF block format as the Fast kernels read it.
pub(super) trait FF: Block {
    /// Q4_1 / Q5_1 / Q4_K / Q5_K: the `-M_g * Y_g` term.
    const MINS: bool = false;
    /// The unpacked bytes are signed (Q8_0, IQ4_NL, IQ4_XS); otherwise unsigned.
    const SIGNED: bool = false;
    /// Q2_K / Q3_K / Q6_K: a signed integer scale per 16-value half (`sc`), and `D_h -= BIAS H_h`.
    const HALVES: bool = false;
    /// Q2_K: the min term is `-M_g fl(X_g (ms_0 H_0 + ms_1 H_1))`, `ms` the half mins.
    const HALF_MINS: bool = false;
    /// `D_g = dot(unsigned bytes, q) - (S_g << OFF)`; 0: no offset. For Q8_0 (with VNNI,
    /// whose bytes are XORed with 0x80 to make them unsigned) 7.
    const OFF: u32 = 0;
    /// What the unpacked unsigned bytes carry above the signed weight `w` (Q4_0 8, Q5_0 16,
    /// Q3_K 4, Q6_K 32; 0 for the signed formats, whose bytes are `w`, and those with mins).
    const BIAS: i8 = 0;
    /// Groups `2u` and `2u + 1` of the row at `p` (`u` counts units from the row start);
    /// only group `2u` when `!two` (the second is then zero and not read).
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i);
    /// `(A, M)` of the 16 groups of chunk `ch` (`gn` of them exist, the rest 0); `HALVES`
    /// formats also write the chunk's 32 sub-block scales to `sc`, `HALF_MINS` ones their 32
    /// mins after them.
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, sc: &mut HalfScales) -> (V, V);
}

/// `A` of 32-value blocks (`d`, an f16 at the block start) for a chunk of 16 blocks.
#[inline(always)]
unsafe fn header_0<V: F32x16Bytes>(p: *const u8, bb: usize, ch: usize, gn: usize) -> V {
    let mut d = [0u16; 16];
    let b = p.add(16 * ch * bb);
    if gn == 16 {
        // A full chunk (all but a row's last): the 16 scales assembled in a register and
        // stored whole, so the vector load below forwards from one store instead of stalling
        // on 16 narrow ones (that stall was ~15% of a Q4_0 GEMV).
        let r = |i: usize| ptr::read_unaligned(b.add(i * bb) as *const i16);
        let v = _mm256_set_epi16(
            r(15),
            r(14),
            r(13),
            r(12),
            r(11),
            r(10),
            r(9),
            r(8),
            r(7),
            r(6),
            r(5),
            r(4),
            r(3),
            r(2),
            r(1),
            r(0),
        );
        _mm256_storeu_si256(d.as_mut_ptr() as *mut __m256i, v);
        return V::load_f16(d.as_ptr() as *const u8);
    }
    for i in 0..gn {
        d[i] = ptr::read_unaligned(b.add(i * bb) as *const u16);
    }
    V::load_f16(d.as_ptr() as *const u8)
}

impl FF for Q4_0 {
    const OFF: u32 = 3;
    const BIAS: i8 = 8;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 18, u, two, |b| nibbles16(b.add(2)))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        (header_0(p, 18, ch, gn), V::zero())
    }
}

/// The two 32-value blocks of unit `u` (`bb` bytes each, from `p`), each unpacked by `one`
/// from its start (only the first when `!two`).
#[inline(always)]
unsafe fn unit_0(
    p: *const u8,
    bb: usize,
    u: usize,
    two: bool,
    one: impl Fn(*const u8) -> __m256i,
) -> (__m256i, __m256i) {
    let b = p.add(2 * u * bb);
    (one(b), if two { one(b.add(bb)) } else { _mm256_setzero_si256() })
}

impl FF for Q5_0 {
    const OFF: u32 = 4;
    const BIAS: i8 = 16;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 22, u, two, |b| q5_quants::<V>(b.add(2)))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        (header_0(p, 22, ch, gn), V::zero())
    }
}

impl FF for Q8_0 {
    const SIGNED: bool = true;
    const OFF: u32 = 7;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 34, u, two, |b| load32(b.add(2)))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        (header_0(p, 34, ch, gn), V::zero())
    }
}

/// `(A, M)` of a chunk of Q4_1 / Q5_1 (`bb`-byte blocks): `A = d`, `M = -m`.
#[inline(always)]
unsafe fn header_1<V: F32x16Bytes>(p: *const u8, bb: usize, ch: usize, gn: usize) -> (V, V) {
    (header_0(p, bb, ch, gn), V::neg(header_0(p.add(2), bb, ch, gn)))
}

impl FF for Q4_1 {
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 20, u, two, |b| nibbles16(b.add(4)))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        header_1(p, 20, ch, gn)
    }
}

impl FF for Q5_1 {
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 24, u, two, |b| q5_quants::<V>(b.add(4)))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        header_1(p, 24, ch, gn)
    }
}

impl FF for IQ4NL {
    const SIGNED: bool = true;
    const OFF: u32 = 7;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, two: bool) -> (__m256i, __m256i) {
        unit_0(p, 18, u, two, |b| iq4_levels(nibbles16(b.add(2))))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        (header_0(p, 18, ch, gn), V::zero())
    }
}

impl FF for IQ4XS {
    const SIGNED: bool = true;
    const OFF: u32 = 7;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        let b = p.add((u / 4) * 136 + IQ4XS_QS + 32 * (u % 4));
        (iq4_levels(nibbles16(b)), iq4_levels(nibbles16(b.add(16))))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        // A = d * (ls - 32), as ggml's dequantization rounds it.
        let mut a = [0f32; CHAINS];
        for s in 0..gn / 8 {
            let b = p.add((2 * ch + s) * 136);
            let (d, sb) = (f16_at(b), std::slice::from_raw_parts(b, IQ4XS_QS));
            for j in 0..8 {
                a[8 * s + j] = d * iq4xs_scale(sb, j) as f32;
            }
        }
        (V::load(a.as_ptr()), V::zero())
    }
}

/// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (ggml's `get_scale_min_k4`
/// for all j at once), as bytes.
#[inline(always)]
unsafe fn k4_scales(p: *const u8) -> (u64, u64) {
    let q0 = ptr::read_unaligned(p.add(4) as *const u32);
    let q1 = ptr::read_unaligned(p.add(8) as *const u32);
    let q2 = ptr::read_unaligned(p.add(12) as *const u32);
    let sc_lo = q0 & 0x3f3f_3f3f;
    let m_lo = q1 & 0x3f3f_3f3f;
    let sc_hi = (q2 & 0x0f0f_0f0f) | (((q0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((q2 >> 4) & 0x0f0f_0f0f) | (((q1 >> 6) & 0x0303_0303) << 4);
    ((sc_lo as u64) | ((sc_hi as u64) << 32), (m_lo as u64) | ((m_hi as u64) << 32))
}

/// `(A, M)` of a chunk of Q4_K / Q5_K: two super-blocks of `bb` bytes (one when `gn == 8`).
#[inline(always)]
unsafe fn header_k<V: F32x16Bytes>(p: *const u8, bb: usize, ch: usize, gn: usize) -> (V, V) {
    let b0 = p.add(2 * ch * bb);
    let (s0, m0) = k4_scales(b0);
    let (d0, n0) = (f16_at(b0), f16_at(b0.add(2)));
    let (mut s, mut m, mut d1, mut n1) = ([s0, 0u64], [m0, 0u64], 0f32, 0f32);
    if gn > 8 {
        let b1 = b0.add(bb);
        (s[1], m[1]) = k4_scales(b1);
        (d1, n1) = (f16_at(b1), f16_at(b1.add(2)));
    }
    let a = V::mul(V::from_u8x16(s.as_ptr() as *const u8), V::halves(d0, d1));
    let mm = V::mul(V::from_u8x16(m.as_ptr() as *const u8), V::halves(n0, n1));
    (a, mm)
}

impl FF for Q4K {
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        let raw = load32(p.add((u / 4) * 144 + 16 + 32 * (u % 4)));
        let m4 = _mm256_set1_epi8(0x0F);
        (_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        header_k(p, 144, ch, gn)
    }
}

impl FF for Q5K {
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        let (b, pair) = (p.add((u / 4) * 176), u % 4);
        let raw = load32(b.add(48 + 32 * pair));
        let qh = load32(b.add(16));
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), high_bit(qh, 2 * pair, 16));
        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4), high_bit(qh, 2 * pair + 1, 16));
        (lo, hi)
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, _: &mut HalfScales) -> (V, V) {
        header_k(p, 176, ch, gn)
    }
}

impl FF for Q2K {
    const MINS: bool = true;
    const HALVES: bool = true;
    const HALF_MINS: bool = true;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        let (b, v) = (p.add((u / 4) * 84 + Q2K_QS), u % 4);
        (two_bits(b, 2 * v), two_bits(b, 2 * v + 1))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, sc: &mut HalfScales) -> (V, V) {
        let (mut d, mut dmin) = ([0f32; 2], [0f32; 2]);
        sc.fill(0);
        for s in 0..gn / 8 {
            let b = p.add((2 * ch + s) * 84);
            (d[s], dmin[s]) = (f16_at(b.add(Q2K_D)), f16_at(b.add(Q2K_D + 2)));
            for c in 0..16 {
                let v = *b.add(c);
                (sc[16 * s + c], sc[32 + 16 * s + c]) = ((v & 0xF) as i16, (v >> 4) as i16);
            }
        }
        (V::halves(d[0], d[1]), V::halves(dmin[0], dmin[1]))
    }
}

impl FF for Q3K {
    const HALVES: bool = true;
    const BIAS: i8 = 4;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        let (b, v) = (p.add((u / 4) * 110), u % 4);
        (q3k_quants(b, 2 * v), q3k_quants(b, 2 * v + 1))
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, sc: &mut HalfScales) -> (V, V) {
        let mut d = [0f32; 2];
        sc.fill(0);
        for s in 0..gn / 8 {
            let b = p.add((2 * ch + s) * 110);
            d[s] = f16_at(b.add(Q3K_D));
            let sb = std::slice::from_raw_parts(b, Q3K_D);
            for c in 0..16 {
                sc[16 * s + c] = q3k_scale(sb, c) as i16;
            }
        }
        (V::halves(d[0], d[1]), V::zero())
    }
}

impl FF for Q6K {
    const HALVES: bool = true;
    const BIAS: i8 = 32;
    #[inline(always)]
    unsafe fn unit<V: F32x16Bytes>(p: *const u8, u: usize, _: bool) -> (__m256i, __m256i) {
        // Unit u' of a super-block: half n = u'/2, quarters gq = 2(u'%2) and 2(u'%2)+1: the
        // low (gq < 2) or high nibbles of ql[64n + 32(gq%2)..] and bits 2gq, 2gq+1 of qh[32n..].
        let (b, v) = (p.add((u / 4) * 210), u % 4);
        let n = v / 2;
        let a = load32(b.add(64 * n));
        let c = load32(b.add(64 * n + 32));
        let h = load32(b.add(128 + 32 * n));
        let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        if v % 2 == 0 {
            // Quarters 0 and 1: low nibbles of a and c, qh bits 0-1 and 2-3.
            let q0 = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(h), m30));
            let q1 = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(h), m30));
            (q0, q1)
        } else {
            let q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(h, m30));
            let q3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(c), m4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(h), m30),
            );
            (q2, q3)
        }
    }
    #[inline(always)]
    unsafe fn header<V: F32x16Bytes>(p: *const u8, ch: usize, gn: usize, sc: &mut HalfScales) -> (V, V) {
        let b0 = p.add(2 * ch * 210);
        let d0 = f16_at(b0.add(208));
        let s0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b0.add(192) as *const __m128i));
        _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, s0);
        let mut d1 = 0f32;
        if gn > 8 {
            let b1 = b0.add(210);
            d1 = f16_at(b1.add(208));
            let s1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b1.add(192) as *const __m128i));
            _mm256_storeu_si256(sc.as_mut_ptr().add(16) as *mut __m256i, s1);
        } else {
            _mm256_storeu_si256(sc.as_mut_ptr().add(16) as *mut __m256i, _mm256_setzero_si256());
        }
        (V::halves(d0, d1), V::zero())
    }
}

/// One call of the kernels: weight rows `w` (stride `row_bytes`), activation rows
/// `i0..i0 + m` of `act`, raw dot products to `dst[(i - i0) * ld + j]`.
pub(super) struct FJob<'a> {
    pub w: *const u8,
    pub row_bytes: usize,
    pub n: usize,
    pub act: &'a QAct,
    pub i0: usize,
    pub m: usize,
    pub dst: *mut f32,
    pub ld: usize,
}

/// Tree level `L` (1, 2, 3) applied elementwise.
#[inline(always)]
unsafe fn comb<I: I32x16, const L: u8, const M: usize, const R: usize>(a: [[I; M]; R], b: [[I; M]; R]) -> [[I; M]; R] {
    let mut o = a;
    for r in 0..R {
        for i in 0..M {
            o[r][i] = match L {
                1 => I::comb1(a[r][i], b[r][i]),
                2 => I::comb2(a[r][i], b[r][i]),
                _ => I::comb3(a[r][i], b[r][i]),
            };
        }
    }
    o
}

/// Partial sums of unit `u` (groups `2u`, `2u + 1` of chunk `ch`) for every (row, activation
/// row) pair; zero past the chunk's `gn` groups. (A function, not a closure: closures do not
/// inherit the target features of the entry point they are inlined into.)
#[inline(always)]
unsafe fn unit_dots<I: I32x16, F: FF, const VNNI: bool, const R: usize, const M: usize>(
    p: &[*const u8; R],
    x: &[ActRow; M],
    sc: &[HalfScales; R],
    ch: usize,
    u: usize,
    gn: usize,
) -> [[I; M]; R] {
    let mut out = [[I::zero(); M]; R];
    if 2 * u < gn {
        let two = 2 * u + 1 < gn;
        for r in 0..R {
            let (lo, hi) = F::unit::<I::F>(p[r], CHAINS / 2 * ch + u, two);
            let mut wv = I::from2(lo, hi);
            if F::SIGNED && VNNI {
                wv = wv.xor80();
            }
            let scv = if F::HALVES { I::sc_unit(sc[r].as_ptr().add(4 * u)) } else { I::zero() };
            for i in 0..M {
                let xv = I::load(x[i].xq.add((CHAINS * ch + 2 * u) * GROUP));
                out[r][i] = if F::HALVES {
                    I::dot_sc::<VNNI>(I::zero(), wv, xv, scv)
                } else if F::SIGNED && !VNNI {
                    I::dot_ss(I::zero(), wv, xv)
                } else {
                    I::dot::<VNNI>(I::zero(), wv, xv)
                };
            }
        }
    }
    out
}

/// Dot products of `R` consecutive weight rows at `w` with `M` activation rows.
#[inline(always)]
unsafe fn rows_direct<I: I32x16, F: FF, const VNNI: bool, const R: usize, const M: usize>(
    w: *const u8,
    row_bytes: usize,
    x: &[ActRow; M],
    ng: usize,
) -> [[f32; M]; R] {
    let mut acc = [[I::F::zero(); M]; R];
    let mut p = [w; R];
    for r in 0..R {
        p[r] = w.add(r * row_bytes);
    }
    let chunk_bytes = F::BYTES * (CHAINS * GROUP) / F::ELEMS;
    // As in the Exact direct path: rows are short, so fetch `dist` ahead explicitly.
    let dist = (R * row_bytes).max(PREFETCH_BYTES);
    let mut sc = [[0i16; 64]; R];
    for ch in 0..ng.div_ceil(CHAINS) {
        let gn = (ng - CHAINS * ch).min(CHAINS);
        for r in 0..R {
            let mut o = 0;
            while o < chunk_bytes {
                _mm_prefetch::<_MM_HINT_T0>(p[r].wrapping_add(ch * chunk_bytes + dist + o) as *const i8);
                o += 64;
            }
        }
        let (mut a, mut mn) = ([I::F::zero(); R], [I::F::zero(); R]);
        for r in 0..R {
            (a[r], mn[r]) = F::header::<I::F>(p[r], ch, gn, &mut sc[r]);
        }
        let u01 = comb::<I, 1, M, R>(
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 0, gn),
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 1, gn),
        );
        let u23 = comb::<I, 1, M, R>(
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 2, gn),
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 3, gn),
        );
        let q0 = comb::<I, 2, M, R>(u01, u23);
        let u45 = comb::<I, 1, M, R>(
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 4, gn),
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 5, gn),
        );
        let u67 = comb::<I, 1, M, R>(
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 6, gn),
            unit_dots::<I, F, VNNI, R, M>(&p, x, &sc, ch, 7, gn),
        );
        let q1 = comb::<I, 2, M, R>(u45, u67);
        let d = comb::<I, 3, M, R>(q0, q1);
        for r in 0..R {
            for i in 0..M {
                let mut dv = d[r][i];
                if F::HALVES && F::BIAS > 0 {
                    // -BIAS Σ_h sc_h H_h per group: i16 scale and half-sum pairs.
                    let c = I::madd16(
                        I::load(sc[r].as_ptr() as *const u8),
                        I::load((x[i].h as *const u8).add(4 * CHAINS * ch)),
                    );
                    dv = I::sub(dv, c.shl(F::BIAS.trailing_zeros()));
                } else if F::OFF > 0 && (VNNI || !F::SIGNED) {
                    dv = I::sub(dv, I::load((x[i].s as *const u8).add(4 * CHAINS * ch)).shl(F::OFF));
                }
                let xs = I::F::load(x[i].xs.add(CHAINS * ch));
                let mut v = I::F::fma(dv.cvt(), I::F::mul(a[r], xs), acc[r][i]);
                if F::MINS {
                    let y = if F::HALF_MINS {
                        let hm = I::load(sc[r].as_ptr().add(32) as *const u8);
                        I::F::mul(I::madd16(hm, I::load((x[i].h as *const u8).add(4 * CHAINS * ch))).cvt(), xs)
                    } else {
                        I::F::load(x[i].ys.add(CHAINS * ch))
                    };
                    v = I::F::fma(mn[r].neg(), y, v);
                }
                // A short last chunk leaves the chains it has no group for untouched (adding
                // fma(0, 0, acc) would be exact too, as no chain can hold -0.0 after the 2^-100
                // flush; the blend does not rely on that).
                acc[r][i] = if gn == CHAINS { v } else { I::F::keep_first(gn, v, acc[r][i]) };
            }
        }
    }
    let mut out = [[0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            out[r][i] = acc[r][i].reduce();
        }
    }
    out
}

/// All weight rows of `job` against activation rows `i..i + M`, `R` weight rows at a time.
#[inline(always)]
unsafe fn direct_m<I: I32x16, F: FF, const VNNI: bool, const R: usize, const M: usize>(job: &FJob<'_>, i: usize) {
    let mut x = [ActRow::of(job.act, job.i0 + i); M];
    for t in 0..M {
        x[t] = ActRow::of(job.act, job.i0 + i + t);
    }
    let ng = job.act.ng;
    let mut j = 0;
    while j + R <= job.n {
        let res = rows_direct::<I, F, VNNI, R, M>(job.w.add(j * job.row_bytes), job.row_bytes, &x, ng);
        for r in 0..R {
            for t in 0..M {
                *job.dst.add((i + t) * job.ld + j + r) = res[r][t];
            }
        }
        j += R;
    }
    while j < job.n {
        let res = rows_direct::<I, F, VNNI, 1, M>(job.w.add(j * job.row_bytes), job.row_bytes, &x, ng);
        for t in 0..M {
            *job.dst.add((i + t) * job.ld + j) = res[0][t];
        }
        j += 1;
    }
}

/// Direct path on zmm: up to 4 activation rows per pass, 4 weight rows when there is one.
#[inline(always)]
unsafe fn direct_z<F: FF, const VNNI: bool>(job: &FJob<'_>) {
    let mut i = 0;
    while i < job.m {
        let mm = (job.m - i).min(4);
        match mm {
            1 => direct_m::<Avx512i, F, VNNI, 4, 1>(job, i),
            2 => direct_m::<Avx512i, F, VNNI, 2, 2>(job, i),
            3 => direct_m::<Avx512i, F, VNNI, 1, 3>(job, i),
            _ => direct_m::<Avx512i, F, VNNI, 1, 4>(job, i),
        }
        i += mm;
    }
}

/// Direct path on ymm pairs (16 registers): two rows of one kind or the other per pass.
#[inline(always)]
unsafe fn direct_y<F: FF, const VNNI: bool>(job: &FJob<'_>) {
    let mut i = 0;
    while i < job.m {
        let mm = (job.m - i).min(2);
        match mm {
            1 => direct_m::<Avx2x2i, F, VNNI, 2, 1>(job, i),
            _ => direct_m::<Avx2x2i, F, VNNI, 1, 2>(job, i),
        }
        i += mm;
    }
}

/// Output rows per packed panel (one i32 / f32 lane each).
pub(super) const PANEL: usize = 16;

/// Byte offsets inside one packed group record of a panel: 8 quads of `PANEL` rows x 4
/// signed weight bytes, then `A` (f32), the VNNI start value `-128 Σ w` (i32; Q6_K: one per
/// half), `-M` (f32, formats with mins) and Q6_K's two i32 half scales.
struct Rec;
impl Rec {
    const A: usize = 8 * 4 * PANEL;
    const CORR: usize = Self::A + 4 * PANEL;
    const CORR_B: usize = Self::CORR + 4 * PANEL;
    /// After the first correction: `-M` (mins) or the second one (Q6_K).
    const M: usize = Self::CORR_B;
    const SC_A: usize = Self::CORR_B + 4 * PANEL;
    const SC_B: usize = Self::SC_A + 4 * PANEL;
    fn bytes<F: FF>() -> usize {
        if F::HALVES {
            Self::SC_B + 4 * PANEL
        } else if F::MINS {
            Self::M + 4 * PANEL
        } else {
            Self::CORR_B
        }
    }
}

/// Chain-major position of the first group of each chain (and the total, at index 16).
fn chain_starts(ng: usize) -> [usize; CHAINS + 1] {
    let mut st = [0; CHAINS + 1];
    for c in 0..CHAINS {
        st[c + 1] = st[c] + (ng + CHAINS - 1 - c) / CHAINS;
    }
    st
}

/// Packs `rows` (at most `PANEL`) weight rows at `w` into `panel` (`ng` records of
/// `Rec::bytes::<F>()`, chain-major; rows past `rows` are zero).
#[inline(always)]
unsafe fn pack<V: F32x16Bytes, F: FF>(w: *const u8, row_bytes: usize, rows: usize, ng: usize, panel: *mut u8) {
    let rec = Rec::bytes::<F>();
    let st = chain_starts(ng);
    if rows < PANEL {
        ptr::write_bytes(panel, 0, ng * rec);
    }
    let mut sc = [0i16; 64];
    let bias = _mm256_set1_epi8(F::BIAS);
    let flip = _mm256_set1_epi8(-128);
    // Chunk by chunk, all rows: the 16 records a chunk writes stay in L1.
    for ch in 0..ng.div_ceil(CHAINS) {
        let gn = (ng - CHAINS * ch).min(CHAINS);
        for r in 0..rows {
            let p = w.add(r * row_bytes);
            let (a, mn) = F::header::<V>(p, ch, gn, &mut sc);
            let (mut av, mut mv) = ([0f32; CHAINS], [0f32; CHAINS]);
            a.store(av.as_mut_ptr());
            mn.neg().store(mv.as_mut_ptr());
            for u in 0..gn.div_ceil(2) {
                let (lo, hi) = F::unit::<V>(p, CHAINS / 2 * ch + u, 2 * u + 1 < gn);
                for (h, v) in [(0, lo), (1, hi)] {
                    let gl = 2 * u + h;
                    if gl >= gn {
                        break;
                    }
                    let g = CHAINS * ch + gl;
                    let ws = _mm256_sub_epi8(v, bias);
                    let rp = panel.add((st[g % CHAINS] + g / CHAINS) * rec);
                    let mut q = [0u32; 8];
                    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ws);
                    for t in 0..8 {
                        ptr::write_unaligned(rp.add(16 * 4 * t + 4 * r) as *mut u32, q[t]);
                    }
                    // Σ w per 8 bytes: Σ (w + 128) - 1024.
                    let sad = _mm256_sad_epu8(_mm256_xor_si256(ws, flip), _mm256_setzero_si256());
                    let mut s8 = [0i64; 4];
                    _mm256_storeu_si256(s8.as_mut_ptr() as *mut __m256i, sad);
                    let s8 = s8.map(|v| v as i32 - 1024);
                    ptr::write_unaligned(rp.add(Rec::A + 4 * r) as *mut f32, av[gl]);
                    if F::HALVES {
                        ptr::write_unaligned(rp.add(Rec::CORR + 4 * r) as *mut i32, -128 * (s8[0] + s8[1]));
                        ptr::write_unaligned(rp.add(Rec::CORR_B + 4 * r) as *mut i32, -128 * (s8[2] + s8[3]));
                        ptr::write_unaligned(rp.add(Rec::SC_A + 4 * r) as *mut i32, sc[2 * gl] as i32);
                        ptr::write_unaligned(rp.add(Rec::SC_B + 4 * r) as *mut i32, sc[2 * gl + 1] as i32);
                    } else {
                        let corr = -128 * (s8[0] + s8[1] + s8[2] + s8[3]);
                        ptr::write_unaligned(rp.add(Rec::CORR + 4 * r) as *mut i32, corr);
                        if F::MINS {
                            ptr::write_unaligned(rp.add(Rec::M + 4 * r) as *mut f32, mv[gl]);
                        }
                    }
                }
            }
        }
    }
}

/// Transposes 16 rows of 8 dwords (row `r` at `src + r * stride`) into 8 vectors of 16
/// (vector `t` = dword `t` of every row), stored 64 bytes apart from `dst`.
#[inline(always)]
unsafe fn transpose16x8(src: *const u8, stride: usize, dst: *mut u8) {
    // r[i] = [row i | row i + 8]: two independent 8x8 transposes, one per 256-bit half.
    let mut r = [_mm512_setzero_si512(); 8];
    for i in 0..8 {
        r[i] = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(load32(src.add(i * stride))),
            load32(src.add((i + 8) * stride)),
        );
    }
    let mut t = [_mm512_setzero_si512(); 8];
    for i in 0..4 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[d] (d < 4): rows 0-3 (4-7 for u[4 + d]) of dword d in 128-bit lane 0, of dword d + 4
    // in lane 1; lanes 2 and 3 the same for rows 8-11 (12-15).
    let mut u = [_mm512_setzero_si512(); 8];
    for h in 0..2 {
        let (a, b, c, d) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
        u[4 * h] = _mm512_unpacklo_epi64(a, c);
        u[4 * h + 1] = _mm512_unpackhi_epi64(a, c);
        u[4 * h + 2] = _mm512_unpacklo_epi64(b, d);
        u[4 * h + 3] = _mm512_unpackhi_epi64(b, d);
    }
    let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for d in 0..4 {
        _mm512_storeu_si512(dst.add(64 * d) as *mut _, _mm512_permutex2var_epi64(u[d], lo, u[4 + d]));
        _mm512_storeu_si512(dst.add(64 * (d + 4)) as *mut _, _mm512_permutex2var_epi64(u[d], hi, u[4 + d]));
    }
}

/// `-128 v` per lane.
#[inline(always)]
unsafe fn neg128(v: __m512i) -> __m512i {
    _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(v))
}

/// [`pack`] on AVX-512: per chunk, every row's signed bytes go to an L1 buffer first, then
/// each group's 16 rows are transposed into its quads at once; the VNNI start values come
/// from the transposed quads. (The scalar-scatter `pack` spends most of its time on 8
/// separate dword stores per row and group.)
#[inline(always)]
unsafe fn pack_z<F: FF, const VNNI: bool>(w: *const u8, row_bytes: usize, rows: usize, ng: usize, panel: *mut u8) {
    let rec = Rec::bytes::<F>();
    let st = chain_starts(ng);
    let mut buf = [[0u8; CHAINS * GROUP]; PANEL];
    let (mut av, mut mv) = ([[0f32; CHAINS]; PANEL], [[0f32; CHAINS]; PANEL]);
    let mut sc = [[0i16; 64]; PANEL];
    let bias = _mm256_set1_epi8(F::BIAS);
    for ch in 0..ng.div_ceil(CHAINS) {
        let gn = (ng - CHAINS * ch).min(CHAINS);
        for r in 0..PANEL {
            if r >= rows {
                // Missing rows multiply as zeros (their outputs are dropped).
                buf[r].fill(0);
                av[r].fill(0.0);
                mv[r].fill(0.0);
                sc[r].fill(0);
                continue;
            }
            let p = w.add(r * row_bytes);
            let (a, mn) = F::header::<Avx512>(p, ch, gn, &mut sc[r]);
            a.store(av[r].as_mut_ptr());
            mn.neg().store(mv[r].as_mut_ptr());
            for u in 0..gn.div_ceil(2) {
                let (lo, hi) = F::unit::<Avx512>(p, CHAINS / 2 * ch + u, 2 * u + 1 < gn);
                let b = buf[r].as_mut_ptr().add(2 * u * GROUP);
                _mm256_storeu_si256(b as *mut __m256i, _mm256_sub_epi8(lo, bias));
                _mm256_storeu_si256(b.add(GROUP) as *mut __m256i, _mm256_sub_epi8(hi, bias));
            }
        }
        for gl in 0..gn {
            let g = CHAINS * ch + gl;
            let rp = panel.add((st[g % CHAINS] + g / CHAINS) * rec);
            transpose16x8(buf[0].as_ptr().add(gl * GROUP), CHAINS * GROUP, rp);
            for r in 0..PANEL {
                ptr::write_unaligned(rp.add(Rec::A + 4 * r) as *mut f32, av[r][gl]);
            }
            if F::HALVES {
                for r in 0..PANEL {
                    ptr::write_unaligned(rp.add(Rec::SC_A + 4 * r) as *mut i32, sc[r][2 * gl] as i32);
                    ptr::write_unaligned(rp.add(Rec::SC_B + 4 * r) as *mut i32, sc[r][2 * gl + 1] as i32);
                }
            } else if F::MINS {
                for r in 0..PANEL {
                    ptr::write_unaligned(rp.add(Rec::M + 4 * r) as *mut f32, mv[r][gl]);
                }
            }
            if VNNI {
                // -128 Σ w per row (per half for Q6_K): byte sums of the quads.
                let ones = _mm512_set1_epi8(1);
                let mut s = [_mm512_setzero_si512(); 2];
                for t in 0..8 {
                    let q = _mm512_loadu_si512(rp.add(64 * t) as *const _);
                    s[t / 4] = _mm512_dpbusd_epi32(s[t / 4], ones, q);
                }
                if F::HALVES {
                    _mm512_storeu_si512(rp.add(Rec::CORR) as *mut _, neg128(s[0]));
                    _mm512_storeu_si512(rp.add(Rec::CORR_B) as *mut _, neg128(s[1]));
                } else {
                    _mm512_storeu_si512(rp.add(Rec::CORR) as *mut _, neg128(_mm512_add_epi32(s[0], s[1])));
                }
            }
        }
    }
}

/// One activation row of the chain-major copy.
#[derive(Clone, Copy)]
struct ChainRow {
    q: *const u8,
    xs: *const f32,
    ys: *const f32,
}

/// Activation rows per register tile of the GEMM.
const GEMM_MR_Z: usize = 8;
const GEMM_MR_Y: usize = 2;

/// The integer accumulator's start: `-128 Σ w` (stored at `off` of the record) with VNNI,
/// whose activations carry +128, else zero.
#[inline(always)]
unsafe fn start<I: I32x16, const VNNI: bool>(rp: *const u8, off: usize) -> I {
    if VNNI {
        I::load(rp.add(off))
    } else {
        I::zero()
    }
}

/// Quads `t0..t0 + 4` of the record at `rp` (chain-major position `pos`) into `d`.
#[inline(always)]
unsafe fn quads<I: I32x16, const VNNI: bool, const MR: usize>(
    d: &mut [I; MR],
    rp: *const u8,
    x: &[ChainRow; MR],
    pos: usize,
    t0: usize,
) {
    for t in t0..t0 + 4 {
        let w = I::load(rp.add(4 * PANEL * t));
        let aw = if VNNI { w } else { w.abs8() };
        for i in 0..MR {
            d[i] = I::dpw::<VNNI>(d[i], w, aw, I::bcast32(x[i].q.add(GROUP * pos + 4 * t)));
        }
    }
}

/// Chain `c`'s records `p0..p1` of a packed panel against `MR` activation rows: the chain's
/// accumulator per row (lanes = the panel's output rows).
#[inline(always)]
unsafe fn gemm_chain<I: I32x16, F: FF, const VNNI: bool, const MR: usize>(
    panel: *const u8,
    (p0, p1): (usize, usize),
    x: &[ChainRow; MR],
) -> [I::F; MR] {
    let rec = Rec::bytes::<F>();
    let mut acc = [I::F::zero(); MR];
    for pos in p0..p1 {
        let rp = panel.add(pos * rec);
        let mut d = [start::<I, VNNI>(rp, Rec::CORR); MR];
        quads::<I, VNNI, MR>(&mut d, rp, x, pos, 0);
        if F::HALVES {
            let mut e = [start::<I, VNNI>(rp, Rec::CORR_B); MR];
            quads::<I, VNNI, MR>(&mut e, rp, x, pos, 4);
            let (sa, sb) = (I::load(rp.add(Rec::SC_A)), I::load(rp.add(Rec::SC_B)));
            for i in 0..MR {
                d[i] = I::add(I::mullo(d[i], sa), I::mullo(e[i], sb));
            }
        } else {
            quads::<I, VNNI, MR>(&mut d, rp, x, pos, 4);
        }
        let a = I::F::load(rp.add(Rec::A) as *const f32);
        for i in 0..MR {
            let s = I::F::mul(a, I::F::splat(*x[i].xs.add(pos)));
            acc[i] = I::F::fma(d[i].cvt(), s, acc[i]);
        }
        if F::MINS {
            let mn = I::F::load(rp.add(Rec::M) as *const f32);
            for i in 0..MR {
                acc[i] = I::F::fma(mn, I::F::splat(*x[i].ys.add(pos)), acc[i]);
            }
        }
    }
    acc
}

impl ChainRow {
    fn of(a: &QAct, i: usize) -> ChainRow {
        // SAFETY: row i exists (i < a.m), so the offsets stay inside the chain-major arrays.
        unsafe {
            ChainRow {
                q: a.cq.as_ptr().add(i * a.ng * GROUP),
                xs: a.cxs.as_ptr().add(i * a.ng),
                ys: a.cys.as_ptr().add(i * a.ng),
            }
        }
    }
}

/// One register tile: rows `ib..ib + MR` (of `mc`, from activation row `i0`) against chain
/// `c` of the panel, accumulators to `chains`. A short tile repeats its last row (results
/// discarded).
#[inline(always)]
unsafe fn chain_tile<I: I32x16, F: FF, const VNNI: bool, const MR: usize>(
    act: &QAct,
    i0: usize,
    (ib, mc): (usize, usize),
    panel: *const u8,
    range: (usize, usize),
    c: usize,
    chains: *mut f32,
) {
    let mut x = [ChainRow::of(act, i0 + ib); MR];
    for t in 0..MR {
        x[t] = ChainRow::of(act, i0 + (ib + t).min(mc - 1));
    }
    let acc = gemm_chain::<I, F, VNNI, MR>(panel, range, &x);
    for t in 0..MR.min(mc - ib) {
        acc[t].store(chains.add(((ib + t) * CHAINS + c) * PANEL));
    }
}

/// Activation rows whose chain accumulators are kept per packed panel (their chain-major
/// values stay in L2 while each chain's weights, 1/16 of the panel, stay in L1).
pub(super) const GEMM_IC: usize = 128;

/// Tiled path: `PANEL` weight rows packed once (into `panel`), then every activation row of
/// the job, chain by chain, `MR` rows per register tile; `chains` holds `GEMM_IC` rows'
/// chain accumulators until the canonical tree sums them.
#[inline(always)]
unsafe fn tiled<I: PanelPack, F: FF, const VNNI: bool, const MR: usize>(
    job: &FJob<'_>,
    panel: *mut u8,
    chains: *mut f32,
) {
    let act = job.act;
    let ng = act.ng;
    let st = chain_starts(ng);
    let mut j0 = 0;
    while j0 < job.n {
        let rows = (job.n - j0).min(PANEL);
        I::pack::<F, VNNI>(job.w.add(j0 * job.row_bytes), job.row_bytes, rows, ng, panel);
        let mut ic = 0;
        while ic < job.m {
            let mc = (job.m - ic).min(GEMM_IC);
            for c in 0..CHAINS {
                let mut ib = 0;
                while ib < mc {
                    if MR > 4 && mc - ib <= 4 {
                        chain_tile::<I, F, VNNI, 4>(act, job.i0 + ic, (ib, mc), panel, (st[c], st[c + 1]), c, chains);
                        ib += 4;
                    } else {
                        chain_tile::<I, F, VNNI, MR>(act, job.i0 + ic, (ib, mc), panel, (st[c], st[c + 1]), c, chains);
                        ib += MR;
                    }
                }
            }
            for t in 0..mc {
                let ch = chains.add(t * CHAINS * PANEL);
                let mut s8 = [I::F::zero(); 8];
                for l in 0..8 {
                    s8[l] = I::F::add(I::F::load(ch.add(l * PANEL)), I::F::load(ch.add((l + 8) * PANEL)));
                }
                let mut s4 = [I::F::zero(); 4];
                for l in 0..4 {
                    s4[l] = I::F::add(s8[l], s8[l + 4]);
                }
                let y = I::F::add(I::F::add(s4[0], s4[2]), I::F::add(s4[1], s4[3]));
                let dst = job.dst.add((ic + t) * job.ld + j0);
                if rows == PANEL {
                    y.store(dst);
                } else {
                    let mut v = [0f32; PANEL];
                    y.store(v.as_mut_ptr());
                    ptr::copy_nonoverlapping(v.as_ptr(), dst, rows);
                }
            }
            ic += mc;
        }
        j0 += PANEL;
    }
}

thread_local! {
    /// Per-thread packed panel and chain accumulators of the tiled path, reused.
    static GEMM: std::cell::RefCell<(Vec<u64>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with `panel_bytes` of panel and `chain_f32s` of chain scratch (fresh memory if
/// this thread's is in use).
fn with_gemm_scratch<T>(panel_bytes: usize, chain_f32s: usize, f: impl FnOnce(*mut u8, *mut f32) -> T) -> T {
    let run = |(p, c): &mut (Vec<u64>, Vec<f32>)| {
        // 64-byte aligned records: every weight and scale load is one cache line.
        if p.len() * 8 < panel_bytes + 64 {
            p.resize((panel_bytes + 64).div_ceil(8), 0);
        }
        if c.len() < chain_f32s + 16 {
            c.resize(chain_f32s + 16, 0.0);
        }
        let (pp, cp) = (p.as_mut_ptr() as *mut u8, c.as_mut_ptr());
        // SAFETY: the offsets are below 64 bytes, inside the 64 bytes of slack reserved above.
        unsafe { f(pp.add(pp.align_offset(64)), cp.add(cp.align_offset(64))) }
    };
    GEMM.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => run(&mut s),
        Err(_) => run(&mut (Vec::new(), Vec::new())),
    })
}

macro_rules! entry_points {
    ($name:ident, $tiled:ident, $i:ty, $mr:expr, $body:ident, $vnni:literal, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<F: FF>(job: &FJob<'_>) {
            $body::<F, $vnni>(job)
        }

        #[target_feature(enable = $features)]
        unsafe fn $tiled<F: FF>(job: &FJob<'_>, panel: *mut u8, chains: *mut f32) {
            tiled::<$i, F, $vnni, { $mr }>(job, panel, chains)
        }
    };
}

entry_points!(
    direct_z_vnni,
    tiled_z_vnni,
    Avx512i,
    GEMM_MR_Z,
    direct_z,
    true,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
);
entry_points!(
    direct_z_plain,
    tiled_z_plain,
    Avx512i,
    GEMM_MR_Z,
    direct_z,
    false,
    "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
);
entry_points!(direct_y_vnni, tiled_y_vnni, Avx2x2i, GEMM_MR_Y, direct_y, true, "avx2,fma,f16c,avxvnni");
entry_points!(direct_y_plain, tiled_y_plain, Avx2x2i, GEMM_MR_Y, direct_y, false, "avx2,fma,f16c");

/// Which of the four instantiations runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Level {
    pub avx512: bool,
    pub vnni: bool,
}

/// `entry::<F>(args)` with `F` the block type of `dtype` and `entry` the one of the four
/// instantiations (AVX-512 or AVX2, with or without VNNI) that `level` names.
/// (`@packed` first: only the formats with a packed-panel layout.)
macro_rules! by_level {
    ($(@$packed:ident)? $level:expr, $dtype:expr, [$zv:ident, $zp:ident, $yv:ident, $yp:ident]($($arg:expr),*)) => {{
        use $crate::gemm::gguf::with_block;
        match ($level.avx512, $level.vnni) {
            (true, true) => with_block!($($packed:)? $dtype, F => $zv::<F>($($arg),*), _ => not_a_block()),
            (true, false) => with_block!($($packed:)? $dtype, F => $zp::<F>($($arg),*), _ => not_a_block()),
            (false, true) => with_block!($($packed:)? $dtype, F => $yv::<F>($($arg),*), _ => not_a_block()),
            (false, false) => with_block!($($packed:)? $dtype, F => $yp::<F>($($arg),*), _ => not_a_block()),
        }
    }};
}
pub(super) use by_level;

/// The `dtype` of a quantized kernel call is a block format (checked by `matmul_quant`).
#[cold]
pub(super) fn not_a_block() -> ! {
    unreachable!("checked by matmul_quant")
}

/// Raw Fast dot products for `job` (direct path).
///
/// # Safety
/// The CPU supports `level` (checked by the caller through `isa`), `job` describes valid
/// memory: `n` rows of `row_bytes` bytes of `dtype` blocks of `act.k` values, activation rows
/// `i0..i0 + m` of `act`, and a writable `dst`.
pub(super) unsafe fn dots_direct(level: Level, dtype: DType, job: &FJob<'_>) {
    by_level!(level, dtype, [direct_z_vnni, direct_z_plain, direct_y_vnni, direct_y_plain](job))
}

/// Raw Fast dot products for `job` on the tiled path (packed panels); the activations must
/// have their chain-major copy, biased exactly when `level.vnni`.
///
/// # Safety
/// As [`dots_direct`].
pub(super) unsafe fn dots_tiled(level: Level, dtype: DType, job: &FJob<'_>) {
    if dtype == DType::Q2K {
        // Its per-half mins have no place in the panel records: the direct walk, any `m`.
        return dots_direct(level, dtype, job);
    }
    macro_rules! go {
        ($f:ident) => {{
            fn bytes<F: FF>() -> usize {
                Rec::bytes::<F>()
            }
            let rec = with_block!(dtype, F => bytes::<F>(), _ => unreachable!("checked by matmul_quant"));
            with_gemm_scratch(job.act.ng * rec, GEMM_IC * CHAINS * PANEL, |panel, chains| {
                with_block!(dtype, F => $f::<F>(job, panel, chains), _ => unreachable!("checked by matmul_quant"))
            })
        }};
    }
    match (level.avx512, level.vnni) {
        (true, true) => go!(tiled_z_vnni),
        (true, false) => go!(tiled_z_plain),
        (false, true) => go!(tiled_y_vnni),
        (false, false) => go!(tiled_y_plain),
    }
}

/// [`super::q8_activations::GroupQuantizer`] on AVX-512: the scalar quantization's exact results.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ available; `x` readable for 32 f32, `q` writable for 32 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn quantize_group_avx512(x: *const f32, q: *mut i8) -> (f32, [i32; 2]) {
    let a = _mm512_loadu_ps(x);
    let b = _mm512_loadu_ps(x.add(16));
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    // |x| bit patterns order like the values (and NaN above infinity).
    let mx =
        _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(a), abs), _mm512_and_si512(_mm512_castps_si512(b), abs));
    let bits = _mm512_reduce_max_epu32(mx);
    let amax = f32::from_bits(bits);
    if bits >= 0x7F80_0000 || amax < super::q8_activations::TINY {
        ptr::write_bytes(q, 0, GROUP);
        return (if bits >= 0x7F80_0000 { f32::NAN } else { 0.0 }, [0, 0]);
    }
    let inv = _mm512_set1_ps(127.0 / amax);
    let qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    let qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(q as *mut __m128i, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(qb));
    (amax / 127.0, [_mm512_reduce_add_epi32(qa), _mm512_reduce_add_epi32(qb)])
}

#[inline(always)]
unsafe fn hsum_i32x8(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
}

/// [`super::q8_activations::GroupQuantizer`] on AVX2.
///
/// # Safety
/// AVX2 available; `x` readable for 32 f32, `q` writable for 32 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_group_avx2(x: *const f32, q: *mut i8) -> (f32, [i32; 2]) {
    let v = [_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(x.add(16)), _mm256_loadu_ps(x.add(24))];
    let abs = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut a = [_mm256_setzero_si256(); 4];
    for t in 0..4 {
        a[t] = _mm256_and_si256(_mm256_castps_si256(v[t]), abs);
    }
    let mx = _mm256_max_epu32(_mm256_max_epu32(a[0], a[1]), _mm256_max_epu32(a[2], a[3]));
    let m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256::<1>(mx));
    let m2 = _mm_max_epu32(m4, _mm_unpackhi_epi64(m4, m4));
    let bits = _mm_cvtsi128_si32(_mm_max_epu32(m2, _mm_shuffle_epi32::<1>(m2))) as u32;
    let amax = f32::from_bits(bits);
    if bits >= 0x7F80_0000 || amax < super::q8_activations::TINY {
        ptr::write_bytes(q, 0, GROUP);
        return (if bits >= 0x7F80_0000 { f32::NAN } else { 0.0 }, [0, 0]);
    }
    let inv = _mm256_set1_ps(127.0 / amax);
    let mut i = [_mm256_setzero_si256(); 4];
    for t in 0..4 {
        i[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
    }
    let h0 = hsum_i32x8(_mm256_add_epi32(i[0], i[1]));
    let h1 = hsum_i32x8(_mm256_add_epi32(i[2], i[3]));
    // packs work per 128-bit half: 0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31, then fix.
    let p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, p);
    (amax / 127.0, [h0, h1])
}
