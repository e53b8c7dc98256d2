//! Block-quantized weights repacked for the `Fast` precision: 16 output rows interleaved per
//! 32-value group ("panels"), so that an integer dot product leaves one output row per i32
//! lane and no horizontal sums are needed (llama.cpp's CPU "repack" buffers, e.g.
//! `block_q4_0x8`, serve the same purpose).
//!
//! The GGUF layout stores each row's blocks one after the other, so a GEMV reading it must
//! reduce every group's products across lanes (the direct path in `int_dot`: a tree of
//! permutes per 16 groups). Here one `vpdpbusd` multiplies 4 activation bytes (broadcast)
//! with 4 weight bytes of each of 16 rows, and the float step runs on 16 rows at once.
//!
//! ## Layout
//! Rows are grouped in panels of [`PANEL`] (the last panel padded with zero rows). A packed
//! matrix is all panels' quant bytes (panel after panel, each panel's `ng = k / 32` groups in
//! natural order, `QB` bytes per group), then all panels' scales (same order, `SB` bytes
//! per group on average). A run of panels is thus two sequential streams, which the hardware
//! prefetchers follow best (measured: interleaving scales with quants per 16 groups, one
//! stream, streamed 30% slower here, and splitting per panel, 30-50% slower), and quant
//! loads stay 64-byte aligned.
//!
//! Quants (every layout gives, per quad `t` = values `4t..4t + 4` of the group, one vector
//! with the 16 rows in 4-byte lanes, as unsigned bytes `u`):
//! - nibbles (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K), 256 bytes: 4 blocks of 64; byte `64L + 4r + t`
//!   is `n(r, 8L + t) | n(r, 8L + 4 + t) << 4` (`n` the low 4 bits of `u` of row `r`). Low
//!   nibbles give quad `2L`, high nibbles quad `2L + 1`;
//! - fifth bits (Q5_0, Q5_K), 64 bytes after the nibbles: bit `t` of byte `4r + v` is bit 4
//!   of `u(r, 4t + v)`;
//! - bits 4 and 5 (Q6_K), 128 bytes after the nibbles: bits `2t', 2t' + 1` of byte
//!   `64h + 4r + v` are bits 4, 5 of `u(r, 4(4h + t') + v)`;
//! - bytes (Q8_0), 512 bytes: byte `64t + 4r + v` is `w(r, 4t + v) + 128`.
//!
//! `u` is the weight `w` of `q8_activations`'s module doc plus the format's bias: Q4_0 8, Q5_0 16,
//! Q6_K 32, Q8_0 128, none for Q4_K / Q5_K.
//!
//! Scales:
//! - Q4_0, Q5_0, Q8_0 (`SB` 32): the 16 rows' `d` as f16, per group;
//! - Q4_K, Q5_K (`SB` 40): per super-block of 8 groups, 320 bytes: the 16 rows' `d` and
//!   `dmin` (f16), then per group the 16 rows' 6-bit scales as bytes, then their mins;
//! - Q6_K (`SB` 36): per super-block, 288 bytes: the 16 rows' `d` (f16), then per group
//!   and half the 16 rows' signed scales (i8).
//!
//! Same size as the GGUF bytes of the panel's rows. The arithmetic is exactly `q8_activations`'s (its
//! module doc): `D_g` is the same integer, and `acc[g mod 16]` takes the same float steps, so
//! results are bit-identical to the GGUF-layout kernels at every ISA level.

use super::q8_activations::{self, Group, GROUP};
use crate::DType;

/// Output rows per panel (one i32 / f32 lane each).
pub const PANEL: usize = 16;
/// Values per group: `cols` must be a multiple of it.
pub const GROUP_VALUES: usize = GROUP;

/// Whether `dtype` has a packed layout.
pub fn packable(dtype: DType) -> bool {
    crate::gemm::gguf::with_block!(packed: dtype, _F => true, _ => false)
}

