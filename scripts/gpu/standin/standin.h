// The stand-in's internal interface: the state lives in the driver library (libcuda.so.1); the
// runtime, cuBLAS and cuRAND stand-ins call these to check, zero and count (see README.md).
#ifndef STANDIN_H
#define STANDIN_H
#include <stddef.h>

// Where a device range's bytes came from, for the read report: written from the host (an HtoD
// copy), or by the device (a memset, a device-to-device copy, a GEMM's C, a cuRAND draw).
// STANDIN_NONZERO: the bytes written may be other than 0 (a memset to a value).
enum { STANDIN_FROM_HOST = 1, STANDIN_FROM_DEVICE = 2, STANDIN_NONZERO = 4 };

// 1 when [p, p + n) lies inside one live device allocation, else 0 (and the miss is counted).
int standin_check_range(unsigned long long p, size_t n);
// Zeroes [p, p + n) (pages handed back where whole ones are covered) and marks it device-written.
void standin_zero(unsigned long long p, size_t n);
// Marks the allocation holding p as written by `from` (STANDIN_FROM_* and STANDIN_NONZERO bits).
void standin_mark(unsigned long long p, int from);
// Counts one call of a library function (group "cublas", "curand", "cudart").
void standin_note(const char *group, const char *name);
// Counts one kernel launch by kernel name (runtime launches: cudart's registered functions).
void standin_launch_named(const char *name);
// A host synchronisation (context or stream).
void standin_host_sync(void);
// Device memory for the runtime's cudaMalloc / cudaMallocAsync (pool: 1 = the stream-ordered pool).
int standin_alloc(unsigned long long *p, size_t n, int pool);
int standin_free(unsigned long long p, int pool);
// The stand-in device's value of a device attribute (a CU_DEVICE_ATTRIBUTE_*, which the
// runtime's cudaDevAttr* equal) into *v: 0, or 1 for one it does not list.
int standin_attribute(int attr, int *v);
// Called by every generated stub of a referenced but unimplemented function: counted, reported.
int standin_unimplemented(const char *name, int error);

// An H100 SXM's figures (compute capability 9.0, 132 SMs, 227 KB opt-in shared memory, 80 GB).
#define STANDIN_TOTAL_MEM (80ull << 30)
#define STANDIN_SMS 132
#define STANDIN_SHARED_OPTIN (227 * 1024)
#define STANDIN_SHARED_DEFAULT (48 * 1024)
#endif
