/*
 * ascend-sim ops_attention.c -- CANN SIMULATOR: aclnnFusedInferAttentionScoreV2/V3/V4/V5 (one reference
 * implementation behind the three signatures) and aclnnScatterPaKvCache. Semantics and checks follow
 * OT attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV2.md (and V3/V4) and
 * OT-EN attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache_en.md. Simulated subset:
 *   - layouts BSH, BSND, BNSD; fp16/bf16 query/key/value/out; no quantization, pse, prefix, padding, rope;
 *   - contiguous KV ([B, S, KV_N, D] in the query's layout, one tensor in each list) or paged KV through
 *     blockTable + blockSize with caches BnBsH [blocks, blockSize, KV_N*D] (or BnNBsD with BNSD queries);
 *   - sparseMode 0 (optional full mask), 1 (full mask), 2 leftUpCausal, 3 rightDownCausal, 4 band (2, 3 and 4
 *     require the 2048x2048 upper-triangular mask, checked). Band (docs/context/sparse_mode参数说明.md: "sparseMode
 *     为4时，代表band场景，即计算preTokens和nextTokens之间的部分，参数起点为右下角，preTokens和nextTokens之间需要有
 *     交集"): with the origin at the right-down corner, row i sees key j when
 *     -preTokens <= j - i - (KV_S - Q_S) <= nextTokens (a sliding window of W keys: preTokens W-1, nextTokens 0);
 *   - Q_S == 1 takes the IncreFlashAttention branch: sparseMode, preTokens/nextTokens ("Q_S为1时该参数无效") and
 *     actualSeqLengths are ignored; its mask is (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S), and with page
 *     attention its last dim must be at least blockTable's second dim * blockSize (FIA V4 doc, PagedAttention).
 * Rows past a batch's actual query length, and rows with no visible key, are written as zeros.
 * Not CANN: see ascend-sim/README.md.
 */
#include "ops_common.h"

#include <limits.h>

enum { LAY_BSH, LAY_BSND, LAY_BNSD };

typedef struct {
    const char *op;
    int q, k, v, mask, bt, out, lse;
    int lay;
    int64_t B, Sq, N, D, KVN, Skv;
    int paged, cacheNz; /* cacheNz: BnNBsD */
    int64_t blockSize, nblocks, maxBlocks;
    int64_t *actQ, *actKv;
    int sparse;
    int64_t preTokens, nextTokens; /* sparseMode 4 */
    double scale;
    int maskB, maskQ1; /* mask has a batch dim / Q_S==1 mask shape (B, KV_S) */
} FiaP;

static void fia_free(void *pp) {
    FiaP *p = pp;
    free(p->actQ);
    free(p->actKv);
}

static int64_t q_off(const FiaP *p, const aclTensor *t, int64_t b, int64_t s, int64_t n, int64_t d, int64_t D) {
    switch (p->lay) {
    case LAY_BSH: return off3(t, b, s, n * D + d);
    case LAY_BSND: return off4(t, b, s, n, d);
    default: return off4(t, b, n, s, d);
    }
}

/* key/value element of batch b at kv position j; -1 when the block table points outside the cache */
static int64_t kv_off(const FiaP *p, const aclTensor *t, const aclTensor *bt, int64_t b, int64_t j, int64_t n,
                      int64_t d) {
    if (!p->paged) return q_off(p, t, b, j, n, d, p->D);
    int64_t blk = ld_i(bt, off2(bt, b, j / p->blockSize)), o = j % p->blockSize;
    if (blk < 0 || blk >= p->nblocks) return -1;
    return p->cacheNz ? off4(t, blk, n, o, d) : off3(t, blk, o, n * p->D + d);
}

static int masked(const FiaP *p, const aclTensor *m, int64_t b, int64_t i, int64_t j) {
    if (!m) return 0;
    int64_t bb = p->maskB ? b : 0;
    if (p->maskQ1) return ld(m, m->ndim == 2 ? off2(m, b, j) : m->ndim == 3 ? off3(m, b, 0, j) : off4(m, b, 0, 0, j)) != 0;
    switch (m->ndim) {
    case 2: return ld(m, off2(m, i, j)) != 0;
    case 3: return ld(m, off3(m, bb, i, j)) != 0;
    default: return ld(m, off4(m, bb, 0, i, j)) != 0;
    }
}

static int check_causal_mask(const aclTensor *m) {
    /* the optimized mask: 2048x2048, 1 strictly above the diagonal ("upper triangle masked out") */
    for (int64_t i = 0; i < 2048; i++)
        for (int64_t j = 0; j < 2048; j++) {
            int64_t o = m->offset + i * m->strides[m->ndim - 2] + j * m->strides[m->ndim - 1];
            if ((((const uint8_t *)m->data)[o] != 0) != (j > i)) return 0;
        }
    return 1;
}