/// What a panel's unsigned weight bytes carry above the signed weight `w` (`u = w + bias`).
fn weight_bias(dtype: DType) -> i32 {
    match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q6K => 32,
        DType::Q8_0 => 128,
        _ => 0,
    }
}

/// Quant and scale bytes per group of one panel (scales: on average, for the K types).
pub(crate) fn group_bytes(dtype: DType) -> (usize, usize) {
    match dtype {
        DType::Q4_0 => (256, 32),
        DType::Q5_0 => (320, 32),
        DType::Q8_0 => (512, 32),
        DType::Q4K => (256, 40),
        DType::Q5K => (320, 40),
        DType::Q6K => (384, 36),
        _ => unreachable!("packed layout is only defined for packable types"),
    }
}

/// Groups per super-block of the K types (their `d` and `dmin` are per super-block).
pub(crate) const SUPER: usize = 8;

/// Byte offsets inside one super-block's scales: K4 (Q4_K, Q5_K) and Q6_K.
pub(crate) struct K4;
impl K4 {
    pub const D: usize = 0;
    pub const DMIN: usize = 2 * PANEL;
    pub const SC: usize = 4 * PANEL;
    pub const M: usize = Self::SC + SUPER * PANEL;
    pub const BYTES: usize = Self::M + SUPER * PANEL;
}
pub(crate) struct K6;
impl K6 {
    pub const D: usize = 0;
    pub const SC: usize = 2 * PANEL;
    pub const BYTES: usize = Self::SC + 2 * SUPER * PANEL;
}

/// Bytes of one panel of a `[_, cols]` matrix (quants and scales).
pub fn panel_bytes(dtype: DType, cols: usize) -> usize {
    let (qb, sb) = group_bytes(dtype);
    cols / GROUP * (qb + sb)
}

/// Bytes of a packed `[rows, cols]` matrix (rows rounded up to whole panels).
pub fn packed_bytes(dtype: DType, rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL) * panel_bytes(dtype, cols)
}

/// Where the parts of a packed `[rows, cols]` matrix are: all panels' quants (`q_stride`
/// bytes each), then all panels' scales (`s_stride` bytes each).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub q_stride: usize,
    pub s_stride: usize,
    pub panels: usize,
}

impl Geometry {
    pub fn of(dtype: DType, rows: usize, cols: usize) -> Geometry {
        let (qb, sb) = group_bytes(dtype);
        let ng = cols / GROUP;
        Geometry { q_stride: ng * qb, s_stride: ng * sb, panels: rows.div_ceil(PANEL) }
    }

    /// Offsets of panel `p`'s quants and scales.
    #[inline]
    pub fn offsets(&self, p: usize) -> (usize, usize) {
        (p * self.q_stride, self.panels * self.q_stride + p * self.s_stride)
    }
}

/// `src`, a GGUF-layout `[rows, cols]` matrix of `dtype`, in the packed layout (panels in
/// parallel on the current rayon pool). Panics when `dtype` is not packable or the sizes
/// disagree (a caller bug: [`crate::WeightMat::new`] checks a matrix).
pub fn pack(dtype: DType, rows: usize, cols: usize, src: &[u8], dst: &mut [u8]) {
    pack_panels(dtype, rows, cols, src, dst, 0..rows.div_ceil(PANEL))
}

