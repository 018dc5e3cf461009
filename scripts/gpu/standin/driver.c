// The recording stand-in for the CUDA driver (libcuda.so.1) on a CPU machine: device memory is
// host memory, copies are real, kernels do nothing (their outputs stay as allocated: zero), and
// every call is counted as scripts/gpu/cucount.c counts it on the real driver (the same table,
// cucount_calls.h), with more that only a stand-in can see: launches by kernel name, the memory
// pool's growth, host syncs, and every device-to-host read by its call stack. README.md says
// what is modelled and how; build.sh builds it.
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <elf.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "record.h"
#include "standin.h"


// ---------------------------------------------------------------- device memory
// One reservation of address space, never backed until written (MAP_NORESERVE): allocations
// are page-aligned and never reuse an address (a bump pointer through 16 TB), so every
// allocation starts zeroed and a freed one gives its pages back (MADV_DONTNEED). The 80 GB a
// device has is enforced on the bytes live, not on the address space.
#define ARENA_BYTES (16ull << 40)
#define PAGE 4096ull
static char *arena;
static unsigned long long arena_used;

// from: STANDIN_FROM_* bits; nonzero: it may hold a byte that is not 0 (an upload, a memset to a
// value, a copy of such bytes).
struct alloc { unsigned long long p, n; unsigned char live, from, pool, nonzero; };
static struct alloc *allocs;  // sorted by address (bump allocation appends)
static size_t n_allocs, cap_allocs;

static unsigned long long plain_used;
static int pool_handle;  // the default pool's CUmemoryPool is &pool_handle

static int arena_init(void) {
  if (arena) return 1;
  void *m = mmap(NULL, ARENA_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 0;
  arena = m;
  return 1;
}

static struct alloc *find(unsigned long long p) {
  size_t lo = 0, hi = n_allocs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (allocs[mid].p <= p) lo = mid + 1; else hi = mid;
  }
  if (lo == 0) return NULL;
  struct alloc *a = &allocs[lo - 1];
  return (a->live && p < a->p + (a->n ? a->n : 1)) ? a : NULL;
}

static int range_ok_locked(unsigned long long p, size_t n) {
  struct alloc *a = find(p);
  if (a && p + n <= a->p + a->n) return 1;
  stats.bad_ranges++;
  if (getenv("STANDIN_VERBOSE")) fprintf(stderr, "standin: range %#llx + %zu is outside every live allocation\n", p, n);
  return 0;
}
int standin_check_range(unsigned long long p, size_t n) {
  LOCK();
  int ok = range_ok_locked(p, n);
  UNLOCK();
  return ok;
}

// Zeroes [p, p + n): whole pages by handing them back, the ragged ends by memset.
static void zero_bytes(unsigned long long p, size_t n) {
  unsigned long long lo = (p + PAGE - 1) & ~(PAGE - 1), hi = (p + n) & ~(PAGE - 1);
  if (hi > lo + PAGE) {
    memset((void *)p, 0, lo - p);
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
    memset((void *)hi, 0, p + n - hi);
  } else {
    memset((void *)p, 0, n);
  }
}
void standin_zero(unsigned long long p, size_t n) {
  zero_bytes(p, n);
  standin_mark(p, STANDIN_FROM_DEVICE);
}
void standin_mark(unsigned long long p, int from) {
  LOCK();
  struct alloc *a = find(p);
  if (a) {
    a->from |= from & (STANDIN_FROM_HOST | STANDIN_FROM_DEVICE);
    if (from & STANDIN_NONZERO) a->nonzero = 1;
  }
  UNLOCK();
}

