/*
 * ascend-sim ops_moe.c -- CANN SIMULATOR: rotary position embedding and the MoE chain
 * (aclnnRotaryPositionEmbedding, aclnnMoeGatingTopKSoftmax, aclnnMoeInitRoutingV2, aclnnGroupedMatmulV4,
 * aclnnMoeFinalizeRoutingV2), following the formulas of their docs (OT posembedding/.../docs,
 * OT-EN moe/<op>/docs, gmm/grouped_matmul/docs/aclnnGroupedMatmulV4_en.md). Not CANN: see ascend-sim/README.md.
 */
#include "ops_common.h"

#define FAIL(code, ...)                  \
    do {                                 \
        sim_error(__VA_ARGS__);          \
        tboostSimInternal_execAbort(se); \
        return (code);                   \
    } while (0)

/* ---------------------------------------------------------------- RotaryPositionEmbedding */

typedef struct {
    int x, cos, sin, out;
    int mode;
} RopeP;

static aclnnStatus rope_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    RopeP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *c = T(e, p->cos), *s = T(e, p->sin), *o = T(e, p->out);
    int64_t D = x->dims[3], h = D / 2, qd = D / 4;
    for (int64_t a = 0; a < x->dims[0]; a++)
        for (int64_t b = 0; b < x->dims[1]; b++)
            for (int64_t n = 0; n < x->dims[2]; n++) {
                int64_t ca = c->dims[0] == 1 ? 0 : a, cb = c->dims[1] == 1 ? 0 : b, cn = c->dims[2] == 1 ? 0 : n;
                for (int64_t d = 0; d < D; d++) {
#define X(i) ld(x, off4(x, a, b, n, (i)))
                    double base, rot;
                    switch (p->mode) {
                    case 0: base = X(d), rot = d < h ? -X(d + h) : X(d - h); break;
                    case 1: base = X(d), rot = d % 2 == 0 ? -X(d + 1) : X(d - 1); break;
                    case 2: base = X(d), rot = (d / qd) % 2 == 0 ? -X(d + qd) : X(d - qd); break;
                    default:
                        if (d < h) base = X(2 * d), rot = -X(2 * d + 1);
                        else base = X(2 * (d - h) + 1), rot = X(2 * (d - h));
                        break;
                    }
#undef X
                    double cv = ld(c, off4(c, ca, cb, cn, d)), sv = ld(s, off4(s, ca, cb, cn, d));
                    st(o, off4(o, a, b, n, d), base * cv + rot * sv);
                }
            }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnRotaryPositionEmbeddingGetWorkspaceSize(const aclTensor *x, const aclTensor *cos, const aclTensor *sin,
                                                         int64_t mode, aclTensor *out, uint64_t *workspaceSize,
                                                         aclOpExecutor **executor) {
    static const char *OP = "aclnnRotaryPositionEmbedding";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, rope_run, sizeof(RopeP));
    if (!se) return ACLNN_ERR_INNER;
    RopeP *p = se->x.params;
    SNAP("x", x, 1, &p->x);
    SNAP("cos", cos, 1, &p->cos);
    SNAP("sin", sin, 1, &p->sin);
    SNAP("out", out, 1, &p->out);
    const aclTensor *a = T(se, p->x), *c = T(se, p->cos), *s = T(se, p->sin), *o = T(se, p->out);
    if (!is_float(a->dtype) || c->dtype != a->dtype || s->dtype != a->dtype || o->dtype != a->dtype)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x, cos, sin and out must share one of BFLOAT16, FLOAT16, FLOAT32 (%s/%s/%s/%s)", OP,
             dname(a->dtype), dname(c->dtype), dname(s->dtype), dname(o->dtype));
    if (check_bf16(OP, "x", a)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BFLOAT16 on %s", OP, sim_soc_name());
    if (mode < 0 || mode > 3) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: mode %lld is not 0..3", OP, (long long)mode);
    if (soc_is_a2a3() && mode > 1)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: on %s (Atlas A2/A3) only mode 0 (half) and 1 (interleave) exist", OP, sim_soc_name());
    if (a->ndim != 4 || c->ndim != 4 || !same_shape(c, s) || !same_shape(a, o))
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: x %s / out %s must match, cos %s / sin %s must match, all 4-D", OP, SHAPE(a), SHAPE(o), SHAPE(c), SHAPE(s));
    int64_t D = a->dims[3];
    if (c->dims[3] != D || D % (mode == 2 ? 4 : 2) || D >= 896)
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: D %lld (cos D %lld) must be equal, < 896 and divisible by %d", OP, (long long)D, (long long)c->dims[3], mode == 2 ? 4 : 2);
    for (int i = 0; i < 3; i++)
        if (c->dims[i] != 1 && c->dims[i] != a->dims[i])
            FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: cos %s does not broadcast to x %s", OP, SHAPE(c), SHAPE(a));
    p->mode = (int)mode;
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnRotaryPositionEmbedding)

