//! Vector primitives shared by the attention and norm kernels, one implementation per ISA.
//!
//! Kernels are written once, generic over [`Simd`], with `#[inline(always)]` bodies; each
//! ISA gets a `#[target_feature]` entry point that instantiates them, so the intrinsics are
//! inlined with the right features enabled. Every primitive is lane-wise or reduces in one
//! fixed order, so a result never depends on where a value sits in a batch.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `MASK[16 - n..]` starts with `n` ones followed by zeros: keeps the first `n` lanes.
pub(crate) static MASK: [f32; 32] = {
    let mut m = [0.0f32; 32];
    let mut i = 0;
    while i < 16 {
        m[i] = 1.0;
        i += 1;
    }
    m
};

/// One instruction set's vector of f32 and the operations the kernels need.
///
/// # Safety
/// Every method requires the CPU to support the ISA (callers dispatch on `isa::active`) and
/// pointers valid for the documented number of elements (unaligned is fine).
pub(crate) trait Simd {
    const LANES: usize;
    /// Queries FlashAttention runs together (sharing K/V loads) within the register file.
    const QUERY_GROUP: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` (fused on SIMD ISAs, two roundings on scalar).
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// Sum of the lanes in a fixed tree order.
    unsafe fn reduce_add(v: Self::V) -> f32;
    unsafe fn reduce_max(v: Self::V) -> f32;
    /// `e^min(x, 0)`, 0 below -87 (where f32 `e^x` approaches the subnormal range).
    unsafe fn exp_neg(x: Self::V) -> Self::V;
    /// Transposes a `LANES x LANES` block: `dst[c * dst_stride + r] = rows[r][col + c]`.
    unsafe fn transpose(rows: *const *const f32, col: usize, dst: *mut f32, dst_stride: usize);
    /// Converts `n` little-endian f16 values (`n % 16 == 0`) to f32 (exact).
    unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize);
    /// Converts `n` little-endian bf16 values (`n % 16 == 0`) to f32 (exact).
    unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize);

    /// Hints that the 64-byte line at `p` is read soon (no-op where unsupported).
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        #[cfg(target_arch = "x86_64")]
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// Scalar `exp_neg` computed with the vector code, so scalar and vector uses agree.
    #[inline(always)]
    unsafe fn exp_neg1(x: f32) -> f32 {
        Self::reduce_max(Self::exp_neg(Self::splat(x)))
    }
}

/// Portable fallback: one lane.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Simd for Scalar {
    const LANES: usize = 1;
    const QUERY_GROUP: usize = 2;
    type V = f32;
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        p.read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        p.write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        // Not `mul_add`: without hardware FMA that is a slow libm call.
        a * b + c
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn reduce_add(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn reduce_max(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn exp_neg(x: f32) -> f32 {
        if x < -87.0 {
            0.0
        } else {
            x.min(0.0).exp()
        }
    }
    #[inline(always)]
    unsafe fn transpose(rows: *const *const f32, col: usize, dst: *mut f32, _dst_stride: usize) {
        *dst = (*rows).add(col).read_unaligned();
    }
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        for i in 0..n {
            let b = [*src.add(2 * i), *src.add(2 * i + 1)];
            dst.add(i).write_unaligned(half::f16::from_le_bytes(b).to_f32());
        }
    }
    #[inline(always)]
    unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
        for i in 0..n {
            let b = [*src.add(2 * i), *src.add(2 * i + 1)];
            dst.add(i).write_unaligned(half::bf16::from_le_bytes(b).to_f32());
        }
    }
}

// Cephes expf constants (single-precision range reduction + degree-5 polynomial, ~1 ulp).
#[cfg(target_arch = "x86_64")]
const EXP_LO: f32 = -87.0;
#[cfg(target_arch = "x86_64")]
const LOG2E: f32 = std::f32::consts::LOG2_E;
#[cfg(target_arch = "x86_64")]
const LN2_HI: f32 = 0.693_359_4;
#[cfg(target_arch = "x86_64")]
const LN2_LO: f32 = -2.121_944_4e-4;
#[cfg(target_arch = "x86_64")]
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// AVX2 + FMA + F16C, 8 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
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

/// AVX-512 F/BW/VL/DQ, 16 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    const LANES: usize = 16;
    // Six queries: 24 score accumulators and 4 K vectors of 32 registers, 10 loads per 24
    // FMAs (four: 8 per 16). `attention -- prefill/flash`, f16: 157.6 / 157.9 -> 172.3 /
    // 172.2 Gelem/s at 2048, 150.6 / 147.3 -> 162.4 / 162.0 at 512.
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
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        Avx2::reduce_add(h)
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
