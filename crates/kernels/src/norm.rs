//! RMSNorm, and RMSNorm with the residual add fused in.
//!
//! `rmsnorm(x) = w * x / sqrt(mean(x²) + eps)` per row of `dim` values (no +1 offset).
//!
//! Numerics: the sum of squares is accumulated in f32 by one code path (`sum_sq`) shared by
//! `rmsnorm` and `add_rmsnorm`, in a fixed order for the ISA (four vector accumulators over
//! the row, a scalar tail, a fixed reduction tree), so the fusion never changes a bit. The
//! inverse rms is computed in f64 from that f32 sum (`1 / sqrt(ss / dim + eps)`) and
//! rounded to f32 once; each output is then `(x * inv_rms) * w` in f32, which is the same
//! on every ISA. Results may differ between ISAs only through the sum of squares.

use rayon::prelude::*;

use crate::isa::{self, Isa};
use crate::simd::{Native, Scalar};
use crate::WeightVec;

/// Rows of fewer values than this per task are not worth a thread.
const PAR_MIN_VALUES: usize = 1 << 15;

/// `out[r] = rmsnorm(x[r]) * w` for each row of `w.len` values.
/// RMSNorm runs on f32 activations with an f32, f16 or bf16 gain vector.
pub fn supports(gain: crate::DType) -> Result<(), tboost_ops::Unsupported> {
    match gain {
        crate::DType::F32 | crate::DType::F16 | crate::DType::BF16 => Ok(()),
        other => Err(tboost_ops::Unsupported::new("gain_dtype", other, "f32, f16 or bf16")),
    }
}

pub fn rmsnorm(x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    rmsnorm_with(isa::active(), x, w, eps, out)
}

/// `residual += x; out = rmsnorm(residual) * w` row by row: one pass instead of two.
pub fn add_rmsnorm(residual: &mut [f32], x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    add_rmsnorm_with(isa::active(), residual, x, w, eps, out)
}

/// `dst += src` elementwise (the unfused residual add).
pub fn add(dst: &mut [f32], src: &[f32]) {
    add_with(isa::active(), dst, src)
}

/// Checks the shapes; returns the row length.
fn check(what: &str, n: usize, others: &[(&str, usize)], w: &WeightVec<'_>) -> usize {
    assert!(w.len > 0, "{what}: the norm weight is empty");
    assert!(n.is_multiple_of(w.len), "{what}: {n} values are not whole rows of {} (the norm weight's length)", w.len);
    for &(name, len) in others {
        assert_eq!(len, n, "{what}: {name} has {len} values, the input {n}");
    }
    w.len
}

fn check_isa(isa: Isa) {
    assert!(
        isa <= isa::detected(),
        "norm: ISA {} requested but this CPU supports {}",
        isa.name(),
        isa::detected().name()
    );
}

/// One row: `r` is the input (and, when fused, the residual updated with `x`).
type RowFn = unsafe fn(*mut f32, *const f32, *const f32, *mut f32, usize, f32);

fn row_fn<const FUSED: bool>(isa: Isa) -> RowFn {
    check_isa(isa);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => row_avx512::<FUSED>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => row_avx2::<FUSED>,
        _ => row_scalar::<FUSED>,
    }
}

pub fn rmsnorm_with(isa: Isa, x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    let dim = check("rmsnorm", x.len(), &[("out", out.len())], &w);
    let f = row_fn::<false>(isa);
    let wf = w.as_f32();
    let min_rows = (PAR_MIN_VALUES / dim).max(1);
    x.par_chunks(dim).zip(out.par_chunks_mut(dim)).with_min_len(min_rows).for_each(|(xr, or)| {
        // SAFETY: ISA checked; rows of `dim` values; not fused, so `xr` is only read.
        unsafe { f(xr.as_ptr() as *mut f32, std::ptr::null(), wf.as_ptr(), or.as_mut_ptr(), dim, eps) }
    });
}

pub fn add_rmsnorm_with(isa: Isa, residual: &mut [f32], x: &[f32], w: WeightVec<'_>, eps: f32, out: &mut [f32]) {
    let dim = check("add_rmsnorm", residual.len(), &[("x", x.len()), ("out", out.len())], &w);
    let f = row_fn::<true>(isa);
    let wf = w.as_f32();
    let min_rows = (PAR_MIN_VALUES / dim).max(1);
    residual.par_chunks_mut(dim).zip(x.par_chunks(dim)).zip(out.par_chunks_mut(dim)).with_min_len(min_rows).for_each(
        |((rr, xr), or)| {
            // SAFETY: ISA checked; rows of `dim` values.
            unsafe { f(rr.as_mut_ptr(), xr.as_ptr(), wf.as_ptr(), or.as_mut_ptr(), dim, eps) }
        },
    );
}