/* ---------------------------------------------------------------- MoeGatingTopKSoftmax */

typedef struct {
    int x, fin, y, idx, row;
    int64_t rows, E, k;
} GateP;

static aclnnStatus gate_run(SimExec *e, void *ws, uint64_t wsSize) {
    GateP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *y = T(e, p->y), *ix = T(e, p->idx), *rw = T(e, p->row);
    const aclTensor *fin = p->fin >= 0 ? T(e, p->fin) : NULL;
    double *prob = ws;
    if (wsSize < (uint64_t)p->E * sizeof(double)) return ACLNN_ERR_INNER;
    for (int64_t r = 0; r < p->rows; r++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t c = 0; c < p->E; c++) {
            prob[c] = ld(x, off_lin(x, r * p->E + c));
            if (prob[c] > mx) mx = prob[c];
        }
        for (int64_t c = 0; c < p->E; c++) sum += (prob[c] = exp(prob[c] - mx));
        int finished = fin && ld(fin, off_lin(fin, r)) != 0;
        for (int64_t j = 0; j < p->k; j++) {
            int64_t best = -1;
            for (int64_t c = 0; c < p->E; c++)
                if (prob[c] >= 0 && (best < 0 || prob[c] > prob[best])) best = c; /* ties: lower index first */
            st(y, off_lin(y, r * p->k + j), prob[best] / sum);
            st(ix, off_lin(ix, r * p->k + j), finished ? (double)p->E : (double)best);
            st(rw, off_lin(rw, r * p->k + j), (double)(j * p->rows + r));
            prob[best] = -1;
        }
    }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnMoeGatingTopKSoftmaxGetWorkspaceSize(const aclTensor *x, const aclTensor *finishedOptional, int64_t k,
                                                      const aclTensor *yOut, const aclTensor *expertIdxOut,
                                                      const aclTensor *rowIdxOut, uint64_t *workspaceSize,
                                                      aclOpExecutor **executor) {
    static const char *OP = "aclnnMoeGatingTopKSoftmax";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    if (!soc_is_a2a3()) {
        sim_error("%s: no kernel for %s: the op supports Atlas A2/A3 only", OP, sim_soc_name());
        return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
    }
    SimExec *se = tboostSimInternal_execNew(OP, gate_run, sizeof(GateP));
    if (!se) return ACLNN_ERR_INNER;
    GateP *p = se->x.params;
    SNAP("x", x, 1, &p->x);
    SNAP("finishedOptional", finishedOptional, 0, &p->fin);
    SNAP("yOut", yOut, 1, &p->y);
    SNAP("expertIdxOut", expertIdxOut, 1, &p->idx);
    SNAP("rowIdxOut", rowIdxOut, 1, &p->row);
    const aclTensor *a = T(se, p->x), *y = T(se, p->y), *ix = T(se, p->idx), *rw = T(se, p->row);
    if (!is_float(a->dtype) || y->dtype != a->dtype) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x and yOut must share FLOAT16, BFLOAT16 or FLOAT32", OP);
    if (ix->dtype != ACL_INT32 || rw->dtype != ACL_INT32) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: expertIdxOut and rowIdxOut must be INT32", OP);
    if (a->ndim < 2 || a->ndim > 3) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: x %s must be 2-D or 3-D", OP, SHAPE(a));
    p->E = a->dims[a->ndim - 1];
    p->rows = p->E ? numel(a) / p->E : 0;
    if (k < 0 || k > p->E || k > 1024) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: k %lld must be in [0, min(%lld, 1024)]", OP, (long long)k, (long long)p->E);
    p->k = k;
    int ok = y->ndim == a->ndim && same_shape(y, ix) && same_shape(y, rw) && y->dims[y->ndim - 1] == k;
    for (int i = 0; ok && i < a->ndim - 1; i++) ok = y->dims[i] == a->dims[i];
    if (!ok) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: yOut %s, expertIdxOut %s and rowIdxOut %s must be x's shape %s with the last dim k = %lld", OP, SHAPE(y), SHAPE(ix), SHAPE(rw), SHAPE(a), (long long)k);
    if (p->fin >= 0) {
        const aclTensor *f = T(se, p->fin);
        ok = f->dtype == ACL_BOOL && f->ndim == a->ndim - 1;
        for (int i = 0; ok && i < f->ndim; i++) ok = f->dims[i] == a->dims[i];
        if (!ok) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: finishedOptional must be BOOL with shape x.shape[:-1]", OP);
    }
    return tboostSimInternal_execFinish(se, (uint64_t)(p->E ? p->E : 1) * sizeof(double), workspaceSize, executor);
}
SIM_EXECUTE(aclnnMoeGatingTopKSoftmax)

