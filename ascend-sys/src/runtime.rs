//! The loaded CANN runtime: initialisation, device facts, devices, streams, events, memory.
//!
//! Ownership:
//! - [`Cann`] is a cheap handle (an `Arc`) to the loaded libraries and their resolved functions. One
//!   instance exists per `libascendcl.so` path per process and lives until the process exits: CANN allows
//!   one `aclInit` per process, so the handle calls `aclInit` once and `aclFinalize` once, at process exit
//!   (an `atexit` handler, after every engine and device is gone; a host may call [`Cann::finalize`]
//!   earlier itself, and then the exit handler does nothing). When the host had initialised AscendCL
//!   before us, the host finalises it.
//! - [`Device`] sets the device (`aclrtSetDevice`, which binds the *calling thread*) and resets it when
//!   its last clone is dropped; [`Device::make_current`] binds another thread (callers do it on entry). Every
//!   stream, event and buffer holds a `Device` clone, so the device outlives them.
//! - [`DeviceBuffer`] (`aclrtMalloc`) and [`HostBuffer`] (`aclrtMallocHost`) free on drop. Work queued on a
//!   stream that uses a buffer must be synchronized before the buffer is dropped.
//! - [`Stream`] synchronizes and destroys itself on drop; [`Event`] destroys itself on drop.
//!   Failures inside `Drop` are logged (`log::warn!`), never panicked on.

use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::{AclError, Result};
use crate::loader::{c_string, locate_runtime, Libraries, OpSyms, SearchOrder};
use crate::raw;
use crate::version::CannVersion;

/// Returns the function or makes the enclosing function return `AclError::FunctionUnavailable`.
#[macro_export]
#[doc(hidden)]
macro_rules! call_fn {
    ($f:expr, $name:literal, $cann:expr) => {
        match $f {
            Some(f) => f,
            None => return Err($cann.unavailable($name)),
        }
    };
}

