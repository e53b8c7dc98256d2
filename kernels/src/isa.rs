//! Run-time choice of the SIMD instruction set.
//!
//! Detected once; `TBOOST_ISA=scalar|avx2|avx512` caps it (for tests of every path and for
//! isolating a SIMD bug), never raises it above what the CPU has.
//!
//! VNNI (`vpdpbusd`: u8 × s8 dot products of 4 into i32, used by the `Fast` quantized
//! kernels) is a separate flag on top of the level, not a level of [`Isa`]: AVX512-VNNI (with
//! VL) at [`Isa::Avx512`], AVX-VNNI at [`Isa::Avx2`]. So the levels a test can select are
//! `(Avx512, vnni)`, `(Avx512, no vnni)`, `(Avx2, vnni)`, `(Avx2, no vnni)` and `Scalar`.
//! A `TBOOST_ISA` cap names the level and whether VNNI stays on: `avx512vnni` / `avx2vnni`
//! keep it, plain `avx512` / `avx2` / `scalar` turn it off (so the integer kernels without
//! VNNI can be exercised on a VNNI machine). Without `TBOOST_ISA` everything detected is used.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ (+ the AVX2 set).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }
}

/// The best instruction set this CPU supports.
pub fn detected() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The instruction set kernels use: the detected one, capped by `TBOOST_ISA`.
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let best = detected();
        match cap() {
            Some((level, _)) => level.min(best),
            None => best,
        }
    })
}

/// A `TBOOST_ISA` value: the level it caps at and whether VNNI stays allowed.
pub fn parse_cap(s: &str) -> Option<(Isa, bool)> {
    let s = s.trim().to_ascii_lowercase();
    match s.strip_suffix("vnni").map(|l| l.trim_end_matches(['+', '-', '_'])) {
        Some(level) => Isa::parse(level).filter(|&l| l != Isa::Scalar).map(|l| (l, true)),
        None => Isa::parse(&s).map(|l| (l, false)),
    }
}

fn cap() -> Option<(Isa, bool)> {
    std::env::var("TBOOST_ISA").ok().as_deref().and_then(parse_cap)
}

/// Whether this CPU has VNNI at `isa` (AVX512-VNNI with VL for `Avx512`, AVX-VNNI for
/// `Avx2`), and has `isa` itself.
pub fn vnni_detected(isa: Isa) -> bool {
    if isa > detected() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512 => return is_x86_feature_detected!("avx512vnni"),
            Isa::Avx2 => return is_x86_feature_detected!("avxvnni"),
            Isa::Scalar => {}
        }
    }
    false
}

/// Whether kernels use VNNI at the [`active`] level: detected there and not capped off.
pub fn vnni_active() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| vnni_detected(active()) && cap().is_none_or(|(_, vnni)| vnni))
}
