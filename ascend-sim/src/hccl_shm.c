/*
 * ascend-sim hccl_shm.c -- CANN SIMULATOR: the group behind HcclCommInitRootInfo, whose ranks may be separate
 * processes (one per NPU, the root info carried between them by the host, e.g. over MPI, as MindIE does) or
 * threads of one process. Not HCCL: no NPU and no HCCS/RoCE link; the ranks meet in a POSIX shared-memory
 * segment named by the root info, on this machine only.
 *
 * The segment holds a process-shared, robust mutex and condition variable, what each rank has joined with
 * (device and host name: one rank per device of a host, as HCCL maps ranks to NPUs), and one slot of
 * SHM_SLOT bytes per rank. A collective moves through the slots in rounds of at most SHM_SLOT bytes per
 * rank: every rank deposits its round, waits for the others' (at most HCCL_EXEC_TIMEOUT from the
 * collective's start), checks that they agree, computes its own result from all slots in rank order (so
 * every rank gets the same sums), and marks the round read; a rank deposits its next round only when every
 * rank has read the last. A timeout, a disagreement or a rank's process dying inside the segment's lock
 * breaks the group for every rank. The segment's name is unlinked once every rank has joined (or the join
 * timed out); the mapping lives until the last rank leaves.
 */
#define _GNU_SOURCE
#include "hccl_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHM_MAGIC 0x53484d48u /* "SHMH" */
#define SHM_MAX_RANKS 64
#define SHM_SLOT ((uint64_t)1 << 20)

typedef struct {
    uint64_t seq;
    uint32_t round;
    CollKind kind;
    uint64_t count;
    HcclDataType dtype;
    HcclReduceOp op;
    uint32_t root;
} ShmMeta;

typedef struct {
    _Atomic uint32_t magic; /* set last by the creator: the rest is initialized */
    uint32_t n, joined;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint8_t present[SHM_MAX_RANKS];
    int32_t dev[SHM_MAX_RANKS];
    char host[SHM_MAX_RANKS][64];
    uint64_t arrived[SHM_MAX_RANKS];  /* rounds each rank has deposited */
    uint64_t consumed[SHM_MAX_RANKS]; /* rounds each rank has read */
    ShmMeta meta[SHM_MAX_RANKS];      /* what each rank's last deposit was */
    int broken;
    char why[768];
} ShmHdr;

struct ShmGroup {
    ShmHdr *h;
    size_t size;
    uint32_t rank;
    uint64_t rounds; /* this rank's rounds so far */
};

static size_t shm_size(uint32_t n) {
    size_t page = 4096, hdr = (sizeof(ShmHdr) + page - 1) / page * page;
    return hdr + (size_t)n * SHM_SLOT;
}

static char *slot(ShmGroup *s, uint32_t r) {
    size_t page = 4096, hdr = (sizeof(ShmHdr) + page - 1) / page * page;
    return (char *)s->h + hdr + (size_t)r * SHM_SLOT;
}

static void break_locked(ShmHdr *h, const char *why) {
    if (!h->broken) {
        h->broken = 1;
        snprintf(h->why, sizeof h->why, "%s", why);
    }
    pthread_cond_broadcast(&h->cv);
}

/* A rank's process that died holding the lock leaves it to the next locker (a robust mutex): the group
 * is then broken, as HCCL's would be by a lost peer. */
static void after_lock(ShmHdr *h, int rc) {
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(&h->mu);
        break_locked(h, "a rank's process died inside a collective");
    }
}

static void shm_lock(ShmHdr *h) { after_lock(h, pthread_mutex_lock(&h->mu)); }

/* 1 when the deadline passed */
static int shm_wait(ShmHdr *h, const struct timespec *dl) {
    int rc = pthread_cond_timedwait(&h->cv, &h->mu, dl);
    after_lock(h, rc);
    return rc == ETIMEDOUT;
}

static void shm_name(const char *key, char *out, size_t size) {
    size_t at = (size_t)snprintf(out, size, "/tboost-sim-hccl-");
    for (const char *k = key; *k && at + 1 < size; k++) out[at++] = (*k == ':' || *k == '/') ? '-' : *k;
    out[at] = 0;
}

static double since(const struct timespec *t0) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (double)(now.tv_sec - t0->tv_sec) + (double)(now.tv_nsec - t0->tv_nsec) / 1e9;
}

