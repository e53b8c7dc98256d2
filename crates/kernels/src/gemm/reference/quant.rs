//! Plain scalar references: GGUF block dequantization (the arithmetic of ggml's
//! `dequantize_row_*`, value for value), a simple quantizer that makes valid blocks for
//! tests, and the fixed-order dot product every matmul path reproduces.

use crate::gemm::gguf::{
    group, has_mins, iq4xs_scale, q3k_scale, scale_min_k4, GROUP, IQ4XS_QS, IQ4_LEVELS, Q2K_D, Q2K_QS, Q3K_D, Q3K_QS,
};
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
        DType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0xF) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            // Q5_0: (q - 16) d; Q5_1: q d + m (its m before qh).
            let q51 = dtype == DType::Q5_1;
            let (o, off) = if q51 { (4, 0) } else { (2, 16) };
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
            let qs = &b[o + 4..o + 20];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((qs[j] & 0xF) as u32 | xh0) as i32 - off;
                let x1 = ((qs[j] >> 4) as u32 | xh1) as i32 - off;
                (y[j], y[j + 16]) =
                    if q51 { (x0 as f32 * d + m, x1 as f32 * d + m) } else { (x0 as f32 * d, x1 as f32 * d) };
            }
        }
        DType::IQ4NL => iq4_values(f16_at(b, 0), &b[2..18], y),
        DType::IQ4XS => {
            let d = f16_at(b, 0);
            for ib in 0..8 {
                let qs = &b[IQ4XS_QS + 16 * ib..IQ4XS_QS + 16 * ib + 16];
                iq4_values(d * iq4xs_scale(b, ib) as f32, qs, &mut y[32 * ib..32 * ib + 32]);
            }
        }
        DType::Q2K => {
            let (d, min) = (f16_at(b, Q2K_D), f16_at(b, Q2K_D + 2));
            // Sub-block 2j + h: two bits at 2 (j % 4) of qs[32 (j / 4) + l], scale and min the
            // low and high nibble of byte 2j + h.
            for j in 0..8 {
                let q = &b[Q2K_QS + 32 * (j / 4)..];
                for (h, l0) in [(0, 0), (1, 16)] {
                    let sc = b[2 * j + h];
                    let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                    for l in l0..l0 + 16 {
                        y[32 * j + l] = dl * ((q[l] >> (2 * (j % 4))) & 3) as f32 - ml;
                    }
                }
            }
        }
        DType::Q3K => {
            let d = f16_at(b, Q3K_D);
            let (hm, qs) = (&b[..32], &b[Q3K_QS..Q3K_QS + 64]);
            // Sub-block is = 2j, 2j + 1 of group j: two bits at 2 (j % 4) of qs[32 (j / 4) + l],
            // minus 4 unless bit j of hmask[l] is set.
            for j in 0..8 {
                let q = &qs[32 * (j / 4)..];
                for (h, l0) in [(0, 0), (1, 16)] {
                    let dl = d * q3k_scale(b, 2 * j + h) as f32;
                    for l in l0..l0 + 16 {
                        let v = ((q[l] >> (2 * (j % 4))) & 3) as i32 - if hm[l] & (1 << j) != 0 { 0 } else { 4 };
                        y[32 * j + l] = dl * v as f32;
                    }
                }
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

/// 32 IQ4 values: `d * level` of the low nibbles of `qs` (values 0..16), then the high ones.
fn iq4_values(d: f32, qs: &[u8], y: &mut [f32]) {
    for j in 0..16 {
        y[j] = d * IQ4_LEVELS[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * IQ4_LEVELS[(qs[j] >> 4) as usize] as f32;
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

/// The largest f16 that is <= `v` (finite), saturating at `-f16::MAX`.
fn f16_at_most(v: f32) -> f16 {
    if v < 0.0 {
        return -f16_at_least(-v);
    }
    let h = f16::from_f32(v);
    if h.to_f32() > v {
        f16::from_bits(h.to_bits() - 1)
    } else {
        h
    }
}

/// Sub-block scales for the steps `need` (each >= 0): an f16 super-scale `d` rounded up so
/// that `max` integer steps cover the largest, and per sub-block the integer `ceil(need / d)`
/// in `0..=max`, so `d * s >= need` (both 0 when every step is 0).
fn sub_scales(need: &[f32], max: i32) -> (f16, f32, Vec<i32>) {
    let d = f16_at_least(need.iter().fold(0f32, |a, &v| a.max(v)) / max as f32);
    let dv = d.to_f32();
    (d, dv, need.iter().map(|&n| if dv == 0.0 { 0 } else { ((n / dv).ceil() as i32).clamp(0, max) }).collect())
}

/// Largest magnitude of each `n`-value run of `x`, divided by `steps`.
fn run_steps(x: &[f32], n: usize, steps: f32) -> Vec<f32> {
    x.chunks_exact(n).map(|s| s.iter().fold(0f32, |a, v| a.max(v.abs())) / steps).collect()
}

/// Index of the IQ4 level nearest to `v`.
fn nearest_level(v: f32) -> u8 {
    let dist = |i: usize| (IQ4_LEVELS[i] as f32 - v).abs();
    (0..16).min_by(|&a, &b| dist(a).total_cmp(&dist(b))).unwrap_or(8) as u8
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
            DType::Q4_1 | DType::Q5_1 => quantize_block_1(dtype, blk, &mut out),
            DType::IQ4NL => quantize_block_iq4nl(blk, &mut out),
            DType::IQ4XS => quantize_block_iq4xs(blk, &mut out),
            DType::Q3K => quantize_block_q3k(blk, &mut out),
            DType::Q2K => quantize_block_q2k(blk, &mut out),
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

/// Q4_1 / Q5_1: one f16 scale `d` and min `m` (rounded down), value = q * d + m.
fn quantize_block_1(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let nmax = if dtype == DType::Q4_1 { 15 } else { 31 };
    let lo = x.iter().fold(f32::MAX, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::MIN, |a, &v| a.max(v));
    let m = f16_at_most(lo);
    let mv = m.to_f32();
    let d = f16_at_least(((hi - mv) / nmax as f32).max(0.0));
    let dv = d.to_f32();
    let q: Vec<u32> =
        x.iter().map(|&v| if dv == 0.0 { 0 } else { clamp_round((v - mv) / dv, 0, nmax) as u32 }).collect();
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&m.to_le_bytes());
    if dtype == DType::Q5_1 {
        let qh = (0..32).fold(0u32, |h, j| h | (((q[j] >> 4) & 1) << j));
        out.extend_from_slice(&qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| ((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)) as u8));
}

/// 32 values as IQ4 nibbles of scale `d` (low nibbles values 0..16, high 16..32).
fn iq4_nibbles(x: &[f32], d: f32, out: &mut Vec<u8>) {
    let idx: Vec<u8> = x.iter().map(|&v| if d == 0.0 { 8 } else { nearest_level(v / d) }).collect();
    out.extend((0..16).map(|j| idx[j] | (idx[j + 16] << 4)));
}

/// The least IQ4 scale whose levels (-127..=113) cover `x`.
fn iq4_step(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &v| a.max(if v > 0.0 { v / 113.0 } else { -v / 127.0 }))
}

/// IQ4_NL: one f16 scale covering the block with the levels' range.
fn quantize_block_iq4nl(x: &[f32], out: &mut Vec<u8>) {
    let d = f16_at_least(iq4_step(x));
    out.extend_from_slice(&d.to_le_bytes());
    iq4_nibbles(x, d.to_f32(), out);
}

/// IQ4_XS: 8 groups of 32, value = d * (ls - 32) * level with 6-bit ls (here 32..=63).
fn quantize_block_iq4xs(x: &[f32], out: &mut Vec<u8>) {
    let need: Vec<f32> = x.chunks_exact(32).map(iq4_step).collect();
    let (d, dv, s) = sub_scales(&need, 31);
    let ls: Vec<u32> = s.iter().map(|&s| s as u32 + 32).collect();
    out.extend_from_slice(&d.to_le_bytes());
    let sh = (0..8).fold(0u16, |h, j| h | (((ls[j] >> 4) as u16) << (2 * j)));
    out.extend_from_slice(&sh.to_le_bytes());
    out.extend((0..4).map(|i| ((ls[2 * i] & 0xF) | ((ls[2 * i + 1] & 0xF) << 4)) as u8));
    for (j, g) in x.chunks_exact(32).enumerate() {
        iq4_nibbles(g, dv * s[j] as f32, out);
    }
}

/// Q3_K: 16 sub-blocks of 16, value = d * (s - 32) * (q - 4) with 6-bit s (here 32..=63).
fn quantize_block_q3k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dv, s) = sub_scales(&run_steps(x, 16, 3.0), 31);
    let u: Vec<u8> = (0..256)
        .map(|i| {
            let dq = dv * s[i / 16] as f32;
            (if dq == 0.0 { 0 } else { clamp_round(x[i] / dq, -4, 3) } + 4) as u8
        })
        .collect();
    let (mut hm, mut qs, mut sc) = ([0u8; 32], [0u8; 64], [0u8; 12]);
    for j in 0..8 {
        for l in 0..32 {
            let v = u[32 * j + l];
            qs[32 * (j / 4) + l] |= (v & 3) << (2 * (j % 4));
            hm[l] |= (v >> 2) << j;
        }
    }
    for (j, &s) in s.iter().enumerate() {
        let ls = s as u8 + 32;
        sc[j % 8] |= (ls & 0xF) << (4 * (j / 8));
        sc[8 + j % 4] |= (ls >> 4) << (2 * (j / 4));
    }
    out.extend_from_slice(&hm);
    out.extend_from_slice(&qs);
    out.extend_from_slice(&sc);
    out.extend_from_slice(&d.to_le_bytes());
}

/// Per `n`-value run of `x`: an f16 super-min `dmin` (rounded up) and integer mins `m` in
/// `0..=max` with `dmin * m >= -min(run, 0)`, those products, and the run's largest value.
fn run_mins(x: &[f32], n: usize, max: i32) -> (f16, Vec<u8>, Vec<f32>, Vec<f32>) {
    let lo: Vec<f32> = x.chunks_exact(n).map(|s| s.iter().fold(0f32, |a, &v| a.min(v))).collect();
    let hi: Vec<f32> = x.chunks_exact(n).map(|s| s.iter().fold(f32::MIN, |a, &v| a.max(v))).collect();
    let dmin = f16_at_least(lo.iter().fold(0f32, |a, &v| a.max(-v)) / max as f32);
    let dminv = dmin.to_f32();
    let m: Vec<u8> =
        lo.iter().map(|&l| if dminv == 0.0 { 0 } else { ((-l / dminv).ceil() as i32).clamp(0, max) as u8 }).collect();
    let mnq: Vec<f32> = m.iter().map(|&m| dminv * m as f32).collect();
    (dmin, m, mnq, hi)
}

/// Q2_K: 16 sub-blocks of 16, value = d*sc*q - dmin*m with 4-bit sc, m and 2-bit q.
fn quantize_block_q2k(x: &[f32], out: &mut Vec<u8>) {
    let (dmin, m, mnq, hi) = run_mins(x, 16, 15);
    let need: Vec<f32> = (0..16).map(|s| ((hi[s] + mnq[s]) / 3.0).max(0.0)).collect();
    let (d, dv, sc) = sub_scales(&need, 15);
    let mut qs = [0u8; 64];
    for (i, &xi) in x.iter().enumerate().take(256) {
        let (s, j, l) = (i / 16, i / 32, i % 32);
        let dq = dv * sc[s] as f32;
        let q = if dq == 0.0 { 0 } else { clamp_round((xi + mnq[s]) / dq, 0, 3) as u8 };
        qs[32 * (j / 4) + l] |= q << (2 * (j % 4));
    }
    out.extend((0..16).map(|s| sc[s] as u8 | (m[s] << 4)));
    out.extend_from_slice(&qs);
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
}

/// Q4_K / Q5_K: 8 sub-blocks of 32, value = d*sc*q - dmin*m with 6-bit sc, m.
fn quantize_block_k(dtype: DType, x: &[f32], out: &mut Vec<u8>) {
    let nmax: i32 = if dtype == DType::Q4K { 15 } else { 31 };
    let (dmin, m, mnq, hi) = run_mins(x, 32, 63);
    let need: Vec<f32> = (0..8).map(|s| ((hi[s] + mnq[s]) / nmax as f32).max(0.0)).collect();
    let (d, dv, sc) = sub_scales(&need, 63);
    let sc: Vec<u8> = sc.iter().map(|&s| s as u8).collect();
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
    let (d, dv, sc) = sub_scales(&run_steps(x, 16, 31.0), 127);
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
        let s = (gr.ms[0] * h0 + gr.ms[1] * h1) as f64;
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
                    + 2.01
                        * u
                        * ((a * (gr.sc[e / 16] * gr.w[e] as i32) as f64).abs() + (m * gr.ms[e / 16] as f64).abs())
                        * xh.abs()
            };
        }
    }
    let n = ng.div_ceil(CHAINS) * if mins { 2 } else { 1 };
    Ok(FastReference { value, rounding: (n + 5) as f64 * u * mag * 1.001, quantization: quant })
}
