//! Plain scalar references: GGUF block dequantization (the arithmetic of ggml's
//! `dequantize_row_*`, value for value), a simple quantizer that makes valid blocks for
//! tests, and the fixed-order dot product every matmul path reproduces.

use crate::gemm::gguf::{group, has_mins, scale_min_k4, GROUP};
use crate::DType;
use half::f16;

/// Elements per 16-lane accumulator chunk: the unit of the fixed reduction order.
pub(crate) const LANES: usize = 16;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one block (`dtype.block_bytes()` bytes) into `y` (`dtype.block_elems()` values).
/// Each value is computed with the same f32 operations, in the same order, as ggml's C code
/// (without floating-point contraction).
pub(crate) fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                y[j] = (((qs[j] & 0xF) as u32 | xh0) as i32 - 16) as f32 * d;
                y[j + 16] = (((qs[j] >> 4) as u32 | xh1) as i32 - 16) as f32 * d;
            }
        }
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        DType::Q4K => {
            let d = f16_at(b, 0);
            let min = f16_at(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for p in 0..4 {
                let (sc, m) = scale_min_k4(2 * p, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = scale_min_k4(2 * p + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                let q = &qs[32 * p..32 * p + 32];
                for l in 0..32 {
                    y[64 * p + l] = d1 * (q[l] & 0xF) as f32 - m1;
                    y[64 * p + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        DType::Q5K => {
            let d = f16_at(b, 0);
            let min = f16_at(b, 2);
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for p in 0..4 {
                let (sc, m) = scale_min_k4(2 * p, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = scale_min_k4(2 * p + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                let (u1, u2) = (1u8 << (2 * p), 2u8 << (2 * p));
                let ql = &qs[32 * p..32 * p + 32];
                for l in 0..32 {
                    let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[64 * p + l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
                    y[64 * p + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
                }
            }
        }
        DType::Q6K => {
            let d = f16_at(b, 208);
            for n in 0..2 {
                let ql = &b[64 * n..64 * n + 64];
                let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                let y = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * sc[is] as i8 as f32 * q1 as f32;
                    y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
                    y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
                    y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
                }
            }
        }
        _ => unreachable!("dequantize_block is only called for block types"),
    }
}

/// Dequantizes a run of `dtype` blocks into `out` (scalar reference, bit-identical to ggml's
/// `dequantize_row_*`). `bytes` must hold exactly the blocks for `out.len()` values.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    if !dtype.is_quantized() {
        return Err(format!("dequantize_row: {dtype} is not a block-quantized type"));
    }
    let need = dtype.bytes_for(out.len()).ok_or_else(|| {
        format!(
            "dequantize_row: {} values is not a whole number of {dtype} blocks ({} values each)",
            out.len(),
            dtype.block_elems()
        )
    })?;
    if bytes.len() != need {
        return Err(format!("dequantize_row: {} {dtype} values need {need} bytes, got {}", out.len(), bytes.len()));
    }
    for (b, y) in bytes.chunks_exact(dtype.block_bytes()).zip(out.chunks_exact_mut(dtype.block_elems())) {
        dequantize_block(dtype, b, y);
    }
    Ok(())
}

/// The smallest f16 that is >= `v` (`v` >= 0 and finite), saturating at `f16::MAX`, so a
/// scale rounded to f16 still covers the range it was computed for.
fn f16_at_least(v: f32) -> f16 {
    let h = f16::from_f32(v);
    let h = if h.to_f32() < v { f16::from_bits(h.to_bits() + 1) } else { h };
    if h.is_infinite() {
        f16::MAX
    } else {
        h
    }
}

/// Index of the nearest of `0..=hi - lo` steps, i.e. `round(v)` clamped to `lo..=hi`.
fn clamp_round(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

/// Quantizes `x` into `dtype` blocks. For tests only: it makes valid blocks with bounded
/// error (scales are rounded *up* to f16 / 6 bits so the range is always covered, and each
/// value then lands within half a step), not the error-minimizing blocks llama.cpp makes.
/// Bounds, per block of `x` with `amax = max |x|`: Q8_0 `amax/254`, Q4_0 `amax/14`,
/// Q5_0 `amax/30` (plus f16 rounding of the scale); K-quants within one step of the
/// super-block range divided by `2^bits - 1`.
pub fn quantize_row_reference(dtype: DType, x: &[f32]) -> Result<Vec<u8>, String> {
    if !dtype.is_quantized() {
        return Err(format!("quantize_row_reference: {dtype} is not a block-quantized type"));
    }
    let qk = dtype.block_elems();
    if !x.len().is_multiple_of(qk) {
        return Err(format!(
            "quantize_row_reference: {} values is not a whole number of {dtype} blocks ({qk} values each)",
            x.len()
        ));
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(format!("quantize_row_reference: value {i} is {} (not finite)", x[i]));
    }
    let mut out = Vec::with_capacity(x.len() / qk * dtype.block_bytes());
    for blk in x.chunks_exact(qk) {
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => quantize_block_0(dtype, blk, &mut out),
            DType::Q4K | DType::Q5K => quantize_block_k(dtype, blk, &mut out),
            DType::Q6K => quantize_block_q6k(blk, &mut out),
            _ => unreachable!("checked above: {dtype} is block-quantized"),
        }
    }
    Ok(out)
}

/// Symmetric 32-value blocks: one f16 scale `d`, value = q * d.
fn quantize_block_0(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (qmax, qmin) = match dtype {
        DType::Q8_0 => (127, -127),
        DType::Q4_0 => (7, -8),
        _ => (15, -16),
    };
    let d = f16_at_least(amax / qmax as f32);
    let dv = d.to_f32();
    let q: Vec<i32> = x.iter().map(|&v| if dv == 0.0 { 0 } else { clamp_round(v / dv, qmin, qmax) }).collect();
    out.extend_from_slice(&d.to_le_bytes());
    match dtype {
        DType::Q8_0 => out.extend(q.iter().map(|&q| q as i8 as u8)),
        DType::Q4_0 => out.extend((0..16).map(|j| ((q[j] + 8) | ((q[j + 16] + 8) << 4)) as u8)),
        _ => {
            let u: Vec<u32> = q.iter().map(|&q| (q + 16) as u32).collect();
            let qh = (0..32).fold(0u32, |h, j| h | (((u[j] >> 4) & 1) << j));
            out.extend_from_slice(&qh.to_le_bytes());
            out.extend((0..16).map(|j| ((u[j] & 0xF) | ((u[j + 16] & 0xF) << 4)) as u8));
        }
    }
}

/// Q4_K / Q5_K: 8 sub-blocks of 32, value = d*sc*q - dmin*m with 6-bit sc, m.
fn quantize_block_k(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let nmax: i32 = if dtype == DType::Q4K { 15 } else { 31 };
    let lo: Vec<f32> = x.chunks_exact(32).map(|s| s.iter().fold(0f32, |a, &v| a.min(v))).collect();
    let hi: Vec<f32> = x.chunks_exact(32).map(|s| s.iter().fold(f32::MIN, |a, &v| a.max(v))).collect();
    let dmin = f16_at_least(lo.iter().fold(0f32, |a, &v| a.max(-v)) / 63.0);
    let dminv = dmin.to_f32();
    let m: Vec<u8> =
        lo.iter().map(|&l| if dminv == 0.0 { 0 } else { ((-l / dminv).ceil() as i32).clamp(0, 63) as u8 }).collect();
    let mnq: Vec<f32> = m.iter().map(|&m| dminv * m as f32).collect();
    let need: Vec<f32> = (0..8).map(|s| ((hi[s] + mnq[s]) / nmax as f32).max(0.0)).collect();
    let d = f16_at_least(need.iter().fold(0f32, |a, &v| a.max(v)) / 63.0);
    let dv = d.to_f32();
    let sc: Vec<u8> =
        need.iter().map(|&n| if dv == 0.0 { 0 } else { ((n / dv).ceil() as i32).clamp(0, 63) as u8 }).collect();
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = sc[j];
            scales[j + 4] = m[j];
        } else {
            scales[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            scales[j - 4] |= (sc[j] >> 4) << 6;
            scales[j] |= (m[j] >> 4) << 6;
        }
    }
    let q: Vec<u8> = (0..256)
        .map(|i| {
            let s = i / 32;
            let dq = dv * sc[s] as f32;
            if dq == 0.0 {
                0
            } else {
                clamp_round((x[i] + mnq[s]) / dq, 0, nmax) as u8
            }
        })
        .collect();
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&scales);
    if dtype == DType::Q5K {
        let mut qh = [0u8; 32];
        for p in 0..4 {
            for l in 0..32 {
                qh[l] |= ((q[64 * p + l] >> 4) << (2 * p)) | ((q[64 * p + 32 + l] >> 4) << (2 * p + 1));
            }
        }
        out.extend_from_slice(&qh);
    }
    for p in 0..4 {
        out.extend((0..32).map(|l| (q[64 * p + l] & 0xF) | ((q[64 * p + 32 + l] & 0xF) << 4)));
    }
}

/// Q6_K: 16 sub-blocks of 16, value = d*sc*(q-32) with signed 8-bit sc.
fn quantize_block_q6k(x: &[f32], out: &mut Vec<u8>) {
    let need: Vec<f32> = x.chunks_exact(16).map(|s| s.iter().fold(0f32, |a, &v| a.max(v.abs())) / 31.0).collect();
    let d = f16_at_least(need.iter().fold(0f32, |a, &v| a.max(v)) / 127.0);
    let dv = d.to_f32();
    let sc: Vec<i8> =
        need.iter().map(|&n| if dv == 0.0 { 0 } else { ((n / dv).ceil() as i32).clamp(0, 127) as i8 }).collect();
    let l: Vec<u8> = (0..256)
        .map(|i| {
            let dq = dv * sc[i / 16] as f32;
            let q = if dq == 0.0 { 0 } else { clamp_round(x[i] / dq, -32, 31) };
            (q + 32) as u8
        })
        .collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for n in 0..2 {
        let j = 128 * n;
        for i in 0..32 {
            ql[64 * n + i] = (l[j + i] & 0xF) | ((l[j + i + 64] & 0xF) << 4);
            ql[64 * n + i + 32] = (l[j + i + 32] & 0xF) | ((l[j + i + 96] & 0xF) << 4);
            qh[32 * n + i] = (l[j + i] >> 4)
                | ((l[j + i + 32] >> 4) << 2)
                | ((l[j + i + 64] >> 4) << 4)
                | ((l[j + i + 96] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d.to_le_bytes());
}

/// Sums 16 lanes with the fixed tree every SIMD path uses: lanes l and l+8, then l and
/// l+4, then l and l+2, then 0 and 1.
#[inline]
pub(crate) fn hsum16(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

/// The one reduction order of every quantized matmul path: lane `l` accumulates
/// `x[16c + l] * w[16c + l]` with a fused multiply-add for c = 0, 1, 2, ... in turn, then
/// the 16 lanes are summed by [`hsum16`]. `x.len() == w.len()`, a multiple of 16.
pub(crate) fn dot_ordered(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (xc, wc) in x.chunks_exact(LANES).zip(w.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = xc[l].mul_add(wc[l], acc[l]);
        }
    }
    hsum16(&acc)
}

/// What a `Fast`-precision dot product of one weight row with one activation row must give
/// (the arithmetic in `quant::q8_activations`'s module doc), with its two error bounds.
#[derive(Clone, Copy, Debug)]
pub struct FastReference {
    /// `Σ_g A_g X_g D_g - M_g X_g S_g` in f64, from the exact integer group dot products of
    /// the quantized activations: the kernels' result up to the rounding of their float chain.
    pub value: f64,
    /// Bound on `|kernel - value|`: `(n + 5) 2^-24` times the summed magnitude of the chain's
    /// terms, `n` the terms per chain (each term is rounded once when it is formed, once when
    /// it joins its chain, by each later fma of the chain, and by the 4 levels of the tree).
    pub rounding: f64,
    /// Bound on `|value - Σ_e w_e x_e|`, `w` the `dequantize_row` values and `x` the f32
    /// activations: half a quantization step `X_g / 2` plus `3.01·2^-24 |x_e|` per activation
    /// (`x̂ = X q` with `q = round(fl(x * inv))`: three f32 roundings), the value itself for a
    /// group flushed to zero, and `2.01·2^-24 (|A sc w| + |M|) |x̂|` for the f32 roundings of
    /// ggml's dequantization that the integer path does not make.
    pub quantization: f64,
}

/// Independent float chains per output of the `Fast` precision (its canonical order: group
/// `g` goes to chain `g mod 16`).
pub(crate) const CHAINS: usize = 16;
/// Activation groups whose largest magnitude is below this are quantized to zero.
pub(crate) const TINY: f32 = 7.888_609e-31; // 2^-100

/// Quantizes one activation group (the `Fast` precision's arithmetic, `quant::q8_activations`): returns `X`, fills `q`, and the half
/// sums. Scalar; the SIMD versions reproduce it exactly.
pub(crate) fn quantize_group(x: &[f32], q: &mut [i8]) -> (f32, [i32; 2]) {
    let bits = x.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7FFF_FFFF));
    let amax = f32::from_bits(bits);
    if bits >= 0x7F80_0000 || amax < TINY {
        q.fill(0);
        return (if bits >= 0x7F80_0000 { f32::NAN } else { 0.0 }, [0, 0]);
    }
    let inv = 127.0 / amax;
    let mut h = [0i32; 2];
    for (e, (&v, q)) in x.iter().zip(q.iter_mut()).enumerate() {
        *q = (v * inv).round_ties_even() as i8;
        h[e / 16] += *q as i32;
    }
    (amax / 127.0, h)
}

/// The [`FastReference`] of `row` (one `dtype` weight row of `x.len()` values) with `x`.
pub fn fast_reference(dtype: DType, row: &[u8], x: &[f32]) -> Result<FastReference, String> {
    if !dtype.is_quantized() || dtype.bytes_for(x.len()) != Some(row.len()) || !x.len().is_multiple_of(GROUP) {
        return Err(format!("fast_reference: {} bytes of {dtype} do not hold {} values", row.len(), x.len()));
    }
    let u = 2f64.powi(-24);
    let mins = has_mins(dtype);
    let mut wd = vec![0f32; x.len()];
    dequantize_row(dtype, row, &mut wd)?;
    let ng = x.len() / GROUP;
    let (mut value, mut mag, mut quant) = (0f64, 0f64, 0f64);
    for g in 0..ng {
        let xs = &x[g * GROUP..(g + 1) * GROUP];
        let mut q = [0i8; GROUP];
        let (xg, [h0, h1]) = quantize_group(xs, &mut q);
        let gr = group(dtype, row, g);
        let d: i64 = (0..GROUP).map(|e| gr.sc[e / 16] as i64 * gr.w[e] as i64 * q[e] as i64).sum();
        let s = (h0 + h1) as f64;
        let (a, m, xg) = (gr.a as f64, gr.m as f64, xg as f64);
        value += a * xg * d as f64 - m * xg * s;
        mag += (a * xg * d as f64).abs() + if mins { (m * xg * s).abs() } else { 0.0 };
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        for e in 0..GROUP {
            let (w, xe, xh) = (wd[g * GROUP + e].abs() as f64, xs[e] as f64, xg * q[e] as f64);
            quant += if amax < TINY {
                w * xe.abs()
            } else {
                w * (xg / 2.0 + 3.01 * u * xe.abs())
                    + 2.01 * u * ((a * (gr.sc[e / 16] * gr.w[e] as i32) as f64).abs() + m.abs()) * xh.abs()
            };
        }
    }
    let n = ng.div_ceil(CHAINS) * if mins { 2 } else { 1 };
    Ok(FastReference { value, rounding: (n + 5) as f64 * u * mag * 1.001, quantization: quant })
}
