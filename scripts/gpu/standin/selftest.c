// The stand-in's self-test program (selftest.sh): linked as the trainer is, against the driver
// and cuBLAS by name; run under the stand-in, it checks what the calls do and exits non-zero on
// the first wrong answer. selftest.sh then checks the stand-in's report of these calls.
#include <cublas_v2.h>
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define CHECK(cond)                                               \
  do {                                                            \
    if (!(cond)) {                                                \
      fprintf(stderr, "selftest.c:%d: %s failed\n", __LINE__, #cond); \
      return 1;                                                   \
    }                                                             \
  } while (0)

static const char PTX[] =
    ".version 8.0\n.target sm_90\n.address_size 64\n"
    ".visible .entry standin_k(\n\t.param .u64 p\n)\n{\n\tret;\n}\n";

int main(void) {
  CHECK(cuInit(0) == CUDA_SUCCESS);
  CUdevice dev;
  CUcontext ctx;
  CHECK(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
  int major, minor, sms, optin;
  cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev);
  CHECK(major == 9 && minor == 0 && sms == 132 && optin == 227 * 1024);
  size_t total;
  CHECK(cuDeviceTotalMem(&total, dev) == CUDA_SUCCESS && total == 80ull << 30);

  // Copies are real; fresh allocations are zero; a copy outside an allocation is refused.
  float host[64], back[64];
  for (int i = 0; i < 64; i++) host[i] = (float)i + 0.5f;
  CUdeviceptr up, fresh;
  CHECK(cuMemAlloc(&up, sizeof host) == CUDA_SUCCESS && cuMemAlloc(&fresh, 1 << 20) == CUDA_SUCCESS);
  CHECK(cuMemcpyHtoDAsync(up, host, sizeof host, 0) == CUDA_SUCCESS);
  CHECK(cuMemcpyDtoHAsync(back, up, sizeof back, 0) == CUDA_SUCCESS);  // read 1: uploaded data
  CHECK(memcmp(host, back, sizeof host) == 0);
  unsigned char edge[2];
  CHECK(cuMemcpyDtoH(&edge[0], fresh, 1) == CUDA_SUCCESS);               // read 2: computed (never written)
  CHECK(cuMemcpyDtoH(&edge[1], fresh + (1 << 20) - 1, 1) == CUDA_SUCCESS);  // read 3
  CHECK(edge[0] == 0 && edge[1] == 0);
  CHECK(cuMemcpyHtoD(up + 8, host, sizeof host) == CUDA_ERROR_INVALID_VALUE);
  CHECK(cuMemsetD8Async(fresh, 7, 16, 0) == CUDA_SUCCESS);
  CHECK(cuMemcpyDtoH(edge, fresh + 15, 1) == CUDA_SUCCESS && edge[0] == 7);  // read 4

  // A GEMM zeroes every C of the batch (m 4, n 2, ldc 6: rows 4 and 5 of each column are
  // padding and keep their bytes) and computes nothing.
  enum { M = 4, N = 2, K = 3, LDC = 6, BATCH = 2 };
  float c_host[BATCH * LDC * N];
  for (int i = 0; i < BATCH * LDC * N; i++) c_host[i] = 1.0f;
  CUdeviceptr a, b, c;
  CHECK(cuMemAlloc(&a, sizeof(float) * M * K * BATCH) == CUDA_SUCCESS);
  CHECK(cuMemAlloc(&b, sizeof(float) * K * N * BATCH) == CUDA_SUCCESS);
  CHECK(cuMemAlloc(&c, sizeof c_host) == CUDA_SUCCESS);
  CHECK(cuMemcpyHtoD(c, c_host, sizeof c_host) == CUDA_SUCCESS);
  cublasHandle_t h;
  CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  float one = 1.0f, zero = 0.0f;
  CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &one, (void *)a, CUDA_R_32F, M, M * K,
                                   (void *)b, CUDA_R_32F, K, K * N, &zero, (void *)c, CUDA_R_32F, LDC, LDC * N,
                                   BATCH, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  CHECK(cuMemcpyDtoH(c_host, c, sizeof c_host) == CUDA_SUCCESS);  // read 5: computed
  for (int bi = 0; bi < BATCH; bi++)
    for (int j = 0; j < N; j++)
      for (int i = 0; i < LDC; i++) CHECK(c_host[bi * LDC * N + j * LDC + i] == (i < M ? 0.0f : 1.0f));
  // a C too small for the batch is refused
  CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &one, (void *)a, CUDA_R_32F, M, M * K,
                                   (void *)b, CUDA_R_32F, K, K * N, &zero, (void *)c, CUDA_R_32F, LDC, LDC * N,
                                   BATCH + 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);
  CHECK(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS);

  // Kernels are found by name in their module and launched as the device would allow.
  CUmodule mod;
  CUfunction f, missing;
  CHECK(cuModuleLoadData(&mod, PTX) == CUDA_SUCCESS);
  CHECK(cuModuleGetFunction(&f, mod, "standin_k") == CUDA_SUCCESS);
  CHECK(cuModuleGetFunction(&missing, mod, "standin") == CUDA_ERROR_NOT_FOUND);
  void *args[] = {&up};
  for (int i = 0; i < 3; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, 0, args, 0) == CUDA_SUCCESS);
  CHECK(cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 64 << 10, 0, args, 0) == CUDA_ERROR_INVALID_VALUE);  // no opt-in
  CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 << 10) == CUDA_SUCCESS);
  CHECK(cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 64 << 10, 0, args, 0) == CUDA_SUCCESS);
  CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 228 << 10) == CUDA_ERROR_INVALID_VALUE);

  // The pool: at threshold 0 a sync hands freed memory back and the next allocation grows the
  // pool again; at the maximum threshold it keeps it.
  CUmemoryPool pool;
  CHECK(cuDeviceGetDefaultMemPool(&pool, dev) == CUDA_SUCCESS);
  CUdeviceptr p;
  CHECK(cuMemAllocAsync(&p, 1 << 20, 0) == CUDA_SUCCESS && cuMemFreeAsync(p, 0) == CUDA_SUCCESS);
  CHECK(cuStreamSynchronize(0) == CUDA_SUCCESS);
  CHECK(cuMemAllocAsync(&p, 1 << 20, 0) == CUDA_SUCCESS);
  cuuint64_t keep = UINT64_MAX, reserved = 0;
  CHECK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep) == CUDA_SUCCESS);
  CHECK(cuMemFreeAsync(p, 0) == CUDA_SUCCESS && cuCtxSynchronize() == CUDA_SUCCESS);
  CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) == CUDA_SUCCESS);
  CHECK(reserved == 1 << 20);
  CHECK(cuMemAllocAsync(&p, 1 << 20, 0) == CUDA_SUCCESS && cuMemFreeAsync(p, 0) == CUDA_SUCCESS);

  CUevent e;
  CHECK(cuEventCreate(&e, 0) == CUDA_SUCCESS && cuEventRecord(e, 0) == CUDA_SUCCESS);
  CHECK(cuEventSynchronize(e) == CUDA_SUCCESS && cuEventDestroy(e) == CUDA_SUCCESS);
  // referenced but not implemented: a generated stub answers "not supported"
  CHECK(cuMemHostRegister(host, sizeof host, 0) == CUDA_ERROR_NOT_SUPPORTED);
  CHECK(cuMemFree(a) == CUDA_SUCCESS && cuMemFree(b) == CUDA_SUCCESS && cuMemFree(c) == CUDA_SUCCESS);
  CHECK(cuMemFree(a) == CUDA_ERROR_INVALID_VALUE);  // twice
  CHECK(cuMemFree(up) == CUDA_SUCCESS && cuMemFree(fresh) == CUDA_SUCCESS);
  return 0;
}