/* Creates the segment, or opens the one another rank created and waits until it is initialized. */
static ShmHdr *open_segment(const char *name, uint32_t n, double timeout, size_t *size, char *why, size_t whySize) {
    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    int creator = fd >= 0;
    if (!creator && errno == EEXIST) fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) {
        snprintf(why, whySize, "shm_open(%s): %s (the group is complete, or its root info is stale)", name,
                 strerror(errno));
        return NULL;
    }
    size_t want = shm_size(n);
    if (creator && ftruncate(fd, (off_t)want) != 0) {
        snprintf(why, whySize, "ftruncate(%s, %zu): %s", name, want, strerror(errno));
        close(fd);
        shm_unlink(name);
        return NULL;
    }
    struct stat st;
    while (!creator && fstat(fd, &st) == 0 && (size_t)st.st_size < sizeof(ShmHdr)) {
        if (since(&t0) > timeout) {
            snprintf(why, whySize, "the segment %s was never initialized within HCCL_CONNECT_TIMEOUT=%gs", name,
                     timeout);
            close(fd);
            return NULL;
        }
        usleep(1000);
    }
    size_t have = creator ? want : (size_t)st.st_size;
    ShmHdr *h = mmap(NULL, have, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (h == MAP_FAILED) {
        snprintf(why, whySize, "mmap(%s): %s", name, strerror(errno));
        return NULL;
    }
    if (creator) {
        pthread_mutexattr_t ma;
        pthread_mutexattr_init(&ma);
        pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&h->mu, &ma);
        pthread_mutexattr_destroy(&ma);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
        pthread_cond_init(&h->cv, &ca);
        pthread_condattr_destroy(&ca);
        h->n = n;
        atomic_store(&h->magic, SHM_MAGIC);
    } else {
        while (atomic_load(&h->magic) != SHM_MAGIC) {
            if (since(&t0) > timeout) {
                snprintf(why, whySize, "the segment %s was never initialized within HCCL_CONNECT_TIMEOUT=%gs", name,
                         timeout);
                munmap(h, have);
                return NULL;
            }
            usleep(1000);
        }
    }
    *size = have;
    return h;
}

ShmGroup *tboostSimHccl_shmJoin(const char *key, uint32_t n, uint32_t rank, int32_t dev, double connectTimeout,
                                HcclResult *code, char *why, size_t whySize) {
    *code = HCCL_E_PARA;
    if (n > SHM_MAX_RANKS) {
        snprintf(why, whySize, "nRanks %u is above the SIMULATOR's %u", n, SHM_MAX_RANKS);
        return NULL;
    }
    char name[200];
    shm_name(key, name, sizeof name);
    size_t size = 0;
    ShmHdr *h = open_segment(name, n, connectTimeout, &size, why, whySize);
    if (!h) {
        *code = HCCL_E_SYSCALL;
        return NULL;
    }
    char host[64] = "";
    gethostname(host, sizeof host - 1);
    shm_lock(h);
    const char *bad = NULL;
    if (h->n != n) {
        snprintf(why, whySize, "nRanks %u differs from the %u of the ranks that joined first", n, h->n);
        bad = why;
    } else if (h->present[rank]) {
        snprintf(why, whySize, "rank %u already joined this root info", rank);
        bad = why;
    } else {
        /* one rank per device: HCCL's intra-server communicators map each rank to its own NPU */
        for (uint32_t r = 0; r < h->n && !bad; r++)
            if (h->present[r] && h->dev[r] == dev && strcmp(h->host[r], host) == 0) {
                snprintf(why, whySize, "device %d of %s is already rank %u of this communicator (one rank per device)",
                         dev, host, r);
                bad = why;
            }
    }
    if (bad) {
        pthread_mutex_unlock(&h->mu);
        munmap(h, size);
        tboostSimInternal_countViolation();
        return NULL;
    }
    h->present[rank] = 1, h->dev[rank] = dev;
    snprintf(h->host[rank], sizeof h->host[rank], "%s", host);
    h->joined++;
    if (h->joined == h->n) shm_unlink(name); /* complete: nobody else may join */
    pthread_cond_broadcast(&h->cv);
    struct timespec dl = deadline_in(connectTimeout);
    while (h->joined < h->n && !h->broken) {
        if (shm_wait(h, &dl) && h->joined < h->n) {
            char b[256];
            snprintf(b, sizeof b, "only %u of %u ranks joined within HCCL_CONNECT_TIMEOUT=%gs", h->joined, h->n,
                     connectTimeout);
            break_locked(h, b);
            shm_unlink(name);
        }
    }
    if (h->joined < h->n || h->broken) {
        snprintf(why, whySize, "%s", h->why);
        pthread_mutex_unlock(&h->mu);
        munmap(h, size);
        *code = HCCL_E_TIMEOUT;
        return NULL;
    }
    pthread_mutex_unlock(&h->mu);
    ShmGroup *s = calloc(1, sizeof *s);
    if (!s) abort();
    s->h = h, s->size = size, s->rank = rank;
    *code = HCCL_SUCCESS;
    return s;
}

