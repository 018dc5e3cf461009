// Shared by driver.c and record.c (both in libcuda.so.1): the figures the driver records and
// the calls that record names and reads. Callers hold standin_mu (LOCK) around the _locked ones.
#ifndef STANDIN_RECORD_H
#define STANDIN_RECORD_H
#include <pthread.h>
#include <stddef.h>

#include "../cucount_calls.h"

struct standin_stats {
  unsigned long long calls[N_FUNCS];  // by cucount_calls.h's table
  unsigned long long runtime_launches, host_syncs, blocking_reads, bad_ranges, plain_high;
  struct {
    unsigned long long used, reserved, used_high, reserved_high, threshold;
    unsigned long long grow_calls, grow_bytes, trims, trimmed_bytes;
  } pool;
};
extern struct standin_stats stats;
extern pthread_mutex_t standin_mu;
#define LOCK() pthread_mutex_lock(&standin_mu)
#define UNLOCK() pthread_mutex_unlock(&standin_mu)
#define COUNT(name) (stats.calls[ID_##name]++)

// The groups of named counts in the report.
extern const char G_KERNEL[], G_CUBLAS[], G_CURAND[], G_CUDART[], G_UNIMPL[];
void record_name_locked(const char *group, const char *name);
// A device-to-host read of n bytes by the caller's call stack; computed: the bytes came from the
// device, not only from uploads.
void record_read_locked(int computed, size_t n);
#endif
