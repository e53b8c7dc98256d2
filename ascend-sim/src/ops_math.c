/*
 * ascend-sim ops_math.c -- CANN SIMULATOR: the ops-math family (Cast, Add, InplaceAdd, Mul, Div) with
 * numpy-style broadcasting, reference math in double. Not CANN: see ascend-sim/README.md.
 */
#include "ops_common.h"


/* ---------------------------------------------------------------- Cast */

typedef struct {
    int x, out;
} CastP;

static aclnnStatus cast_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    CastP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *o = T(e, p->out);
    int64_t n = numel(x);
    for (int64_t i = 0; i < n; i++) st(o, off_lin(o, i), ld(x, off_lin(x, i)));
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, const aclDataType dtype, aclTensor *out,
                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *OP = "aclnnCast";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, cast_run, sizeof(CastP));
    if (!se) return ACLNN_ERR_INNER;
    CastP *p = se->x.params;
    SNAP("self", self, 1, &p->x);
    SNAP("out", out, 1, &p->out);
    const aclTensor *x = T(se, p->x), *o = T(se, p->out);
    if (o->dtype != dtype) {
        tboostSimInternal_execAbort(se);
        INVALID("%s: out is %s but dtype asks for %s", OP, dname(o->dtype), dname(dtype));
    }
    if (!same_shape(x, o)) {
        tboostSimInternal_execAbort(se);
        INVALID("%s: out %s must have self's shape %s", OP, SHAPE(o), SHAPE(x));
    }
    if (check_bf16(OP, "self", x) || check_bf16(OP, "out", o)) {
        tboostSimInternal_execAbort(se);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnCast)

/* ---------------------------------------------------------------- binary ops with broadcasting */

typedef struct {
    int a, b, out;
    double alpha;
    int mul; /* 0 add, 1 mul, 2 div */
} BinP;

static aclnnStatus bin_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    BinP *p = e->x.params;
    const aclTensor *a = T(e, p->a), *b = T(e, p->b), *o = T(e, p->out);
    int64_t n = numel(o);
    int64_t idx[SIM_MAX_DIM];
    for (int64_t lin = 0; lin < n; lin++) {
        int64_t r = lin;
        for (int i = o->ndim - 1; i >= 0; i--) idx[i] = r % o->dims[i], r /= o->dims[i];
        int64_t ao = a->offset, bo = b->offset, oo = o->offset;
        for (int i = 0; i < o->ndim; i++) oo += idx[i] * o->strides[i];
        for (int i = 0; i < a->ndim; i++) {
            int oi = o->ndim - a->ndim + i;
            ao += (a->dims[i] == 1 ? 0 : idx[oi]) * a->strides[i];
        }
        for (int i = 0; i < b->ndim; i++) {
            int oi = o->ndim - b->ndim + i;
            bo += (b->dims[i] == 1 ? 0 : idx[oi]) * b->strides[i];
        }
        double x = ld(a, ao), y = ld(b, bo);
        st(o, oo, p->mul == 2 ? x / y : p->mul ? x * y : x + p->alpha * y);
    }
    return ACLNN_SUCCESS;
}

static aclDataType promote(aclDataType a, aclDataType b) {
    if (a == b) return a;
    if (is_float(a) && is_float(b)) return ACL_FLOAT;
    if (is_float(a)) return a;
    if (is_float(b)) return b;
    return dsize(a) >= dsize(b) ? a : b;
}

/* out's shape must be the broadcast of a and b */
static aclnnStatus check_broadcast(const char *OP, const aclTensor *a, const aclTensor *b, const aclTensor *o) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    if (o->ndim != nd) INVALID("%s: out %s is not the broadcast of %s and %s", OP, SHAPE(o), SHAPE(a), SHAPE(b));
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t da = ia >= 0 ? a->dims[ia] : 1, db = ib >= 0 ? b->dims[ib] : 1;
        if (da != db && da != 1 && db != 1)
            INVALID("%s: shapes %s and %s do not broadcast (dim %d: %lld vs %lld)", OP, SHAPE(a), SHAPE(b), i,
                    (long long)da, (long long)db);
        int64_t d = da == 1 ? db : da;
        if (o->dims[i] != d) INVALID("%s: out %s is not the broadcast of %s and %s", OP, SHAPE(o), SHAPE(a), SHAPE(b));
    }
    if (o->dtype != promote(a->dtype, b->dtype))
        INVALID("%s: out is %s; %s with %s gives %s", OP, dname(o->dtype), dname(a->dtype), dname(b->dtype),
                dname(promote(a->dtype, b->dtype)));
    if (check_bf16(OP, "self", a) || check_bf16(OP, "other", b)) return ACLNN_ERR_PARAM_INVALID;
    return ACLNN_SUCCESS;
}

static aclnnStatus bin_gws(const char *OP, const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                           int needAlpha, const aclTensor *out, int inplace, int mul, uint64_t *workspaceSize,
                           aclOpExecutor **executor) {
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    if (needAlpha && !alpha) {
        sim_error("%s: alpha is NULL", OP);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (alpha && !tboostSimInternal_isLive(SIM_OBJ_SCALAR, alpha)) INVALID("%s: alpha is not a live aclScalar", OP);
    SimExec *se = tboostSimInternal_execNew(OP, bin_run, sizeof(BinP));
    if (!se) return ACLNN_ERR_INNER;
    BinP *p = se->x.params;
    SNAP("self", self, 1, &p->a);
    SNAP("other", other, 1, &p->b);
    if (inplace)
        p->out = p->a;
    else
        SNAP("out", out, 1, &p->out);
    p->alpha = alpha ? alpha->value : 1.0;
    p->mul = mul;
    CHECK(check_broadcast(OP, T(se, p->a), T(se, p->b), T(se, p->out)));
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}

aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                     aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return bin_gws("aclnnAdd", self, other, alpha, 1, out, 0, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnAdd)

aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other, const aclScalar *alpha,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    return bin_gws("aclnnInplaceAdd", selfRef, other, alpha, 1, NULL, 1, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnInplaceAdd)

aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    return bin_gws("aclnnMul", self, other, NULL, 0, out, 0, 1, workspaceSize, executor);
}
SIM_EXECUTE(aclnnMul)

/* hicann/ops-math math/div/op_host/op_api/aclnn_div.h: out = self / other (true division, broadcasting). */
aclnnStatus aclnnDivGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    return bin_gws("aclnnDiv", self, other, NULL, 0, out, 0, 2, workspaceSize, executor);
}
SIM_EXECUTE(aclnnDiv)
