//! Hugging Face directories in a tempdir built around a shared golden checkpoint: files the
//! test edits are written, the others are symbolic links to `shared/` (read in place).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// A golden case's directory under `shared/testdata/golden`, or a failure saying how to get it.
pub fn golden(case: &str) -> PathBuf {
    let p = crate::golden::shared_dir().join("testdata/golden").join(case);
    assert!(
        p.join("config.json").is_file() && p.join("model.safetensors").is_file(),
        "golden model {} is missing: check out the `shared` directory next to the repository or set TBOOST_SHARED",
        p.display()
    );
    p
}

/// Links `dir/name` to `target`.
pub fn link(dir: &Path, name: &str, target: &Path) {
    std::os::unix::fs::symlink(target, dir.join(name)).unwrap_or_else(|e| panic!("symlink {name}: {e}"));
}

/// The golden case's config.json, parsed.
pub fn golden_config(case: &str) -> Value {
    let p = golden(case).join("config.json");
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A directory holding `config` as config.json and a link to the golden case's weights.
pub fn dir_with_config(case: &str, config: &Value) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("config.json"), serde_json::to_vec_pretty(config).unwrap()).unwrap();
    link(tmp.path(), "model.safetensors", &golden(case).join("model.safetensors"));
    tmp
}

/// A directory with links to the golden case's config.json and weights.
pub fn linked_dir(case: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    link(tmp.path(), "config.json", &golden(case).join("config.json"));
    link(tmp.path(), "model.safetensors", &golden(case).join("model.safetensors"));
    tmp
}
