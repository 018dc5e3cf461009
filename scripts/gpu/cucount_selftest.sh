#!/usr/bin/env bash
# CPU self-test of cucount.c (the LD_PRELOAD counter of CUDA driver calls): a fake libcuda.so.1
# and a program that looks its functions up both ways the real users do (dlsym, as cudarc;
# cuGetProcAddress_v2 by base name, as PyTorch's cudart), calls them a known number of times,
# and the counts and kernel times cucount reports are checked.
#
#   scripts/gpu/cucount_selftest.sh            # exit 0: "cucount self-test: ok"
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT

cat > "$D/fake_cuda.c" <<'EOF'
// Each function does nothing and succeeds; events "take" 0.5 ms; the one kernel is fake_kernel.
#include <string.h>
typedef unsigned long long u64;
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                   unsigned s, void *st, void **p, void **x) { return f ? 0 : 1; }
int cuMemAlloc_v2(u64 *p, size_t n) { *p = 4096; return 0; }
int cuMemFree_v2(u64 p) { return 0; }
int cuStreamSynchronize(void *s) { return 0; }
int cuMemcpyDtoH_v2(void *d, u64 s, size_t n) { return 0; }
static long next_event = 16;
int cuEventCreate(void **e, unsigned f) { *e = (void *)(next_event += 16); return 0; }
int cuEventRecord(void *e, void *s) { return 0; }
int cuEventQuery(void *e) { return 0; }
int cuEventElapsedTime(float *ms, void *a, void *b) { *ms = 0.5f; return 0; }
int cuFuncGetName(const char **name, void *f) { *name = "fake_kernel"; return 0; }
int cuGetProcAddress_v2(const char *sym, void **fn, int version, u64 flags, int *status) {
  static const struct { const char *name; void *fn; } table[] = {
      {"cuLaunchKernel", (void *)cuLaunchKernel}, {"cuMemAlloc", (void *)cuMemAlloc_v2},
      {"cuMemFree", (void *)cuMemFree_v2}, {"cuStreamSynchronize", (void *)cuStreamSynchronize}};
  for (unsigned i = 0; i < sizeof table / sizeof *table; i++)
    if (strcmp(sym, table[i].name) == 0) { *fn = table[i].fn; if (status) *status = 0; return 0; }
  return 500;  // CUDA_ERROR_NOT_FOUND
}
EOF

