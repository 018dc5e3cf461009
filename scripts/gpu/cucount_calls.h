// The CUDA driver calls counted per step and their categories: one source for cucount.c (the
// LD_PRELOAD counter on the real driver) and standin/ (the recording stand-in for the driver on a
// CPU machine), so that their reports name the same functions and sum them the same way.
//
// X(name, category, parameters, arguments): the current (CUDA 12/13) signature of each, written
// with the driver's type names (CUfunction, CUstream, ...); the includer declares those types
// (cucount.c as plain integers and pointers, the stand-in through cuda.h) and expands the
// parameters only where it needs them. No other declarations here, so it can follow cuda.h.
#ifndef CUCOUNT_CALLS_H
#define CUCOUNT_CALLS_H
#include <stdio.h>
// X(name, category, parameters, arguments): the current (CUDA 12/13) signature of each.
// The two launches timed (CUCOUNT_TIME=1) have their own wrappers; the others count and forward.
#define TIMED(X)                                                                                           \
  X(cuLaunchKernel, launch,                                                                                \
    (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,           \
     unsigned shmem, CUstream s, void **params, void **extra),                                             \
    (f, gx, gy, gz, bx, by, bz, shmem, s, params, extra))                                                  \
  X(cuLaunchKernelEx, launch, (const void *cfg, CUfunction f, void **params, void **extra),                \
    (cfg, f, params, extra))
#define COUNTED(X) TIMED(X) FORWARDED(X)
#define FORWARDED(X)                                                                                       \
  X(cuLaunchCooperativeKernel, launch,                                                                     \
    (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,           \
     unsigned shmem, CUstream s, void **params),                                                           \
    (f, gx, gy, gz, bx, by, bz, shmem, s, params))                                                         \
  X(cuGraphLaunch, launch, (void *g, CUstream s), (g, s))                                                  \
  X(cuMemAlloc_v2, alloc, (CUdeviceptr * p, size_t n), (p, n))                                             \
  X(cuMemAllocAsync, alloc, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s))                            \
  X(cuMemAllocFromPoolAsync, alloc, (CUdeviceptr * p, size_t n, CUmemoryPool m, CUstream s), (p, n, m, s)) \
  X(cuMemAllocManaged, alloc, (CUdeviceptr * p, size_t n, unsigned fl), (p, n, fl))                        \
  X(cuMemAllocPitch_v2, alloc, (CUdeviceptr * p, size_t *pitch, size_t w, size_t h, unsigned e),           \
    (p, pitch, w, h, e))                                                                                   \
  X(cuMemAllocHost_v2, alloc, (void **p, size_t n), (p, n))                                                \
  X(cuMemHostAlloc, alloc, (void **p, size_t n, unsigned fl), (p, n, fl))                                  \
  X(cuMemFree_v2, free, (CUdeviceptr p), (p))                                                              \
  X(cuMemFreeAsync, free, (CUdeviceptr p, CUstream s), (p, s))                                             \
  X(cuMemFreeHost, free, (void *p), (p))                                                                   \
  X(cuCtxSynchronize, sync, (void), ())                                                                    \
  X(cuStreamSynchronize, sync, (CUstream s), (s))                                                          \
  X(cuEventSynchronize, sync, (CUevent e), (e))                                                            \
  X(cuMemcpyDtoH_v2, read, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))                          \
  X(cuMemcpyHtoD_v2, copy, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n))                    \
  X(cuMemcpyDtoD_v2, copy, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))                    \
  X(cuMemcpyHtoDAsync_v2, copy, (CUdeviceptr dst, const void *src, size_t n, CUstream s),                  \
    (dst, src, n, s))                                                                                      \
  X(cuMemcpyDtoHAsync_v2, read, (void *dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s))     \
  X(cuMemcpyDtoDAsync_v2, copy, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s),                  \
    (dst, src, n, s))                                                                                      \
  X(cuMemcpyAsync, copy, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s))      \
  X(cuMemsetD8Async, memset, (CUdeviceptr p, unsigned char v, size_t n, CUstream s), (p, v, n, s))         \
  X(cuMemsetD32Async, memset, (CUdeviceptr p, unsigned v, size_t n, CUstream s), (p, v, n, s))             \
  X(cuMemsetD8_v2, memset, (CUdeviceptr p, unsigned char v, size_t n), (p, v, n))                          \
  X(cuMemsetD32_v2, memset, (CUdeviceptr p, unsigned v, size_t n), (p, v, n))                              \
  X(cuEventCreate, event, (CUevent * e, unsigned fl), (e, fl))                                             \
  X(cuEventRecord, event, (CUevent e, CUstream s), (e, s))                                                 \
  X(cuStreamWaitEvent, event, (CUstream s, CUevent e, unsigned fl), (s, e, fl))

// `read`: device-to-host copies, each a wait of the host for the device when the destination
// is pageable memory (cudarc's to_vec: the trainer's read-backs), async or not.
#define CATEGORIES(C) C(launch) C(alloc) C(free) C(sync) C(read) C(copy) C(memset) C(event)

enum {
#define ID(name, cat, params, args) ID_##name,
  COUNTED(ID)
#undef ID
      N_FUNCS
};
__attribute__((unused)) static const char *FUNC_NAMES[] = {
#define NAME(name, cat, params, args) #name,
    COUNTED(NAME)
#undef NAME
};
enum {
#define CAT(c) CAT_##c,
  CATEGORIES(CAT)
#undef CAT
      N_CATS
};
__attribute__((unused)) static const char *CAT_NAMES[] = {
#define CAT(c) #c,
    CATEGORIES(CAT)
#undef CAT
};
__attribute__((unused)) static const int FUNC_CAT[] = {
#define FCAT(name, cat, params, args) CAT_##cat,
    COUNTED(FCAT)
#undef FCAT
};

// `s` as a JSON string: quotes and backslashes escaped, control characters left out.
__attribute__((unused)) static void json_string(FILE *o, const char *s) {
  fputc('"', o);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fputc('\\', o);
    if ((unsigned char)*s >= 0x20) fputc(*s, o);
  }
  fputc('"', o);
}

// The JSON members `"counts": {category: n, ...}, "calls": {function: n, ...}` (functions never
// called are left out) of a report: both cucount.c and the stand-in write them this way.
__attribute__((unused)) static void cucount_write_counts(FILE *o, const unsigned long long *calls) {
  unsigned long long cat[N_CATS] = {0};
  for (int i = 0; i < N_FUNCS; i++) cat[FUNC_CAT[i]] += calls[i];
  fputs("\"counts\": {", o);
  for (int c = 0; c < N_CATS; c++) fprintf(o, "%s\"%s\": %llu", c ? ", " : "", CAT_NAMES[c], cat[c]);
  fputs("}, \"calls\": {", o);
  for (int i = 0, first = 1; i < N_FUNCS; i++)
    if (calls[i]) { fprintf(o, "%s\"%s\": %llu", first ? "" : ", ", FUNC_NAMES[i], calls[i]); first = 0; }
  fputc('}', o);
}
#endif
