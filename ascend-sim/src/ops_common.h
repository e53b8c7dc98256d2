/*
 * ascend-sim ops_common.h -- CANN SIMULATOR helpers for the simulated aclnn ops: element access through
 * shape/strides/offset in any simulated dtype (fp16/bf16 converted through float), tensor snapshots
 * taken by GetWorkspaceSize, and argument checks that produce CANN status codes with a message.
 */
#ifndef TBOOST_ASCEND_SIM_OPS_COMMON_H
#define TBOOST_ASCEND_SIM_OPS_COMMON_H

#include "sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline size_t dsize(aclDataType t) {
    switch (t) {
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: return 1;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: return 8;
    default: return 0;
    }
}

/* bits per element: INT4 packs two per byte (element 2i in the low nibble of byte i) */
static inline size_t dbits(aclDataType t) { return t == ACL_INT4 ? 4 : 8 * dsize(t); }

static inline const char *dname(aclDataType t) {
    switch (t) {
    case ACL_INT4: return "INT4";
    case ACL_FLOAT: return "FLOAT";
    case ACL_FLOAT16: return "FLOAT16";
    case ACL_BF16: return "BFLOAT16";
    case ACL_INT8: return "INT8";
    case ACL_UINT8: return "UINT8";
    case ACL_INT16: return "INT16";
    case ACL_UINT16: return "UINT16";
    case ACL_INT32: return "INT32";
    case ACL_UINT32: return "UINT32";
    case ACL_INT64: return "INT64";
    case ACL_UINT64: return "UINT64";
    case ACL_DOUBLE: return "DOUBLE";
    case ACL_BOOL: return "BOOL";
    default: return "UNKNOWN";
    }
}

static inline int is_float(aclDataType t) { return t == ACL_FLOAT || t == ACL_FLOAT16 || t == ACL_BF16; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff);
    uint32_t man = x & 0x7fffff;
    if (exp == 255) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    int32_t e = exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++; /* may carry into the exponent: still right */
    return (uint16_t)(sign | half);
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    uint32_t lsb = (x >> 16) & 1;
    x += 0x7fff + lsb;
    return (uint16_t)(x >> 16);
}

/* element at `off` elements from t->data (offsets already include t->offset) */
static inline double ld(const aclTensor *t, int64_t off) {
    if (t->dtype == ACL_INT4) { /* sign-extend the nibble */
        uint8_t b = ((const uint8_t *)t->data)[off >> 1];
        int v = (off & 1) ? b >> 4 : b & 0xf;
        return v >= 8 ? v - 16 : v;
    }
    const char *p = (const char *)t->data + off * (int64_t)dsize(t->dtype);
    switch (t->dtype) {
    case ACL_FLOAT: { float v; memcpy(&v, p, 4); return v; }
    case ACL_DOUBLE: { double v; memcpy(&v, p, 8); return v; }
    case ACL_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return f16_to_f32(v); }
    case ACL_BF16: { uint16_t v; memcpy(&v, p, 2); return bf16_to_f32(v); }
    case ACL_INT8: return *(const int8_t *)p;
    case ACL_UINT8: return *(const uint8_t *)p;
    case ACL_BOOL: return *(const uint8_t *)p != 0;
    case ACL_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
    case ACL_UINT16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case ACL_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case ACL_UINT32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case ACL_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case ACL_UINT64: { uint64_t v; memcpy(&v, p, 8); return (double)v; }
    default: return 0;
    }
}

static inline int64_t ld_i(const aclTensor *t, int64_t off) {
    const char *p = (const char *)t->data + off * (int64_t)dsize(t->dtype);
    switch (t->dtype) {
    case ACL_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case ACL_INT64: { int64_t v; memcpy(&v, p, 8); return v; }
    default: return (int64_t)ld(t, off);
    }
}

static inline double clampd(double v, double lo, double hi) { return v != v ? 0 : v < lo ? lo : v > hi ? hi : v; }

static inline void st(const aclTensor *t, int64_t off, double v) {
    char *p = (char *)t->data + off * (int64_t)dsize(t->dtype);
    switch (t->dtype) {
    case ACL_FLOAT: { float f = (float)v; memcpy(p, &f, 4); break; }
    case ACL_DOUBLE: memcpy(p, &v, 8); break;
    case ACL_FLOAT16: { uint16_t h = f32_to_f16((float)v); memcpy(p, &h, 2); break; }
    case ACL_BF16: { uint16_t h = f32_to_bf16((float)v); memcpy(p, &h, 2); break; }
    case ACL_INT8: *(int8_t *)p = (int8_t)clampd(trunc(v), -128, 127); break;
    case ACL_UINT8: *(uint8_t *)p = (uint8_t)clampd(trunc(v), 0, 255); break;
    case ACL_BOOL: *(uint8_t *)p = v != 0; break;
    case ACL_INT16: { int16_t x = (int16_t)clampd(trunc(v), -32768, 32767); memcpy(p, &x, 2); break; }
    case ACL_UINT16: { uint16_t x = (uint16_t)clampd(trunc(v), 0, 65535); memcpy(p, &x, 2); break; }
    case ACL_INT32: { int32_t x = (int32_t)clampd(trunc(v), -2147483648.0, 2147483647.0); memcpy(p, &x, 4); break; }
    case ACL_UINT32: { uint32_t x = (uint32_t)clampd(trunc(v), 0, 4294967295.0); memcpy(p, &x, 4); break; }
    case ACL_INT64: { int64_t x = (int64_t)clampd(trunc(v), -9.2e18, 9.2e18); memcpy(p, &x, 8); break; }
    case ACL_UINT64: { uint64_t x = (uint64_t)clampd(trunc(v), 0, 1.8e19); memcpy(p, &x, 8); break; }
    default: break;
    }
}