void tboostSimHccl_shmLeave(ShmGroup *s) {
    if (!s) return;
    munmap(s->h, s->size);
    free(s);
}

/* The ranks (as "rank 1, rank 3") whose counter in `of` is below `want`. */
static void ranks_below(const ShmHdr *h, const uint64_t *of, uint64_t want, char *out, size_t size) {
    size_t at = 0;
    out[0] = 0;
    for (uint32_t r = 0; r < h->n && at + 16 < size; r++)
        if (of[r] < want) at += (size_t)snprintf(out + at, size - at, "%srank %u", at ? ", " : "", r);
}

/* Waits until every rank's counter in `of` reaches `want`; 1 (with msg) on timeout or a broken group. */
static int wait_all(ShmGroup *s, const uint64_t *of, uint64_t want, const Arrival *a, uint64_t seq, int32_t dev,
                    double execTimeout, const struct timespec *dl, char *msg, size_t msgSize) {
    ShmHdr *h = s->h;
    const char *name = coll_name(a->kind);
    for (;;) {
        if (h->broken) {
            snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: the communicator broke while waiting (%s)", name,
                     (unsigned long long)seq, s->rank, h->why);
            return 1;
        }
        char missing[256];
        ranks_below(h, of, want, missing, sizeof missing);
        if (!missing[0]) return 0;
        if (shm_wait(h, dl) && !h->broken) {
            ranks_below(h, of, want, missing, sizeof missing);
            if (!missing[0]) return 0;
            char why[512];
            snprintf(why, sizeof why, "%s #%llu: %s did not arrive within HCCL_EXEC_TIMEOUT=%gs", name,
                     (unsigned long long)seq, missing, execTimeout);
            break_locked(h, why);
            snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u (device %d): %s did not arrive within "
                                            "HCCL_EXEC_TIMEOUT=%gs (HCCL_E_TIMEOUT)",
                     name, (unsigned long long)seq, s->rank, dev, missing, execTimeout);
            return 1;
        }
    }
}

/* 0 when every rank deposited the same collective and round as `me`; else breaks the group, with msg. */
static int agree(ShmGroup *s, const ShmMeta *me, char *msg, size_t msgSize) {
    ShmHdr *h = s->h;
    for (uint32_t r = 0; r < h->n; r++) {
        const ShmMeta *o = &h->meta[r];
        /* "The ranks must have the same count, dataType, and op." (HcclAllReduce, CANN 8.0.0 HCCL API reference,
         * hcclcpp_07_0021; the same constraint for AllGather's sendCount/dataType and Broadcast's root) */
        if (o->kind != me->kind || o->count != me->count || o->dtype != me->dtype ||
            (me->kind == COLL_ALLREDUCE && o->op != me->op) || (me->kind == COLL_BROADCAST && o->root != me->root)) {
            char why[640];
            snprintf(why, sizeof why,
                     "collective #%llu: rank %u called %s(count %llu, %s, op %d, root %u) but rank %u called "
                     "%s(count %llu, %s, op %d, root %u): the ranks must have the same count, dataType and op",
                     (unsigned long long)me->seq, r, coll_name(o->kind), (unsigned long long)o->count, hname(o->dtype),
                     (int)o->op, o->root, s->rank, coll_name(me->kind), (unsigned long long)me->count,
                     hname(me->dtype), (int)me->op, me->root);
            tboostSimInternal_countViolation();
            break_locked(h, why);
            snprintf(msg, msgSize, HCCL_TAG " %s on rank %u: %s", coll_name(me->kind), s->rank, why);
            return 1;
        }
    }
    return 0;
}