fn cast<F: Copy>(p: Option<*mut c_void>) -> Option<F> {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: F is an `Option<unsafe extern "C" fn(..)>` from raw.rs (pointer-sized, null = None); the
    // address is the symbol the header declares with that type.
    p.map(|p| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

#[allow(non_snake_case)]
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub aclInit: raw::aclInit_fn,
    pub aclFinalize: raw::aclFinalize_fn,
    pub aclGetRecentErrMsg: raw::aclGetRecentErrMsg_fn,
    pub aclsysGetVersionStr: raw::aclsysGetVersionStr_fn,
    pub aclrtGetVersion: raw::aclrtGetVersion_fn,
    pub aclrtGetSocName: raw::aclrtGetSocName_fn,
    pub aclrtSetDevice: raw::aclrtSetDevice_fn,
    pub aclrtGetDevice: raw::aclrtGetDevice_fn,
    pub aclrtResetDevice: raw::aclrtResetDevice_fn,
    pub aclrtGetDeviceCount: raw::aclrtGetDeviceCount_fn,
    pub aclrtSynchronizeDevice: raw::aclrtSynchronizeDevice_fn,
    pub aclrtCreateStream: raw::aclrtCreateStream_fn,
    pub aclrtDestroyStream: raw::aclrtDestroyStream_fn,
    pub aclrtSynchronizeStream: raw::aclrtSynchronizeStream_fn,
    pub aclrtCreateEvent: raw::aclrtCreateEvent_fn,
    pub aclrtDestroyEvent: raw::aclrtDestroyEvent_fn,
    pub aclrtRecordEvent: raw::aclrtRecordEvent_fn,
    pub aclrtSynchronizeEvent: raw::aclrtSynchronizeEvent_fn,
    pub aclrtStreamWaitEvent: raw::aclrtStreamWaitEvent_fn,
    pub aclrtMalloc: raw::aclrtMalloc_fn,
    pub aclrtFree: raw::aclrtFree_fn,
    pub aclrtMallocHost: raw::aclrtMallocHost_fn,
    pub aclrtFreeHost: raw::aclrtFreeHost_fn,
    pub aclrtMemcpy: raw::aclrtMemcpy_fn,
    pub aclrtMemcpyAsync: raw::aclrtMemcpyAsync_fn,
    pub aclrtMemset: raw::aclrtMemset_fn,
    pub aclrtMemsetAsync: raw::aclrtMemsetAsync_fn,
    pub aclrtEventElapsedTime: raw::aclrtEventElapsedTime_fn,
    pub tboostSimGetStats: raw::tboostSimGetStats_fn,
    pub aclCreateTensor: raw::aclCreateTensor_fn,
    pub aclDestroyTensor: raw::aclDestroyTensor_fn,
    pub aclCreateScalar: raw::aclCreateScalar_fn,
    pub aclDestroyScalar: raw::aclDestroyScalar_fn,
    pub aclCreateIntArray: raw::aclCreateIntArray_fn,
    pub aclDestroyIntArray: raw::aclDestroyIntArray_fn,
    pub aclCreateTensorList: raw::aclCreateTensorList_fn,
    pub aclDestroyTensorList: raw::aclDestroyTensorList_fn,
    pub aclSetAclOpExecutorRepeatable: raw::aclSetAclOpExecutorRepeatable_fn,
    pub aclDestroyAclOpExecutor: raw::aclDestroyAclOpExecutor_fn,
}

/// Runtime functions without which nothing works; a library lacking one is not CANN.
const REQUIRED_RUNTIME: [&str; 11] = [
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
];
const REQUIRED_NNOPBASE: [&str; 9] = [
    "aclCreateTensor",
    "aclDestroyTensor",
    "aclCreateIntArray",
    "aclDestroyIntArray",
    "aclCreateTensorList",
    "aclDestroyTensorList",
    "aclCreateScalar",
    "aclDestroyScalar",
    "aclDestroyAclOpExecutor",
];

impl Api {
    fn resolve(libs: &Libraries) -> Result<Api> {
        for name in REQUIRED_RUNTIME {
            if libs.runtime_symbol(name).is_none() {
                return Err(AclError::MissingSymbol { library: libs.runtime.path.clone(), symbol: name });
            }
        }
        for name in REQUIRED_NNOPBASE {
            if libs.nnopbase.symbol(name).is_none() {
                return Err(AclError::MissingSymbol { library: libs.nnopbase.path.clone(), symbol: name });
            }
        }
        let rt = |n: &str| libs.runtime_symbol(n);
        let nn = |n: &str| libs.nnopbase.symbol(n);
        Ok(Api {
            aclInit: cast(rt("aclInit")),
            aclFinalize: cast(rt("aclFinalize")),
            aclGetRecentErrMsg: cast(rt("aclGetRecentErrMsg")),
            aclsysGetVersionStr: cast(rt("aclsysGetVersionStr")),
            aclrtGetVersion: cast(rt("aclrtGetVersion")),
            aclrtGetSocName: cast(rt("aclrtGetSocName")),
            aclrtSetDevice: cast(rt("aclrtSetDevice")),
            aclrtGetDevice: cast(rt("aclrtGetDevice")),
            aclrtResetDevice: cast(rt("aclrtResetDevice")),
            aclrtGetDeviceCount: cast(rt("aclrtGetDeviceCount")),
            aclrtSynchronizeDevice: cast(rt("aclrtSynchronizeDevice")),
            aclrtCreateStream: cast(rt("aclrtCreateStream")),
            aclrtDestroyStream: cast(rt("aclrtDestroyStream")),
            aclrtSynchronizeStream: cast(rt("aclrtSynchronizeStream")),
            aclrtCreateEvent: cast(rt("aclrtCreateEvent")),
            aclrtDestroyEvent: cast(rt("aclrtDestroyEvent")),
            aclrtRecordEvent: cast(rt("aclrtRecordEvent")),
            aclrtSynchronizeEvent: cast(rt("aclrtSynchronizeEvent")),
            aclrtStreamWaitEvent: cast(rt("aclrtStreamWaitEvent")),
            aclrtMalloc: cast(rt("aclrtMalloc")),
            aclrtFree: cast(rt("aclrtFree")),
            aclrtMallocHost: cast(rt("aclrtMallocHost")),
            aclrtFreeHost: cast(rt("aclrtFreeHost")),
            aclrtMemcpy: cast(rt("aclrtMemcpy")),
            aclrtMemcpyAsync: cast(rt("aclrtMemcpyAsync")),
            aclrtMemset: cast(rt("aclrtMemset")),
            aclrtMemsetAsync: cast(rt("aclrtMemsetAsync")),
            aclrtEventElapsedTime: cast(rt("aclrtEventElapsedTime")),
            tboostSimGetStats: cast(rt("tboostSimGetStats")),
            aclCreateTensor: cast(nn("aclCreateTensor")),
            aclDestroyTensor: cast(nn("aclDestroyTensor")),
            aclCreateScalar: cast(nn("aclCreateScalar")),
            aclDestroyScalar: cast(nn("aclDestroyScalar")),
            aclCreateIntArray: cast(nn("aclCreateIntArray")),
            aclDestroyIntArray: cast(nn("aclDestroyIntArray")),
            aclCreateTensorList: cast(nn("aclCreateTensorList")),
            aclDestroyTensorList: cast(nn("aclDestroyTensorList")),
            aclSetAclOpExecutorRepeatable: cast(nn("aclSetAclOpExecutorRepeatable")),
            aclDestroyAclOpExecutor: cast(nn("aclDestroyAclOpExecutor")),
        })
    }
}

struct Inner {
    libs: Libraries,
    api: Api,
    dir: PathBuf,
    /// `aclInit` was ours (not the host's), so `aclFinalize` is ours too.
    owns_init: bool,
    finalized: std::sync::atomic::AtomicBool,
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> std::os::raw::c_int;
}

/// Calls `aclFinalize` once per runtime we initialised, at process exit: "aclFinalize ... must be called
/// before the process exits" and after it the runtime cannot be used again (acl_rt.h), so no earlier
/// point is safe while another engine in the process may still open the device.
extern "C" fn finalize_at_exit() {
    let instances = match INSTANCES.try_lock() {
        Ok(g) => g.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>(),
        Err(_) => return, // exiting while another thread loads CANN: leave it to the OS
    };
    for c in instances {
        if c.inner.owns_init {
            if let Err(e) = c.finalize() {
                log::warn!("ascend: aclFinalize at exit failed: {e}");
            }
        }
    }
}

/// A handle to one loaded CANN installation (or the CANN SIMULATOR). Cheap to clone.
#[derive(Clone)]
pub struct Cann {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cann {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cann({})", self.inner.dir.display())
    }
}

static INSTANCES: Mutex<Vec<(PathBuf, Cann)>> = Mutex::new(Vec::new());

impl Cann {
    /// Loads CANN from the standard search order ([`SearchOrder::from_env`]) and initialises it.
    pub fn load() -> Result<Cann> {
        Cann::load_from(&SearchOrder::from_env())
    }

    /// Loads from the given search order; a second call that finds the same `libascendcl.so` returns the
    /// same instance.
    pub fn load_from(order: &SearchOrder) -> Result<Cann> {
        let runtime = locate_runtime(order)?;
        let key = runtime.canonicalize().unwrap_or(runtime);
        let mut instances = INSTANCES.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = instances.iter().find(|(k, _)| *k == key) {
            return Ok(c.clone());
        }
        let libs = Libraries::load(order)?;
        let api = Api::resolve(&libs)?;
        let dir = libs.runtime.path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut cann = Cann {
            inner: Arc::new(Inner {
                libs,
                api,
                dir,
                owns_init: false,
                finalized: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        let owns_init = cann.init()?;
        if let Some(inner) = Arc::get_mut(&mut cann.inner) {
            inner.owns_init = owns_init;
        }
        if owns_init {
            static REGISTER: std::sync::Once = std::sync::Once::new();
            REGISTER.call_once(|| {
                // SAFETY: registers a plain extern "C" function.
                if unsafe { atexit(finalize_at_exit) } != 0 {
                    log::warn!("ascend: could not register aclFinalize at exit");
                }
            });
        }
        let facts = cann.facts();
        log::info!(
            "ascend: {} loaded from {} (SoC {}, CANN {}, operator libraries {})",
            if cann.is_simulator() { "CANN SIMULATOR" } else { "CANN" },
            cann.inner.dir.display(),
            facts.soc_name.as_deref().unwrap_or("unknown"),
            facts.cann_version_string.as_deref().unwrap_or("unknown"),
            cann.op_libraries().iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
        instances.push((key, cann.clone()));
        Ok(cann)
    }

    /// `aclInit`; true when this call initialised the runtime (so we finalise it).
    fn init(&self) -> Result<bool> {
        let f = call_fn!(self.api().aclInit, "aclInit", self);
        // SAFETY: NULL config path is documented as allowed.
        let rc = unsafe { f(std::ptr::null()) };
        match rc {
            0 => Ok(true),
            raw::ACL_ERROR_REPEAT_INITIALIZE => {
                // the host (or another component) initialised AscendCL already: fine, it is per process
                let _ = self.recent_error();
                log::info!("ascend: aclInit reports the process is already initialised; using it");
                Ok(false)
            }
            code => Err(self.runtime_error("aclInit", code)),
        }
    }

    /// `aclFinalize`. After it the runtime cannot be used again in this process (acl_rt.h).
    pub fn finalize(&self) -> Result<()> {
        if self.inner.finalized.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Ok(()); // once per process
        }
        let f = call_fn!(self.api().aclFinalize, "aclFinalize", self);
        // SAFETY: plain call.
        self.check("aclFinalize", unsafe { f() })
    }

    pub(crate) fn api(&self) -> &Api {
        &self.inner.api
    }

    /// The directory `libascendcl.so` was loaded from.
    pub fn lib_dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The operator libraries ops are resolved from, in search order.
    pub fn op_libraries(&self) -> Vec<PathBuf> {
        self.inner.libs.opapi_paths()
    }

    /// True when this is the tboost CANN SIMULATOR (it exports `tboostSimGetStats`).
    pub fn is_simulator(&self) -> bool {
        self.api().tboostSimGetStats.is_some()
    }

    /// Whether `aclrtEventElapsedTime` is exported (events can time work on the stream).
    pub fn has_event_timing(&self) -> bool {
        self.api().aclrtEventElapsedTime.is_some()
    }

    /// Whether the installation has op `name` (e.g. `"aclnnRmsNorm"`): both halves of the pair exist.
    pub fn has_op(&self, name: &str) -> bool {
        self.inner.libs.op(name).is_some()
    }

    /// The library op `name` resolves from, when present.
    pub fn op_library(&self, name: &str) -> Option<PathBuf> {
        self.inner.libs.op(name).map(|s| self.inner.libs.opapi[s.lib].path.clone())
    }

    /// The raw addresses of op `name`'s pair, for callers that drive the protocol themselves (tests of the
    /// two-phase rules, custom caching). `first_phase` must be cast to the header's `<name>GetWorkspaceSize_fn`.
    pub fn raw_op(&self, name: &str) -> Option<RawOp> {
        let s = self.inner.libs.op(name)?;
        // SAFETY: the execute twin of every op has the header's aclnnExecute_fn type.
        let execute = unsafe { std::mem::transmute_copy::<*mut c_void, raw::aclnnExecute_fn>(&s.exec) };
        Some(RawOp { first_phase: s.gws, execute })
    }

    pub(crate) fn op_syms(&self, name: &'static str) -> Result<OpSyms> {
        self.inner
            .libs
            .op(name)
            .ok_or_else(|| AclError::OpUnavailable { op: name.to_string(), libraries: self.op_libraries() })
    }

    /// `aclGetRecentErrMsg()`, when the runtime has one.
    pub fn recent_error(&self) -> Option<String> {
        let f = self.api().aclGetRecentErrMsg?;
        // SAFETY: returns NULL or a NUL-terminated string owned by the runtime.
        c_string(unsafe { f() }).filter(|s| !s.is_empty())
    }

    pub(crate) fn unavailable(&self, symbol: &'static str) -> AclError {
        AclError::FunctionUnavailable { library: self.inner.libs.runtime.path.clone(), symbol }
    }

    pub(crate) fn runtime_error(&self, call: &'static str, code: i32) -> AclError {
        AclError::Runtime { call, code, message: self.recent_error().unwrap_or_default() }
    }

    pub(crate) fn check(&self, call: &'static str, code: i32) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.runtime_error(call, code))
        }
    }

    /// The SoC family (`aclrtGetSocName`).
    pub fn soc(&self) -> SocFamily {
        self.api()
            .aclrtGetSocName
            .and_then(|f| {
                // SAFETY: returns NULL or a static NUL-terminated string.
                c_string(unsafe { f() })
            })
            .as_deref()
            .map(SocFamily::classify)
            .unwrap_or(SocFamily::Unknown)
    }

    /// What the runtime says about itself and the SoC.
    pub fn facts(&self) -> DeviceFacts {
        let api = self.api();
        let soc_name = api.aclrtGetSocName.and_then(|f| {
            // SAFETY: returns NULL or a static NUL-terminated string.
            c_string(unsafe { f() })
        });
        let mut cann_version_string = None;
        if let Some(f) = api.aclsysGetVersionStr {
            for pkg in ["runtime", "cann", "toolkit"] {
                let mut buf = [0 as c_char; 128]; // ACL_PKG_VERSION_MAX_SIZE
                let name = CString::new(pkg).unwrap_or_default();
                // SAFETY: name is NUL-terminated; buf has ACL_PKG_VERSION_MAX_SIZE bytes as documented.
                let rc = unsafe { f(name.as_ptr() as *mut c_char, buf.as_mut_ptr()) };
                if rc == 0 {
                    buf[127] = 0;
                    cann_version_string = c_string(buf.as_ptr()).filter(|s| !s.is_empty());
                    break;
                }
                let _ = self.recent_error();
            }
        }
        let acl_api_version = api.aclrtGetVersion.and_then(|f| {
            let (mut a, mut b, mut c) = (0, 0, 0);
            // SAFETY: three valid out pointers.
            (unsafe { f(&mut a, &mut b, &mut c) } == 0).then_some((a, b, c))
        });
        let device_count = api.aclrtGetDeviceCount.and_then(|f| {
            let mut n = 0u32;
            // SAFETY: valid out pointer.
            (unsafe { f(&mut n) } == 0).then_some(n)
        });
        let _ = self.recent_error();
        DeviceFacts {
            soc: soc_name.as_deref().map(SocFamily::classify).unwrap_or(SocFamily::Unknown),
            cann_version: cann_version_string.as_deref().and_then(CannVersion::parse),
            soc_name,
            cann_version_string,
            acl_api_version,
            device_count,
            simulator: self.is_simulator(),
        }
    }

    /// Sets device `id` for this thread; the device is reset when the last clone of the result drops.
    pub fn device(&self, id: i32) -> Result<Device> {
        let f = call_fn!(self.api().aclrtSetDevice, "aclrtSetDevice", self);
        // SAFETY: plain call.
        self.check("aclrtSetDevice", unsafe { f(id) })?;
        Ok(Device { inner: Arc::new(DeviceInner { cann: self.clone(), id }) })
    }

    /// The simulator's resource counters (`None` on real CANN).
    pub fn sim_stats(&self) -> Option<SimStats> {
        let f = self.api().tboostSimGetStats?;
        // SAFETY: tboostSimStats is plain data; structSize tells the simulator the layout we expect.
        let mut s: raw::tboostSimStats = unsafe { std::mem::zeroed() };
        s.structSize = std::mem::size_of::<raw::tboostSimStats>() as u64;
        // SAFETY: valid pointer to a correctly sized struct.
        if unsafe { f(&mut s) } != 0 {
            return None;
        }
        Some(SimStats {
            device_allocations: s.deviceAllocations,
            device_bytes: s.deviceBytes,
            host_allocations: s.hostAllocations,
            live_tensors: s.liveTensors,
            live_scalars: s.liveScalars,
            live_int_arrays: s.liveIntArrays,
            live_tensor_lists: s.liveTensorLists,
            live_executors: s.liveExecutors,
            live_streams: s.liveStreams,
            live_events: s.liveEvents,
            pending_tasks: s.pendingTasks,
            malloc_calls: s.mallocCalls,
            op_launches: s.opLaunches,
            ops_run: s.opsRun,
            sync_calls: s.syncCalls,
            rule_violations: s.ruleViolations,
            executor_double_frees: s.executorDoubleFrees,
        })
    }
}

/// See [`Cann::raw_op`].
#[derive(Clone, Copy)]
pub struct RawOp {
    pub first_phase: *mut c_void,
    pub execute: raw::aclnnExecute_fn,
}

/// The SoC families tboost distinguishes (research notes §1.5: ATB's `InitSocVersion` substring rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SocFamily {
    /// Atlas A2: "Ascend910B" followed by more characters (Ascend910B1..B4).
    Ascend910B,
    /// Atlas A3: "Ascend910_93..".
    Ascend910_93,
    /// Atlas inference series (300I Duo): "Ascend310P..". No bf16, NZ formats.
    Ascend310P,
    /// Training series: "Ascend910A", "Ascend910ProA", or exactly "Ascend910B".
    Ascend910A,
    Ascend310B,
    Ascend950,
    Unknown,
}

impl SocFamily {
    pub fn classify(name: &str) -> SocFamily {
        if name.starts_with("Ascend910_93") {
            SocFamily::Ascend910_93
        } else if name == "Ascend910B" || name.starts_with("Ascend910A") || name.starts_with("Ascend910ProA") {
            SocFamily::Ascend910A
        } else if name.starts_with("Ascend910B") {
            SocFamily::Ascend910B
        } else if name.starts_with("Ascend310P") {
            SocFamily::Ascend310P
        } else if name.starts_with("Ascend310B") {
            SocFamily::Ascend310B
        } else if name.starts_with("Ascend950") {
            SocFamily::Ascend950
        } else {
            SocFamily::Unknown
        }
    }

    /// bf16 tensors exist: only on Atlas A2/A3 and 950. The Atlas inference series (310P: ATB
    /// `include/atb/types.h`), the training series (910A) and 200I/500 A2 (310B) have none (ops-nn
    /// `matmul/mat_mul_v3/docs/aclnnMm.md` and `norm/rms_norm/docs/aclnnRmsNorm.md` list BFLOAT16 for
    /// A2/A3 only).
    pub fn supports_bf16(self) -> bool {
        !matches!(self, SocFamily::Ascend310P | SocFamily::Ascend910A | SocFamily::Ascend310B)
    }

    /// Atlas A2/A3 (and 950): where FusedInferAttentionScore, MoeGatingTopKSoftmax and ScatterPaKvCache exist.
    pub fn is_a2_or_a3(self) -> bool {
        matches!(self, SocFamily::Ascend910B | SocFamily::Ascend910_93 | SocFamily::Ascend950)
    }
}

/// What a backend gates on: SoC and CANN version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    /// `aclrtGetSocName()`, e.g. "Ascend910B2".
    pub soc_name: Option<String>,
    pub soc: SocFamily,
    /// `aclsysGetVersionStr("runtime")` (or "cann"/"toolkit"), e.g. "8.0.RC2".
    pub cann_version_string: Option<String>,
    pub cann_version: Option<CannVersion>,
    /// `aclrtGetVersion()`: the AscendCL API version (deprecated call, not the CANN release).
    pub acl_api_version: Option<(i32, i32, i32)>,
    pub device_count: Option<u32>,
    /// Running on the tboost CANN SIMULATOR.
    pub simulator: bool,
}

/// The simulator's counters (see `tboostSimStats` in the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimStats {
    pub device_allocations: i64,
    pub device_bytes: i64,
    pub host_allocations: i64,
    pub live_tensors: i64,
    pub live_scalars: i64,
    pub live_int_arrays: i64,
    pub live_tensor_lists: i64,
    pub live_executors: i64,
    pub live_streams: i64,
    pub live_events: i64,
    pub pending_tasks: i64,
    pub malloc_calls: u64,
    pub op_launches: u64,
    pub ops_run: u64,
    pub sync_calls: u64,
    pub rule_violations: u64,
    /// `aclDestroyAclOpExecutor` on an executor its execute phase had already consumed.
    pub executor_double_frees: u64,
}

