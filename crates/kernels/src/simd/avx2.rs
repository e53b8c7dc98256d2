//! AVX2 + FMA + F16C: [`Avx2`] (one ymm, the native 8 lanes) and [`Avx2x2`] (two ymm as the
//! canonical 16 lanes).

use std::arch::x86_64::*;
use std::ptr;

use super::{F32x16, F32x16Bytes, I32x16, Native, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};

/// AVX2 + FMA + F16C, 8 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Native for Avx2 {
    const LANES: usize = 8;
    const QUERY_GROUP: usize = 2;
    type V = __m256;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        _mm256_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
    #[inline(always)]
    unsafe fn reduce_max(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
    #[inline(always)]
    unsafe fn exp_neg(x: __m256) -> __m256 {
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_LO));
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_setzero_ps());
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(LOG2E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(EXP_P[0]);
        for &c in &EXP_P[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2)), keep)
    }
    #[inline(always)]
    unsafe fn transpose(rows: *const *const f32, col: usize, dst: *mut f32, dst_stride: usize) {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps((*rows.add(i)).add(col)));
        // 32-bit then 64-bit interleaves: u[4i + k] lane l holds column 4l + k of rows 4i..4i+4.
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        let u: [__m256; 8] = std::array::from_fn(|n| {
            let (i, k) = (n / 4, n % 4);
            let (a, b) = (_mm256_castps_pd(t[4 * i + k / 2]), _mm256_castps_pd(t[4 * i + 2 + k / 2]));
            _mm256_castpd_ps(if k % 2 == 0 { _mm256_unpacklo_pd(a, b) } else { _mm256_unpackhi_pd(a, b) })
        });
        for k in 0..4 {
            _mm256_storeu_ps(dst.add(k * dst_stride), _mm256_permute2f128_ps::<0x20>(u[k], u[4 + k]));
            _mm256_storeu_ps(dst.add((4 + k) * dst_stride), _mm256_permute2f128_ps::<0x31>(u[k], u[4 + k]));
        }
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
            _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
            i += 8;
        }
    }
}

/// The canonical 16 lanes as two ymm: lanes 0..8 in `.0`, lanes 8..16 in `.1`.
#[derive(Clone, Copy)]
pub(crate) struct Avx2x2(pub(crate) __m256, pub(crate) __m256);

impl F32x16 for Avx2x2 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2x2(_mm256_setzero_ps(), _mm256_setzero_ps())
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx2x2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        Avx2x2(
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
        )
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        Avx2x2(bf16x8(p), bf16x8(p.add(16)))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0);
        _mm256_storeu_ps(p.add(8), self.1);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self {
        Avx2x2(_mm256_fmadd_ps(a.0, b.0, acc.0), _mm256_fmadd_ps(a.1, b.1, acc.1))
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Avx2x2(_mm256_set1_ps(v), _mm256_set1_ps(v))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx2x2(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx2x2(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx2x2(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn reduce(self) -> f32 {
        Avx2::reduce_add(_mm256_add_ps(self.0, self.1))
    }
    // A 3x2 tile of full 16-lane chains needs 12 ymm accumulators and 10 loads per 12
    // FMAs; half the chains of a 3x4 tile need the same 12 accumulators but 7 loads.
    const SPLIT: bool = true;
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // a[i][j] is indexed by both loops
    unsafe fn split_tile<const MR: usize, const NR: usize>(
        x: *const f32,
        xs: usize,
        w: &[*const f32; NR],
        steps: usize,
        acc: *mut Self,
        h: usize,
        first: bool,
    ) {
        let half = |v: Self| if h == 0 { v.0 } else { v.1 };
        let mut a = [[_mm256_setzero_ps(); NR]; MR];
        if !first {
            for i in 0..MR {
                for j in 0..NR {
                    a[i][j] = half(acc.add(i * NR + j).read());
                }
            }
        }
        for st in 0..steps {
            let c = st * 8;
            let mut xv = [_mm256_setzero_ps(); MR];
            for i in 0..MR {
                xv[i] = _mm256_loadu_ps(x.add(i * xs + c));
            }
            for j in 0..NR {
                let wv = _mm256_loadu_ps(w[j].add(c));
                for i in 0..MR {
                    a[i][j] = _mm256_fmadd_ps(xv[i], wv, a[i][j]);
                }
            }
        }
        for i in 0..MR {
            for j in 0..NR {
                let p = acc.add(i * NR + j);
                let v = if h == 0 {
                    Avx2x2(a[i][j], if first { _mm256_setzero_ps() } else { p.read().1 })
                } else {
                    Avx2x2(p.read().0, a[i][j])
                };
                p.write(v);
            }
        }
    }
}

impl F32x16Bytes for Avx2x2 {
    #[inline(always)]
    unsafe fn splat_f16(p: *const u8) -> Self {
        let v = _mm256_cvtph_ps(_mm_set1_epi16(ptr::read_unaligned(p as *const i16)));
        Avx2x2(v, v)
    }
    #[inline(always)]
    unsafe fn from_i8x32(v: __m256i) -> (Self, Self) {
        let a = _mm256_castsi256_si128(v);
        let b = _mm256_extracti128_si256::<1>(v);
        (Avx2x2(cvt8(a), cvt8(_mm_srli_si128::<8>(a))), Avx2x2(cvt8(b), cvt8(_mm_srli_si128::<8>(b))))
    }
    #[inline(always)]
    unsafe fn bits_to_bytes(bits: u32) -> __m256i {
        // Byte i takes byte i/8 of `bits`, then tests bit i%8 of it.
        let v = _mm256_set1_epi32(bits as i32);
        let pick = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, pick), sel), sel)
    }
    #[inline(always)]
    unsafe fn neg(self) -> Self {
        let m = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        Avx2x2(_mm256_xor_ps(self.0, m), _mm256_xor_ps(self.1, m))
    }
    #[inline(always)]
    unsafe fn from_u8x16(p: *const u8) -> Self {
        let v = _mm_loadu_si128(p as *const __m128i);
        Avx2x2(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))),
        )
    }
    #[inline(always)]
    unsafe fn halves(a: f32, b: f32) -> Self {
        Avx2x2(_mm256_set1_ps(a), _mm256_set1_ps(b))
    }
    #[inline(always)]
    unsafe fn keep_first(n: usize, new: Self, old: Self) -> Self {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx));
        let hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32 - 8), idx));
        Avx2x2(_mm256_blendv_ps(old.0, new.0, lo), _mm256_blendv_ps(old.1, new.1, hi))
    }
}