/// [`pack`] of panels `panels` only (the rest of `dst` untouched). `src` holds the stored
/// rows of those panels only (rows `panels.start * PANEL` up to `panels.end * PANEL` or
/// `rows`): a caller can read a large matrix in parts into a buffer of its own and pack each.
pub fn pack_panels(dtype: DType, rows: usize, cols: usize, src: &[u8], dst: &mut [u8], panels: std::ops::Range<usize>) {
    use rayon::prelude::*;
    assert!(packable(dtype) && cols.is_multiple_of(GROUP), "{rows}x{cols} {dtype} has no packed layout");
    let part_rows = (panels.end * PANEL).min(rows).saturating_sub(panels.start * PANEL);
    assert_eq!(
        Some(src.len()),
        dtype.bytes_for(cols).map(|rb| rb * part_rows),
        "{rows}x{cols} {dtype} source size of panels {panels:?}"
    );
    assert_eq!(dst.len(), packed_bytes(dtype, rows, cols), "{rows}x{cols} {dtype} packed size");
    let geo = Geometry::of(dtype, rows, cols);
    if geo.q_stride == 0 {
        return;
    }
    assert!(panels.end <= geo.panels, "panels {panels:?} of {}", geo.panels);
    let out = SharedOut(dst.as_mut_ptr());
    let first = panels.start;
    panels.into_par_iter().for_each(|p| {
        let (qo, so) = geo.offsets(p);
        // SAFETY: panels' quant and scale ranges are disjoint and inside `dst` (sized by
        // `packed_bytes`, checked above); `dst` stays mutably borrowed until all are done.
        let (q, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(out.get().add(qo), geo.q_stride),
                std::slice::from_raw_parts_mut(out.get().add(so), geo.s_stride),
            )
        };
        pack_panel(dtype, src, first * PANEL, rows, cols, p, q, s)
    });
}

#[derive(Clone, Copy)]
struct SharedOut(*mut u8);
// SAFETY: only used for disjoint writes while the owning slice is mutably borrowed.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    fn get(&self) -> *mut u8 {
        self.0
    }
}

/// Packs panel `p` of a GGUF-layout matrix into its quants `q` and scales `s`; `src` holds
/// its rows from `src_row0` on. Rows past `rows` are zero.
#[allow(clippy::too_many_arguments)]
fn pack_panel(
    dtype: DType,
    src: &[u8],
    src_row0: usize,
    rows: usize,
    cols: usize,
    p: usize,
    quants: &mut [u8],
    scales: &mut [u8],
) {
    let ng = cols / GROUP;
    let (qb, sb) = group_bytes(dtype);
    let row_bytes = dtype.bytes_for(cols).expect("whole blocks");
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    quants.fill(0);
    scales.fill(0);
    for r in 0..PANEL {
        let j = p * PANEL + r;
        if j >= rows {
            break;
        }
        let row = &src[(j - src_row0) * row_bytes..(j - src_row0 + 1) * row_bytes];
        for g in 0..ng {
            let block = &row[(g * GROUP / be) * bb..][..bb];
            let gr = q8_activations::group(dtype, row, g);
            let bias = weight_bias(dtype);
            let u: [u8; GROUP] = std::array::from_fn(|e| (gr.w[e] as i32 + bias) as u8);
            let q = &mut quants[g * qb..(g + 1) * qb];
            if dtype == DType::Q8_0 {
                for t in 0..8 {
                    for v in 0..4 {
                        q[64 * t + 4 * r + v] = u[4 * t + v];
                    }
                }
            } else {
                for l in 0..4 {
                    for t in 0..4 {
                        q[64 * l + 4 * r + t] = (u[8 * l + t] & 0xF) | ((u[8 * l + 4 + t] & 0xF) << 4);
                    }
                }
                for t in 0..8 {
                    for v in 0..4 {
                        let hi = u[4 * t + v] >> 4;
                        if matches!(dtype, DType::Q5_0 | DType::Q5K) {
                            q[256 + 4 * r + v] |= (hi & 1) << t;
                        } else if dtype == DType::Q6K {
                            q[256 + 64 * (t / 4) + 4 * r + v] |= (hi & 3) << (2 * (t % 4));
                        }
                    }
                }
            }
            let (sbk, jg) = (g / SUPER * SUPER * sb, g % SUPER);
            match dtype {
                DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => {
                    scales[g * sb + 2 * r..][..2].copy_from_slice(&block[..2]);
                }
                DType::Q4K | DType::Q5K => {
                    let s = &mut scales[sbk..sbk + K4::BYTES];
                    s[K4::D + 2 * r..][..2].copy_from_slice(&block[0..2]);
                    s[K4::DMIN + 2 * r..][..2].copy_from_slice(&block[2..4]);
                    let (sc, mn) = crate::gemm::gguf::scale_min_k4(jg, &block[4..16]);
                    s[K4::SC + PANEL * jg + r] = sc;
                    s[K4::M + PANEL * jg + r] = mn;
                }
                DType::Q6K => {
                    let s = &mut scales[sbk..sbk + K6::BYTES];
                    s[K6::D + 2 * r..][..2].copy_from_slice(&block[208..210]);
                    for h in 0..2 {
                        s[K6::SC + PANEL * (2 * jg + h) + r] = gr.sc[h] as i8 as u8;
                    }
                }
                _ => unreachable!("packed layout is only defined for packable types"),
            }
        }
    }
}

