//! Handle ownership, in one place: every handle the C side holds is the address of an
//! `Arc<T>` kept in a per-kind registry. A call clones the `Arc` out of the registry (so the
//! object outlives the call even if another thread frees the handle meanwhile); `*_free`
//! removes it. A pointer that is not in the registry — never created, already freed, or a
//! handle of another kind — is reported as `TBOOST_ERR_INVALID_HANDLE` and never dereferenced.
//! (An address reused by a later handle of the same kind cannot be told apart: that is the
//! "where detectable" limit.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::status::{Failure, FfiResult, Status};

pub(crate) struct Registry<T> {
    kind: &'static str,
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    pub const fn new(kind: &'static str) -> Self {
        Registry { kind, live: Mutex::new(BTreeMap::new()) }
    }

    fn live(&self) -> MutexGuard<'_, BTreeMap<usize, Arc<T>>> {
        // The map is only ever inserted into or removed from; a panic elsewhere that
        // poisoned the lock left it consistent.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `v` and returns its handle.
    pub fn insert<H>(&self, v: Arc<T>) -> *mut H {
        let p = Arc::as_ptr(&v) as usize;
        self.live().insert(p, v);
        p as *mut H
    }

    /// A reference to the object behind `h`; `param` names the argument in errors.
    pub fn get<H>(&self, h: *const H, param: &str) -> FfiResult<Arc<T>> {
        if h.is_null() {
            return Err(Failure::null(param));
        }
        self.live().get(&(h as usize)).cloned().ok_or_else(|| self.invalid(h as usize, param))
    }

    /// Unregisters `h`; the object is dropped when the last in-flight call releases it.
    pub fn remove<H>(&self, h: *const H, param: &str) -> FfiResult<Arc<T>> {
        if h.is_null() {
            return Err(Failure::null(param));
        }
        self.live().remove(&(h as usize)).ok_or_else(|| self.invalid(h as usize, param))
    }

    fn invalid(&self, p: usize, param: &str) -> Failure {
        Failure::new(
            Status::TBOOST_ERR_INVALID_HANDLE,
            format!(
                "`{param}` ({p:#x}) is not a live tboost_{} handle (never created, already freed, or another kind)",
                self.kind
            ),
        )
    }
}
