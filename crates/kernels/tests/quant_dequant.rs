//! Block formats: hand-built blocks against values worked out by hand from the GGUF layouts,
//! quantize -> dequantize round trips within stated bounds, and input errors.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
use tboost_kernels::DType;

mod quant_util;
use quant_util::QUANT;

/// The 16 IQ4 levels, as ggml-common.h lists them (`kvalues_iq4nl`).
const LEVELS: [f32; 16] =
    [-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0];

fn h(v: f32) -> [u8; 2] {
    let x = f16::from_f32(v);
    assert_eq!(x.to_f32(), v, "test scale {v} must be exact in f16");
    x.to_le_bytes()
}

fn deq(dtype: DType, b: &[u8]) -> Vec<f32> {
    let mut y = vec![f32::NAN; b.len() / dtype.block_bytes() * dtype.block_elems()];
    dequantize_row(dtype, b, &mut y).unwrap();
    y
}

/// Compares exactly (bit patterns, so -0.0 vs 0.0 would be caught too only where we care).
fn assert_values(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "{what}: value {i} is {g}, expected {w}");
    }
}

#[test]
fn q8_0_hand_built() {
    // d = 0.5; qs are signed bytes.
    let mut b = h(0.5).to_vec();
    let qs: [i8; 32] = std::array::from_fn(|j| [1, -2, 127, -128][j % 4]);
    b.extend(qs.iter().map(|&q| q as u8));
    let want: Vec<f32> = (0..32).map(|j| [0.5, -1.0, 63.5, -64.0][j % 4]).collect();
    assert_values(&deq(DType::Q8_0, &b), &want, "q8_0");
}

#[test]
fn q4_0_hand_built() {
    // d = 2; value j is the low nibble of qs[j], value j+16 its high nibble, both minus 8.
    let mut b = h(2.0).to_vec();
    let mut qs = [0x88u8; 16];
    qs[0] = 0xF0; // y[0] = (0-8)*2 = -16, y[16] = (15-8)*2 = 14
    qs[1] = 0x98; // y[1] = 0, y[17] = 2
    qs[15] = 0x1F; // y[15] = 14, y[31] = -14
    b.extend_from_slice(&qs);
    let mut want = vec![0f32; 32];
    (want[0], want[16], want[1], want[17], want[15], want[31]) = (-16.0, 14.0, 0.0, 2.0, 14.0, -14.0);
    assert_values(&deq(DType::Q4_0, &b), &want, "q4_0");
}

#[test]
fn q5_0_hand_built() {
    // d = -1 (negative scale); bit j of qh is the fifth bit of value j; values minus 16.
    let mut b = h(-1.0).to_vec();
    let qh: u32 = (1 << 0) | (1 << 17) | (1 << 31);
    b.extend_from_slice(&qh.to_le_bytes());
    let mut qs = [0x00u8; 16];
    qs[0] = 0x2F; // y[0] = (15|16)-16 = 15, y[16] = 2-16 = -14
    qs[1] = 0x3A; // y[1] = 10-16 = -6, y[17] = (3|16)-16 = 3
    qs[15] = 0xF0; // y[15] = -16, y[31] = (15|16)-16 = 15
    b.extend_from_slice(&qs);
    let mut want = vec![16f32; 32]; // 0 - 16 = -16, times d = -1
    (want[0], want[16], want[1], want[17], want[15], want[31]) = (-15.0, 14.0, 6.0, -3.0, 16.0, -15.0);
    assert_values(&deq(DType::Q5_0, &b), &want, "q5_0");
}

#[test]
fn q4_1_hand_built() {
    // Layout d, m (f16), qs[16]; value j = low nibble of qs[j] * d + m, value j+16 the high one.
    let mut b = [h(0.5), h(-2.0)].concat();
    let mut qs = [0u8; 16];
    qs[0] = 0xF0; // y[0] = 0*0.5 - 2 = -2, y[16] = 15*0.5 - 2 = 5.5
    qs[3] = 0x37; // y[3] = 7*0.5 - 2 = 1.5, y[19] = 3*0.5 - 2 = -0.5
    b.extend_from_slice(&qs);
    let mut want = vec![-2f32; 32];
    (want[16], want[3], want[19]) = (5.5, 1.5, -0.5);
    assert_values(&deq(DType::Q4_1, &b), &want, "q4_1");
}

