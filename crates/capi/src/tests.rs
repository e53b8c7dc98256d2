//! The C ABI driven from Rust: the rules a C host relies on (status + last error, buffer
//! sizes, handle checks, the panic barrier, events) and equality with the Rust API. The
//! gtest suite in tests/cpp/ covers the same surface from C++.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::ptr::{null, null_mut};

use super::*;
use ::tboost_engine::engine::{Engine, EngineConfig, KvSize};
use ::tboost_engine::sched::Request;

use tboost_status::*;

use tboost_testkit::golden::shared_dir;

fn golden(case: &str) -> PathBuf {
    shared_dir().join("testdata/golden").join(case)
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn last_error() -> String {
    let mut buf = vec![0 as std::os::raw::c_char; 4096];
    let mut need = 0;
    assert_eq!(unsafe { tboost_last_error(buf.as_mut_ptr(), buf.len(), &mut need) }, TBOOST_OK);
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

fn config(pairs: &[(&str, &str)]) -> *mut tboost_config {
    let mut cfg = null_mut();
    assert_eq!(unsafe { tboost_config_new(&mut cfg) }, TBOOST_OK);
    for (k, v) in pairs {
        let s = unsafe { tboost_config_set_str(cfg, c(k).as_ptr(), c(v).as_ptr()) };
        assert_eq!(s, TBOOST_OK, "{k}={v}: {}", last_error());
    }
    cfg
}

fn load(case: &str, cfg: *const tboost_config) -> *mut tboost_model {
    let mut m = null_mut();
    let path = c(golden(case).to_str().unwrap());
    let s = unsafe { tboost_model_load(path.as_ptr(), cfg, None, null_mut(), &mut m) };
    assert_eq!(s, TBOOST_OK, "{}", last_error());
    m
}

fn engine(model: *const tboost_model, cfg: *const tboost_config) -> *mut tboost_engine {
    let mut e = null_mut();
    let s = unsafe { tboost_engine_new(model, cfg, &mut e) };
    assert_eq!(s, TBOOST_OK, "{}", last_error());
    e
}

fn read_all(e: *mut tboost_engine, id: u64) -> Vec<tboost_event> {
    let mut out = Vec::new();
    loop {
        let mut buf = [tboost_event { struct_size: 0, ..unsafe { std::mem::zeroed() } }; 8];
        let mut n = 0;
        let s = unsafe { tboost_engine_read(e, id, buf.as_mut_ptr(), size_of::<tboost_event>(), buf.len(), &mut n) };
        assert_eq!(s, TBOOST_OK, "{}", last_error());
        out.extend_from_slice(&buf[..n]);
        if n < buf.len() {
            return out;
        }
    }
}

fn run(e: *mut tboost_engine) {
    loop {
        let mut work = false;
        assert_eq!(unsafe { tboost_engine_has_work(e, &mut work) }, TBOOST_OK);
        if !work {
            return;
        }
        assert_eq!(unsafe { tboost_engine_step(e, null_mut()) }, TBOOST_OK, "{}", last_error());
    }
}

fn enqueue(e: *mut tboost_engine, prompt: &[i32], p: &tboost_sampling_params) -> u64 {
    let mut id = 0;
    let s = unsafe { tboost_engine_enqueue(e, prompt.as_ptr(), prompt.len(), p, null(), null(), 0, &mut id) };
    assert_eq!(s, TBOOST_OK, "{}", last_error());
    id
}

#[test]
fn version_macros_follow_the_crate_and_build_script() {
    assert_eq!(TBOOST_VERSION_MAJOR.to_string(), env!("CARGO_PKG_VERSION_MAJOR"));
    assert_eq!(TBOOST_VERSION_MINOR.to_string(), env!("CARGO_PKG_VERSION_MINOR"));
    assert_eq!(TBOOST_VERSION_PATCH.to_string(), env!("CARGO_PKG_VERSION_PATCH"));
    let v = unsafe { CStr::from_ptr(tboost_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    assert_eq!(tboost_abi_version(), TBOOST_ABI_VERSION);
    let toml = include_str!("../cbindgen.toml");
    assert!(
        toml.contains(&format!("#define TBOOST_VERSION_STRING \"{}\"", env!("CARGO_PKG_VERSION"))),
        "cbindgen.toml's TBOOST_VERSION_STRING must equal the crate version {}",
        env!("CARGO_PKG_VERSION")
    );
    let build = include_str!("../build.rs");
    assert!(
        build.contains(&format!("const ABI_VERSION: u32 = {TBOOST_ABI_VERSION};")),
        "build.rs's ABI_VERSION (the SONAME) must equal TBOOST_ABI_VERSION {TBOOST_ABI_VERSION}"
    );
}

#[test]
fn status_names_are_unique_and_numbered_in_order() {
    for (i, (s, name)) in status::NAMES.iter().enumerate() {
        assert_eq!(*s as i32, i as i32, "{name:?} is out of order");
        let got = unsafe { CStr::from_ptr(tboost_status_name(i as i32)) };
        assert_eq!(got, *name);
    }
    let unknown = unsafe { CStr::from_ptr(tboost_status_name(999)) };
    assert_eq!(unknown.to_str().unwrap(), "TBOOST_UNKNOWN_STATUS");
    let eos = unsafe { CStr::from_ptr(tboost_finish_reason_name(2)) };
    assert_eq!(eos.to_str().unwrap(), "eos");
}

#[test]
fn last_error_is_per_thread_and_buffer_rules_hold() {
    let mut cfg = null_mut();
    assert_eq!(unsafe { tboost_config_new(&mut cfg) }, TBOOST_OK);
    let s = unsafe { tboost_config_set_int(cfg, c("max_seqs").as_ptr(), 0) };
    assert_eq!(s, TBOOST_ERR_INVALID_ARGUMENT);
    let msg = last_error();
    assert!(msg.contains("tboost_config_set_int") && msg.contains("max_seqs"), "{msg}");
    // Another thread has its own (empty) last error.
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "");
    // Size query, then a truncated copy.
    let mut need = 0;
    assert_eq!(unsafe { tboost_last_error(null_mut(), 0, &mut need) }, TBOOST_ERR_BUFFER_TOO_SMALL);
    assert_eq!(need, msg.len() + 1);
    let mut small = [0x55 as std::os::raw::c_char; 6];
    assert_eq!(unsafe { tboost_last_error(small.as_mut_ptr(), 6, &mut need) }, TBOOST_ERR_BUFFER_TOO_SMALL);
    assert_eq!(unsafe { CStr::from_ptr(small.as_ptr()) }.to_str().unwrap(), &msg[..5]);
    // NULL buffer with a capacity is an error of its own, reported without touching the
    // message it would copy.
    assert_eq!(unsafe { tboost_last_error(null_mut(), 8, null_mut()) }, TBOOST_ERR_NULL_POINTER);
    assert_eq!(last_error(), msg);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

#[test]
fn freed_and_wrong_kind_handles_are_rejected() {
    let cfg = config(&[]);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
    assert_eq!(tboost_config_free(cfg), TBOOST_ERR_INVALID_HANDLE);
    let s = unsafe { tboost_config_set_int(cfg, c("threads").as_ptr(), 1) };
    assert_eq!(s, TBOOST_ERR_INVALID_HANDLE);
    assert!(last_error().contains("not a live tboost_config handle"));
    // A config handle passed as a model.
    let cfg = config(&[]);
    let mut e = null_mut();
    let s = unsafe { tboost_engine_new(cfg.cast(), null(), &mut e) };
    assert_eq!(s, TBOOST_ERR_INVALID_HANDLE);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
    assert_eq!(unsafe { tboost_engine_new(null(), null(), &mut e) }, TBOOST_ERR_NULL_POINTER);
    assert!(last_error().contains("`model` is NULL"));
}

#[test]
fn config_keys_parse_and_reject_with_names() {
    let cfg = config(&[("threads", "2"), ("prefix_caching", "off"), ("kv_dtype", "f16"), ("disabled_ops", "fuse_qkv")]);
    let mut buf = vec![0 as std::os::raw::c_char; 1024];
    let mut need = 0;
    assert_eq!(unsafe { tboost_config_to_json(cfg, buf.as_mut_ptr(), buf.len(), &mut need) }, TBOOST_OK);
    let v: serde_json::Value = serde_json::from_str(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap()).unwrap();
    assert_eq!(v["threads"], 2);
    assert_eq!(v["prefix_caching"], false);
    assert_eq!(v["kv_dtype"], "f16");
    assert_eq!(v["disabled_ops"], "fuse_qkv");
    let cases: &[(&str, &str, tboost_status, &str)] = &[
        ("bogus", "1", TBOOST_ERR_INVALID_ARGUMENT, "unknown config key `bogus`"),
        ("threads", "lots", TBOOST_ERR_INVALID_ARGUMENT, "`threads` = `lots` is not an integer"),
        ("threads", "5000", TBOOST_ERR_INVALID_ARGUMENT, "out of range"),
        ("kv_dtype", "q4", TBOOST_ERR_INVALID_ARGUMENT, "`kv_dtype` = `q4`"),
        ("disabled_ops", "warp_drive", TBOOST_ERR_INVALID_ARGUMENT, "warp_drive"),
        ("backend", "nosuch", TBOOST_ERR_INVALID_ARGUMENT, "unknown backend `nosuch`"),
        ("prefix_caching", "maybe", TBOOST_ERR_INVALID_ARGUMENT, "flag"),
    ];
    for (k, v, want, text) in cases {
        let s = unsafe { tboost_config_set_str(cfg, c(k).as_ptr(), c(v).as_ptr()) };
        assert_eq!(s, *want, "{k}={v}");
        let msg = last_error();
        assert!(msg.contains(text), "{k}={v}: {msg}");
    }
    let s = unsafe { tboost_config_set_int(cfg, c("kv_dtype").as_ptr(), 3) };
    assert_eq!(s, TBOOST_ERR_INVALID_ARGUMENT);
    // The rejected values left the config as it was.
    assert_eq!(unsafe { tboost_config_to_json(cfg, buf.as_mut_ptr(), buf.len(), &mut need) }, TBOOST_OK);
    let after: serde_json::Value =
        serde_json::from_str(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap()).unwrap();
    assert_eq!(after, v);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

/// The same requests through the C ABI and through `Engine` give the same tokens.
#[test]
fn c_abi_tokens_equal_the_rust_api() {
    let cfg = config(&[("threads", "2"), ("kv_cache_blocks", "64"), ("max_batched_tokens", "64")]);
    let m = load("llama_gqa", cfg);
    let e = engine(m, cfg);
    assert_eq!(tboost_model_free(m), TBOOST_OK, "an engine outlives its model");
    let prompts: Vec<Vec<i32>> =
        (0..4).map(|i| (0..5 + 7 * i).map(|j| 3 + (i * 31 + j * 17) % 600).collect()).collect();
    let mut ids = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut sp = tboost_sampling_params::default();
        unsafe { tboost_sampling_params_init(&mut sp) };
        sp.max_tokens = 9;
        sp.ignore_eos = 1;
        sp.user_tag = 100 + i as u64;
        if i % 2 == 1 {
            sp.temperature = 0.8;
            sp.seed = 7 + i as u64;
            sp.logprobs = 0;
        }
        ids.push(enqueue(e, p, &sp));
    }
    run(e);
    let rust = Engine::new(EngineConfig {
        threads: 2,
        kv_size: KvSize::Blocks(64),
        max_batched_tokens: 64,
        ..Default::default()
    })
    .unwrap();
    rust.load(&golden("llama_gqa")).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let mut r = Request::new(p.iter().map(|&t| t as u32).collect(), 9);
        r.ignore_eos = true;
        if i % 2 == 1 {
            r.sampling.temperature = 0.8;
            r.sampling.seed = 7 + i as u64;
        }
        let want = rust.enqueue(r).unwrap();
        rust.run_to_completion().unwrap();
        let want = rust.output(want).unwrap().tokens;
        let events = read_all(e, ids[i]);
        let got: Vec<u32> = events.iter().filter(|v| v.token >= 0).map(|v| v.token as u32).collect();
        assert_eq!(got, want, "request {i}");
        let last = events.last().unwrap();
        assert_eq!(last.finish, tboost_finish_reason::TBOOST_FINISH_LENGTH);
        assert!(events.iter().all(|v| v.user_tag == 100 + i as u64 && v.request_id == ids[i]));
        assert!(events.iter().enumerate().all(|(k, v)| v.index == k as u32));
        assert_eq!(events.iter().all(|v| !v.logprob.is_nan()), i % 2 == 1, "logprobs only when asked");
    }
    assert_eq!(tboost_engine_free(e), TBOOST_OK);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

/// A cancel between steps ends the stream with a cancelled event from the next step.
#[test]
fn cancel_between_steps_ends_the_stream() {
    let m = load("llama_gqa", null());
    let cfg = config(&[("threads", "1"), ("kv_cache_blocks", "32")]);
    let e = engine(m, cfg);
    let sp = tboost_sampling_params { max_tokens: 50, ..Default::default() };
    let id = enqueue(e, &[5, 6, 7], &sp);
    assert_eq!(unsafe { tboost_engine_step(e, null_mut()) }, TBOOST_OK);
    assert_eq!(tboost_engine_cancel(e, id), TBOOST_OK);
    assert_eq!(tboost_engine_cancel(e, id), TBOOST_OK, "idempotent");
    run(e);
    let mut stats = tboost_stats { struct_size: size_of::<tboost_stats>() as u32, ..Default::default() };
    assert_eq!(unsafe { tboost_engine_stats(e, &mut stats) }, TBOOST_OK);
    assert_eq!(stats.kv_blocks_used, 0, "the next step freed the blocks");
    assert_eq!(tboost_engine_cancel(e, id), TBOOST_OK, "still idempotent once cancelled");
    let events = read_all(e, id);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].token >= 0);
    assert_eq!(events[1].finish, tboost_finish_reason::TBOOST_FINISH_CANCELLED);
    assert_eq!((events[1].token, events[1].index), (-1, 1));
    assert_eq!(tboost_engine_cancel(e, 999), TBOOST_ERR_NOT_FOUND);
    assert_eq!(tboost_engine_free(e), TBOOST_OK);
    assert_eq!(tboost_model_free(m), TBOOST_OK);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

#[test]
fn a_panic_is_a_status_and_poisons_only_its_engine() {
    let m = load("llama_gqa", null());
    let cfg = config(&[("threads", "1"), ("kv_cache_blocks", "16")]);
    // The test-only path: the faults a `fault-injection` build's `test.*` keys set.
    config::CONFIGS.get(cfg, "cfg").unwrap().settings.lock().unwrap().faults.panic_at_step = 2;
    let bad = engine(m, cfg);
    let good = engine(m, null());
    let id = enqueue(bad, &[3, 4], &tboost_sampling_params::default());
    assert_eq!(unsafe { tboost_engine_step(bad, null_mut()) }, TBOOST_OK);
    assert_eq!(unsafe { tboost_engine_step(bad, null_mut()) }, TBOOST_ERR_PANIC);
    assert!(last_error().contains("panics on purpose"), "{}", last_error());
    assert_eq!(unsafe { tboost_engine_step(bad, null_mut()) }, TBOOST_ERR_POISONED);
    assert_eq!(tboost_engine_cancel(bad, id), TBOOST_ERR_POISONED);
    let mut n = 0;
    assert_eq!(unsafe { tboost_engine_wait(bad, 0, 0, &mut n) }, TBOOST_ERR_POISONED);
    enqueue(good, &[3, 4], &tboost_sampling_params::default());
    run(good);
    assert_eq!(tboost_engine_free(bad), TBOOST_OK);
    assert_eq!(tboost_engine_free(good), TBOOST_OK);
    assert_eq!(tboost_model_free(m), TBOOST_OK);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

#[test]
fn struct_size_too_small_is_rejected() {
    let m = load("llama_gqa", null());
    let e = engine(m, null());
    let sp = tboost_sampling_params { struct_size: 0, ..Default::default() };
    let mut id = 0;
    let s = unsafe { tboost_engine_enqueue(e, [3].as_ptr(), 1, &sp, null(), null(), 0, &mut id) };
    assert_eq!(s, TBOOST_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("struct_size"), "{}", last_error());
    let mut stats = tboost_stats::default();
    assert_eq!(unsafe { tboost_engine_stats(e, &mut stats) }, TBOOST_ERR_INVALID_ARGUMENT);
    // A larger caller struct (a newer header) gets our fields and our size back.
    let mut big = [0u64; 40];
    big[0] = 320;
    assert_eq!(unsafe { tboost_engine_stats(e, big.as_mut_ptr().cast()) }, TBOOST_OK);
    assert_eq!(big[0] as u32, size_of::<tboost_stats>() as u32);
    assert_eq!(tboost_engine_free(e), TBOOST_OK);
    assert_eq!(tboost_model_free(m), TBOOST_OK);
}

/// `wait` on a request that has ended and whose events were all read returns at once
/// (it used to block for the whole timeout).
#[test]
fn wait_on_an_ended_fully_read_request_returns_at_once() {
    let m = load("llama_gqa", null());
    let cfg = config(&[("threads", "1"), ("kv_cache_blocks", "16")]);
    let e = engine(m, cfg);
    let id = enqueue(e, &[5, 6, 7], &tboost_sampling_params { max_tokens: 2, ..Default::default() });
    run(e);
    assert_eq!(read_all(e, id).len(), 2);
    let t = std::time::Instant::now();
    let mut n = 99;
    assert_eq!(unsafe { tboost_engine_wait(e, id, 10_000, &mut n) }, TBOOST_ERR_NOT_FOUND);
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "waited {:?}", t.elapsed());
    assert!(last_error().contains("has ended"), "{}", last_error());
    assert_eq!(tboost_engine_free(e), TBOOST_OK);
    assert_eq!(tboost_model_free(m), TBOOST_OK);
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

#[test]
fn fault_keys_are_not_public_config_keys() {
    let cfg = config(&[]);
    for key in ["debug_panic_at_step", "debug_step_delay_ms"] {
        assert_eq!(unsafe { tboost_config_set_int(cfg, c(key).as_ptr(), 1) }, TBOOST_ERR_INVALID_ARGUMENT, "{key}");
    }
    let status = unsafe { tboost_config_set_int(cfg, c("test.panic_at_step").as_ptr(), 1) };
    let want = if cfg!(feature = "fault-injection") { TBOOST_OK } else { TBOOST_ERR_INVALID_ARGUMENT };
    assert_eq!(status, want);
    assert!(::tboost_engine::engine::keys::keys()
        .iter()
        .all(|k| !k.name.starts_with("test.") && !k.name.contains("debug")));
    assert_eq!(tboost_config_free(cfg), TBOOST_OK);
}

/// Every key of the engine's table is documented in the header, under `tboost_config_set_int`
/// or `tboost_config_set_str`, with its environment variable when it has one.
#[test]
fn every_table_key_is_documented_in_the_header() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../include/tboost.h")).unwrap();
    let start = header.find("Sets an integer or flag option.").expect("tboost_config_set_int's doc");
    let end = header.find("tboost_status tboost_config_to_json(").expect("tboost_config_to_json");
    let docs = &header[start..end];
    for k in ::tboost_engine::engine::keys::keys() {
        assert!(docs.contains(&format!("`{}`", k.name)), "key `{}` is not documented in tboost_config_set_*", k.name);
        if let Some(var) = k.env {
            assert!(docs.contains(&format!("`{var}`")), "key `{}`: its variable {var} is not documented", k.name);
        }
    }
}

/// A key set on one config stays there: other configs, and the engines made from them, keep
/// their defaults.
#[test]
fn a_key_set_on_one_config_does_not_leak_to_another_engine() {
    let m = load("llama_gqa", null());
    let a = config(&[("threads", "1"), ("disabled_ops", "fuse_qkv"), ("max_seqs", "3")]);
    let b = config(&[("threads", "1")]);
    let json = |cfg: *const tboost_config| {
        let mut buf = vec![0 as std::os::raw::c_char; 1 << 14];
        assert_eq!(unsafe { tboost_config_to_json(cfg, buf.as_mut_ptr(), buf.len(), null_mut()) }, TBOOST_OK);
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
        serde_json::from_str::<serde_json::Value>(&s).unwrap()
    };
    assert_eq!(json(a)["disabled_ops"], "fuse_qkv");
    assert_eq!(json(b)["max_seqs"], 64);
    let plan = |e: *const tboost_engine| {
        let mut buf = vec![0 as std::os::raw::c_char; 1 << 20];
        assert_eq!(unsafe { tboost_engine_plan_json(e, buf.as_mut_ptr(), buf.len(), null_mut()) }, TBOOST_OK);
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    };
    let (ea, eb) = (engine(m, a), engine(m, b));
    let (pa, pb) = (plan(ea), plan(eb));
    assert!(pa.contains("fuse_qkv"), "{pa}");
    assert_ne!(pa, pb, "the disabled fusion changes only engine a's plan");
    for h in [ea, eb] {
        assert_eq!(tboost_engine_free(h), TBOOST_OK);
    }
    for h in [a, b] {
        assert_eq!(tboost_config_free(h), TBOOST_OK);
    }
    assert_eq!(tboost_model_free(m), TBOOST_OK);
}

/// What the re-entrant log callback saw, on the test's own thread only (other tests log
/// from theirs while the callback is installed).
struct Reentry {
    thread: std::thread::ThreadId,
    engine: *mut tboost_engine,
    seen: Vec<(tboost_status, tboost_status, String)>,
}

unsafe extern "C" fn reenter(
    _level: tboost_log_level,
    _target: *const std::os::raw::c_char,
    _msg: *const std::os::raw::c_char,
    user: *mut std::os::raw::c_void,
) {
    // SAFETY: the test passes a live `Reentry` and removes the callback before dropping it;
    // other threads only read `thread`, which is never written.
    let r = user as *mut Reentry;
    if std::thread::current().id() != unsafe { (*r).thread } {
        return;
    }
    let r = unsafe { &mut *r };
    let set = tboost_log_set(None, null_mut(), 2);
    let mut stats: tboost_stats = unsafe { std::mem::zeroed() };
    stats.struct_size = size_of::<tboost_stats>() as u32;
    let st = unsafe { tboost_engine_stats(r.engine, &mut stats) };
    r.seen.push((set, st, last_error()));
}

#[test]
fn a_tboost_call_from_a_log_callback_is_refused_not_deadlocked() {
    let (tx, rx) = std::sync::mpsc::channel();
    // A hard limit: a deadlock leaves the worker hanging and fails the test here.
    std::thread::spawn(move || {
        let cfg = config(&[]);
        let m = load("llama_gqa", cfg);
        let e = engine(m, cfg);
        let mut r = Reentry { thread: std::thread::current().id(), engine: e, seen: Vec::new() };
        assert_eq!(tboost_log_set(Some(reenter), &mut r as *mut Reentry as *mut _, 2), TBOOST_OK);
        // 600 new tokens go beyond llama_gqa's 512 trained positions: enqueue warns while it
        // holds the engine's lock, and the callback calls back into the log sink and engine.
        let p = tboost_sampling_params { max_tokens: 600, ..Default::default() };
        let mut id = 0;
        let prompt = [1i32, 2, 3];
        let s = unsafe { tboost_engine_enqueue(e, prompt.as_ptr(), prompt.len(), &p, null(), null(), 0, &mut id) };
        assert_eq!(tboost_log_set(None, null_mut(), 2), TBOOST_OK);
        let _ = tx.send((s, std::mem::take(&mut r.seen)));
        // The engine still works after the refused calls.
        assert_eq!(tboost_engine_cancel(e, id), TBOOST_OK, "{}", last_error());
        tboost_engine_free(e);
        tboost_model_free(m);
        tboost_config_free(cfg);
    });
    let (enqueued, seen) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a tboost call from a log callback hung (deadlock) or the worker failed");
    assert_eq!(enqueued, TBOOST_OK, "the outer enqueue must complete");
    assert!(!seen.is_empty(), "enqueue's warning never reached the callback");
    for (set, stats, err) in &seen {
        assert_eq!(*set, TBOOST_ERR_REENTRANT);
        assert_eq!(*stats, TBOOST_ERR_REENTRANT);
        assert!(
            err.starts_with(
                "tboost_engine_stats: called from a tboost log callback (fired inside tboost_engine_enqueue)"
            ),
            "{err}"
        );
    }
}