/// Group `g` of row `j` of the packed matrix `w`, in the integer form of `q8_activations` (the
/// definition the SIMD kernels follow).
pub(crate) fn group(w: &crate::WeightMat<'_>, j: usize, g: usize) -> Group {
    let dtype = w.dtype;
    let geo = Geometry::of(dtype, w.rows, w.cols);
    let (qb, sb) = group_bytes(dtype);
    let (p, r) = (j / PANEL, j % PANEL);
    let (qo, so) = geo.offsets(p);
    let q = &w.data[qo + g * qb..][..qb];
    let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut u = [0u8; GROUP];
    for t in 0..8 {
        for v in 0..4 {
            let e = 4 * t + v;
            u[e] = if dtype == DType::Q8_0 {
                q[64 * t + 4 * r + v]
            } else {
                let b = q[64 * (t / 2) + 4 * r + v];
                let lo = if t % 2 == 0 { b & 0xF } else { b >> 4 };
                let hi = match dtype {
                    DType::Q5_0 | DType::Q5K => (q[256 + 4 * r + v] >> t) & 1,
                    DType::Q6K => (q[256 + 64 * (t / 4) + 4 * r + v] >> (2 * (t % 4))) & 3,
                    _ => 0,
                };
                lo | (hi << 4)
            };
        }
    }
    let bias = weight_bias(dtype);
    let wv: [i8; GROUP] = std::array::from_fn(|e| (u[e] as i32 - bias) as i8);
    let (sbk, jg) = (so + g / SUPER * SUPER * sb, g % SUPER);
    let s = w.data;
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => {
            Group { w: wv, sc: [1, 1], a: f16(s, so + g * sb + 2 * r), m: 0.0, ms: [1, 1] }
        }
        DType::Q4K | DType::Q5K => {
            let (sc, mn) = (s[sbk + K4::SC + PANEL * jg + r], s[sbk + K4::M + PANEL * jg + r]);
            let a = f16(s, sbk + K4::D + 2 * r) * sc as f32;
            let m = f16(s, sbk + K4::DMIN + 2 * r) * mn as f32;
            Group { w: wv, sc: [1, 1], a, m, ms: [1, 1] }
        }
        DType::Q6K => {
            let sc = [0, 1].map(|h| s[sbk + K6::SC + PANEL * (2 * jg + h) + r] as i8 as i32);
            Group { w: wv, sc, a: f16(s, sbk + K6::D + 2 * r), m: 0.0, ms: [1, 1] }
        }
        _ => unreachable!("packed layout is only defined for packable types"),
    }
}

/// Scalar Fast kernel over packed panels: weight rows `j0..j1` of `w` against activation rows
/// `i0..i1` of `act`, raw dot products to `dst[(i - i0) * ld + (j - j0)]`.
///
/// # Safety
/// `dst` is writable for that rectangle.
pub(crate) unsafe fn dots_scalar(
    w: &crate::WeightMat<'_>,
    rows: (usize, usize),
    act: &q8_activations::QAct,
    acts: (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    q8_activations::dots_scalar_of(|j, g| group(w, j, g), q8_activations::has_mins(w.dtype), rows, act, acts, dst, ld)
}