impl SimStats {
    /// Nothing outstanding: no allocations, handles, executors, streams, events or queued work.
    pub fn is_clean(&self) -> bool {
        self.device_allocations == 0
            && self.host_allocations == 0
            && self.live_tensors == 0
            && self.live_scalars == 0
            && self.live_int_arrays == 0
            && self.live_tensor_lists == 0
            && self.live_executors == 0
            && self.live_streams == 0
            && self.live_events == 0
            && self.pending_tasks == 0
    }
}

struct DeviceInner {
    cann: Cann,
    id: i32,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Some(f) = self.cann.api().aclrtResetDevice {
            // SAFETY: plain call.
            let rc = unsafe { f(self.id) };
            if rc != 0 {
                log::warn!(
                    "ascend: aclrtResetDevice({}) failed with {rc}: {}",
                    self.id,
                    self.cann.recent_error().unwrap_or_default()
                );
            }
        }
    }
}

/// A device set with `aclrtSetDevice`; reset when the last clone (and every object made on it) is gone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

// SAFETY: the handle holds an id and the library handle; CANN's device calls are thread-safe (the
// current device is per thread: call `make_current` on a new thread).
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    pub fn id(&self) -> i32 {
        self.inner.id
    }
    pub fn cann(&self) -> &Cann {
        &self.inner.cann
    }

    /// Makes this device the calling thread's current one ("aclrtSetDevice sets the compute device in the
    /// current thread"), calling `aclrtSetDevice` only when the thread has another device or none: each
    /// call adds a reference that only `aclrtResetDevice` drops, and CANN releases what is left at
    /// process exit ("no functional error", aclrtResetDevice doc).
    pub fn make_current(&self) -> Result<()> {
        let c = self.cann();
        if let Some(get) = c.api().aclrtGetDevice {
            let mut cur = -1i32;
            // SAFETY: valid out pointer.
            if unsafe { get(&mut cur) } == 0 && cur == self.inner.id {
                return Ok(());
            }
            let _ = c.recent_error(); // "no current device" is the expected answer on a new thread
        }
        let f = call_fn!(c.api().aclrtSetDevice, "aclrtSetDevice", c);
        // SAFETY: plain call.
        c.check("aclrtSetDevice", unsafe { f(self.inner.id) })
    }

    /// `aclrtMalloc(len, ACL_MEM_MALLOC_HUGE_FIRST)`.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(AclError::Invalid("a device buffer needs at least one byte".into()));
        }
        let c = self.cann();
        let f = call_fn!(c.api().aclrtMalloc, "aclrtMalloc", c);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        c.check("aclrtMalloc", unsafe { f(&mut p, len, raw::aclrtMemMallocPolicy_ACL_MEM_MALLOC_HUGE_FIRST) })?;
        match NonNull::new(p) {
            Some(ptr) => Ok(DeviceBuffer { dev: self.clone(), ptr, len }),
            None => Err(AclError::NullHandle { call: "aclrtMalloc", message: String::new() }),
        }
    }

    /// A device buffer holding `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer> {
        let buf = self.alloc(std::mem::size_of_val(data).max(1))?;
        buf.write(0, data)?;
        Ok(buf)
    }

    /// `aclrtMallocHost`: page-locked host memory for asynchronous copies.
    pub fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(AclError::Invalid("a host buffer needs at least one byte".into()));
        }
        let c = self.cann();
        let f = call_fn!(c.api().aclrtMallocHost, "aclrtMallocHost", c);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        c.check("aclrtMallocHost", unsafe { f(&mut p, len) })?;
        match NonNull::new(p) {
            Some(ptr) => Ok(HostBuffer { dev: self.clone(), ptr, len }),
            None => Err(AclError::NullHandle { call: "aclrtMallocHost", message: String::new() }),
        }
    }

    pub fn create_stream(&self) -> Result<Stream> {
        let c = self.cann();
        let f = call_fn!(c.api().aclrtCreateStream, "aclrtCreateStream", c);
        let mut s: raw::aclrtStream = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        c.check("aclrtCreateStream", unsafe { f(&mut s) })?;
        Ok(Stream { dev: self.clone(), raw: s })
    }

    pub fn create_event(&self) -> Result<Event> {
        let c = self.cann();
        let f = call_fn!(c.api().aclrtCreateEvent, "aclrtCreateEvent", c);
        let mut e: raw::aclrtEvent = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        c.check("aclrtCreateEvent", unsafe { f(&mut e) })?;
        Ok(Event { dev: self.clone(), raw: e })
    }

    /// `aclrtSynchronizeDevice`: waits for every stream of the device.
    pub fn synchronize(&self) -> Result<()> {
        let c = self.cann();
        let f = call_fn!(c.api().aclrtSynchronizeDevice, "aclrtSynchronizeDevice", c);
        // SAFETY: plain call.
        c.check("aclrtSynchronizeDevice", unsafe { f() })
    }
}

