/*
 * ascend-sim ops_nn.c -- CANN SIMULATOR: the ops-nn family (RmsNorm, AddRmsNorm, Matmul, Mm, SwiGlu,
 * Embedding) with the semantics and checks of their docs (NN norm/rms_norm/docs/aclnnRmsNorm.md, ...).
 * Reference math in double. Not CANN: see ascend-sim/README.md.
 */
#include "ops_common.h"


/* ---------------------------------------------------------------- RmsNorm / AddRmsNorm */

typedef struct {
    int x1, x2, gamma, y, rstd, xout;
    double eps;
    int64_t rows, cols;
} NormP;

static aclnnStatus norm_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    NormP *p = e->x.params;
    const aclTensor *x1 = T(e, p->x1), *g = T(e, p->gamma), *y = T(e, p->y);
    const aclTensor *x2 = p->x2 >= 0 ? T(e, p->x2) : NULL, *rs = p->rstd >= 0 ? T(e, p->rstd) : NULL;
    const aclTensor *xo = p->xout >= 0 ? T(e, p->xout) : NULL;
    double *row = malloc((size_t)p->cols * sizeof(double));
    if (!row) return ACLNN_ERR_INNER;
    for (int64_t r = 0; r < p->rows; r++) {
        double ss = 0;
        for (int64_t c = 0; c < p->cols; c++) {
            int64_t lin = r * p->cols + c;
            double v = ld(x1, off_lin(x1, lin));
            if (x2) v += ld(x2, off_lin(x2, lin));
            row[c] = v;
            ss += v * v;
        }
        double rstd = 1.0 / sqrt(ss / (double)p->cols + p->eps);
        for (int64_t c = 0; c < p->cols; c++) {
            int64_t lin = r * p->cols + c;
            if (xo) st(xo, off_lin(xo, lin), row[c]);
            st(y, off_lin(y, lin), row[c] * rstd * ld(g, off_lin(g, c)));
        }
        if (rs) st(rs, off_lin(rs, r), rstd);
    }
    free(row);
    return ACLNN_SUCCESS;
}

static aclnnStatus norm_check(const char *op, const aclTensor *x, const aclTensor *gamma, const aclTensor *y,
                              const aclTensor *rstd, int64_t *rows, int64_t *cols) {
    if (!is_float(x->dtype)) INVALID("%s: x must be FLOAT, FLOAT16 or BFLOAT16, not %s", op, dname(x->dtype));
    if (gamma->dtype != x->dtype && gamma->dtype != ACL_FLOAT)
        INVALID("%s: gamma %s does not go with x %s (same dtype or FLOAT32)", op, dname(gamma->dtype), dname(x->dtype));
    if (y->dtype != x->dtype) INVALID("%s: yOut must have x's dtype %s, not %s", op, dname(x->dtype), dname(y->dtype));
    if (check_bf16(op, "x", x)) return ACLNN_ERR_PARAM_INVALID;
    if (gamma->ndim < 1 || gamma->ndim > x->ndim) SHAPE_ERR("%s: gamma %s must match the trailing dims of x %s", op, SHAPE(gamma), SHAPE(x));
    int64_t c = 1;
    for (int i = 0; i < gamma->ndim; i++) {
        if (gamma->dims[i] != x->dims[x->ndim - gamma->ndim + i])
            SHAPE_ERR("%s: gamma %s must equal the trailing dims of x %s", op, SHAPE(gamma), SHAPE(x));
        c *= gamma->dims[i];
    }
    if (!same_shape(x, y)) SHAPE_ERR("%s: yOut %s must have x's shape %s", op, SHAPE(y), SHAPE(x));
    if (rstd) {
        if (rstd->dtype != ACL_FLOAT) INVALID("%s: rstdOut must be FLOAT32, not %s", op, dname(rstd->dtype));
        int ok = rstd->ndim == x->ndim;
        for (int i = 0; ok && i < x->ndim; i++)
            ok = rstd->dims[i] == (i < x->ndim - gamma->ndim ? x->dims[i] : 1);
        if (!ok) SHAPE_ERR("%s: rstdOut %s must be x's shape %s with the normalized dims set to 1", op, SHAPE(rstd), SHAPE(x));
    }
    if (sim_soc() == SIM_SOC_310P && c * (int64_t)dsize(x->dtype) < 32)
        INVALID("%s: on %s the normalized size must be at least 32 bytes (%lld)", op, sim_soc_name(),
                (long long)(c * (int64_t)dsize(x->dtype)));
    *cols = c;
    *rows = c ? numel(x) / c : 0;
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double epsilon,
                                         const aclTensor *yOut, const aclTensor *rstdOut, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    static const char *OP = "aclnnRmsNorm";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, norm_run, sizeof(NormP));
    if (!se) return ACLNN_ERR_INNER;
    NormP *p = se->x.params;
    p->x2 = p->xout = -1;
    SNAP("x", x, 1, &p->x1);
    SNAP("gamma", gamma, 1, &p->gamma);
    SNAP("yOut", yOut, 1, &p->y);
    SNAP("rstdOut", rstdOut, 1, &p->rstd);
    p->eps = epsilon;
    CHECK(norm_check(OP, T(se, p->x1), T(se, p->gamma), T(se, p->y), T(se, p->rstd), &p->rows, &p->cols));
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnRmsNorm)

