//! Generators of model files for the reliability regression tests and the fuzzers: a GGUF
//! writer that also reads real files back into editable form (`gguf`), Hugging Face
//! directories built in a tempdir around the shared golden checkpoints, which are linked,
//! never copied (`hf`), and a runner that gives a call a time budget and turns a panic into
//! a value (`bounded`). Nothing here writes into the repository or into `shared/`.
#![allow(dead_code)]

pub mod convert;
pub mod gguf;
pub mod hf;

use std::any::Any;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

/// How a bounded call ended.
#[derive(Debug)]
pub enum Outcome<T> {
    Done(T),
    /// It panicked; the payload's message.
    Panicked(String),
    /// It was still running when the budget ran out (the thread is left behind).
    TimedOut,
}

pub fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Runs `f` on its own thread under `catch_unwind` and waits at most `budget`.
pub fn bounded<T: Send + 'static>(budget: Duration, f: impl FnOnce() -> T + Send + 'static) -> Outcome<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("bounded".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r.map_err(|p| panic_message(&*p)));
        })
        .expect("spawn");
    match rx.recv_timeout(budget) {
        Ok(Ok(v)) => Outcome::Done(v),
        Ok(Err(msg)) => Outcome::Panicked(msg),
        Err(_) => Outcome::TimedOut,
    }
}

/// The budget of one load in the regression tests: a load of these tiny files takes
/// milliseconds; 60 s leaves room for a machine under heavy load and still fails a hang.
pub const LOAD_BUDGET: Duration = Duration::from_secs(60);

/// `tboost_engine::model::Model::load` under [`bounded`]: the error text, or a failure naming
/// `what` when it loaded, panicked or hung.
pub fn load_error(path: &Path, what: &str) -> String {
    let p = path.to_path_buf();
    match bounded(LOAD_BUDGET, move || tboost_engine::model::Model::load(&p).map(|_| ()).map_err(|e| e.to_string())) {
        Outcome::Done(Err(e)) => e,
        Outcome::Done(Ok(())) => panic!("{what}: {} loaded, but it must be refused", path.display()),
        Outcome::Panicked(m) => panic!("{what}: loading {} panicked: {m}", path.display()),
        Outcome::TimedOut => panic!("{what}: loading {} did not return within {LOAD_BUDGET:?}", path.display()),
    }
}

pub fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` should mention `{p}`");
    }
}

/// Makes a FIFO (named pipe) at `path`.
pub fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}