/* ---------------------------------------------------------------- MoeInitRoutingV2 */

typedef struct {
    int x, eidx, ex, erow, cnt, before;
    int64_t N, H, K, active, cap, E, drop, cntFlag;
} InitP;

static aclnnStatus init_run(SimExec *e, void *ws, uint64_t wsSize) {
    InitP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *ei = T(e, p->eidx), *ex = T(e, p->ex), *er = T(e, p->erow);
    const aclTensor *cnt = p->cnt >= 0 ? T(e, p->cnt) : NULL, *bef = p->before >= 0 ? T(e, p->before) : NULL;
    int64_t NK = p->N * p->K;
    int64_t *ids = ws, *order = ids + NK, *hist = order + NK;
    if (wsSize < (uint64_t)(2 * NK + p->E + 1) * sizeof(int64_t)) return ACLNN_ERR_INNER;
    for (int64_t i = 0; i < NK; i++) {
        ids[i] = ld_i(ei, off_lin(ei, i));
        int bounded = p->drop == 1 || cnt;
        if (ids[i] < 0 || (bounded && ids[i] >= p->E)) {
            sim_error("aclnnMoeInitRoutingV2: expertIdx[%lld] = %lld is outside [0, %lld)", (long long)i, (long long)ids[i], (long long)p->E);
            return ACLNN_ERR_PARAM_INVALID;
        }
        order[i] = i;
    }
    /* keyValueSort: stable by expert id (insertion sort: n is small in tests; stable) */
    for (int64_t i = 1; i < NK; i++) {
        int64_t o = order[i], j = i;
        while (j > 0 && ids[order[j - 1]] > ids[o]) order[j] = order[j - 1], j--;
        order[j] = o;
    }
    for (int64_t i = 0; i <= p->E; i++) hist[i] = 0;
    if (p->drop == 0) {
        int64_t rowsOut = p->active > 0 && p->active < NK ? p->active : NK;
        for (int64_t i = 0; i < NK; i++) {
            int64_t src = order[i];
            st(er, off_lin(er, src), (double)i);
            if (i < rowsOut)
                for (int64_t h = 0; h < p->H; h++) st(ex, off2(ex, i, h), ld(x, off2(x, src / p->K, h)));
            if (ids[src] < p->E) hist[ids[src]]++;
        }
    } else {
        for (int64_t c = 0; c < p->E * p->cap; c++)
            for (int64_t h = 0; h < p->H; h++) st(ex, off3(ex, c / p->cap, c % p->cap, h), 0);
        for (int64_t i = 0; i < NK; i++) {
            int64_t src = order[i], ex_id = ids[src], pos = hist[ex_id]++;
            if (pos < p->cap) {
                st(er, off_lin(er, src), (double)(ex_id * p->cap + pos));
                for (int64_t h = 0; h < p->H; h++) st(ex, off3(ex, ex_id, pos, h), ld(x, off2(x, src / p->K, h)));
            } else {
                st(er, off_lin(er, src), -1);
            }
        }
    }
    if (cnt) {
        int64_t run = 0;
        for (int64_t i = 0; i < p->E; i++) {
            run += hist[i];
            st(cnt, off_lin(cnt, i), (double)(p->cntFlag == 1 ? run : hist[i]));
        }
    }
    if (bef)
        for (int64_t i = 0; i < p->E; i++) st(bef, off_lin(bef, i), (double)hist[i]);
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnMoeInitRoutingV2GetWorkspaceSize(const aclTensor *x, const aclTensor *expertIdx, int64_t activeNum,
                                                  int64_t expertCapacity, int64_t expertNum, int64_t dropPadMode,
                                                  int64_t expertTokensCountOrCumsumFlag,
                                                  bool expertTokensBeforeCapacityFlag, const aclTensor *expandedXOut,
                                                  const aclTensor *expandedRowIdxOut,
                                                  const aclTensor *expertTokensCountOrCumsumOut,
                                                  const aclTensor *expertTokensBeforeCapacityOut,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *OP = "aclnnMoeInitRoutingV2";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, init_run, sizeof(InitP));
    if (!se) return ACLNN_ERR_INNER;
    InitP *p = se->x.params;
    p->cnt = p->before = -1;
    SNAP("x", x, 1, &p->x);
    SNAP("expertIdx", expertIdx, 1, &p->eidx);
    SNAP("expandedXOut", expandedXOut, 1, &p->ex);
    SNAP("expandedRowIdxOut", expandedRowIdxOut, 1, &p->erow);
    if (expertTokensCountOrCumsumFlag > 0) SNAP("expertTokensCountOrCumsumOut", expertTokensCountOrCumsumOut, 1, &p->cnt);
    if (expertTokensBeforeCapacityFlag) SNAP("expertTokensBeforeCapacityOut", expertTokensBeforeCapacityOut, 1, &p->before);
    const aclTensor *a = T(se, p->x), *ei = T(se, p->eidx), *ex = T(se, p->ex), *er = T(se, p->erow);
    if (!is_float(a->dtype) || ex->dtype != a->dtype) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x and expandedXOut must share FLOAT16, BFLOAT16 or FLOAT32", OP);
    if (ei->dtype != ACL_INT32 || er->dtype != ACL_INT32) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: expertIdx and expandedRowIdxOut must be INT32", OP);
    if (check_bf16(OP, "x", a)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BFLOAT16 on %s", OP, sim_soc_name());
    if (a->ndim != 2 || ei->ndim != 2 || ei->dims[0] != a->dims[0])
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: x %s and expertIdx %s must be 2-D with equal first dims", OP, SHAPE(a), SHAPE(ei));
    if (activeNum < 0 || expertCapacity < 0 || expertNum < 0)
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: activeNum, expertCapacity and expertNum must be >= 0", OP);
    if (dropPadMode < 0 || dropPadMode > 1 || expertTokensCountOrCumsumFlag < 0 || expertTokensCountOrCumsumFlag > 2)
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: dropPadMode %lld (0/1) or expertTokensCountOrCumsumFlag %lld (0/1/2) unsupported", OP, (long long)dropPadMode, (long long)expertTokensCountOrCumsumFlag);
    if (sim_soc() == SIM_SOC_310P && dropPadMode != 0) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: %s supports dropPadMode 0 only", OP, sim_soc_name());
    /* Atlas inference (310P): H % 32 == 0 (ops-transformer moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md) */
    if (sim_soc() == SIM_SOC_310P && a->dims[1] % 32 != 0) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: on %s H (%lld) must be a multiple of 32", OP, sim_soc_name(), (long long)a->dims[1]);
    p->N = a->dims[0], p->H = a->dims[1], p->K = ei->dims[1];
    p->active = activeNum, p->cap = expertCapacity, p->E = expertNum, p->drop = dropPadMode, p->cntFlag = expertTokensCountOrCumsumFlag;
    int64_t NK = p->N * p->K;
    if (dropPadMode == 1 && (expertCapacity == 0 || expertNum == 0 || expertCapacity > p->N))
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: drop/pad mode needs expertNum > 0 and expertCapacity in (0, numRows]", OP);
    if (expertTokensCountOrCumsumFlag > 0 && expertNum == 0) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expertTokensCountOrCumsumOut needs expertNum > 0", OP);
    if (expertTokensBeforeCapacityFlag && dropPadMode != 1) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expertTokensBeforeCapacityOut exists in drop/pad mode only", OP);
    if (expertTokensCountOrCumsumFlag > 0 && dropPadMode != 0) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expertTokensCountOrCumsumOut exists in dropless mode only", OP);
    if (dropPadMode == 0) {
        int64_t rows = activeNum > 0 && activeNum < NK ? activeNum : NK;
        if (ex->ndim != 2 || ex->dims[0] != rows || ex->dims[1] != p->H)
            FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expandedXOut %s must be [%lld, %lld]", OP, SHAPE(ex), (long long)rows, (long long)p->H);
    } else if (ex->ndim != 3 || ex->dims[0] != p->E || ex->dims[1] != p->cap || ex->dims[2] != p->H) {
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expandedXOut %s must be [expertNum, expertCapacity, h]", OP, SHAPE(ex));
    }
    if (er->ndim != 1 || er->dims[0] != NK) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expandedRowIdxOut %s must be [%lld]", OP, SHAPE(er), (long long)NK);
    const aclTensor *outs[2] = {p->cnt >= 0 ? T(se, p->cnt) : NULL, p->before >= 0 ? T(se, p->before) : NULL};
    for (int i = 0; i < 2; i++)
        if (outs[i] && (outs[i]->dtype != ACL_INT32 || outs[i]->ndim != 1 || outs[i]->dims[0] != p->E))
            FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expert token counts must be INT32 [expertNum %lld]", OP, (long long)p->E);
    return tboostSimInternal_execFinish(se, (uint64_t)(2 * NK + p->E + 1) * sizeof(int64_t), workspaceSize, executor);
}
SIM_EXECUTE(aclnnMoeInitRoutingV2)

/* ---------------------------------------------------------------- GroupedMatmulV4 */

typedef struct {
    int n;            /* tensors per list (groupType -1: groups; 0: 1) */
    int x[128], w[128], bias[128], out[128];
    int glist;
    int64_t groupType, glType, E;
} GmmP;

static aclnnStatus gmm_one(const aclTensor *x, const aclTensor *w, const aclTensor *b, const aclTensor *o, int64_t row0,
                           int64_t rows, int64_t g, int wBatched) {
    int64_t K = x->dims[x->ndim - 1], Nn = o->dims[o->ndim - 1];
    for (int64_t i = row0; i < row0 + rows; i++)
        for (int64_t j = 0; j < Nn; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) s += ld(x, off2(x, i, k)) * ld(w, wBatched ? off3(w, g, k, j) : off2(w, k, j));
            if (b) s += ld(b, b->ndim == 2 ? off2(b, g, j) : off_lin(b, j));
            st(o, off2(o, i, j), s);
        }
    return ACLNN_SUCCESS;
}

