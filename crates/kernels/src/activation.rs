//! Elementwise activations and softmax.
//!
//! [`silu`] is `g / (1 + exp(-g))` with its own `exp` ([`exp_silu`]: Cephes' `expf`
//! polynomial in plain multiplies and adds, no FMA), so that the scalar form and the AVX2 /
//! AVX-512 forms of [`swiglu`] give the same bits: every fused matmul (packed panels, row
//! tiles, quantized tasks) and the separate `swiglu` agree whatever ISA ran which rows. The
//! platform's `expf` was a call per element and measured 6% of a 16-request decode step.

use rayon::prelude::*;

const PAR_MIN: usize = 1 << 14;

/// `exp(x)` as `silu` needs it, `x` clamped to [-86, 89] first: below, `1 + exp(x)` is 1 in
/// f32; from 88.73 up the result overflows to +inf, as f32's `exp` does. About 2 ulp in
/// between. The scale 2^n is applied as 2^(n-1) then 2, so that n = 128 (x near 88.7)
/// stays finite where it should. A NaN `x` gives a finite value (silu's numerator carries
/// the NaN).
#[inline(always)]
pub fn exp_silu(x: f32) -> f32 {
    // Not `clamp`: that keeps a NaN, while max/min give the bound, as the vector forms do.
    #[allow(clippy::manual_clamp)]
    let x = x.max(X_MIN).min(X_MAX);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let z = r * r;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * z + r + 1.0;
    y * f32::from_bits(((n as i32 + 126) as u32) << 23) * 2.0
}

const X_MIN: f32 = -86.0;
const X_MAX: f32 = 89.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (ties to even).
const ROUND: f32 = 12_582_912.0;
/// ln 2 split so that `n * LN2_HI` is exact for |n| < 2^9 (Cephes' C1, C2).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` minimax coefficients, highest degree first (its last, 5.0000001201e-1, is
/// 0.5 in f32).
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `silu(g) = g / (1 + exp(-g))` in f32 with [`exp_silu`] (shared by every fused matmul).
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp_silu(-g))
}

/// `out = silu(gate) * up`, `silu(g) = g / (1 + exp(-g))`, in parallel for long inputs.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu: gate has {} values, up {}, out {}",
        gate.len(),
        up.len(),
        out.len()
    );
    out.par_chunks_mut(PAR_MIN)
        .zip(gate.par_chunks(PAR_MIN))
        .zip(up.par_chunks(PAR_MIN))
        .for_each(|((o, g), u)| swiglu_serial(g, u, o));
}

/// [`swiglu`] on the calling thread, with the widest vectors `isa::active` allows (the same
/// bits as the scalar [`silu`]). Slices of equal length (the caller checks).
pub fn swiglu_serial(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_serial_with(crate::isa::active(), gate, up, out)
}

