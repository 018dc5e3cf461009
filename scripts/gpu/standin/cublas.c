// The stand-in for cuBLAS (libcublas.so.13): a GEMM checks that A, B and C lie inside live
// device allocations, zeroes C (every matrix of the batch, column by column as ldc lays them
// out) and is counted by name; it multiplies nothing.
#include <cublas_v2.h>
#include <stdlib.h>

#include "standin.h"

#define NOTE() standin_note("cublas", __func__)

struct handle { cudaStream_t stream; cublasMath_t math; };

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
  NOTE();
  *h = calloc(1, sizeof(struct handle));
  return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) { NOTE(); free(h); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  NOTE();
  ((struct handle *)h)->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s) { *s = ((struct handle *)h)->stream; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m) {
  NOTE();
  ((struct handle *)h)->math = m;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *m) { *m = ((struct handle *)h)->math; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *w, size_t n) { (void)h; (void)w; (void)n; NOTE(); return CUBLAS_STATUS_SUCCESS; }

static size_t elt_size(cudaDataType t) {
  switch (t) {
    case CUDA_R_64F: return 8;
    case CUDA_R_32F: case CUDA_R_32I: return 4;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    case CUDA_R_8I: case CUDA_R_8U: case CUDA_R_8F_E4M3: case CUDA_R_8F_E5M2: return 1;
    default: return 0;
  }
}

// The bytes a column-major rows x cols matrix with leading dimension ld spans, times the batch.
static size_t span(long long rows, long long cols, long long ld, long long stride, int batch, size_t elt) {
  return (size_t)(((long long)(batch - 1) * stride + (cols - 1) * ld + rows) * (long long)elt);
}

// op(A) is m x k, op(B) k x n, C m x n (column-major, as cuBLAS).
static cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A, int lda,
                           long long sa, const void *B, int ldb, long long sb, void *C, int ldc, long long sc,
                           int batch, size_t ea, size_t eb, size_t ec) {
  if (!ea || !eb || !ec) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  long long ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
  long long br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
  if (lda < ar || ldb < br || ldc < m) return CUBLAS_STATUS_INVALID_VALUE;
  if (k > 0 && (!standin_check_range((unsigned long long)A, span(ar, ac, lda, sa, batch, ea)) ||
                !standin_check_range((unsigned long long)B, span(br, bc, ldb, sb, batch, eb))))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!standin_check_range((unsigned long long)C, span(m, n, ldc, sc, batch, ec))) return CUBLAS_STATUS_INVALID_VALUE;
  for (int b = 0; b < batch; b++) {
    char *c = (char *)C + (size_t)b * sc * ec;
    if (ldc == m) standin_zero((unsigned long long)c, (size_t)m * n * ec);
    else
      for (int j = 0; j < n; j++) standin_zero((unsigned long long)(c + (size_t)j * ldc * ec), (size_t)m * ec);
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType at, int lda,
                                          long long sa, const void *B, cudaDataType bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  (void)h; (void)alpha; (void)beta; (void)compute; (void)algo;
  NOTE();
  return gemm(ta, tb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, elt_size(at), elt_size(bt), elt_size(ct));
}
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  (void)h; (void)alpha; (void)beta; (void)compute; (void)algo;
  NOTE();
  return gemm(ta, tb, m, n, k, A, lda, 0, B, ldb, 0, C, ldc, 0, 1, elt_size(at), elt_size(bt), elt_size(ct));
}
#define TYPED(name, T)                                                                                        \
  cublasStatus_t name(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,      \
                      const T *alpha, const T *A, int lda, long long sa, const T *B, int ldb, long long sb,   \
                      const T *beta, T *C, int ldc, long long sc, int batch) {                                \
    (void)h; (void)alpha; (void)beta;                                                                         \
    NOTE();                                                                                                   \
    return gemm(ta, tb, m, n, k, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, sizeof(T), sizeof(T), sizeof(T)); \
  }
TYPED(cublasSgemmStridedBatched, float)
TYPED(cublasDgemmStridedBatched, double)
#undef TYPED
cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                              const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                              float *C, int ldc) {
  (void)h; (void)alpha; (void)beta;
  NOTE();
  return gemm(ta, tb, m, n, k, A, lda, 0, B, ldb, 0, C, ldc, 0, 1, 4, 4, 4);
}
