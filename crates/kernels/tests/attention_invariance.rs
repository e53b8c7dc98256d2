//! Batch invariance, bit for bit: a query row's output is the same whether its sequence is
//! prefilled in one call, in chunks, decoded one row at a time, mixed with other sequences
//! at other offsets, or run on 1, 2 or 3 threads.

mod attention_util;

use attention_util::{bits, World};
use tboost_kernels::attention::{flash_attention_with, standard_attention, AttnParams, KvPool, SeqSpan};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::DType;

const LEN: usize = 300;

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()).collect()
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

/// Checks every way of computing sequence 0's rows against the one-shot prefill.
fn check<K>(w: &World, what: &str, kernel: K)
where
    K: Fn(&[f32], &KvPool<'_>, &[SeqSpan<'_>], &AttnParams, &mut [f32]) + Sync + Copy,
{
    let rl = w.row_len();
    let one_shot = bits(&in_pool(1, || w.call(&[(0, LEN, LEN)], 0, kernel))[0]);
    let row = |r: usize| &one_shot[r * rl..(r + 1) * rl];

    let mut ctx = 0;
    for chunk in [37, 64, 1, 100, 98] {
        ctx += chunk;
        let got = bits(&w.call(&[(0, ctx, chunk)], 0, kernel)[0]);
        for i in 0..chunk {
            assert_eq!(
                &got[i * rl..(i + 1) * rl],
                row(ctx - chunk + i),
                "{what}: chunked prefill, row {}",
                ctx - chunk + i
            );
        }
    }
    for ctx in 1..=LEN {
        let got = bits(&w.call(&[(0, ctx, 1)], 0, kernel)[0]);
        assert_eq!(&got[..], row(ctx - 1), "{what}: decode of row {}", ctx - 1);
    }
    // Other sequences around it, at other offsets, some decoding, some prefilling.
    for threads in [1, 2, 3] {
        let parts = [(1, 77, 77), (0, LEN, LEN), (3, 130, 5), (2, 1, 1)];
        let got = in_pool(threads, || w.call(&parts, 3, kernel));
        assert_eq!(bits(&got[1]), one_shot, "{what}: mixed batch on {threads} threads");
        let parts = [(3, 130, 1), (0, 180, 43), (1, 60, 60)];
        let got = in_pool(threads, || w.call(&parts, 1, kernel));
        assert_eq!(bits(&got[1])[..], one_shot[137 * rl..180 * rl], "{what}: mixed chunk on {threads} threads");
    }
}

#[test]
fn flash_rows_are_batch_invariant() {
    // GQA 3 and 1 make query groups straddle rows, so a group mixes causal limits in one
    // call and not in another.
    for (dtype, bs, hd, heads, kv) in
        [(DType::F16, 16, 64, 8, 2), (DType::F32, 1, 80, 8, 2), (DType::BF16, 32, 32, 6, 2), (DType::F32, 16, 16, 2, 2)]
    {
        let w = World::new(5, dtype, bs, heads, kv, hd, &[LEN, 77, 1, 130], 4.0);
        for isa in isas() {
            let what = format!("flash {} {dtype} bs={bs} hd={hd} heads={heads}/{kv}", isa.name());
            check(&w, &what, move |q, pool, s, p, o| flash_attention_with(isa, q, pool, s, p, o));
        }
    }
}

#[test]
fn standard_rows_are_batch_invariant() {
    for (dtype, bs, hd) in [(DType::F16, 16, 24), (DType::F32, 1, 64)] {
        let w = World::new(6, dtype, bs, 4, 1, hd, &[LEN, 77, 1, 130], 4.0);
        check(&w, &format!("standard {dtype} bs={bs} hd={hd}"), standard_attention);
    }
}
