/*
 * ascend-sim hccl.c -- CANN SIMULATOR, the simulated libhccl.so: communicators between simulated devices and
 * the collectives AllReduce, AllGather, Broadcast and Barrier done in host memory when every rank's stream
 * reaches them. HcclCommInitAll's ranks are threads of ONE process (one thread per rank, each with its own
 * aclrtSetDevice) and meet here; HcclCommInitRootInfo's may be threads or separate processes of this machine
 * (one per NPU) and meet in shared memory (hccl_shm.c). Not HCCL: no NPU, no HCCS/RoCE link, no ring or mesh
 * algorithm, no real timing, no second machine. See ascend-sim/README.md.
 *
 * A collective call checks its arguments at once (the errors HCCL returns from the call) and queues a task
 * on the rank's stream. The task runs when that stream is synchronized: it deposits its buffers and waits
 * for the same collective (the rank's n-th on the communicator) of every other rank, at most
 * HCCL_EXEC_TIMEOUT seconds; the ranks' arguments must agree, and the result goes into every rank's receive
 * buffer. A failure fails the stream (the synchronize returns 500003 with the message), and a timeout or a
 * disagreement breaks the communicator: every later collective on it fails at once.
 *
 * Environment (read at the first HCCL call):
 *   HCCL_EXEC_TIMEOUT     seconds a collective waits for the other ranks (real HCCL's variable; default 1836,
 *                         HCCL's documented default; the SIMULATOR also takes fractions, e.g. 0.5)
 *   HCCL_CONNECT_TIMEOUT  seconds HcclCommInitRootInfo waits for the other ranks (default 120, as HCCL)
 *   TBOOST_SIM_HCCL_FAULT SIMULATOR-ONLY fault injection, comma-separated KIND@N:RANK: the N-th collective
 *                         (1-based, counted per communicator) of rank RANK either never arrives (timeout: its
 *                         task blocks until the others time out, then fails) or fails at once without arriving
 *                         (fail); e.g. timeout@3:1
 */
#define _GNU_SOURCE
#include "hccl_internal.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#define COMM_MAGIC 0x4843434cu /* "HCCL" */
#define ROOT_MAGIC "tboost-ascend-sim-hccl-root"



typedef struct Group Group;
typedef struct SimComm {
    uint32_t magic;
    Group *g;
    uint32_t rank;
    int32_t device;
    uint64_t enqueued; /* collectives queued so far: the next one's sequence number - 1 */
    int pending;       /* queued, not yet run (under g->mu) */
    int destroyed;
    ShmGroup *shm; /* HcclCommInitRootInfo's ranks meet there (hccl_shm.c); NULL: HcclCommInitAll's, in g */
} SimComm;

struct Group {
    char key[96];
    uint32_t n, joined;
    SimComm **ranks;
    Arrival *arr;
    uint64_t done; /* sequence number of the last completed collective */
    int broken;
    char why[768];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Group *next;
};

static pthread_mutex_t g_regMu = PTHREAD_MUTEX_INITIALIZER;
static Group *g_groups;
static SimComm **g_comms; /* every comm ever made (destroyed ones stay, marked): a pointer is recognised */
static size_t g_ncomms, g_capcomms;
static uint64_t g_rootCounter;

typedef struct {
    int kind; /* 1 timeout, 2 fail */
    uint64_t at;
    uint32_t rank;
} Fault;
static struct {
    int loaded;
    double execTimeout, connectTimeout;
    Fault faults[16];
    int nfaults;
} g_hc;

static double env_seconds(const char *name, double dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end = NULL;
    double d = strtod(v, &end);
    return (end && *end == 0 && d > 0) ? d : dflt;
}

