//! A row read from the packed panels (`panel_rows`, the embedding lookup of a tied table kept
//! only as the lm_head's panels) equals `dequantize_row` of the stored row bit for bit, in every
//! packable block type, for rows of full and partial panels.

use tboost_kernels::embed;
use tboost_kernels::gemm::quant::{dequantize_row, panel_pack, panel_rows};
use tboost_kernels::{DType, Layout, WeightMat};

/// Valid blocks of `dtype`: random quant bytes, and scales set to small finite f16 values.
fn random_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut bytes: Vec<u8> = (0..dtype.bytes_for(cols).unwrap() * rows)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect();
    // f16 scales: offsets of d (and dmin) inside each block
    let f16_at: &[usize] = match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[208],
        _ => unreachable!(),
    };
    let bb = dtype.block_bytes();
    for (i, b) in bytes.chunks_exact_mut(bb).enumerate() {
        for &at in f16_at {
            let v = half::f16::from_f32(0.001 + (i % 97) as f32 * 1e-4);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

#[test]
fn packed_rows_equal_the_stored_rows_dequantized() {
    let (rows, cols) = (16 * 3 + 7, 512);
    for dtype in [DType::Q4_0, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K] {
        let src = random_rows(dtype, rows, cols, dtype as u64 + 3);
        let mut packed = vec![0u8; panel_pack::packed_bytes(dtype, rows, cols)];
        panel_pack::pack(dtype, rows, cols, &src, &mut packed);
        let w = WeightMat { dtype, rows, cols, data: &packed, layout: Layout::Panels };
        assert!(panel_rows::reads(dtype, Layout::Panels), "{dtype}");
        let rb = dtype.bytes_for(cols).unwrap();
        for j in [0, 1, 15, 16, 31, 47, rows - 1] {
            let mut want = vec![0f32; cols];
            dequantize_row(dtype, &src[j * rb..(j + 1) * rb], &mut want).unwrap();
            let mut got = vec![0f32; cols];
            panel_rows::row_to_f32(&w, j, &mut got);
            let bad = want.iter().zip(&got).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{dtype} row {j} value {bad:?}: {:?} vs {:?}",
                bad.map(|i| want[i]),
                bad.map(|i| got[i])
            );
            assert!(want.iter().any(|v| *v != 0.0), "{dtype}: a row of zeros proves nothing");
        }
        // the embedding lookup takes the packed table as it is
        let ids = [5u32, (rows - 1) as u32, 16];
        let mut out = vec![0f32; ids.len() * cols];
        embed::embed(&ids, w, &mut out);
        for (i, &id) in ids.iter().enumerate() {
            let mut want = vec![0f32; cols];
            dequantize_row(dtype, &src[id as usize * rb..(id as usize + 1) * rb], &mut want).unwrap();
            assert_eq!(&out[i * cols..(i + 1) * cols], &want[..], "{dtype} embed id {id}");
        }
    }
    assert!(!panel_rows::reads(DType::Q8_0, Layout::Rows));
    assert!(!panel_rows::reads(DType::BF16, Layout::Panels));
}
