//! Attention throughput: FlashAttention prefill (FLOP/s, reported as elements/s where one
//! element is one FLOP) and paged decode (bytes of KV cache read per second).
//!
//! `cargo bench -p tboost-kernels --bench attention` (TBOOST_ISA caps the ISA).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tboost_kernels::attention::{
    flash_attention, standard_attention, write_kv, AttnParams, KvPool, KvPoolMut, SeqSpan,
};
use tboost_kernels::DType;

const N_HEADS: usize = 32;
const KV_HEADS: usize = 4;
const HD: usize = 64;
const BS: usize = 16;

/// A pool holding `seqs` sequences of `len` positions each, in interleaved blocks.
struct Cache {
    dtype: DType,
    k: Vec<u8>,
    v: Vec<u8>,
    tables: Vec<Vec<u32>>,
}

fn esz(dtype: DType) -> usize {
    if dtype == DType::F32 {
        4
    } else {
        2
    }
}

fn cache(dtype: DType, seqs: usize, len: usize) -> Cache {
    let per = len.div_ceil(BS);
    let blocks = seqs * per;
    let bytes = blocks * BS * KV_HEADS * HD * esz(dtype);
    let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
    // Sequence s owns blocks s, s + seqs, ...: its blocks are scattered as in a real pool.
    let tables: Vec<Vec<u32>> = (0..seqs).map(|s| (0..per).map(|b| (b * seqs + s) as u32).collect()).collect();
    let vals: Vec<f32> = (0..len * KV_HEADS * HD).map(|i| ((i * 7919) % 2000) as f32 / 2000.0 - 0.5).collect();
    for t in &tables {
        let slots: Vec<u32> = (0..len).map(|p| t[p / BS] * BS as u32 + (p % BS) as u32).collect();
        let mut pm = KvPoolMut { dtype, block_size: BS, kv_heads: KV_HEADS, head_dim: HD, k: &mut k, v: &mut v };
        write_kv(&vals, &vals, &slots, &mut pm);
    }
    Cache { dtype, k, v, tables }
}

fn params() -> AttnParams {
    AttnParams::new(N_HEADS, KV_HEADS, HD, 1.0 / (HD as f32).sqrt())
}

fn q_rows(n: usize) -> Vec<f32> {
    (0..n * N_HEADS * HD).map(|i| ((i * 104729) % 1999) as f32 / 1999.0 - 0.5).collect()
}

fn prefill(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefill");
    g.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    for (len, standard) in [(2048usize, false), (512, false), (512, true)] {
        // QK^T and PV: 2 FLOPs per multiply-add, causal: sum of (i + 1) positions.
        let flops = 4 * HD * N_HEADS * len * (len + 1) / 2;
        g.throughput(Throughput::Elements(flops as u64));
        for dtype in [DType::F16, DType::F32] {
            let cc = cache(dtype, 1, len);
            let pool = KvPool { dtype, block_size: BS, kv_heads: KV_HEADS, head_dim: HD, k: &cc.k, v: &cc.v };
            let q = q_rows(len);
            let mut out = vec![0.0f32; q.len()];
            let spans = [SeqSpan { q_start: 0, q_len: len, ctx_len: len, block_table: &cc.tables[0] }];
            let name = if standard { "standard" } else { "flash" };
            g.bench_function(BenchmarkId::new(format!("{name}/{}", cc.dtype), len), |b| {
                b.iter(|| {
                    if standard {
                        standard_attention(&q, &pool, &spans, &params(), &mut out)
                    } else {
                        flash_attention(&q, &pool, &spans, &params(), &mut out)
                    }
                })
            });
        }
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    g.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    let (seqs, len) = (16, 1024);
    for dtype in [DType::F16, DType::F32] {
        let cc = cache(dtype, seqs, len);
        g.throughput(Throughput::Bytes((seqs * len * KV_HEADS * HD * 2 * esz(dtype)) as u64));
        let pool = KvPool { dtype, block_size: BS, kv_heads: KV_HEADS, head_dim: HD, k: &cc.k, v: &cc.v };
        let q = q_rows(seqs);
        let mut out = vec![0.0f32; q.len()];
        let spans: Vec<SeqSpan<'_>> =
            (0..seqs).map(|s| SeqSpan { q_start: s, q_len: 1, ctx_len: len, block_table: &cc.tables[s] }).collect();
        g.bench_function(BenchmarkId::new(format!("flash/{dtype}"), format!("{seqs}x{len}")), |b| {
            b.iter(|| flash_attention(&q, &pool, &spans, &params(), &mut out))
        });
    }
    g.finish();
}

criterion_group!(benches, prefill, decode);
criterion_main!(benches);
