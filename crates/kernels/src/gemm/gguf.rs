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
    Q4_1: 32, 20;
    Q5_0: 32, 22;
    Q5_1: 32, 24;
    Q8_0: 32, 34;
    IQ4NL: 32, 18;
    IQ4XS: 256, 136;
    Q2K: 256, 84;
    Q3K: 256, 110;
    Q4K: 256, 144;
    Q5K: 256, 176;
    Q6K: 256, 210;
}

/// `$body` with `$F` the [`Block`] type of `$dtype`, or `$other` for a dtype that is not a
/// block format the kernels read (`packed:` first: not one `panel_pack` has a layout for).
macro_rules! with_block {
    (packed: $dtype:expr, $F:ident => $body:expr, _ => $other:expr) => {
        $crate::gemm::gguf::with_block!(@ [Q4_0 Q5_0 Q8_0 Q4K Q5K Q6K] $dtype, $F => $body, _ => $other)
    };
    ($dtype:expr, $F:ident => $body:expr, _ => $other:expr) => {
        $crate::gemm::gguf::with_block!(
            @ [Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4NL IQ4XS Q2K Q3K Q4K Q5K Q6K] $dtype, $F => $body, _ => $other
        )
    };
    (@ [$($t:ident)*] $dtype:expr, $F:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $($crate::DType::$t => {
                type $F = $crate::gemm::gguf::$t;
                $body
            })*
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

/// The 16 signed levels a 4-bit IQ4_NL / IQ4_XS index selects (ggml's `kvalues_iq4nl`).
pub(crate) const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Bytes of an IQ4_XS super-block before its quants: d (f16), scales_h (u16), scales_l (4 bytes).
pub(crate) const IQ4XS_QS: usize = 8;

/// The signed scale `ls - 32` of group `j` (0..8) of an IQ4_XS super-block `b`: 4 low bits
/// from `scales_l`, 2 high bits from `scales_h`.
#[inline]
pub(crate) fn iq4xs_scale(b: &[u8], j: usize) -> i32 {
    let hi = (u16::from_le_bytes([b[2], b[3]]) >> (2 * j)) & 3;
    let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0xF;
    (lo as i32 | (hi as i32) << 4) - 32
}

/// Q2_K byte offsets: 16 bytes of 4-bit scale and min pairs (scale low), `qs` (64 bytes, two
/// bits each, as Q3_K's), then d and dmin (f16).
pub(crate) const Q2K_QS: usize = 16;
pub(crate) const Q2K_D: usize = 80;

/// Q3_K byte offsets: `hmask` (32 bytes, the third bit), `qs` (64, two bits each), 12 bytes of
/// packed 6-bit scales, then d (f16).
pub(crate) const Q3K_QS: usize = 32;
pub(crate) const Q3K_SCALES: usize = 96;
pub(crate) const Q3K_D: usize = 108;

/// The signed scale `s - 32` of sub-block `j` (0..16, 16 values each) of a Q3_K super-block `b`:
/// 4 low bits from bytes 0..8 (low nibbles for j < 8, high for j >= 8), 2 high bits from byte
/// `8 + j % 4`, bits `2 (j / 4)`.
#[inline]
pub(crate) fn q3k_scale(b: &[u8], j: usize) -> i32 {
    let sc = &b[Q3K_SCALES..Q3K_SCALES + 12];
    let lo = (sc[j % 8] >> (4 * (j / 8))) & 0xF;
    let hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    (lo as i32 | (hi as i32) << 4) - 32
}

/// Values per activation and weight group.
pub(crate) const GROUP: usize = 32;

/// Whether the format subtracts per-group mins (the `-M_g * Y_g` term).
pub(crate) fn has_mins(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q2K | DType::Q4K | DType::Q5K)
}

/// One 32-value group of a weight row in the integer form (see the module doc).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    pub w: [i8; GROUP],
    pub sc: [i32; 2],
    pub a: f32,
    pub m: f32,
    /// Integer multiples of `m` per 16-value half: `[1, 1]` except Q2_K (its 4-bit mins).
    pub ms: [i32; 2],
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
    let (mut sc, mut m, mut ms) = ([1, 1], 0f32, [1, 1]);
    let a;
    match dtype {
        DType::Q4_0 => {
            a = f16_at(b, 0);
            for l in 0..16 {
                w[l] = (b[2 + l] & 0xF) as i8 - 8;
                w[l + 16] = (b[2 + l] >> 4) as i8 - 8;
            }
        }
        DType::Q4_1 => {
            // value = d q + min: w = q, A = d, M = -min.
            (a, m) = (f16_at(b, 0), -f16_at(b, 2));
            for l in 0..16 {
                w[l] = (b[4 + l] & 0xF) as i8;
                w[l + 16] = (b[4 + l] >> 4) as i8;
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            // Q5_1: value = d q + min, its d and min before qh; Q5_0: value = d (q - 16).
            let (o, off) = if dtype == DType::Q5_1 { (4, 0) } else { (2, 16) };
            a = f16_at(b, 0);
            if dtype == DType::Q5_1 {
                m = -f16_at(b, 2);
            }
            let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
            for l in 0..16 {
                let hi0 = ((qh >> l) & 1) as u8;
                let hi1 = ((qh >> (l + 16)) & 1) as u8;
                w[l] = ((b[o + 4 + l] & 0xF) | (hi0 << 4)) as i8 - off;
                w[l + 16] = ((b[o + 4 + l] >> 4) | (hi1 << 4)) as i8 - off;
            }
        }
        DType::IQ4NL | DType::IQ4XS => {
            // value = A * level[nibble]; IQ4_XS: A = d (ls - 32) per 32-value group.
            let (qs, aa) = if dtype == DType::IQ4NL {
                (&b[2..18], f16_at(b, 0))
            } else {
                (&b[IQ4XS_QS + 16 * j..IQ4XS_QS + 16 * j + 16], f16_at(b, 0) * iq4xs_scale(b, j) as f32)
            };
            a = aa;
            for l in 0..16 {
                w[l] = IQ4_LEVELS[(qs[l] & 0xF) as usize];
                w[l + 16] = IQ4_LEVELS[(qs[l] >> 4) as usize];
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
        DType::Q2K => {
            // Group j: bits 2 (j % 4) of qs[32 (j / 4) + l]; value = d sc q - dmin m per half.
            (a, m) = (f16_at(b, Q2K_D), f16_at(b, Q2K_D + 2));
            let qs = &b[Q2K_QS + 32 * (j / 4)..];
            for l in 0..GROUP {
                w[l] = ((qs[l] >> (2 * (j % 4))) & 3) as i8;
            }
            sc = [(b[2 * j] & 0xF) as i32, (b[2 * j + 1] & 0xF) as i32];
            ms = [(b[2 * j] >> 4) as i32, (b[2 * j + 1] >> 4) as i32];
        }
        DType::Q3K => {
            // Group j: bits 2 (j % 4) of qs[32 (j / 4) + l], bit j of hmask[l]; w = q - 4.
            a = f16_at(b, Q3K_D);
            let qs = &b[Q3K_QS + 32 * (j / 4)..];
            for l in 0..GROUP {
                let lo = (qs[l] >> (2 * (j % 4))) & 3;
                let hi = (b[l] >> j) & 1;
                w[l] = (lo | (hi << 2)) as i8 - 4;
            }
            sc = [q3k_scale(b, 2 * j), q3k_scale(b, 2 * j + 1)];
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
    Group { w, sc, a, m, ms }
}