static aclnnStatus fia_run(SimExec *e, void *ws, uint64_t wsSize) {
    FiaP *p = e->x.params;
    const aclTensor *q = T(e, p->q), *k = T(e, p->k), *v = T(e, p->v), *o = T(e, p->out);
    const aclTensor *m = p->mask >= 0 ? T(e, p->mask) : NULL, *bt = p->bt >= 0 ? T(e, p->bt) : NULL;
    const aclTensor *lse = p->lse >= 0 ? T(e, p->lse) : NULL;
    if (p->sparse >= 2 && p->Sq > 1 && !check_causal_mask(m)) {
        sim_error("%s: sparseMode %d needs the optimized 2048x2048 mask with 1 strictly above the diagonal (and 0 "
                  "elsewhere); the one given differs",
                  p->op, p->sparse);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int64_t maxKv = 0;
    for (int64_t b = 0; b < p->B; b++) maxKv = p->actKv[b] > maxKv ? p->actKv[b] : maxKv;
    if (wsSize < (uint64_t)(maxKv + 1) * sizeof(double)) return ACLNN_ERR_INNER;
    double *sc = ws;
    int64_t group = p->N / p->KVN;
    for (int64_t b = 0; b < p->B; b++) {
        int64_t lq = p->Sq == 1 ? 1 : p->actQ[b], lkv = p->actKv[b];
        if (p->paged) /* every block this sequence uses must be a real block */
            for (int64_t j = 0; j < lkv; j += p->blockSize)
                if (kv_off(p, k, bt, b, j, 0, 0) < 0) {
                    sim_error("%s: blockTable[%lld][%lld] = %lld is not a block of the cache (0..%lld): the device "
                              "would read out of bounds",
                              p->op, (long long)b, (long long)(j / p->blockSize),
                              (long long)ld_i(bt, off2(bt, b, j / p->blockSize)), (long long)p->nblocks - 1);
                    return ACLNN_ERR_PARAM_INVALID;
                }
        for (int64_t n = 0; n < p->N; n++) {
            int64_t kn = n / group;
            for (int64_t i = 0; i < p->Sq; i++) {
                int any = 0;
                double mx = -INFINITY, sum = 0;
                if (i < lq) {
                    for (int64_t j = 0; j < lkv; j++) {
                        int vis;
                        if (p->Sq == 1) vis = !masked(p, m, b, i, j);
                        else if (p->sparse == 2) vis = j <= i;
                        else if (p->sparse == 3) vis = j <= i + lkv - lq;
                        else if (p->sparse == 4) {
                            int64_t dd = j - i - (lkv - lq); /* origin at the right-down corner */
                            vis = dd >= -p->preTokens && dd <= p->nextTokens;
                        }
                        else vis = !masked(p, m, b, i, j);
                        if (!vis) {
                            sc[j] = -INFINITY;
                            continue;
                        }
                        double s = 0;
                        for (int64_t d = 0; d < p->D; d++)
                            s += ld(q, q_off(p, q, b, i, n, d, p->D)) * ld(k, kv_off(p, k, bt, b, j, kn, d));
                        sc[j] = s * p->scale;
                        if (sc[j] > mx) mx = sc[j];
                        any = 1;
                    }
                }
                if (any)
                    for (int64_t j = 0; j < lkv; j++) sum += sc[j] == -INFINITY ? 0 : exp(sc[j] - mx);
                for (int64_t d = 0; d < p->D; d++) {
                    double acc = 0;
                    if (any)
                        for (int64_t j = 0; j < lkv; j++)
                            if (sc[j] != -INFINITY) acc += exp(sc[j] - mx) / sum * ld(v, kv_off(p, v, bt, b, j, kn, d));
                    st(o, q_off(p, o, b, i, n, d, p->D), acc);
                }
                if (lse) st(lse, off4(lse, b, n, i, 0), any ? mx + log(sum) : INFINITY);
            }
        }
    }
    return ACLNN_SUCCESS;
}

static aclnnStatus seq_lengths(const char *op, const char *name, const aclIntArray *a, int64_t B, int64_t dflt,
                               int64_t max, int64_t **out) {
    *out = malloc((size_t)(B ? B : 1) * sizeof(int64_t));
    if (!*out) return ACLNN_ERR_INNER;
    if (a && !tboostSimInternal_isLive(SIM_OBJ_INTARRAY, a)) INVALID("%s: %s is not a live aclIntArray", op, name);
    if (a && a->size != 1 && a->size < (uint64_t)B)
        INVALID("%s: %s has %llu entries; it needs 1 or at least B = %lld", op, name, (unsigned long long)a->size,
                (long long)B);
    for (int64_t b = 0; b < B; b++) {
        int64_t x = !a ? dflt : a->size == 1 ? a->values[0] : a->values[b];
        if (x < 0 || x > max) INVALID("%s: %s[%lld] = %lld is outside [0, %lld]", op, name, (long long)b, (long long)x, (long long)max);
        (*out)[b] = x;
    }
    return ACLNN_SUCCESS;
}

#define NOT_SIM(t, name)                                                                      \
    do {                                                                                      \
        if (t) {                                                                              \
            tboostSimInternal_execAbort(se);                                                  \
            INVALID("%s: %s is not simulated (pass NULL)", OP, name);                         \
        }                                                                                     \
    } while (0)
#define FAIL(code, ...)                   \
    do {                                  \
        sim_error(__VA_ARGS__);           \
        tboostSimInternal_execAbort(se);  \
        return (code);                    \
    } while (0)

/* everything V2/V3/V4 share; the version-only inputs were checked NULL by the callers */
static aclnnStatus fia_gws(const char *OP, const aclTensor *query, const aclTensorList *key, const aclTensorList *value,
                           const aclTensor *pse, const aclTensor *attenMask, const aclIntArray *actSeq,
                           const aclIntArray *actSeqKv, const aclTensor *const *unsupported, int nunsupported,
                           const aclIntArray *actSharedPrefix, const aclTensor *blockTable, int64_t numHeads,
                           double scaleValue, int64_t preTokens, int64_t nextTokens, const char *inputLayout,
                           int64_t numKeyValueHeads, int64_t sparseMode, int64_t innerPrecise, int64_t blockSize,
                           bool softmaxLseFlag, const aclTensor *attentionOut, const aclTensor *softmaxLse,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    FAULT_GWS(OP);
    if (!workspaceSize || !executor || !query || !key || !value || !attentionOut || !inputLayout) {
        sim_error("%sGetWorkspaceSize: query, key, value, attentionOut, inputLayout, workspaceSize and executor must "
                  "not be NULL",
                  OP);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!soc_is_a2a3()) {
        sim_error("%s: no kernel for %s: the op supports Atlas A2/A3 only", OP, sim_soc_name());
        return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
    }
    /* On Ascend950 (DAV_3510) V1..V4 refuse at the first phase (ops-transformer
     * attention/fused_infer_attention_score/op_api/aclnn_fused_infer_attention_score_v4.cpp and its V2/V3 twins) */
    if (sim_soc() == SIM_SOC_950 && strcmp(OP, "aclnnFusedInferAttentionScoreV5") != 0) {
        sim_error("Interface aclnnFusedInferAttentionScore versions V1 to V4 are no longer supported on Ascend950 (%s)", OP);
        return ACLNN_ERR_RUNTIME_ERROR;
    }
    SimExec *se = tboostSimInternal_execNew(OP, fia_run, sizeof(FiaP));
    if (!se) return ACLNN_ERR_INNER;
    se->x.freeParams = fia_free;
    FiaP *p = se->x.params;
    p->op = OP;
    p->mask = p->bt = p->lse = -1;
    if (!tboostSimInternal_isLive(SIM_OBJ_TLIST, key) || !tboostSimInternal_isLive(SIM_OBJ_TLIST, value))
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key/value must be live aclTensorLists", OP);
    if (key->size != 1 || value->size != 1)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key/value lists of %llu/%llu tensors: the SIMULATOR takes one tensor each", OP,
             (unsigned long long)key->size, (unsigned long long)value->size);
    NOT_SIM(pse, "pseShiftOptional");
    for (int i = 0; i < nunsupported; i++) NOT_SIM(unsupported[i], "a quantization/padding/prefix/rope input");
    if (actSharedPrefix) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: actualSharedPrefixLen is not simulated (pass NULL)", OP);
    SNAP("query", query, 1, &p->q);
    SNAP("key[0]", key->items[0], 1, &p->k);
    SNAP("value[0]", value->items[0], 1, &p->v);
    SNAP("attenMaskOptional", attenMask, 0, &p->mask);
    SNAP("blockTableOptional", blockTable, 0, &p->bt);
    SNAP("attentionOut", attentionOut, 1, &p->out);
    SNAP("softmaxLse", softmaxLseFlag ? softmaxLse : NULL, softmaxLseFlag, &p->lse);
    const aclTensor *q = T(se, p->q), *k = T(se, p->k), *v = T(se, p->v), *o = T(se, p->out);
    if ((q->dtype != ACL_FLOAT16 && q->dtype != ACL_BF16) || k->dtype != q->dtype || v->dtype != q->dtype ||
        o->dtype != q->dtype)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: query/key/value/attentionOut are %s/%s/%s/%s: FLOAT16 or BFLOAT16, all the same (INT8 paths are not simulated)",
             OP, dname(q->dtype), dname(k->dtype), dname(v->dtype), dname(o->dtype));
    if (strcmp(inputLayout, "BSH") == 0) p->lay = LAY_BSH;
    else if (strcmp(inputLayout, "BSND") == 0) p->lay = LAY_BSND;
    else if (strcmp(inputLayout, "BNSD") == 0) p->lay = LAY_BNSD;
    else FAIL(ACLNN_ERR_PARAM_INVALID, "%s: inputLayout \"%s\" is not simulated (BSH, BSND, BNSD)", OP, inputLayout);
    if (numHeads <= 0) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: numHeads %lld must be > 0", OP, (long long)numHeads);
    p->N = numHeads;
    p->KVN = numKeyValueHeads == 0 ? numHeads : numKeyValueHeads;
    if (p->KVN <= 0 || p->N % p->KVN != 0 || p->N / p->KVN > 64)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: numHeads %lld must be a multiple of numKeyValueHeads %lld with a ratio of at most 64",
             OP, (long long)p->N, (long long)p->KVN);
    if (p->lay == LAY_BSH) {
        if (q->ndim != 3 || q->dims[2] % p->N) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BSH query %s: H must be a multiple of numHeads %lld", OP, SHAPE(q), (long long)p->N);
        p->B = q->dims[0], p->Sq = q->dims[1], p->D = q->dims[2] / p->N;
    } else {
        if (q->ndim != 4) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: %s query %s must be 4-D", OP, inputLayout, SHAPE(q));
        int64_t qn = p->lay == LAY_BSND ? q->dims[2] : q->dims[1];
        if (qn != p->N) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: query %s has %lld heads, numHeads is %lld", OP, SHAPE(q), (long long)qn, (long long)p->N);
        p->B = q->dims[0], p->Sq = p->lay == LAY_BSND ? q->dims[1] : q->dims[2], p->D = q->dims[3];
    }
    if (!same_shape(q, o)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: attentionOut %s must have the query's shape %s", OP, SHAPE(o), SHAPE(q));
    if (p->B > 65536 || p->N > 256 || p->D > 512 || p->D < 1)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: B %lld <= 65536, N %lld <= 256 and 1 <= D %lld <= 512 are required", OP, (long long)p->B, (long long)p->N, (long long)p->D);
    if (p->Sq > 1 && p->D % 16 != 0 && p->B > 128)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: D %lld is not 16-aligned, which limits B to 128 (B is %lld)", OP, (long long)p->D, (long long)p->B);
    if (sparseMode < 0 || sparseMode > 4) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: sparseMode %lld: only 0..4 are supported", OP, (long long)sparseMode);
    if (innerPrecise < 0 || innerPrecise > 3) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: innerPrecise %lld is not 0..3", OP, (long long)innerPrecise);
    p->sparse = (int)sparseMode;
    p->preTokens = preTokens, p->nextTokens = nextTokens;
    p->scale = scaleValue;
    const aclTensor *m = p->mask >= 0 ? T(se, p->mask) : NULL;
    if (p->Sq > 1) {
        if (p->sparse == 4 && (preTokens < 0 || nextTokens < 0))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: sparseMode 4 with negative preTokens %lld / nextTokens %lld is not simulated", OP, (long long)preTokens, (long long)nextTokens);
        if (p->sparse == 0 && m && (preTokens < INT_MAX || nextTokens < INT_MAX))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: sparseMode 0 with a mask and preTokens/nextTokens bands is not simulated (pass 2147483647)", OP);
        if (p->sparse == 1 && !m) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: sparseMode 1 (allMask) needs attenMask", OP);
        if (p->sparse >= 2) {
            int ok = m && m->ndim >= 2 && m->ndim <= 4 && m->dims[m->ndim - 1] == 2048 && m->dims[m->ndim - 2] == 2048 && dsize(m->dtype) == 1;
            for (int i = 0; ok && i < m->ndim - 2; i++) ok = m->dims[i] == 1;
            if (!ok) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: sparseMode %d needs the optimized attenMask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) in BOOL/INT8/UINT8", OP, p->sparse);
        }
    }
    if (m && dsize(m->dtype) != 1) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: attenMask must be BOOL, INT8 or UINT8, not %s", OP, dname(m->dtype));

    p->paged = p->bt >= 0;
    int64_t kvMax;
    if (p->paged) {
        const aclTensor *bt = T(se, p->bt);
        if (bt->dtype != ACL_INT32 || bt->ndim != 2 || bt->dims[0] != p->B)
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: blockTable must be INT32 [B=%lld, maxBlocksPerSeq], got %s %s", OP, (long long)p->B, dname(bt->dtype), SHAPE(bt));
        if (p->Sq > 1 && (blockSize < 128 || blockSize > 512 || blockSize % 128))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: with Q_S > 1 and page attention blockSize must be 128..512 and a multiple of 128 (got %lld)", OP, (long long)blockSize);
        if (p->Sq == 1 && (blockSize <= 0 || blockSize > 512 || blockSize % 16))
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: with Q_S == 1 blockSize must be 16-aligned and at most 512 (got %lld)", OP, (long long)blockSize);
        if (!actSeqKv) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: page attention needs actualSeqLengthsKv", OP);
        if (!same_shape(k, v)) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key cache %s and value cache %s must have the same shape", OP, SHAPE(k), SHAPE(v));
        p->blockSize = blockSize, p->maxBlocks = bt->dims[1];
        if (k->ndim == 3) {
            if (k->dims[1] != blockSize || k->dims[2] != p->KVN * p->D)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BnBsH key cache %s must be [blocks, blockSize %lld, KV_N*D %lld]", OP, SHAPE(k), (long long)blockSize, (long long)(p->KVN * p->D));
            if (p->KVN * p->D > 65535)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BnBsH cache with KV_N*D = %lld > 65535: enable GQA or use BnNBsD", OP, (long long)(p->KVN * p->D));
        } else if (k->ndim == 4) {
            if (p->lay != LAY_BNSD)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: with query layout %s the cache must be BnBsH (3-D [blocks, blockSize, KV_N*D]), got %s", OP, inputLayout, SHAPE(k));
            if (k->dims[1] != p->KVN || k->dims[2] != blockSize || k->dims[3] != p->D)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: BnNBsD key cache %s must be [blocks, KV_N %lld, blockSize %lld, D %lld]", OP, SHAPE(k), (long long)p->KVN, (long long)blockSize, (long long)p->D);
            p->cacheNz = 1;
        } else {
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: paged key cache %s must be 3-D (BnBsH) or 4-D (BnNBsD)", OP, SHAPE(k));
        }
        p->nblocks = k->dims[0];
        kvMax = p->maxBlocks * blockSize;
    } else {
        int ok = k->ndim == q->ndim && same_shape(k, v);
        if (ok && p->lay == LAY_BSH) ok = k->dims[0] == p->B && k->dims[2] == p->KVN * p->D;
        if (ok && p->lay == LAY_BSND) ok = k->dims[0] == p->B && k->dims[2] == p->KVN && k->dims[3] == p->D;
        if (ok && p->lay == LAY_BNSD) ok = k->dims[0] == p->B && k->dims[1] == p->KVN && k->dims[3] == p->D;
        if (!ok) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key %s / value %s do not match query %s in layout %s with %lld KV heads", OP, SHAPE(k), SHAPE(v), SHAPE(q), inputLayout, (long long)p->KVN);
        p->Skv = p->lay == LAY_BNSD ? k->dims[2] : k->dims[1];
        kvMax = p->Skv;
    }
    CHECK(seq_lengths(OP, "actualSeqLengths", p->Sq == 1 ? NULL : actSeq, p->B, p->Sq, p->Sq, &p->actQ));
    CHECK(seq_lengths(OP, "actualSeqLengthsKv", actSeqKv, p->B, kvMax, kvMax, &p->actKv));
    if (p->paged)
        for (int64_t b = 0; b < p->B; b++)
            if ((p->actKv[b] + p->blockSize - 1) / p->blockSize > p->maxBlocks)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: batch %lld needs %lld blocks, blockTable has %lld columns", OP, (long long)b, (long long)((p->actKv[b] + p->blockSize - 1) / p->blockSize), (long long)p->maxBlocks);
    if (m && !(p->Sq > 1 && p->sparse >= 2)) {
        int64_t mS = m->dims[m->ndim - 1];
        if (p->Sq == 1) {
            p->maskQ1 = 1;
            if (m->dims[0] != p->B) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: with Q_S == 1 attenMask must be (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S), got %s", OP, SHAPE(m));
            if (p->paged && mS < p->maxBlocks * p->blockSize)
                FAIL(ACLNN_ERR_PARAM_INVALID, "%s: with page attention the mask's last dim %lld must be at least blockTable's %lld columns * blockSize %lld", OP, (long long)mS, (long long)p->maxBlocks, (long long)p->blockSize);
        } else {
            int64_t mq = m->dims[m->ndim - 2];
            p->maskB = m->ndim >= 3 && m->dims[0] == p->B && p->B > 1;
            int ok = mq >= p->Sq && (m->ndim < 3 || m->dims[0] == 1 || m->dims[0] == p->B) && (m->ndim < 4 || m->dims[1] == 1);
            if (!ok) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: attenMask %s must be (Q_S, KV_S), (B|1, Q_S, KV_S) or (B|1, 1, Q_S, KV_S) with Q_S %lld", OP, SHAPE(m), (long long)p->Sq);
        }
        for (int64_t b = 0; b < p->B; b++)
            if (mS < p->actKv[b]) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: attenMask's KV_S %lld is shorter than actualSeqLengthsKv[%lld] = %lld", OP, (long long)mS, (long long)b, (long long)p->actKv[b]);
    }
    if (softmaxLseFlag) {
        const aclTensor *l = T(se, p->lse);
        if (l->dtype != ACL_FLOAT || l->ndim != 4 || l->dims[0] != p->B || l->dims[1] != p->N || l->dims[2] != p->Sq || l->dims[3] != 1)
            FAIL(ACLNN_ERR_PARAM_INVALID, "%s: softmaxLse must be FLOAT [B, N, Q_S, 1], got %s %s", OP, dname(l->dtype), SHAPE(l));
    }
    int64_t maxKv = 0;
    for (int64_t b = 0; b < p->B; b++) maxKv = p->actKv[b] > maxKv ? p->actKv[b] : maxKv;
    return tboostSimInternal_execFinish(se, (uint64_t)(maxKv + 1) * sizeof(double), workspaceSize, executor);
}

