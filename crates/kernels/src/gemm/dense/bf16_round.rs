//! f32 activation rows rounded to bf16 for the AVX512_BF16 and AMX dot products: one place,
//! so that every kernel that feeds `vdpbf16ps` or `tdpbf16ps` rounds the same way.

use std::arch::x86_64::*;

/// Rounds `n` f32 at `src` to bf16 at `dst` (RNE, DAZ), zero-padding to `padded`
/// (a multiple of 32).
#[inline(always)]
pub(in crate::gemm) unsafe fn round_row(src: *const f32, n: usize, padded: usize, dst: *mut u16) {
    let mut c = 0;
    while c < padded {
        let left = n.saturating_sub(c);
        let (lo, hi) = if left >= 32 {
            (_mm512_loadu_ps(src.add(c)), _mm512_loadu_ps(src.add(c + 16)))
        } else {
            let ml = if left >= 16 { 0xffff } else { (1u32 << left) as u16 - 1 };
            let mh = if left > 16 { ((1u32 << (left - 16)) - 1) as u16 } else { 0 };
            // Masked-off lanes are neither read nor faulted; they load as +0.0.
            (_mm512_maskz_loadu_ps(ml, src.add(c)), _mm512_maskz_loadu_ps(mh, src.add(c + 16)))
        };
        let b = _mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(dst.add(c) as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(b));
        c += 32;
    }
}
