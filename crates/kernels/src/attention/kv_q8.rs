//! The int8 KV cache rows: GGUF's Q8_0 block (`ggml-common.h` `block_q8_0`: an f16 scale `d`
//! and 32 signed bytes, value = `d * q`), as llama.cpp stores its `-ctk q8_0` cache. A head
//! row of `head_dim` values (a multiple of 32) is `head_dim / 32` consecutive blocks, so K and
//! V cost 34 bytes per 32 values: 53% of f16, 27% of f32.
//!
//! Quantization follows llama.cpp's `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q =
//! round(x / d)` (ties away from zero), `d` stored as f16. Reading multiplies by the stored
//! (rounded) scale, so the writer and every reader agree on the values.

/// Values per block.
pub const BLOCK: usize = 32;
/// Bytes per block: the f16 scale and the 32 quants.
pub const BLOCK_BYTES: usize = 2 + BLOCK;

/// Bytes of a row of `n` values (`n % 32 == 0`).
pub fn row_bytes(n: usize) -> usize {
    n / BLOCK * BLOCK_BYTES
}

/// Quantizes `src` (`len % 32 == 0`) into `dst` (`row_bytes(src.len())` bytes).
pub fn quantize_row(src: &[f32], dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(BLOCK) && dst.len() == row_bytes(src.len()),
        "kv_q8::quantize_row: {} values into {} bytes (need a multiple of 32 values, 34 bytes per 32)",
        src.len(),
        dst.len()
    );
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, v) in b[2..].iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

/// Dequantizes `n` values (`n % 32 == 0`) of the Q8_0 row at `src` into `dst`.
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
    fn round_trip_is_within_half_a_step_and_keeps_the_extremes() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.173).collect();
        let mut q = vec![0u8; row_bytes(64)];
        quantize_row(&x, &mut q);
        let mut y = vec![0f32; 64];
        unsafe { dequantize_row(q.as_ptr(), y.as_mut_ptr(), 64) };
        for blk in 0..2 {
            let xs = &x[blk * 32..blk * 32 + 32];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = half::f16::from_f32(amax / 127.0).to_f32();
            for i in 0..32 {
                let (a, b) = (xs[i], y[blk * 32 + i]);
                assert!(
                    (a - b).abs() <= 0.5 * step + amax * 1e-3,
                    "value {i} of block {blk}: {a} -> {b} (step {step})"
                );
            }
            // The largest magnitude maps to +-127 quants.
            let imax = (0..32).max_by(|&a, &b| xs[a].abs().total_cmp(&xs[b].abs())).unwrap();
            assert_eq!((q[blk * 34 + 2 + imax] as i8).unsigned_abs(), 127);
        }
    }

    #[test]
    fn zero_block_has_zero_scale_and_quants() {
        let mut q = vec![0xAAu8; row_bytes(32)];
        quantize_row(&[0.0; 32], &mut q);
        assert!(q.iter().all(|&b| b == 0), "{q:?}");
    }
}
