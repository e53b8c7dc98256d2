//! The configuration table: keys set by name, environment variables as defaults only.

use tboost_engine::backend::BackendKind;
use tboost_engine::engine::keys::{keys, Raw};
use tboost_engine::engine::{EngineConfig, WeightPages};

#[test]
fn environment_values_are_defaults_that_a_set_key_overrides() {
    let env = |name: &str| match name {
        "TBOOST_BACKEND" => Some("cpu".to_string()),
        "TBOOST_DISABLE" => Some("fuse_qkv,pack_weights".to_string()),
        "TBOOST_PIN_THREADS" => Some("1".to_string()),
        "TBOOST_PROFILE" => Some("yes please".to_string()),
        "TBOOST_WEIGHT_PAGES" => Some("file".to_string()),
        _ => None,
    };
    let mut c = EngineConfig::default();
    c.apply_env(env).unwrap();
    assert_eq!(c.backend, BackendKind::Cpu);
    assert_eq!(c.disabled_ops.iter().map(String::as_str).collect::<Vec<_>>(), ["fuse_qkv", "pack_weights"]);
    assert!(c.pin_threads && c.profile, "any TBOOST_PROFILE value turns profiling on, as before it was a key");
    assert_eq!(c.weight_pages, WeightPages::Small);
    c.set("disabled_ops", Raw::Str("fuse_gate_up")).unwrap();
    c.set("pin_threads", Raw::Int(0)).unwrap();
    assert_eq!(c.disabled_ops.iter().map(String::as_str).collect::<Vec<_>>(), ["fuse_gate_up"]);
    assert!(!c.pin_threads);
    // The default config reads no environment.
    let d = EngineConfig::default();
    assert_eq!((d.backend, d.pin_threads, d.profile), (BackendKind::Auto, false, false));
}

#[test]
fn a_bad_environment_value_names_its_variable() {
    let mut c = EngineConfig::default();
    let e = c.apply_env(|n| (n == "TBOOST_BACKEND").then(|| "gpu9".to_string())).unwrap_err().to_string();
    assert!(e.contains("TBOOST_BACKEND") && e.contains("gpu9"), "{e}");
}

#[test]
fn keys_are_typed_range_checked_and_a_rejected_value_changes_nothing() {
    let mut c = EngineConfig::default();
    let before = c.to_json();
    for (key, raw) in [
        ("threads", Raw::Int(2000)),
        ("prefix_caching", Raw::Int(2)),
        ("backend", Raw::Int(1)),
        ("weight_pages", Raw::Str("tiny")),
        ("nosuch", Raw::Int(1)),
        ("tiling.matmul.panel_rows", Raw::Int(17)),
    ] {
        let e = c.set(key, raw).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
    assert_eq!(c.to_json(), before);
    c.set("max_seqs", Raw::Str("8")).unwrap();
    c.set("prefix_caching", Raw::Str("off")).unwrap();
    c.set("tiling.matmul.panel_rows", Raw::Int(32)).unwrap();
    assert_eq!((c.max_seqs, c.prefix_caching), (8, false));
    let j = c.to_json();
    assert_eq!(j["tiling.matmul.panel_rows"], 32);
    // Every key of the table shows in to_json, and a second config keeps its defaults.
    for k in keys() {
        assert!(j.get(&k.name).is_some(), "to_json lacks `{}`", k.name);
    }
    assert_eq!(EngineConfig::default().max_seqs, 64);
}
