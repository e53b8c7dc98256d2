//! Ops that move values: embedding rows, gathering the logit rows, dtype conversion, zeroing.

use tboost_engine::backend::{DType, Op, OpQuery, StepHost};
use tboost_testkit::golden::Rng;

use super::measure::{Measured, EXACT_COPY};
use super::numbers::{decode, encode, round_to, Mat, WEIGHT_TYPES};
use super::suite::{empty_host, Suite};

pub fn embed(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let vocab = 50;
    for dtype in WEIGHT_TYPES {
        // K-quant rows are whole 256-value super-blocks.
        let cols = if dtype.block_elems() == 256 { 256 } else { 96 };
        let table = Mat::random(rng, dtype, vocab, cols, 1.0);
        let ids: Vec<u32> = vec![0, vocab as u32 - 1, 7, 7, 23, 0, 48];
        let q = [OpQuery::Embed { table: dtype, act }];
        s.case("embed", EXACT_COPY, format!("{dtype} table {vocab}x{cols}, ids {ids:?}"), &q, &[0], |d| {
            let w = d.mat("embed", &table)?;
            let sv = d.step(&StepHost { ids: &ids, ..empty_host() }, 0)?;
            let out = d.alloc(act, ids.len() * cols)?;
            d.launch(Op::Embed { ids: sv.ids, table: w, out })?;
            d.sync()?;
            let got = d.read_act(out)?;
            let want: Vec<f32> = ids.iter().flat_map(|&i| table.vals[i as usize * cols..][..cols].to_vec()).collect();
            let mut m = Measured::default();
            m.exact("out", &got, &want)?;
            Ok(m)
        });
    }
}

pub fn gather_rows(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    let q = [OpQuery::GatherRows { act }];
    for (n, cols, rows) in
        [(10usize, 37usize, vec![9u32, 0, 3, 3, 9]), (64, 896, vec![63]), (5, 1, vec![4, 3, 2, 1, 0])]
    {
        let x = round_to(act, &rng.vec(n * cols, 1.0));
        s.case(
            "gather_rows",
            EXACT_COPY,
            format!("{n}x{cols}, rows {rows:?} (the step's logit rows)"),
            &q,
            &[15],
            |d| {
                let xv = d.acts(act, &x)?;
                let sv = d.step(&StepHost { logit_rows: &rows, ..empty_host() }, 0)?;
                let out = d.alloc(act, rows.len() * cols)?;
                d.launch(Op::GatherRows { x: xv, cols, rows: sv.logit_rows, out })?;
                d.sync()?;
                let got = d.read_act(out)?;
                let want: Vec<f32> = rows.iter().flat_map(|&r| x[r as usize * cols..][..cols].to_vec()).collect();
                let mut m = Measured::default();
                m.exact("out", &got, &want)?;
                Ok(m)
            },
        );
    }
}

pub fn convert(s: &mut Suite<'_>, rng: &mut Rng) {
    let mut vals = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1.0 + 2f32.powi(-11),       // f16 tie: to even (1.0)
        1.0 + 3.0 * 2f32.powi(-11), // f16 tie: to even (up)
        1.0 + 2f32.powi(-8),        // bf16 tie: to even (1.0)
        1.0 + 3.0 * 2f32.powi(-8),  // bf16 tie: to even (up)
        65504.0,                    // f16 max
        65520.0,                    // halfway to the next f16 binade: rounds to inf
        1.0e6,                      // beyond f16: inf; bf16 keeps it
        2f32.powi(-24),             // smallest f16 subnormal
        1.0e-10,                    // below f16: 0
        1.0e-40,                    // f32 subnormal
        f32::MAX,                   // rounds to bf16 inf
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    vals.extend(rng.vec(1000, 100.0));
    let n = vals.len();
    let dts = [DType::F32, DType::F16, DType::BF16];
    for from in dts {
        for to in dts {
            let q = [OpQuery::Convert { from, to }];
            let tol = "exact: round to nearest even, through f32 (NaN stays NaN)";
            s.case(
                "convert",
                tol,
                format!("{from} -> {to}, {n} values incl. ties, overflow, subnormals, inf, NaN"),
                &q,
                &[16],
                |d| {
                    // The source holds what `from` can represent of the values.
                    let src_bytes = encode(from, &vals);
                    let src_vals = decode(from, &src_bytes, n);
                    // At an offset inside both buffers, as views are.
                    let mut sb = encode(from, &[2.0; 4]);
                    sb.extend(&src_bytes);
                    let src = d.raw(from, n + 4, &sb)?;
                    let dst = d.raw(to, n + 2, &encode(to, &vec![7.0; n + 2]))?;
                    d.launch(Op::Convert { src: src.sub(4, n), dst: dst.sub(2, n) })?;
                    d.sync()?;
                    let got = d.read_bytes(dst)?;
                    let mut want_vals = vec![7.0f32; 2];
                    want_vals.extend(&src_vals);
                    let want = encode(to, &want_vals);
                    // Widening to f32 is exact and one-to-one, so comparing the f32 bits compares
                    // the stored bits (NaN payloads may differ: NaN matches NaN).
                    let mut m = Measured::default();
                    m.exact("dst (with margins)", &decode(to, &got, n + 2), &decode(to, &want, n + 2))?;
                    Ok(m)
                },
            );
        }
    }
}

/// Fixed values (`_rng` keeps the suite's signature).
pub fn zero(s: &mut Suite<'_>, _rng: &mut Rng) {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::U32] {
        let (n, start, len) = (100usize, 10usize, 50usize);
        // No OpQuery exists for Zero: every backend must take it.
        s.case("zero", EXACT_COPY, format!("{dtype}: elements {start}..{} of {n}", start + len), &[], &[17], |d| {
            let ones: Vec<u8> = match dtype {
                DType::U32 => (0..n as u32).flat_map(|i| (i + 1).to_le_bytes()).collect(),
                _ => encode(dtype, &vec![1.5; n]),
            };
            let b = d.raw(dtype, n, &ones)?;
            d.launch(Op::Zero { dst: b.sub(start, len) })?;
            d.sync()?;
            let got = d.read_bytes(b)?;
            let esz = dtype.block_bytes();
            let mut want = ones.clone();
            want[start * esz..(start + len) * esz].fill(0);
            let mut m = Measured::default();
            m.exact_bytes("buffer", &got, &want, esz)?;
            Ok(m)
        });
    }
}