int tboostSimHccl_shmRun(ShmGroup *s, uint64_t seq, const Arrival *a, int fault, double execTimeout, int32_t dev,
                         char *msg, size_t msgSize) {
    ShmHdr *h = s->h;
    const char *name = coll_name(a->kind);
    size_t es = a->kind == COLL_BARRIER ? 0 : hsize(a->dtype);
    uint64_t bytes = a->count * es;
    uint32_t rounds = bytes ? (uint32_t)((bytes + SHM_SLOT - 1) / SHM_SLOT) : 1;
    struct timespec dl = deadline_in(execTimeout);
    int rc = 0;
    shm_lock(h);
    if (h->broken) {
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: the communicator is broken (%s): destroy it and create "
                                        "a new one",
                 name, (unsigned long long)seq, s->rank, h->why);
        rc = 1;
        goto out;
    }
    if (fault == 2) {
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: fault injection (TBOOST_SIM_HCCL_FAULT fail@%llu:%u): "
                                        "the collective failed on this rank",
                 name, (unsigned long long)seq, s->rank, (unsigned long long)seq, s->rank);
        rc = 1;
        goto out;
    }
    if (fault == 1) {
        /* never arrives: wait until the others give up (or twice the timeout), then fail */
        struct timespec hang = deadline_in(2 * execTimeout + 1);
        while (!h->broken && !shm_wait(h, &hang)) {
        }
        snprintf(msg, msgSize, HCCL_TAG " %s #%llu on rank %u: fault injection (TBOOST_SIM_HCCL_FAULT timeout@%llu:%u): "
                                        "this rank hung in the collective",
                 name, (unsigned long long)seq, s->rank, (unsigned long long)seq, s->rank);
        rc = 1;
        goto out;
    }
    for (uint32_t round = 0; round < rounds; round++) {
        uint64_t e = s->rounds + 1;
        /* the slots are free once every rank has read the last round */
        if ((rc = wait_all(s, h->consumed, e - 1, a, seq, dev, execTimeout, &dl, msg, msgSize))) goto out;
        if ((a->sendId > 0 && !tboostSimInternal_allocLive(a->sendId)) ||
            (a->recvId > 0 && !tboostSimInternal_allocLive(a->recvId))) {
            char why[256];
            snprintf(why, sizeof why, "%s #%llu: a buffer of rank %u was freed before the stream ran the collective",
                     name, (unsigned long long)seq, s->rank);
            tboostSimInternal_countViolation();
            break_locked(h, why);
            snprintf(msg, msgSize, HCCL_TAG " %s on rank %u: %s", name, s->rank, why);
            rc = 1;
            goto out;
        }
        uint64_t off = (uint64_t)round * SHM_SLOT, len = bytes ? (bytes - off < SHM_SLOT ? bytes - off : SHM_SLOT) : 0;
        if (len) memcpy(slot(s, s->rank), (const char *)a->send + off, len);
        ShmMeta me = {seq, round, a->kind, a->count, a->dtype, a->op, a->root};
        h->meta[s->rank] = me;
        h->arrived[s->rank] = e;
        pthread_cond_broadcast(&h->cv);
        if ((rc = wait_all(s, h->arrived, e, a, seq, dev, execTimeout, &dl, msg, msgSize))) goto out;
        if ((rc = agree(s, &me, msg, msgSize))) goto out;
        switch (a->kind) {
        case COLL_ALLREDUCE:
            for (uint64_t i = 0; i < len / es; i++) {
                double acc = load(a->dtype, slot(s, 0), i);
                for (uint32_t r = 1; r < h->n; r++) {
                    double v = load(a->dtype, slot(s, r), i);
                    switch (a->op) {
                    case HCCL_REDUCE_SUM: acc += v; break;
                    case HCCL_REDUCE_PROD: acc *= v; break;
                    case HCCL_REDUCE_MAX: acc = v > acc ? v : acc; break;
                    case HCCL_REDUCE_MIN: acc = v < acc ? v : acc; break;
                    }
                }
                store(a->dtype, (char *)a->recv + off, i, acc);
            }
            break;
        case COLL_ALLGATHER:
            for (uint32_t r = 0; r < h->n; r++) memcpy((char *)a->recv + r * bytes + off, slot(s, r), len);
            break;
        case COLL_BROADCAST:
            if (s->rank != a->root) memcpy((char *)a->send + off, slot(s, a->root), len);
            break;
        case COLL_BARRIER: break;
        }
        h->consumed[s->rank] = e;
        s->rounds = e;
        pthread_cond_broadcast(&h->cv);
    }
out:
    pthread_mutex_unlock(&h->mu);
    return rc;
}