aclnnStatus aclnnFusedInferAttentionScoreV2GetWorkspaceSize(
    const aclTensor *query, const aclTensorList *key, const aclTensorList *value, const aclTensor *pseShiftOptional,
    const aclTensor *attenMaskOptional, const aclIntArray *actualSeqLengthsOptional,
    const aclIntArray *actualSeqLengthsKvOptional, const aclTensor *deqScale1Optional,
    const aclTensor *quantScale1Optional, const aclTensor *deqScale2Optional, const aclTensor *quantScale2Optional,
    const aclTensor *quantOffset2Optional, const aclTensor *antiquantScaleOptional,
    const aclTensor *antiquantOffsetOptional, const aclTensor *blockTableOptional,
    const aclTensor *queryPaddingSizeOptional, const aclTensor *kvPaddingSizeOptional,
    const aclTensor *keyAntiquantScaleOptional, const aclTensor *keyAntiquantOffsetOptional,
    const aclTensor *valueAntiquantScaleOptional, const aclTensor *valueAntiquantOffsetOptional,
    const aclTensor *keySharedPrefixOptional, const aclTensor *valueSharedPrefixOptional,
    const aclIntArray *actualSharedPrefixLenOptional, int64_t numHeads, double scaleValue, int64_t preTokens,
    int64_t nextTokens, char *inputLayout, int64_t numKeyValueHeads, int64_t sparseMode, int64_t innerPrecise,
    int64_t blockSize, int64_t antiquantMode, bool softmaxLseFlag, int64_t keyAntiquantMode,
    int64_t valueAntiquantMode, const aclTensor *attentionOut, const aclTensor *softmaxLse, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    (void)antiquantMode, (void)keyAntiquantMode, (void)valueAntiquantMode;
    const aclTensor *un[] = {deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
                             quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional,
                             queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional,
                             keyAntiquantOffsetOptional, valueAntiquantScaleOptional, valueAntiquantOffsetOptional,
                             keySharedPrefixOptional, valueSharedPrefixOptional};
    return fia_gws("aclnnFusedInferAttentionScoreV2", query, key, value, pseShiftOptional, attenMaskOptional,
                   actualSeqLengthsOptional, actualSeqLengthsKvOptional, un, (int)(sizeof un / sizeof un[0]),
                   actualSharedPrefixLenOptional, blockTableOptional, numHeads, scaleValue, preTokens, nextTokens,
                   inputLayout, numKeyValueHeads, sparseMode, innerPrecise, blockSize, softmaxLseFlag, attentionOut,
                   softmaxLse, workspaceSize, executor);
}
SIM_EXECUTE(aclnnFusedInferAttentionScoreV2)

