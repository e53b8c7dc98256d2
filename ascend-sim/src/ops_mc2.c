/* The CANN SIMULATOR's fused matmul + communication (MC2) ops, from ops-transformer
 * mc2/matmul_all_reduce/docs/aclnnMatmulAllReduce.md:
 *   output = allreduce(x1 @ x2 + bias) over the communicator named `group` (HcclGetCommName);
 *   products: Atlas A2 (1, 2, 4 or 8 ranks) and Ascend950 (1-64); not A3, the inference (310P), 200I/500
 *   A2 (310B) or training series ("产品支持情况");
 *   x1 2-D (m, k) or 3-D (b, s, k), FLOAT16/BFLOAT16, not transposed and contiguous ("非连续Tensor ×");
 *   x2 2-D (k, n), x1's dtype, contiguous or its last two axes transposed; bias NULL or 1-D (n), x1's dtype;
 *   output x1's dims with n last, x1's dtype; reduceOp "sum" only; commTurn 0 only; streamMode 1 only
 *   ("当前版本仅支持"); the doc's return table: NULL x1/x2/output 161001, dtypes/shapes/reduceOp/streamMode
 *   161002.
 * The simulator queues the matmul as an op task and then an HcclAllReduce (sum, in place on output) on the
 * same stream, so the sum waits for every rank as HCCL's does, under HCCL_EXEC_TIMEOUT. libhccl.so is
 * found among the loaded libraries (a process that made no communicator has no group to name). */

#include "ops_common.h"

#include <dlfcn.h>
#include <pthread.h>


typedef struct {
    int x1, x2, bias, y;
    int64_t m, k, n;
} Mc2P;

/* What the execute phase hands to HCCL, by executor (filled at the first phase). */
typedef struct {
    const aclOpExecutor *exec;
    HcclComm comm;
    void *out;
    uint64_t count;
    HcclDataType dtype;
} Mc2Pending;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static Mc2Pending g_pending[256];

static void *hccl_sym(const char *name) {
    void *lib = dlopen("libhccl.so", RTLD_NOW | RTLD_NOLOAD);
    void *f = lib ? dlsym(lib, name) : NULL;
    if (lib) dlclose(lib); /* NOLOAD took a reference */
    return f;
}

static int contiguous(const aclTensor *t) {
    int64_t want = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->dims[d] > 1 && t->strides[d] != want) return 0;
        want *= t->dims[d];
    }
    return 1;
}

