//! The vector lanes every kernel is written over, one implementation per instruction set
//! (`scalar`, `avx2`, `avx512`). Kernels are generic over these traits with
//! `#[inline(always)]` bodies; each ISA gets a `#[target_feature]` entry point that
//! instantiates them, so the intrinsics inline with the right features enabled.
//!
//! Two views of the same registers:
//! - [`Native`]: the ISA's own width (1, 8 or 16 f32 lanes), for the kernels whose results
//!   do not depend on the lane count (attention, norms): every primitive is lane-wise or
//!   reduces in one fixed order;
//! - [`F32x16`]: 16 f32 lanes on every ISA (one zmm, two ymm, or 16 scalars), for the
//!   matmuls' canonical reduction order: lane `l` accumulates the elements `c ≡ l (mod 16)`
//!   with fused multiply-adds, then the fixed tree `s8[i] = v[i] + v[i+8]`,
//!   `s4[i] = s8[i] + s8[i+4]`, `s2[i] = s4[i] + s4[i+2]`, `sum = s2[0] + s2[1]`. Every step
//!   is one correctly rounded IEEE operation, so every ISA produces the same bits.
//!   [`F32x16Bytes`] adds the byte unpacking the GGUF block formats need (x86 only).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256i;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;

/// The canonical tree over 16 chain accumulators, lane by lane: `s8[l] = acc[l] + acc[l+8]`,
/// `s4[l] = s8[l] + s8[l+4]`, then `(s4[0] + s4[2]) + (s4[1] + s4[3])` (the reference's
/// `hsum16`, applied to each lane).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // s8[l] and acc[l + 8] share the counter
pub(crate) unsafe fn chain_tree<V: F32x16>(acc: &[V; 16]) -> V {
    let mut s8 = [V::zero(); 8];
    for l in 0..8 {
        s8[l] = V::add(acc[l], acc[l + 8]);
    }
    let mut s4 = [V::zero(); 4];
    for l in 0..4 {
        s4[l] = V::add(s8[l], s8[l + 4]);
    }
    V::add(V::add(s4[0], s4[2]), V::add(s4[1], s4[3]))
}

/// `$body` 16 times with `$c` bound to 0, 1, .., 15 (a constant in each copy): the 16 lanes
/// or chains of a canonical accumulator, each kept in its own register.
macro_rules! unroll16 {
    ($c:ident => $body:block) => {{
        $crate::simd::unroll16!(@ $c $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }};
    (@ $c:ident $body:block; $($n:literal)*) => {{
        $( { let $c: usize = $n; $body } )*
    }};
}
pub(crate) use unroll16;

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::{Avx2, Avx2x2, Avx2x2i};
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::{Avx512, Avx512i};
pub(crate) use scalar::{Scalar, Scalar16};

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
pub(crate) trait Native {
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
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// Scalar `exp_neg` computed with the vector code, so scalar and vector uses agree.
    #[inline(always)]
    unsafe fn exp_neg1(x: f32) -> f32 {
        Self::reduce_max(Self::exp_neg(Self::splat(x)))
    }
}

/// One 16-lane f32 vector in the canonical lane order.
///
/// Implementations are `#[inline(always)]` and are only called (after inlining) from
/// functions compiled with the target features the implementation needs.
pub(crate) trait F32x16: Copy {
    unsafe fn zero() -> Self;
    /// 16 f32 from `p` (any alignment).
    unsafe fn load(p: *const f32) -> Self;
    /// 16 little-endian f16 from `p` (any alignment), widened exactly.
    unsafe fn load_f16(p: *const u8) -> Self;
    /// 16 little-endian bf16 from `p` (any alignment), widened exactly.
    unsafe fn load_bf16(p: *const u8) -> Self;
    /// Stores the 16 lanes to `p` (any alignment).
    unsafe fn store(self, p: *mut f32);
    /// `a * b + acc` per lane, fused (one rounding).
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self;
    /// The canonical tree sum of the 16 lanes.
    unsafe fn reduce(self) -> f32;
    /// `v` in every lane.
    unsafe fn splat(v: f32) -> Self;
    /// `a + b` per lane.
    unsafe fn add(a: Self, b: Self) -> Self;
    /// `a * b` per lane.
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `a - b` per lane.
    unsafe fn sub(a: Self, b: Self) -> Self;
    /// Hints that the cache line at `p` will be read soon (no effect on results).
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}

    /// Whether `register_blocked` runs its packed tiles as two passes over half the chains
    /// (`split_tile`), with each packed k block stored half by half. Chains are independent
    /// until the final tree, so this changes which chain is advanced when, not any chain's
    /// own sequence of operations: the bits stay canonical.
    const SPLIT: bool = false;

    /// One pass of a split tile: continues chains `8h..8h + 8` of an `MR x NR` tile (row `i`,
    /// weight row `j` at `acc[i * NR + j]`, the other half left as it is) over `steps` steps
    /// of 8 values: x rows at `x` (stride `xs`), weight rows at `w`, both holding this half's
    /// values of consecutive 16-blocks. `first` starts the chains from zero (`h = 0` then
    /// writes the other half as zero too). Only called when `SPLIT`.
    #[inline(always)]
    unsafe fn split_tile<const MR: usize, const NR: usize>(
        _x: *const f32,
        _xs: usize,
        _w: &[*const f32; NR],
        _steps: usize,
        _acc: *mut Self,
        _h: usize,
        _first: bool,
    ) {
        unreachable!("split_tile on a type without SPLIT")
    }
}

