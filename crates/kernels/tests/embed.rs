//! Embedding rows converted to f32 exactly, for every dense dtype.

use tboost_kernels::embed::{embed, row_to_f32};
use tboost_kernels::{DType, WeightMat};

fn table(dtype: DType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    // Values every dtype holds exactly, so the expected f32 is the value itself.
    let vals: Vec<f32> = (0..rows * cols).map(|i| (i as f32 - 37.0) * 0.25).collect();
    let bytes = match dtype {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => vals.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        _ => vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
    };
    (bytes, vals)
}

#[test]
fn embed_copies_rows_for_each_dense_dtype() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (rows, cols) = (10, 24);
        let (bytes, vals) = table(dtype, rows, cols);
        let t = WeightMat::new(dtype, rows, cols, &bytes).unwrap();
        let ids = [3u32, 0, 9, 3];
        let mut out = vec![0.0f32; ids.len() * cols];
        embed(&ids, t, &mut out);
        for (i, &id) in ids.iter().enumerate() {
            let want = &vals[id as usize * cols..(id as usize + 1) * cols];
            assert_eq!(&out[i * cols..(i + 1) * cols], want, "{dtype} id {id}");
        }
        let mut row = vec![0.0f32; cols];
        row_to_f32(t, 7, &mut row);
        assert_eq!(row, vals[7 * cols..8 * cols]);
    }
}

#[test]
fn quantized_tables_dequantize_exactly_the_rows_asked_for() {
    use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
    let (rows, cols) = (5, 64);
    for dtype in [DType::Q4_0, DType::Q5_0, DType::Q8_0] {
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let mut bytes = Vec::new();
        for r in vals.chunks(cols) {
            bytes.extend(quantize_row_reference(dtype, r).unwrap());
        }
        let t = WeightMat::new(dtype, rows, cols, &bytes).unwrap();
        let ids = [4u32, 0, 4, 2];
        let mut out = vec![0.0f32; ids.len() * cols];
        embed(&ids, t, &mut out);
        for (i, &id) in ids.iter().enumerate() {
            let mut want = vec![0.0f32; cols];
            dequantize_row(dtype, t.row(id as usize), &mut want).unwrap();
            assert_eq!(&out[i * cols..(i + 1) * cols], &want[..], "{dtype} id {id}");
        }
    }
}

#[test]
#[should_panic(expected = "embed: id 10 is outside the table (10 rows)")]
fn out_of_range_id_is_a_bug_caught_with_its_value() {
    let (bytes, _) = table(DType::F32, 10, 4);
    embed(&[10], WeightMat::new(DType::F32, 10, 4, &bytes).unwrap(), &mut [0.0; 4]);
}