/// Device memory from `aclrtMalloc`, freed on drop.
pub struct DeviceBuffer {
    dev: Device,
    ptr: NonNull<c_void>,
    len: usize,
}

// SAFETY: an owned device address; CANN's memory calls are thread-safe.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl DeviceBuffer {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address (for raw calls; the buffer keeps owning it).
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr.as_ptr()
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn range(&self, at: usize, n: usize) -> Result<()> {
        if at.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(AclError::Invalid(format!(
                "bytes {at}..{} are outside the {}-byte device buffer",
                at.saturating_add(n),
                self.len
            )));
        }
        Ok(())
    }

    fn memcpy(
        &self,
        dst: *mut c_void,
        dst_max: usize,
        src: *const c_void,
        n: usize,
        kind: raw::aclrtMemcpyKind,
    ) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemcpy, "aclrtMemcpy", c);
        // SAFETY: the callers checked both ranges.
        c.check("aclrtMemcpy", unsafe { f(dst, dst_max, src, n, kind) })
    }

    /// Synchronous host → device copy of `data` to byte `at`. It does not wait for queued work: synchronize
    /// the stream first if an op may still be using these bytes.
    pub fn write<T: Element>(&self, at: usize, data: &[T]) -> Result<()> {
        let bytes = as_bytes(data);
        if bytes.is_empty() {
            return Ok(());
        }
        self.range(at, bytes.len())?;
        // SAFETY: in range (checked).
        let dst = unsafe { self.ptr.as_ptr().cast::<u8>().add(at) }.cast();
        self.memcpy(
            dst,
            self.len - at,
            bytes.as_ptr().cast(),
            bytes.len(),
            raw::aclrtMemcpyKind_ACL_MEMCPY_HOST_TO_DEVICE,
        )
    }

    /// Synchronous device → host copy from byte `at` into `out`. Synchronize the stream first.
    pub fn read<T: Element>(&self, at: usize, out: &mut [T]) -> Result<()> {
        let bytes = as_bytes_mut(out);
        if bytes.is_empty() {
            return Ok(());
        }
        self.range(at, bytes.len())?;
        // SAFETY: in range (checked).
        let src = unsafe { self.ptr.as_ptr().cast::<u8>().add(at) }.cast::<c_void>();
        let n = bytes.len();
        self.memcpy(bytes.as_mut_ptr().cast(), n, src, n, raw::aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_HOST)
    }

    /// `n` elements from byte `at`, as a new vector.
    pub fn to_vec<T: Element>(&self, at: usize, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        self.read(at, &mut v)?;
        Ok(v)
    }

    /// Synchronous device → device copy.
    pub fn copy_from(&self, at: usize, src: &DeviceBuffer, src_at: usize, n: usize) -> Result<()> {
        self.range(at, n)?;
        src.range(src_at, n)?;
        // SAFETY: both in range (checked).
        let (d, s) = unsafe { (self.ptr.as_ptr().cast::<u8>().add(at), src.ptr.as_ptr().cast::<u8>().add(src_at)) };
        self.memcpy(d.cast(), self.len - at, s.cast(), n, raw::aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_DEVICE)
    }

    /// Sets every byte to `value` (`aclrtMemset`).
    pub fn fill_bytes(&self, value: u8) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemset, "aclrtMemset", c);
        // SAFETY: the whole buffer.
        c.check("aclrtMemset", unsafe { f(self.ptr.as_ptr(), self.len, value as i32, self.len) })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let c = self.dev.cann();
        if let Some(f) = c.api().aclrtFree {
            // SAFETY: we own the allocation.
            let rc = unsafe { f(self.ptr.as_ptr()) };
            if rc != 0 {
                log::warn!(
                    "ascend: aclrtFree({:p}) failed with {rc}: {}",
                    self.ptr,
                    c.recent_error().unwrap_or_default()
                );
            }
        }
    }
}

