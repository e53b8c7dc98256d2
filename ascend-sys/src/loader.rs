//! Finding and opening the CANN libraries, resolving symbols.
//!
//! Search order (first directory that holds `libascendcl.so` wins; the other libraries are looked for
//! in that directory first, then in the rest of the list):
//! 1. `$ASCEND_HOME_PATH/lib64`
//! 2. `$ASCEND_TOOLKIT_HOME/lib64`
//! 3. each directory of `$LD_LIBRARY_PATH`, itself and its `lib64/`
//! 4. `/usr/local/Ascend/ascend-toolkit/latest/lib64`
//!
//! Operator symbols are resolved lazily, on the first use of an op, across `libopapi.so` and the split
//! libraries newer CANN ships next to it (`libopapi_transformer.so`, `libopapi_nn.so`,
//! `libopapi_math.so`); the answer, found or absent, is cached. Absence is a capability answer, never a
//! load failure. The libraries stay loaded for the life of the process: CANN runtimes start threads and
//! expect `aclFinalize` before exit, not `dlclose`.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, OsStr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::error::{AclError, Result};

pub const RUNTIME_LIB: &str = "libascendcl.so";
pub const NNOPBASE_LIB: &str = "libnnopbase.so";
pub const OPAPI_LIB: &str = "libopapi.so";
/// Split operator libraries of newer CANN (research notes §3.3), searched after `libopapi.so`.
pub const OPAPI_SPLIT_LIBS: [&str; 3] = ["libopapi_transformer.so", "libopapi_nn.so", "libopapi_math.so"];
/// Libraries some CANN versions move runtime functions into (`aclsysGetVersionStr`, research notes §3.3).
pub const RUNTIME_EXTRA_LIBS: [&str; 3] = ["libacl_rt.so", "libacl_rt_impl.so", "libascend_common.so"];
/// HCCL, the collective communication library (loaded on demand by [`crate::hccl::Hccl::load`]).
pub const HCCL_LIB: &str = "libhccl.so";
pub const DEFAULT_TOOLKIT: &str = "/usr/local/Ascend/ascend-toolkit/latest";

/// The directories searched for the CANN libraries, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchOrder {
    dirs: Vec<PathBuf>,
}

impl SearchOrder {
    /// From `ASCEND_HOME_PATH`, `ASCEND_TOOLKIT_HOME`, `LD_LIBRARY_PATH` and the default toolkit path.
    pub fn from_env() -> SearchOrder {
        let get = |k: &str| std::env::var_os(k);
        SearchOrder::from_vars(
            get("ASCEND_HOME_PATH").as_deref(),
            get("ASCEND_TOOLKIT_HOME").as_deref(),
            get("LD_LIBRARY_PATH").as_deref(),
        )
    }

    /// The same rules on given values (empty values count as unset).
    pub fn from_vars(
        ascend_home: Option<&OsStr>,
        toolkit_home: Option<&OsStr>,
        ld_library_path: Option<&OsStr>,
    ) -> Self {
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut push = |p: PathBuf| {
            if !dirs.contains(&p) {
                dirs.push(p);
            }
        };
        for root in [ascend_home, toolkit_home].into_iter().flatten() {
            if !root.is_empty() {
                push(Path::new(root).join("lib64"));
            }
        }
        if let Some(ld) = ld_library_path {
            for dir in std::env::split_paths(ld) {
                if !dir.as_os_str().is_empty() {
                    push(dir.clone());
                    push(dir.join("lib64"));
                }
            }
        }
        push(Path::new(DEFAULT_TOOLKIT).join("lib64"));
        SearchOrder { dirs }
    }

    /// Exactly these directories, in this order (no environment, no default path).
    pub fn dirs_only(dirs: impl IntoIterator<Item = PathBuf>) -> SearchOrder {
        SearchOrder { dirs: dirs.into_iter().collect() }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// `preferred` first, then the rest of the list.
    fn ordered_from<'a>(&'a self, preferred: &'a Path) -> impl Iterator<Item = &'a Path> {
        std::iter::once(preferred).chain(self.dirs.iter().map(PathBuf::as_path).filter(move |d| *d != preferred))
    }
}

pub(crate) struct Lib {
    pub path: PathBuf,
    lib: Library,
}

impl Lib {
    pub(crate) fn open(path: &Path) -> Result<Lib> {
        // RTLD_NOW: an unresolved dependency fails here, with dlerror's text, not in the middle of a step.
        // SAFETY: loading a shared library runs its initialisers; CANN's are what every CANN program runs.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| AclError::Load { path: path.to_path_buf(), reason: e.to_string() })?;
        Ok(Lib { path: path.to_path_buf(), lib })
    }

    /// The address of `name`, or None when the library does not export it.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let mut bytes = Vec::with_capacity(name.len() + 1);
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        // SAFETY: reading a symbol's address does not call it; the type is a plain pointer.
        let sym = unsafe { self.lib.get::<*mut c_void>(&bytes) }.ok()?;
        let p = *sym;
        (!p.is_null()).then_some(p)
    }
}

/// Resolved addresses of one op's pair.
#[derive(Clone, Copy)]
pub(crate) struct OpSyms {
    pub gws: *mut c_void,
    pub exec: *mut c_void,
    pub lib: usize, // index into Libraries::opapi
}
// SAFETY: function addresses are immutable for the life of the (never unloaded) library.
unsafe impl Send for OpSyms {}

pub(crate) struct Libraries {
    pub runtime: Lib,
    pub runtime_extra: Vec<Lib>,
    pub nnopbase: Lib,
    pub opapi: Vec<Lib>,
    ops: Mutex<HashMap<String, Option<OpSyms>>>,
}

