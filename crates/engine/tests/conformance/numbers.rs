//! The numbers behind the reference: roundoff units, encoding values as a dtype stores them,
//! weight matrices, and the f64 matmul / SwiGLU / MLP references with their error bounds.

use half::{bf16, f16};
use tboost_engine::backend::DType;
use tboost_kernels::gemm::quant::{dequantize_row, quantize_row_reference};
use tboost_ops::MatMulCase;
use tboost_testkit::golden::Rng;

/// Unit roundoff of f32 (half an ulp of 1).
pub const U: f64 = 1.0 / (1u64 << 24) as f64;
/// Smallest normal f32: below it results are subnormal and lose relative precision.
pub const MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;

/// Unit roundoff of one rounding to a 16-bit activation dtype (0 for f32, whose roundings the
/// f32 bounds already count).
pub fn u_act(act: DType) -> f64 {
    match act {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// Absolute floor of one rounding to the activation dtype: half the smallest f16 subnormal, or
/// (bf16, which has f32's range) the smallest normal f32.
pub fn tiny_act(act: DType) -> f64 {
    match act {
        DType::F16 => 2f64.powi(-25),
        DType::BF16 => MIN_NORMAL,
        _ => 0.0,
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `v` stored as `dtype`: dense types round to nearest even, block types through the
/// kernels' reference quantizer (valid GGUF blocks).
pub fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => f32_bytes(v),
        DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        q if q.is_quantized() => quantize_row_reference(q, v).unwrap_or_else(|e| panic!("quantize {q}: {e}")),
        other => panic!("encode: {other} is not a weight type"),
    }
}

/// The values `n` elements of `dtype` in `b` stand for (block types: ggml's dequantization).
pub fn decode(dtype: DType, b: &[u8], n: usize) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        q if q.is_quantized() => {
            let mut out = vec![0f32; n];
            dequantize_row(q, b, &mut out).unwrap_or_else(|e| panic!("dequantize {q}: {e}"));
            out
        }
        other => panic!("decode: {other} is not a weight type"),
    }
}

/// Rounds `v` to `dtype` and back (what a cache or gain of that dtype holds).
pub fn round_to(dtype: DType, v: &[f32]) -> Vec<f32> {
    decode(dtype, &encode(dtype, v), v.len())
}

pub const WEIGHT_TYPES: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

/// A weight matrix `[rows, cols]`: its bytes, and the values they stand for.
pub struct Mat {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
    pub vals: Vec<f32>,
}

impl Mat {
    pub fn random(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, amp: f32) -> Mat {
        let src = rng.vec(rows * cols, amp);
        let bytes = encode(dtype, &src);
        let vals = decode(dtype, &bytes, rows * cols);
        if dtype.is_quantized() {
            // The reference reads the weights through ggml's dequantization; check that the
            // blocks really carry the source values (within two quantization steps), so the
            // suite compares against real numbers and not, say, all zeros.
            let levels = match dtype {
                DType::Q2K | DType::Q3K => 3.0,
                DType::Q4_0 => 7.0,
                // Levels up to 24/127 of the scale apart.
                DType::IQ4NL | DType::IQ4XS => 10.0,
                DType::Q4_1 | DType::Q5_0 | DType::Q4K => 15.0,
                DType::Q5_1 | DType::Q5K | DType::Q6K => 31.0,
                _ => 127.0,
            };
            for r in 0..rows {
                let row = r * cols..(r + 1) * cols;
                let amax = src[row.clone()].iter().fold(0f32, |a, v| a.max(v.abs()));
                let err = src[row.clone()].iter().zip(&vals[row]).fold(0f32, |a, (s, v)| a.max((s - v).abs()));
                assert!(err <= 2.0 * amax / levels, "{dtype} row {r}: dequantized values off by {err} (amax {amax})");
            }
        }
        Mat { dtype, rows, cols, bytes, vals }
    }

    pub fn case(&self, act: DType) -> MatMulCase {
        MatMulCase { act_dtype: act, ..MatMulCase::f32(self.dtype, self.rows, self.cols) }
    }
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Bound of |silu'| over the reals (its maximum, at g ≈ 2.4, is 1.0998).
pub const SILU_LIP: f64 = 1.1;

/// `x · wᵀ + b` in f64 for `x` `[m, k]` and `w` `[n, k]` (as stored), and per output the
/// error bound of an f32 dot product over k terms: `(k + 4)·2⁻²⁴·(Σ|x·w| + |b|)` (any
/// summation order, fused or not, plus the bias add).
pub fn matmul_ref(x: &[f32], m: usize, w: &Mat, bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.rows, w.cols);
    let (mut out, mut bound) = (vec![0f64; m * n], vec![0f64; m * n]);
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w.vals[j * k..(j + 1) * k];
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..k {
                let p = xr[c] as f64 * wr[c] as f64;
                s += p;
                a += p.abs();
            }
            let b = bias.map_or(0.0, |b| b[j] as f64);
            out[i * n + j] = s + b;
            bound[i * n + j] = (k + 4) as f64 * U * (a + b.abs());
        }
    }
    (out, bound)
}

/// `silu(g) * u` from the reference gate/up results and their bounds: |silu'| ≤ 1.1 carries
/// the gate's error, the up error scales with |silu(g)|, and the f32 silu and product add
/// 8·2⁻²⁴ relative.
pub fn swiglu_ref(g: &[f64], eg: &[f64], u: &[f64], eu: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut out = Vec::with_capacity(g.len());
    let mut bound = Vec::with_capacity(g.len());
    for i in 0..g.len() {
        let s = silu(g[i]);
        out.push(s * u[i]);
        let (sa, ua) = (s.abs() + SILU_LIP * eg[i], u[i].abs() + eu[i]);
        bound.push(SILU_LIP * eg[i] * ua + s.abs() * eu[i] + 8.0 * U * sa * ua + MIN_NORMAL);
    }
    (out, bound)
}

/// One token through a SwiGLU MLP (`down · (silu(gate · x) * (up · x))`) in f64, with the
/// bound that carries every stage's f32 error forward, plus (`ua` > 0) the activation dtype's
/// roundings of the gate/up, SwiGLU and down outputs.
pub fn mlp_ref(x: &[f32], gate: &Mat, up: &Mat, down: &Mat, ua: f64) -> (Vec<f64>, Vec<f64>) {
    let (g, mut eg) = matmul_ref(x, 1, gate, None);
    let (u, mut eu) = matmul_ref(x, 1, up, None);
    for i in 0..g.len() {
        eg[i] += ua * g[i].abs();
        eu[i] += ua * u[i].abs();
    }
    let (h, mut eh) = swiglu_ref(&g, &eg, &u, &eu);
    for i in 0..h.len() {
        eh[i] += ua * h[i].abs();
    }
    let (hid, inter) = (down.rows, down.cols);
    let (mut y, mut ey) = (vec![0f64; hid], vec![0f64; hid]);
    for j in 0..hid {
        let dr = &down.vals[j * inter..(j + 1) * inter];
        let (mut s, mut a, mut carried) = (0f64, 0f64, 0f64);
        for i in 0..inter {
            let d = dr[i] as f64;
            s += d * h[i];
            a += (d * h[i]).abs() + d.abs() * eh[i];
            carried += d.abs() * eh[i];
        }
        y[j] = s;
        ey[j] = carried + (inter + 4) as f64 * U * a + ua * s.abs();
    }
    (y, ey)
}