static void hc_load(void) {
    pthread_mutex_lock(&g_regMu);
    if (!g_hc.loaded) {
        /* HCCL_EXEC_TIMEOUT: default 1836 s (HCCL environment variable reference); HCCL_CONNECT_TIMEOUT 120 s */
        g_hc.execTimeout = env_seconds("HCCL_EXEC_TIMEOUT", 1836);
        g_hc.connectTimeout = env_seconds("HCCL_CONNECT_TIMEOUT", 120);
        const char *f = getenv("TBOOST_SIM_HCCL_FAULT");
        while (f && *f && g_hc.nfaults < 16) {
            Fault x = {0, 0, 0};
            unsigned long long at = 0;
            unsigned rank = 0;
            if (sscanf(f, "timeout@%llu:%u", &at, &rank) == 2) x.kind = 1;
            else if (sscanf(f, "fail@%llu:%u", &at, &rank) == 2) x.kind = 2;
            if (x.kind) {
                x.at = at, x.rank = rank;
                g_hc.faults[g_hc.nfaults++] = x;
            } else {
                fprintf(stderr, HCCL_TAG " TBOOST_SIM_HCCL_FAULT: ignoring '%s' (want timeout@N:RANK or fail@N:RANK)\n",
                        f);
            }
            f = strchr(f, ',');
            if (f) f++;
        }
        g_hc.loaded = 1;
    }
    pthread_mutex_unlock(&g_regMu);
}

static int fault_of(uint32_t rank, uint64_t seq) {
    for (int i = 0; i < g_hc.nfaults; i++)
        if (g_hc.faults[i].rank == rank && g_hc.faults[i].at == seq) return g_hc.faults[i].kind;
    return 0;
}

/* HCCL keeps its own last-error text; the SIMULATOR puts it where aclGetRecentErrMsg() finds it too. */
#define hccl_fail(code, ...)                                                                                 \
    do {                                                                                                   \
        sim_error("HCCL " __VA_ARGS__);                                                                    \
        return (code);                                                                                     \
    } while (0)

static int comm_known(const SimComm *c) {
    int found = 0;
    pthread_mutex_lock(&g_regMu);
    for (size_t i = 0; i < g_ncomms && !found; i++) found = g_comms[i] == c;
    pthread_mutex_unlock(&g_regMu);
    return found;
}

static SimComm *comm_new(Group *g, uint32_t rank, int32_t device) {
    SimComm *c = calloc(1, sizeof *c);
    if (!c) abort();
    c->magic = COMM_MAGIC, c->g = g, c->rank = rank, c->device = device;
    /* under g_regMu */
    if (g_ncomms == g_capcomms) {
        size_t cap = g_capcomms ? g_capcomms * 2 : 16;
        SimComm **a = realloc(g_comms, cap * sizeof *a);
        if (!a) abort();
        g_comms = a, g_capcomms = cap;
    }
    g_comms[g_ncomms++] = c;
    return c;
}

static Group *group_new(const char *key, uint32_t n) {
    Group *g = calloc(1, sizeof *g);
    if (!g) abort();
    snprintf(g->key, sizeof g->key, "%s", key);
    g->n = n;
    g->ranks = calloc(n, sizeof *g->ranks);
    g->arr = calloc(n, sizeof *g->arr);
    if (!g->ranks || !g->arr) abort();
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->next = g_groups;
    g_groups = g;
    return g;
}


/* ------------------------------------------------------------------ communicators */

