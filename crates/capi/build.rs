//! Build script: gives the C ABI's shared library (cdylib) its SONAME,
//! `libtboost.so.<ABI version>`, so hosts linked against one ABI never load another.

/// Equal to `TBOOST_ABI_VERSION` in src/ffi/mod.rs (a unit test there checks it).
const ABI_VERSION: u32 = 1;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if matches!(os.as_str(), "linux" | "android" | "freebsd" | "netbsd" | "openbsd" | "dragonfly") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtboost.so.{ABI_VERSION}");
    }
}