cat > "$D/user.c" <<'EOF'
// 3 launches, 2 allocations, 1 sync, 2 frees, 1 blocking read through dlsym; then through
// cuGetProcAddress_v2: 2 launches, 1 allocation, 1 sync; a per-thread-stream lookup (not wrapped).
#include <dlfcn.h>
#include <stdio.h>
typedef unsigned long long u64;
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
int main(int argc, char **argv) {
  if (argc < 2) return 2;
  void *lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
  launch_t launch = (launch_t)dlsym(lib, "cuLaunchKernel");
  int (*alloc)(u64 *, size_t) = (int (*)(u64 *, size_t))dlsym(lib, "cuMemAlloc_v2");
  int (*mfree)(u64) = (int (*)(u64))dlsym(lib, "cuMemFree_v2");
  int (*sync)(void *) = (int (*)(void *))dlsym(lib, "cuStreamSynchronize");
  int (*dtoh)(void *, u64, size_t) = (int (*)(void *, u64, size_t))dlsym(lib, "cuMemcpyDtoH_v2");
  int (*gpa)(const char *, void **, int, u64, int *) =
      (int (*)(const char *, void **, int, u64, int *))dlsym(lib, "cuGetProcAddress_v2");
  int k = 7, bad = 0;
  u64 p;
  for (int i = 0; i < 3; i++) bad |= launch(&k, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
  for (int i = 0; i < 2; i++) bad |= alloc(&p, 64);
  bad |= sync(0);
  for (int i = 0; i < 2; i++) bad |= mfree(p);
  char buf[4];
  bad |= dtoh(buf, p, 4);
  void *fn;
  bad |= gpa("cuLaunchKernel", &fn, 12000, 0, 0);
  for (int i = 0; i < 2; i++) bad |= ((launch_t)fn)(&k, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
  bad |= gpa("cuMemAlloc", &fn, 12000, 0, 0);
  bad |= ((int (*)(u64 *, size_t))fn)(&p, 64);
  bad |= gpa("cuStreamSynchronize", &fn, 12000, 0, 0);
  bad |= ((int (*)(void *))fn)(0);
  bad |= gpa("cuLaunchKernel", &fn, 12000, 2, 0);  // per-thread default stream: passed through
  bad |= ((launch_t)fn)(&k, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
  return bad;
}
EOF

# -Bsymbolic: the fake binds its own functions locally, as the real driver does (the table below
# must hand out its own cuLaunchKernel, not a preloaded one of the same name).
cc -O2 -Wall -Wextra -Wno-unused-parameter -shared -fPIC -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic -o "$D/libcuda.so.1" "$D/fake_cuda.c"
cc -O2 -Wall -Wextra -o "$D/user" "$D/user.c" -ldl
cc -O2 -Wall -Wextra -shared -fPIC -o "$D/libcucount.so" "$HERE/cucount.c" -ldl -lpthread
# A program linked against the driver (as the trainer is): 4 launches, 1 allocation, 1 sync.
cat > "$D/linked.c" <<'EOF'
typedef unsigned long long u64;
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                   void **, void **);
int cuMemAlloc_v2(u64 *, unsigned long);
int cuStreamSynchronize(void *);
int main(void) {
  int k = 7, bad = 0;
  u64 p;
  for (int i = 0; i < 4; i++) bad |= cuLaunchKernel(&k, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
  bad |= cuMemAlloc_v2(&p, 64);
  bad |= cuStreamSynchronize(0);
  return bad;
}
EOF
cc -O2 -Wall -Wextra -o "$D/linked" "$D/linked.c" -L"$D" -l:libcuda.so.1 -Wl,-rpath,"$D"

check() { # json python-expression description
  python3 - "$1" "$2" "$3" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if not eval(sys.argv[2], {}, {"r": r}):
    sys.exit(f"cucount self-test: {sys.argv[3]} failed: {sys.argv[2]} on {json.dumps(r)}")
EOF
}

CUCOUNT_OUT=$D/plain.json LD_PRELOAD=$D/libcucount.so "$D/user" "$D/libcuda.so.1"
check "$D/plain.json" 'r["counts"] == {"launch": 5, "alloc": 3, "free": 2, "sync": 2, "read": 1, "copy": 0, "memset": 0, "event": 0}' counts
check "$D/plain.json" 'r["calls"] == {"cuLaunchKernel": 5, "cuMemAlloc_v2": 3, "cuMemFree_v2": 2, "cuStreamSynchronize": 2, "cuMemcpyDtoH_v2": 1}' "per-function calls"
check "$D/plain.json" 'r["unwrapped_ptsz"] == 1 and "kernels" not in r' "per-thread lookups; no timing unless asked"

CUCOUNT_OUT=$D/timed.json CUCOUNT_TIME=1 LD_PRELOAD=$D/libcucount.so "$D/user" "$D/libcuda.so.1"
# The 5 timed launches were all read back by the syncs after them; the timing's own events are not counted.
check "$D/timed.json" 'r["kernels"] == [{"name": "fake_kernel", "n": 5, "ms": 2.5}] and r["kernel_ms_total"] == 2.5' "kernel times"
check "$D/timed.json" 'r["counts"]["event"] == 0 and r["untimed"] == 0 and r["unread"] == 0' "timing leaves the counts alone"

CUCOUNT_OUT=$D/linked.json CUCOUNT_TIME=1 LD_PRELOAD=$D/libcucount.so "$D/linked"
check "$D/linked.json" 'r["calls"] == {"cuLaunchKernel": 4, "cuMemAlloc_v2": 1, "cuStreamSynchronize": 1}' "a linked program's calls"
check "$D/linked.json" 'r["kernels"] == [{"name": "fake_kernel", "n": 4, "ms": 2.0}]' "a linked program's kernel times"

# Without the preload the same program runs and nothing is written.
"$D/user" "$D/libcuda.so.1"
echo "cucount self-test: ok"
