//! Plain scalar references for the tests: float64 accumulation, no tiling, no threads.

use crate::{DType, WeightMat, WeightVec};

/// Element `(r, c)` of a dense weight matrix, widened to f32.
///
/// # Panics
/// For quantized dtypes (the reference covers the dense ones only).
pub fn weight_at(w: &WeightMat<'_>, r: usize, c: usize) -> f32 {
    let row = w.row(r);
    match w.dtype {
        DType::F32 => f32::from_le_bytes(row[4 * c..4 * c + 4].try_into().unwrap()),
        DType::F16 => half::f16::from_le_bytes([row[2 * c], row[2 * c + 1]]).to_f32(),
        DType::BF16 => half::bf16::from_le_bytes([row[2 * c], row[2 * c + 1]]).to_f32(),
        other => panic!("matmul reference: {other} is not a dense dtype"),
    }
}

/// `x · wᵀ + bias` accumulated in f64, `[m, w.rows]`.
pub fn matmul(x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&WeightVec<'_>>) -> Vec<f64> {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "reference matmul: x is not [m={m}, k={k}]");
    let mut out = vec![0f64; m * n];
    for j in 0..n {
        let wr: Vec<f64> = (0..k).map(|c| weight_at(w, j, c) as f64).collect();
        let b = bias.map_or(0.0, |b| b.get(j) as f64);
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            out[i * n + j] = xr.iter().zip(&wr).map(|(&a, &b)| a as f64 * b).sum::<f64>() + b;
        }
    }
    out
}

/// `silu(x · gateᵀ) * (x · upᵀ)` in f64, `[m, gate.rows]`.
pub fn matmul_swiglu(x: &[f32], m: usize, gate: &WeightMat<'_>, up: &WeightMat<'_>) -> Vec<f64> {
    let g = matmul(x, m, gate, None);
    let u = matmul(x, m, up, None);
    g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect()
}