/// The byte-level steps of unpacking GGUF blocks into 16 f32 lanes (256-bit integer vectors,
/// AVX2 instructions present on every x86 ISA here).
#[cfg(target_arch = "x86_64")]
pub(crate) trait F32x16Bytes: F32x16 {
    /// The little-endian f16 at `p`, converted exactly, in every lane.
    unsafe fn splat_f16(p: *const u8) -> Self;
    /// `reduce` of the 16 vectors at `p` (16 f32 each, consecutive): the same additions.
    #[inline(always)]
    unsafe fn hsum16x(p: *const f32) -> [f32; 16] {
        let mut out = [0f32; 16];
        for (t, o) in out.iter_mut().enumerate() {
            *o = Self::load(p.add(16 * t)).reduce();
        }
        out
    }
    /// 32 signed bytes as floats: (bytes 0..16, bytes 16..32).
    unsafe fn from_i8x32(v: __m256i) -> (Self, Self);
    /// Byte `i` is 0xFF when bit `i` of `bits` is set, else 0.
    unsafe fn bits_to_bytes(bits: u32) -> __m256i;
    /// `-v` exactly (the sign bit flipped, also for zeros).
    unsafe fn neg(self) -> Self;
    /// 16 bytes at `p` as unsigned integers, converted exactly.
    unsafe fn from_u8x16(p: *const u8) -> Self;
    /// `a` in lanes 0..8, `b` in lanes 8..16.
    unsafe fn halves(a: f32, b: f32) -> Self;
    /// Lanes `0..n` from `new`, the others from `old`.
    unsafe fn keep_first(n: usize, new: Self, old: Self) -> Self;
}

