/*
 * ascend-sim -- a CANN SIMULATOR (not CANN). Internal header shared by the three simulated libraries.
 *
 * "Device" memory is host memory handed out by aclrtMalloc; ops compute reference math in double on it.
 * Work launched on a stream is queued and runs when the stream (or an event recorded on it) is
 * synchronized, so a caller that reads results before synchronizing, or frees a buffer that queued work
 * still uses, sees the failure here instead of on hardware.
 *
 * State lives in libascendcl.so (core.c) and is reached from libnnopbase.so and libopapi.so through the
 * exported tboostSimInternal_* functions below (sim-only names; real CANN has none of them).
 */
#ifndef TBOOST_ASCEND_SIM_H
#define TBOOST_ASCEND_SIM_H

#include "tboost_cann.h"

#include <stdarg.h>

#define SIM_MAX_DIM 8
#define SIM_TAG "[ascend-sim SIMULATOR]"

enum { SIM_MAGIC_TENSOR = 0x54454e53u, SIM_MAGIC_SCALAR = 0x5343414cu, SIM_MAGIC_INTARRAY = 0x494e5441u,
       SIM_MAGIC_TLIST = 0x544c5354u, SIM_MAGIC_EXEC = 0x45584543u };

/* The simulator's definitions of the opaque aclnn types. */
struct aclTensor {
    uint32_t magic;
    aclDataType dtype;
    aclFormat format;
    int ndim;
    int64_t dims[SIM_MAX_DIM];
    int64_t strides[SIM_MAX_DIM];
    int64_t offset; /* in elements */
    int storageNdim;
    int64_t storageDims[SIM_MAX_DIM];
    void *data;
    int64_t allocId; /* set when an executor snapshots the tensor: the device allocation it lies in */
};

struct aclScalar {
    uint32_t magic;
    aclDataType dtype;
    double value;
};

struct aclIntArray {
    uint32_t magic;
    uint64_t size;
    int64_t *values;
};

struct aclTensorList {
    uint32_t magic;
    uint64_t size;
    const aclTensor **items;
};

typedef struct SimExec SimExec;
/* Runs the op on the snapshots in params; returns ACLNN_SUCCESS or sets the error message. */
typedef aclnnStatus (*SimRunFn)(SimExec *e, void *workspace, uint64_t workspaceSize);

#define SIM_EXEC_MAX_TENSORS 64
struct aclOpExecutor {
    uint32_t magic;
    const char *op;
    int repeatable;
    int launches;   /* accepted execute calls */
    int destroyed;  /* aclDestroyAclOpExecutor called */
    int pending;    /* queued, not yet run */
    uint64_t workspaceSize;
    SimRunFn run;
    void *params;
    void (*freeParams)(void *params);
    int ntensors;
    aclTensor tensors[SIM_EXEC_MAX_TENSORS]; /* snapshots, referenced by index from params */
};
struct SimExec {
    struct aclOpExecutor x;
};

typedef enum { SIM_OBJ_TENSOR, SIM_OBJ_SCALAR, SIM_OBJ_INTARRAY, SIM_OBJ_TLIST, SIM_OBJ_EXEC, SIM_OBJ_KINDS } SimObjKind;

typedef enum { SIM_SOC_910B, SIM_SOC_910_93, SIM_SOC_310P, SIM_SOC_910A, SIM_SOC_310B, SIM_SOC_950, SIM_SOC_OTHER } SimSocFamily;

#define SIM_API __attribute__((visibility("default")))

/* errors and log */
SIM_API void tboostSimInternal_setError(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
SIM_API void tboostSimInternal_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* config */
SIM_API SimSocFamily tboostSimInternal_socFamily(void);
SIM_API const char *tboostSimInternal_socName(void);
/* object registry (tensors, scalars, int arrays, tensor lists, executors) */
SIM_API void tboostSimInternal_register(SimObjKind kind, const void *obj);
SIM_API int tboostSimInternal_unregister(SimObjKind kind, const void *obj); /* 0 if it was not live */
SIM_API int tboostSimInternal_isLive(SimObjKind kind, const void *obj);
/* device memory: the live allocation holding [ptr, ptr+bytes), or -1 */
SIM_API int64_t tboostSimInternal_findAlloc(const void *ptr, uint64_t bytes);
/* op plumbing */
SIM_API aclnnStatus tboostSimInternal_opFault(const char *op, int execPhase);
SIM_API SimExec *tboostSimInternal_execNew(const char *op, SimRunFn run, size_t paramsSize);
SIM_API void tboostSimInternal_execAbort(SimExec *e);
SIM_API aclnnStatus tboostSimInternal_execFinish(SimExec *e, uint64_t workspaceSize, uint64_t *workspaceSizeOut,
                                                 aclOpExecutor **executorOut);
SIM_API aclnnStatus tboostSimInternal_launch(const char *op, void *workspace, uint64_t workspaceSize,
                                             aclOpExecutor *executor, aclrtStream stream);
SIM_API aclnnStatus tboostSimInternal_destroyExec(aclOpExecutor *executor);
SIM_API aclnnStatus tboostSimInternal_setRepeatable(aclOpExecutor *executor);
/* devices, streams, host tasks (libhccl.so's collectives) */
SIM_API int32_t tboostSimInternal_currentDevice(void); /* -1: none on this thread */
/* the device of the live allocation holding [ptr, ptr+bytes): -1 host memory, -2 none; *allocId set when found */
SIM_API int32_t tboostSimInternal_allocDevice(const void *ptr, uint64_t bytes, int64_t *allocId);
SIM_API int tboostSimInternal_allocLive(int64_t allocId);
SIM_API void tboostSimInternal_countViolation(void); /* a rule violation another library detected */
SIM_API int32_t tboostSimInternal_streamDevice(aclrtStream stream); /* -1 default stream, -2 not a live stream */
/* A task run by the stream when a synchronize reaches it, without the simulator's lock held (it may block).
 * run = 1; returns 0 on success, else writes the failure into msg (it fails the stream). The task owns arg. */
typedef int (*SimHostTaskFn)(void *arg, int run, char *msg, size_t msgSize);
SIM_API int tboostSimInternal_pushHostTask(aclrtStream stream, SimHostTaskFn fn, void *arg); /* 0: not a stream */

#define sim_error tboostSimInternal_setError
#define sim_log tboostSimInternal_log
#define sim_soc tboostSimInternal_socFamily
#define sim_soc_name tboostSimInternal_socName

#endif