static int alloc_locked(unsigned long long *out, size_t n, int in_pool) {
  if (!arena_init()) return CUDA_ERROR_OUT_OF_MEMORY;
  unsigned long long rounded = (n + PAGE - 1) & ~(PAGE - 1);
  if (rounded == 0) rounded = PAGE;
  if (stats.pool.used + plain_used + n > STANDIN_TOTAL_MEM || arena_used + rounded > ARENA_BYTES)
    return CUDA_ERROR_OUT_OF_MEMORY;
  if (n_allocs == cap_allocs) {
    cap_allocs = cap_allocs ? 2 * cap_allocs : 4096;
    allocs = realloc(allocs, cap_allocs * sizeof *allocs);
    if (!allocs) abort();
  }
  unsigned long long p = (unsigned long long)(arena + arena_used);
  arena_used += rounded;
  allocs[n_allocs++] = (struct alloc){p, n, 1, 0, (unsigned char)in_pool, 0};
  if (in_pool) {
    // The pool grows by what its free bytes cannot cover (no fragmentation modelled).
    stats.pool.used += n;
    if (stats.pool.used > stats.pool.reserved) {
      stats.pool.grow_calls++;
      stats.pool.grow_bytes += stats.pool.used - stats.pool.reserved;
      stats.pool.reserved = stats.pool.used;
    }
    if (stats.pool.used > stats.pool.used_high) stats.pool.used_high = stats.pool.used;
    if (stats.pool.reserved > stats.pool.reserved_high) stats.pool.reserved_high = stats.pool.reserved;
  } else {
    plain_used += n;
    if (plain_used > stats.plain_high) stats.plain_high = plain_used;
  }
  *out = p;
  return CUDA_SUCCESS;
}

static int free_locked(unsigned long long p, int in_pool) {
  struct alloc *a = find(p);
  if (!a || a->p != p || a->pool != in_pool) return CUDA_ERROR_INVALID_VALUE;
  a->live = 0;
  madvise((void *)a->p, (a->n + PAGE - 1) & ~(PAGE - 1), MADV_DONTNEED);
  if (in_pool) stats.pool.used -= a->n; else plain_used -= a->n;
  return CUDA_SUCCESS;
}

int standin_alloc(unsigned long long *p, size_t n, int in_pool) {
  LOCK();
  int r = alloc_locked(p, n, in_pool);
  UNLOCK();
  return r;
}
int standin_free(unsigned long long p, int in_pool) {
  LOCK();
  int r = free_locked(p, in_pool);
  UNLOCK();
  return r;
}

// A synchronisation releases the pool's memory above its release threshold (the driver's rule:
// "on the next call to stream, event or context synchronize").
// A blocking read waits for the device too, but the documented trim points are the explicit
// synchronisations only; STANDIN_TRIM_AT_READS=1 trims at blocking reads as well.
static int trim_at_reads;
__attribute__((constructor)) static void read_env(void) {
  const char *t = getenv("STANDIN_TRIM_AT_READS");
  trim_at_reads = t && strcmp(t, "1") == 0;
}
static void sync_locked(void) {
  stats.host_syncs++;
  unsigned long long keep = stats.pool.used > stats.pool.threshold ? stats.pool.used : stats.pool.threshold;
  if (stats.pool.reserved > keep) {
    stats.pool.trims++;
    stats.pool.trimmed_bytes += stats.pool.reserved - keep;
    stats.pool.reserved = keep;
  }
}
void standin_host_sync(void) {
  LOCK();
  sync_locked();
  UNLOCK();
}

// ---------------------------------------------------------------- modules and functions
// A module keeps its image (PTX text or a cubin ELF); a function is looked up in it by name.
struct module { const void *image; size_t size; char *owned; };
struct function { struct module *m; char *name; int max_dyn_shared; };
#define MAX_FUNCS 4096
static struct function funcs[MAX_FUNCS];
static int n_funcs;

static size_t elf_size(const unsigned char *img) {
  const Elf64_Ehdr *h = (const Elf64_Ehdr *)img;
  size_t end = h->e_shoff + (size_t)h->e_shnum * h->e_shentsize;
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(img + h->e_shoff);
  for (int i = 0; i < h->e_shnum; i++)
    if (sh[i].sh_type != SHT_NOBITS && sh[i].sh_offset + sh[i].sh_size > end) end = sh[i].sh_offset + sh[i].sh_size;
  return end;
}
static int is_elf(const void *img) { return memcmp(img, ELFMAG, SELFMAG) == 0; }

