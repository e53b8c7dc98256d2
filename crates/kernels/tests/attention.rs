//! FlashAttention and standard attention against the f64 reference, across head_dims, GQA
//! ratios, lengths, block sizes, cache dtypes and ISAs; the KV write; capability checks.

mod attention_util;

use attention_util::World;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::attention::{
    flash_attention_with, flash_supports, reference, standard_attention, standard_supports, write_kv, AttentionCase,
    KvPool, KvPoolMut, SeqSpan,
};
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::DType;

/// ISAs this CPU can run, scalar first.
fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()).collect()
}

/// Largest |kernel - reference| over all rows of a call.
fn max_err(w: &World, parts: &[(usize, usize, usize)], got: &[Vec<f32>]) -> f64 {
    // The reference over the same call layout (no gaps).
    let rl = w.row_len();
    let mut q = Vec::new();
    let mut spans = Vec::new();
    for &(s, ctx, ql) in parts {
        spans.push(SeqSpan { q_start: q.len() / rl, q_len: ql, ctx_len: ctx, block_table: &w.seqs[s].table });
        q.extend_from_slice(&w.seqs[s].q[(ctx - ql) * rl..ctx * rl]);
    }
    let want = reference::attention(&q, &w.pool(), &spans, &w.p);
    let got: Vec<f32> = got.concat();
    assert_eq!(got.len(), want.len());
    got.iter().zip(&want).map(|(&g, &r)| (g as f64 - r).abs()).fold(0.0, f64::max)
}

/// Tolerances against the f64 reference, for V in [-1, 1] (outputs are convex mixtures of
/// V rows, so absolute error is the right measure) and scores up to ~12 sqrt(head_dim/3)
/// in magnitude. Measured maxima: ~1.3e-6 for the SIMD paths, ~3e-6 for scalar and
/// standard (one long sequential f32 sum per dot product); the bound leaves ~3x. f16/bf16
/// and q8_0 caches use the same bound because the reference reads the same rounded cache
/// values.
const TOL_FLASH: f64 = 1e-5;
const TOL_STANDARD: f64 = 1e-5;

struct Case {
    group: usize,
    kv_heads: usize,
    bs: usize,
    dtype: DType,
    lens: [usize; 3],
    q_amp: f32,
}

fn random_case(rng: &mut StdRng, hd: usize) -> Case {
    let group = [1, 2, 4, 8][rng.random_range(0..4)];
    let kv_heads = if group >= 4 || hd >= 128 { 1 } else { 2 };
    Case {
        group,
        kv_heads,
        bs: [1, 16, 32][rng.random_range(0..3)],
        // q8_0 caches hold whole 32-value blocks per head row.
        dtype: [DType::F32, DType::F16, DType::BF16, DType::Q8_0]
            [rng.random_range(0..if hd.is_multiple_of(32) { 4 } else { 3 })],
        lens: [rng.random_range(1..=1024), rng.random_range(1..=160), rng.random_range(1..=70)],
        q_amp: if rng.random_bool(0.3) { 12.0 } else { 1.0 },
    }
}

/// Parts of one call: a long context with a few new rows, a whole prompt, a chunk.
fn parts_for(rng: &mut StdRng, lens: [usize; 3]) -> Vec<(usize, usize, usize)> {
    vec![
        (0, lens[0], rng.random_range(1..=lens[0].min(8))),
        (1, lens[1], lens[1]),
        (2, lens[2], rng.random_range(1..=lens[2])),
    ]
}

#[test]
fn flash_matches_reference_and_standard() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut worst = 0.0f64;
    for hd in [16, 32, 48, 64, 80, 128, 256] {
        for _ in 0..6 {
            let c = random_case(&mut rng, hd);
            let w = World::new(rng.random(), c.dtype, c.bs, c.kv_heads * c.group, c.kv_heads, hd, &c.lens, c.q_amp);
            let parts = parts_for(&mut rng, c.lens);
            let std_out = w.call(&parts, 1, standard_attention);
            for isa in isas() {
                let got = w.call(&parts, 1, |q, pool, s, p, o| flash_attention_with(isa, q, pool, s, p, o));
                let e = max_err(&w, &parts, &got);
                worst = worst.max(e);
                assert!(
                    e <= TOL_FLASH,
                    "flash {} hd={hd} group={} bs={} {} lens={:?} amp={}: max error {e:e}",
                    isa.name(),
                    c.group,
                    c.bs,
                    c.dtype,
                    c.lens,
                    c.q_amp
                );
                let d = got.concat().iter().zip(std_out.concat()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(d as f64 <= TOL_FLASH + TOL_STANDARD, "flash {} vs standard hd={hd}: {d:e}", isa.name());
            }
        }
    }
    println!("flash: worst error against the f64 reference {worst:e}");
}

