// cucount: counts a process's CUDA driver calls — kernel launches, allocations, frees, copies,
// synchronisations, events — and optionally times every kernel, by LD_PRELOAD on the real
// driver (issue #31: "launches, allocations and syncs per step").
//
//   cc -O2 -shared -fPIC -o libcucount.so scripts/gpu/cucount.c -ldl -lpthread
//   CUCOUNT_OUT=counts.json LD_PRELOAD=$PWD/libcucount.so trainer train ...
//   CUCOUNT_OUT=counts.json CUCOUNT_TIME=1 LD_PRELOAD=... python3 torch_gpu_step.py ...
//
// How calls are caught, three ways. Candle's cudarc is built without dynamic loading: the
// trainer links libcuda.so.1 and calls it through its PLT, so this library defines the counted
// functions under their own names (seen on the H200, 2026-11-28: without them only cuBLAS's
// cuLaunchKernelEx was counted). A program that opens libcuda and looks functions up by name
// gets them through dlsym, which this library defines too; one that asks cuGetProcAddress (CUDA
// 12+: the name without its _v2 suffix, and a version) gets a wrapper for what it returns. Each
// way leads to a wrapper that counts and calls the real function. Everything else passes
// through untouched. PyTorch's runtime (cudart) makes most of its calls through the driver's
// private export table, which no preload sees: its counts here are cuBLAS's and a few others',
// not the whole step (Nsight Compute's launch list, run.sh's `profile` part, is).
//
// Output, at exit (CUCOUNT_OUT, else stderr): one JSON object with a count per category and per
// function, and with CUCOUNT_TIME=1 the GPU time of each kernel by name (a pair of events around
// every launch, read back whenever the program synchronises: timing adds work, so time in a
// separate run from the one whose step time is measured). Per step = (count after W + S steps -
// count after W steps) / S: scripts/gpu/run.sh runs both.
//
// The driver's types are declared here as the integer and pointer types they are (cuda.h is not
// needed to build it: the CPU self-test, cucount_selftest.sh, builds it against a fake driver).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream, *CUfunction, *CUevent, *CUcontext, *CUmemoryPool;
typedef unsigned long long cuuint64_t;

// The functions counted and their categories (shared with standin/).
#include "cucount_calls.h"

static unsigned long long calls[N_FUNCS];

// ---------------------------------------------------------------- the real functions
static void *(*real_dlsym)(void *, const char *);
static void *driver;  // libcuda's handle, for the timing helpers

static void init_real_dlsym(void) {
  if (real_dlsym) return;
  // dlsym is versioned in glibc: GLIBC_2.34 since it moved into libc, GLIBC_2.2.5 before.
  real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (!real_dlsym) real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  if (!real_dlsym) {
    fputs("cucount: cannot find the real dlsym\n", stderr);
    abort();
  }
}

#define REAL(name, cat, params, args) static CUresult(*real_##name) params;
COUNTED(REAL)
#undef REAL
// Defined below under the driver's own names (for programs linked against libcuda).
#define DECL(name, cat, params, args) CUresult name params;
COUNTED(DECL)
#undef DECL

// ---------------------------------------------------------------- kernel timing (CUCOUNT_TIME=1)
static int timing;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static CUresult (*ev_create)(CUevent *, unsigned);
static CUresult (*ev_record)(CUevent, CUstream);
static CUresult (*ev_query)(CUevent);
static CUresult (*ev_elapsed)(float *, CUevent, CUevent);
static CUresult (*func_name)(const char **, CUfunction);

struct pending { CUfunction f; CUevent start, end; };
#define MAX_PENDING 65536
static struct pending pending[MAX_PENDING];
static int n_pending;
static CUevent spare[2 * MAX_PENDING];
static int n_spare;
static unsigned long long untimed;  // launches not timed (no events, or too many in flight)

struct kernel { CUfunction f; char *name; unsigned long long n; double ms; };
#define MAX_KERNELS 4096
static struct kernel kernels[MAX_KERNELS];
static int n_kernels;