/// Page-locked host memory from `aclrtMallocHost`, freed on drop.
pub struct HostBuffer {
    dev: Device,
    ptr: NonNull<c_void>,
    len: usize,
}

// SAFETY: owned host memory.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr.as_ptr()
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: len bytes owned by us; no copy writes into it unless the caller queued one (unsafe API).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self excludes other Rust access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let c = self.dev.cann();
        if let Some(f) = c.api().aclrtFreeHost {
            // SAFETY: we own it.
            let rc = unsafe { f(self.ptr.as_ptr()) };
            if rc != 0 {
                log::warn!("ascend: aclrtFreeHost failed with {rc}: {}", c.recent_error().unwrap_or_default());
            }
        }
    }
}

/// An `aclrtStream`; synchronized and destroyed on drop.
pub struct Stream {
    dev: Device,
    raw: raw::aclrtStream,
}

// SAFETY: a stream handle may be used from another thread (with the device current there).
unsafe impl Send for Stream {}

impl Stream {
    pub fn as_raw(&self) -> raw::aclrtStream {
        self.raw
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Waits for all work queued on the stream; returns the first failure of that work.
    pub fn synchronize(&self) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtSynchronizeStream, "aclrtSynchronizeStream", c);
        // SAFETY: live stream.
        c.check("aclrtSynchronizeStream", unsafe { f(self.raw) })
    }

    /// Queues a host → device copy.
    ///
    /// # Safety
    /// `src` and `dst` must stay alive and `src` unmodified until the stream is synchronized.
    pub unsafe fn copy_to_device_async(
        &self,
        src: &HostBuffer,
        src_at: usize,
        dst: &DeviceBuffer,
        at: usize,
        n: usize,
    ) -> Result<()> {
        if src_at.checked_add(n).is_none_or(|e| e > src.len) {
            return Err(AclError::Invalid(format!("bytes {src_at}..+{n} outside the {}-byte host buffer", src.len)));
        }
        dst.range(at, n)?;
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemcpyAsync, "aclrtMemcpyAsync", c);
        // SAFETY: ranges checked; lifetime is the caller's contract.
        let (d, s) = unsafe { (dst.as_ptr().cast::<u8>().add(at), src.as_ptr().cast::<u8>().add(src_at)) };
        c.check("aclrtMemcpyAsync", unsafe {
            f(d.cast(), dst.len - at, s.cast(), n, raw::aclrtMemcpyKind_ACL_MEMCPY_HOST_TO_DEVICE, self.raw)
        })
    }

    /// Queues a device → host copy.
    ///
    /// # Safety
    /// `dst` must not be read or written, and both buffers must stay alive, until the stream is synchronized.
    pub unsafe fn copy_to_host_async(
        &self,
        src: &DeviceBuffer,
        at: usize,
        dst: &HostBuffer,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        if dst_at.checked_add(n).is_none_or(|e| e > dst.len) {
            return Err(AclError::Invalid(format!("bytes {dst_at}..+{n} outside the {}-byte host buffer", dst.len)));
        }
        src.range(at, n)?;
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemcpyAsync, "aclrtMemcpyAsync", c);
        // SAFETY: ranges checked; lifetime is the caller's contract.
        let (d, s) = unsafe { (dst.as_ptr().cast::<u8>().add(dst_at), src.as_ptr().cast::<u8>().add(at)) };
        c.check("aclrtMemcpyAsync", unsafe {
            f(d.cast(), dst.len - dst_at, s.cast(), n, raw::aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_HOST, self.raw)
        })
    }

    /// Queues a device → device copy of `n` bytes from byte `src_at` of `src` to byte `at` of `dst`.
    /// Both addresses must be 64-byte aligned ("The source address and destination address passed to
    /// this call must be 64-byte aligned": aclrtMemcpyAsync, CANN API reference aclcppdevg_03_0106).
    ///
    /// # Safety
    /// Both buffers must stay alive until the stream is synchronized.
    pub unsafe fn copy_device_async(
        &self,
        src: &DeviceBuffer,
        src_at: usize,
        dst: &DeviceBuffer,
        at: usize,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        src.range(src_at, n)?;
        dst.range(at, n)?;
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemcpyAsync, "aclrtMemcpyAsync", c);
        // SAFETY: ranges checked; lifetime is the caller's contract.
        let (d, s) = unsafe { (dst.as_ptr().cast::<u8>().add(at), src.as_ptr().cast::<u8>().add(src_at)) };
        c.check("aclrtMemcpyAsync", unsafe {
            f(d.cast(), dst.len - at, s.cast(), n, raw::aclrtMemcpyKind_ACL_MEMCPY_DEVICE_TO_DEVICE, self.raw)
        })
    }

    /// Queues `aclrtMemsetAsync`: bytes `at..at + n` of `dst` are set to `value` in stream order.
    ///
    /// # Safety
    /// `dst` must stay alive until the stream is synchronized.
    pub unsafe fn memset_async(&self, dst: &DeviceBuffer, at: usize, n: usize, value: u8) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        dst.range(at, n)?;
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtMemsetAsync, "aclrtMemsetAsync", c);
        // SAFETY: range checked; lifetime is the caller's contract.
        let d = unsafe { dst.as_ptr().cast::<u8>().add(at) };
        c.check("aclrtMemsetAsync", unsafe { f(d.cast(), dst.len - at, value as i32, n, self.raw) })
    }

    /// Work queued after this waits until `event` (recorded on another stream) has completed.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtStreamWaitEvent, "aclrtStreamWaitEvent", c);
        // SAFETY: live handles.
        c.check("aclrtStreamWaitEvent", unsafe { f(self.raw, event.raw) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let c = self.dev.cann().clone();
        if let Err(e) = self.synchronize() {
            log::warn!("ascend: stream synchronize before destroy failed: {e}");
        }
        if let Some(f) = c.api().aclrtDestroyStream {
            // SAFETY: live stream, synchronized.
            let rc = unsafe { f(self.raw) };
            if rc != 0 {
                log::warn!("ascend: aclrtDestroyStream failed with {rc}: {}", c.recent_error().unwrap_or_default());
            }
        }
    }
}

