/*
 * ascend-sim core.c -- CANN SIMULATOR, part of the simulated libascendcl.so: AscendCL runtime
 * (init, devices, streams, events, memory, copies, versions, recent error message), the shared state of
 * all three simulated libraries (object registries, counters, fault injection) and the deferred task
 * queue that runs launched ops at synchronize time. Not CANN: see ascend-sim/README.md.
 */
#define _GNU_SOURCE
#include "sim.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ state */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
#define LOCK() pthread_mutex_lock(&g_lock)
#define UNLOCK() pthread_mutex_unlock(&g_lock)

typedef struct {
    const char *op;
    char name[128];
    int64_t at;
    int status;
    int execPhase;
    /* -1: any device; else only calls made with this device current (a fault on one rank) */
    int device;
    int64_t calls;
} OpFault;

typedef struct {
    int loaded;
    char soc[64];
    char cannVersion[128];
    int cannVersionSet; /* 0: env var set to "" -> aclsysGetVersionStr fails */
    int apiMajor, apiMinor, apiPatch;
    uint32_t deviceCount;
    uint64_t memBytes;
    int64_t failMallocAt;
    int64_t failSyncAt;
    int failSyncStatus;
    OpFault faults[16];
    int nfaults;
    int log;
} Config;
static Config g_cfg;

static int64_t env_int(const char *name, int64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || !end || *end) {
        fprintf(stderr, SIM_TAG " ignoring %s=%s: not an integer\n", name, v);
        return dflt;
    }
    return (int64_t)x;
}

static void parse_faults(const char *spec) {
    /* op:n:status[:exec][@device][,op:n:status...]; with @device only that device's calls count */
    g_cfg.nfaults = 0;
    if (!spec || !*spec) return;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item && g_cfg.nfaults < 16; item = strtok_r(NULL, ",", &save)) {
        OpFault *f = &g_cfg.faults[g_cfg.nfaults];
        memset(f, 0, sizeof *f);
        char phase[16] = {0};
        long long at = 0, status = 0;
        f->device = -1;
        char *dev = strchr(item, '@');
        if (dev) {
            *dev = 0;
            f->device = atoi(dev + 1);
        }
        int n = sscanf(item, "%127[^:]:%lld:%lld:%15s", f->name, &at, &status, phase);
        if (n < 3 || at < 1) {
            fprintf(stderr, SIM_TAG " ignoring TBOOST_SIM_FAIL_OP item '%s': expected op:call:status[:exec][@device]\n",
                    item);
            continue;
        }
        f->at = at;
        f->status = (int)status;
        f->execPhase = (n == 4 && strcmp(phase, "exec") == 0);
        g_cfg.nfaults++;
    }
}

static void load_config(void) {
    const char *soc = getenv("TBOOST_SIM_SOC");
    snprintf(g_cfg.soc, sizeof g_cfg.soc, "%s", soc && *soc ? soc : "Ascend910B2");
    const char *ver = getenv("TBOOST_SIM_CANN_VERSION");
    g_cfg.cannVersionSet = !(ver && !*ver);
    snprintf(g_cfg.cannVersion, sizeof g_cfg.cannVersion, "%s", ver && *ver ? ver : "8.1.RC1");
    const char *api = getenv("TBOOST_SIM_ACL_API_VERSION");
    g_cfg.apiMajor = 1, g_cfg.apiMinor = 12, g_cfg.apiPatch = 0;
    if (api && *api && sscanf(api, "%d.%d.%d", &g_cfg.apiMajor, &g_cfg.apiMinor, &g_cfg.apiPatch) != 3)
        fprintf(stderr, SIM_TAG " ignoring TBOOST_SIM_ACL_API_VERSION=%s: expected A.B.C\n", api);
    g_cfg.deviceCount = (uint32_t)env_int("TBOOST_SIM_DEVICE_COUNT", 1);
    g_cfg.memBytes = (uint64_t)env_int("TBOOST_SIM_MEM_BYTES", (int64_t)64 << 30);
    g_cfg.failMallocAt = env_int("TBOOST_SIM_FAIL_MALLOC_AT", 0);
    g_cfg.failSyncAt = env_int("TBOOST_SIM_FAIL_SYNC_AT", 0);
    g_cfg.failSyncStatus = (int)env_int("TBOOST_SIM_FAIL_SYNC_STATUS", ACL_ERROR_RT_FAILURE);
    parse_faults(getenv("TBOOST_SIM_FAIL_OP"));
    g_cfg.log = (int)env_int("TBOOST_SIM_LOG", 0);
    g_cfg.loaded = 1;
}
static Config *cfg(void) {
    if (!g_cfg.loaded) load_config();
    return &g_cfg;
}

static tboostSimStats g_stats;

/* ------------------------------------------------------------------ errors, log */

static _Thread_local char t_err[2048];
static _Thread_local char t_errOut[2048];

SIM_API void tboostSimInternal_setError(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(t_err, sizeof t_err, SIM_TAG " ");
    vsnprintf(t_err + n, sizeof t_err - (size_t)n, fmt, ap);
    va_end(ap);
    if (cfg()->log) fprintf(stderr, "%s\n", t_err);
}

SIM_API void tboostSimInternal_log(const char *fmt, ...) {
    if (!cfg()->log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, SIM_TAG " ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

/* Returns the last message set on this thread and clears it (NULL when there is none). */
const char *aclGetRecentErrMsg(void) {
    if (!t_err[0]) return NULL;
    memcpy(t_errOut, t_err, sizeof t_errOut);
    t_err[0] = 0;
    return t_errOut;
}

/* ------------------------------------------------------------------ config queries */

SIM_API SimSocFamily tboostSimInternal_socFamily(void) {
    const char *s = cfg()->soc;
    if (strncmp(s, "Ascend910_93", 12) == 0) return SIM_SOC_910_93;
    if (strcmp(s, "Ascend910B") == 0 || strncmp(s, "Ascend910A", 10) == 0 || strncmp(s, "Ascend910ProA", 13) == 0)
        return SIM_SOC_910A;
    if (strncmp(s, "Ascend910B", 10) == 0) return SIM_SOC_910B;
    if (strncmp(s, "Ascend310P", 10) == 0) return SIM_SOC_310P;
    if (strncmp(s, "Ascend310B", 10) == 0) return SIM_SOC_310B;
    if (strncmp(s, "Ascend950", 9) == 0) return SIM_SOC_950;
    return SIM_SOC_OTHER;
}
SIM_API const char *tboostSimInternal_socName(void) { return cfg()->soc; }

/* ------------------------------------------------------------------ generic pointer sets */

typedef struct {
    const void **items;
    size_t n, cap;
} PtrSet;

static void ps_add(PtrSet *s, const void *p) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        const void **items = realloc(s->items, cap * sizeof *items);
        if (!items) abort(); /* host out of memory: nothing sensible to return */
        s->items = items, s->cap = cap;
    }
    s->items[s->n++] = p;
}
static int ps_find(const PtrSet *s, const void *p) {
    for (size_t i = s->n; i-- > 0;)
        if (s->items[i] == p) return (int)i;
    return -1;
}
static int ps_remove(PtrSet *s, const void *p) {
    int i = ps_find(s, p);
    if (i < 0) return 0;
    s->items[i] = s->items[--s->n];
    return 1;
}