aclnnStatus aclnnFusedInferAttentionScoreV3GetWorkspaceSize(
    const aclTensor *query, const aclTensorList *key, const aclTensorList *value, const aclTensor *pseShiftOptional,
    const aclTensor *attenMaskOptional, const aclIntArray *actualSeqLengthsOptional,
    const aclIntArray *actualSeqLengthsKvOptional, const aclTensor *deqScale1Optional,
    const aclTensor *quantScale1Optional, const aclTensor *deqScale2Optional, const aclTensor *quantScale2Optional,
    const aclTensor *quantOffset2Optional, const aclTensor *antiquantScaleOptional,
    const aclTensor *antiquantOffsetOptional, const aclTensor *blockTableOptional,
    const aclTensor *queryPaddingSizeOptional, const aclTensor *kvPaddingSizeOptional,
    const aclTensor *keyAntiquantScaleOptional, const aclTensor *keyAntiquantOffsetOptional,
    const aclTensor *valueAntiquantScaleOptional, const aclTensor *valueAntiquantOffsetOptional,
    const aclTensor *keySharedPrefixOptional, const aclTensor *valueSharedPrefixOptional,
    const aclIntArray *actualSharedPrefixLenOptional, const aclTensor *queryRopeOptional,
    const aclTensor *keyRopeOptional, const aclTensor *keyRopeAntiquantScaleOptional, int64_t numHeads,
    double scaleValue, int64_t preTokens, int64_t nextTokens, char *inputLayout, int64_t numKeyValueHeads,
    int64_t sparseMode, int64_t innerPrecise, int64_t blockSize, int64_t antiquantMode, bool softmaxLseFlag,
    int64_t keyAntiquantMode, int64_t valueAntiquantMode, const aclTensor *attentionOut, const aclTensor *softmaxLse,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)antiquantMode, (void)keyAntiquantMode, (void)valueAntiquantMode;
    const aclTensor *un[] = {deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
                             quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional,
                             queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional,
                             keyAntiquantOffsetOptional, valueAntiquantScaleOptional, valueAntiquantOffsetOptional,
                             keySharedPrefixOptional, valueSharedPrefixOptional, queryRopeOptional, keyRopeOptional,
                             keyRopeAntiquantScaleOptional};
    return fia_gws("aclnnFusedInferAttentionScoreV3", query, key, value, pseShiftOptional, attenMaskOptional,
                   actualSeqLengthsOptional, actualSeqLengthsKvOptional, un, (int)(sizeof un / sizeof un[0]),
                   actualSharedPrefixLenOptional, blockTableOptional, numHeads, scaleValue, preTokens, nextTokens,
                   inputLayout, numKeyValueHeads, sparseMode, innerPrecise, blockSize, softmaxLseFlag, attentionOut,
                   softmaxLse, workspaceSize, executor);
}
SIM_EXECUTE(aclnnFusedInferAttentionScoreV3)