const char *HcclGetErrorString(HcclResult code) {
    switch (code) {
    case HCCL_SUCCESS: return "HCCL_SUCCESS: success";
    case HCCL_E_PARA: return "HCCL_E_PARA: parameter error";
    case HCCL_E_PTR: return "HCCL_E_PTR: empty or invalid pointer";
    case HCCL_E_MEMORY: return "HCCL_E_MEMORY: memory error";
    case HCCL_E_INTERNAL: return "HCCL_E_INTERNAL: internal error";
    case HCCL_E_NOT_SUPPORT: return "HCCL_E_NOT_SUPPORT: not supported";
    case HCCL_E_NOT_FOUND: return "HCCL_E_NOT_FOUND: not found";
    case HCCL_E_UNAVAIL: return "HCCL_E_UNAVAIL: resource unavailable";
    case HCCL_E_SYSCALL: return "HCCL_E_SYSCALL: system call error";
    case HCCL_E_TIMEOUT: return "HCCL_E_TIMEOUT: timeout";
    case HCCL_E_OPEN_FILE_FAILURE: return "HCCL_E_OPEN_FILE_FAILURE: cannot open a file";
    case HCCL_E_TCP_CONNECT: return "HCCL_E_TCP_CONNECT: TCP connection failed";
    case HCCL_E_ROCE_CONNECT: return "HCCL_E_ROCE_CONNECT: RoCE connection failed";
    case HCCL_E_RUNTIME: return "HCCL_E_RUNTIME: runtime call failed";
    case HCCL_E_OOM: return "HCCL_E_OOM: out of memory";
    }
    return "unknown HcclResult";
}

HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo) {
    hc_load();
    if (!rootInfo) hccl_fail(HCCL_E_PTR, "HcclGetRootInfo: rootInfo is NULL");
    /* HCCL: "the device must be specified (aclrtSetDevice) before a communicator is created" -- the root rank
     * runs on its device too */
    if (tboostSimInternal_currentDevice() < 0)
        hccl_fail(HCCL_E_RUNTIME, "HcclGetRootInfo: this thread has no current device: call aclrtSetDevice first");
    memset(rootInfo, 0, sizeof *rootInfo);
    pthread_mutex_lock(&g_regMu);
    uint64_t id = ++g_rootCounter;
    pthread_mutex_unlock(&g_regMu);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    /* the other ranks may be other processes: the name is unique on this machine (pid, counter, time) */
    snprintf(rootInfo->internal, sizeof rootInfo->internal, "%s:%d:%llu:%lld%09ld", ROOT_MAGIC, (int)getpid(),
             (unsigned long long)id, (long long)now.tv_sec, now.tv_nsec);
    return HCCL_SUCCESS;
}

HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm) {
    hc_load();
    if (!rootInfo || !comm) hccl_fail(HCCL_E_PTR, "HcclCommInitRootInfo: rootInfo and comm must not be NULL");
    int32_t dev = tboostSimInternal_currentDevice();
    /* the communicator is bound to the thread's current device: set it first (aclrtSetDevice) */
    if (dev < 0)
        hccl_fail(HCCL_E_RUNTIME, "HcclCommInitRootInfo: this thread has no current device: call aclrtSetDevice first");
    if (nRanks == 0 || rank >= nRanks)
        hccl_fail(HCCL_E_PARA, "HcclCommInitRootInfo: rank %u is not below nRanks %u", rank, nRanks);
    char key[96];
    snprintf(key, sizeof key, "%.*s", (int)sizeof key - 1, rootInfo->internal);
    if (strncmp(key, ROOT_MAGIC ":", strlen(ROOT_MAGIC) + 1) != 0)
        hccl_fail(HCCL_E_PARA, "HcclCommInitRootInfo: rootInfo was not made by HcclGetRootInfo");
    /* the ranks may be threads of this process or other processes (one per NPU): they meet in shared memory */
    HcclResult code;
    char why[512];
    ShmGroup *shm = tboostSimHccl_shmJoin(key, nRanks, rank, dev, g_hc.connectTimeout, &code, why, sizeof why);
    if (!shm) hccl_fail(code, "HcclCommInitRootInfo (rank %u): %s", rank, why);
    pthread_mutex_lock(&g_regMu);
    char local[96];
    snprintf(local, sizeof local, "rootinfo:%llu", (unsigned long long)++g_rootCounter);
    Group *g = group_new(local, nRanks);
    SimComm *c = comm_new(g, rank, dev);
    c->shm = shm;
    g->ranks[rank] = c;
    g->joined = nRanks;
    pthread_mutex_unlock(&g_regMu);
    *comm = c;
    sim_log("HcclCommInitRootInfo: rank %u of %u on device %d (SIMULATOR, pid %d)", rank, nRanks, dev, (int)getpid());
    return HCCL_SUCCESS;
}

HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms) {
    hc_load();
    if (!devices || !comms) hccl_fail(HCCL_E_PTR, "HcclCommInitAll: devices and comms must not be NULL");
    if (ndev == 0) hccl_fail(HCCL_E_PARA, "HcclCommInitAll: ndev must be at least 1");
    uint32_t count = 0;
    if (aclrtGetDeviceCount(&count) != ACL_SUCCESS)
        hccl_fail(HCCL_E_RUNTIME, "HcclCommInitAll: aclrtGetDeviceCount failed (is AscendCL initialized?)");
    for (uint32_t i = 0; i < ndev; i++) {
        if (devices[i] < 0 || (uint32_t)devices[i] >= count)
            hccl_fail(HCCL_E_PARA, "HcclCommInitAll: devices[%u] = %d does not exist (%u devices)", i, devices[i],
                      count);
        for (uint32_t j = 0; j < i; j++)
            if (devices[j] == devices[i]) {
                tboostSimInternal_countViolation();
                hccl_fail(HCCL_E_PARA, "HcclCommInitAll: device %d is listed twice (one rank per device)", devices[i]);
            }
    }
    pthread_mutex_lock(&g_regMu);
    char key[96];
    snprintf(key, sizeof key, "initall:%llu", (unsigned long long)++g_rootCounter);
    Group *g = group_new(key, ndev);
    for (uint32_t i = 0; i < ndev; i++) {
        g->ranks[i] = comm_new(g, i, devices[i]);
        comms[i] = g->ranks[i];
    }
    g->joined = ndev;
    pthread_mutex_unlock(&g_regMu);
    return HCCL_SUCCESS;
}

static HcclResult live_comm(const char *fn, HcclComm comm, SimComm **out) {
    SimComm *c = comm;
    if (!c) hccl_fail(HCCL_E_PTR, "%s: comm is NULL", fn);
    if (!comm_known(c) || c->magic != COMM_MAGIC) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s: %p is not a communicator HcclCommInit* made", fn, comm);
    }
    if (c->destroyed) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s: the communicator (rank %u) was destroyed (HcclCommDestroy)", fn, c->rank);
    }
    *out = c;
    return HCCL_SUCCESS;
}

HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize) {
    SimComm *c;
    HcclResult rc = live_comm("HcclGetRankSize", comm, &c);
    if (rc) return rc;
    if (!rankSize) hccl_fail(HCCL_E_PTR, "HcclGetRankSize: rankSize is NULL");
    *rankSize = c->g->n;
    return HCCL_SUCCESS;
}

/* "commName: the communication domain name, at most COMM_NAME_MAX_LENGTH (128) bytes" (HcclGetCommName,
 * HCCL API reference): the name fused MC2 ops take as `group`. The simulator names each communicator
 * by its group and rank. */
HcclResult HcclGetCommName(HcclComm comm, char *commName) {
    SimComm *c;
    HcclResult rc = live_comm("HcclGetCommName", comm, &c);
    if (rc) return rc;
    if (!commName) hccl_fail(HCCL_E_PTR, "HcclGetCommName: commName is NULL");
    snprintf(commName, 128, "sim-hccl-%p-rank%u", (void *)c, c->rank);
    return HCCL_SUCCESS;
}

/* The live communicator HcclGetCommName named `name`, or NULL (for the simulated MC2 ops). */
SIM_API HcclComm tboostSimInternal_hcclByName(const char *name) {
    HcclComm found = NULL;
    char buf[128];
    pthread_mutex_lock(&g_regMu);
    for (size_t i = 0; i < g_ncomms && !found; i++) {
        SimComm *c = g_comms[i];
        if (c->destroyed) continue;
        snprintf(buf, sizeof buf, "sim-hccl-%p-rank%u", (void *)c, c->rank);
        if (name && strcmp(buf, name) == 0) found = c;
    }
    pthread_mutex_unlock(&g_regMu);
    return found;
}