/// Two ymm as 16 i32 lanes (the integer twin of [`Avx2x2`]).
#[derive(Clone, Copy)]
pub(crate) struct Avx2x2i(__m256i, __m256i);

#[inline(always)]
unsafe fn dot_y<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_avx_epi32(acc, w, x)
    } else {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
    }
}

#[inline(always)]
unsafe fn dot_sc_y<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i, sc: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(w, x);
    if VNNI {
        _mm256_dpwssd_avx_epi32(acc, p, sc)
    } else {
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc))
    }
}

#[inline(always)]
unsafe fn dot_ss_y(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

#[inline(always)]
unsafe fn fold_halves(e0: __m256i, e1: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(e0, e1), _mm256_permute2x128_si256::<0x31>(e0, e1))
}

impl I32x16 for Avx2x2i {
    type F = Avx2x2;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2x2i(_mm256_setzero_si256(), _mm256_setzero_si256())
    }
    #[inline(always)]
    unsafe fn from2(a: __m256i, b: __m256i) -> Self {
        Avx2x2i(a, b)
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Avx2x2i(_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn xor80(self) -> Self {
        let m = _mm256_set1_epi8(-128);
        Avx2x2i(_mm256_xor_si256(self.0, m), _mm256_xor_si256(self.1, m))
    }
    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(acc: Self, w: Self, x: Self) -> Self {
        Avx2x2i(dot_y::<VNNI>(acc.0, w.0, x.0), dot_y::<VNNI>(acc.1, w.1, x.1))
    }
    #[inline(always)]
    unsafe fn dot_ss(acc: Self, w: Self, x: Self) -> Self {
        Avx2x2i(dot_ss_y(acc.0, w.0, x.0), dot_ss_y(acc.1, w.1, x.1))
    }
    #[inline(always)]
    unsafe fn dot_sc<const VNNI: bool>(acc: Self, w: Self, x: Self, sc: Self) -> Self {
        Avx2x2i(dot_sc_y::<VNNI>(acc.0, w.0, x.0, sc.0), dot_sc_y::<VNNI>(acc.1, w.1, x.1, sc.1))
    }
    #[inline(always)]
    unsafe fn comb1(a: Self, b: Self) -> Self {
        // Units hold one group per ymm; hadd keeps pair sums of the same group together.
        Avx2x2i(_mm256_hadd_epi32(a.0, a.1), _mm256_hadd_epi32(b.0, b.1))
    }
    #[inline(always)]
    unsafe fn comb2(a: Self, b: Self) -> Self {
        Self::comb1(a, b)
    }
    #[inline(always)]
    unsafe fn comb3(a: Self, b: Self) -> Self {
        // After two hadd levels each 128-bit half holds four groups' partial sums (low half:
        // lanes 0..4 of each group, high half: lanes 4..8); add the halves, groups in order.
        Avx2x2i(fold_halves(a.0, a.1), fold_halves(b.0, b.1))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_sub_epi32(a.0, b.0), _mm256_sub_epi32(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn shl(self, n: u32) -> Self {
        let c = _mm_cvtsi32_si128(n as i32);
        Avx2x2i(_mm256_sll_epi32(self.0, c), _mm256_sll_epi32(self.1, c))
    }
    #[inline(always)]
    unsafe fn madd16(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_madd_epi16(a.0, b.0), _mm256_madd_epi16(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn ubs(w: Self, x: Self) -> Self {
        Avx2x2i(_mm256_maddubs_epi16(w.0, x.0), _mm256_maddubs_epi16(w.1, x.1))
    }
    #[inline(always)]
    unsafe fn add16(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_add_epi16(a.0, b.0), _mm256_add_epi16(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn widen16(self) -> Self {
        let one = _mm256_set1_epi16(1);
        Avx2x2i(_mm256_madd_epi16(self.0, one), _mm256_madd_epi16(self.1, one))
    }
    #[inline(always)]
    unsafe fn sc_unit(p: *const i16) -> Self {
        let v = _mm256_broadcastq_epi64(_mm_loadl_epi64(p as *const __m128i));
        // Per 128-bit half: i16 number `s` in all 8 lanes (bytes 2s, 2s+1).
        let lo = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        );
        let hi = _mm256_setr_epi8(
            4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7,
        );
        Avx2x2i(_mm256_shuffle_epi8(v, lo), _mm256_shuffle_epi8(v, hi))
    }
    #[inline(always)]
    unsafe fn cvt(self) -> Avx2x2 {
        Avx2x2(_mm256_cvtepi32_ps(self.0), _mm256_cvtepi32_ps(self.1))
    }
    #[inline(always)]
    unsafe fn bcast32(p: *const u8) -> Self {
        let v = _mm256_set1_epi32(ptr::read_unaligned(p as *const i32));
        Avx2x2i(v, v)
    }
    #[inline(always)]
    unsafe fn abs8(self) -> Self {
        Avx2x2i(_mm256_abs_epi8(self.0), _mm256_abs_epi8(self.1))
    }
    #[inline(always)]
    unsafe fn dpw<const VNNI: bool>(acc: Self, w: Self, aw: Self, x: Self) -> Self {
        if VNNI {
            Avx2x2i(_mm256_dpbusd_avx_epi32(acc.0, x.0, w.0), _mm256_dpbusd_avx_epi32(acc.1, x.1, w.1))
        } else {
            let one = _mm256_set1_epi16(1);
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw.0, _mm256_sign_epi8(x.0, w.0)), one);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw.1, _mm256_sign_epi8(x.1, w.1)), one);
            Avx2x2i(_mm256_add_epi32(acc.0, p0), _mm256_add_epi32(acc.1, p1))
        }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_add_epi32(a.0, b.0), _mm256_add_epi32(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn mullo(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_mullo_epi32(a.0, b.0), _mm256_mullo_epi32(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn nib_lo(self) -> Self {
        let m = _mm256_set1_epi8(0x0F);
        Avx2x2i(_mm256_and_si256(self.0, m), _mm256_and_si256(self.1, m))
    }
    #[inline(always)]
    unsafe fn nib_hi(self) -> Self {
        let m = _mm256_set1_epi8(0x0F);
        Avx2x2i(
            _mm256_and_si256(_mm256_srli_epi16::<4>(self.0), m),
            _mm256_and_si256(_mm256_srli_epi16::<4>(self.1), m),
        )
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        Avx2x2i(_mm256_or_si256(a.0, b.0), _mm256_or_si256(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn and8(self, mask: i8) -> Self {
        let m = _mm256_set1_epi8(mask);
        Avx2x2i(_mm256_and_si256(self.0, m), _mm256_and_si256(self.1, m))
    }
    #[inline(always)]
    unsafe fn shift16(self, n: i32) -> Self {
        if n >= 0 {
            let c = _mm_cvtsi32_si128(n);
            Avx2x2i(_mm256_sll_epi16(self.0, c), _mm256_sll_epi16(self.1, c))
        } else {
            let c = _mm_cvtsi32_si128(-n);
            Avx2x2i(_mm256_srl_epi16(self.0, c), _mm256_srl_epi16(self.1, c))
        }
    }
    #[inline(always)]
    unsafe fn from_i8x16(p: *const u8) -> Self {
        let v = _mm_loadu_si128(p as *const __m128i);
        Avx2x2i(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)))
    }
}

/// The low 8 signed bytes of `x` as floats.
#[inline(always)]
unsafe fn cvt8(x: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x))
}

/// 8 little-endian bf16 at `p`, widened exactly.
#[inline(always)]
unsafe fn bf16x8(p: *const u8) -> __m256 {
    let h = _mm_loadu_si128(p as *const __m128i);
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}