// Whether the image defines an entry point of that name: a PTX `.entry name(` or, in a cubin,
// the symbol's name in its string tables.
static int module_has(const struct module *m, const char *name) {
  size_t len = strlen(name);
  if (!is_elf(m->image)) {
    for (const char *s = m->image; (s = strstr(s, ".entry")) != NULL; s += 6) {
      const char *t = s + 6;
      while (*t == ' ' || *t == '\t') t++;
      if (strncmp(t, name, len) == 0 && (t[len] == '(' || t[len] == ' ' || t[len] == '\n')) return 1;
    }
    return 0;
  }
  for (const char *s = m->image, *end = s + m->size; (s = memmem(s, end - s, name, len + 1)) != NULL; s++)
    if (s == (const char *)m->image || s[-1] == '\0' || s[-1] == '.') return 1;
  return 0;
}

// ---------------------------------------------------------------- the driver: context, device
CUresult cuInit(unsigned flags) { (void)flags; return arena_init() ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d;
  snprintf(name, len, "NVIDIA H100 80GB HBM3 (CPU stand-in)");
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(size_t *bytes, CUdevice d) { (void)d; *bytes = STANDIN_TOTAL_MEM; return CUDA_SUCCESS; }
int standin_attribute(int attr, int *v) {
  switch ((CUdevice_attribute)attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = STANDIN_SMS; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = STANDIN_SHARED_OPTIN; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = STANDIN_SHARED_DEFAULT; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 228 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 50 * 1024 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *v = 0; break;
    default: return 1;
  }
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  if (standin_attribute(a, v))
    return (CUresult)standin_unimplemented("cuDeviceGetAttribute(unlisted attribute)", CUDA_ERROR_INVALID_VALUE);
  return CUDA_SUCCESS;
}
static int ctx_handle;
static CUcontext current;
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)&ctx_handle; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
CUresult cuCtxDestroy(CUcontext c) { if (current == c) current = NULL; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { LOCK(); COUNT(cuCtxSynchronize); sync_locked(); UNLOCK(); return CUDA_SUCCESS; }

static const char *error_name(CUresult e) {
  switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_FILE_NOT_FOUND: return "CUDA_ERROR_FILE_NOT_FOUND";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}
CUresult cuGetErrorName(CUresult e, const char **s) { *s = error_name(e); return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = e == CUDA_ERROR_NOT_SUPPORTED ? "not implemented by the CPU stand-in of the CUDA driver" : error_name(e);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- memory
CUresult cuMemGetInfo(size_t *free_b, size_t *total) {
  LOCK();
  *total = STANDIN_TOTAL_MEM;
  *free_b = STANDIN_TOTAL_MEM - stats.pool.reserved - plain_used;
  UNLOCK();
  return CUDA_SUCCESS;
}
CUresult cuMemAlloc(CUdeviceptr *p, size_t n) { LOCK(); COUNT(cuMemAlloc_v2); int r = alloc_locked(p, n, 0); UNLOCK(); return r; }
CUresult cuMemFree(CUdeviceptr p) { LOCK(); COUNT(cuMemFree_v2); int r = free_locked(p, 0); UNLOCK(); return r; }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
  (void)s;
  LOCK(); COUNT(cuMemAllocAsync); int r = alloc_locked(p, n, 1); UNLOCK();
  return r;
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s) {
  (void)s;
  if (m != (CUmemoryPool)&pool_handle) return CUDA_ERROR_INVALID_VALUE;
  LOCK(); COUNT(cuMemAllocFromPoolAsync); int r = alloc_locked(p, n, 1); UNLOCK();
  return r;
}
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
  (void)s;
  LOCK(); COUNT(cuMemFreeAsync); int r = free_locked(p, 1); UNLOCK();
  return r;
}
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *m, CUdevice d) { (void)d; *m = (CUmemoryPool)&pool_handle; return CUDA_SUCCESS; }
CUresult cuDeviceGetMemPool(CUmemoryPool *m, CUdevice d) { (void)d; *m = (CUmemoryPool)&pool_handle; return CUDA_SUCCESS; }
CUresult cuMemPoolSetAttribute(CUmemoryPool m, CUmemPool_attribute a, void *v) {
  if (m != (CUmemoryPool)&pool_handle) return CUDA_ERROR_INVALID_VALUE;
  LOCK();
  CUresult r = CUDA_SUCCESS;
  switch (a) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: stats.pool.threshold = *(cuuint64_t *)v; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: stats.pool.reserved_high = stats.pool.reserved; break;  // reset to current
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: stats.pool.used_high = stats.pool.used; break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: break;
    default: r = CUDA_ERROR_INVALID_VALUE;
  }
  UNLOCK();
  return r;
}
CUresult cuMemPoolGetAttribute(CUmemoryPool m, CUmemPool_attribute a, void *v) {
  if (m != (CUmemoryPool)&pool_handle) return CUDA_ERROR_INVALID_VALUE;
  LOCK();
  CUresult r = CUDA_SUCCESS;
  switch (a) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)v = stats.pool.threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)v = stats.pool.reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)v = stats.pool.reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)v = stats.pool.used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)v = stats.pool.used_high; break;
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)v = 1; break;
    default: r = CUDA_ERROR_INVALID_VALUE;
  }
  UNLOCK();
  return r;
}
CUresult cuMemPoolTrimTo(CUmemoryPool m, size_t keep) {
  if (m != (CUmemoryPool)&pool_handle) return CUDA_ERROR_INVALID_VALUE;
  LOCK();
  unsigned long long floor = stats.pool.used > keep ? stats.pool.used : keep;
  if (stats.pool.reserved > floor) { stats.pool.trims++; stats.pool.trimmed_bytes += stats.pool.reserved - floor; stats.pool.reserved = floor; }
  UNLOCK();
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- copies and memsets
static CUresult htod(CUdeviceptr dst, const void *src, size_t n) {
  LOCK();
  int ok = range_ok_locked(dst, n);
  if (ok) { struct alloc *a = find(dst); a->from |= STANDIN_FROM_HOST; a->nonzero = 1; }
  UNLOCK();
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  memcpy((void *)dst, src, n);
  return CUDA_SUCCESS;
}
static CUresult dtoh(void *dst, CUdeviceptr src, size_t n) {
  LOCK();
  int ok = range_ok_locked(src, n);
  if (ok) {
    // into pageable memory: the host waits for the device (a blocking read, a host sync)
    stats.blocking_reads++;
    if (trim_at_reads) sync_locked(); else stats.host_syncs++;
    record_read_locked(!(find(src) && find(src)->from == STANDIN_FROM_HOST), n);
  }
  UNLOCK();
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  memcpy(dst, (const void *)src, n);
  return CUDA_SUCCESS;
}
// A copy from an allocation that holds only zeros (nothing but kernels, GEMMs and zero memsets
// wrote it: the stand-in computes nothing) zeroes the destination instead of copying pages.
static CUresult dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  LOCK();
  int ok = range_ok_locked(dst, n) && range_ok_locked(src, n), nonzero = 0;
  if (ok) {
    struct alloc *d = find(dst), *s = find(src);
    d->from |= s->from ? s->from : STANDIN_FROM_DEVICE;
    nonzero = s->nonzero;
    d->nonzero |= nonzero;
  }
  UNLOCK();
  if (!ok) return CUDA_ERROR_INVALID_VALUE;
  if (nonzero) memmove((void *)dst, (const void *)src, n);
  else zero_bytes(dst, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) { LOCK(); COUNT(cuMemcpyHtoD_v2); UNLOCK(); return htod(d, s, n); }
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t n, CUstream st) {
  (void)st; LOCK(); COUNT(cuMemcpyHtoDAsync_v2); UNLOCK(); return htod(d, s, n);
}
CUresult cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) { LOCK(); COUNT(cuMemcpyDtoH_v2); UNLOCK(); return dtoh(d, s, n); }
CUresult cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t n, CUstream st) {
  (void)st; LOCK(); COUNT(cuMemcpyDtoHAsync_v2); UNLOCK(); return dtoh(d, s, n);
}
CUresult cuMemcpyDtoD(CUdeviceptr d, CUdeviceptr s, size_t n) { LOCK(); COUNT(cuMemcpyDtoD_v2); UNLOCK(); return dtod(d, s, n); }
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  (void)st; LOCK(); COUNT(cuMemcpyDtoDAsync_v2); UNLOCK(); return dtod(d, s, n);
}
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  (void)st; LOCK(); COUNT(cuMemcpyAsync); UNLOCK(); return dtod(d, s, n);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st) {
  (void)dc; (void)sc; (void)st; return dtod(d, s, n);
}
static CUresult memset_elems(CUdeviceptr p, unsigned v, size_t n, size_t elt) {
  if (!standin_check_range(p, n * elt)) return CUDA_ERROR_INVALID_VALUE;
  if (v == 0) { standin_zero(p, n * elt); return CUDA_SUCCESS; }
  if (elt == 1) memset((void *)p, (int)v, n);
  else if (elt == 2) for (size_t i = 0; i < n; i++) ((uint16_t *)p)[i] = (uint16_t)v;
  else for (size_t i = 0; i < n; i++) ((uint32_t *)p)[i] = v;
  standin_mark(p, STANDIN_FROM_DEVICE | STANDIN_NONZERO);
  return CUDA_SUCCESS;
}
CUresult cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) { LOCK(); COUNT(cuMemsetD8_v2); UNLOCK(); return memset_elems(p, v, n, 1); }
CUresult cuMemsetD32(CUdeviceptr p, unsigned v, size_t n) { LOCK(); COUNT(cuMemsetD32_v2); UNLOCK(); return memset_elems(p, v, n, 4); }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
  (void)s; LOCK(); COUNT(cuMemsetD8Async); UNLOCK(); return memset_elems(p, v, n, 1);
}
CUresult cuMemsetD16Async(CUdeviceptr p, unsigned short v, size_t n, CUstream s) { (void)s; return memset_elems(p, v, n, 2); }
CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, CUstream s) {
  (void)s; LOCK(); COUNT(cuMemsetD32Async); UNLOCK(); return memset_elems(p, v, n, 4);
}