/* Ranks of a live communicator (0 when `comm` is not one), for the simulated MC2 ops' rank rules. */
SIM_API uint32_t tboostSimInternal_hcclRanks(HcclComm comm) {
    SimComm *c = comm;
    return c && comm_known(c) && !c->destroyed ? c->g->n : 0;
}

HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank) {
    SimComm *c;
    HcclResult rc = live_comm("HcclGetRankId", comm, &c);
    if (rc) return rc;
    if (!rank) hccl_fail(HCCL_E_PTR, "HcclGetRankId: rank is NULL");
    *rank = c->rank;
    return HCCL_SUCCESS;
}

HcclResult HcclCommDestroy(HcclComm comm) {
    SimComm *c = comm;
    if (c && comm_known(c) && c->magic == COMM_MAGIC && c->destroyed) {
        /* a communicator is destroyed once: a second HcclCommDestroy would free freed memory in HCCL */
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "HcclCommDestroy: the communicator (rank %u) was already destroyed", c->rank);
    }
    HcclResult rc = live_comm("HcclCommDestroy", comm, &c);
    if (rc) return rc;
    pthread_mutex_lock(&c->g->mu);
    int pending = c->pending;
    if (pending == 0) c->destroyed = 1;
    pthread_mutex_unlock(&c->g->mu);
    if (pending == 0) {
        tboostSimHccl_shmLeave(c->shm);
        c->shm = NULL;
    }
    if (pending) {
        /* the queued tasks still use the communicator: synchronize the stream first */
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "HcclCommDestroy: %d collectives of rank %u are still queued on a stream: synchronize it "
                               "first", pending, c->rank);
    }
    return HCCL_SUCCESS;
}

/* ------------------------------------------------------------------ collectives */





typedef struct {
    SimComm *c;
    uint64_t seq;
    Arrival a;
} CollTask;

/* The last rank to arrive: check agreement, compute. Under g->mu. Returns 0 or writes why into msg. */
static int compute_locked(Group *g, const Arrival *me, uint32_t meRank, char *msg, size_t msgSize) {
    for (uint32_t r = 0; r < g->n; r++) {
        const Arrival *a = &g->arr[r];
        /* "The ranks must have the same count, dataType, and op." (HcclAllReduce, CANN 8.0.0 HCCL API reference,
         * hcclcpp_07_0021; the same constraint for AllGather's sendCount/dataType and Broadcast's root) */
        if (a->kind != me->kind || a->count != me->count || a->dtype != me->dtype ||
            (me->kind == COLL_ALLREDUCE && a->op != me->op) || (me->kind == COLL_BROADCAST && a->root != me->root)) {
            snprintf(msg, msgSize,
                     "collective #%llu: rank %u called %s(count %llu, %s, op %d, root %u) but rank %u called "
                     "%s(count %llu, %s, op %d, root %u): the ranks must have the same count, dataType and op",
                     (unsigned long long)me->seq, r, coll_name(a->kind), (unsigned long long)a->count, hname(a->dtype),
                     (int)a->op, a->root, meRank, coll_name(me->kind), (unsigned long long)me->count,
                     hname(me->dtype), (int)me->op, me->root);
            tboostSimInternal_countViolation();
            return 1;
        }
        if ((a->sendId > 0 && !tboostSimInternal_allocLive(a->sendId)) ||
            (a->recvId > 0 && !tboostSimInternal_allocLive(a->recvId))) {
            snprintf(msg, msgSize, "%s #%llu: a buffer of rank %u was freed before the stream ran the collective",
                     coll_name(me->kind), (unsigned long long)me->seq, r);
            tboostSimInternal_countViolation();
            return 1;
        }
    }
    size_t es = hsize(me->dtype);
    uint64_t n = me->count;
    switch (me->kind) {
    case COLL_ALLREDUCE: {
        char *tmp = malloc(n * es + 1);
        if (!tmp) abort();
        for (uint64_t i = 0; i < n; i++) {
            double acc = load(me->dtype, g->arr[0].send, i);
            for (uint32_t r = 1; r < g->n; r++) {
                double v = load(me->dtype, g->arr[r].send, i);
                switch (me->op) {
                case HCCL_REDUCE_SUM: acc += v; break;
                case HCCL_REDUCE_PROD: acc *= v; break;
                case HCCL_REDUCE_MAX: acc = v > acc ? v : acc; break;
                case HCCL_REDUCE_MIN: acc = v < acc ? v : acc; break;
                }
            }
            store(me->dtype, tmp, i, acc);
        }
        for (uint32_t r = 0; r < g->n; r++) memcpy(g->arr[r].recv, tmp, n * es);
        free(tmp);
        break;
    }
    case COLL_ALLGATHER: {
        char *tmp = malloc(g->n * n * es + 1);
        if (!tmp) abort();
        for (uint32_t r = 0; r < g->n; r++) memcpy(tmp + r * n * es, g->arr[r].send, n * es);
        for (uint32_t r = 0; r < g->n; r++) memcpy(g->arr[r].recv, tmp, g->n * n * es);
        free(tmp);
        break;
    }
    case COLL_BROADCAST:
        for (uint32_t r = 0; r < g->n; r++)
            if (r != me->root) memcpy(g->arr[r].send, g->arr[me->root].send, n * es);
        break;
    case COLL_BARRIER: break;
    }
    return 0;
}

