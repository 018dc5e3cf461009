// The stand-in's records (README.md): kernels and library calls by name, unimplemented calls,
// device-to-host reads by call stack, and the report written at exit (STANDIN_OUT). Part of
// libcuda.so.1, with driver.c.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "record.h"
#include "standin.h"

struct standin_stats stats;
pthread_mutex_t standin_mu = PTHREAD_MUTEX_INITIALIZER;

// ---------------------------------------------------------------- named counters
// A small table of (group, name) -> count: kernels by name, library calls, unimplemented calls.
struct named { const char *group; char *name; unsigned long long n; };
#define MAX_NAMED 8192
static struct named named[MAX_NAMED];
static int n_named;
static unsigned long long named_overflow;

void record_name_locked(const char *group, const char *name) {
  for (int i = 0; i < n_named; i++)
    if (named[i].group == group && strcmp(named[i].name, name) == 0) { named[i].n++; return; }
  if (n_named == MAX_NAMED) { named_overflow++; return; }
  named[n_named++] = (struct named){group, strdup(name), 1};
}
const char G_KERNEL[] = "kernels", G_CUBLAS[] = "cublas", G_CURAND[] = "curand", G_CUDART[] = "cudart",
           G_UNIMPL[] = "unimplemented";
static const char *group_of(const char *g) {
  static const char *all[] = {G_KERNEL, G_CUBLAS, G_CURAND, G_CUDART, G_UNIMPL};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    if (strcmp(all[i], g) == 0) return all[i];
  return G_UNIMPL;
}
void standin_note(const char *group, const char *name) {
  LOCK();
  record_name_locked(group_of(group), name);
  UNLOCK();
}
void standin_launch_named(const char *name) {
  LOCK();
  stats.runtime_launches++;
  record_name_locked(G_KERNEL, name);
  UNLOCK();
}
int standin_unimplemented(const char *name, int error) {
  standin_note(G_UNIMPL, name);
  if (getenv("STANDIN_VERBOSE")) fprintf(stderr, "standin: %s is not implemented (returns %d)\n", name, error);
  return error;
}

// ---------------------------------------------------------------- device-to-host reads
// Every read is kept by its call stack (return addresses as module + offset, symbolised after
// the run by report.py with addr2line), with how often the bytes read were computed by the
// device rather than uploaded from the host: the stand-in returns zeros for those, so a branch
// on them is flagged.
#define FRAMES 24
struct site { void *pc[FRAMES]; int depth; unsigned long long n, bytes, computed; };
#define MAX_SITES 2048
static struct site sites[MAX_SITES];
static int n_sites;
static unsigned long long sites_overflow;

void record_read_locked(int computed, size_t n) {
  void *pc[FRAMES];
  int depth = backtrace(pc, FRAMES);
  struct site *s = NULL;
  for (int i = 0; i < n_sites && !s; i++)
    if (sites[i].depth == depth && memcmp(sites[i].pc, pc, depth * sizeof *pc) == 0) s = &sites[i];
  if (!s) {
    if (n_sites == MAX_SITES) { sites_overflow++; return; }
    s = &sites[n_sites++];
    memcpy(s->pc, pc, sizeof pc);
    s->depth = depth;
  }
  s->n++;
  s->bytes += n;
  s->computed += computed;
}

// ---------------------------------------------------------------- the report
static void write_group(FILE *o, const char *g) {
  fputc('{', o);
  for (int i = 0, first = 1; i < n_named; i++)
    if (named[i].group == g) {
      if (!first) fputs(", ", o);
      json_string(o, named[i].name);
      fprintf(o, ": %llu", named[i].n);
      first = 0;
    }
  fputc('}', o);
}
static void write_sites(FILE *o) {
  fputc('[', o);
  for (int i = 0; i < n_sites; i++) {
    struct site *s = &sites[i];
    fprintf(o, "%s{\"n\": %llu, \"bytes\": %llu, \"computed\": %llu, \"frames\": [", i ? ", " : "", s->n, s->bytes,
            s->computed);
    for (int k = 0; k < s->depth; k++) {
      Dl_info info;
      char buf[4096];
      // a return address: the call is the instruction before it (addr - 1 for addr2line)
      if (dladdr(s->pc[k], &info) && info.dli_fname)
        snprintf(buf, sizeof buf, "%s+0x%lx", info.dli_fname,
                 (unsigned long)((char *)s->pc[k] - (char *)info.dli_fbase - 1));
      else
        snprintf(buf, sizeof buf, "?+%p", s->pc[k]);
      if (k) fputs(", ", o);
      json_string(o, buf);
    }
    fputs("]}", o);
  }
  fputc(']', o);
}

__attribute__((destructor)) static void report(void) {
  const char *path = getenv("STANDIN_OUT");
  if (!path) return;
  FILE *o = fopen(path, "w");
  if (!o) return;
  LOCK();
  unsigned long long kernel_launches = 0, gemms = 0;
  for (int i = 0; i < n_named; i++) {
    if (named[i].group == G_KERNEL) kernel_launches += named[i].n;
    if (named[i].group == G_CUBLAS && strcasestr(named[i].name, "gemm")) gemms += named[i].n;
  }
  fputc('{', o);
  cucount_write_counts(o, stats.calls);
  fprintf(o, ", \"kernel_launches\": %llu, \"runtime_launches\": %llu, \"gemm_calls\": %llu", kernel_launches,
          stats.runtime_launches, gemms);
  fprintf(o, ", \"host_syncs\": %llu, \"blocking_reads\": %llu, \"bad_ranges\": %llu", stats.host_syncs, stats.blocking_reads,
          stats.bad_ranges);
  fprintf(o, ", \"pool\": {\"release_threshold\": %llu, \"grow_calls\": %llu, \"grow_bytes\": %llu, \"trims\": %llu, "
             "\"trimmed_bytes\": %llu, \"reserved_high\": %llu, \"used_high\": %llu, \"used_now\": %llu}",
          stats.pool.threshold, stats.pool.grow_calls, stats.pool.grow_bytes, stats.pool.trims, stats.pool.trimmed_bytes, stats.pool.reserved_high,
          stats.pool.used_high, stats.pool.used);
  fprintf(o, ", \"plain_alloc_high\": %llu", stats.plain_high);
  fputs(", \"kernels\": ", o);
  write_group(o, G_KERNEL);
  fputs(", \"cublas\": ", o);
  write_group(o, G_CUBLAS);
  fputs(", \"curand\": ", o);
  write_group(o, G_CURAND);
  fputs(", \"cudart\": ", o);
  write_group(o, G_CUDART);
  fputs(", \"unimplemented\": ", o);
  write_group(o, G_UNIMPL);
  fprintf(o, ", \"overflow\": {\"names\": %llu, \"read_sites\": %llu}", named_overflow, sites_overflow);
  fputs(", \"reads\": ", o);
  write_sites(o);
  fputs("}\n", o);
  UNLOCK();
  fclose(o);
}