static aclnnStatus mc2_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    Mc2P *p = e->x.params;
    const aclTensor *a = T(e, p->x1), *b = T(e, p->x2), *y = T(e, p->y);
    const aclTensor *bias = p->bias >= 0 ? T(e, p->bias) : NULL;
    for (int64_t i = 0; i < p->m; i++)
        for (int64_t j = 0; j < p->n; j++) {
            double s = bias ? ld(bias, bias->offset + j * bias->strides[0]) : 0;
            for (int64_t kk = 0; kk < p->k; kk++) s += ld(a, a->offset + i * p->k + kk) * ld(b, off2(b, kk, j));
            st(y, y->offset + i * p->n + j, s); /* rounded to the output dtype, as the cube's result is */
        }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnMatmulAllReduceGetWorkspaceSize(const aclTensor *x1, const aclTensor *x2, const aclTensor *bias,
                                                 const char *group, const char *reduceOp, int64_t commTurn,
                                                 int64_t streamMode, const aclTensor *output, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    const char *OP = "aclnnMatmulAllReduce";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    SimSocFamily soc = sim_soc();
    if (soc != SIM_SOC_910B && soc != SIM_SOC_950) {
        sim_error("%s: no kernel for %s (the op's product-support table lists Atlas A2 and Ascend950 only)", OP,
                  sim_soc_name());
        return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
    }
    if (!reduceOp || strcmp(reduceOp, "sum") != 0)
        INVALID("%s: reduceOp \"%s\" (only \"sum\" is supported)", OP, reduceOp ? reduceOp : "(null)");
    if (commTurn != 0) INVALID("%s: commTurn %lld (only 0 is supported)", OP, (long long)commTurn);
    if (streamMode != 1) INVALID("%s: streamMode %lld (only 1 is supported)", OP, (long long)streamMode);
    HcclComm (*byName)(const char *) = (HcclComm(*)(const char *))hccl_sym("tboostSimInternal_hcclByName");
    uint32_t (*ranks)(HcclComm) = (uint32_t(*)(HcclComm))hccl_sym("tboostSimInternal_hcclRanks");
    HcclComm comm = byName && group ? byName(group) : NULL;
    if (!comm)
        INVALID("%s: group \"%s\" is not the name of a live HCCL communicator (HcclGetCommName)", OP,
                group ? group : "(null)");
    uint32_t n = ranks(comm);
    int ok_ranks = soc == SIM_SOC_910B ? (n == 1 || n == 2 || n == 4 || n == 8) : (n >= 1 && n <= 64 && !(n & (n - 1)));
    if (!ok_ranks)
        INVALID("%s: %u ranks (%s: %s)", OP, n, sim_soc_name(),
                soc == SIM_SOC_910B ? "1, 2, 4 or 8 cards" : "1 to 64 cards, a power of two");
    SimExec *se = tboostSimInternal_execNew(OP, mc2_run, sizeof(Mc2P));
    if (!se) return ACLNN_ERR_INNER;
    Mc2P *p = se->x.params;
    SNAP("x1", x1, 1, &p->x1);
    SNAP("x2", x2, 1, &p->x2);
    SNAP("bias", bias, 0, &p->bias);
    SNAP("output", output, 1, &p->y);
    const aclTensor *a = T(se, p->x1), *b = T(se, p->x2), *o = T(se, p->y);
    const aclTensor *bi = p->bias >= 0 ? T(se, p->bias) : NULL;
    aclnnStatus st = ACLNN_ERR_PARAM_INVALID;
    if (a->dtype != ACL_FLOAT16 && a->dtype != ACL_BF16) {
        sim_error("%s: x1 is %s (FLOAT16 or BFLOAT16)", OP, dname(a->dtype));
    } else if (b->dtype != a->dtype || o->dtype != a->dtype || (bi && bi->dtype != a->dtype)) {
        sim_error("%s: x2 %s, bias %s and output %s must be x1's dtype %s", OP, dname(b->dtype),
                  bi ? dname(bi->dtype) : "(none)", dname(o->dtype), dname(a->dtype));
    } else if ((a->ndim != 2 && a->ndim != 3) || !contiguous(a)) {
        sim_error("%s: x1 %s must be 2-D or 3-D and contiguous (no transpose)", OP, SHAPE(a));
    } else if (b->ndim != 2 || !is_transpose_or_contig(b)) {
        sim_error("%s: x2 %s must be 2-D, contiguous or with its two axes transposed", OP, SHAPE(b));
    } else if (b->dims[0] != a->dims[a->ndim - 1]) {
        sim_error("%s: x1 %s and x2 %s differ in k", OP, SHAPE(a), SHAPE(b));
    } else if (bi && (bi->ndim != 1 || bi->dims[0] != b->dims[1])) {
        sim_error("%s: bias %s must be 1-D (n = %lld)", OP, SHAPE(bi), (long long)b->dims[1]);
    } else if (o->ndim != a->ndim || !contiguous(o) || o->dims[o->ndim - 1] != b->dims[1] ||
               (a->ndim == 2 ? o->dims[0] != a->dims[0] : (o->dims[0] != a->dims[0] || o->dims[1] != a->dims[1]))) {
        sim_error("%s: output %s must be x1 %s with n = %lld last (contiguous here)", OP, SHAPE(o), SHAPE(a),
                  (long long)b->dims[1]);
    } else {
        p->k = b->dims[0], p->n = b->dims[1];
        p->m = a->ndim == 2 ? a->dims[0] : a->dims[0] * a->dims[1];
        st = ACLNN_SUCCESS;
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    Mc2Pending pend = {&se->x, comm, (char *)o->data + o->offset * (int64_t)dsize(o->dtype), (uint64_t)(p->m * p->n),
                       o->dtype == ACL_BF16 ? HCCL_DATA_TYPE_BFP16 : HCCL_DATA_TYPE_FP16};
    pthread_mutex_lock(&g_mu);
    size_t slot = 0;
    while (slot < sizeof g_pending / sizeof *g_pending && g_pending[slot].exec) slot++;
    if (slot < sizeof g_pending / sizeof *g_pending) g_pending[slot] = pend;
    pthread_mutex_unlock(&g_mu);
    if (slot == sizeof g_pending / sizeof *g_pending) {
        tboostSimInternal_execAbort(se);
        sim_error("%s: more than %zu first phases without their execute (SIMULATOR limit)", OP, slot);
        return ACLNN_ERR_INNER;
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}

/* The matmul as an op task, then the in-place all-reduce of the output behind it on the stream. */
aclnnStatus aclnnMatmulAllReduce(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    Mc2Pending pend = {0};
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < sizeof g_pending / sizeof *g_pending; i++)
        if (executor && g_pending[i].exec == executor) {
            pend = g_pending[i];
            memset(&g_pending[i], 0, sizeof g_pending[i]);
            break;
        }
    pthread_mutex_unlock(&g_mu);
    aclnnStatus st = tboostSimInternal_launch("aclnnMatmulAllReduce", workspace, workspaceSize, executor, stream);
    if (st || !pend.exec) return st;
    HcclResult (*allReduce)(void *, void *, uint64_t, HcclDataType, HcclReduceOp, HcclComm, aclrtStream) =
        (HcclResult(*)(void *, void *, uint64_t, HcclDataType, HcclReduceOp, HcclComm, aclrtStream))hccl_sym(
            "HcclAllReduce");
    HcclResult rc = allReduce ? allReduce(pend.out, pend.out, pend.count, pend.dtype, HCCL_REDUCE_SUM, pend.comm, stream)
                              : HCCL_E_NOT_SUPPORT;
    if (rc) {
        sim_error("aclnnMatmulAllReduce: the all-reduce of the output could not be queued (HCCL %d)", (int)rc);
        return ACLNN_ERR_INNER;
    }
    return ACLNN_SUCCESS;
}
