//! AVX-512 (F/BW/VL, DQ where the entry point enables it): [`Avx512`], one zmm, which is
//! both the native width and the canonical 16 lanes.

use std::arch::x86_64::*;
use std::ptr;

use super::{Avx2, F32x16, F32x16Bytes, I32x16, Native, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};

/// AVX-512 F/BW/VL/DQ: one zmm, both the native and the canonical 16 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx512(pub(crate) __m512);

impl Native for Avx512 {
    const LANES: usize = 16;
    // Six queries: 24 score accumulators and 4 K vectors of 32 registers, 10 loads per 24
    // FMAs (four: 8 per 16).
    const QUERY_GROUP: usize = 6;
    type V = __m512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        _mm512_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m512) -> f32 {
        // The high half through the 64-bit extract (AVX512F alone: the quantized kernels'
        // entry points do not enable AVX512DQ); the same bits as `_mm512_extractf32x8_ps`.
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        Avx2::reduce_add(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m512) -> f32 {
        let h = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        Avx2::reduce_max(h)
    }
    #[inline(always)]
    unsafe fn exp_neg(x: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_LO));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_setzero_ps());
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(LOG2E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut y = _mm512_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
        }
        let y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(pow2)))
    }
    #[inline(always)]
    unsafe fn transpose(rows: *const *const f32, col: usize, dst: *mut f32, dst_stride: usize) {
        let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps((*rows.add(i)).add(col)));
        // u[4i + k] lane l (128 bits) holds column 4l + k of rows 4i..4i+4.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        let u: [__m512; 16] = std::array::from_fn(|n| {
            let (i, k) = (n / 4, n % 4);
            let (a, b) = (_mm512_castps_pd(t[4 * i + k / 2]), _mm512_castps_pd(t[4 * i + 2 + k / 2]));
            _mm512_castpd_ps(if k % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
        });
        // Gather lane l of u[k], u[4+k], u[8+k], u[12+k] into column 4l + k.
        for k in 0..4 {
            let v0 = _mm512_shuffle_f32x4::<0x88>(u[k], u[4 + k]);
            let v1 = _mm512_shuffle_f32x4::<0xDD>(u[k], u[4 + k]);
            let w0 = _mm512_shuffle_f32x4::<0x88>(u[8 + k], u[12 + k]);
            let w1 = _mm512_shuffle_f32x4::<0xDD>(u[8 + k], u[12 + k]);
            _mm512_storeu_ps(dst.add(k * dst_stride), _mm512_shuffle_f32x4::<0x88>(v0, w0));
            _mm512_storeu_ps(dst.add((8 + k) * dst_stride), _mm512_shuffle_f32x4::<0xDD>(v0, w0));
            _mm512_storeu_ps(dst.add((4 + k) * dst_stride), _mm512_shuffle_f32x4::<0x88>(v1, w1));
            _mm512_storeu_ps(dst.add((12 + k) * dst_stride), _mm512_shuffle_f32x4::<0xDD>(v1, w1));
        }
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let h = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
            _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
            i += 16;
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let h = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
            let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
            _mm512_storeu_ps(dst.add(i), _mm512_castsi512_ps(w));
            i += 16;
        }
    }
}

