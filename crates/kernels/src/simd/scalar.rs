//! Portable lanes: [`Scalar`] (one native lane) and [`Scalar16`] (the canonical 16 lanes as
//! an array).

use super::{F32x16, Native};

/// Portable fallback: one lane.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Native for Scalar {
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

/// Portable implementation: 16 scalar lanes, `f32::mul_add` for the fused step.
#[derive(Clone, Copy)]
pub(crate) struct Scalar16([f32; 16]);

impl F32x16 for Scalar16 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar16([0.0; 16])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Scalar16(std::array::from_fn(|l| p.add(l).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        Scalar16(std::array::from_fn(|l| {
            half::f16::from_bits((p.add(2 * l) as *const u16).read_unaligned().to_le()).to_f32()
        }))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        Scalar16(std::array::from_fn(|l| {
            f32::from_bits(((p.add(2 * l) as *const u16).read_unaligned().to_le() as u32) << 16)
        }))
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
    unsafe fn mul(a: Self, b: Self) -> Self {
        Scalar16(std::array::from_fn(|l| a.0[l] * b.0[l]))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Scalar16(std::array::from_fn(|l| a.0[l] - b.0[l]))
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