#[test]
fn standard_matches_reference_any_head_dim() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut worst = 0.0f64;
    for hd in [1, 3, 8, 24, 40, 64, 100] {
        for _ in 0..2 {
            let c = random_case(&mut rng, hd);
            let w = World::new(rng.random(), c.dtype, c.bs, c.kv_heads * c.group, c.kv_heads, hd, &c.lens, c.q_amp);
            let parts = parts_for(&mut rng, c.lens);
            let got = w.call(&parts, 2, standard_attention);
            let e = max_err(&w, &parts, &got);
            worst = worst.max(e);
            assert!(e <= TOL_STANDARD, "standard hd={hd} group={} bs={} {}: max error {e:e}", c.group, c.bs, c.dtype);
        }
    }
    println!("standard: worst error against the f64 reference {worst:e}");
}

/// Scores that grow along the sequence move the running max up in every tile, so each
/// tile rescales what came before; scores that peak early never rescale.
#[test]
fn flash_online_softmax_rescales_across_tiles() {
    for rising in [true, false] {
        let mut w = World::new(3, DType::F32, 16, 4, 2, 64, &[300], 1.0);
        let hd = 64;
        // K rows aligned with a fixed direction, growing (or shrinking) with position.
        let mut k = vec![0.0f32; 300 * 2 * hd];
        for pos in 0..300 {
            let a = if rising { pos as f32 / 300.0 } else { 1.0 - pos as f32 / 300.0 } * 8.0;
            for g in 0..2 {
                for d in 0..hd {
                    k[(pos * 2 + g) * hd + d] = a * if d % 2 == 0 { 1.0 } else { -1.0 } / 8.0;
                }
            }
        }
        for x in w.seqs[0].q.iter_mut().enumerate() {
            *x.1 = if x.0 % 2 == 0 { 1.0 } else { -1.0 };
        }
        let slots: Vec<u32> = (0..300).map(|pos| w.seqs[0].table[pos / 16] * 16 + (pos % 16) as u32).collect();
        let v = w.seqs[0].v.clone();
        let mut pm =
            KvPoolMut { dtype: DType::F32, block_size: 16, kv_heads: 2, head_dim: hd, k: &mut w.k, v: &mut w.v };
        write_kv(&k, &v, &slots, &mut pm);
        let parts = [(0, 300, 300)];
        for isa in isas() {
            let got = w.call(&parts, 0, |q, pool, s, p, o| flash_attention_with(isa, q, pool, s, p, o));
            let e = max_err(&w, &parts, &got);
            assert!(e <= TOL_FLASH, "flash {} rising={rising}: max error {e:e}", isa.name());
        }
    }
}

#[test]
fn write_kv_rounds_to_nearest_even_and_places_slots() {
    // Halfway cases: f16 has 10 mantissa bits, bf16 7.
    let f16_cases = [(1.0 + 2f32.powi(-11), 1.0f32), (1.0 + 3.0 * 2f32.powi(-11), 1.0 + 2f32.powi(-9))];
    let bf16_cases = [(1.0 + 2f32.powi(-8), 1.0f32), (1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-6))];
    for (dtype, cases) in [(DType::F16, f16_cases), (DType::BF16, bf16_cases)] {
        for (x, want) in cases {
            let (mut k, mut v) = (vec![0u8; 2 * 3 * 2], vec![0u8; 2 * 3 * 2]);
            let mut pm = KvPoolMut { dtype, block_size: 3, kv_heads: 1, head_dim: 2, k: &mut k, v: &mut v };
            // Slot 2 of a 3-row block: bytes 8..12.
            write_kv(&[x, -x], &[x, 0.5], &[2], &mut pm);
            let pool = KvPool { dtype, block_size: 3, kv_heads: 1, head_dim: 2, k: &k, v: &v };
            assert_eq!(reference::pool_value(&pool, false, &[0], 2, 0, 0), want as f64, "{dtype} K of {x}");
            assert_eq!(reference::pool_value(&pool, false, &[0], 2, 0, 1), -want as f64, "{dtype} K of -{x}");
            assert_eq!(reference::pool_value(&pool, true, &[0], 2, 0, 1), 0.5, "{dtype} V");
            assert!(k[..8].iter().all(|&b| b == 0), "{dtype}: write_kv touched other slots");
        }
    }
    let (mut k, mut v) = (vec![0u8; 4 * 2 * 2 * 4], vec![0u8; 4 * 2 * 2 * 4]);
    let mut pm = KvPoolMut { dtype: DType::F32, block_size: 2, kv_heads: 2, head_dim: 2, k: &mut k, v: &mut v };
    write_kv(&[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0], &[3], &mut pm);
    let f = |b: &[u8], i: usize| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!([f(&k, 12), f(&k, 13), f(&k, 14), f(&k, 15)], [1.0, 2.0, 3.0, 4.0]);
    assert_eq!([f(&v, 12), f(&v, 15)], [5.0, 8.0]);
    assert!((0..12).all(|i| f(&k, i) == 0.0));
}