static int run_collective(void *arg, int run, char *msg, size_t msgSize) {
    CollTask *t = arg;
    SimComm *c = t->c;
    Group *g = c->g;
    const char *name = coll_name(t->a.kind);
    int rc = 0;
    pthread_mutex_lock(&g->mu);
    c->pending--;
    if (!run) goto out;
    if (c->shm) {
        pthread_mutex_unlock(&g->mu);
        rc = tboostSimHccl_shmRun(c->shm, t->seq, &t->a, fault_of(c->rank, t->seq), g_hc.execTimeout, c->device, msg,
                                  msgSize);
        free(t);
        return rc;
    }
    if (g->broken) {
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: the communicator is broken (%s): destroy it and create "
                                        "a new one",
                 name, (unsigned long long)t->seq, c->rank, g->why);
        rc = 1;
        goto out;
    }
    int fault = fault_of(c->rank, t->seq);
    if (fault == 2) {
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: fault injection (TBOOST_SIM_HCCL_FAULT fail@%llu:%u): "
                                        "the collective failed on this rank",
                 name, (unsigned long long)t->seq, c->rank, (unsigned long long)t->seq, c->rank);
        rc = 1;
        goto out;
    }
    if (fault == 1) {
        /* never arrives: wait until the others give up (or twice the timeout), then fail */
        struct timespec dl = deadline_in(2 * g_hc.execTimeout + 1);
        while (!g->broken)
            if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT) break;
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: fault injection (TBOOST_SIM_HCCL_FAULT timeout@%llu:%u): "
                                        "this rank hung in the collective",
                 name, (unsigned long long)t->seq, c->rank, (unsigned long long)t->seq, c->rank);
        rc = 1;
        goto out;
    }
    g->arr[c->rank] = t->a;
    g->arr[c->rank].seq = t->seq;
    int all = 1;
    for (uint32_t r = 0; r < g->n; r++) all &= g->arr[r].seq == t->seq;
    if (all) {
        char why[640];
        if (compute_locked(g, &g->arr[c->rank], c->rank, why, sizeof why)) {
            g->broken = 1;
            snprintf(g->why, sizeof g->why, "%s", why);
            snprintf(msg, msgSize, HCCL_TAG " %s on rank %u: %s", name, c->rank, why);
            rc = 1;
        } else {
            g->done = t->seq;
        }
        pthread_cond_broadcast(&g->cv);
        goto out;
    }
    struct timespec dl = deadline_in(g_hc.execTimeout);
    while (g->done < t->seq && !g->broken) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->done < t->seq && !g->broken) {
            char missing[256] = "";
            size_t at = 0;
            for (uint32_t r = 0; r < g->n && at < sizeof missing - 16; r++)
                if (g->arr[r].seq != t->seq)
                    at += (size_t)snprintf(missing + at, sizeof missing - at, "%srank %u", at ? ", " : "", r);
            g->broken = 1;
            snprintf(g->why, sizeof g->why, "%s #%llu: %s did not arrive within HCCL_EXEC_TIMEOUT=%gs", name,
                     (unsigned long long)t->seq, missing, g_hc.execTimeout);
            pthread_cond_broadcast(&g->cv);
            snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u (device %d): %s did not arrive within "
                                            "HCCL_EXEC_TIMEOUT=%gs (HCCL_E_TIMEOUT)",
                     name, (unsigned long long)t->seq, c->rank, c->device, missing, g_hc.execTimeout);
            rc = 1;
            goto out;
        }
    }
    if (g->done < t->seq) {
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: the communicator broke while waiting (%s)", name,
                 (unsigned long long)t->seq, c->rank, g->why);
        rc = 1;
    }
