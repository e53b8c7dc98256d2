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
    /// `out[i] = dot(q, k[i])` for `i in 0..LANES`, over `hd` values (`hd % 16 == 0`).
    unsafe fn dots(q: *const f32, k: *const *const f32, hd: usize, out: *mut f32);
    /// Converts `n` little-endian f16 values (`n % 16 == 0`) to f32 (exact).
    unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize);
    /// Converts `n` little-endian bf16 values (`n % 16 == 0`) to f32 (exact).
    unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize);

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
    unsafe fn dots(q: *const f32, k: *const *const f32, hd: usize, out: *mut f32) {
        let kr = *k;
        let mut acc = 0.0f32;
        for d in 0..hd {
            acc += q.add(d).read_unaligned() * kr.add(d).read_unaligned();
        }
        *out = acc;
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

// Cephes expf constants (single-precision range reduction + degree-5 polynomial).
const EXP_LO: f32 = -87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];

/// AVX2 + FMA + F16C, 8 lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    const LANES: usize = 8;
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
    unsafe fn dots(q: *const f32, k: *const *const f32, hd: usize, out: *mut f32) {
        // Accumulator slot s holds position SIGMA[s]: the transposing reduction below leaves
        // slot 2e+l in lane 4l+e, so this order puts position i in lane i.
        const SIGMA: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
        let kp: [*const f32; 8] = SIGMA.map(|i| *k.add(i));
        let mut a = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < hd {
            let qv = _mm256_loadu_ps(q.add(c));
            for s in 0..8 {
                a[s] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[s].add(c)), a[s]);
            }
            c += 8;
        }
        let z: [__m256; 4] = std::array::from_fn(|j| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a[2 * j], a[2 * j + 1]),
                _mm256_permute2f128_ps::<0x31>(a[2 * j], a[2 * j + 1]),
            )
        });
        let v: [__m256; 2] = std::array::from_fn(|m| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(z[2 * m], z[2 * m + 1]),
                _mm256_shuffle_ps::<0xEE>(z[2 * m], z[2 * m + 1]),
            )
        });
        let r = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(v[0], v[1]), _mm256_shuffle_ps::<0xDD>(v[0], v[1]));
        _mm256_storeu_ps(out, r);
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
    unsafe fn dots(q: *const f32, k: *const *const f32, hd: usize, out: *mut f32) {
        // Slot s holds position SIGMA[s]: the transposing reduction leaves slot 4e+l in lane
        // 4l+e, so this order puts position i in lane i.
        const SIGMA: [usize; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
        let kp: [*const f32; 16] = SIGMA.map(|i| *k.add(i));
        let mut a = [_mm512_setzero_ps(); 16];
        let mut c = 0;
        while c < hd {
            let qv = _mm512_loadu_ps(q.add(c));
            for s in 0..16 {
                a[s] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kp[s].add(c)), a[s]);
            }
            c += 16;
        }
        // 16 vectors of 16 partial sums -> one vector of 16 sums, halving the partials per
        // input at each level (256-bit halves, 128-bit lanes, pairs, singles).
        let z: [__m512; 8] = std::array::from_fn(|j| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a[2 * j], a[2 * j + 1]),
                _mm512_shuffle_f32x4::<0xEE>(a[2 * j], a[2 * j + 1]),
            )
        });
        let w: [__m512; 4] = std::array::from_fn(|k| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(z[2 * k], z[2 * k + 1]),
                _mm512_shuffle_f32x4::<0xDD>(z[2 * k], z[2 * k + 1]),
            )
        });
        let v: [__m512; 2] = std::array::from_fn(|m| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(w[2 * m], w[2 * m + 1]),
                _mm512_shuffle_ps::<0xEE>(w[2 * m], w[2 * m + 1]),
            )
        });
        let r = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(v[0], v[1]), _mm512_shuffle_ps::<0xDD>(v[0], v[1]));
        _mm512_storeu_ps(out, r);
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
