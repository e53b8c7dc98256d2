//! The int8 KV cache rows: GGUF's Q8_0 block (`ggml-common.h` `block_q8_0`: an f16 scale `d`
//! and 32 signed bytes, value = `d * q`), as llama.cpp stores its `-ctk q8_0` cache. A head
//! row of `head_dim` values (a multiple of 32) is `head_dim / 32` consecutive blocks, so K and
//! V cost 34 bytes per 32 values: 53% of f16, 27% of f32.
//!
//! Each block is stored rotated: the cache holds `Q8_0(H x)`, with `H` the normalized 32-point
//! Walsh–Hadamard matrix ([`rotate`]). Keys of real models carry a few channels far larger
//! than the rest (Qwen2's k bias), and one such channel sets the step of its whole block;
//! `H` spreads it over all 32 values, so the step follows the block's RMS instead of its
//! outlier (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456). `H` is orthonormal and its own
//! inverse, so `q·k = Hq·Hk` and `Σ p v = H Σ p Hv`: the kernels read the cache as it is,
//! with the query rotated once per call and their output rotated back (`super::in_rotated`).
//!
//! Quantization follows llama.cpp's `quantize_row_q8_0_ref` on the rotated block: `d = max|y|
//! / 127`, `q = round(y / d)` (ties away from zero), `d` stored as f16. Reading multiplies by
//! the stored (rounded) scale, so the writer and every reader agree on the values.

/// Values per block.
pub const BLOCK: usize = 32;
/// Bytes per block: the f16 scale and the 32 quants.
pub const BLOCK_BYTES: usize = 2 + BLOCK;

/// Bytes of a row of `n` values (`n % 32 == 0`).
pub fn row_bytes(n: usize) -> usize {
    n / BLOCK * BLOCK_BYTES
}

/// `1 / sqrt(32)`: makes the transform orthonormal.
const NORM: f32 = 0.176_776_7;

/// The normalized Walsh–Hadamard transform of every 32-value block of `x`, in place. Applying
/// it twice gives `x` back (up to f32 rounding).
pub fn rotate(x: &mut [f32]) {
    assert!(x.len().is_multiple_of(BLOCK), "kv_q8::rotate: {} values is not a multiple of 32", x.len());
    for b in x.chunks_exact_mut(BLOCK) {
        let mut h = 1;
        while h < BLOCK {
            for i in (0..BLOCK).step_by(2 * h) {
                for j in i..i + h {
                    let (a, c) = (b[j], b[j + h]);
                    b[j] = a + c;
                    b[j + h] = a - c;
                }
            }
            h *= 2;
        }
        for v in b.iter_mut() {
            *v *= NORM;
        }
    }
}

/// Quantizes `src` (`len % 32 == 0`), each block rotated by `H`, into `dst`
/// (`row_bytes(src.len())` bytes).
pub fn quantize_row(src: &[f32], dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(BLOCK) && dst.len() == row_bytes(src.len()),
        "kv_q8::quantize_row: {} values into {} bytes (need a multiple of 32 values, 34 bytes per 32)",
        src.len(),
        dst.len()
    );
    for (src, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let mut x = [0f32; BLOCK];
        x.copy_from_slice(src);
        rotate(&mut x);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, v) in b[2..].iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

/// Dequantizes `n` values (`n % 32 == 0`) of the Q8_0 row at `src` into `dst`: the rotated
/// values `H x` ([`rotate`] them to get `x`).
///
/// # Safety
/// `src` readable for `row_bytes(n)` bytes, `dst` writable for `n` f32. Inlined into the
/// attention kernels' ISA entry points, where the inner loop vectorizes.
#[inline(always)]
pub unsafe fn dequantize_row(src: *const u8, dst: *mut f32, n: usize) {
    for blk in 0..n / BLOCK {
        let b = src.add(blk * BLOCK_BYTES);
        let d = half::f16::from_le_bytes([*b, *b.add(1)]).to_f32();
        let q = b.add(2) as *const i8;
        let out = dst.add(blk * BLOCK);
        for i in 0..BLOCK {
            *out.add(i) = d * *q.add(i) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_is_within_half_a_step_of_the_rotated_block() {
        // One outlier channel per block, as Qwen2's keys have.
        let mut x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.0173).collect();
        x[5] = 40.0;
        x[40] = -25.0;
        let mut q = vec![0u8; row_bytes(64)];
        quantize_row(&x, &mut q);
        let mut y = vec![0f32; 64];
        unsafe { dequantize_row(q.as_ptr(), y.as_mut_ptr(), 64) };
        let mut hx = x.clone();
        rotate(&mut hx);
        rotate(&mut y);
        for blk in 0..2 {
            let (xs, ys, hs) = (&x[blk * 32..][..32], &y[blk * 32..][..32], &hx[blk * 32..][..32]);
            let amax = hs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = half::f16::from_f32(amax / 127.0).to_f32();
            // Rounding moves each rotated value by at most half a step; H keeps the error's norm.
            let err = xs.iter().zip(ys).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt();
            let bound = (0.5 * step + amax * 1e-3) * (BLOCK as f32).sqrt();
            assert!(err <= bound, "block {blk}: error norm {err} > {bound}");
            // Without the rotation the outlier would set the step: amax/127 >= 25/127.
            let plain_step = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            assert!(step < plain_step / 4.0, "block {blk}: rotated step {step} vs plain {plain_step}");
            // The largest rotated magnitude maps to +-127 quants.
            let imax = (0..32).max_by(|&a, &b| hs[a].abs().total_cmp(&hs[b].abs())).unwrap();
            assert_eq!((q[blk * 34 + 2 + imax] as i8).unsigned_abs(), 127);
        }
    }

    #[test]
    fn rotate_is_orthonormal_and_its_own_inverse() {
        let x: Vec<f32> = (0..96).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.01).collect();
        let mut y = x.clone();
        rotate(&mut y);
        for (a, b) in x.chunks(32).zip(y.chunks(32)) {
            let (na, nb) = (a.iter().map(|v| v * v).sum::<f32>(), b.iter().map(|v| v * v).sum::<f32>());
            assert!((na - nb).abs() <= 1e-5 * na, "norm {na} -> {nb}");
        }
        rotate(&mut y);
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1e-6), "H H x != x");
    }

    #[test]
    fn zero_block_has_zero_scale_and_quants() {
        let mut q = vec![0xAAu8; row_bytes(32)];
        quantize_row(&[0.0; 32], &mut q);
        assert!(q.iter().all(|&b| b == 0), "{q:?}");
    }
}