out:
    pthread_mutex_unlock(&g->mu);
    free(t);
    return rc;
}

/* Checks one buffer of rank c: device memory of its device, `bytes` long. */
static HcclResult check_buf(const char *fn, const char *what, SimComm *c, void *p, uint64_t bytes, int64_t *id) {
    if (!p) hccl_fail(HCCL_E_PTR, "%s (rank %u): %s is NULL", fn, c->rank, what);
    int32_t dev = tboostSimInternal_allocDevice(p, bytes, id);
    /* sendBuf/recvBuf are device memory of the rank's NPU (HCCL reads and writes them from the device) */
    if (dev == -1) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s (rank %u): %s %p is host memory (aclrtMallocHost): HCCL needs device memory", fn,
                  c->rank, what, p);
    }
    if (dev == -2) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s (rank %u): %s %p..+%llu is not inside one live device allocation (aclrtMalloc)", fn,
                  c->rank, what, p, (unsigned long long)bytes);
    }
    if (dev != c->device) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s (rank %u): %s %p is memory of device %d, but the rank's device is %d", fn, c->rank,
                  what, p, dev, c->device);
    }
    return HCCL_SUCCESS;
}

static HcclResult enqueue(CollKind kind, void *send, void *recv, uint64_t count, HcclDataType dtype, HcclReduceOp op,
                          uint32_t root, HcclComm comm, aclrtStream stream) {
    hc_load();
    const char *fn = coll_name(kind);
    SimComm *c;
    HcclResult rc = live_comm(fn, comm, &c);
    if (rc) return rc;
    int32_t cur = tboostSimInternal_currentDevice();
    if (cur != c->device) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_RUNTIME, "%s (rank %u): the calling thread's current device is %d, the rank's is %d "
                                  "(aclrtSetDevice the rank's device on this thread)", fn, c->rank, cur, c->device);
    }
    /* "stream: Stream of the rank" (HcclAllReduce parameters, hcclcpp_07_0021): a stream of the rank's device */
    int32_t sdev = tboostSimInternal_streamDevice(stream);
    if (!stream || sdev == -2) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s (rank %u): %p is not a live stream (aclrtCreateStream)", fn, c->rank, stream);
    }
    if (sdev != c->device) {
        tboostSimInternal_countViolation();
        hccl_fail(HCCL_E_PARA, "%s (rank %u): the stream belongs to device %d, the rank's device is %d", fn, c->rank,
                  sdev, c->device);
    }
    Arrival a;
    memset(&a, 0, sizeof a);
    a.kind = kind, a.count = count, a.dtype = dtype, a.op = op, a.root = root, a.sendId = -1, a.recvId = -1;
    if (kind != COLL_BARRIER) {
        size_t es = hsize(dtype);
        /* the data types HcclAllReduce lists for Atlas A2 (hcclcpp_07_0014): int8, int16, int32, int64, float16,
         * float32, bfp16 */
        if (es == 0 || dtype == HCCL_DATA_TYPE_UINT8 || dtype == HCCL_DATA_TYPE_UINT16 ||
            dtype == HCCL_DATA_TYPE_UINT32 || dtype == HCCL_DATA_TYPE_UINT64 || dtype == HCCL_DATA_TYPE_FP64)
            hccl_fail(HCCL_E_NOT_SUPPORT, "%s (rank %u): data type %d (%s) is not supported by the SIMULATOR", fn,
                      c->rank, (int)dtype, hname(dtype));
        if (kind == COLL_ALLREDUCE) {
            if ((int)op < 0 || (int)op > 3) hccl_fail(HCCL_E_PARA, "%s (rank %u): unknown op %d", fn, c->rank, (int)op);
            /* "prod" does not support int16 and bfp16 on Atlas A2 (HcclAllReduce, hcclcpp_07_0014) */
            if (op == HCCL_REDUCE_PROD && (dtype == HCCL_DATA_TYPE_INT16 || dtype == HCCL_DATA_TYPE_BFP16))
                hccl_fail(HCCL_E_NOT_SUPPORT, "%s (rank %u): op prod does not support %s", fn, c->rank, hname(dtype));
        }
        if (kind == COLL_BROADCAST && root >= c->g->n)
            hccl_fail(HCCL_E_PARA, "%s (rank %u): root %u is not below the rank size %u", fn, c->rank, root, c->g->n);
        if (count == 0) hccl_fail(HCCL_E_PARA, "%s (rank %u): count is 0", fn, c->rank);
        uint64_t sendBytes = count * es, recvBytes = kind == COLL_ALLGATHER ? count * es * c->g->n : count * es;
        rc = check_buf(fn, kind == COLL_BROADCAST ? "buf" : "sendBuf", c, send, sendBytes, &a.sendId);
        if (rc) return rc;
        if (kind != COLL_BROADCAST) {
            rc = check_buf(fn, "recvBuf", c, recv, recvBytes, &a.recvId);
            if (rc) return rc;
        }
        a.send = send, a.recv = kind == COLL_BROADCAST ? send : recv;
    }
    CollTask *t = calloc(1, sizeof *t);
    if (!t) abort();
    pthread_mutex_lock(&c->g->mu);
    t->c = c, t->seq = ++c->enqueued, t->a = a;
    c->pending++;
    pthread_mutex_unlock(&c->g->mu);
    if (!tboostSimInternal_pushHostTask(stream, run_collective, t)) {
        pthread_mutex_lock(&c->g->mu);
        c->pending--, c->enqueued--;
        pthread_mutex_unlock(&c->g->mu);
        free(t);
        hccl_fail(HCCL_E_PARA, "%s (rank %u): the stream went away", fn, c->rank);
    }
    return HCCL_SUCCESS;
}

HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op,
                         HcclComm comm, aclrtStream stream) {
    return enqueue(COLL_ALLREDUCE, sendBuf, recvBuf, count, dataType, op, 0, comm, stream);
}

HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm,
                         aclrtStream stream) {
    return enqueue(COLL_ALLGATHER, sendBuf, recvBuf, sendCount, dataType, HCCL_REDUCE_SUM, 0, comm, stream);
}

HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root, HcclComm comm,
                         aclrtStream stream) {
    return enqueue(COLL_BROADCAST, buf, NULL, count, dataType, HCCL_REDUCE_SUM, root, comm, stream);
}

HcclResult HcclBarrier(HcclComm comm, aclrtStream stream) {
    return enqueue(COLL_BARRIER, NULL, NULL, 0, HCCL_DATA_TYPE_INT8, HCCL_REDUCE_SUM, 0, comm, stream);
}
