//! Writing K/V rows into the paged cache, in every cache dtype.

use tboost_engine::backend::{DType, KvLayer, Op, OpQuery, StepHost};
use tboost_testkit::golden::Rng;

use super::measure::{Measured, EXACT_COPY};
use super::numbers::{encode, round_to};
use super::suite::{empty_host, Suite};

/// Values that round in interesting ways to f16/bf16 (ties to even, subnormals, the top of
/// the f16 range, signed zero).
fn kv_edges() -> Vec<f32> {
    vec![
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        65504.0,
        6.0e-8,
        -1.0e-6,
        -0.0,
    ]
}

pub fn write_kv(s: &mut Suite<'_>, rng: &mut Rng) {
    let act = s.act;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (kvh, hd) in [(2usize, 64usize), (1, 24), (8, 128)] {
            let (bs, blocks, tokens) = (16usize, 12usize, 20usize);
            let row = kvh * hd;
            let mut all: Vec<u32> = (0..(bs * blocks) as u32).collect();
            rng.shuffle(&mut all);
            // The pool's first and last slots among them, wherever the shuffle put them.
            for (i, edge) in [0u32, (bs * blocks - 1) as u32].into_iter().enumerate() {
                if let Some(at) = all.iter().position(|&x| x == edge) {
                    all.swap(i, at);
                }
            }
            // Reversed: the last tokens of the step write the pool edges.
            all[..tokens].reverse();
            let slots: Vec<u32> = all[..tokens].to_vec();
            let mut k = rng.vec(tokens * row, 3.0);
            let v = round_to(act, &rng.vec(tokens * row, 3.0));
            k[..8].copy_from_slice(&kv_edges());
            // K/V arrive as the activation dtype holds them.
            let k = round_to(act, &k);
            let q = [OpQuery::WriteKv { act, kv_dtype: dtype, block_size: bs, kv_heads: kvh, head_dim: hd }];
            let name =
                format!("kv {dtype}, {kvh} kv heads x {hd}, {tokens} slots scattered over {blocks} blocks of {bs}");
            s.case("write_kv", EXACT_COPY, name, &q, &[9], |d| {
                let n = blocks * bs * row;
                // Sentinels everywhere: slots not written must keep them.
                let sentinel = encode(dtype, &vec![-777.0; n]);
                let (kp, vp) = (d.raw(dtype, n, &sentinel)?, d.raw(dtype, n, &sentinel)?);
                let cache = KvLayer {
                    k: kp.buf,
                    v: vp.buf,
                    dtype,
                    num_blocks: blocks,
                    block_size: bs,
                    kv_heads: kvh,
                    head_dim: hd,
                };
                let sv = d.step(&StepHost { slots: &slots, ..empty_host() }, 0)?;
                let (kv_, vv) = (d.acts(act, &k)?, d.acts(act, &v)?);
                d.launch(Op::WriteKv { k: kv_, v: vv, slots: sv.slots, cache })?;
                d.sync()?;
                let esz = dtype.block_bytes();
                let mut m = Measured::default();
                for (what, pool, src) in [("K pool", kp, &k), ("V pool", vp, &v)] {
                    let got = d.read_bytes(pool)?;
                    let mut want = sentinel.clone();
                    for (t, &sl) in slots.iter().enumerate() {
                        let at = sl as usize * row * esz;
                        want[at..at + row * esz].copy_from_slice(&encode(dtype, &src[t * row..(t + 1) * row]));
                    }
                    m.exact_bytes(what, &got, &want, esz)?;
                }
                Ok(m)
            });
        }
    }
}