static PtrSet g_objs[SIM_OBJ_KINDS];
static int64_t *live_counter(SimObjKind k) {
    switch (k) {
    case SIM_OBJ_TENSOR: return &g_stats.liveTensors;
    case SIM_OBJ_SCALAR: return &g_stats.liveScalars;
    case SIM_OBJ_INTARRAY: return &g_stats.liveIntArrays;
    case SIM_OBJ_TLIST: return &g_stats.liveTensorLists;
    default: return &g_stats.liveExecutors;
    }
}
SIM_API void tboostSimInternal_register(SimObjKind kind, const void *obj) {
    LOCK();
    ps_add(&g_objs[kind], obj);
    (*live_counter(kind))++;
    UNLOCK();
}
SIM_API int tboostSimInternal_unregister(SimObjKind kind, const void *obj) {
    LOCK();
    int ok = ps_remove(&g_objs[kind], obj);
    if (ok) (*live_counter(kind))--;
    UNLOCK();
    return ok;
}
SIM_API int tboostSimInternal_isLive(SimObjKind kind, const void *obj) {
    LOCK();
    int live = ps_find(&g_objs[kind], obj) >= 0;
    UNLOCK();
    return live;
}

/* ------------------------------------------------------------------ memory registry */

typedef struct {
    char *base;
    uint64_t size;
    int64_t id;
    int host;   /* aclrtMallocHost */
    int device; /* the thread's current device at aclrtMalloc (-1 for host memory) */
} Alloc;
static Alloc *g_allocs;
static size_t g_nallocs, g_capallocs;
static int64_t g_nextAllocId = 1;

