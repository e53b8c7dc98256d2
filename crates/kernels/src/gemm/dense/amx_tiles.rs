//! The AMX tile instructions both bf16 tile kernels (`fast_bf16`'s row kernel and
//! `amx_pair_panels`) issue, with one register plan: C tiles in tmm0..3, operands in tmm4..7, every
//! register 16 rows of 64 bytes. Tile registers are named in the instruction, so each
//! register gets its own arm; the tile state lives across these asm blocks, and the compiler
//! never uses tile registers itself.

use std::arch::asm;

/// The tile configuration: palette 1, tmm0..7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

/// Loads the configuration (at the start of a task; [`release`] at its end).
///
/// # Safety
/// The CPU has AMX and this process the permission (`isa::amx_bf16_detected`).
#[inline(always)]
pub(in crate::gemm) unsafe fn configure() {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
    }
    let cfg = Config(c);
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Releases the tile state.
#[inline(always)]
pub(in crate::gemm) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
}

/// Zeroes C tile `c` (0..4).
#[inline(always)]
pub(in crate::gemm) unsafe fn zero(c: usize) {
    match c {
        0 => asm!("tilezero tmm0", options(nostack, nomem)),
        1 => asm!("tilezero tmm1", options(nostack, nomem)),
        2 => asm!("tilezero tmm2", options(nostack, nomem)),
        _ => asm!("tilezero tmm3", options(nostack, nomem)),
    }
}

/// Loads operand register `r` (4..8) from 16 rows at `p`, `stride` bytes apart.
#[inline(always)]
pub(in crate::gemm) unsafe fn load(r: usize, p: *const u8, stride: usize) {
    match r {
        4 => asm!("tileloadd tmm4, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
        5 => asm!("tileloadd tmm5, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
        6 => asm!("tileloadd tmm6, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
        _ => asm!("tileloadd tmm7, [{p} + {s} * 1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
    }
}

/// Stores C tile `c` as 16 rows of 16 f32 at `p` (64-byte rows).
#[inline(always)]
pub(in crate::gemm) unsafe fn store(c: usize, p: *mut u8) {
    let s = 64usize;
    match c {
        0 => asm!("tilestored [{p} + {s} * 1], tmm0", p = in(reg) p, s = in(reg) s, options(nostack)),
        1 => asm!("tilestored [{p} + {s} * 1], tmm1", p = in(reg) p, s = in(reg) s, options(nostack)),
        2 => asm!("tilestored [{p} + {s} * 1], tmm2", p = in(reg) p, s = in(reg) s, options(nostack)),
        _ => asm!("tilestored [{p} + {s} * 1], tmm3", p = in(reg) p, s = in(reg) s, options(nostack)),
    }
}