aclnnStatus aclnnAddRmsNormGetWorkspaceSize(const aclTensor *x1, const aclTensor *x2, const aclTensor *gamma,
                                            double epsilon, aclTensor *yOut, aclTensor *rstdOut, aclTensor *xOut,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *OP = "aclnnAddRmsNorm";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, norm_run, sizeof(NormP));
    if (!se) return ACLNN_ERR_INNER;
    NormP *p = se->x.params;
    SNAP("x1", x1, 1, &p->x1);
    SNAP("x2", x2, 1, &p->x2);
    SNAP("gamma", gamma, 1, &p->gamma);
    SNAP("yOut", yOut, 1, &p->y);
    SNAP("rstdOut", rstdOut, 0, &p->rstd);
    SNAP("xOut", xOut, 0, &p->xout);
    p->eps = epsilon;
    const aclTensor *a = T(se, p->x1), *b = T(se, p->x2);
    if (p->rstd >= 0 && p->xout < 0) {
        tboostSimInternal_execAbort(se);
        INVALID("%s: rstdOut is given but xOut is NULL", OP);
    }
    if (!same_shape(a, b) || a->dtype != b->dtype) {
        tboostSimInternal_execAbort(se);
        INVALID("%s: x1 %s %s and x2 %s %s must match", OP, dname(a->dtype), SHAPE(a), dname(b->dtype), SHAPE(b));
    }
    if (p->xout >= 0 && (!same_shape(a, T(se, p->xout)) || T(se, p->xout)->dtype != a->dtype)) {
        tboostSimInternal_execAbort(se);
        INVALID("%s: xOut must have x1's shape and dtype", OP);
    }
    CHECK(norm_check(OP, a, T(se, p->gamma), T(se, p->y), p->rstd >= 0 ? T(se, p->rstd) : NULL, &p->rows, &p->cols));
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnAddRmsNorm)

/* ---------------------------------------------------------------- Matmul / Mm */

typedef struct {
    int a, b, out;
    int64_t batch, m, k, n;
    int aBatched, bBatched;
} MmP;

static aclnnStatus mm_run(SimExec *e, void *ws, uint64_t wsSize) {
    MmP *p = e->x.params;
    const aclTensor *a = T(e, p->a), *b = T(e, p->b), *o = T(e, p->out);
    /* accumulate in the workspace (f32 on the cube unit; double here) */
    double *acc = ws;
    if (wsSize < (uint64_t)(p->m * p->n) * sizeof(double)) return ACLNN_ERR_INNER;
    for (int64_t bi = 0; bi < p->batch; bi++) {
        for (int64_t i = 0; i < p->m; i++)
            for (int64_t j = 0; j < p->n; j++) {
                double s = 0;
                for (int64_t kk = 0; kk < p->k; kk++) {
                    int64_t ao = p->aBatched ? off3(a, bi, i, kk) : off2(a, i, kk);
                    int64_t bo = p->bBatched ? off3(b, bi, kk, j) : off2(b, kk, j);
                    s += ld(a, ao) * ld(b, bo);
                }
                acc[i * p->n + j] = s;
            }
        for (int64_t i = 0; i < p->m; i++)
            for (int64_t j = 0; j < p->n; j++)
                st(o, o->ndim == 3 ? off3(o, bi, i, j) : off2(o, i, j), acc[i * p->n + j]);
    }
    return ACLNN_SUCCESS;
}