static aclnnStatus gmm_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    GmmP *p = e->x.params;
    if (p->groupType == -1) {
        for (int i = 0; i < p->n; i++) {
            const aclTensor *x = T(e, p->x[i]);
            gmm_one(x, T(e, p->w[i]), p->bias[i] >= 0 ? T(e, p->bias[i]) : NULL, T(e, p->out[i]), 0, x->dims[0], 0, 0);
        }
        return ACLNN_SUCCESS;
    }
    const aclTensor *x = T(e, p->x[0]), *w = T(e, p->w[0]), *o = T(e, p->out[0]), *gl = T(e, p->glist);
    const aclTensor *b = p->bias[0] >= 0 ? T(e, p->bias[0]) : NULL;
    int64_t row = 0, M = x->dims[0];
    for (int64_t g = 0; g < p->E; g++) {
        int64_t v = ld_i(gl, off_lin(gl, g)), cnt = p->glType == 0 ? v - row : v;
        if (cnt < 0 || row + cnt > M) {
            sim_error("aclnnGroupedMatmulV4: groupList[%lld] = %lld gives a group outside x's %lld rows (groupListType %lld)",
                      (long long)g, (long long)v, (long long)M, (long long)p->glType);
            return ACLNN_ERR_PARAM_INVALID;
        }
        gmm_one(x, w, b, o, row, cnt, g, 1);
        row += cnt;
    }
    return ACLNN_SUCCESS;
}