/// [`swiglu_serial`] with vectors no wider than `isa` (and than this CPU has).
pub fn swiglu_serial_with(isa: crate::isa::Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    debug_assert!(gate.len() == out.len() && up.len() == out.len());
    let n = out.len().min(gate.len()).min(up.len());
    let done = match isa.min(crate::isa::detected()) {
        // SAFETY: the ISA is present (capped at what was detected); the loops stay within
        // n, which all three slices hold.
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx512 => unsafe { x86::swiglu_avx512(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n) },
        #[cfg(target_arch = "x86_64")]
        crate::isa::Isa::Avx2 => unsafe { x86::swiglu_avx2(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n) },
        _ => 0,
    };
    for i in done..n {
        out[i] = silu(gate[i]) * up[i];
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! [`super::silu`] step for step in 16 or 8 lanes: the same operations in the same
    //! order (max/min return the bound for a NaN lane, as `f32::max`/`min` do).
    use std::arch::x86_64::*;

    macro_rules! silu_lanes {
        ($name:ident, $feat:literal, $v:ty, $w:expr, $set1:ident, $max:ident, $min:ident, $add:ident, $sub:ident,
         $mul:ident, $div:ident, $cvt:ident, $addi:ident, $set1i:ident, $slli:ident, $cast:ident, $xor:ident,
         $castps:ident, $loadu:ident, $storeu:ident) => {
            /// Writes `out[i] = silu(gate[i]) * up[i]` for the whole vectors in `0..n`;
            /// returns how many it wrote.
            ///
            /// # Safety
            /// The CPU has the features; the pointers cover `n` values.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name(g: *const f32, u: *const f32, o: *mut f32, n: usize) -> usize {
                let sign = $set1i(i32::MIN);
                let (lo, hi) = ($set1(super::X_MIN), $set1(super::X_MAX));
                let mut i = 0;
                while i + $w <= n {
                    let gv = $loadu(g.add(i));
                    // -g flips the sign bit, as the scalar negation does.
                    let x = $cast($xor($castps(gv), sign));
                    let x = $min($max(x, lo), hi);
                    let nn = $sub($add($mul(x, $set1(super::LOG2E)), $set1(super::ROUND)), $set1(super::ROUND));
                    let r = $sub(x, $mul(nn, $set1(super::LN2_HI)));
                    let r = $sub(r, $mul(nn, $set1(super::LN2_LO)));
                    let z = $mul(r, r);
                    let mut p = $set1(super::P[0]);
                    for c in &super::P[1..] {
                        p = $add($mul(p, r), $set1(*c));
                    }
                    let y = $add($add($mul(p, z), r), $set1(1.0));
                    let e = $mul($mul(y, $cast($slli::<23>($addi($cvt(nn), $set1i(126))))), $set1(2.0));
                    let s = $div(gv, $add($set1(1.0), e));
                    $storeu(o.add(i), $mul(s, $loadu(u.add(i))));
                    i += $w;
                }
                i
            }
        };
    }

    silu_lanes!(
        swiglu_avx512,
        "avx512f",
        __m512,
        16,
        _mm512_set1_ps,
        _mm512_max_ps,
        _mm512_min_ps,
        _mm512_add_ps,
        _mm512_sub_ps,
        _mm512_mul_ps,
        _mm512_div_ps,
        _mm512_cvtps_epi32,
        _mm512_add_epi32,
        _mm512_set1_epi32,
        _mm512_slli_epi32,
        _mm512_castsi512_ps,
        _mm512_xor_si512,
        _mm512_castps_si512,
        _mm512_loadu_ps,
        _mm512_storeu_ps
    );
    silu_lanes!(
        swiglu_avx2,
        "avx2",
        __m256,
        8,
        _mm256_set1_ps,
        _mm256_max_ps,
        _mm256_min_ps,
        _mm256_add_ps,
        _mm256_sub_ps,
        _mm256_mul_ps,
        _mm256_div_ps,
        _mm256_cvtps_epi32,
        _mm256_add_epi32,
        _mm256_set1_epi32,
        _mm256_slli_epi32,
        _mm256_castsi256_ps,
        _mm256_xor_si256,
        _mm256_castps_si256,
        _mm256_loadu_ps,
        _mm256_storeu_ps
    );
}

/// In-place softmax of each row of `cols` values (max-subtracted). Exponentials in f32,
/// their sum in f64, each output `e / sum` rounded once. A row of all `-inf` becomes NaN
/// (there is no distribution to return).
pub fn softmax_rows(x: &mut [f32], cols: usize) {
    if x.is_empty() {
        return;
    }
    assert!(cols > 0 && x.len().is_multiple_of(cols), "softmax_rows: {} values are not whole rows of {cols}", x.len());
    let min_rows = (PAR_MIN / cols).max(1);
    x.par_chunks_mut(cols).with_min_len(min_rows).for_each(|row| {
        let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0.0f64;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v as f64;
        }
        for v in row.iter_mut() {
            *v = (*v as f64 / sum) as f32;
        }
    });
}

/// `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/π) (g + 0.044715 g³)))` (PyTorch's
/// `gelu(approximate="tanh")`, HF `gelu_pytorch_tanh`), in f32 with the platform's `tanh`.
#[inline]
pub fn gelu_tanh(g: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * g * (1.0 + (C * (g + 0.044_715 * g * g * g)).tanh())
}

/// `out = gelu_tanh(gate) * up` (GeGLU), in parallel for long inputs. One scalar form for
/// every ISA, so the bits do not depend on the machine.
pub fn geglu_tanh(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "geglu: gate has {} values, up {}, out {}",
        gate.len(),
        up.len(),
        out.len()
    );
    out.par_chunks_mut(PAR_MIN).zip(gate.par_chunks(PAR_MIN)).zip(up.par_chunks(PAR_MIN)).for_each(|((o, g), u)| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = gelu_tanh(g) * u;
        }
    });
}

/// Plain f64 references for the tests.
pub mod reference {
    pub fn geglu_tanh(gate: &[f32], up: &[f32]) -> Vec<f64> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        gate.iter()
            .zip(up)
            .map(|(&g, &u)| {
                let g = g as f64;
                0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u as f64
            })
            .collect()
    }

    pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f64> {
        gate.iter().zip(up).map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).collect()
    }

    pub fn softmax_rows(x: &[f32], cols: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let e: Vec<f64> = row.iter().map(|&v| (v as f64 - mx).exp()).collect();
            let s: f64 = e.iter().sum();
            out.extend(e.iter().map(|v| v / s));
        }
        out
    }
}