/// An `aclrtEvent`, destroyed on drop.
pub struct Event {
    dev: Device,
    raw: raw::aclrtEvent,
}

// SAFETY: an event handle may move between threads.
unsafe impl Send for Event {}

impl Event {
    /// Marks the current end of `stream`'s queue.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtRecordEvent, "aclrtRecordEvent", c);
        // SAFETY: live handles.
        c.check("aclrtRecordEvent", unsafe { f(self.raw, stream.raw) })
    }

    /// Waits until the work queued before the last `record` has completed.
    pub fn synchronize(&self) -> Result<()> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtSynchronizeEvent, "aclrtSynchronizeEvent", c);
        // SAFETY: live event.
        c.check("aclrtSynchronizeEvent", unsafe { f(self.raw) })
    }

    /// `aclrtEventElapsedTime(ms, start, self)`: milliseconds between `start`'s last record and this
    /// event's, both completed (synchronize first).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        let c = self.dev.cann();
        let f = call_fn!(c.api().aclrtEventElapsedTime, "aclrtEventElapsedTime", c);
        let mut ms = 0f32;
        // SAFETY: live events, valid out pointer.
        c.check("aclrtEventElapsedTime", unsafe { f(&mut ms, start.raw, self.raw) })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let c = self.dev.cann();
        if let Some(f) = c.api().aclrtDestroyEvent {
            // SAFETY: owned event.
            let rc = unsafe { f(self.raw) };
            if rc != 0 {
                log::warn!("ascend: aclrtDestroyEvent failed with {rc}: {}", c.recent_error().unwrap_or_default());
            }
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.inner.id)
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:p})", self.raw)
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({:p})", self.raw)
    }
}