static int list_live(const aclTensorList *l) { return !l || tboostSimInternal_isLive(SIM_OBJ_TLIST, l); }

aclnnStatus aclnnGroupedMatmulV4GetWorkspaceSize(
    const aclTensorList *x, const aclTensorList *weight, const aclTensorList *biasOptional,
    const aclTensorList *scaleOptional, const aclTensorList *offsetOptional, const aclTensorList *antiquantScaleOptional,
    const aclTensorList *antiquantOffsetOptional, const aclTensorList *perTokenScaleOptional,
    const aclTensor *groupListOptional, const aclTensorList *activationInputOptional,
    const aclTensorList *activationQuantScaleOptional, const aclTensorList *activationQuantOffsetOptional,
    int64_t splitItem, int64_t groupType, int64_t groupListType, int64_t actType, aclTensorList *out,
    aclTensorList *activationFeatureOutOptional, aclTensorList *dynQuantScaleOutOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    static const char *OP = "aclnnGroupedMatmulV4";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    if (!x || !weight || !out) {
        sim_error("%s: x, weight and out must not be NULL", OP);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!list_live(x) || !list_live(weight) || !list_live(out) || !list_live(biasOptional)) INVALID("%s: x, weight, bias and out must be live aclTensorLists", OP);
    if (scaleOptional || offsetOptional || antiquantScaleOptional || antiquantOffsetOptional || perTokenScaleOptional ||
        activationInputOptional || activationQuantScaleOptional || activationQuantOffsetOptional ||
        activationFeatureOutOptional || dynQuantScaleOutOptional)
        INVALID("%s: quantization and activation inputs/outputs are not simulated (pass NULL)", OP);
    if (actType != GMM_ACT_TYPE_NONE) INVALID("%s: actType %lld: activations exist only in (de)quantization scenarios", OP, (long long)actType);
    if (weight->size > 128 || (biasOptional && biasOptional->size != weight->size)) INVALID("%s: weight has more than 128 tensors or bias length differs", OP);
    SimExec *se = tboostSimInternal_execNew(OP, gmm_run, sizeof(GmmP));
    if (!se) return ACLNN_ERR_INNER;
    GmmP *p = se->x.params;
    p->groupType = groupType, p->glType = groupListType, p->glist = -1;
    if (groupType == -1) {
        if (splitItem != 0 && splitItem != 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupType -1 needs splitItem 0 or 1", OP);
        if (groupListOptional) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupType -1 takes no groupList", OP);
        if (x->size != weight->size || out->size != weight->size) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x, weight and out lists must have the same length", OP);
        p->n = (int)weight->size;
    } else if (groupType == 0) {
        if (splitItem != 2 && splitItem != 3) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupType 0 (single tensors) needs splitItem 2 or 3", OP);
        if (out->size != 1 || x->size != 1 || weight->size != 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: the SIMULATOR does groupType 0 with single-tensor x, weight and out", OP);
        if (!groupListOptional) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupType 0 needs groupListOptional", OP);
        if (groupListType != 0 && groupListType != 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupListType %lld: 0 (cumsum) or 1 (counts) for float inputs", OP, (long long)groupListType);
        p->n = 1;
    } else {
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupType %lld is not simulated (-1 or 0)", OP, (long long)groupType);
    }
    for (int i = 0; i < p->n; i++) {
        SNAP("x[i]", x->items[i], 1, &p->x[i]);
        SNAP("weight[i]", weight->items[i], 1, &p->w[i]);
        SNAP("out[i]", out->items[i], 1, &p->out[i]);
        SNAP("bias[i]", biasOptional ? biasOptional->items[i] : NULL, 0, &p->bias[i]);
        const aclTensor *a = T(se, p->x[i]), *w = T(se, p->w[i]), *o = T(se, p->out[i]);
        const aclTensor *b = p->bias[i] >= 0 ? T(se, p->bias[i]) : NULL;
        if (!is_float(a->dtype) || w->dtype != a->dtype || o->dtype != a->dtype)
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x %s, weight %s, out %s: one of FLOAT16, BFLOAT16, FLOAT32 for all (quantized types not simulated)", OP, dname(a->dtype), dname(w->dtype), dname(o->dtype));
        if (a->dtype == ACL_FLOAT && groupType == -1 && p->n > 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: FLOAT32 needs single tensors", OP);
        if (b && b->dtype != (a->dtype == ACL_FLOAT16 ? ACL_FLOAT16 : ACL_FLOAT))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: bias must be %s for %s inputs", OP, a->dtype == ACL_FLOAT16 ? "FLOAT16" : "FLOAT32", dname(a->dtype));
        if (check_bf16(OP, "x", a)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BFLOAT16 on %s", OP, sim_soc_name());
        int wNd = groupType == 0 ? 3 : 2;
        /* Atlas inference (310P): FLOAT16 only, weight in FRACTAL_NZ, N a multiple of 16
         * (ops-transformer gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md, product constraints) */
        if (sim_soc() == SIM_SOC_310P && (a->dtype != ACL_FLOAT16 || w->format != ACL_FORMAT_FRACTAL_NZ || w->dims[wNd - 1] % 16 != 0))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: on %s x must be FLOAT16 (%s), weight FRACTAL_NZ (format %d) and N %% 16 == 0 (N %lld)", OP,
                 sim_soc_name(), dname(a->dtype), (int)w->format, (long long)w->dims[wNd - 1]);
        if (a->ndim != 2 || w->ndim != wNd || o->ndim != 2 || w->dims[wNd - 2] != a->dims[1] || o->dims[0] != a->dims[0] || o->dims[1] != w->dims[wNd - 1])
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x %s, weight %s, out %s do not fit (x [m,k], weight %s, out [m,n])", OP, SHAPE(a), SHAPE(w), SHAPE(o), wNd == 3 ? "[e,k,n]" : "[k,n]");
        if (a->strides[1] != 1 && a->dims[1] > 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x cannot be transposed", OP);
        if (groupType == 0) {
            p->E = w->dims[0];
            if (b && (b->ndim != 2 || b->dims[0] != p->E || b->dims[1] != w->dims[2])) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: bias %s must be [e, n]", OP, SHAPE(b));
        } else if (b && (b->ndim != 1 || b->dims[0] != w->dims[1])) {
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: bias %s must be [n]", OP, SHAPE(b));
        }
    }
    if (groupType == 0) {
        SNAP("groupListOptional", groupListOptional, 1, &p->glist);
        const aclTensor *g = T(se, p->glist);
        if (g->dtype != ACL_INT64 || g->ndim != 1 || g->dims[0] != p->E)
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: groupList must be INT64 [e = %lld], got %s %s", OP, (long long)p->E, dname(g->dtype), SHAPE(g));
        if (p->E > 1024) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: at most 1024 groups", OP);
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnGroupedMatmulV4)

/* ---------------------------------------------------------------- MoeFinalizeRoutingV2 */

typedef struct {
    int ex, erow, x1, x2, bias, scales, eidx, out;
    int64_t N, K, H, mode, rowsX;
} FinP;

static aclnnStatus fin_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    FinP *p = e->x.params;
    const aclTensor *ex = T(e, p->ex), *er = T(e, p->erow), *o = T(e, p->out);
    const aclTensor *x1 = p->x1 >= 0 ? T(e, p->x1) : NULL, *x2 = p->x2 >= 0 ? T(e, p->x2) : NULL;
    const aclTensor *bias = p->bias >= 0 ? T(e, p->bias) : NULL, *sc = p->scales >= 0 ? T(e, p->scales) : NULL;
    const aclTensor *ei = p->eidx >= 0 ? T(e, p->eidx) : NULL;
    for (int64_t i = 0; i < p->N; i++)
        for (int64_t j = 0; j < p->H; j++) {
            double s = 0;
            if (x1) s += ld(x1, off2(x1, i, j));
            if (x2) s += ld(x2, off2(x2, i, j));
            for (int64_t k = 0; k < p->K; k++) {
                int64_t at = (p->mode == 0 || p->mode == 1) ? i + k * p->N : i * p->K + k;
                int64_t r = ld_i(er, off_lin(er, at));
                if (r == -1 && (p->mode == 1 || p->mode == 3)) continue; /* dropped */
                if (r < 0 || r >= p->rowsX) {
                    sim_error("aclnnMoeFinalizeRoutingV2: expandedRowIdx[%lld] = %lld is outside [0, %lld)", (long long)at, (long long)r, (long long)p->rowsX);
                    return ACLNN_ERR_PARAM_INVALID;
                }
                double v = ld(ex, off_lin(ex, r * p->H + j));
                if (bias) {
                    int64_t id = ld_i(ei, off2(ei, i, k));
                    if (id < 0 || id >= bias->dims[0]) {
                        sim_error("aclnnMoeFinalizeRoutingV2: expertIdx[%lld][%lld] = %lld has no bias row", (long long)i, (long long)k, (long long)id);
                        return ACLNN_ERR_PARAM_INVALID;
                    }
                    v += ld(bias, off2(bias, id, j));
                }
                s += (sc ? ld(sc, off2(sc, i, k)) : 1.0) * v;
            }
            st(o, off2(o, i, j), s);
        }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnMoeFinalizeRoutingV2GetWorkspaceSize(const aclTensor *expandedX, const aclTensor *expandedRowIdx,
                                                      const aclTensor *x1Optional, const aclTensor *x2Optional,
                                                      const aclTensor *biasOptional, const aclTensor *scalesOptional,
                                                      const aclTensor *expertIdxOptional, int64_t dropPadMode,
                                                      const aclTensor *out, uint64_t *workspaceSize,
                                                      aclOpExecutor **executor) {
    static const char *OP = "aclnnMoeFinalizeRoutingV2";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, fin_run, sizeof(FinP));
    if (!se) return ACLNN_ERR_INNER;
    FinP *p = se->x.params;
    SNAP("expandedX", expandedX, 1, &p->ex);
    SNAP("expandedRowIdx", expandedRowIdx, 1, &p->erow);
    SNAP("x1Optional", x1Optional, 0, &p->x1);
    SNAP("x2Optional", x2Optional, 0, &p->x2);
    SNAP("biasOptional", biasOptional, 0, &p->bias);
    SNAP("scalesOptional", scalesOptional, 0, &p->scales);
    SNAP("expertIdxOptional", expertIdxOptional, 0, &p->eidx);
    SNAP("out", out, 1, &p->out);
    const aclTensor *ex = T(se, p->ex), *er = T(se, p->erow), *o = T(se, p->out);
    if (dropPadMode < 0 || dropPadMode > 3) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: dropPadMode %lld is not 0..3", OP, (long long)dropPadMode);
    /* Atlas inference (310P): x1, x2, bias and expertIdx NULL and dropPadMode 2
     * (ops-transformer moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md) */
    if (sim_soc() == SIM_SOC_310P && (p->x1 >= 0 || p->x2 >= 0 || p->bias >= 0 || p->eidx >= 0 || dropPadMode != 2))
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: on %s x1, x2, bias and expertIdx must be NULL and dropPadMode 2 (got %lld)", OP, sim_soc_name(), (long long)dropPadMode);
    if (!is_float(ex->dtype) || o->dtype != ex->dtype) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: expandedX and out must share FLOAT16, BFLOAT16 or FLOAT32", OP);
    if (er->dtype != ACL_INT32 || er->ndim != 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: expandedRowIdx must be INT32 1-D", OP);
    if (check_bf16(OP, "expandedX", ex)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BFLOAT16 on %s", OP, sim_soc_name());
    if (p->x2 >= 0 && p->x1 < 0) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: x1Optional must be given before x2Optional", OP);
    if (p->bias >= 0 && p->eidx < 0) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: biasOptional needs expertIdxOptional", OP);
    if (o->ndim != 2) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: out %s must be [NUM_ROWS, H]", OP, SHAPE(o));
    p->N = o->dims[0], p->H = o->dims[1], p->mode = dropPadMode;
    if (p->scales >= 0) {
        const aclTensor *s = T(se, p->scales);
        if (s->ndim != 2 || s->dims[0] != p->N) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: scales %s must be [NUM_ROWS, K]", OP, SHAPE(s));
        if (s->dtype != ex->dtype && !(ex->dtype == ACL_BF16 && s->dtype == ACL_FLOAT)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: scales dtype %s does not go with expandedX %s", OP, dname(s->dtype), dname(ex->dtype));
        p->K = s->dims[1];
    } else {
        p->K = 1;
    }
    if (er->dims[0] != p->N * p->K) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expandedRowIdx %s must be [NUM_ROWS*K = %lld]", OP, SHAPE(er), (long long)(p->N * p->K));
    if (dropPadMode == 0 || dropPadMode == 2) {
        if (ex->ndim != 2 || ex->dims[1] != p->H) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: dropless expandedX %s must be [rows, H = %lld]", OP, SHAPE(ex), (long long)p->H);
        p->rowsX = ex->dims[0];
    } else {
        if (ex->ndim != 3 || ex->dims[2] != p->H) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: drop/pad expandedX %s must be [E, C, H]", OP, SHAPE(ex));
        p->rowsX = ex->dims[0] * ex->dims[1];
    }
    const aclTensor *sides[2] = {p->x1 >= 0 ? T(se, p->x1) : NULL, p->x2 >= 0 ? T(se, p->x2) : NULL};
    for (int i = 0; i < 2; i++)
        if (sides[i] && (!same_shape(sides[i], o) || sides[i]->dtype != ex->dtype)) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: x1/x2 must be out's shape and expandedX's dtype", OP);
    if (p->bias >= 0) {
        const aclTensor *b = T(se, p->bias), *ei = T(se, p->eidx);
        if (b->ndim != 2 || b->dims[1] != p->H || b->dtype != ex->dtype) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: bias %s must be [E, H]", OP, SHAPE(b));
        if (ei->dtype != ACL_INT32 || ei->ndim != 2 || ei->dims[0] != p->N || ei->dims[1] != p->K) FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: expertIdx must be INT32 [NUM_ROWS, K]", OP);
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnMoeFinalizeRoutingV2)
