//! Block formats: hand-built blocks against values worked out by hand from the GGUF layouts,
//! quantize -> dequantize round trips within stated bounds, and input errors.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
use tboost_kernels::DType;

const QUANT: [DType; 6] = [DType::Q4_0, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K];

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
    tiny + match dt {
        DType::Q8_0 => amax / 254.0 * slack,
        DType::Q4_0 => amax / 14.0 * slack,
        DType::Q5_0 => amax / 30.0 * slack,
        DType::Q6K => amax / 31.0 * slack,
        DType::Q4K | DType::Q5K => {
            let lo = x.iter().fold(0f32, |a, &v| a.min(v));
            let hi = x.iter().fold(f32::MIN, |a, &v| a.max(v));
            let nmax = if dt == DType::Q4K { 15.0 } else { 31.0 };
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
            DType::Q5_0 | DType::Q5K => 0.03,
            _ => 0.06,
        };
        assert!(rms < limit, "{dt}: rms error {rms} above {limit}");
    }
}