#[test]
fn capability_checks_say_why() {
    let case = |head_dim, n_heads, kv_heads, kv_dtype| AttentionCase {
        phase: tboost_ops::AttnPhase::Prefill,
        head_dim,
        n_heads,
        kv_heads,
        act_dtype: DType::F32,
        kv_dtype,
        block_size: 16,
        max_context: 4096,
        sliding_window: 0,
    };
    let why = |r: Result<(), tboost_ops::Unsupported>| r.map_err(|u| (u.param.to_string(), u.value));
    assert_eq!(why(flash_supports(&case(24, 8, 2, DType::F16))), Err(("head_dim".into(), "24".into())));
    assert_eq!(flash_supports(&case(128, 32, 8, DType::BF16)), Ok(()));
    assert_eq!(standard_supports(&case(24, 8, 2, DType::F16)), Ok(()));
    assert_eq!(why(standard_supports(&case(64, 6, 4, DType::F32))), Err(("n_heads".into(), "6".into())));
    // An int8 (q8_0) cache: whole 32-value blocks per head row, on both kernels.
    assert_eq!(flash_supports(&case(64, 8, 8, DType::Q8_0)), Ok(()));
    assert_eq!(standard_supports(&case(32, 8, 8, DType::Q8_0)), Ok(()));
    assert_eq!(why(flash_supports(&case(48, 8, 8, DType::Q8_0))), Err(("head_dim".into(), "48".into())));
    assert_eq!(why(standard_supports(&case(24, 8, 2, DType::Q8_0))), Err(("head_dim".into(), "24".into())));
    assert_eq!(why(flash_supports(&case(64, 8, 8, DType::Q4_0))), Err(("kv_dtype".into(), "q4_0".into())));
    let f16_act = AttentionCase { act_dtype: DType::F16, ..case(64, 8, 8, DType::F16) };
    assert_eq!(why(flash_supports(&f16_act)), Err(("act_dtype".into(), "f16".into())));
}

/// The int8 cache holds each value to within half a quantization step of its block (plus the
/// f16 rounding of the stored scale, at most 127 quants x 2^-11 of a step), and the reference
/// decodes the bytes on its own.
#[test]
fn q8_0_cache_keeps_values_within_half_a_rotated_step() {
    let w = World::new(5, DType::Q8_0, 16, 4, 2, 64, &[37], 1.0);
    let pool = w.pool();
    let s = &w.seqs[0];
    for pos in 0..s.len {
        for g in 0..2 {
            let row = &s.k[(pos * 2 + g) * 64..(pos * 2 + g + 1) * 64];
            for blk in row.chunks(32).enumerate() {
                // The cache rounds `H x` (kv_q8): each rotated value moves by at most half a
                // step (plus the f16 scale's rounding), and H keeps the error's norm.
                let mut hx = blk.1.to_vec();
                tboost_kernels::attention::kv_q8::rotate(&mut hx);
                let amax = hx.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                let err = blk
                    .1
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| reference::pool_value(&pool, false, &s.table, pos, g, blk.0 * 32 + i) - x as f64)
                    .map(|e| e * e)
                    .sum::<f64>()
                    .sqrt();
                let bound = (amax / 127.0 * (0.5 + 127.0 / 2048.0) + 1e-6) * 32f64.sqrt();
                assert!(err <= bound, "pos {pos} head {g} block {}: error norm {err} > {bound}", blk.0);
            }
        }
    }
}