static inline int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->dims[i];
    return n;
}

/* element offset of the `lin`-th element in row-major order of the view */
static inline int64_t off_lin(const aclTensor *t, int64_t lin) {
    int64_t off = t->offset;
    for (int i = t->ndim - 1; i >= 0; i--) {
        int64_t d = t->dims[i];
        if (d <= 0) return off;
        off += (lin % d) * t->strides[i];
        lin /= d;
    }
    return off;
}

static inline int64_t off2(const aclTensor *t, int64_t i0, int64_t i1) {
    return t->offset + i0 * t->strides[0] + i1 * t->strides[1];
}
static inline int64_t off3(const aclTensor *t, int64_t i0, int64_t i1, int64_t i2) {
    return t->offset + i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2];
}
static inline int64_t off4(const aclTensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return t->offset + i0 * t->strides[0] + i1 * t->strides[1] + i2 * t->strides[2] + i3 * t->strides[3];
}

static inline const char *shape_str(const aclTensor *t, char *buf, size_t n) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && k < n; i++) k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->dims[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}
#define SHAPE(t) shape_str((t), (char[128]){0}, 128)

static inline int same_shape(const aclTensor *a, const aclTensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->dims[i] != b->dims[i]) return 0;
    return 1;
}

/* -------- snapshots: GetWorkspaceSize copies every tensor it is given, so the caller may destroy the
 * aclTensor right after the launch; the copy records the device allocation it lies in. */

#define INVALID(...) \
    do {                \
        sim_error(__VA_ARGS__); \
        return ACLNN_ERR_PARAM_INVALID; \
    } while (0)
#define SHAPE_ERR(...) \
    do {                \
        sim_error(__VA_ARGS__); \
        return ACLNN_ERR_INNER_TILING_ERROR; \
    } while (0)

static inline aclnnStatus snap(SimExec *e, const char *op, const char *name, const aclTensor *t, int required,
                               int *idx) {
    *idx = -1;
    if (!t) {
        if (required) {
            sim_error("%s: %s is NULL", op, name);
            return ACLNN_ERR_PARAM_NULLPTR;
        }
        return ACLNN_SUCCESS;
    }
    if (!tboostSimInternal_isLive(SIM_OBJ_TENSOR, t)) INVALID("%s: %s (%p) is not a live aclTensor", op, name, (const void *)t);
    if (e->x.ntensors >= SIM_EXEC_MAX_TENSORS) INVALID("%s: too many tensors for the simulator", op);
    aclTensor c = *t;
    c.allocId = -1;
    int64_t n = numel(&c);
    if (n > 0) {
        int64_t maxOff = c.offset;
        for (int i = 0; i < c.ndim; i++) maxOff += (c.dims[i] - 1) * c.strides[i];
        uint64_t begin = (uint64_t)c.offset * dbits(c.dtype) / 8, end = ((uint64_t)(maxOff + 1) * dbits(c.dtype) + 7) / 8;
        if (!c.data) INVALID("%s: %s has no data pointer", op, name);
        c.allocId = tboostSimInternal_findAlloc((const char *)c.data + begin, end - begin);
        if (c.allocId < 0)
            INVALID("%s: %s %s %s at %p (+%llu..%llu bytes) is not inside one live device allocation (host pointer, "
                    "freed buffer or view past the end)",
                    op, name, dname(c.dtype), SHAPE(&c), c.data, (unsigned long long)begin, (unsigned long long)end);
    }
    *idx = e->x.ntensors;
    e->x.tensors[e->x.ntensors++] = c;
    return ACLNN_SUCCESS;
}

#define SNAP(name, t, req, idxp)                                  \
    do {                                                          \
        aclnnStatus _s = snap(se, OP, (name), (t), (req), (idxp)); \
        if (_s) {                                                 \
            tboostSimInternal_execAbort(se);                      \
            return _s;                                            \
        }                                                         \
    } while (0)
/* Runs a check that returns a status; aborts the executor on failure. */
#define CHECK(expr)                            \
    do {                                       \
        aclnnStatus _s = (expr);               \
        if (_s) {                              \
            tboostSimInternal_execAbort(se);   \
            return _s;                         \
        }                                      \
    } while (0)