/* The promotion table of the aclnn docs (互推导关系): equal dtypes stay; any mix of FLOAT16, BFLOAT16
 * and FLOAT promotes to FLOAT. */
static aclDataType mm_promote(aclDataType a, aclDataType b) { return a == b ? a : ACL_FLOAT; }

static aclnnStatus mm_gws(const char *OP, int allowBatch, const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                          int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, mm_run, sizeof(MmP));
    if (!se) return ACLNN_ERR_INNER;
    MmP *p = se->x.params;
    SNAP("self", self, 1, &p->a);
    SNAP("mat2", mat2, 1, &p->b);
    SNAP("out", out, 1, &p->out);
    const aclTensor *a = T(se, p->a), *b = T(se, p->b), *o = T(se, p->out);
    aclnnStatus st = ACLNN_SUCCESS;
    if (cubeMathType < 0 || cubeMathType > 3) {
        sim_error("%s: cubeMathType %d is not one of KEEP_DTYPE 0, ALLOW_FP32_DOWN_PRECISION 1, USE_FP16 2, USE_HF32 3", OP, cubeMathType);
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (!is_float(a->dtype) || !is_float(b->dtype) || !is_float(o->dtype)) {
        sim_error("%s: self %s, mat2 %s and out %s must be FLOAT, FLOAT16 or BFLOAT16", OP, dname(a->dtype),
                  dname(b->dtype), dname(o->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (o->dtype != mm_promote(a->dtype, b->dtype) && o->dtype != a->dtype) {
        /* "self and mat2 follow the dtype promotion rules (互推导关系)"; out takes the promoted dtype (or,
         * under cubeMathType, self's): ops-nn matmul/mat_mul_v3/docs/aclnnMm.md */
        sim_error("%s: out %s is neither the promoted dtype %s of self %s and mat2 %s nor self's", OP, dname(o->dtype),
                  dname(mm_promote(a->dtype, b->dtype)), dname(a->dtype), dname(b->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (check_bf16(OP, "self", a) || check_bf16(OP, "mat2", b) || check_bf16(OP, "out", o)) {
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (!(a->ndim == 2 || (allowBatch && a->ndim == 3)) || !(b->ndim == 2 || (allowBatch && b->ndim == 3))) {
        sim_error("%s: self %s and mat2 %s must be 2-D%s", OP, SHAPE(a), SHAPE(b), allowBatch ? " or 3-D (batched)" : "");
        st = ACLNN_ERR_PARAM_INVALID;
    } else {
        p->aBatched = a->ndim == 3, p->bBatched = b->ndim == 3;
        p->m = a->dims[a->ndim - 2], p->k = a->dims[a->ndim - 1], p->n = b->dims[b->ndim - 1];
        p->batch = p->aBatched ? a->dims[0] : p->bBatched ? b->dims[0] : 1;
        int outNd = (p->aBatched || p->bBatched) ? 3 : 2;
        if (b->dims[b->ndim - 2] != p->k || (p->aBatched && p->bBatched && a->dims[0] != b->dims[0])) {
            sim_error("%s: self %s and mat2 %s do not multiply", OP, SHAPE(a), SHAPE(b));
            st = ACLNN_ERR_PARAM_INVALID;
        } else if (o->ndim != outNd || o->dims[outNd - 2] != p->m || o->dims[outNd - 1] != p->n ||
                   (outNd == 3 && o->dims[0] != p->batch)) {
            sim_error("%s: out %s must be [%s%lld, %lld]", OP, SHAPE(o), outNd == 3 ? "batch, " : "", (long long)p->m,
                      (long long)p->n);
            st = ACLNN_ERR_PARAM_INVALID;
        }
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    uint64_t ws = (uint64_t)(p->m * p->n) * sizeof(double);
    return tboostSimInternal_execFinish(se, ws ? ws : 0, workspaceSize, executor);
}

aclnnStatus aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                        int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return mm_gws("aclnnMatmul", 1, self, mat2, out, cubeMathType, workspaceSize, executor);
}
SIM_EXECUTE(aclnnMatmul)

aclnnStatus aclnnMmGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out, int8_t cubeMathType,
                                    uint64_t *workspaceSize, aclOpExecutor **executor) {
    return mm_gws("aclnnMm", 0, self, mat2, out, cubeMathType, workspaceSize, executor);
}
SIM_EXECUTE(aclnnMm)

/* ---------------------------------------------------------------- WeightQuantBatchMatmulV2 */
/* y = x @ ((weight + antiquantOffset) * antiquantScale), the rules of hicann/ops-nn
 * matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md for Atlas A2/A3 ("约束说明"):
 * x 2-D (m, k) FLOAT16/BFLOAT16; weight 2-D (k, n) INT8 or INT4 (INT4: the inner axis even), ND, contiguous
 * or a transpose; antiquantScale FLOAT16/BFLOAT16 = x's dtype, shape per tensor (1,)/(1, 1), per channel
 * (n,)/(1, n), per group (ceil(k/g), n); antiquantOffset scale's shape and dtype; antiquantGroupSize 0 or a
 * multiple of 32 in [32, k-1]; k and n in [1, 65535]; y (m, n) in x's dtype. Simulated: the A16 path without
 * output quantization (quantScale/quantOffset) or bias, which tboost does not pass. Product support: A2/A3 and
 * 950 (the doc's table lists Atlas inference too, with INT8 FLOAT16 only and other shapes: not simulated, so
 * 310P is refused here like 310B and the training series, which the table leaves out). */

typedef struct {
    int x, w, scale, offset, y;
    int64_t m, k, n, group;
    int perGroup;
} WqbmmP;

static aclnnStatus wqbmm_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    WqbmmP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *w = T(e, p->w), *sc = T(e, p->scale), *y = T(e, p->y);
    const aclTensor *of = p->offset >= 0 ? T(e, p->offset) : NULL;
    int64_t sn = sc->ndim == 2 ? 1 : 0; /* the n axis of the scale */
    for (int64_t i = 0; i < p->m; i++)
        for (int64_t j = 0; j < p->n; j++) {
            double s = 0;
            for (int64_t kk = 0; kk < p->k; kk++) {
                int64_t g = p->perGroup ? kk / p->group : 0;
                int64_t gi = sc->ndim == 2 ? g : 0, ji = sc->dims[sn] == 1 ? 0 : j;
                int64_t so = sc->offset + (sc->ndim == 2 ? gi * sc->strides[0] : 0) + ji * sc->strides[sn];
                /* the dequantized weight is rounded to x's dtype before the cube multiplies it */
                double wv = ld(w, off2(w, kk, j));
                if (of) wv += ld(of, of->offset + (of->ndim == 2 ? gi * of->strides[0] : 0) + ji * of->strides[sn]);
                wv *= ld(sc, so);
                wv = x->dtype == ACL_BF16 ? bf16_to_f32(f32_to_bf16((float)wv)) : f16_to_f32(f32_to_f16((float)wv));
                s += ld(x, off2(x, i, kk)) * wv;
            }
            st(y, off2(y, i, j), s);
        }
    return ACLNN_SUCCESS;
}


aclnnStatus aclnnWeightQuantBatchMatmulV2GetWorkspaceSize(const aclTensor *x, const aclTensor *weight,
                                                          const aclTensor *antiquantScale,
                                                          const aclTensor *antiquantOffsetOptional,
                                                          const aclTensor *quantScaleOptional,
                                                          const aclTensor *quantOffsetOptional,
                                                          const aclTensor *biasOptional, int antiquantGroupSize,
                                                          const aclTensor *y, uint64_t *workspaceSize,
                                                          aclOpExecutor **executor) {
    const char *OP = "aclnnWeightQuantBatchMatmulV2";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    if (!soc_is_a2a3()) {
        /* the doc's return table: 361001 (ACLNN_ERR_RUNTIME_ERROR) "产品型号不支持" */
        sim_error("%s: %s is not supported (simulated for Atlas A2/A3 and Ascend950)", OP, sim_soc_name());
        return ACLNN_ERR_RUNTIME_ERROR;
    }
    if (quantScaleOptional || quantOffsetOptional || biasOptional) {
        sim_error("%s: quantScale, quantOffset and bias are not simulated (pass NULL)", OP);
        return ACLNN_ERR_PARAM_INVALID;
    }
    SimExec *se = tboostSimInternal_execNew(OP, wqbmm_run, sizeof(WqbmmP));
    if (!se) return ACLNN_ERR_INNER;
    WqbmmP *p = se->x.params;
    SNAP("x", x, 1, &p->x);
    SNAP("weight", weight, 1, &p->w);
    SNAP("antiquantScale", antiquantScale, 1, &p->scale);
    SNAP("antiquantOffsetOptional", antiquantOffsetOptional, 0, &p->offset);
    SNAP("y", y, 1, &p->y);
    const aclTensor *a = T(se, p->x), *w = T(se, p->w), *sc = T(se, p->scale), *o = T(se, p->y);
    const aclTensor *of = p->offset >= 0 ? T(se, p->offset) : NULL;
    aclnnStatus st = ACLNN_ERR_PARAM_INVALID;
    if (a->ndim != 2 || w->ndim != 2 || o->ndim != 2) {
        sim_error("%s: x %s, weight %s and y %s must be 2-D", OP, SHAPE(a), SHAPE(w), SHAPE(o));
    } else if (a->dtype != ACL_FLOAT16 && a->dtype != ACL_BF16) {
        sim_error("%s: x is %s (FLOAT16 or BFLOAT16)", OP, dname(a->dtype));
    } else if (w->dtype != ACL_INT8 && w->dtype != ACL_INT4) {
        sim_error("%s: weight is %s (INT8 or INT4; INT32 only as INT4Pack, not simulated)", OP, dname(w->dtype));
    } else if (sc->dtype != a->dtype || o->dtype != a->dtype || (of && of->dtype != a->dtype)) {
        sim_error("%s: antiquantScale %s, antiquantOffset %s and y %s must be x's dtype %s", OP, dname(sc->dtype),
                  of ? dname(of->dtype) : "(none)", dname(o->dtype), dname(a->dtype));
    } else if (!is_transpose_or_contig(a) || !is_transpose_or_contig(w) || !is_transpose_or_contig(sc) ||
               (of && !is_transpose_or_contig(of)) || o->strides[1] != 1 || o->strides[0] != o->dims[1]) {
        sim_error("%s: a non-contiguous tensor that is not a transpose (x %s, weight %s, scale %s, y %s)", OP,
                  SHAPE(a), SHAPE(w), SHAPE(sc), SHAPE(o));
    } else {
        p->m = a->dims[0], p->k = a->dims[1], p->n = w->dims[1];
        int64_t inner = w->strides[1] == 1 ? w->dims[1] : w->dims[0];
        if (w->dims[0] != p->k) {
            sim_error("%s: x %s and weight %s differ in k", OP, SHAPE(a), SHAPE(w));
        } else if (p->k < 1 || p->k > 65535 || p->n < 1 || p->n > 65535) {
            sim_error("%s: k %lld and n %lld must be in [1, 65535]", OP, (long long)p->k, (long long)p->n);
        } else if (p->m < 1) {
            sim_error("%s: m %lld (empty tensors are not supported)", OP, (long long)p->m);
        } else if (w->dtype == ACL_INT4 && inner % 2) {
            sim_error("%s: an INT4 weight's inner axis (%lld) must be even", OP, (long long)inner);
        } else if (o->dims[0] != p->m || o->dims[1] != p->n) {
            sim_error("%s: y %s must be [%lld, %lld]", OP, SHAPE(o), (long long)p->m, (long long)p->n);
        } else if (of && !same_shape(of, sc)) {
            sim_error("%s: antiquantOffset %s must have antiquantScale's shape %s", OP, SHAPE(of), SHAPE(sc));
        } else if (antiquantGroupSize != 0 &&
                   (antiquantGroupSize < 32 || antiquantGroupSize % 32 || antiquantGroupSize > p->k - 1)) {
            sim_error("%s: antiquantGroupSize %d must be 0 or a multiple of 32 in [32, k-1 = %lld]", OP,
                      antiquantGroupSize, (long long)(p->k - 1));
        } else {
            p->group = antiquantGroupSize, p->perGroup = antiquantGroupSize != 0;
            int64_t groups = p->perGroup ? (p->k + p->group - 1) / p->group : 1;
            int ok;
            if (p->perGroup)
                ok = sc->ndim == 2 && sc->dims[0] == groups && sc->dims[1] == p->n;
            else /* per tensor (1,)/(1, 1) or per channel (n,)/(1, n) */
                ok = (sc->ndim == 1 && (sc->dims[0] == 1 || sc->dims[0] == p->n)) ||
                     (sc->ndim == 2 && sc->dims[0] == 1 && (sc->dims[1] == 1 || sc->dims[1] == p->n));
            if (!ok)
                sim_error("%s: antiquantScale %s does not fit %s (k %lld, n %lld, group %d)", OP, SHAPE(sc),
                          p->perGroup ? "per group (ceil(k/group), n)" : "per tensor or per channel", (long long)p->k,
                          (long long)p->n, antiquantGroupSize);
            else
                st = ACLNN_SUCCESS;
        }
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnWeightQuantBatchMatmulV2)

/* ---------------------------------------------------------------- SwiGlu */

typedef struct {
    int x, out;
    int dim;
} SwiGluP;

static aclnnStatus swiglu_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    SwiGluP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *o = T(e, p->out);
    int64_t n = numel(o), half = o->dims[p->dim];
    int64_t idx[SIM_MAX_DIM];
    for (int64_t lin = 0; lin < n; lin++) {
        int64_t r = lin;
        for (int i = o->ndim - 1; i >= 0; i--) idx[i] = r % o->dims[i], r /= o->dims[i];
        int64_t ao = x->offset, bo = x->offset, oo = o->offset;
        for (int i = 0; i < o->ndim; i++) {
            ao += idx[i] * x->strides[i];
            bo += (idx[i] + (i == p->dim ? half : 0)) * x->strides[i];
            oo += idx[i] * o->strides[i];
        }
        double a = ld(x, ao), b = ld(x, bo);
        st(o, oo, a / (1.0 + exp(-a)) * b);
    }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnSwiGluGetWorkspaceSize(const aclTensor *x, int64_t dim, const aclTensor *out, uint64_t *workspaceSize,
                                        aclOpExecutor **executor) {
    static const char *OP = "aclnnSwiGlu";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, swiglu_run, sizeof(SwiGluP));
    if (!se) return ACLNN_ERR_INNER;
    SwiGluP *p = se->x.params;
    SNAP("x", x, 1, &p->x);
    SNAP("out", out, 1, &p->out);
    const aclTensor *a = T(se, p->x), *o = T(se, p->out);
    int nd = a->ndim;
    aclnnStatus st = ACLNN_SUCCESS;
    if (!is_float(a->dtype) || o->dtype != a->dtype) {
        sim_error("%s: x %s / out %s must be one of BFLOAT16, FLOAT16, FLOAT32", OP, dname(a->dtype), dname(o->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (check_bf16(OP, "x", a)) {
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (nd < 1 || dim < -nd || dim >= nd) {
        sim_error("%s: dim %lld is outside [-%d, %d]", OP, (long long)dim, nd, nd - 1);
        st = ACLNN_ERR_PARAM_INVALID;
    } else {
        p->dim = (int)(dim < 0 ? dim + nd : dim);
        int ok = o->ndim == nd && a->dims[p->dim] % 2 == 0;
        for (int i = 0; ok && i < nd; i++) ok = o->dims[i] == (i == p->dim ? a->dims[i] / 2 : a->dims[i]);
        if (!ok) {
            sim_error("%s: x %s must be even along dim %d and out %s must be x halved there", OP, SHAPE(a), p->dim, SHAPE(o));
            st = ACLNN_ERR_PARAM_INVALID;
        }
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnSwiGlu)

/* ---------------------------------------------------------------- GeluV2
 * hicann/ops-nn activation/gelu_v2/docs/aclnnGeluV2.md: y = x * Phi(x); approximate 0 "none" (Phi the normal
 * CDF, 0.5 (1 + erf(x / sqrt 2))), 1 "tanh" (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))). x and y
 * FLOAT32/FLOAT16/BFLOAT16 (bf16 not on Atlas inference/training), same dtype and shape, 0..8 dims; not on
 * 200I/500 A2 (310B). Errors: NULL x/y 161001; dtype, dtype mismatch or shape mismatch 161002. */

typedef struct {
    int x, out;
    int tanh;
} GeluP;

static aclnnStatus gelu_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    GeluP *p = e->x.params;
    const aclTensor *x = T(e, p->x), *o = T(e, p->out);
    int64_t n = numel(x);
    for (int64_t i = 0; i < n; i++) {
        double v = ld(x, off_lin(x, i));
        double y = p->tanh ? 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
                           : 0.5 * v * (1.0 + erf(v / sqrt(2.0)));
        st(o, off_lin(o, i), y);
    }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnGeluV2GetWorkspaceSize(const aclTensor *x, int64_t approximate, aclTensor *y, uint64_t *workspaceSize,
                                        aclOpExecutor **executor) {
    static const char *OP = "aclnnGeluV2";
    FAULT_GWS(OP);
    SOC_KERNEL(OP);
    OUTS_NULL(OP);
    if (!x || !y) {
        sim_error("%s: x and y must not be NULL", OP);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    SimExec *se = tboostSimInternal_execNew(OP, gelu_run, sizeof(GeluP));
    if (!se) return ACLNN_ERR_INNER;
    GeluP *p = se->x.params;
    SNAP("x", x, 1, &p->x);
    SNAP("y", y, 1, &p->out);
    const aclTensor *a = T(se, p->x), *o = T(se, p->out);
    aclnnStatus st = ACLNN_SUCCESS;
    if (!is_float(a->dtype) || o->dtype != a->dtype) {
        sim_error("%s: x %s / y %s must be one of FLOAT32, FLOAT16, BFLOAT16, both the same", OP, dname(a->dtype),
                  dname(o->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (check_bf16(OP, "x", a)) {
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (!same_shape(a, o) || a->ndim > 8) {
        sim_error("%s: y %s must have x's shape %s (at most 8 dims)", OP, SHAPE(o), SHAPE(a));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (approximate != 0 && approximate != 1) {
        sim_error("%s: approximate %lld is not 0 (none) or 1 (tanh)", OP, (long long)approximate);
        st = ACLNN_ERR_PARAM_INVALID;
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    p->tanh = approximate == 1;
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnGeluV2)

/* ---------------------------------------------------------------- Embedding */

typedef struct {
    int w, idx, out;
} EmbP;

static aclnnStatus emb_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    EmbP *p = e->x.params;
    const aclTensor *w = T(e, p->w), *ix = T(e, p->idx), *o = T(e, p->out);
    int64_t n = numel(ix), v = w->dims[0], h = w->dims[1];
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ld_i(ix, off_lin(ix, i));
        if (id < 0 || id >= v) {
            sim_error("aclnnEmbedding: indices[%lld] = %lld is outside [0, %lld): the device would read out of bounds",
                      (long long)i, (long long)id, (long long)v);
            return ACLNN_ERR_PARAM_INVALID;
        }
        for (int64_t j = 0; j < h; j++) st(o, off_lin(o, i * h + j), ld(w, off2(w, id, j)));
    }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnEmbeddingGetWorkspaceSize(const aclTensor *weight, const aclTensor *indices, const aclTensor *out,
                                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *OP = "aclnnEmbedding";
    FAULT_GWS(OP);
    OUTS_NULL(OP);
    SimExec *se = tboostSimInternal_execNew(OP, emb_run, sizeof(EmbP));
    if (!se) return ACLNN_ERR_INNER;
    EmbP *p = se->x.params;
    SNAP("weight", weight, 1, &p->w);
    SNAP("indices", indices, 1, &p->idx);
    SNAP("out", out, 1, &p->out);
    const aclTensor *w = T(se, p->w), *ix = T(se, p->idx), *o = T(se, p->out);
    aclnnStatus st = ACLNN_SUCCESS;
    if (w->ndim != 2) {
        sim_error("%s: weight %s must be 2-D [num_embeddings, embedding_dim]", OP, SHAPE(w));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (ix->dtype != ACL_INT32 && ix->dtype != ACL_INT64) {
        sim_error("%s: indices must be INT32 or INT64, not %s", OP, dname(ix->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (o->dtype != w->dtype) {
        sim_error("%s: out %s must have weight's dtype %s", OP, dname(o->dtype), dname(w->dtype));
        st = ACLNN_ERR_PARAM_INVALID;
    } else if (check_bf16(OP, "weight", w)) {
        st = ACLNN_ERR_PARAM_INVALID;
    } else {
        int ok = o->ndim == ix->ndim + 1 && o->dims[o->ndim - 1] == w->dims[1];
        for (int i = 0; ok && i < ix->ndim; i++) ok = o->dims[i] == ix->dims[i];
        if (!ok) {
            sim_error("%s: out %s must be indices' shape %s plus [%lld]", OP, SHAPE(o), SHAPE(ix), (long long)w->dims[1]);
            st = ACLNN_ERR_PARAM_INVALID;
        }
    }
    if (st) {
        tboostSimInternal_execAbort(se);
        return st;
    }
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnEmbedding)