#[test]
fn q5_1_hand_built() {
    // Layout d, m (f16), qh (u32), qs[16]; bit j of qh is the fifth bit of value j; value = q*d + m.
    let mut b = [h(0.25), h(1.0)].concat();
    let qh: u32 = (1 << 2) | (1 << 20);
    b.extend_from_slice(&qh.to_le_bytes());
    let mut qs = [0u8; 16];
    qs[2] = 0x4A; // y[2] = (10|16)*0.25 + 1 = 7.5, y[18] = 4*0.25 + 1 = 2
    qs[4] = 0x1F; // y[4] = 15*0.25 + 1 = 4.75, y[20] = (1|16)*0.25 + 1 = 5.25
    b.extend_from_slice(&qs);
    let mut want = vec![1f32; 32];
    (want[2], want[18], want[4], want[20]) = (7.5, 2.0, 4.75, 5.25);
    assert_values(&deq(DType::Q5_1, &b), &want, "q5_1");
}

#[test]
fn iq4_nl_hand_built() {
    // Layout d (f16), qs[16]; value j = d * LEVELS[low nibble of qs[j]], j+16 the high nibble.
    let mut b = h(-2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let want: Vec<f32> = (0..32).map(|i| -2.0 * if i < 16 { LEVELS[i] } else { LEVELS[31 - i] }).collect();
    assert_eq!((want[0], want[15], want[16]), (254.0, -226.0, -226.0));
    assert_values(&deq(DType::IQ4NL, &b), &want, "iq4_nl");
}

#[test]
fn iq4_xs_hand_built() {
    // Layout d (f16), scales_h (u16), scales_l[4], qs[128]. Group j (32 values) has the 6-bit
    // scale ls = nibble j%2 of scales_l[j/2] | bits 2j..2j+2 of scales_h << 4, value =
    // d * (ls - 32) * LEVELS[nibble] with the nibbles of qs[16j..16j+16] as in IQ4_NL.
    let ls: [u16; 8] = [0, 63, 32, 33, 31, 40, 16, 48];
    let mut b = h(0.5).to_vec();
    let sh: u16 = (0..8).map(|j| (ls[j] >> 4) << (2 * j)).sum();
    b.extend_from_slice(&sh.to_le_bytes());
    b.extend((0..4).map(|i| ((ls[2 * i] & 0xF) | ((ls[2 * i + 1] & 0xF) << 4)) as u8));
    for _ in 0..8 {
        b.extend((0..16u8).map(|l| l | ((15 - l) << 4)));
    }
    assert_eq!(b.len(), 136);
    let want: Vec<f32> = (0..256)
        .map(|i| {
            let (j, l) = (i / 32, i % 32);
            let lv = if l < 16 { LEVELS[l] } else { LEVELS[31 - l] };
            0.5 * (ls[j] as f32 - 32.0) * lv
        })
        .collect();
    // Group 0: scale -32; group 1: scale 31; group 2: scale 0.
    assert_eq!((want[0], want[32 + 15], want[64]), (2032.0, 1751.5, 0.0));
    assert_values(&deq(DType::IQ4XS, &b), &want, "iq4_xs");
}

#[test]
fn q3_k_hand_built() {
    // Layout hmask[32], qs[64], scales[12], d (f16). Group j (0..8, 32 values, l = 0..32):
    // q = bits 2(j%4) of qs[32(j/4) + l], minus 4 unless bit j of hmask[l] is set; scale of
    // values 16s..16s+16 is the 6-bit s_s - 32, its low 4 bits in scales[s%8] (low nibble for
    // s < 8, high for s >= 8), its top 2 bits at 2(s/4) of scales[8 + s%4]; value = d*(s-32)*q.
    let s6: [u8; 16] = [0, 63, 32, 33, 40, 20, 1, 62, 34, 35, 36, 37, 38, 39, 44, 50];
    let hm: Vec<u8> = (0..32u8).map(|l| l.wrapping_mul(37)).collect();
    let qs: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(151).wrapping_add(7)).collect();
    let mut sc = [0u8; 12];
    for (s, &v) in s6.iter().enumerate() {
        sc[s % 8] |= (v & 0xF) << (4 * (s / 8));
        sc[8 + s % 4] |= (v >> 4) << (2 * (s / 4));
    }
    let mut b = hm.clone();
    b.extend_from_slice(&qs);
    b.extend_from_slice(&sc);
    b.extend_from_slice(&h(0.25));
    let want: Vec<f32> = (0..256)
        .map(|i| {
            let (j, l) = (i / 32, i % 32);
            let q = ((qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3) as i32;
            let q = if hm[l] >> j & 1 == 1 { q } else { q - 4 };
            0.25 * (s6[i / 16] as f32 - 32.0) * q as f32
        })
        .collect();
    // Value 0: qs[0] = 7 -> 3, hmask[0] = 0 -> 3 - 4 = -1, scale 0 - 32: 0.25 * -32 * -1 = 8.
    // Value 16: qs[16] = 16*151+7 = 2423 = 0x977 -> 0x77 & 3 = 3; hmask[16] = 592 = 0x250 -> 0x50,
    // bit 0 clear: -1; scale 63 - 32 = 31: -7.75.
    assert_eq!((want[0], want[16]), (8.0, -7.75));
    assert_values(&deq(DType::Q3K, &b), &want, "q3_k");
}

#[test]
fn q2_k_hand_built() {
    // Layout scales[16], qs[64], d, dmin (f16). Sub-block s (16 values) has scale = low nibble,
    // min = high nibble of scales[s]; value 32j + l (group j, l = 0..32) has q = bits 2(j%4) of
    // qs[32(j/4) + l]; value = d*scale*q - dmin*min.
    let scales: Vec<u8> = (0..16u8).map(|s| s.wrapping_mul(7) ^ (s << 4)).collect();
    let qs: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(173).wrapping_add(29)).collect();
    let mut b = scales.clone();
    b.extend_from_slice(&qs);
    b.extend_from_slice(&[h(0.5), h(-0.25)].concat());
    let want: Vec<f32> = (0..256)
        .map(|i| {
            let (j, l, s) = (i / 32, i % 32, scales[i / 16]);
            let q = (qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
            0.5 * (s & 0xF) as f32 * q as f32 - -0.25 * (s >> 4) as f32
        })
        .collect();
    // Value 0: scales[0] = 0 -> 0*q + 0.25*0 = 0. Value 255: group 7, l = 31: qs[63] =
    // 63*173+29 = 10928 -> 0xB0, bits 6-7 = 2; scales[15] = 105 ^ 240 = 0x99: 0.5*9*2 + 0.25*9 = 11.25.
    assert_eq!((want[0], want[255]), (0.0, 11.25));
    assert_values(&deq(DType::Q2K, &b), &want, "q2_k");
}

/// 12 packed bytes for 8 (scale, min) 6-bit pairs, packed by hand for the two layouts.
fn k_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    s
}

#[test]
fn q4_k_hand_built() {
    // d = 1, dmin = 0.5. Sub-block j covers values 32j..32j+32: sub-block 2p takes the low
    // nibbles of qs[32p..32p+32], 2p+1 the high nibbles. value = d*sc*q - dmin*m.
    let sc = [2, 3, 0, 0, 17, 63, 0, 1];
    let m = [4, 1, 0, 0, 34, 63, 0, 0];
    let scales = k_scales(sc, m);
    // The packing of scales 4..8 stores their high bits in the top of bytes 0..8.
    assert_eq!(scales[0], 2 | (1 << 6));
    let mut b = [h(1.0), h(0.5)].concat();
    b.extend_from_slice(&scales);
    let mut qs = [0u8; 128];
    qs[0] = 0x5A; // y[0] = 2*10 - 2 = 18, y[32] = 3*5 - 0.5 = 14.5
    qs[64] = 0x07; // y[128] = 17*7 - 17 = 102, y[160] = 63*0 - 31.5
    qs[127] = 0xF0; // y[223] = 0 - 0 = 0, y[255] = 1*15 - 0 = 15
    b.extend_from_slice(&qs);
    let mut want = vec![0f32; 256];
    for j in 0..8 {
        for v in &mut want[32 * j..32 * j + 32] {
            *v = -0.5 * m[j] as f32;
        }
    }
    (want[0], want[32], want[128], want[160], want[223], want[255]) = (18.0, 14.5, 102.0, -31.5, 0.0, 15.0);
    assert_values(&deq(DType::Q4K, &b), &want, "q4_k");
}