#define T(e, i) (&(e)->x.tensors[(i)])

/* bf16: none on Atlas inference (310P: ATB include/atb/types.h), training (910A) or 200I/500 A2 (310B)
 * (the aclnnMm / aclnnRmsNorm docs list BFLOAT16 for Atlas A2/A3 only: ops-nn matmul/mat_mul_v3/docs/aclnnMm.md,
 * norm/rms_norm/docs/aclnnRmsNorm.md). */
static inline int soc_has_bf16(void) {
    return sim_soc() != SIM_SOC_310P && sim_soc() != SIM_SOC_910A && sim_soc() != SIM_SOC_310B;
}
static inline int soc_is_a2a3(void) { return sim_soc() == SIM_SOC_910B || sim_soc() == SIM_SOC_910_93 || sim_soc() == SIM_SOC_950; }

static inline aclnnStatus check_bf16(const char *op, const char *name, const aclTensor *t) {
    if (t && t->dtype == ACL_BF16 && !soc_has_bf16())
        INVALID("%s: %s is BFLOAT16, which %s does not support (bf16 only on Atlas A2/A3)", op, name, sim_soc_name());
    return ACLNN_SUCCESS;
}

/* SoC profiles: which ops have kernels where, from each op doc's product-support table ("产品支持情况"):
 * - RotaryPositionEmbedding: A2/A3 (and 950) only, not Atlas inference (310P), training (910A) or
 *   200I/500 A2 (310B) (ops-transformer posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md);
 * - RmsNorm, SwiGlu, Mm, GeluV2: not on 200I/500 A2 (310B) (ops-nn norm/rms_norm/docs/aclnnRmsNorm.md,
 *   activation/swi_glu/docs/aclnnSwiGlu.md, matmul/mat_mul_v3/docs/aclnnMm.md, activation/gelu_v2/docs/aclnnGeluV2.md);
 * - MoeInitRoutingV2, MoeFinalizeRoutingV2: not on training (910A) or 200I/500 A2 (310B)
 *   (ops-transformer moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md,
 *   moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md).
 * A missing kernel is what CANN reports for it: 561003 (ACLNN_ERR_INNER_FIND_KERNEL_ERROR). */
static inline aclnnStatus soc_kernel(const char *op) {
    SimSocFamily f = sim_soc();
    int absent = 0;
    if (strcmp(op, "aclnnRotaryPositionEmbedding") == 0) absent = !soc_is_a2a3();
    else if (strcmp(op, "aclnnRmsNorm") == 0 || strcmp(op, "aclnnSwiGlu") == 0 || strcmp(op, "aclnnMm") == 0 ||
             strcmp(op, "aclnnGeluV2") == 0)
        absent = f == SIM_SOC_310B;
    else if (strcmp(op, "aclnnMoeInitRoutingV2") == 0 || strcmp(op, "aclnnMoeFinalizeRoutingV2") == 0)
        absent = f == SIM_SOC_910A || f == SIM_SOC_310B;
    if (absent) {
        sim_error("%s: no kernel for %s (the op's product-support table does not list it)", op, sim_soc_name());
        return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
    }
    return ACLNN_SUCCESS;
}
#define SOC_KERNEL(opname)                       \
    do {                                         \
        aclnnStatus _k = soc_kernel(opname);     \
        if (_k) return _k;                       \
    } while (0)

/* a first phase's out-pointers: the two-phase docs return 161001 (ACLNN_ERR_PARAM_NULLPTR) for NULL */
#define OUTS_NULL(op)                                                                         \
    do {                                                                                      \
        if (!workspaceSize || !executor) {                                                    \
            sim_error("%sGetWorkspaceSize: workspaceSize and executor must not be NULL", op); \
            return ACLNN_ERR_PARAM_NULLPTR;                                                   \
        }                                                                                     \
    } while (0)

/* a 2-D tensor that is contiguous or the transpose of a contiguous one (what "转置" inputs allow) */
static inline int is_transpose_or_contig(const aclTensor *t) {
    if (t->ndim != 2) return t->ndim == 1 && (t->dims[0] <= 1 || t->strides[0] == 1);
    int contig = (t->dims[1] <= 1 || t->strides[1] == 1) && (t->dims[0] <= 1 || t->strides[0] == t->dims[1]);
    int transp = (t->dims[0] <= 1 || t->strides[0] == 1) && (t->dims[1] <= 1 || t->strides[1] == t->dims[0]);
    return contig || transp;
}

/* the execute twin shared by every op */
#define SIM_EXECUTE(opname)                                                                                  \
    aclnnStatus opname(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return tboostSimInternal_launch(#opname, workspace, workspaceSize, executor, stream);               \
    }

#define FAULT_GWS(opname)                                          \
    do {                                                           \
        aclnnStatus _f = tboostSimInternal_opFault(opname, 0);     \
        if (_f) return _f;                                         \
    } while (0)

#endif