/// `f32 -> bf16` as AVX512_BF16's `vcvtne2ps2bf16` rounds: to nearest even, denormal inputs
/// to signed zero, NaN kept quiet.
pub fn bf16_round(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else if b & 0x7f80_0000 == 0 {
        ((b >> 16) & 0x8000) as u16
    } else {
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// A bf16 input of `vdpbf16ps`, widened; denormals count as signed zeros.
fn bf16_f32(h: u16) -> f32 {
    let h = if h & 0x7f80 == 0 { h & 0x8000 } else { h };
    f32::from_bits((h as u32) << 16)
}

/// Flushes a denormal result to a signed zero (`vdpbf16ps` flushes its results).
fn ftz(v: f32) -> f32 {
    if v != 0.0 && v.is_subnormal() {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// One `vdpbf16ps` lane on value pair `q` of bf16 `xb` and weight row `row` (values past `k`
/// are the zero padding): `acc += x[2q+1]·w[2q+1]`, then `acc += x[2q]·w[2q]`.
fn dot_pair(mut acc: f32, xb: &[u16], row: &[u8], k: usize, q: usize) -> f32 {
    for e in [2 * q + 1, 2 * q] {
        let (xe, we) = if e < k { (xb[e], u16::from_le_bytes([row[2 * e], row[2 * e + 1]])) } else { (0, 0) };
        // Both factors have 8 significant bits: the product is exact in f32.
        let p = ftz(bf16_f32(xe) * bf16_f32(we));
        acc = ftz(acc + p);
    }
    acc
}

/// `x · wᵀ + bias` for BF16 `w` with the activations rounded to bf16, each output's sum
/// given by `sum(bf16 x row, weight row)`; `[m, w.rows]`.
fn emulate_bf16(
    what: &str,
    x: &[f32],
    m: usize,
    w: &WeightMat<'_>,
    bias: Option<&WeightVec<'_>>,
    sum: impl Fn(&[u16], &[u8]) -> f32,
) -> Vec<f32> {
    assert_eq!(w.dtype, DType::BF16, "reference {what}: weights are {}", w.dtype);
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "reference {what}: x is not [m={m}, k={k}]");
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let xb: Vec<u16> = x[i * k..(i + 1) * k].iter().map(|&v| bf16_round(v)).collect();
        for j in 0..n {
            let s = sum(&xb, w.row(j));
            out[i * n + j] = match bias {
                Some(b) => s + b.get(j),
                None => s,
            };
        }
    }
    out
}

/// A scalar emulation of `matmul_fast` for BF16 weights (`Precision::Fast`) in the row
/// layout, bit for bit: the order stated in `fast_bf16`'s module docs, `[m, w.rows]`.
///
/// # Panics
/// When `w` is not BF16 or `x` is not `[m, w.cols]`.
pub fn matmul_fast_bf16(x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&WeightVec<'_>>) -> Vec<f32> {
    let k = w.cols;
    emulate_bf16("matmul_fast_bf16", x, m, w, bias, |xb, row| {
        // Lane `l` takes pair `16t + l` of each 32-value block, the padded last one included.
        let mut lanes = [0f32; 16];
        for t in 0..k.div_ceil(32) {
            for (l, acc) in lanes.iter_mut().enumerate() {
                *acc = dot_pair(*acc, xb, row, k, 16 * t + l);
            }
        }
        let s8: [f32; 8] = std::array::from_fn(|q| lanes[q] + lanes[q + 8]);
        let s4: [f32; 4] = std::array::from_fn(|q| s8[q] + s8[q + 4]);
        let s2: [f32; 2] = std::array::from_fn(|q| s4[q] + s4[q + 2]);
        s2[0] + s2[1]
    })
}

/// A scalar emulation of `matmul_fast` for BF16 weights in pair panels
/// (`dense::bf16_pair_panels`), bit for bit: each output one chain over the value pairs in
/// increasing order (one `vdpbf16ps` lane per pair), then the bias; `[m, w.rows]`. `w` is
/// the row-major BF16 matrix that was packed.
///
/// # Panics
/// When `w` is not BF16 or `x` is not `[m, w.cols]`.
pub fn matmul_fast_bf16_pairs(x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&WeightVec<'_>>) -> Vec<f32> {
    let k = w.cols;
    emulate_bf16("matmul_fast_bf16_pairs", x, m, w, bias, |xb, row| {
        // The chain runs over the zero pairs padding k to whole 32-value blocks too.
        (0..k.div_ceil(32) * 16).fold(0f32, |acc, q| dot_pair(acc, xb, row, k, q))
    })
}

/// A scalar emulation of `matmul_fast` for F16 or BF16 weights in pair panels on the tile
/// arithmetic (`dense::amx_pair_panels`), bit for bit. F16: weights and activations split into
/// bf16 hi and lo parts, per 32-value block three `tdpbf16ps` products (`xh·wh`, `xh·wl`,
/// `xl·wh`); BF16: the one product `xh·w`. Each product is an even and an odd chain of FMAs
/// from zero, then `C + (e + o)`, with denormal inputs read as zero and denormal results
/// flushed; then the bias; `[m, w.rows]`. `w` is the row-major matrix that was packed.
///
/// # Panics
/// When `w` is neither F16 nor BF16 or `x` is not `[m, w.cols]`.
pub fn matmul_fast_pair_tiles(x: &[f32], m: usize, w: &WeightMat<'_>, bias: Option<&WeightVec<'_>>) -> Vec<f32> {
    let f16 = w.dtype == DType::F16;
    assert!(f16 || w.dtype == DType::BF16, "reference matmul_fast_pair_tiles: weights are {}", w.dtype);
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "reference matmul_fast_pair_tiles: x is not [m={m}, k={k}]");
    let kp = k.div_ceil(32) * 32;
    // The parts of an f32: its top 8 significant bits, and the rest.
    let hi = |v: f32| f32::from_bits(v.to_bits() & 0xffff_0000);
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        let xh: Vec<f32> = (0..kp).map(|c| if c < k { bf16_f32(bf16_round(xr[c])) } else { 0.0 }).collect();
        let xl: Vec<f32> = (0..kp).map(|c| if c < k { bf16_f32(bf16_round(xr[c] - xh[c])) } else { 0.0 }).collect();
        for j in 0..n {
            let wv: Vec<f32> = (0..kp).map(|c| if c < k { weight_at(w, j, c) } else { 0.0 }).collect();
            // BF16 weights are bf16 already (`bf16_f32` reads a denormal one as zero).
            let wh: Vec<f32> =
                wv.iter().map(|&v| if f16 { hi(v) } else { bf16_f32((v.to_bits() >> 16) as u16) }).collect();
            let wl: Vec<f32> = wv.iter().zip(&wh).map(|(&v, &h)| v - h).collect();
            let products: &[(&Vec<f32>, &Vec<f32>)] =
                if f16 { &[(&xh, &wh), (&xh, &wl), (&xl, &wh)] } else { &[(&xh, &wh)] };
            let mut c = 0f32;
            for t in 0..kp / 32 {
                for &(a, b) in products {
                    let (mut e, mut o) = (0f32, 0f32);
                    for q in 0..16 {
                        let v = 32 * t + 2 * q;
                        e = ftz(a[v].mul_add(b[v], e));
                        o = ftz(a[v + 1].mul_add(b[v + 1], o));
                    }
                    c = ftz(c + ftz(e + o));
                }
            }
            out[i * n + j] = match bias {
                Some(b) => c + b.get(j),
                None => c,
            };
        }
    }
    out
}

pub mod quant;
