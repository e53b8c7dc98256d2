//! The storage types of dense weight rows, read into the canonical 16 lanes
//! ([`crate::simd::F32x16`]), which every ISA implements with the same arithmetic.
//!
//! Canonical reduction order of one dot product `x · w` over `k` (shared by every ISA, so
//! scalar, AVX2 and AVX-512 results are bit-identical, and by every tile shape, so results
//! do not depend on `m`):
//! - lane `l` (0..16) accumulates `acc[l] = fma(x[c], w[c], acc[l])` for `c ≡ l (mod 16)`,
//!   in increasing `c`, starting from `+0.0`; a partial last block is zero-padded (the
//!   padded lanes do `fma(0, 0, acc)`);
//! - then the fixed tree `s8[i] = v[i] + v[i+8]`, `s4[i] = s8[i] + s8[i+4]`,
//!   `s2[i] = s4[i] + s4[i+2]`, `sum = s2[0] + s2[1]`.
//!
//! Every step is one correctly rounded IEEE operation, so any implementation performing the
//! same operations on the same lanes produces the same bits.

use crate::simd::F32x16;

/// Storage type of the weight rows a kernel instance reads.
pub(in crate::gemm) trait WKind {
    /// Bytes per element.
    const BYTES: usize;
    unsafe fn load<V: F32x16>(p: *const u8) -> V;
    /// Element `i` of the row at `p`, widened to f32 (used for the k tail).
    unsafe fn get(p: *const u8, i: usize) -> f32;
}

pub(in crate::gemm) struct WF32;
pub(in crate::gemm) struct WF16;
pub(in crate::gemm) struct WBF16;

impl WKind for WF32 {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load<V: F32x16>(p: *const u8) -> V {
        V::load(p as *const f32)
    }
    #[inline(always)]
    unsafe fn get(p: *const u8, i: usize) -> f32 {
        (p.add(4 * i) as *const f32).read_unaligned()
    }
}

impl WKind for WF16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load<V: F32x16>(p: *const u8) -> V {
        V::load_f16(p)
    }
    #[inline(always)]
    unsafe fn get(p: *const u8, i: usize) -> f32 {
        half::f16::from_bits((p.add(2 * i) as *const u16).read_unaligned().to_le()).to_f32()
    }
}

impl WKind for WBF16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load<V: F32x16>(p: *const u8) -> V {
        V::load_bf16(p)
    }
    #[inline(always)]
    unsafe fn get(p: *const u8, i: usize) -> f32 {
        f32::from_bits(((p.add(2 * i) as *const u16).read_unaligned().to_le() as u32) << 16)
    }
}
