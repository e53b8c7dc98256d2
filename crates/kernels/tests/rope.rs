//! RoPE: both pairings and partial rotation against the f64 reference, llama3 frequencies
//! against hand-computed values, and the GGUF permutation identity between the pairings.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tboost_kernels::rope::{apply, cos_sin, inv_freq, reference, Llama3Scaling, RopeStyle};

#[test]
fn inv_freq_plain_and_llama3_match_hand_computed_values() {
    let plain = inv_freq(8, 10000.0, None);
    assert_eq!(plain.len(), 4);
    for (got, want) in plain.iter().zip([1.0, 0.1, 0.01, 0.001]) {
        assert!((got - want).abs() <= 1e-15 * want, "{got} vs {want}");
    }
    // orig 1024, low 1, high 4: wavelengths 2π/inv = 6.28, 62.8 (below 256: kept), 628.3
    // (between 256 and 1024: smooth = (1024/628.3185 - 1)/3 = 0.2099155...), 6283 (above
    // 1024: divided by 8).
    let s = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 1024.0,
    };
    let scaled = inv_freq(8, 10000.0, Some(&s));
    let smooth: f64 = 0.209_915_539_087_002_75;
    let want = [1.0, 0.1, (1.0 - smooth) * 0.01 / 8.0 + smooth * 0.01, 0.001 / 8.0];
    assert!((want[2] - 0.003_086_760_967_011_274).abs() < 1e-17);
    for (i, (got, want)) in scaled.iter().zip(want).enumerate() {
        assert!((got - want).abs() <= 1e-13 * want, "inv_freq[{i}] = {got}, want {want}");
    }
}

#[test]
fn cos_sin_tables_are_f64_angles_rounded_once() {
    let f = inv_freq(16, 500000.0, None);
    let pos = [0u32, 1, 4095, 131071];
    let (c, s) = cos_sin(&pos, &f);
    assert_eq!((c.len(), s.len()), (32, 32));
    for (r, &p) in pos.iter().enumerate() {
        for (i, &fi) in f.iter().enumerate() {
            let a = p as f64 * fi;
            assert_eq!(c[r * 8 + i], a.cos() as f32);
            assert_eq!(s[r * 8 + i], a.sin() as f32);
        }
    }
}

#[test]
fn both_styles_and_partial_rotation_match_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    for (head_dim, rot_dim) in [(64, 64), (128, 128), (80, 32), (96, 64), (2, 2)] {
        for style in [RopeStyle::HalfSplit, RopeStyle::Adjacent] {
            let heads = 3;
            let pos = [0u32, 1, 17, 5000, 100_000];
            let f = inv_freq(rot_dim, 10000.0, None);
            let (c, s) = cos_sin(&pos, &f);
            let x0: Vec<f32> = (0..pos.len() * heads * head_dim).map(|_| rng.random_range(-4.0f32..4.0)).collect();
            let mut x = x0.clone();
            apply(&mut x, heads, head_dim, &c, &s, style);
            for (r, &p) in pos.iter().enumerate() {
                for h in 0..heads {
                    let o = (r * heads + h) * head_dim;
                    let want = reference::rotate(&x0[o..o + head_dim], p, &f, style);
                    for d in 0..head_dim {
                        // f32 tables (|error| <= 2^-24) and two f32 products: a few ulps of |x|.
                        let err = (x[o + d] as f64 - want[d]).abs();
                        assert!(err <= 2e-6, "{style:?} hd={head_dim} rot={rot_dim} pos={p} dim {d}: error {err:e}");
                        if d >= rot_dim {
                            assert_eq!(x[o + d], x0[o + d], "dims past rot_dim pass through");
                        }
                    }
                }
            }
        }
    }
}

/// GGUF llama q/k weights are permuted per head so that half-split pair (i, i + d/2)
/// becomes adjacent pair (2i, 2i + 1); the projection of permuted weights is the permuted
/// projection, so Adjacent on it must equal HalfSplit on the unpermuted one, bit for bit.
#[test]
fn adjacent_on_gguf_permuted_rows_equals_half_split() {
    let mut rng = StdRng::seed_from_u64(10);
    let (heads, d, rows) = (4, 64, 6);
    let f = inv_freq(d, 10000.0, None);
    let pos: Vec<u32> = (0..rows as u32).map(|i| i * 1000 + 3).collect();
    let (c, s) = cos_sin(&pos, &f);
    let x: Vec<f32> = (0..rows * heads * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    // permute(): new row 2i + j takes old row j * d/2 + i, per head.
    let perm = |v: &[f32]| -> Vec<f32> {
        let mut p = vec![0.0; v.len()];
        for (hp, hv) in p.chunks_exact_mut(d).zip(v.chunks_exact(d)) {
            for i in 0..d / 2 {
                hp[2 * i] = hv[i];
                hp[2 * i + 1] = hv[i + d / 2];
            }
        }
        p
    };
    let mut half_split = x.clone();
    apply(&mut half_split, heads, d, &c, &s, RopeStyle::HalfSplit);
    let mut adjacent = perm(&x);
    apply(&mut adjacent, heads, d, &c, &s, RopeStyle::Adjacent);
    let want: Vec<u32> = perm(&half_split).iter().map(|v| v.to_bits()).collect();
    assert_eq!(adjacent.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
}

#[test]
#[should_panic(expected = "rope: tables rotate 66 dims, more than head_dim 64")]
fn apply_rejects_tables_wider_than_the_head() {
    let (c, s) = cos_sin(&[1], &inv_freq(66, 10000.0, None));
    apply(&mut [0.0; 64], 1, 64, &c, &s, RopeStyle::HalfSplit);
}