/// 16 i32 lanes (or 64 bytes, or 32 i16) in the canonical lane order, with the integer steps
/// of the quantized `Fast` kernels (`gemm::quant::int_dot`); x86 only.
#[cfg(target_arch = "x86_64")]
pub(crate) trait I32x16: Copy {
    type F: F32x16Bytes;
    unsafe fn zero() -> Self;
    /// Bytes 0..32 from `a`, 32..64 from `b`.
    unsafe fn from2(a: __m256i, b: __m256i) -> Self;
    /// 64 bytes at `p`.
    unsafe fn load(p: *const u8) -> Self;
    unsafe fn xor80(self) -> Self;
    /// `acc + Σ_{t<4} w[4l+t] * x[4l+t]` per lane, `w` unsigned and `x` signed bytes. Without
    /// VNNI through `vpmaddubsw` pair sums: exact because every caller's `w` is at most 63.
    unsafe fn dot<const VNNI: bool>(acc: Self, w: Self, x: Self) -> Self;
    /// As `dot` with signed `w` (Q8_0 without VNNI): `|w|` times `x` with `w`'s sign, pair
    /// sums at most 2 * 128 * 127 < 2^15.
    unsafe fn dot_ss(acc: Self, w: Self, x: Self) -> Self;
    /// Q6_K: `acc + Σ_{t<2} sc[2l+t] * (w[4l+2t] x[4l+2t] + w[4l+2t+1] x[4l+2t+1])` with the
    /// i16 scales `sc` (pair sums at most 2 * 63 * 127).
    unsafe fn dot_sc<const VNNI: bool>(acc: Self, w: Self, x: Self, sc: Self) -> Self;
    /// Levels 1, 2, 3 of the tree that turns 8 units of per-group partial sums into one
    /// vector of 16 group sums (`int_dot`'s module doc). Only the final lane order is fixed.
    unsafe fn comb1(a: Self, b: Self) -> Self;
    unsafe fn comb2(a: Self, b: Self) -> Self;
    unsafe fn comb3(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn shl(self, n: u32) -> Self;
    /// i16 pairs multiplied and summed into i32 lanes.
    unsafe fn madd16(a: Self, b: Self) -> Self;
    /// `vpmaddubsw`: unsigned bytes `w` times signed bytes `x`, pair sums as i16 (the caller
    /// keeps them below 2^15: no saturation).
    unsafe fn ubs(w: Self, x: Self) -> Self;
    /// i16 lanes added (the caller keeps the sums below 2^15).
    unsafe fn add16(a: Self, b: Self) -> Self;
    /// i16 pairs summed into i32 lanes (`vpmaddwd` by ones).
    unsafe fn widen16(self) -> Self;
    /// `[s0 x 8, s1 x 8, s2 x 8, s3 x 8]` as i16 from the 4 i16 at `p`.
    unsafe fn sc_unit(p: *const i16) -> Self;
    unsafe fn cvt(self) -> Self::F;
    // The packed GEMM (weights signed, output rows in lanes).
    /// The 4 bytes at `p` in every lane.
    unsafe fn bcast32(p: *const u8) -> Self;
    unsafe fn abs8(self) -> Self;
    /// `acc + Σ_{t<4} w[4l+t] x[4l+t]` per lane with signed weight bytes `w` (`aw = |w|`):
    /// with VNNI `x` is unsigned (`q + 128`, the caller starts from `-128 Σ w`), without it
    /// `x` is signed and the product is `|w|` times `x` with `w`'s sign (no saturation).
    unsafe fn dpw<const VNNI: bool>(acc: Self, w: Self, aw: Self, x: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn mullo(a: Self, b: Self) -> Self;
    /// The low / high nibble of every byte, as a byte (the packed layouts).
    unsafe fn nib_lo(self) -> Self;
    unsafe fn nib_hi(self) -> Self;
    unsafe fn or(a: Self, b: Self) -> Self;
    /// Every byte ANDed with `mask`.
    unsafe fn and8(self, mask: i8) -> Self;
    /// Each 16-bit lane shifted left by `n` (right by `-n`), `|n| < 16`.
    unsafe fn shift16(self, n: i32) -> Self;
    /// 16 signed bytes at `p` as i32 lanes.
    unsafe fn from_i8x16(p: *const u8) -> Self;
}

// Cephes expf constants (single-precision range reduction + degree-5 polynomial, ~1 ulp).
#[cfg(target_arch = "x86_64")]
pub(crate) const EXP_LO: f32 = -87.0;
#[cfg(target_arch = "x86_64")]
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
#[cfg(target_arch = "x86_64")]
pub(crate) const LN2_HI: f32 = 0.693_359_4;
#[cfg(target_arch = "x86_64")]
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
#[cfg(target_arch = "x86_64")]
pub(crate) const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
