/*
 * ascend-sim hccl_internal.h -- CANN SIMULATOR: what the simulated libhccl.so's two communicator kinds share:
 * the collectives' names and arguments, element access for HCCL's data types, and the cross-process group
 * (hccl_shm.c) behind HcclCommInitRootInfo.
 */
#ifndef TBOOST_ASCEND_SIM_HCCL_INTERNAL_H
#define TBOOST_ASCEND_SIM_HCCL_INTERNAL_H

#include "ops_common.h"

#include <time.h>

#define HCCL_TAG SIM_TAG " HCCL"

typedef enum { COLL_ALLREDUCE, COLL_ALLGATHER, COLL_BROADCAST, COLL_BARRIER } CollKind;

static inline const char *coll_name(CollKind k) {
    switch (k) {
    case COLL_ALLREDUCE: return "HcclAllReduce";
    case COLL_ALLGATHER: return "HcclAllGather";
    case COLL_BROADCAST: return "HcclBroadcast";
    default: return "HcclBarrier";
    }
}

typedef struct {
    uint64_t seq; /* 0: none yet */
    CollKind kind;
    void *send, *recv;
    uint64_t count;
    HcclDataType dtype;
    HcclReduceOp op;
    uint32_t root;
    int64_t sendId, recvId;
} Arrival;

static inline struct timespec deadline_in(double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double whole = (double)(int64_t)seconds;
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    return ts;
}

static inline size_t hsize(HcclDataType t) {
    switch (t) {
    case HCCL_DATA_TYPE_INT8:
    case HCCL_DATA_TYPE_UINT8: return 1;
    case HCCL_DATA_TYPE_INT16:
    case HCCL_DATA_TYPE_UINT16:
    case HCCL_DATA_TYPE_FP16:
    case HCCL_DATA_TYPE_BFP16: return 2;
    case HCCL_DATA_TYPE_INT32:
    case HCCL_DATA_TYPE_UINT32:
    case HCCL_DATA_TYPE_FP32: return 4;
    case HCCL_DATA_TYPE_INT64:
    case HCCL_DATA_TYPE_UINT64:
    case HCCL_DATA_TYPE_FP64: return 8;
    }
    return 0;
}

static inline const char *hname(HcclDataType t) {
    static const char *n[] = {"INT8", "INT16", "INT32", "FP16", "FP32", "INT64", "UINT64", "UINT8", "UINT16",
                              "UINT32", "FP64", "BFP16"};
    return (int)t >= 0 && (int)t < 12 ? n[t] : "?";
}

static inline double load(HcclDataType t, const char *p, uint64_t i) {
    switch (t) {
    case HCCL_DATA_TYPE_INT8: return ((const int8_t *)p)[i];
    case HCCL_DATA_TYPE_INT16: return ((const int16_t *)p)[i];
    case HCCL_DATA_TYPE_INT32: return ((const int32_t *)p)[i];
    case HCCL_DATA_TYPE_FP16: return f16_to_f32(((const uint16_t *)p)[i]);
    case HCCL_DATA_TYPE_BFP16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case HCCL_DATA_TYPE_FP32: return ((const float *)p)[i];
    case HCCL_DATA_TYPE_INT64: return (double)((const int64_t *)p)[i];
    default: return 0;
    }
}

static inline void store(HcclDataType t, char *p, uint64_t i, double v) {
    switch (t) {
    case HCCL_DATA_TYPE_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case HCCL_DATA_TYPE_INT16: ((int16_t *)p)[i] = (int16_t)v; break;
    case HCCL_DATA_TYPE_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case HCCL_DATA_TYPE_FP16: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
    case HCCL_DATA_TYPE_BFP16: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    case HCCL_DATA_TYPE_FP32: ((float *)p)[i] = (float)v; break;
    case HCCL_DATA_TYPE_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: break;
    }
}

/* ------------------------------------------------------------------ the cross-process group (hccl_shm.c) */

typedef struct ShmGroup ShmGroup;

/* Joins rank `rank` of `n` on device `dev` to the group named by root info `key`, waiting up to
 * `connectTimeout` seconds for every rank. NULL on failure, with the HCCL code in *code and the reason in why. */
ShmGroup *tboostSimHccl_shmJoin(const char *key, uint32_t n, uint32_t rank, int32_t dev, double connectTimeout,
                                HcclResult *code, char *why, size_t whySize);
/* Runs collective #seq (described by `a`, this rank's buffers) with the other ranks. fault: 0, 1 (never
 * arrive) or 2 (fail at once). 0 on success, else 1 with the message in msg. */
int tboostSimHccl_shmRun(ShmGroup *s, uint64_t seq, const Arrival *a, int fault, double execTimeout, int32_t dev,
                         char *msg, size_t msgSize);
void tboostSimHccl_shmLeave(ShmGroup *s);

#endif