aclnnStatus aclnnFusedInferAttentionScoreV4GetWorkspaceSize(
    const aclTensor *query, const aclTensorList *key, const aclTensorList *value, const aclTensor *pseShiftOptional,
    const aclTensor *attenMaskOptional, const aclIntArray *actualSeqLengthsOptional,
    const aclIntArray *actualSeqLengthsKvOptional, const aclTensor *deqScale1Optional,
    const aclTensor *quantScale1Optional, const aclTensor *deqScale2Optional, const aclTensor *quantScale2Optional,
    const aclTensor *quantOffset2Optional, const aclTensor *antiquantScaleOptional,
    const aclTensor *antiquantOffsetOptional, const aclTensor *blockTableOptional,
    const aclTensor *queryPaddingSizeOptional, const aclTensor *kvPaddingSizeOptional,
    const aclTensor *keyAntiquantScaleOptional, const aclTensor *keyAntiquantOffsetOptional,
    const aclTensor *valueAntiquantScaleOptional, const aclTensor *valueAntiquantOffsetOptional,
    const aclTensor *keySharedPrefixOptional, const aclTensor *valueSharedPrefixOptional,
    const aclIntArray *actualSharedPrefixLenOptional, const aclTensor *queryRopeOptional,
    const aclTensor *keyRopeOptional, const aclTensor *keyRopeAntiquantScaleOptional,
    const aclTensor *dequantScaleQueryOptional, const aclTensor *learnableSinkOptional, int64_t numHeads,
    double scaleValue, int64_t preTokens, int64_t nextTokens, char *inputLayout, int64_t numKeyValueHeads,
    int64_t sparseMode, int64_t innerPrecise, int64_t blockSize, int64_t antiquantMode, bool softmaxLseFlag,
    int64_t keyAntiquantMode, int64_t valueAntiquantMode, int64_t queryQuantMode, const aclTensor *attentionOut,
    const aclTensor *softmaxLse, uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)antiquantMode, (void)keyAntiquantMode, (void)valueAntiquantMode, (void)queryQuantMode;
    const aclTensor *un[] = {deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
                             quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional,
                             queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional,
                             keyAntiquantOffsetOptional, valueAntiquantScaleOptional, valueAntiquantOffsetOptional,
                             keySharedPrefixOptional, valueSharedPrefixOptional, queryRopeOptional, keyRopeOptional,
                             keyRopeAntiquantScaleOptional, dequantScaleQueryOptional, learnableSinkOptional};
    return fia_gws("aclnnFusedInferAttentionScoreV4", query, key, value, pseShiftOptional, attenMaskOptional,
                   actualSeqLengthsOptional, actualSeqLengthsKvOptional, un, (int)(sizeof un / sizeof un[0]),
                   actualSharedPrefixLenOptional, blockTableOptional, numHeads, scaleValue, preTokens, nextTokens,
                   inputLayout, numKeyValueHeads, sparseMode, innerPrecise, blockSize, softmaxLseFlag, attentionOut,
                   softmaxLse, workspaceSize, executor);
}
SIM_EXECUTE(aclnnFusedInferAttentionScoreV4)

