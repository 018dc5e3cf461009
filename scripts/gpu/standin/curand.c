// The stand-in for cuRAND (libcurand.so.10): generators exist and are counted; a draw checks
// its output range and zeroes it (as a kernel's output under the stand-in: nothing computed).
#include <curand.h>
#include <stdlib.h>

#include "standin.h"

#define NOTE() standin_note("curand", __func__)

curandStatus_t curandCreateGenerator(curandGenerator_t *g, curandRngType_t t) {
  (void)t;
  NOTE();
  *g = calloc(1, 16);
  return *g ? CURAND_STATUS_SUCCESS : CURAND_STATUS_ALLOCATION_FAILED;
}
curandStatus_t curandDestroyGenerator(curandGenerator_t g) { NOTE(); free(g); return CURAND_STATUS_SUCCESS; }
curandStatus_t curandSetStream(curandGenerator_t g, cudaStream_t s) { (void)g; (void)s; NOTE(); return CURAND_STATUS_SUCCESS; }
curandStatus_t curandSetPseudoRandomGeneratorSeed(curandGenerator_t g, unsigned long long seed) {
  (void)g; (void)seed;
  NOTE();
  return CURAND_STATUS_SUCCESS;
}
curandStatus_t curandSetGeneratorOffset(curandGenerator_t g, unsigned long long off) { (void)g; (void)off; NOTE(); return CURAND_STATUS_SUCCESS; }

static curandStatus_t draw(void *out, size_t bytes) {
  if (!standin_check_range((unsigned long long)out, bytes)) return CURAND_STATUS_LAUNCH_FAILURE;
  standin_zero((unsigned long long)out, bytes);
  return CURAND_STATUS_SUCCESS;
}
curandStatus_t curandGenerate(curandGenerator_t g, unsigned *out, size_t n) { (void)g; NOTE(); return draw(out, n * 4); }
curandStatus_t curandGenerateUniform(curandGenerator_t g, float *out, size_t n) { (void)g; NOTE(); return draw(out, n * 4); }
curandStatus_t curandGenerateUniformDouble(curandGenerator_t g, double *out, size_t n) { (void)g; NOTE(); return draw(out, n * 8); }
curandStatus_t curandGenerateNormal(curandGenerator_t g, float *out, size_t n, float mean, float sd) {
  (void)g; (void)mean; (void)sd;
  NOTE();
  return draw(out, n * 4);
}
curandStatus_t curandGenerateNormalDouble(curandGenerator_t g, double *out, size_t n, double mean, double sd) {
  (void)g; (void)mean; (void)sd;
  NOTE();
  return draw(out, n * 8);
}