pub fn add_with(isa: Isa, dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "add: dst has {} values, src {}", dst.len(), src.len());
    check_isa(isa);
    let f: unsafe fn(*mut f32, *const f32, usize) = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => add_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => add_avx2,
        _ => add_scalar,
    };
    dst.par_chunks_mut(PAR_MIN_VALUES).zip(src.par_chunks(PAR_MIN_VALUES)).for_each(|(d, s)| {
        // SAFETY: ISA checked; equal lengths.
        unsafe { f(d.as_mut_ptr(), s.as_ptr(), d.len()) }
    });
}

unsafe fn row_scalar<const FUSED: bool>(r: *mut f32, x: *const f32, w: *const f32, o: *mut f32, dim: usize, eps: f32) {
    row::<Scalar, FUSED>(r, x, w, o, dim, eps)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_avx2<const FUSED: bool>(r: *mut f32, x: *const f32, w: *const f32, o: *mut f32, dim: usize, eps: f32) {
    row::<crate::simd::Avx2, FUSED>(r, x, w, o, dim, eps)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn row_avx512<const FUSED: bool>(r: *mut f32, x: *const f32, w: *const f32, o: *mut f32, dim: usize, eps: f32) {
    row::<crate::simd::Avx512, FUSED>(r, x, w, o, dim, eps)
}

unsafe fn add_scalar(d: *mut f32, s: *const f32, n: usize) {
    add_n::<Scalar>(d, s, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_avx2(d: *mut f32, s: *const f32, n: usize) {
    add_n::<crate::simd::Avx2>(d, s, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn add_avx512(d: *mut f32, s: *const f32, n: usize) {
    add_n::<crate::simd::Avx512>(d, s, n)
}

#[inline(always)]
unsafe fn add_n<S: Native>(d: *mut f32, s: *const f32, n: usize) {
    let l = S::LANES;
    let mut i = 0;
    while i + l <= n {
        S::store(d.add(i), S::add(S::load(d.add(i)), S::load(s.add(i))));
        i += l;
    }
    while i < n {
        *d.add(i) += *s.add(i);
        i += 1;
    }
}

/// Sum of squares of row `r` (after `r += x` when `FUSED`): the one accumulation order
/// both entry points share.
#[inline(always)]
unsafe fn sum_sq<S: Native, const FUSED: bool>(r: *mut f32, x: *const f32, dim: usize) -> f32 {
    let l = S::LANES;
    let mut a = [S::zero(); 4];
    let mut i = 0;
    while i + 4 * l <= dim {
        for (u, acc) in a.iter_mut().enumerate() {
            *acc = sq_step::<S, FUSED>(r, x, i + u * l, *acc);
        }
        i += 4 * l;
    }
    while i + l <= dim {
        a[0] = sq_step::<S, FUSED>(r, x, i, a[0]);
        i += l;
    }
    let mut tail = 0.0f32;
    while i < dim {
        let mut y = *r.add(i);
        if FUSED {
            y += *x.add(i);
            *r.add(i) = y;
        }
        tail += y * y;
        i += 1;
    }
    S::reduce_add(S::add(S::add(a[0], a[1]), S::add(a[2], a[3]))) + tail
}

#[inline(always)]
unsafe fn sq_step<S: Native, const FUSED: bool>(r: *mut f32, x: *const f32, i: usize, acc: S::V) -> S::V {
    let mut y = S::load(r.add(i));
    if FUSED {
        y = S::add(y, S::load(x.add(i)));
        S::store(r.add(i), y);
    }
    S::fma(y, y, acc)
}

#[inline(always)]
unsafe fn row<S: Native, const FUSED: bool>(
    r: *mut f32,
    x: *const f32,
    w: *const f32,
    o: *mut f32,
    dim: usize,
    eps: f32,
) {
    let ss = sum_sq::<S, FUSED>(r, x, dim);
    let inv = (1.0 / (ss as f64 / dim as f64 + eps as f64).sqrt()) as f32;
    let l = S::LANES;
    let vi = S::splat(inv);
    let mut i = 0;
    while i + l <= dim {
        S::store(o.add(i), S::mul(S::mul(S::load(r.add(i)), vi), S::load(w.add(i))));
        i += l;
    }
    while i < dim {
        *o.add(i) = *r.add(i) * inv * *w.add(i);
        i += 1;
    }
}

/// Plain f64 references for the tests.
pub mod reference {
    /// `rmsnorm` of each row of `w.len()` values, in f64.
    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(w.len()) {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / w.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * inv * g as f64));
        }
        out
    }
}