#[test]
fn q5_k_hand_built() {
    // As Q4_K plus qh: bit j of qh[l] adds 16 to value l of sub-block j.
    let sc = [1, 2, 0, 0, 0, 0, 0, 40];
    let m = [0, 3, 0, 0, 0, 0, 0, 0];
    let mut b = [h(0.25), h(2.0)].concat();
    b.extend_from_slice(&k_scales(sc, m));
    let mut qh = [0u8; 32];
    qh[0] = 0b0000_0011; // y[0] += 16, y[32] += 16
    qh[31] = 0b1000_0000; // sub-block 7, l = 31: y[255] += 16
    b.extend_from_slice(&qh);
    let mut qs = [0u8; 128];
    qs[0] = 0x21; // y[0] = 0.25*1*(1+16) = 4.25, y[32] = 0.25*2*(2+16) - 6 = 3
    qs[1] = 0x0F; // y[1] = 0.25*15 = 3.75, y[33] = 0 - 6
    qs[127] = 0xF0; // y[255] = 0.25*40*(15+16) = 310
    b.extend_from_slice(&qs);
    let mut want = vec![0f32; 256];
    for v in &mut want[32..64] {
        *v = -6.0;
    }
    (want[0], want[32], want[1], want[33], want[255]) = (4.25, 3.0, 3.75, -6.0, 310.0);
    assert_values(&deq(DType::Q5K, &b), &want, "q5_k");
}

#[test]
fn q6_k_hand_built() {
    // Layout ql[128] qh[64] scales[16] d. In half n, for l in 0..32: value 128n+l uses the low
    // nibble of ql[64n+l] and bits 0-1 of qh[32n+l]; +32: low nibble of ql[64n+l+32], bits
    // 2-3; +64: high nibble of ql[64n+l], bits 4-5; +96: high nibble of ql[64n+l+32], bits
    // 6-7. q = 6-bit value - 32, value = d * scales[(index)/16] * q.
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    let mut scales = [0i8; 16];
    ql[0] = 0x3C;
    ql[32] = 0x05;
    qh[0] = 0b11_10_01_00;
    (scales[0], scales[2], scales[4], scales[6]) = (-2, 4, 3, -1);
    ql[64 + 16] = 0x01;
    qh[32 + 16] = 0x03;
    scales[9] = 2;
    scales[15] = -128;
    let mut b = ql.to_vec();
    b.extend_from_slice(&qh);
    b.extend(scales.iter().map(|&s| s as u8));
    b.extend_from_slice(&h(0.25));
    let mut want = vec![0f32; 256];
    for (i, v) in want.iter_mut().enumerate() {
        *v = 0.25 * scales[i / 16] as f32 * -32.0; // every other 6-bit value is 0
    }
    let sc = |i: usize| scales[i] as f32;
    want[0] = 0.25 * sc(0) * (12.0 - 32.0); // ql low 0xC, qh bits 0-1 = 0
    want[32] = 0.25 * sc(2) * (5.0 + 16.0 - 32.0); // ql[32] low 5, qh bits 2-3 = 1
    want[64] = 0.25 * sc(4) * (3.0 + 32.0 - 32.0); // ql[0] high 3, qh bits 4-5 = 2
    want[96] = 0.25 * sc(6) * (48.0 - 32.0); // ql[32] high 0, qh bits 6-7 = 3
    want[144] = 0.25 * sc(9) * (1.0 + 48.0 - 32.0); // second half, l = 16
    assert_eq!((want[0], want[32], want[64], want[96], want[144], want[255]), (10.0, -11.0, 2.25, -4.0, 8.5, 1024.0));
    assert_values(&deq(DType::Q6K, &b), &want, "q6_k");
}

#[test]
fn all_zero_blocks_are_zero() {
    for dt in QUANT {
        let b = vec![0u8; 3 * dt.block_bytes()];
        let y = deq(dt, &b);
        // Q4_0/Q5_0/Q6_K store offset values: zero scale still gives 0 * q = 0.
        assert!(y.iter().all(|&v| v == 0.0), "{dt}: zero block must dequantize to zeros");
    }
}

#[test]
fn dequantize_row_checks_sizes() {
    let mut y = vec![0f32; 64];
    let e = dequantize_row(DType::Q8_0, &[0u8; 34], &mut y).unwrap_err();
    assert!(e.contains("68 bytes, got 34"), "{e}");
    let e = dequantize_row(DType::Q4K, &[0u8; 144], &mut y).unwrap_err();
    assert!(e.contains("not a whole number of q4_k blocks"), "{e}");
    let e = dequantize_row(DType::F16, &[0u8; 128], &mut y).unwrap_err();
    assert!(e.contains("f16 is not a block-quantized type"), "{e}");
    let e = quantize_row_reference(DType::Q5_0, &[0.0; 33]).unwrap_err();
    assert!(e.contains("33 values"), "{e}");
    let e = quantize_row_reference(DType::Q8_0, &[0.0, f32::NAN].repeat(16)).unwrap_err();
    assert!(e.contains("value 1 is NaN"), "{e}");
}

