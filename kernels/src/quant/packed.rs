//! Block-quantized weights repacked for the `Fast` precision: 16 output rows interleaved per
//! 32-value group ("panels"), so that an integer dot product leaves one output row per i32
//! lane and no horizontal sums are needed (llama.cpp's CPU "repack" buffers, e.g.
//! `block_q4_0x8`, serve the same purpose).
//!
//! The GGUF layout stores each row's blocks one after the other, so a GEMV reading it must
//! reduce every group's products across lanes (the direct path in `fast_x86`: a tree of
//! permutes per 16 groups). Here one `vpdpbusd` multiplies 4 activation bytes (broadcast)
//! with 4 weight bytes of each of 16 rows, and the float step runs on 16 rows at once.
//!
//! ## Layout
//! Rows are grouped in panels of [`PANEL`] (the last panel padded with zero rows). A packed
//! matrix is all panels' quant bytes (panel after panel, each panel's `ng = k / 32` groups in
//! natural order, `QB` bytes per group), then all panels' scales (same order, `SB` bytes
//! per group). A run of panels is thus two sequential streams, which the hardware
//! prefetchers follow best (measured: interleaving scales with quants per 16 groups, one
//! stream, streamed 30% slower here, and splitting per panel, 30-50% slower), and quant
//! loads stay 64-byte aligned.
//! - Q4_0 (`QB` 256, `SB` 32): 4 blocks of 64 bytes; byte `64L + 4r + t` of a group is
//!   `n(r, 8L + t) | n(r, 8L + 4 + t) << 4` (`n` the unsigned nibble of row `r`, value `e`).
//!   Low nibbles give quad `2L` (values `8L..8L+4`) of the 16 rows in lanes, high nibbles
//!   quad `2L + 1`. Scales: the 16 rows' `d` as f16.
//! - Q8_0 (`QB` 512, `SB` 32): 8 blocks of 64 bytes; byte `64t + 4r + u` is
//!   `w(r, 4t + u) + 128` as u8 (so `vpdpbusd` takes it as the unsigned operand). Scales as
//!   Q4_0.
//!
//! Same size as the GGUF bytes of the panel's rows. The arithmetic is exactly `fast`'s (its
//! module doc): `D_g` is the same integer, and `acc[g mod 16]` takes the same float steps, so
//! results are bit-identical to the GGUF-layout kernels at every ISA level.

use super::fast::{self, Group, GROUP};
use crate::DType;

/// Output rows per panel (one i32 / f32 lane each).
pub const PANEL: usize = 16;
/// Values per group: `cols` must be a multiple of it.
pub const GROUP_VALUES: usize = GROUP;

/// Whether `dtype` has a packed layout.
pub fn packable(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q8_0)
}

