//! The decode walk over packed panels with its software prefetch the other way round from
//! this CPU's default (`isa::weight_prefetch`: on for Intel, off elsewhere), so both walks
//! are tested on every machine. Prefetches are hints: the bits must equal the scalar
//! reference's either way. One test in its own binary: `TBOOST_PREFETCH` is read once per
//! process, and it must be set before the first kernel call.

use rand::rngs::StdRng;
use rand::SeedableRng;
use tboost_kernels::gemm::quant::{matmul_quant_prec_with, panel_pack, IntDot, Precision};
use tboost_kernels::gemm::MatSeg;
use tboost_kernels::isa::{self, Isa};
use tboost_kernels::{DType, WeightMat};

mod quant_util;
use quant_util::*;

#[test]
fn the_decode_walk_gives_the_same_bits_with_and_without_prefetch() {
    let flipped = !isa::intel();
    std::env::set_var("TBOOST_PREFETCH", if flipped { "on" } else { "off" });
    assert_eq!(isa::weight_prefetch(), flipped, "TBOOST_PREFETCH decides the walk");
    let mut rng = StdRng::seed_from_u64(5);
    for dt in [DType::Q4_0, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K] {
        // Several panels, so prefetches run past a panel's end into the next one and past
        // the matrix's end.
        let (n, k) = (80, 2048);
        let wb = random_weights(dt, n, k, &mut rng);
        let w = WeightMat::new(dt, n, k, &wb).unwrap();
        let mut pb = vec![0u8; panel_pack::packed_bytes(dt, n, k)];
        panel_pack::pack(dt, n, k, &wb, &mut pb);
        let wp = WeightMat::packed(dt, n, k, &pb).unwrap();
        let x = random_x(1, k, &mut rng);
        let run = |isa: Isa, dot: IntDot, w: WeightMat<'_>| {
            let mut out = vec![f32::NAN; n];
            matmul_quant_prec_with(isa, dot, Precision::Fast, &x, 1, &mut [MatSeg { w, bias: None, out: &mut out }]);
            out
        };
        let want = run(Isa::Scalar, false.into(), w);
        for isa in [Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= isa::detected()) {
            for vnni in [false, true].into_iter().filter(|&v| !v || isa::vnni_detected(isa)) {
                let what = format!("{dt} packed m=1 {} vnni={vnni} prefetch={flipped}", isa.name());
                for threads in [1, 2] {
                    assert_bits_eq(&in_pool(threads, || run(isa, vnni.into(), wp)), &want, &what);
                }
            }
        }
    }
}