aclnnStatus aclnnFusedInferAttentionScoreV5GetWorkspaceSize(
    const aclTensor *query, const aclTensorList *key, const aclTensorList *value, const aclTensor *pseShiftOptional,
    const aclTensor *attenMaskOptional, const aclIntArray *actualSeqLengthsOptional,
    const aclIntArray *actualSeqLengthsKvOptional, const aclTensor *deqScale1Optional,
    const aclTensor *quantScale1Optional, const aclTensor *deqScale2Optional, const aclTensor *quantScale2Optional,
    const aclTensor *quantOffset2Optional, const aclTensor *antiquantScaleOptional,
    const aclTensor *antiquantOffsetOptional, const aclTensor *blockTableOptional,
    const aclTensor *queryPaddingSizeOptional, const aclTensor *kvPaddingSizeOptional,
    const aclTensor *keyAntiquantScaleOptional, const aclTensor *keyAntiquantOffsetOptional,
    const aclTensor *valueAntiquantScaleOptional, const aclTensor *valueAntiquantOffsetOptional,
    const aclTensor *keySharedPrefixOptional, const aclTensor *valueSharedPrefixOptional,
    const aclIntArray *actualSharedPrefixLenOptional, const aclTensor *queryRopeOptional,
    const aclTensor *keyRopeOptional, const aclTensor *keyRopeAntiquantScaleOptional,
    const aclTensor *dequantScaleQueryOptional, const aclTensor *learnableSinkOptional,
    const aclIntArray *qStartIdxOptional, const aclIntArray *kvStartIdxOptional, int64_t numHeads, double scaleValue,
    int64_t preTokens, int64_t nextTokens, char *inputLayout, int64_t numKeyValueHeads, int64_t sparseMode,
    int64_t innerPrecise, int64_t blockSize, int64_t antiquantMode, bool softmaxLseFlag, int64_t keyAntiquantMode,
    int64_t valueAntiquantMode, int64_t queryQuantMode, int64_t pseType, const aclTensor *attentionOut,
    const aclTensor *softmaxLse, uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *OP = "aclnnFusedInferAttentionScoreV5";
    (void)antiquantMode, (void)keyAntiquantMode, (void)valueAntiquantMode, (void)queryQuantMode, (void)pseType;
    if (qStartIdxOptional || kvStartIdxOptional) {
        sim_error("%sGetWorkspaceSize: qStartIdx / kvStartIdx are not simulated (pass NULL)", OP);
        return ACLNN_ERR_PARAM_INVALID;
    }
    const aclTensor *un[] = {deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
                             quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional,
                             queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional,
                             keyAntiquantOffsetOptional, valueAntiquantScaleOptional, valueAntiquantOffsetOptional,
                             keySharedPrefixOptional, valueSharedPrefixOptional, queryRopeOptional, keyRopeOptional,
                             keyRopeAntiquantScaleOptional, dequantScaleQueryOptional, learnableSinkOptional};
    return fia_gws(OP, query, key, value, pseShiftOptional, attenMaskOptional, actualSeqLengthsOptional,
                   actualSeqLengthsKvOptional, un, (int)(sizeof un / sizeof un[0]), actualSharedPrefixLenOptional,
                   blockTableOptional, numHeads, scaleValue, preTokens, nextTokens, inputLayout, numKeyValueHeads,
                   sparseMode, innerPrecise, blockSize, softmaxLseFlag, attentionOut, softmaxLse, workspaceSize,
                   executor);
}
SIM_EXECUTE(aclnnFusedInferAttentionScoreV5)