#[test]
fn empty_calls_and_empty_sequences_write_nothing() {
    let w = World::new(1, DType::F16, 16, 4, 2, 32, &[20], 1.0);
    let mut out = vec![7.0f32; 3 * w.row_len()];
    let q = vec![0.0f32; out.len()];
    let spans = [SeqSpan { q_start: 1, q_len: 0, ctx_len: 20, block_table: &w.seqs[0].table }];
    flash_attention_with(isa::detected(), &q, &w.pool(), &spans, &w.p, &mut out);
    standard_attention(&q, &w.pool(), &spans, &w.p, &mut out);
    flash_attention_with(isa::detected(), &[], &w.pool(), &[], &w.p, &mut []);
    assert!(out.iter().all(|&x| x == 7.0));
}

#[test]
#[should_panic(expected = "uses block 99 of a pool of")]
fn bad_block_id_is_caught_before_reading() {
    let w = World::new(1, DType::F32, 4, 2, 1, 16, &[6], 1.0);
    let table = [w.seqs[0].table[0], 99];
    let q = vec![0.0f32; 6 * w.row_len()];
    let mut out = q.clone();
    let spans = [SeqSpan { q_start: 0, q_len: 6, ctx_len: 6, block_table: &table }];
    flash_attention_with(Isa::Scalar, &q, &w.pool(), &spans, &w.p, &mut out);
}

#[test]
#[should_panic(expected = "of two sequences overlap")]
fn overlapping_query_rows_are_rejected() {
    let w = World::new(1, DType::F32, 4, 2, 1, 16, &[6, 6], 1.0);
    let q = vec![0.0f32; 8 * w.row_len()];
    let mut out = q.clone();
    let spans = [
        SeqSpan { q_start: 4, q_len: 4, ctx_len: 6, block_table: &w.seqs[0].table },
        SeqSpan { q_start: 0, q_len: 5, ctx_len: 6, block_table: &w.seqs[1].table },
    ];
    standard_attention(&q, &w.pool(), &spans, &w.p, &mut out);
}

#[test]
#[should_panic(expected = "flash_attention: head_dim=24 is not a multiple of 16")]
fn flash_refuses_unsupported_head_dim() {
    let w = World::new(1, DType::F32, 4, 2, 1, 24, &[3], 1.0);
    let q = vec![0.0f32; 3 * w.row_len()];
    let mut out = q.clone();
    let spans = [SeqSpan { q_start: 0, q_len: 3, ctx_len: 3, block_table: &w.seqs[0].table }];
    flash_attention_with(Isa::Scalar, &q, &w.pool(), &spans, &w.p, &mut out);
}

/// Sliding-window attention: flash (every ISA and tile) and standard against the f64
/// reference that attends to the last `window` positions only; windows shorter than, equal
/// to and longer than a tile, prompts, chunks and decodes past the window. A window longer
/// than every context gives plain causal attention bit for bit.
#[test]
fn sliding_window_masks_positions_behind_the_window() {
    let mut rng = StdRng::seed_from_u64(23);
    for hd in [16, 48, 64] {
        for &window in &[1usize, 3, 8, 16, 40, 64, 100] {
            let c = random_case(&mut rng, hd);
            let mut w = World::new(rng.random(), c.dtype, c.bs, c.kv_heads * c.group, c.kv_heads, hd, &c.lens, c.q_amp);
            let parts = parts_for(&mut rng, c.lens);
            let full = w.call(&parts, 1, standard_attention);
            w.p.window = window;
            let std_out = w.call(&parts, 1, standard_attention);
            let e = max_err(&w, &parts, &std_out);
            assert!(e <= TOL_STANDARD, "standard window={window} hd={hd}: max error {e:e}");
            // The window changes the result whenever a context is longer than it.
            if c.lens.iter().any(|&l| l > window) {
                assert_ne!(full, std_out, "window={window} hd={hd} lens={:?} must change something", c.lens);
            }
            for isa in isas() {
                for tile in [16, 64, 128] {
                    w.p.tile_kv = tile;
                    let got = w.call(&parts, 1, |q, pool, s, p, o| flash_attention_with(isa, q, pool, s, p, o));
                    let e = max_err(&w, &parts, &got);
                    assert!(
                        e <= TOL_FLASH,
                        "flash {} tile={tile} window={window} hd={hd} lens={:?} bs={}: max error {e:e}",
                        isa.name(),
                        c.lens,
                        c.bs
                    );
                }
            }
            w.p.tile_kv = 64;
            w.p.window = 100_000;
            let wide = w.call(&parts, 1, |q, pool, s, p, o| flash_attention_with(isas()[0], q, pool, s, p, o));
            w.p.window = 0;
            let plain = w.call(&parts, 1, |q, pool, s, p, o| flash_attention_with(isas()[0], q, pool, s, p, o));
            assert_eq!(wide, plain, "a window longer than the context is plain causal attention");
        }
    }
}
