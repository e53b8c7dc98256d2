//! Packing a matrix in parts of whole panels (`pack_panels`, given only each part's stored rows:
//! the CPU backend reads each part of a large matrix into a buffer of its own) writes the same
//! bytes as packing it at once, in every packed layout, with a last panel that is not full.

use tboost_kernels::gemm::dense::{bf16_pair_panels, exact_panels};
use tboost_kernels::gemm::quant::panel_pack;
use tboost_kernels::DType;

/// Bytes that are not all valid numbers don't matter to packing (it moves bytes); a fixed
/// pseudo-random pattern keeps every position distinct enough to catch a misplaced one.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect()
}

/// The stored rows of panels `p` of a `rows`-row matrix whose rows are `row_bytes` long, in a
/// buffer of their own (so a read outside them is a panic, not a silent read of other rows).
fn rows_of(src: &[u8], rows: usize, row_bytes: usize, p: &std::ops::Range<usize>) -> Vec<u8> {
    let (r0, r1) = (p.start * 16, (p.end * 16).min(rows));
    src[r0 * row_bytes..r1 * row_bytes].to_vec()
}

fn in_parts(panels: usize, mut f: impl FnMut(std::ops::Range<usize>)) {
    // parts of 1, 2 and 3 panels, then the rest
    let mut p = 0;
    for len in [1, 2, 3].iter().cycle() {
        if p >= panels {
            break;
        }
        f(p..(p + len).min(panels));
        p += len;
    }
}

#[test]
fn packing_in_parts_equals_packing_at_once() {
    let (rows, cols): (usize, usize) = (16 * 7 + 5, 256);
    let panels = rows.div_ceil(16);
    for dtype in [DType::Q4_0, DType::Q8_0, DType::Q4K, DType::Q6K] {
        let src = pattern(dtype.bytes_for(cols).unwrap() * rows);
        let n = panel_pack::packed_bytes(dtype, rows, cols);
        let (mut once, mut parts) = (vec![0u8; n], vec![0u8; n]);
        panel_pack::pack(dtype, rows, cols, &src, &mut once);
        let rb = dtype.bytes_for(cols).unwrap();
        in_parts(panels, |r| panel_pack::pack_panels(dtype, rows, cols, &rows_of(&src, rows, rb, &r), &mut parts, r));
        assert!(once == parts, "{dtype}: packed in parts differs");
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let src = pattern(rows * cols * dtype.block_bytes());
        let n = exact_panels::packed_bytes(dtype, rows, cols);
        let (mut once, mut parts) = (vec![0u8; n], vec![0u8; n]);
        exact_panels::pack(dtype, rows, cols, &src, &mut once);
        let rb = cols * dtype.block_bytes();
        in_parts(panels, |r| exact_panels::pack_panels(dtype, rows, cols, &rows_of(&src, rows, rb, &r), &mut parts, r));
        assert!(once == parts, "{dtype} exact panels: packed in parts differs");
    }
    let src = pattern(rows * cols * 2);
    let n = bf16_pair_panels::packed_bytes(rows, cols);
    let (mut once, mut parts) = (vec![0u8; n], vec![0u8; n]);
    bf16_pair_panels::pack(rows, cols, &src, &mut once);
    in_parts(panels, |r| bf16_pair_panels::pack_panels(rows, cols, &rows_of(&src, rows, cols * 2, &r), &mut parts, r));
    assert!(once == parts, "bf16 pair panels: packed in parts differs");
}