// ---------------------------------------------------------------- modules, functions, launches
// The image is copied, as the driver does: the caller may free it after the call (cudarc does).
static CUresult load(CUmodule *out, const void *image) {
  struct module *m = calloc(1, sizeof *m);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  m->size = is_elf(image) ? elf_size(image) : strlen(image);
  m->owned = malloc(m->size + 1);
  if (!m->owned) { free(m); return CUDA_ERROR_OUT_OF_MEMORY; }
  memcpy(m->owned, image, m->size);
  m->owned[m->size] = 0;
  m->image = m->owned;
  *out = (CUmodule)m;
  return CUDA_SUCCESS;
}
CUresult cuModuleLoadData(CUmodule *m, const void *image) { return load(m, image); }
CUresult cuModuleLoad(CUmodule *m, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *buf = calloc(1, n + 1);
  if (!buf || fread(buf, 1, n, f) != (size_t)n) { fclose(f); free(buf); return CUDA_ERROR_INVALID_IMAGE; }
  fclose(f);
  CUresult r = load(m, buf);
  free(buf);
  return r;
}
CUresult cuModuleUnload(CUmodule mod) {
  // Functions keep their names (the launch table needs them); the module's image goes.
  LOCK();
  for (int i = 0; i < n_funcs; i++)
    if (funcs[i].m == (struct module *)mod) funcs[i].m = NULL;
  UNLOCK();
  free(((struct module *)mod)->owned);
  free(mod);
  return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name) {
  struct module *m = (struct module *)mod;
  LOCK();
  for (int i = 0; i < n_funcs; i++)
    if (funcs[i].m == m && strcmp(funcs[i].name, name) == 0) { *f = (CUfunction)&funcs[i]; UNLOCK(); return CUDA_SUCCESS; }
  CUresult r = CUDA_SUCCESS;
  if (!module_has(m, name)) {
    r = CUDA_ERROR_NOT_FOUND;
    if (getenv("STANDIN_VERBOSE")) fprintf(stderr, "standin: no function %s in module %p (%.60s)\n", name, (void *)m, (const char *)m->image);
  }
  else if (n_funcs == MAX_FUNCS) r = CUDA_ERROR_OUT_OF_MEMORY;
  else {
    funcs[n_funcs] = (struct function){m, strdup(name), 0};
    *f = (CUfunction)&funcs[n_funcs++];
  }
  UNLOCK();
  return r;
}
CUresult cuFuncGetName(const char **name, CUfunction f) { *name = ((struct function *)f)->name; return CUDA_SUCCESS; }
CUresult cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f) {
  struct function *fn = (struct function *)f;
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = fn->max_dyn_shared; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *v = 90; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  struct function *fn = (struct function *)f;
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (v < 0 || v > STANDIN_SHARED_OPTIN) return CUDA_ERROR_INVALID_VALUE;
    fn->max_dyn_shared = v;
  }
  return CUDA_SUCCESS;
}
// A launch checks what the device would refuse (block size, dynamic shared memory over 48 KB
// without the opt-in) and counts; it computes nothing.
static CUresult launch(CUfunction f, unsigned bx, unsigned by, unsigned bz, unsigned shmem) {
  struct function *fn = (struct function *)f;
  if (!fn || (unsigned long long)bx * by * bz > 1024 || bx * by * bz == 0) return CUDA_ERROR_INVALID_VALUE;
  if (shmem > STANDIN_SHARED_DEFAULT && (int)shmem > fn->max_dyn_shared) return CUDA_ERROR_INVALID_VALUE;
  record_name_locked(G_KERNEL, fn->name);
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, CUstream s, void **params, void **extra) {
  (void)gx; (void)gy; (void)gz; (void)s; (void)params; (void)extra;
  LOCK(); COUNT(cuLaunchKernel); CUresult r = launch(f, bx, by, bz, shmem); UNLOCK();
  return r;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  (void)params; (void)extra;
  LOCK(); COUNT(cuLaunchKernelEx); CUresult r = launch(f, c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes); UNLOCK();
  return r;
}
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned shmem, CUstream s, void **params) {
  (void)gx; (void)gy; (void)gz; (void)s; (void)params;
  LOCK(); COUNT(cuLaunchCooperativeKernel); CUresult r = launch(f, bx, by, bz, shmem); UNLOCK();
  return r;
}

