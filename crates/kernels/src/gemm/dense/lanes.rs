//! The 16-lane f32 accumulator every ISA implements with the same arithmetic.
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

/// One 16-lane f32 vector in the canonical lane order.
///
/// Implementations are `#[inline(always)]` and are only called (after inlining) from
/// functions compiled with the target features the implementation needs.
pub(in crate::gemm) trait Lanes: Copy {
    unsafe fn zero() -> Self;
    /// 16 f32 from `p` (any alignment).
    unsafe fn load_f32(p: *const f32) -> Self;
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

/// Storage type of the weight rows a kernel instance reads.
pub(in crate::gemm) trait WKind {
    /// Bytes per element.
    const BYTES: usize;
    unsafe fn load<V: Lanes>(p: *const u8) -> V;
    /// Element `i` of the row at `p`, widened to f32 (used for the k tail).
    unsafe fn get(p: *const u8, i: usize) -> f32;
}

pub(in crate::gemm) struct WF32;
pub(in crate::gemm) struct WF16;
pub(in crate::gemm) struct WBF16;

impl WKind for WF32 {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const u8) -> V {
        V::load_f32(p as *const f32)
    }
    #[inline(always)]
    unsafe fn get(p: *const u8, i: usize) -> f32 {
        (p.add(4 * i) as *const f32).read_unaligned()
    }
}

impl WKind for WF16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const u8) -> V {
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
    unsafe fn load<V: Lanes>(p: *const u8) -> V {
        V::load_bf16(p)
    }
    #[inline(always)]
    unsafe fn get(p: *const u8, i: usize) -> f32 {
        f32::from_bits(((p.add(2 * i) as *const u16).read_unaligned().to_le() as u32) << 16)
    }
}

/// Portable implementation: 16 scalar lanes, `f32::mul_add` for the fused step.
#[derive(Clone, Copy)]
pub(in crate::gemm) struct Scalar16([f32; 16]);

impl Lanes for Scalar16 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar16([0.0; 16])
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const f32) -> Self {
        Scalar16(std::array::from_fn(|l| p.add(l).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        Scalar16(std::array::from_fn(|l| WF16::get(p, l)))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        Scalar16(std::array::from_fn(|l| WBF16::get(p, l)))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        std::ptr::copy_nonoverlapping(self.0.as_ptr(), p, 16);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self {
        Scalar16(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], acc.0[l])))
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        Scalar16([v; 16])
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Scalar16(std::array::from_fn(|l| a.0[l] + b.0[l]))
    }
    #[inline(always)]
    unsafe fn reduce(self) -> f32 {
        let v = self.0;
        let s8: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
        let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
        let s2: [f32; 2] = std::array::from_fn(|i| s4[i] + s4[i + 2]);
        s2[0] + s2[1]
    }
}

#[cfg(target_arch = "x86_64")]
pub(in crate::gemm) use x86::{Avx2x2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Lanes;
    use std::arch::x86_64::*;

    /// AVX2 + FMA + F16C: lanes 0..8 in `.0`, lanes 8..16 in `.1`.
    #[derive(Clone, Copy)]
    pub(in crate::gemm) struct Avx2x2(__m256, __m256);

    /// Tree sum of 8 lanes held as `s8` (the last three levels of the canonical tree).
    #[inline(always)]
    unsafe fn reduce8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
    }

    #[inline(always)]
    unsafe fn bf16x8(p: *const u8) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    impl Lanes for Avx2x2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx2x2(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load_f32(p: *const f32) -> Self {
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
        unsafe fn reduce(self) -> f32 {
            reduce8(_mm256_add_ps(self.0, self.1))
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

    /// AVX-512 F/BW/DQ: one zmm.
    #[derive(Clone, Copy)]
    pub(in crate::gemm) struct Avx512(__m512);

    impl Lanes for Avx512 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx512(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load_f32(p: *const f32) -> Self {
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
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        }
        #[inline(always)]
        unsafe fn reduce(self) -> f32 {
            let lo = _mm512_castps512_ps256(self.0);
            let hi = _mm512_extractf32x8_ps::<1>(self.0);
            reduce8(_mm256_add_ps(lo, hi))
        }
    }
}