/* ---------------------------------------------------------------- ScatterPaKvCache (scenario 2, "Norm") */

typedef struct {
    int key, kc, slot, value, vc;
} ScatterP;

static aclnnStatus scatter_run(SimExec *e, void *ws, uint64_t wsSize) {
    (void)ws, (void)wsSize;
    ScatterP *p = e->x.params;
    const aclTensor *k = T(e, p->key), *kc = T(e, p->kc), *sl = T(e, p->slot), *v = T(e, p->value), *vc = T(e, p->vc);
    int64_t ntok = k->dims[0], nh = k->dims[1], dk = k->dims[2], dv = v->dims[2], bs = kc->dims[1],
            slots = kc->dims[0] * bs;
    for (int64_t t = 0; t < ntok; t++) {
        int64_t s = ld_i(sl, off_lin(sl, t));
        if (s < 0 || s >= slots) {
            sim_error("aclnnScatterPaKvCache: slotMapping[%lld] = %lld is outside the cache's %lld slots (the "
                      "SIMULATOR rejects negative slots too: their meaning is not documented)",
                      (long long)t, (long long)s, (long long)slots);
            return ACLNN_ERR_PARAM_INVALID;
        }
        int64_t blk = s / bs, o = s % bs;
        for (int64_t h = 0; h < nh; h++) {
            for (int64_t d = 0; d < dk; d++) st(kc, off4(kc, blk, o, h, d), ld(k, off3(k, t, h, d)));
            for (int64_t d = 0; d < dv; d++) st(vc, off4(vc, blk, o, h, d), ld(v, off3(v, t, h, d)));
        }
    }
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnScatterPaKvCacheGetWorkspaceSize(const aclTensor *key, aclTensor *keyCacheRef,
                                                  const aclTensor *slotMapping, const aclTensor *value,
                                                  aclTensor *valueCacheRef, const aclTensor *compressLensOptional,
                                                  const aclTensor *compressSeqOffsetOptional,
                                                  const aclTensor *seqLensOptional, char *cacheModeOptional,
                                                  char *scatterModeOptional, const aclIntArray *stridesOptional,
                                                  const aclIntArray *offsetsOptional, uint64_t *workspaceSize,
                                                  aclOpExecutor **executor) {
    static const char *OP = "aclnnScatterPaKvCache";
    FAULT_GWS(OP);
    if (!workspaceSize || !executor || !key || !keyCacheRef || !slotMapping || !value || !valueCacheRef) {
        sim_error("%sGetWorkspaceSize: key, keyCacheRef, slotMapping, value, valueCacheRef, workspaceSize and "
                  "executor must not be NULL",
                  OP);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!soc_is_a2a3()) {
        sim_error("%s: no kernel for %s: the op supports Atlas A2/A3 and 950 only", OP, sim_soc_name());
        return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
    }
    SimExec *se = tboostSimInternal_execNew(OP, scatter_run, sizeof(ScatterP));
    if (!se) return ACLNN_ERR_INNER;
    ScatterP *p = se->x.params;
    if (cacheModeOptional && strcmp(cacheModeOptional, "Norm") != 0)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: cacheMode \"%s\" is not simulated (NULL or \"Norm\")", OP, cacheModeOptional);
    if (scatterModeOptional && strcmp(scatterModeOptional, "None") != 0)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: scatterMode \"%s\" is not simulated (NULL or \"None\")", OP, scatterModeOptional);
    if (compressLensOptional || compressSeqOffsetOptional || seqLensOptional || stridesOptional || offsetsOptional)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: compression inputs, strides and offsets are not used in scenario 2 (\"Norm\"/\"None\"): pass NULL", OP);
    SNAP("key", key, 1, &p->key);
    SNAP("keyCacheRef", keyCacheRef, 1, &p->kc);
    SNAP("slotMapping", slotMapping, 1, &p->slot);
    SNAP("value", value, 1, &p->value);
    SNAP("valueCacheRef", valueCacheRef, 1, &p->vc);
    const aclTensor *k = T(se, p->key), *kc = T(se, p->kc), *sl = T(se, p->slot), *v = T(se, p->value), *vc = T(se, p->vc);
    if (k->dtype != ACL_FLOAT16 && k->dtype != ACL_BF16 && k->dtype != ACL_INT8)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key is %s; on Atlas A2/A3 key and caches are FLOAT16, BFLOAT16 or INT8", OP, dname(k->dtype));
    if (kc->dtype != k->dtype || v->dtype != k->dtype || vc->dtype != k->dtype)
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: key, keyCacheRef, value and valueCacheRef must share one dtype", OP);
    if (sl->dtype != ACL_INT32 && sl->dtype != ACL_INT64) FAIL(ACLNN_ERR_PARAM_INVALID, "%s: slotMapping must be INT32 or INT64", OP);
    if (k->ndim != 3 || v->ndim != 3)
        FAIL(ACLNN_ERR_INNER_TILING_ERROR, "%s: key %s and value %s must be 3-D [tokens, heads, head_size] (scenario 2)", OP, SHAPE(k), SHAPE(v));
    if (sl->ndim != 1 || sl->dims[0] != k->dims[0] || v->dims[0] != k->dims[0] || v->dims[1] != k->dims[1])
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: slotMapping %s, key %s and value %s disagree on tokens/heads", OP, SHAPE(sl), SHAPE(k), SHAPE(v));
    if (kc->ndim != 4 || vc->ndim != 4 || kc->dims[2] != k->dims[1] || kc->dims[3] != k->dims[2] || vc->dims[0] != kc->dims[0] ||
        vc->dims[1] != kc->dims[1] || vc->dims[2] != v->dims[1] || vc->dims[3] != v->dims[2])
        FAIL(ACLNN_ERR_PARAM_INVALID, "%s: caches must be [num_blocks, block_size, num_head, head_size] matching key %s / value %s; got %s / %s", OP, SHAPE(k), SHAPE(v), SHAPE(kc), SHAPE(vc));
    return tboostSimInternal_execFinish(se, 0, workspaceSize, executor);
}
SIM_EXECUTE(aclnnScatterPaKvCache)