impl F32x16 for Avx512 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx512(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx512(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        let h = _mm256_loadu_si256(p as *const __m256i);
        Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self {
        Avx512(_mm512_fmadd_ps(a.0, b.0, acc.0))
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Avx512(_mm512_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx512(_mm512_add_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx512(_mm512_mul_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx512(_mm512_sub_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }
    #[inline(always)]
    unsafe fn reduce(self) -> f32 {
        <Avx512 as Native>::reduce_add(self.0)
    }
}

impl F32x16Bytes for Avx512 {
    #[inline(always)]
    unsafe fn splat_f16(p: *const u8) -> Self {
        Avx512(_mm512_cvtph_ps(_mm256_set1_epi16(ptr::read_unaligned(p as *const i16))))
    }
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // v, l1, l2 and l3 are indexed by level position
    unsafe fn hsum16x(p: *const f32) -> [f32; 16] {
        // The four levels of the tree on 16 vectors at once: each level adds the same pairs of
        // lanes as `reduce`, packing two (then four, eight, sixteen) vectors' partial sums into one.
        let mut v = [_mm512_setzero_ps(); 16];
        for t in 0..16 {
            v[t] = _mm512_loadu_ps(p.add(16 * t));
        }
        let mut l1 = [_mm512_setzero_ps(); 8];
        for t in 0..8 {
            // [a0..8 + a8..16 | b0..8 + b8..16]
            let (a, b) = (v[2 * t], v[2 * t + 1]);
            l1[t] = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b));
        }
        let mut l2 = [_mm512_setzero_ps(); 4];
        for t in 0..4 {
            // [a4 | b4 | c4 | d4]: lanes l and l+4 of each 8-lane half.
            let (a, b) = (l1[2 * t], l1[2 * t + 1]);
            l2[t] = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b));
        }
        let mut l3 = [_mm512_setzero_ps(); 2];
        for t in 0..2 {
            // Per 128-bit lane: lanes l and l+2.
            let (a, b) = (l2[2 * t], l2[2 * t + 1]);
            l3[t] = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b));
        }
        let s = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(l3[0], l3[1]), _mm512_shuffle_ps::<0xDD>(l3[0], l3[1]));
        // Element 4j + t holds vector 4t + j.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(order, s));
        out
    }
    #[inline(always)]
    unsafe fn from_i8x32(v: __m256i) -> (Self, Self) {
        let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(v)));
        (Avx512(lo), Avx512(hi))
    }
    #[inline(always)]
    unsafe fn bits_to_bytes(bits: u32) -> __m256i {
        _mm256_movm_epi8(bits)
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        Avx512(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(self.0), _mm512_set1_epi32(i32::MIN))))
    }
    #[inline(always)]
    unsafe fn from_u8x16(p: *const u8) -> Self {
        Avx512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))))
    }
    #[inline(always)]
    unsafe fn halves(a: f32, b: f32) -> Self {
        Avx512(_mm512_insertf32x8::<1>(_mm512_set1_ps(a), _mm256_set1_ps(b)))
    }
    #[inline(always)]
    unsafe fn keep_first(n: usize, new: Self, old: Self) -> Self {
        Avx512(_mm512_mask_blend_ps(((1u32 << n) - 1) as u16, old.0, new.0))
    }
}

/// One zmm as 16 i32 lanes (the integer twin of [`Avx512`]).
#[derive(Clone, Copy)]
pub(crate) struct Avx512i(pub(crate) __m512i);

