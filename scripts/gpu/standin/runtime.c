// The stand-in for the CUDA runtime (libcudart.so.13): what nvcc-compiled host code of the
// trainer's dependencies calls (fat binary registration at load, `<<<>>>` launches, cudaMalloc,
// device queries). Memory and counts go to the driver stand-in (standin.h).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "standin.h"

#define NOTE() standin_note("cudart", __func__)

// ---------------------------------------------------------------- registration and launches
// A kernel registered by __cudaRegisterFunction: its host stub's address and its device name.
struct kernel { const void *host; char *name; int max_dyn_shared; };
#define MAX_KERNELS 4096
static struct kernel kernels[MAX_KERNELS];
static int n_kernels;
static struct kernel *kernel_of(const void *host) {
  for (int i = 0; i < n_kernels; i++)
    if (kernels[i].host == host) return &kernels[i];
  return NULL;
}

static int fatbin_handle;
void **__cudaRegisterFatBinary(void *fatCubin) { (void)fatCubin; return (void **)&fatbin_handle; }
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterVar(void **h, char *hostVar, char *deviceAddress, const char *deviceName, int ext, size_t size,
                       int constant, int global) {
  (void)h; (void)hostVar; (void)deviceAddress; (void)deviceName; (void)ext; (void)size; (void)constant; (void)global;
}
void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun, const char *deviceName, int thread_limit,
                            uint3 *tid, uint3 *bid, dim3 *bDim, dim3 *gDim, int *wSize) {
  (void)h; (void)deviceFun; (void)thread_limit; (void)tid; (void)bid; (void)bDim; (void)gDim; (void)wSize;
  if (n_kernels < MAX_KERNELS && !kernel_of(hostFun))
    kernels[n_kernels++] = (struct kernel){hostFun, strdup(deviceName), 0};
}
cudaError_t __cudaGetKernel(cudaKernel_t *k, const void *hostFun) {
  struct kernel *kk = kernel_of(hostFun);
  *k = (cudaKernel_t)kk;
  return kk ? cudaSuccess : cudaErrorInvalidDeviceFunction;
}

// <<<grid, block, shared, stream>>> pushes the configuration; the stub pops it and launches.
static __thread struct { dim3 grid, block; size_t shared; void *stream; } config;
unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void *stream) {
  config.grid = grid; config.block = block; config.shared = shared; config.stream = stream;
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shared, void *stream) {
  *grid = config.grid; *block = config.block; *shared = config.shared; *(void **)stream = config.stream;
  return cudaSuccess;
}
static cudaError_t last_error;
static cudaError_t launch(struct kernel *k, dim3 block, size_t shared) {
  unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (!k) return last_error = cudaErrorInvalidDeviceFunction;
  if (threads == 0 || threads > 1024) return last_error = cudaErrorInvalidConfiguration;
  if (shared > STANDIN_SHARED_DEFAULT && (int)shared > k->max_dyn_shared) return last_error = cudaErrorInvalidValue;
  standin_launch_named(k->name);
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t k, dim3 grid, dim3 block, void **args, size_t shared, cudaStream_t s) {
  (void)grid; (void)args; (void)s;
  return launch((struct kernel *)k, block, shared);
}
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void **args, size_t shared, cudaStream_t s) {
  return __cudaLaunchKernel_ptsz(k, grid, block, args, shared, s);
}
cudaError_t cudaLaunchKernel(const void *f, dim3 grid, dim3 block, void **args, size_t shared, cudaStream_t s) {
  (void)grid; (void)args; (void)s;
  return launch(kernel_of(f), block, shared);
}
cudaError_t cudaLaunchKernel_ptsz(const void *f, dim3 grid, dim3 block, void **args, size_t shared, cudaStream_t s) {
  return cudaLaunchKernel(f, grid, block, args, shared, s);
}

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *f) {
  struct kernel *k = kernel_of(f);
  if (!k) return cudaErrorInvalidDeviceFunction;
  memset(a, 0, sizeof *a);
  a->maxThreadsPerBlock = 1024;
  a->numRegs = 32;
  a->ptxVersion = a->binaryVersion = 90;
  a->maxDynamicSharedSizeBytes = k->max_dyn_shared;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void *f, enum cudaFuncAttribute attr, int v) {
  struct kernel *k = kernel_of(f);
  if (!k) return cudaErrorInvalidDeviceFunction;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (v < 0 || v > STANDIN_SHARED_OPTIN) return cudaErrorInvalidValue;
    k->max_dyn_shared = v;
  }
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *f, int block, size_t shared,
                                                                   unsigned flags) {
  (void)f; (void)flags;
  if (block <= 0) return cudaErrorInvalidValue;
  int by_threads = 2048 / block, by_shared = shared ? (int)((228 * 1024) / shared) : 32;
  *n = by_threads < by_shared ? by_threads : by_shared;
  if (*n > 32) *n = 32;
  return cudaSuccess;
}

// ---------------------------------------------------------------- device and memory
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
// The runtime's attribute numbers are the driver's (cudaDevAttrX == CU_DEVICE_ATTRIBUTE_X).
_Static_assert((int)cudaDevAttrMaxSharedMemoryPerBlockOptin == (int)CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
               "runtime and driver attribute numbers differ");
_Static_assert((int)cudaDevAttrL2CacheSize == (int)CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
               "runtime and driver attribute numbers differ");
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int d) {
  (void)d;
  if (standin_attribute(a, v))
    return standin_unimplemented("cudaDeviceGetAttribute(unlisted attribute)", cudaErrorInvalidValue);
  return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) {
  NOTE();
  return standin_alloc((unsigned long long *)p, n, 0) ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFree(void *p) {
  NOTE();
  if (!p) return cudaSuccess;
  return standin_free((unsigned long long)p, 0) ? cudaErrorInvalidValue : cudaSuccess;
}
cudaError_t cudaMallocAsync_ptsz(void **p, size_t n, cudaStream_t s) {
  (void)s;
  NOTE();
  return standin_alloc((unsigned long long *)p, n, 1) ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFreeAsync_ptsz(void *p, cudaStream_t s) {
  (void)s;
  NOTE();
  if (!p) return cudaSuccess;
  return standin_free((unsigned long long)p, 1) ? cudaErrorInvalidValue : cudaSuccess;
}
cudaError_t cudaMemsetAsync_ptsz(void *p, int v, size_t n, cudaStream_t s) {
  (void)s;
  NOTE();
  if (!standin_check_range((unsigned long long)p, n)) return cudaErrorInvalidValue;
  if ((v & 0xff) == 0) standin_zero((unsigned long long)p, n);
  else { memset(p, v, n); standin_mark((unsigned long long)p, STANDIN_FROM_DEVICE | STANDIN_NONZERO); }
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) {
  (void)s;
  NOTE();
  standin_host_sync();
  return cudaSuccess;
}

// ---------------------------------------------------------------- errors
cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = cudaSuccess; return e; }
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}
const char *cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorNotSupported ? "not implemented by the CPU stand-in of the CUDA runtime" : cudaGetErrorName(e);
}