/// Quant and scale bytes per group of one panel.
pub(crate) fn group_bytes(dtype: DType) -> (usize, usize) {
    match dtype {
        DType::Q4_0 => (256, 32),
        DType::Q8_0 => (512, 32),
        _ => unreachable!("packed layout is only defined for packable types"),
    }
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
    use rayon::prelude::*;
    assert!(packable(dtype) && cols.is_multiple_of(GROUP), "{rows}x{cols} {dtype} has no packed layout");
    assert_eq!(Some(src.len()), dtype.bytes_for(cols).map(|rb| rb * rows), "{rows}x{cols} {dtype} source size");
    assert_eq!(dst.len(), packed_bytes(dtype, rows, cols), "{rows}x{cols} {dtype} packed size");
    let geo = Geometry::of(dtype, rows, cols);
    if geo.q_stride == 0 {
        return;
    }
    let out = SharedOut(dst.as_mut_ptr());
    (0..geo.panels).into_par_iter().for_each(|p| {
        let (qo, so) = geo.offsets(p);
        // SAFETY: panels' quant and scale ranges are disjoint and inside `dst` (sized by
        // `packed_bytes`, checked above); `dst` stays mutably borrowed until all are done.
        let (q, s) = unsafe {
            (
                std::slice::from_raw_parts_mut(out.get().add(qo), geo.q_stride),
                std::slice::from_raw_parts_mut(out.get().add(so), geo.s_stride),
            )
        };
        pack_panel(dtype, src, rows, cols, p, q, s)
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

/// Packs panel `p` of the GGUF-layout matrix `src` into its quants `q` and scales `s`. Rows
/// past `rows` are zero.
fn pack_panel(dtype: DType, src: &[u8], rows: usize, cols: usize, p: usize, quants: &mut [u8], scales: &mut [u8]) {
    let ng = cols / GROUP;
    let (qb, sb) = group_bytes(dtype);
    let row_bytes = dtype.bytes_for(cols).expect("whole blocks");
    quants.fill(0);
    scales.fill(0);
    for r in 0..PANEL {
        let j = p * PANEL + r;
        if j >= rows {
            break;
        }
        let row = &src[j * row_bytes..(j + 1) * row_bytes];
        for g in 0..ng {
            let gr = fast::group(dtype, row, g);
            // The f16 `d` as stored (exactly `gr.a` widened).
            let d = &row[(g * GROUP / dtype.block_elems()) * dtype.block_bytes()..][..2];
            scales[g * sb + 2 * r..g * sb + 2 * r + 2].copy_from_slice(d);
            let q = &mut quants[g * qb..(g + 1) * qb];
            match dtype {
                DType::Q4_0 => {
                    for l in 0..4 {
                        for t in 0..4 {
                            let lo = (gr.w[8 * l + t] + 8) as u8;
                            let hi = (gr.w[8 * l + 4 + t] + 8) as u8;
                            q[64 * l + 4 * r + t] = lo | (hi << 4);
                        }
                    }
                }
                DType::Q8_0 => {
                    for t in 0..8 {
                        for u in 0..4 {
                            q[64 * t + 4 * r + u] = (gr.w[4 * t + u] as u8) ^ 0x80;
                        }
                    }
                }
                _ => unreachable!("packed layout is only defined for packable types"),
            }
        }
    }
}

/// Group `g` of row `j` of the packed matrix `w`, in the integer form of `fast` (the
/// definition the SIMD kernels follow).
pub(crate) fn group(w: &crate::WeightMat<'_>, j: usize, g: usize) -> Group {
    let geo = Geometry::of(w.dtype, w.rows, w.cols);
    let (qb, sb) = group_bytes(w.dtype);
    let (p, r) = (j / PANEL, j % PANEL);
    let (qo, so) = geo.offsets(p);
    let q = &w.data[qo + g * qb..][..qb];
    let s = &w.data[so + g * sb..][..sb];
    let a = half::f16::from_le_bytes([s[2 * r], s[2 * r + 1]]).to_f32();
    let mut wv = [0i8; GROUP];
    match w.dtype {
        DType::Q4_0 => {
            for l in 0..4 {
                for t in 0..4 {
                    let b = q[64 * l + 4 * r + t];
                    wv[8 * l + t] = (b & 0xF) as i8 - 8;
                    wv[8 * l + 4 + t] = (b >> 4) as i8 - 8;
                }
            }
        }
        DType::Q8_0 => {
            for t in 0..8 {
                for u in 0..4 {
                    wv[4 * t + u] = (q[64 * t + 4 * r + u] ^ 0x80) as i8;
                }
            }
        }
        _ => unreachable!("packed layout is only defined for packable types"),
    }
    Group { w: wv, sc: [1, 1], a, m: 0.0 }
}

/// Scalar Fast kernel over packed panels: weight rows `j0..j1` of `w` against activation rows
/// `i0..i1` of `act`, raw dot products to `dst[(i - i0) * ld + (j - j0)]`.
///
/// # Safety
/// `dst` is writable for that rectangle.
pub(crate) unsafe fn dots_scalar(
    w: &crate::WeightMat<'_>,
    (j0, j1): (usize, usize),
    act: &fast::QAct,
    (i0, i1): (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    let ng = act.ng;
    let mut groups = Vec::with_capacity(ng);
    for j in j0..j1 {
        groups.clear();
        groups.extend((0..ng).map(|g| group(w, j, g)));
        for i in i0..i1 {
            *dst.add((i - i0) * ld + (j - j0)) = fast::dot_groups(&groups, false, act, i);
        }
    }
}