impl I32x16 for Avx512i {
    type F = Avx512;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx512i(_mm512_setzero_si512())
    }
    #[inline(always)]
    unsafe fn from2(a: __m256i, b: __m256i) -> Self {
        Avx512i(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b))
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Avx512i(_mm512_loadu_si512(p as *const _))
    }
    #[inline(always)]
    unsafe fn xor80(self) -> Self {
        Avx512i(_mm512_xor_si512(self.0, _mm512_set1_epi8(-128)))
    }
    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(acc: Self, w: Self, x: Self) -> Self {
        if VNNI {
            Avx512i(_mm512_dpbusd_epi32(acc.0, w.0, x.0))
        } else {
            let p = _mm512_madd_epi16(_mm512_maddubs_epi16(w.0, x.0), _mm512_set1_epi16(1));
            Avx512i(_mm512_add_epi32(acc.0, p))
        }
    }
    #[inline(always)]
    unsafe fn dot_ss(acc: Self, w: Self, x: Self) -> Self {
        let neg = _mm512_movepi8_mask(w.0);
        let xs = _mm512_mask_sub_epi8(x.0, neg, _mm512_setzero_si512(), x.0);
        let p = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w.0), xs), _mm512_set1_epi16(1));
        Avx512i(_mm512_add_epi32(acc.0, p))
    }
    #[inline(always)]
    unsafe fn dot_sc<const VNNI: bool>(acc: Self, w: Self, x: Self, sc: Self) -> Self {
        let p = _mm512_maddubs_epi16(w.0, x.0);
        if VNNI {
            Avx512i(_mm512_dpwssd_epi32(acc.0, p, sc.0))
        } else {
            Avx512i(_mm512_add_epi32(acc.0, _mm512_madd_epi16(p, sc.0)))
        }
    }
    #[inline(always)]
    unsafe fn comb1(a: Self, b: Self) -> Self {
        // Lane q < 8: a[2q] + a[2q+1]; q >= 8: b[2q-16] + b[2q-15].
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        Avx512i(_mm512_add_epi32(_mm512_permutex2var_epi32(a.0, even, b.0), _mm512_permutex2var_epi32(a.0, odd, b.0)))
    }
    #[inline(always)]
    unsafe fn comb2(a: Self, b: Self) -> Self {
        Self::comb1(a, b)
    }
    #[inline(always)]
    unsafe fn comb3(a: Self, b: Self) -> Self {
        Self::comb1(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx512i(_mm512_sub_epi32(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn shl(self, n: u32) -> Self {
        Avx512i(_mm512_sll_epi32(self.0, _mm_cvtsi32_si128(n as i32)))
    }
    #[inline(always)]
    unsafe fn madd16(a: Self, b: Self) -> Self {
        Avx512i(_mm512_madd_epi16(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn ubs(w: Self, x: Self) -> Self {
        Avx512i(_mm512_maddubs_epi16(w.0, x.0))
    }
    #[inline(always)]
    unsafe fn add16(a: Self, b: Self) -> Self {
        Avx512i(_mm512_add_epi16(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn widen16(self) -> Self {
        Avx512i(_mm512_madd_epi16(self.0, _mm512_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn sc_unit(p: *const i16) -> Self {
        let v = _mm512_castsi128_si512(_mm_loadl_epi64(p as *const __m128i));
        let idx = _mm512_set_epi16(
            3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
        );
        Avx512i(_mm512_permutexvar_epi16(idx, v))
    }
    #[inline(always)]
    unsafe fn cvt(self) -> Avx512 {
        Avx512(_mm512_cvtepi32_ps(self.0))
    }
    #[inline(always)]
    unsafe fn bcast32(p: *const u8) -> Self {
        Avx512i(_mm512_set1_epi32(ptr::read_unaligned(p as *const i32)))
    }
    #[inline(always)]
    unsafe fn abs8(self) -> Self {
        Avx512i(_mm512_abs_epi8(self.0))
    }
    #[inline(always)]
    unsafe fn dpw<const VNNI: bool>(acc: Self, w: Self, aw: Self, x: Self) -> Self {
        if VNNI {
            Avx512i(_mm512_dpbusd_epi32(acc.0, x.0, w.0))
        } else {
            let xs = _mm512_mask_sub_epi8(x.0, _mm512_movepi8_mask(w.0), _mm512_setzero_si512(), x.0);
            let p = _mm512_madd_epi16(_mm512_maddubs_epi16(aw.0, xs), _mm512_set1_epi16(1));
            Avx512i(_mm512_add_epi32(acc.0, p))
        }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx512i(_mm512_add_epi32(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn mullo(a: Self, b: Self) -> Self {
        Avx512i(_mm512_mullo_epi32(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn nib_lo(self) -> Self {
        Avx512i(_mm512_and_si512(self.0, _mm512_set1_epi8(0x0F)))
    }
    #[inline(always)]
    unsafe fn nib_hi(self) -> Self {
        Avx512i(_mm512_and_si512(_mm512_srli_epi16::<4>(self.0), _mm512_set1_epi8(0x0F)))
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        Avx512i(_mm512_or_si512(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn and8(self, mask: i8) -> Self {
        Avx512i(_mm512_and_si512(self.0, _mm512_set1_epi8(mask)))
    }
    #[inline(always)]
    unsafe fn shift16(self, n: i32) -> Self {
        if n >= 0 {
            Avx512i(_mm512_sll_epi16(self.0, _mm_cvtsi32_si128(n)))
        } else {
            Avx512i(_mm512_srl_epi16(self.0, _mm_cvtsi32_si128(-n)))
        }
    }
    #[inline(always)]
    unsafe fn from_i8x16(p: *const u8) -> Self {
        Avx512i(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }
}