static int64_t find_alloc_locked(const void *ptr, uint64_t bytes, int host) {
    const char *p = ptr;
    for (size_t i = 0; i < g_nallocs; i++) {
        Alloc *a = &g_allocs[i];
        if (a->host != host) continue;
        if (p >= a->base && p <= a->base + a->size && bytes <= (uint64_t)(a->base + a->size - p)) return a->id;
    }
    return -1;
}
static int alloc_live_locked(int64_t id) {
    for (size_t i = 0; i < g_nallocs; i++)
        if (g_allocs[i].id == id) return 1;
    return 0;
}
SIM_API int64_t tboostSimInternal_findAlloc(const void *ptr, uint64_t bytes) {
    LOCK();
    int64_t id = find_alloc_locked(ptr, bytes, 0);
    UNLOCK();
    return id;
}
static _Thread_local int32_t t_device = -1;
static int64_t add_alloc_locked(char *base, uint64_t size, int host) {
    if (g_nallocs == g_capallocs) {
        size_t cap = g_capallocs ? g_capallocs * 2 : 64;
        Alloc *a = realloc(g_allocs, cap * sizeof *a);
        if (!a) abort();
        g_allocs = a, g_capallocs = cap;
    }
    Alloc *a = &g_allocs[g_nallocs++];
    a->base = base, a->size = size, a->id = g_nextAllocId++, a->host = host;
    a->device = host ? -1 : t_device;
    return a->id;
}
static int remove_alloc_locked(void *base, int host, uint64_t *sizeOut) {
    for (size_t i = 0; i < g_nallocs; i++) {
        if (g_allocs[i].base == base && g_allocs[i].host == host) {
            *sizeOut = g_allocs[i].size;
            g_allocs[i] = g_allocs[--g_nallocs];
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ init, devices */

static int g_inited, g_finalized;
/* aclrtSetDevice "sets the compute device in the current thread" (CANN runtime API reference,
 * aclcppdevg_03_0038): the current device is per thread; each SetDevice adds a reference to the device
 * that aclrtResetDevice drops (aclcppdevg_03_0040). */
#define SIM_MAX_DEVICES 64
SIM_API int32_t tboostSimInternal_currentDevice(void) { return t_device; }
static int64_t g_deviceRefs[SIM_MAX_DEVICES];

aclError aclInit(const char *configPath) {
    (void)configPath;
    LOCK();
    if (g_inited || g_finalized) {
        UNLOCK();
        sim_error("aclInit: the process is already %s; aclInit can be called only once in a process",
                  g_finalized ? "finalized" : "initialized");
        return ACL_ERROR_REPEAT_INITIALIZE;
    }
    load_config();
    g_inited = 1;
    UNLOCK();
    sim_log("aclInit: SoC %s, CANN %s (this is a SIMULATOR, not CANN)", g_cfg.soc, g_cfg.cannVersion);
    return ACL_SUCCESS;
}

static int require_init(const char *fn) {
    if (g_inited) return 1;
    sim_error("%s: AscendCL is %s", fn, g_finalized ? "finalized" : "not initialized: call aclInit first");
    return 0;
}
#define REQUIRE_INIT(fn)                                        \
    do {                                                        \
        if (!require_init(fn)) return ACL_ERROR_UNINITIALIZE; \
    } while (0)
#define REQUIRE_DEVICE(fn)                                                              \
    do {                                                                                \
        REQUIRE_INIT(fn);                                                               \
        if (t_device < 0) {                                                             \
            sim_error("%s: this thread has no current device (context is null): call "  \
                      "aclrtSetDevice on this thread first", fn);                      \
            return ACL_ERROR_RT_CONTEXT_NULL;                                           \
        }                                                                               \
    } while (0)

aclError aclFinalize(void) {
    if (g_finalized) {
        sim_error("aclFinalize: already finalized");
        return ACL_ERROR_REPEAT_FINALIZE;
    }
    REQUIRE_INIT("aclFinalize");
    LOCK();
    g_inited = 0;
    g_finalized = 1;
    tboostSimStats s = g_stats;
    UNLOCK();
    fprintf(stderr,
            SIM_TAG " aclFinalize: outstanding %lld device allocations (%lld bytes), %lld host allocations, "
                    "%lld executors, %lld tensors, %lld int arrays, %lld tensor lists, %lld scalars, %lld streams, "
                    "%lld events, %lld pending tasks; %llu ops launched, %llu run, %llu rule violations, %llu executor "
                    "double frees\n",
            (long long)s.deviceAllocations, (long long)s.deviceBytes, (long long)s.hostAllocations,
            (long long)s.liveExecutors, (long long)s.liveTensors, (long long)s.liveIntArrays,
            (long long)s.liveTensorLists, (long long)s.liveScalars, (long long)s.liveStreams, (long long)s.liveEvents,
            (long long)s.pendingTasks, (unsigned long long)s.opLaunches, (unsigned long long)s.opsRun,
            (unsigned long long)s.ruleViolations, (unsigned long long)s.executorDoubleFrees);
    return ACL_SUCCESS;
}

const char *aclrtGetSocName(void) {
    if (!g_inited) return NULL;
    return cfg()->soc;
}

aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    if (!pkgName || !versionStr) {
        sim_error("aclsysGetVersionStr: pkgName and versionStr must not be NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!cfg()->cannVersionSet) {
        sim_error("aclsysGetVersionStr: no version.info for package '%s' (TBOOST_SIM_CANN_VERSION is empty)",
                  pkgName);
        return ACL_ERROR_INVALID_FILE;
    }
    size_t n = strnlen(cfg()->cannVersion, (size_t)ACL_PKG_VERSION_MAX_SIZE - 1);
    memcpy(versionStr, cfg()->cannVersion, n);
    versionStr[n] = 0;
    return ACL_SUCCESS;
}

aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion) {
    if (!majorVersion || !minorVersion || !patchVersion) {
        sim_error("aclrtGetVersion: NULL output pointer");
        return ACL_ERROR_INVALID_PARAM;
    }
    *majorVersion = cfg()->apiMajor, *minorVersion = cfg()->apiMinor, *patchVersion = cfg()->apiPatch;
    return ACL_SUCCESS;
}

aclError aclrtGetDeviceCount(uint32_t *count) {
    REQUIRE_INIT("aclrtGetDeviceCount");
    if (!count) return ACL_ERROR_INVALID_PARAM;
    *count = cfg()->deviceCount;
    return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t deviceId) {
    REQUIRE_INIT("aclrtSetDevice");
    if (deviceId < 0 || (uint32_t)deviceId >= cfg()->deviceCount) {
        sim_error("aclrtSetDevice: device %d does not exist (%u simulated devices, TBOOST_SIM_DEVICE_COUNT)", deviceId,
                  cfg()->deviceCount);
        return ACL_ERROR_INVALID_DEVICE;
    }
    if (deviceId >= SIM_MAX_DEVICES) {
        sim_error("aclrtSetDevice: the SIMULATOR has at most %d devices", SIM_MAX_DEVICES);
        return ACL_ERROR_INVALID_DEVICE;
    }
    LOCK();
    g_deviceRefs[deviceId]++;
    UNLOCK();
    t_device = deviceId;
    return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t *deviceId) {
    REQUIRE_INIT("aclrtGetDevice");
    if (!deviceId) {
        sim_error("aclrtGetDevice: deviceId is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (t_device < 0) {
        sim_error("aclrtGetDevice: this thread has no current device (context is null)");
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    *deviceId = t_device;
    return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) {
    REQUIRE_INIT("aclrtResetDevice");
    LOCK();
    if (deviceId < 0 || deviceId >= SIM_MAX_DEVICES || g_deviceRefs[deviceId] == 0) {
        UNLOCK();
        sim_error("aclrtResetDevice: device %d was not set (no aclrtSetDevice reference left)", deviceId);
        return ACL_ERROR_INVALID_DEVICE;
    }
    g_deviceRefs[deviceId]--;
    UNLOCK();
    if (t_device == deviceId) t_device = -1;
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------ memory */

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    REQUIRE_DEVICE("aclrtMalloc");
    if (!devPtr || size == 0) {
        sim_error("aclrtMalloc: devPtr must not be NULL and size must be > 0 (size %zu)", size);
        return ACL_ERROR_INVALID_PARAM;
    }
    if ((int)policy < 0 || (int)policy > 7) {
        sim_error("aclrtMalloc: unknown policy %d", (int)policy);
        return ACL_ERROR_INVALID_PARAM;
    }
    LOCK();
    g_stats.mallocCalls++;
    uint64_t call = g_stats.mallocCalls;
    if (cfg()->failMallocAt > 0 && (int64_t)call == cfg()->failMallocAt) {
        UNLOCK();
        sim_error("aclrtMalloc: fault injection: call #%llu fails (TBOOST_SIM_FAIL_MALLOC_AT=%lld)",
                  (unsigned long long)call, (long long)cfg()->failMallocAt);
        return ACL_ERROR_BAD_ALLOC;
    }
    if ((uint64_t)g_stats.deviceBytes + size > cfg()->memBytes) {
        UNLOCK();
        sim_error("aclrtMalloc: out of device memory: %zu bytes requested, %lld of %llu in use (TBOOST_SIM_MEM_BYTES)",
                  size, (long long)g_stats.deviceBytes, (unsigned long long)cfg()->memBytes);
        return ACL_ERROR_BAD_ALLOC;
    }
    /* "real alloc size is aligned to 32 bytes and padded with 32 bytes" */
    size_t real = ((size + 31) / 32) * 32 + 32;
    void *p = NULL;
    if (posix_memalign(&p, 64, real) != 0) {
        UNLOCK();
        sim_error("aclrtMalloc: host allocation of %zu bytes failed", real);
        return ACL_ERROR_BAD_ALLOC;
    }
    memset(p, 0xA5, real); /* fresh device memory is garbage, not zeros */
    add_alloc_locked(p, size, 0);
    g_stats.deviceAllocations++;
    g_stats.deviceBytes += (int64_t)size;
    UNLOCK();
    *devPtr = p;
    return ACL_SUCCESS;
}

aclError aclrtFree(void *devPtr) {
    REQUIRE_DEVICE("aclrtFree");
    uint64_t size = 0;
    LOCK();
    int ok = devPtr && remove_alloc_locked(devPtr, 0, &size);
    if (ok) {
        g_stats.deviceAllocations--;
        g_stats.deviceBytes -= (int64_t)size;
    }
    UNLOCK();
    if (!ok) {
        sim_error("aclrtFree: %p is not a live aclrtMalloc block (double free or foreign pointer)", devPtr);
        return ACL_ERROR_INVALID_PARAM;
    }
    free(devPtr);
    return ACL_SUCCESS;
}

aclError aclrtMallocHost(void **hostPtr, size_t size) {
    REQUIRE_INIT("aclrtMallocHost");
    if (!hostPtr || size == 0) {
        sim_error("aclrtMallocHost: hostPtr must not be NULL and size must be > 0");
        return ACL_ERROR_INVALID_PARAM;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, size) != 0) return ACL_ERROR_BAD_ALLOC;
    LOCK();
    add_alloc_locked(p, size, 1);
    g_stats.hostAllocations++;
    UNLOCK();
    *hostPtr = p;
    return ACL_SUCCESS;
}

aclError aclrtFreeHost(void *hostPtr) {
    REQUIRE_INIT("aclrtFreeHost");
    uint64_t size = 0;
    LOCK();
    int ok = hostPtr && remove_alloc_locked(hostPtr, 1, &size);
    if (ok) g_stats.hostAllocations--;
    UNLOCK();
    if (!ok) {
        sim_error("aclrtFreeHost: %p is not a live aclrtMallocHost block", hostPtr);
        return ACL_ERROR_INVALID_PARAM;
    }
    free(hostPtr);
    return ACL_SUCCESS;
}

/* Checks a copy's pointers against the memory kinds; fills the allocation ids (-1: plain host memory). */
static aclError check_copy(const char *fn, void *dst, size_t destMax, const void *src, size_t count,
                           aclrtMemcpyKind kind, int async, int64_t *dstId, int64_t *srcId) {
    if (!dst || !src) {
        sim_error("%s: NULL pointer (dst %p, src %p)", fn, dst, src);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (count > destMax) {
        sim_error("%s: count %zu exceeds destMax %zu", fn, count, destMax);
        return ACL_ERROR_INVALID_PARAM;
    }
    int dstDev, srcDev;
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: dstDev = 0, srcDev = 0; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: dstDev = 1, srcDev = 0; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: dstDev = 0, srcDev = 1; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: dstDev = 1, srcDev = 1; break;
    default: sim_error("%s: memcpy kind %d is not simulated (use HOST_TO_DEVICE etc.)", fn, (int)kind);
        return ACL_ERROR_INVALID_PARAM;
    }
    LOCK();
    int64_t d = find_alloc_locked(dst, count, 0), s = find_alloc_locked(src, count, 0);
    int64_t dh = find_alloc_locked(dst, count, 1), sh = find_alloc_locked(src, count, 1);
    UNLOCK();
    if (dstDev && d < 0) {
        sim_error("%s: dst %p..+%zu is not inside one live device allocation", fn, dst, count);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (srcDev && s < 0) {
        sim_error("%s: src %p..+%zu is not inside one live device allocation", fn, src, count);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!dstDev && d >= 0) {
        sim_error("%s: dst %p is device memory but the copy kind says host", fn, dst);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!srcDev && s >= 0) {
        sim_error("%s: src %p is device memory but the copy kind says host", fn, src);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (async && ((!dstDev && dh < 0) || (!srcDev && sh < 0))) {
        sim_error("%s: the host side of an asynchronous copy must be aclrtMallocHost memory (SIMULATOR rule: it "
                  "must stay valid until the stream is synchronized)",
                  fn);
        return ACL_ERROR_INVALID_PARAM;
    }
    *dstId = dstDev ? d : dh;
    *srcId = srcDev ? s : sh;
    return ACL_SUCCESS;
}

aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind) {
    REQUIRE_DEVICE("aclrtMemcpy");
    int64_t d, s;
    aclError rc = check_copy("aclrtMemcpy", dst, destMax, src, count, kind, 0, &d, &s);
    if (rc) return rc;
    memmove(dst, src, count);
    return ACL_SUCCESS;
}

aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    REQUIRE_DEVICE("aclrtMemset");
    if (count > maxCount || tboostSimInternal_findAlloc(devPtr, count) < 0) {
        sim_error("aclrtMemset: %p..+%zu is not inside one live device allocation (or count > maxCount %zu)", devPtr,
                  count, maxCount);
        return ACL_ERROR_INVALID_PARAM;
    }
    memset(devPtr, value, count);
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------ streams, tasks, events */

typedef enum { TASK_OP, TASK_COPY, TASK_EVENT, TASK_WAIT, TASK_MEMSET, TASK_HOST } TaskKind;
typedef struct SimStream SimStream;
typedef struct SimEvent SimEvent;
typedef struct {
    TaskKind kind;
    aclOpExecutor *exec;
    void *ws;
    uint64_t wsSize;
    int64_t wsId;
    void *dst;
    const void *src;
    size_t count;
    int64_t dstId, srcId;
    SimEvent *event;
    uint64_t eventSeq;
    int value; /* TASK_MEMSET */
    SimHostTaskFn hostFn; /* TASK_HOST */
    void *hostArg;
} Task;

struct SimStream {
    uint32_t magic;
    Task *tasks;
    size_t head, n, cap;
    int error;
    char errMsg[1024];
    int running;
    int device; /* the device current when it was created (-1: the default stream) */
};
struct SimEvent {
    uint32_t magic;
    SimStream *stream; /* where it was last recorded */
    uint64_t seq;      /* record count */
    uint64_t doneSeq;  /* last record that has run */
    double doneMs;     /* host monotonic clock when that record ran (what aclrtEventElapsedTime compares) */
};
#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u

static PtrSet g_streams, g_events;
static SimStream g_defaultStream = {STREAM_MAGIC, NULL, 0, 0, 0, 0, {0}, 0, -1};

static SimStream *stream_of(aclrtStream s) {
    if (!s) return &g_defaultStream;
    if (ps_find(&g_streams, s) < 0) return NULL;
    return (SimStream *)s;
}

aclError aclrtCreateStream(aclrtStream *stream) {
    REQUIRE_DEVICE("aclrtCreateStream");
    if (!stream) return ACL_ERROR_INVALID_PARAM;
    SimStream *s = calloc(1, sizeof *s);
    if (!s) return ACL_ERROR_BAD_ALLOC;
    s->magic = STREAM_MAGIC;
    s->device = t_device;
    LOCK();
    ps_add(&g_streams, s);
    g_stats.liveStreams++;
    UNLOCK();
    *stream = s;
    return ACL_SUCCESS;
}

static void push_task(SimStream *s, Task t) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 32;
        Task *tasks = realloc(s->tasks, cap * sizeof *tasks);
        if (!tasks) abort();
        s->tasks = tasks, s->cap = cap;
    }
    s->tasks[s->n++] = t;
    g_stats.pendingTasks++;
}

static void stream_fail(SimStream *s, const char *msg) {
    if (!s->error) {
        s->error = ACL_ERROR_RT_FAILURE;
        snprintf(s->errMsg, sizeof s->errMsg, "%s", msg);
    }
}

static void free_exec_locked(aclOpExecutor *e) {
    if (ps_remove(&g_objs[SIM_OBJ_EXEC], e)) g_stats.liveExecutors--;
    if (e->freeParams) e->freeParams(e->params);
    free(e->params);
    e->magic = 0;
    free(e);
}

/* Consumed non-repeatable executors: remembered so a second launch gets a precise message. */
static PtrSet g_consumed;

static void run_stream_locked(SimStream *s, size_t until);

/* Host monotonic time in ms: the SIMULATOR's "device time" is the host time its tasks take when a synchronize
 * runs them. */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void run_task_locked(SimStream *s, Task *t) {
    char msg[1024];
    switch (t->kind) {
    case TASK_OP: {
        aclOpExecutor *e = t->exec;
        int ok = 1;
        for (int i = 0; i < e->ntensors && ok; i++) {
            if (e->tensors[i].allocId > 0 && !alloc_live_locked(e->tensors[i].allocId)) {
                snprintf(msg, sizeof msg,
                         SIM_TAG " %s: tensor #%d (%p) was freed before the stream ran the op (free after "
                                 "synchronize, not after launch)",
                         e->op, i, e->tensors[i].data);
                stream_fail(s, msg);
                g_stats.ruleViolations++;
                ok = 0;
            }
        }
        if (ok && t->wsSize > 0 && !alloc_live_locked(t->wsId)) {
            snprintf(msg, sizeof msg, SIM_TAG " %s: the workspace %p was freed before the stream ran the op", e->op,
                     t->ws);
            stream_fail(s, msg);
            g_stats.ruleViolations++;
            ok = 0;
        }
        if (ok) {
            if (t->wsSize > 0) memset(t->ws, 0x5A, t->wsSize); /* the op owns its workspace: clobber it */
            UNLOCK();
            aclnnStatus st = e->run((SimExec *)e, t->ws, t->wsSize);
            LOCK();
            g_stats.opsRun++;
            if (st != ACLNN_SUCCESS) {
                const char *m = aclGetRecentErrMsg();
                snprintf(msg, sizeof msg, "%s (op status %d)", m ? m : "op failed", st);
                stream_fail(s, msg);
            }
        }
        e->pending--;
        if ((!e->repeatable || e->destroyed) && e->pending == 0) {
            if (!e->repeatable) {
                if (g_consumed.n >= 4096) g_consumed.n = 0; /* keep the set small: only recent ones matter */
                ps_add(&g_consumed, e);
            }
            free_exec_locked(e);
        }
        break;
    }
    case TASK_COPY:
        if ((t->dstId > 0 && !alloc_live_locked(t->dstId)) || (t->srcId > 0 && !alloc_live_locked(t->srcId))) {
            snprintf(msg, sizeof msg, SIM_TAG " aclrtMemcpyAsync: a buffer of the copy %p <- %p was freed before the "
                                              "stream ran it", t->dst, t->src);
            stream_fail(s, msg);
            g_stats.ruleViolations++;
        } else {
            memmove(t->dst, t->src, t->count);
        }
        break;
    case TASK_EVENT:
        if (t->event->doneSeq < t->eventSeq) {
            t->event->doneSeq = t->eventSeq;
            t->event->doneMs = now_ms();
        }
        break;
    case TASK_MEMSET:
        if (t->dstId > 0 && !alloc_live_locked(t->dstId)) {
            snprintf(msg, sizeof msg, SIM_TAG " aclrtMemsetAsync: the buffer %p was freed before the stream ran the memset",
                     t->dst);
            stream_fail(s, msg);
            g_stats.ruleViolations++;
        } else {
            memset(t->dst, t->value, t->count);
        }
        break;
    case TASK_HOST: {
        /* a library's own stream task (libhccl's collectives): it may block on other threads' streams, so it
         * runs without the lock, like an op */
        msg[0] = 0;
        UNLOCK();
        int rc = t->hostFn(t->hostArg, 1, msg, sizeof msg);
        LOCK();
        if (rc) stream_fail(s, msg[0] ? msg : SIM_TAG " a stream task failed");
        break;
    }
    case TASK_WAIT: {
        SimEvent *ev = t->event;
        if (ev->stream && ev->stream != s && ev->doneSeq < t->eventSeq) {
            SimStream *o = ev->stream;
            /* run the other stream up to that record */
            size_t until = o->head;
            for (size_t i = o->head; i < o->n; i++) {
                until = i + 1;
                if (o->tasks[i].kind == TASK_EVENT && o->tasks[i].event == ev && o->tasks[i].eventSeq >= t->eventSeq)
                    break;
            }
            run_stream_locked(o, until);
        }
        break;
    }
    }
}

static void run_stream_locked(SimStream *s, size_t until) {
    if (s->running) return; /* a wait cycle: nothing more to do */
    s->running = 1;
    while (s->head < until && s->head < s->n) {
        Task t = s->tasks[s->head++];
        g_stats.pendingTasks--;
        run_task_locked(s, &t);
    }
    if (s->head == s->n) s->head = s->n = 0;
    s->running = 0;
}

static aclError finish_sync(SimStream *s, const char *fn) {
    g_stats.syncCalls++;
    uint64_t call = g_stats.syncCalls;
    int err = s->error;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", s->errMsg);
    s->error = 0;
    s->errMsg[0] = 0;
    if (err) {
        UNLOCK();
        sim_error("%s: a task failed: %s", fn, msg + (strncmp(msg, SIM_TAG " ", strlen(SIM_TAG) + 1) == 0
                                                          ? strlen(SIM_TAG) + 1
                                                          : 0));
        return err;
    }
    if (cfg()->failSyncAt > 0 && (int64_t)call == cfg()->failSyncAt) {
        UNLOCK();
        sim_error("%s: fault injection: synchronize call #%llu fails with %d (TBOOST_SIM_FAIL_SYNC_AT=%lld)", fn,
                  (unsigned long long)call, cfg()->failSyncStatus, (long long)cfg()->failSyncAt);
        return cfg()->failSyncStatus;
    }
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
    REQUIRE_DEVICE("aclrtSynchronizeStream");
    LOCK();
    SimStream *s = stream_of(stream);
    if (!s) {
        UNLOCK();
        sim_error("aclrtSynchronizeStream: %p is not a live stream", stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    run_stream_locked(s, s->n);
    return finish_sync(s, "aclrtSynchronizeStream");
}

aclError aclrtSynchronizeDevice(void) {
    REQUIRE_DEVICE("aclrtSynchronizeDevice");
    LOCK();
    /* "blocks until the device finishes all preceding tasks": the streams of the thread's current device (a
     * rank thread of another simulated device must not run its streams, which may wait in a collective) */
    for (size_t i = 0; i < g_streams.n; i++) {
        SimStream *s = (SimStream *)g_streams.items[i];
        if (s->device == t_device) run_stream_locked(s, s->n);
    }
    run_stream_locked(&g_defaultStream, g_defaultStream.n);
    SimStream *failed = &g_defaultStream;
    for (size_t i = 0; i < g_streams.n; i++) {
        SimStream *s = (SimStream *)g_streams.items[i];
        if (s->device == t_device && s->error) {
            failed = s;
            break;
        }
    }
    return finish_sync(failed, "aclrtSynchronizeDevice");
}

aclError aclrtDestroyStream(aclrtStream stream) {
    REQUIRE_DEVICE("aclrtDestroyStream");
    LOCK();
    SimStream *s = stream ? stream_of(stream) : NULL;
    if (!s) {
        UNLOCK();
        sim_error("aclrtDestroyStream: %p is not a live stream", stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (s->n > s->head) {
        size_t pending = s->n - s->head;
        g_stats.ruleViolations++;
        UNLOCK();
        sim_error("aclrtDestroyStream: %zu tasks are still queued: call aclrtSynchronizeStream first", pending);
        return ACL_ERROR_INVALID_PARAM;
    }
    ps_remove(&g_streams, s);
    g_stats.liveStreams--;
    for (size_t i = 0; i < g_events.n; i++) {
        SimEvent *ev = (SimEvent *)g_events.items[i];
        if (ev->stream == s) ev->stream = NULL;
    }
    UNLOCK();
    s->magic = 0;
    free(s->tasks);
    free(s);
    return ACL_SUCCESS;
}

aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
    REQUIRE_DEVICE("aclrtMemcpyAsync");
    Task t;
    memset(&t, 0, sizeof t);
    aclError rc = check_copy("aclrtMemcpyAsync", dst, destMax, src, count, kind, 1, &t.dstId, &t.srcId);
    if (rc) return rc;
    /* "The source address and destination address passed to this call must be 64-byte aligned."
     * (aclrtMemcpyAsync, CANN 8.0.0 API reference aclcppdevg_03_0106). Enforced for on-chip copies, the
     * ones tboost issues between its own buffers. */
    if (kind == ACL_MEMCPY_DEVICE_TO_DEVICE && (((uintptr_t)dst % 64) || ((uintptr_t)src % 64))) {
        LOCK();
        g_stats.ruleViolations++;
        UNLOCK();
        sim_error("aclrtMemcpyAsync: device-to-device copy %p <- %p: both addresses must be 64-byte aligned", dst, src);
        return ACL_ERROR_INVALID_PARAM;
    }
    LOCK();
    SimStream *s = stream_of(stream);
    if (!s) {
        UNLOCK();
        sim_error("aclrtMemcpyAsync: %p is not a live stream", stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    t.kind = TASK_COPY, t.dst = dst, t.src = src, t.count = count;
    push_task(s, t);
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream) {
    REQUIRE_DEVICE("aclrtMemsetAsync");
    int64_t id = tboostSimInternal_findAlloc(devPtr, count);
    if (count > maxCount || id < 0) {
        sim_error("aclrtMemsetAsync: %p..+%zu is not inside one live device allocation (or count > maxCount %zu)",
                  devPtr, count, maxCount);
        return ACL_ERROR_INVALID_PARAM;
    }
    LOCK();
    SimStream *s = stream_of(stream);
    if (!s) {
        UNLOCK();
        sim_error("aclrtMemsetAsync: %p is not a live stream", stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    Task t;
    memset(&t, 0, sizeof t);
    t.kind = TASK_MEMSET, t.dst = devPtr, t.count = count, t.value = value, t.dstId = id, t.srcId = -1;
    push_task(s, t);
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtCreateEvent(aclrtEvent *event) {
    REQUIRE_DEVICE("aclrtCreateEvent");
    if (!event) return ACL_ERROR_INVALID_PARAM;
    SimEvent *ev = calloc(1, sizeof *ev);
    if (!ev) return ACL_ERROR_BAD_ALLOC;
    ev->magic = EVENT_MAGIC;
    LOCK();
    ps_add(&g_events, ev);
    g_stats.liveEvents++;
    UNLOCK();
    *event = ev;
    return ACL_SUCCESS;
}

aclError aclrtDestroyEvent(aclrtEvent event) {
    REQUIRE_DEVICE("aclrtDestroyEvent");
    LOCK();
    if (!event || !ps_remove(&g_events, event)) {
        UNLOCK();
        sim_error("aclrtDestroyEvent: %p is not a live event", event);
        return ACL_ERROR_INVALID_PARAM;
    }
    g_stats.liveEvents--;
    /* a queued record of this event would dangle: drop those tasks */
    for (size_t i = 0; i < g_streams.n; i++) {
        SimStream *s = (SimStream *)g_streams.items[i];
        for (size_t j = s->head; j < s->n; j++)
            if ((s->tasks[j].kind == TASK_EVENT || s->tasks[j].kind == TASK_WAIT) && s->tasks[j].event == event)
                s->tasks[j].kind = TASK_COPY, s->tasks[j].count = 0, s->tasks[j].dstId = s->tasks[j].srcId = -1;
    }
    UNLOCK();
    ((SimEvent *)event)->magic = 0;
    free(event);
    return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    REQUIRE_DEVICE("aclrtRecordEvent");
    LOCK();
    SimStream *s = stream_of(stream);
    if (!event || ps_find(&g_events, event) < 0 || !s) {
        UNLOCK();
        sim_error("aclrtRecordEvent: event %p or stream %p is not live", event, stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    SimEvent *ev = event;
    ev->stream = s;
    ev->seq++;
    Task t;
    memset(&t, 0, sizeof t);
    t.kind = TASK_EVENT, t.event = ev, t.eventSeq = ev->seq;
    push_task(s, t);
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    REQUIRE_DEVICE("aclrtStreamWaitEvent");
    LOCK();
    SimStream *s = stream_of(stream);
    if (!event || ps_find(&g_events, event) < 0 || !s) {
        UNLOCK();
        sim_error("aclrtStreamWaitEvent: event %p or stream %p is not live", event, stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    SimEvent *ev = event;
    Task t;
    memset(&t, 0, sizeof t);
    t.kind = TASK_WAIT, t.event = ev, t.eventSeq = ev->seq;
    push_task(s, t);
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent) {
    REQUIRE_INIT("aclrtEventElapsedTime");
    LOCK();
    if (!ms || !startEvent || !endEvent || ps_find(&g_events, startEvent) < 0 || ps_find(&g_events, endEvent) < 0) {
        UNLOCK();
        sim_error("aclrtEventElapsedTime: ms %p, start %p and end %p must be non-NULL and live events", (void *)ms,
                  startEvent, endEvent);
        return ACL_ERROR_INVALID_PARAM;
    }
    const SimEvent *a = startEvent, *b = endEvent;
    if (a->seq == 0 || b->seq == 0 || a->doneSeq < a->seq || b->doneSeq < b->seq) {
        UNLOCK();
        sim_error("aclrtEventElapsedTime: both events must be recorded and completed (synchronize first)");
        return ACL_ERROR_INVALID_PARAM;
    }
    *ms = (float)(b->doneMs - a->doneMs);
    UNLOCK();
    return ACL_SUCCESS;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
    REQUIRE_DEVICE("aclrtSynchronizeEvent");
    LOCK();
    if (!event || ps_find(&g_events, event) < 0) {
        UNLOCK();
        sim_error("aclrtSynchronizeEvent: %p is not a live event", event);
        return ACL_ERROR_INVALID_PARAM;
    }
    SimEvent *ev = event;
    SimStream *s = ev->stream;
    if (!s) { /* never recorded: nothing to wait for */
        UNLOCK();
        return ACL_SUCCESS;
    }
    size_t until = s->head;
    for (size_t i = s->head; i < s->n; i++) {
        until = i + 1;
        if (s->tasks[i].kind == TASK_EVENT && s->tasks[i].event == ev && s->tasks[i].eventSeq == ev->seq) break;
    }
    run_stream_locked(s, until);
    return finish_sync(s, "aclrtSynchronizeEvent");
}

/* ------------------------------------------------------------------ executors */

SIM_API aclnnStatus tboostSimInternal_opFault(const char *op, int execPhase) {
    LOCK();
    Config *c = cfg();
    int hit = -1;
    /* every matching item counts this call, so "op:2:..,op:4:.." fires at the 2nd and at the 4th call */
    for (int i = 0; i < c->nfaults; i++) {
        OpFault *f = &c->faults[i];
        if (f->execPhase != execPhase || strcmp(f->name, op) != 0) continue;
        if (f->device >= 0 && f->device != t_device) continue;
        f->calls++;
        if (f->calls == f->at && hit < 0) hit = i;
    }
    if (hit < 0) {
        UNLOCK();
        return ACLNN_SUCCESS;
    }
    int st = c->faults[hit].status;
    long long at = (long long)c->faults[hit].at;
    UNLOCK();
    sim_error("%s%s: fault injection: call #%lld on device %d returns %d (TBOOST_SIM_FAIL_OP)", op,
              execPhase ? "" : "GetWorkspaceSize", at, (int)t_device, st);
    return st;
}

SIM_API SimExec *tboostSimInternal_execNew(const char *op, SimRunFn run, size_t paramsSize) {
    aclOpExecutor *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->magic = SIM_MAGIC_EXEC;
    e->op = op;
    e->run = run;
    e->params = calloc(1, paramsSize ? paramsSize : 1);
    if (!e->params) {
        free(e);
        return NULL;
    }
    return (SimExec *)e;
}

SIM_API void tboostSimInternal_execAbort(SimExec *se) {
    if (!se) return;
    aclOpExecutor *e = &se->x;
    if (e->freeParams) e->freeParams(e->params);
    free(e->params);
    free(e);
}

SIM_API aclnnStatus tboostSimInternal_execFinish(SimExec *se, uint64_t workspaceSize, uint64_t *workspaceSizeOut,
                                                 aclOpExecutor **executorOut) {
    aclOpExecutor *e = &se->x;
    e->workspaceSize = workspaceSize;
    *workspaceSizeOut = workspaceSize;
    LOCK();
    ps_add(&g_objs[SIM_OBJ_EXEC], e);
    g_stats.liveExecutors++;
    ps_remove(&g_consumed, e); /* a new executor may reuse the address of a consumed one */
    UNLOCK();
    *executorOut = e;
    return ACLNN_SUCCESS;
}

/* The execute phase consumes a one-shot executor whatever it returns: opbase's CommonOpExecutorRun
 * (hicann/opbase src/nnopbase/composite_op/aclnn_engine/op_executor.cpp) deletes a non-repeatable
 * executor after Run() returned, success or not, and DeleteExecutorForError deletes any executor (even a
 * repeatable one) when workspaceSize > 0 comes with a NULL workspace. Only a repeatable executor is left
 * for aclDestroyAclOpExecutor. */
static void consume_locked(aclOpExecutor *e, int evenRepeatable) {
    if (e->repeatable && !evenRepeatable) return;
    if (e->pending > 0) { /* queued launches of a repeatable executor: released when they ran */
        e->destroyed = 1;
        e->repeatable = 0;
        return;
    }
    if (g_consumed.n >= 4096) g_consumed.n = 0;
    ps_add(&g_consumed, e);
    free_exec_locked(e);
}

/* Fails the launch of a live executor: it is consumed as CANN would, then the message is set. */
#define LAUNCH_FAIL(code, evenRepeatable, ...) \
    do {                                       \
        consume_locked(e, (evenRepeatable));   \
        UNLOCK();                              \
        sim_error(__VA_ARGS__);                \
        return (code);                         \
    } while (0)

SIM_API aclnnStatus tboostSimInternal_launch(const char *op, void *workspace, uint64_t workspaceSize,
                                             aclOpExecutor *e, aclrtStream stream) {
    if (!e) {
        sim_error("%s: executor is NULL", op);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    LOCK();
    if (ps_find(&g_objs[SIM_OBJ_EXEC], e) < 0) {
        int consumed = ps_find(&g_consumed, e) >= 0;
        g_stats.ruleViolations++;
        UNLOCK();
        if (consumed)
            sim_error("%s: executor %p already ran (or failed) and was released; call "
                      "aclSetAclOpExecutorRepeatable before the first launch to run it again",
                      op, (void *)e);
        else
            sim_error("%s: executor %p was not returned by %sGetWorkspaceSize (or was destroyed): run the first "
                      "phase before the second",
                      op, (void *)e, op);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (e->destroyed || (!e->repeatable && e->launches > 0)) {
        g_stats.ruleViolations++;
        UNLOCK();
        sim_error("%s: executor %p was already launched; it is not repeatable (aclSetAclOpExecutorRepeatable)", op,
                  (void *)e);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (workspaceSize > 0 && !workspace)
        LAUNCH_FAIL(ACLNN_ERR_PARAM_NULLPTR, 1, "%s: the workspace is NULL with workspaceSize %llu (the executor is "
                    "deleted)", op, (unsigned long long)workspaceSize);
    if (strcmp(e->op, op) != 0) {
        g_stats.ruleViolations++;
        LAUNCH_FAIL(ACLNN_ERR_PARAM_INVALID, 0, "%s: executor %p belongs to %s", op, (void *)e, e->op);
    }
    if (workspaceSize < e->workspaceSize) {
        g_stats.ruleViolations++;
        LAUNCH_FAIL(ACLNN_ERR_PARAM_INVALID, 0, "%s: workspaceSize %llu is smaller than the %llu bytes "
                    "GetWorkspaceSize asked for", op, (unsigned long long)workspaceSize,
                    (unsigned long long)e->workspaceSize);
    }
    int64_t wsId = -1;
    if (e->workspaceSize > 0) {
        wsId = workspace ? find_alloc_locked(workspace, workspaceSize, 0) : -1;
        if (wsId < 0) {
            g_stats.ruleViolations++;
            LAUNCH_FAIL(ACLNN_ERR_PARAM_INVALID, 0, "%s: workspace %p..+%llu is not inside one live device "
                        "allocation", op, workspace, (unsigned long long)workspaceSize);
        }
    }
    if (t_device < 0)
        LAUNCH_FAIL(ACL_ERROR_RT_CONTEXT_NULL, 0, "%s: this thread has no current device (context is null): call "
                    "aclrtSetDevice on this thread first", op);
    SimStream *s = stream_of(stream);
    if (!s) LAUNCH_FAIL(ACLNN_ERR_PARAM_INVALID, 0, "%s: stream %p is not a live stream", op, stream);
    UNLOCK();
    aclnnStatus fault = tboostSimInternal_opFault(op, 1);
    LOCK();
    if (fault) {
        consume_locked(e, 0);
        UNLOCK();
        return fault; /* the message is set by opFault */
    }
    e->launches++;
    e->pending++;
    g_stats.opLaunches++;
    Task t;
    memset(&t, 0, sizeof t);
    t.kind = TASK_OP, t.exec = e, t.ws = workspace, t.wsSize = e->workspaceSize ? workspaceSize : 0, t.wsId = wsId;
    push_task(s, t);
    UNLOCK();
    return ACLNN_SUCCESS;
}

SIM_API aclnnStatus tboostSimInternal_setRepeatable(aclOpExecutor *e) {
    LOCK();
    if (!e || ps_find(&g_objs[SIM_OBJ_EXEC], e) < 0) {
        UNLOCK();
        sim_error("aclSetAclOpExecutorRepeatable: %p is not a live executor", (void *)e);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (e->launches > 0) {
        UNLOCK();
        sim_error("aclSetAclOpExecutorRepeatable: executor %p (%s) was already launched", (void *)e, e->op);
        return ACLNN_ERR_PARAM_INVALID;
    }
    e->repeatable = 1;
    UNLOCK();
    return ACLNN_SUCCESS;
}

SIM_API aclnnStatus tboostSimInternal_destroyExec(aclOpExecutor *e) {
    LOCK();
    if (e && ps_find(&g_objs[SIM_OBJ_EXEC], e) < 0 && ps_find(&g_consumed, e) >= 0) {
        g_stats.ruleViolations++;
        g_stats.executorDoubleFrees++;
        UNLOCK();
        sim_error("aclDestroyAclOpExecutor: executor %p was already deleted by its execute phase (a one-shot "
                  "executor is consumed whatever the execute returned): double free",
                  (void *)e);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (!e || ps_find(&g_objs[SIM_OBJ_EXEC], e) < 0 || e->destroyed) {
        g_stats.ruleViolations++;
        UNLOCK();
        sim_error("aclDestroyAclOpExecutor: %p is not a live executor (a non-repeatable executor is released by "
                  "its launch)",
                  (void *)e);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (e->pending > 0) {
        /* still queued: released when the stream runs it; record the misuse */
        e->destroyed = 1;
        g_stats.ruleViolations++;
        UNLOCK();
        sim_error("aclDestroyAclOpExecutor: executor %p (%s) still has %d queued launches: synchronize first",
                  (void *)e, e->op, e->pending);
        return ACLNN_ERR_PARAM_INVALID;
    }
    free_exec_locked(e);
    UNLOCK();
    return ACLNN_SUCCESS;
}

/* ------------------------------------------------------------------ hooks for the other simulated libraries */

SIM_API int32_t tboostSimInternal_allocDevice(const void *ptr, uint64_t bytes, int64_t *allocId) {
    LOCK();
    int32_t dev = -2;
    const char *p = ptr;
    for (size_t i = 0; i < g_nallocs; i++) {
        Alloc *a = &g_allocs[i];
        if (p >= a->base && p <= a->base + a->size && bytes <= (uint64_t)(a->base + a->size - p)) {
            dev = a->device;
            if (allocId) *allocId = a->id;
            break;
        }
    }
    UNLOCK();
    return dev;
}

SIM_API void tboostSimInternal_countViolation(void) {
    LOCK();
    g_stats.ruleViolations++;
    UNLOCK();
}

SIM_API int tboostSimInternal_allocLive(int64_t allocId) {
    LOCK();
    int live = alloc_live_locked(allocId);
    UNLOCK();
    return live;
}

SIM_API int32_t tboostSimInternal_streamDevice(aclrtStream stream) {
    LOCK();
    SimStream *s = stream_of(stream);
    int32_t dev = s ? s->device : -2;
    UNLOCK();
    return dev;
}

SIM_API int tboostSimInternal_pushHostTask(aclrtStream stream, SimHostTaskFn fn, void *arg) {
    LOCK();
    SimStream *s = stream_of(stream);
    if (!s) {
        UNLOCK();
        return 0;
    }
    Task t;
    memset(&t, 0, sizeof t);
    t.kind = TASK_HOST, t.hostFn = fn, t.hostArg = arg, t.dstId = -1, t.srcId = -1;
    push_task(s, t);
    UNLOCK();
    return 1;
}

/* ------------------------------------------------------------------ stats */

aclError tboostSimGetStats(tboostSimStats *stats) {
    if (!stats || stats->structSize != sizeof(tboostSimStats)) {
        sim_error("tboostSimGetStats: structSize must be %zu", sizeof(tboostSimStats));
        return ACL_ERROR_INVALID_PARAM;
    }
    LOCK();
    *stats = g_stats;
    stats->structSize = sizeof(tboostSimStats);
    UNLOCK();
    return ACL_SUCCESS;
}
