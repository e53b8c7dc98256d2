//! Backend conformance suite, after llama.cpp's `test-backend-ops`: every [`Op`] variant, over
//! a table of shapes, dtypes and edge cases, on every backend compiled into this build,
//! against an f64 scalar reference, within tolerances stated (with their reasons) next to
//! each case.
//!
//! Ops are driven exactly as the runner drives them (`src/runner/graph.rs`, `mod.rs`):
//! buffers from `Backend::alloc`, weights through `upload_weight`, inputs through
//! `write_typed`/`write`, the step's index arrays (token ids, positions, slots, the
//! `[q_start, q_len, ctx_len]` seq table, block tables, logit rows) through `set_step`, then
//! `launch`, `synchronize` and `read_typed`. Before a case runs, the suite asks `supports`
//! the `OpQuery` the plan would ask (`src/plan/table.rs`); a rejection lists the case as
//! skipped with the backend's reason, never as passed.
//!
//! The reference is plain f64 loops in this file over the values *as the device stores
//! them* (weights decoded from their bytes, K/V rounded to the cache dtype); it calls no
//! kernel. The only kernel-crate code it uses is the quantization reference: the test
//! quantizer to make valid GGUF blocks and ggml's dequantization (`dequantize_row`) to read
//! them, checked against the source values. The CPU's SIMD level is fixed per process (`TBOOST_ISA`), so the CPU backend's
//! fast paths are what is compared here; run with `TBOOST_ISA=scalar` (or `avx2`) to check
//! the other paths.
//!
//! Each op (a matmul: each weight dtype) is its own test, run on every backend present
//! (`tboost_testkit::backends`), so one can be selected: `cargo test --test backend_conformance
//! matmul_q4_k`. A test draws its values from a seed of its own name, the same alone or beside
//! the others. `conformance_covers_every_op` checks that the table launches every `Op` variant.
//!
//! The report (per op: cases run, passed, failed, skipped with the reason) is printed on
//! every run, also when the test passes; passing cases one by one with
//! `TBOOST_CONFORMANCE_VERBOSE=1`.
//!
//! Activations: each backend runs in every activation dtype it computes in (f32 on the CPU; f16
//! and bf16 on Ascend).
//! Inputs are rounded to it before the reference sees them, outputs are read back from it, and
//! for a 16-bit dtype every bound adds that dtype's roundings of the op's outputs and
//! intermediates (u = 2⁻¹¹ for f16, 2⁻⁸ for bf16 per rounding, plus half the smallest f16
//! subnormal), as each group's tolerance says; the f32 parts assume a device that accumulates in
//! f32 (the CANN SIMULATOR computes in f64, so it sits well inside them). The Ascend backend runs
//! on the CANN SIMULATOR (ascend-sim, not an NPU), found through `TBOOST_ASCEND_SIM`.

// The reference loops index several arrays in lockstep; explicit indices mirror the math.
#![allow(clippy::needless_range_loop)]

mod conformance;

use conformance::suite::{self, Cases};
use conformance::{attention, data, kv_cache, matmul, moe, norm, rope};

/// One `#[test]` per entry, and the table the coverage test lists.
macro_rules! conformance_tests {
    ($($test:ident: $cases:path,)*) => {
        $(#[test]
        fn $test() {
            suite::run(stringify!($test), $cases);
        })*

        const GROUPS: &[(&str, Cases)] = &[$((stringify!($test), $cases)),*];
    };
}

conformance_tests! {
    conformance_embed: data::embed,
    conformance_rmsnorm: norm::rmsnorm,
    conformance_add_rmsnorm: norm::add_rmsnorm,
    conformance_add: norm::add,
    conformance_matmul_f32: matmul::f32,
    conformance_matmul_f16: matmul::f16,
    conformance_matmul_bf16: matmul::bf16,
    conformance_matmul_q4_0: matmul::q4_0,
    conformance_matmul_q4_1: matmul::q4_1,
    conformance_matmul_q5_0: matmul::q5_0,
    conformance_matmul_q5_1: matmul::q5_1,
    conformance_matmul_q8_0: matmul::q8_0,
    conformance_matmul_iq4_nl: matmul::iq4_nl,
    conformance_matmul_iq4_xs: matmul::iq4_xs,
    conformance_matmul_q2_k: matmul::q2_k,
    conformance_matmul_q3_k: matmul::q3_k,
    conformance_matmul_q4_k: matmul::q4_k,
    conformance_matmul_q5_k: matmul::q5_k,
    conformance_matmul_q6_k: matmul::q6_k,
    conformance_matmul_fast_precision: matmul::fast_precision,
    conformance_matmul_fused_qkv: matmul::fused_qkv,
    conformance_matmul_swiglu: matmul::matmul_swiglu,
    conformance_swiglu: matmul::swiglu,
    conformance_geglu: matmul::geglu,
    conformance_scale: matmul::scale,
    conformance_rope_tables: rope::rope_tables,
    conformance_rope_tables_scaled: rope::rope_tables_scaled,
    conformance_rope: rope::rope,
    conformance_write_kv: kv_cache::write_kv,
    conformance_attention_flash: attention::flash,
    conformance_attention_paged_decode: attention::paged_decode,
    conformance_attention_standard: attention::standard,
    conformance_moe_route: moe::moe_route,
    conformance_moe_grouped: moe::moe_grouped,
    conformance_moe_per_expert: moe::moe_per_expert,
    conformance_moe_scatter: moe::moe_scatter,
    conformance_moe_combine: moe::moe_combine,
    conformance_gather_rows: data::gather_rows,
    conformance_convert: data::convert,
    conformance_zero: data::zero,
}

/// Every `Op` variant is launched by some case of the table (the tests above), on every backend.
#[test]
fn conformance_covers_every_op() {
    suite::coverage(GROUPS);
}