static int timing_ready(void) {
  if (!driver) driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!driver) return 0;
  if (!ev_create) {
    ev_create = real_dlsym(driver, "cuEventCreate");
    ev_record = real_dlsym(driver, "cuEventRecord");
    ev_query = real_dlsym(driver, "cuEventQuery");
    ev_elapsed = real_dlsym(driver, "cuEventElapsedTime_v2");
    if (!ev_elapsed) ev_elapsed = real_dlsym(driver, "cuEventElapsedTime");
    func_name = real_dlsym(driver, "cuFuncGetName");
  }
  return ev_create && ev_record && ev_query && ev_elapsed;
}

static CUevent take_event(void) {
  if (n_spare) return spare[--n_spare];
  CUevent e = 0;
  return ev_create(&e, 0) == 0 ? e : 0;
}

static struct kernel *kernel_of(CUfunction f) {
  for (int i = 0; i < n_kernels; i++)
    if (kernels[i].f == f) return &kernels[i];
  if (n_kernels == MAX_KERNELS) return 0;
  // The name is copied now: at exit the module that holds it may be unloaded.
  const char *name = 0;
  if (!func_name || func_name(&name, f) != 0 || !name) name = "?";
  kernels[n_kernels].f = f;
  kernels[n_kernels].name = strdup(name);
  return &kernels[n_kernels++];
}

// Reads back every finished pair, oldest first, and keeps the rest (called after syncs).
static void harvest(void) {
  int kept = 0;
  for (int i = 0; i < n_pending; i++) {
    struct pending p = pending[i];
    float ms = 0;
    if (ev_query(p.end) == 0 && ev_elapsed(&ms, p.start, p.end) == 0) {
      struct kernel *k = kernel_of(p.f);
      if (k) { k->n++; k->ms += ms; }
      spare[n_spare++] = p.start;
      spare[n_spare++] = p.end;
    } else {
      pending[kept++] = p;
    }
  }
  n_pending = kept;
}

// Launch with events around it on the launch's stream when timing.
static CUresult timed_launch(CUfunction f, CUstream s, CUresult (*launch)(void *), void *ctx) {
  if (!timing) return launch(ctx);
  pthread_mutex_lock(&lock);
  CUevent a = 0, b = 0;
  if (n_pending < MAX_PENDING && timing_ready()) { a = take_event(); b = take_event(); }
  if (!a || !b) {
    untimed++;
    if (a) spare[n_spare++] = a;
    if (b) spare[n_spare++] = b;
    pthread_mutex_unlock(&lock);
    return launch(ctx);
  }
  ev_record(a, s);
  CUresult r = launch(ctx);
  ev_record(b, s);
  if (r == 0) pending[n_pending++] = (struct pending){f, a, b};
  else { spare[n_spare++] = a; spare[n_spare++] = b; }
  pthread_mutex_unlock(&lock);
  return r;
}

static void after_sync(void) {
  if (!timing) return;
  pthread_mutex_lock(&lock);
  if (timing_ready()) harvest();
  pthread_mutex_unlock(&lock);
}

// ---------------------------------------------------------------- the wrappers
#define COUNT(name) __atomic_fetch_add(&calls[ID_##name], 1, __ATOMIC_RELAXED)

struct launch_args { CUfunction f; unsigned g[3], b[3], shmem; CUstream s; void **params, **extra; };
static CUresult do_launch(void *p) {
  struct launch_args *a = p;
  return real_cuLaunchKernel(a->f, a->g[0], a->g[1], a->g[2], a->b[0], a->b[1], a->b[2], a->shmem, a->s,
                             a->params, a->extra);
}
static CUresult wrap_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                    unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                                    void **extra) {
  COUNT(cuLaunchKernel);
  struct launch_args a = {f, {gx, gy, gz}, {bx, by, bz}, shmem, s, params, extra};
  return timed_launch(f, s, do_launch, &a);
}

