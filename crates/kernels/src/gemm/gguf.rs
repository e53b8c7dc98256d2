//! The GGUF block formats as the kernels read them: one marker type per format ([`Block`]:
//! values and bytes per block), the dispatch from a `DType` to it ([`with_block!`]), where a
//! block keeps its scales, mins and quants, and the scalar decode of one 32-value group into
//! the integer form of the `Fast` precision. The reference, the `Exact` unpacking and the
//! `Fast` paths all read the formats through this one description; each SIMD path adds its
//! own unpacking as a trait on these marker types.

use crate::DType;

/// A GGUF block format: values and bytes per block.
pub(crate) trait Block {
    const ELEMS: usize;
    const BYTES: usize;
}

macro_rules! blocks {
    ($($name:ident: $elems:literal, $bytes:literal;)*) => {$(
        pub(crate) struct $name;
        impl Block for $name {
            const ELEMS: usize = $elems;
            const BYTES: usize = $bytes;
        }
    )*};
}

blocks! {
    Q4_0: 32, 18;
    Q5_0: 32, 22;
    Q8_0: 32, 34;
    Q4K: 256, 144;
    Q5K: 256, 176;
    Q6K: 256, 210;
}

/// `$body` with `$F` the [`Block`] type of `$dtype`, or `$other` for a dtype that is not a
/// block format the kernels read.
macro_rules! with_block {
    ($dtype:expr, $F:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $crate::DType::Q4_0 => {
                type $F = $crate::gemm::gguf::Q4_0;
                $body
            }
            $crate::DType::Q5_0 => {
                type $F = $crate::gemm::gguf::Q5_0;
                $body
            }
            $crate::DType::Q8_0 => {
                type $F = $crate::gemm::gguf::Q8_0;
                $body
            }
            $crate::DType::Q4K => {
                type $F = $crate::gemm::gguf::Q4K;
                $body
            }
            $crate::DType::Q5K => {
                type $F = $crate::gemm::gguf::Q5K;
                $body
            }
            $crate::DType::Q6K => {
                type $F = $crate::gemm::gguf::Q6K;
                $body
            }
            _ => $other,
        }
    };
}
pub(crate) use with_block;

/// 6-bit scale and min `j` (0..8) of a Q4_K / Q5_K super-block (ggml's `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Values per activation and weight group.
pub(crate) const GROUP: usize = 32;

/// Whether the format subtracts per-group mins (the `-M_g * Y_g` term).
pub(crate) fn has_mins(dtype: DType) -> bool {
    matches!(dtype, DType::Q4K | DType::Q5K)
}

/// One 32-value group of a weight row in the integer form (see the module doc).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    pub w: [i8; GROUP],
    pub sc: [i32; 2],
    pub a: f32,
    pub m: f32,
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Group `g` of the weight row `row` (scalar decode, the definition the SIMD unpacking follows).
pub(crate) fn group(dtype: DType, row: &[u8], g: usize) -> Group {
    let (qk, bb) = (dtype.block_elems(), dtype.block_bytes());
    let b = &row[(g * GROUP / qk) * bb..][..bb];
    let j = (g * GROUP % qk) / GROUP;
    let mut w = [0i8; GROUP];
    let (mut sc, mut m) = ([1, 1], 0f32);
    let a;
    match dtype {
        DType::Q4_0 => {
            a = f16_at(b, 0);
            for l in 0..16 {
                w[l] = (b[2 + l] & 0xF) as i8 - 8;
                w[l + 16] = (b[2 + l] >> 4) as i8 - 8;
            }
        }
        DType::Q5_0 => {
            a = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for l in 0..16 {
                let hi0 = ((qh >> l) & 1) as u8;
                let hi1 = ((qh >> (l + 16)) & 1) as u8;
                w[l] = ((b[6 + l] & 0xF) | (hi0 << 4)) as i8 - 16;
                w[l + 16] = ((b[6 + l] >> 4) | (hi1 << 4)) as i8 - 16;
            }
        }
        DType::Q8_0 => {
            a = f16_at(b, 0);
            for l in 0..GROUP {
                w[l] = b[2 + l] as i8;
            }
        }
        DType::Q4K | DType::Q5K => {
            let (s, mn) = scale_min_k4(j, &b[4..16]);
            a = f16_at(b, 0) * s as f32;
            m = f16_at(b, 2) * mn as f32;
            // Sub-blocks 2p (low nibbles) and 2p+1 (high nibbles) share 32 bytes.
            let (p, shift) = (j / 2, 4 * (j % 2));
            let (qs, qh) = if dtype == DType::Q4K { (&b[16..144], None) } else { (&b[48..176], Some(&b[16..48])) };
            for l in 0..GROUP {
                let lo = (qs[32 * p + l] >> shift) & 0xF;
                let hi = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                w[l] = (lo | hi) as i8;
            }
        }
        DType::Q6K => {
            a = f16_at(b, 208);
            // Group j: half n = j / 4 of the super-block, quarter gq = j % 4 (ggml's q1..q4).
            let (n, gq) = (j / 4, j % 4);
            let ql = &b[64 * n + 32 * (gq % 2)..];
            let qh = &b[128 + 32 * n..];
            for l in 0..GROUP {
                let lo = (ql[l] >> (4 * (gq / 2))) & 0xF;
                let hi = (qh[l] >> (2 * gq)) & 3;
                w[l] = (lo | (hi << 4)) as i8 - 32;
            }
            sc = [b[192 + 2 * j] as i8 as i32, b[192 + 2 * j + 1] as i8 as i32];
        }
        _ => unreachable!("group is only called for block types"),
    }
    Group { w, sc, a, m }
}