// ---------------------------------------------------------------- streams and events
CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; *s = calloc(1, 16); return *s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned flags, int prio) { (void)prio; return cuStreamCreate(s, flags); }
CUresult cuStreamDestroy(CUstream s) { free(s); return CUDA_SUCCESS; }
CUresult cuStreamQuery(CUstream s) { (void)s; return CUDA_SUCCESS; }
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) { (void)s; *st = CU_STREAM_CAPTURE_STATUS_NONE; return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; LOCK(); COUNT(cuStreamSynchronize); sync_locked(); UNLOCK(); return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) { (void)s; (void)e; (void)flags; LOCK(); COUNT(cuStreamWaitEvent); UNLOCK(); return CUDA_SUCCESS; }
CUresult cuEventCreate(CUevent *e, unsigned flags) { (void)flags; LOCK(); COUNT(cuEventCreate); UNLOCK(); *e = calloc(1, 16); return *e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY; }
CUresult cuEventDestroy(CUevent e) { free(e); return CUDA_SUCCESS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; LOCK(); COUNT(cuEventRecord); UNLOCK(); return CUDA_SUCCESS; }
CUresult cuEventQuery(CUevent e) { (void)e; return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; LOCK(); COUNT(cuEventSynchronize); sync_locked(); UNLOCK(); return CUDA_SUCCESS; }
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) { (void)a; (void)b; *ms = 0; return CUDA_SUCCESS; }