/// Error bound of `quantize_row_reference` for one block (see its doc).
fn bound(dt: DType, x: &[f32]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    // f16 rounding of the scale adds at most 2^-10 relative; the K-quant bounds are one full
    // step of the super-block range (scale and min rounded up by up to one 6-bit step).
    // Scales below the smallest f16 subnormal (2^-24) are rounded up to it: an absolute term.
    let slack = 1.0 + 1.0 / 512.0;
    let tiny = 2f32.powi(-24);
    // IQ4: at the smallest scale, half the widest gap between levels.
    let tiny = if matches!(dt, DType::IQ4NL | DType::IQ4XS) { 12.0 * tiny * slack } else { tiny };
    tiny + match dt {
        DType::Q8_0 => amax / 254.0 * slack,
        DType::Q4_0 => amax / 14.0 * slack,
        DType::Q5_0 => amax / 30.0 * slack,
        DType::Q6K => amax / 31.0 * slack,
        // Half the widest gap between levels (24) of a scale that puts the top level (113) at
        // most at amax; IQ4_XS: the group scale within a 31st of the block's largest.
        DType::IQ4NL => amax * 12.0 / 113.0 * slack,
        DType::IQ4XS => amax * 12.0 / 113.0 * (1.0 + 1.0 / 31.0) * slack,
        // Half a step of amax / 3 (levels -4..=3), the scale within a 31st of the largest.
        DType::Q3K => amax / 6.0 * (1.0 + 1.0 / 31.0) * slack,
        DType::Q2K | DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => {
            let lo = x.iter().fold(0f32, |a, &v| a.min(v));
            let hi = x.iter().fold(f32::MIN, |a, &v| a.max(v));
            let nmax = match dt {
                DType::Q2K => 3.0,
                DType::Q4K | DType::Q4_1 => 15.0,
                _ => 31.0,
            };
            (hi - lo) / nmax * slack
        }
        _ => unreachable!(),
    }
}

#[test]
fn round_trip_within_bounds() {
    let mut rng = StdRng::seed_from_u64(7);
    for dt in QUANT {
        let qk = dt.block_elems();
        for case in 0..40 {
            // Magnitudes from 1e-6 to 1e4; some blocks all positive, all negative, all zero,
            // or with one outlier.
            let scale = 10f32.powi(rng.random_range(-6..=4));
            let mut x: Vec<f32> = (0..qk).map(|_| rng.random_range(-1.0f32..1.0) * scale).collect();
            match case % 5 {
                1 => x.iter_mut().for_each(|v| *v = v.abs()),
                2 => x.iter_mut().for_each(|v| *v = -v.abs()),
                3 => x.iter_mut().for_each(|v| *v = 0.0),
                4 => x[rng.random_range(0..qk)] = 50.0 * scale,
                _ => {}
            }
            let b = quantize_row_reference(dt, &x).unwrap();
            assert_eq!(b.len(), dt.block_bytes());
            let y = deq(dt, &b);
            let tol = bound(dt, &x);
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                assert!((a - b).abs() <= tol, "{dt} case {case} value {i}: {a} -> {b}, error above {tol}");
            }
        }
    }
}

#[test]
fn round_trip_is_tight_for_smooth_data() {
    // Guards against a quantizer that is valid but useless: the typical error must be well
    // under the worst-case bound (a few percent of the range for 4 bits).
    let mut rng = StdRng::seed_from_u64(8);
    for dt in QUANT {
        let x: Vec<f32> = (0..dt.block_elems() * 8).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let y = deq(dt, &quantize_row_reference(dt, &x).unwrap());
        let rms = (x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
        let limit = match dt {
            DType::Q8_0 => 0.005,
            DType::Q6K => 0.02,
            DType::Q5_0 | DType::Q5_1 | DType::Q5K => 0.03,
            DType::Q3K => 0.15,
            DType::Q2K => 0.25,
            _ => 0.06,
        };
        assert!(rms < limit, "{dt}: rms error {rms} above {limit}");
    }
}