struct launch_ex_args { const void *cfg; CUfunction f; void **params, **extra; };
static CUresult do_launch_ex(void *p) {
  struct launch_ex_args *a = p;
  return real_cuLaunchKernelEx(a->cfg, a->f, a->params, a->extra);
}
static CUresult wrap_cuLaunchKernelEx(const void *cfg, CUfunction f, void **params, void **extra) {
  COUNT(cuLaunchKernelEx);
  // CUlaunchConfig: grid x, y, z, block x, y, z, shared bytes (7 unsigned), then the stream.
  CUstream s = cfg ? *(CUstream const *)((const char *)cfg + 32) : 0;
  struct launch_ex_args a = {cfg, f, params, extra};
  return timed_launch(f, s, do_launch_ex, &a);
}

// The others count and forward (syncs harvest finished kernel timings).
#define PLAIN(name, cat, params, args)                                 \
  static CUresult wrap_##name params {                                 \
    COUNT(name);                                                       \
    CUresult r = real_##name args;                                     \
    if (CAT_##cat == CAT_sync || CAT_##cat == CAT_read) after_sync();  \
    return r;                                                          \
  }
FORWARDED(PLAIN)
#undef PLAIN

// The wrapper of a driver function by its exact name (dlsym), or NULL; `real` is stored.
static void *wrapper_for(const char *sym, void *real) {
#define MATCH(name, cat, params, args)                               \
  if (strcmp(sym, #name) == 0) {                                     \
    if (real == (void *)wrap_##name || real == (void *)name) return real; \
    if (real && !real_##name) real_##name = real;                    \
    return (void *)wrap_##name;                                      \
  }
  COUNTED(MATCH)
#undef MATCH
  return 0;
}

// cuGetProcAddress asks by base name ("cuMemAlloc" -> cuMemAlloc_v2, "cuLaunchKernel" with the
// per-thread-stream flag -> cuLaunchKernel_ptsz, same signature): the counted name it stands for.
static const char *counted_name(const char *base) {
  static const char *suffixed[][2] = {
      {"cuMemAlloc", "cuMemAlloc_v2"}, {"cuMemAllocPitch", "cuMemAllocPitch_v2"},
      {"cuMemAllocHost", "cuMemAllocHost_v2"}, {"cuMemFree", "cuMemFree_v2"},
      {"cuMemcpyDtoH", "cuMemcpyDtoH_v2"}, {"cuMemcpyHtoD", "cuMemcpyHtoD_v2"},
      {"cuMemcpyDtoD", "cuMemcpyDtoD_v2"}, {"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2"},
      {"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2"}, {"cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2"},
      {"cuMemsetD8", "cuMemsetD8_v2"}, {"cuMemsetD32", "cuMemsetD32_v2"}};
  for (size_t i = 0; i < sizeof suffixed / sizeof *suffixed; i++)
    if (strcmp(base, suffixed[i][0]) == 0) return suffixed[i][1];
  return base;
}

typedef CUresult (*get_proc_t)(const char *, void **, int, cuuint64_t, int *);
static get_proc_t real_get_proc_v2;
static CUresult (*real_get_proc)(const char *, void **, int, cuuint64_t);

static void *wrap_found(const char *sym, void *fn) {
  if (!fn) return fn;
  void *w = wrapper_for(counted_name(sym), fn);
  return w ? w : fn;
}
// Only the current versions (12000+: the signatures above) with the legacy default stream are
// wrapped: a per-thread-default-stream lookup (flag 2) returns the _ptsz function, which the one
// real_ pointer per name must not stand for (those are counted in "unwrapped_ptsz").
#define PER_THREAD_DEFAULT_STREAM 2
static unsigned long long unwrapped_ptsz;
static void *wrap_lookup(const char *sym, void *fn, int version, cuuint64_t flags) {
  if (version < 12000) return fn;
  if (flags & PER_THREAD_DEFAULT_STREAM) {
    if (fn && wrapper_for(counted_name(sym), 0)) __atomic_fetch_add(&unwrapped_ptsz, 1, __ATOMIC_RELAXED);
    return fn;
  }
  return wrap_found(sym, fn);
}
static CUresult wrap_cuGetProcAddress_v2(const char *sym, void **fn, int version, cuuint64_t flags, int *status) {
  CUresult r = real_get_proc_v2(sym, fn, version, flags, status);
  if (r == 0 && fn) *fn = wrap_lookup(sym, *fn, version, flags);
  return r;
}
static CUresult wrap_cuGetProcAddress(const char *sym, void **fn, int version, cuuint64_t flags) {
  CUresult r = real_get_proc(sym, fn, version, flags);
  if (r == 0 && fn) *fn = wrap_lookup(sym, *fn, version, flags);
  return r;
}

// A program linked against libcuda itself (Candle: cudarc without dynamic loading, so the
// trainer's calls go through its PLT, not dlsym) binds to these: the same counting wrappers,
// with the real function the next definition after this library.
#define EXPORTED(name, cat, params, args)                              \
  CUresult name params {                                               \
    if (!real_##name) {                                                \
      init_real_dlsym();                                               \
      real_##name = real_dlsym(RTLD_NEXT, #name);                      \
      if (!real_##name) return 999; /* CUDA_ERROR_UNKNOWN */           \
    }                                                                  \
    return wrap_##name args;                                           \
  }
COUNTED(EXPORTED)
#undef EXPORTED

void *dlsym(void *handle, const char *sym) {
  init_real_dlsym();
  void *fn = real_dlsym(handle, sym);
  if (!fn || sym[0] != 'c' || sym[1] != 'u') return fn;
  if (strcmp(sym, "cuGetProcAddress_v2") == 0) {
    real_get_proc_v2 = fn;
    return (void *)wrap_cuGetProcAddress_v2;
  }
  if (strcmp(sym, "cuGetProcAddress") == 0) {
    real_get_proc = fn;
    return (void *)wrap_cuGetProcAddress;
  }
  void *w = wrapper_for(sym, fn);
  return w ? w : fn;
}

// ---------------------------------------------------------------- the report
__attribute__((constructor)) static void start(void) {
  init_real_dlsym();
  const char *t = getenv("CUCOUNT_TIME");
  timing = t && strcmp(t, "1") == 0;
}

static int by_time(const void *a, const void *b) {
  double x = ((const struct kernel *)a)->ms, y = ((const struct kernel *)b)->ms;
  return (x < y) - (x > y);
}

__attribute__((destructor)) static void report(void) {
  const char *path = getenv("CUCOUNT_OUT");
  FILE *o = path ? fopen(path, "w") : stderr;
  if (!o) return;
  fputc('{', o);
  cucount_write_counts(o, calls);
  fprintf(o, ", \"unwrapped_ptsz\": %llu", unwrapped_ptsz);
  if (timing) {
    pthread_mutex_lock(&lock);
    if (timing_ready()) harvest();  // what finished after the last sync
    qsort(kernels, n_kernels, sizeof *kernels, by_time);
    double total = 0;
    for (int i = 0; i < n_kernels; i++) total += kernels[i].ms;
    fprintf(o, ", \"kernel_ms_total\": %.3f, \"untimed\": %llu, \"unread\": %d, \"kernels\": [", total, untimed,
            n_pending);
    for (int i = 0; i < n_kernels; i++) {
      fprintf(o, "%s{\"name\": ", i ? ", " : "");
      json_string(o, kernels[i].name ? kernels[i].name : "?");
      fprintf(o, ", \"n\": %llu, \"ms\": %.4f}", kernels[i].n, kernels[i].ms);
    }
    fputc(']', o);
    pthread_mutex_unlock(&lock);
  }
  fputs("}\n", o);
  if (o != stderr) fclose(o);
}
