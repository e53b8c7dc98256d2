//! Run-time choice of the SIMD instruction set.
//!
//! Detected once; `TBOOST_ISA=scalar|avx2|avx512` caps it (for tests of every path and for
//! isolating a SIMD bug), never raises it above what the CPU has.
//!
//! Extensions beyond a level (queried one by one, e.g. `avx512bf16`) are on only when the
//! CPU has them, the active level is the one they extend, and they are not named in
//! `TBOOST_ISA_DISABLE` (comma-separated extension names: `avx512bf16`, `amx`, `vnni`), so
//! `TBOOST_ISA=avx2` turns them off too. `amx` names both AMX kernels (bf16 and int8).
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

/// Whether `TBOOST_ISA_DISABLE` (comma-separated, case-insensitive) names `feature`.
fn disabled_by_env(feature: &str) -> bool {
    std::env::var("TBOOST_ISA_DISABLE")
        .map(|v| v.split(',').any(|f| f.trim().eq_ignore_ascii_case(feature)))
        .unwrap_or(false)
}

/// This CPU has AVX512_BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`) on top of the AVX-512 level.
pub fn avx512bf16_detected() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        detected() == Isa::Avx512 && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Kernels may use AVX512_BF16: detected, the active level is AVX-512 (not capped by
/// `TBOOST_ISA`), and `TBOOST_ISA_DISABLE` does not name `avx512bf16`.
pub fn avx512bf16() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| avx512bf16_detected() && active() == Isa::Avx512 && !disabled_by_env("avx512bf16"))
}

/// This CPU has AMX-BF16 tiles (`tdpbf16ps`) on top of the AVX-512 level with
/// AVX512_BF16, and the OS lets this process use them (on Linux the first call asks for
/// the tile-data permission with `arch_prctl(ARCH_REQ_XCOMP_PERM)`; a refusal means no).
pub fn amx_bf16_detected() -> bool {
    avx512bf16_detected() && amx_tiles(22)
}

/// This CPU has AMX-INT8 tiles (`tdpbssd`) on top of the AVX-512 level with AVX512-VNNI,
/// and the OS lets this process use them (as [`amx_bf16_detected`]).
pub fn amx_int8_detected() -> bool {
    vnni_detected(Isa::Avx512) && amx_tiles(25)
}

/// AMX-TILE and the AMX feature at cpuid leaf 7 EDX bit `bit` are present, and the tile
/// data permission was granted (asked once per process).
fn amx_tiles(bit: u32) -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        if detected() != Isa::Avx512 {
            return false;
        }
        // Read once: kernels ask per call, and under a hypervisor every `cpuid` traps to
        // the host (a decode token's 89 matmuls spent 2% of their time in this one
        // instruction on the KVM Xeon). Leaf 7 exists on every CPU with AVX-512 (checked
        // first).
        static EDX: OnceLock<u32> = OnceLock::new();
        let edx = *EDX.get_or_init(|| std::arch::x86_64::__cpuid_count(7, 0).edx);
        if edx & (1 << 24) == 0 || edx & (1 << bit) == 0 {
            return false;
        }
        static PERMITTED: OnceLock<bool> = OnceLock::new();
        *PERMITTED.get_or_init(|| {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain syscall with integer arguments; it changes only whether this
            // process may use the AMX register state.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        })
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = bit;
        false
    }
}

/// Kernels may use AMX-INT8: detected and permitted, the active level is AVX-512 with VNNI
/// (so `TBOOST_ISA` caps and a disabled `vnni` turn it off too), and `TBOOST_ISA_DISABLE`
/// does not name `amx`.
pub fn amx_int8() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| active() == Isa::Avx512 && vnni_active() && !disabled_by_env("amx") && amx_int8_detected())
}

/// Kernels may use AMX-BF16: detected and permitted, AVX512_BF16 available to kernels (so
/// the same caps apply), and `TBOOST_ISA_DISABLE` does not name `amx`.
pub fn amx_bf16() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| avx512bf16() && !disabled_by_env("amx") && amx_bf16_detected())
}

/// Whether the decode (one-row) weight walks prefetch ahead in software.
///
/// `TBOOST_PREFETCH=on|off` decides; unset, it is on for Intel CPUs and off elsewhere, as
/// measured: on the Xeon (Sapphire Rapids class) VM the hardware prefetchers alone streamed a
/// packed Q4_0 GEMV at 23 GB/s against 30 with the prefetch (roof 32-33), while on the
/// Zen 4 VM every prefetch distance from 2 to 16 KiB read slower (Q8_0 31 -> 23-24 GB/s).
/// Prefetches are hints: results never depend on this.
pub fn weight_prefetch() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("TBOOST_PREFETCH").ok().as_deref().map(str::trim) {
        Some("on" | "1") => true,
        Some("off" | "0") => false,
        _ => intel(),
    })
}

/// The CPU's vendor string is "GenuineIntel".
pub fn intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Read once (a `cpuid` traps to the host under a hypervisor); leaf 0 exists on
        // every x86_64 CPU.
        static R: OnceLock<std::arch::x86_64::CpuidResult> = OnceLock::new();
        let r = *R.get_or_init(|| std::arch::x86_64::__cpuid(0));
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &v == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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

/// Whether kernels use VNNI at the [`active`] level: detected there, not capped off and not
/// named in `TBOOST_ISA_DISABLE`.
pub fn vnni_active() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| vnni_detected(active()) && cap().is_none_or(|(_, vnni)| vnni) && !disabled_by_env("vnni"))
}
