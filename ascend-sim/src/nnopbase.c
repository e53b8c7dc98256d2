/*
 * ascend-sim nnopbase.c -- CANN SIMULATOR, the simulated libnnopbase.so: aclTensor, aclScalar,
 * aclIntArray, aclTensorList and executor control (OPBASE acl_meta.h). Objects are tracked so that
 * double destroys, foreign pointers and leaks are reported. Not CANN: see ascend-sim/README.md.
 */
#include "sim.h"

#include <stdlib.h>
#include <string.h>

static int dtype_known(aclDataType t) {
    switch (t) {
    case ACL_FLOAT: case ACL_FLOAT16: case ACL_INT8: case ACL_INT32: case ACL_UINT8: case ACL_INT16:
    case ACL_UINT16: case ACL_UINT32: case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_BOOL:
    case ACL_BF16: case ACL_INT4:
        return 1;
    default:
        return 0;
    }
}

aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride,
                           int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData) {
    if (viewDimsNum > SIM_MAX_DIM || storageDimsNum > SIM_MAX_DIM) {
        sim_error("aclCreateTensor: at most %d dimensions (view %llu, storage %llu)", SIM_MAX_DIM,
                  (unsigned long long)viewDimsNum, (unsigned long long)storageDimsNum);
        return NULL;
    }
    if ((viewDimsNum && (!viewDims || !stride)) || (storageDimsNum && !storageDims)) {
        sim_error("aclCreateTensor: NULL dims or strides");
        return NULL;
    }
    if (!dtype_known(dataType)) {
        sim_error("aclCreateTensor: data type %d is not simulated", (int)dataType);
        return NULL;
    }
    if (offset < 0) {
        sim_error("aclCreateTensor: negative offset %lld", (long long)offset);
        return NULL;
    }
    for (uint64_t i = 0; i < viewDimsNum; i++) {
        if (viewDims[i] < 0 || stride[i] < 0) {
            sim_error("aclCreateTensor: dim %llu has size %lld stride %lld (negative values are not simulated)",
                      (unsigned long long)i, (long long)viewDims[i], (long long)stride[i]);
            return NULL;
        }
    }
    aclTensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->magic = SIM_MAGIC_TENSOR;
    t->dtype = dataType;
    t->format = format;
    t->ndim = (int)viewDimsNum;
    if (viewDimsNum) {
        memcpy(t->dims, viewDims, viewDimsNum * sizeof(int64_t));
        memcpy(t->strides, stride, viewDimsNum * sizeof(int64_t));
    }
    t->offset = offset;
    t->storageNdim = (int)storageDimsNum;
    if (storageDimsNum) memcpy(t->storageDims, storageDims, storageDimsNum * sizeof(int64_t));
    t->data = tensorData;
    t->allocId = -1;
    tboostSimInternal_register(SIM_OBJ_TENSOR, t);
    return t;
}

aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    if (!tensor) return ACLNN_SUCCESS; /* the op samples destroy optional NULL tensors */
    if (!tboostSimInternal_unregister(SIM_OBJ_TENSOR, tensor)) {
        sim_error("aclDestroyTensor: %p is not a live aclTensor (double destroy?)", (const void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    aclTensor *t = (aclTensor *)tensor;
    t->magic = 0;
    free(t);
    return ACLNN_SUCCESS;
}

static double scalar_value(const void *v, aclDataType t, int *ok) {
    *ok = 1;
    switch (t) {
    case ACL_FLOAT: return *(const float *)v;
    case ACL_DOUBLE: return *(const double *)v;
    case ACL_INT32: return *(const int32_t *)v;
    case ACL_INT64: return (double)*(const int64_t *)v;
    case ACL_INT8: return *(const int8_t *)v;
    case ACL_UINT8: return *(const uint8_t *)v;
    case ACL_BOOL: return *(const uint8_t *)v != 0;
    default: *ok = 0; return 0;
    }
}

aclScalar *aclCreateScalar(void *value, aclDataType dataType) {
    if (!value) {
        sim_error("aclCreateScalar: value is NULL");
        return NULL;
    }
    int ok;
    double v = scalar_value(value, dataType, &ok);
    if (!ok) {
        sim_error("aclCreateScalar: scalar data type %d is not simulated", (int)dataType);
        return NULL;
    }
    aclScalar *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->magic = SIM_MAGIC_SCALAR;
    s->dtype = dataType;
    s->value = v;
    tboostSimInternal_register(SIM_OBJ_SCALAR, s);
    return s;
}

aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    if (!scalar) return ACLNN_SUCCESS;
    if (!tboostSimInternal_unregister(SIM_OBJ_SCALAR, scalar)) {
        sim_error("aclDestroyScalar: %p is not a live aclScalar", (const void *)scalar);
        return ACLNN_ERR_PARAM_INVALID;
    }
    free((aclScalar *)scalar);
    return ACLNN_SUCCESS;
}

aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    if (size && !value) {
        sim_error("aclCreateIntArray: value is NULL with size %llu", (unsigned long long)size);
        return NULL;
    }
    aclIntArray *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->magic = SIM_MAGIC_INTARRAY;
    a->size = size;
    a->values = calloc(size ? size : 1, sizeof(int64_t));
    if (!a->values) {
        free(a);
        return NULL;
    }
    if (size) memcpy(a->values, value, size * sizeof(int64_t));
    tboostSimInternal_register(SIM_OBJ_INTARRAY, a);
    return a;
}

aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    if (!array) return ACLNN_SUCCESS;
    if (!tboostSimInternal_unregister(SIM_OBJ_INTARRAY, array)) {
        sim_error("aclDestroyIntArray: %p is not a live aclIntArray", (const void *)array);
        return ACLNN_ERR_PARAM_INVALID;
    }
    aclIntArray *a = (aclIntArray *)array;
    free(a->values);
    free(a);
    return ACLNN_SUCCESS;
}

aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size) {
    if (size && !value) {
        sim_error("aclCreateTensorList: value is NULL with size %llu", (unsigned long long)size);
        return NULL;
    }
    for (uint64_t i = 0; i < size; i++) {
        if (value[i] && !tboostSimInternal_isLive(SIM_OBJ_TENSOR, value[i])) {
            sim_error("aclCreateTensorList: element %llu (%p) is not a live aclTensor", (unsigned long long)i,
                      (const void *)value[i]);
            return NULL;
        }
    }
    aclTensorList *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->magic = SIM_MAGIC_TLIST;
    l->size = size;
    l->items = calloc(size ? size : 1, sizeof *l->items);
    if (!l->items) {
        free(l);
        return NULL;
    }
    for (uint64_t i = 0; i < size; i++) l->items[i] = value[i];
    tboostSimInternal_register(SIM_OBJ_TLIST, l);
    return l;
}

/* Like CANN (OPBASE src/nnopbase/common/api/acl_op_api.cpp), destroying a list destroys its tensors:
 * a tensor put in a list belongs to the list. */
aclnnStatus aclDestroyTensorList(const aclTensorList *array) {
    if (!array) return ACLNN_SUCCESS;
    if (!tboostSimInternal_unregister(SIM_OBJ_TLIST, array)) {
        sim_error("aclDestroyTensorList: %p is not a live aclTensorList", (const void *)array);
        return ACLNN_ERR_PARAM_INVALID;
    }
    aclTensorList *l = (aclTensorList *)array;
    aclnnStatus st = ACLNN_SUCCESS;
    for (uint64_t i = 0; i < l->size; i++) {
        aclnnStatus r = aclDestroyTensor(l->items[i]);
        if (r != ACLNN_SUCCESS) st = r;
    }
    free(l->items);
    free(l);
    return st;
}

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor) { return tboostSimInternal_setRepeatable(executor); }

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) { return tboostSimInternal_destroyExec(executor); }