pub(crate) fn find(order: &SearchOrder, preferred: Option<&Path>, name: &str, what: &'static str) -> Result<PathBuf> {
    let mut searched = Vec::new();
    let dirs: Vec<&Path> = match preferred {
        Some(p) => order.ordered_from(p).collect(),
        None => order.dirs.iter().map(PathBuf::as_path).collect(),
    };
    for dir in dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(candidate);
    }
    Err(AclError::NotFound { what, searched })
}

/// The `libascendcl.so` the search order picks.
pub(crate) fn locate_runtime(order: &SearchOrder) -> Result<PathBuf> {
    find(order, None, RUNTIME_LIB, "CANN runtime")
}

impl Libraries {
    pub fn load(order: &SearchOrder) -> Result<Libraries> {
        let runtime_path = locate_runtime(order)?;
        let dir = runtime_path.parent().map(Path::to_path_buf).unwrap_or_default();
        let runtime = Lib::open(&runtime_path)?;
        let runtime_extra = RUNTIME_EXTRA_LIBS
            .iter()
            .map(|n| dir.join(n))
            .filter(|p| p.is_file())
            .filter_map(|p| match Lib::open(&p) {
                Ok(l) => Some(l),
                Err(e) => {
                    log::warn!("ascend: ignoring {}: {e}", p.display());
                    None
                }
            })
            .collect();
        let nnopbase = Lib::open(&find(order, Some(&dir), NNOPBASE_LIB, "CANN aclnn base library (libnnopbase.so)")?)?;

        // the operator libraries: the first directory that has libopapi.so or any split library
        let mut opapi = Vec::new();
        let mut searched = Vec::new();
        for d in order.ordered_from(&dir) {
            let present: Vec<PathBuf> =
                std::iter::once(OPAPI_LIB).chain(OPAPI_SPLIT_LIBS).map(|n| d.join(n)).filter(|p| p.is_file()).collect();
            if present.is_empty() {
                searched.push(d.join(OPAPI_LIB));
                continue;
            }
            for p in present {
                opapi.push(Lib::open(&p)?);
            }
            break;
        }
        if opapi.is_empty() {
            return Err(AclError::NotFound { what: "CANN operator library (libopapi.so)", searched });
        }
        Ok(Libraries { runtime, runtime_extra, nnopbase, opapi, ops: Mutex::new(HashMap::new()) })
    }

    /// A runtime function: libascendcl.so first, then the extra runtime libraries.
    pub fn runtime_symbol(&self, name: &str) -> Option<*mut c_void> {
        self.runtime.symbol(name).or_else(|| self.runtime_extra.iter().find_map(|l| l.symbol(name)))
    }

    /// The op pair `<op>GetWorkspaceSize` + `<op>`, resolved on first use and cached (absence too).
    pub fn op(&self, op: &str) -> Option<OpSyms> {
        let mut cache = match self.ops.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(hit) = cache.get(op) {
            return *hit;
        }
        let gws_name = format!("{op}GetWorkspaceSize");
        let found = self.opapi.iter().enumerate().find_map(|(i, l)| {
            let gws = l.symbol(&gws_name)?;
            let exec = l.symbol(op)?;
            Some(OpSyms { gws, exec, lib: i })
        });
        match &found {
            Some(s) => log::debug!("ascend: {op} resolved from {}", self.opapi[s.lib].path.display()),
            None => log::info!("ascend: {op} is absent from {}", self.opapi_paths_str()),
        }
        cache.insert(op.to_string(), found);
        found
    }

    pub fn opapi_paths(&self) -> Vec<PathBuf> {
        self.opapi.iter().map(|l| l.path.clone()).collect()
    }

    fn opapi_paths_str(&self) -> String {
        self.opapi.iter().map(|l| l.path.display().to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// A NUL-terminated C string from CANN, copied (None for NULL or non-UTF-8 bytes replaced).
pub(crate) fn c_string(p: *const std::os::raw::c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: CANN returns NUL-terminated strings that stay valid at least until the next call on this thread.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_follows_the_documented_precedence() {
        let o = SearchOrder::from_vars(
            Some(OsStr::new("/home")),
            Some(OsStr::new("/toolkit")),
            Some(OsStr::new("/a::/b/lib64:/home/lib64")),
        );
        let want: Vec<PathBuf> = [
            "/home/lib64",
            "/toolkit/lib64",
            "/a",
            "/a/lib64",
            "/b/lib64",
            "/b/lib64/lib64",
            "/home/lib64/lib64",
            "/usr/local/Ascend/ascend-toolkit/latest/lib64",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(o.dirs(), want.as_slice());
    }

    #[test]
    fn unset_and_empty_variables_leave_only_the_default_toolkit() {
        let o = SearchOrder::from_vars(Some(OsStr::new("")), None, Some(OsStr::new("")));
        assert_eq!(o.dirs(), [PathBuf::from("/usr/local/Ascend/ascend-toolkit/latest/lib64")]);
    }

    #[test]
    fn not_found_lists_every_candidate_in_order() {
        let dir = std::env::temp_dir().join(format!("ascend-sys-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let o = SearchOrder::dirs_only([dir.clone(), PathBuf::from("/nonexistent/x")]);
        let err = match Libraries::load(&o) {
            Err(e) => e,
            Ok(_) => panic!("an empty directory cannot hold CANN"),
        };
        let text = err.to_string();
        assert_eq!(
            text,
            format!(
                "CANN runtime not found; searched: {}/libascendcl.so, /nonexistent/x/libascendcl.so",
                dir.display()
            )
        );
        let _ = std::fs::remove_dir(&dir);
    }
}
