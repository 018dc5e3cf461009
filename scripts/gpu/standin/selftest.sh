#!/usr/bin/env bash
# Self-test of the recording stand-in (README.md), on the CPU: selftest.c is linked as the
# trainer is (the CUDA root's link-time libcuda stub and the real libcublas.so.13, so its cuBLAS
# symbols are versioned as the trainer's), the stand-in is built for it by build.sh, and the
# program runs under it: its own checks (real copies, zeroed GEMM outputs and fresh memory,
# kernels by name, the opt-in rule, the pool's release threshold, a generated stub) and then the
# report's counts are checked. With a CUDA trainer at TRAINER (default
# /tmp/cuda-target/release/trainer) the stand-in is also built for it: every symbol it takes
# from the CUDA libraries defined.
#
#   scripts/gpu/standin/selftest.sh        # exit 0: "standin self-test: ok"
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CUDA_ROOT_DIR=${CUDA_ROOT_DIR:-/tmp/cudaroot}
TRAINER=${TRAINER:-/tmp/cuda-target/release/trainer}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
[[ -f $CUDA_ROOT_DIR/lib/stubs/libcuda.so && -f $CUDA_ROOT_DIR/lib/libcublas.so.13 ]] ||
  { echo "standin self-test: needs $CUDA_ROOT_DIR (scripts/gpu/build.sh wheels root stub)" >&2; exit 1; }

cc -O1 -Wall -Wextra -I"$CUDA_ROOT_DIR/include" -o "$D/selftest" "$HERE/selftest.c" \
  -L"$CUDA_ROOT_DIR/lib/stubs" -L"$CUDA_ROOT_DIR/lib" -lcuda -l:libcublas.so.13
CUDA_ROOT_DIR=$CUDA_ROOT_DIR "$HERE/build.sh" "$D/lib" "$D/selftest" > "$D/build.log"
grep -qx $'libcuda.so.1\tcuMemHostRegister_v2' "$D/lib/unimplemented.txt" ||
  { echo "standin self-test: the unimplemented cuMemHostRegister_v2 got no stub" >&2; exit 1; }
LD_LIBRARY_PATH=$D/lib STANDIN_OUT=$D/report.json "$D/selftest"

check() { # python-expression description
  python3 - "$D/report.json" "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if not eval(sys.argv[2], {}, {"r": r}):
    sys.exit(f"standin self-test: {sys.argv[3]} failed: {sys.argv[2]} on {json.dumps({k: v for k, v in r.items() if k != 'reads'})}")
EOF
}
check 'r["counts"] == {"launch": 5, "alloc": 8, "free": 9, "sync": 3, "read": 5, "copy": 3, "memset": 1, "event": 2}' \
  "the counts by cucount's categories"
check 'r["kernels"] == {"standin_k": 4} and r["kernel_launches"] == 4' "launches by kernel name (refused ones left out)"
check 'r["cublas"] == {"cublasCreate_v2": 1, "cublasGemmStridedBatchedEx": 2, "cublasDestroy_v2": 1} and r["gemm_calls"] == 2' \
  "cuBLAS calls"
check 'r["pool"]["grow_calls"] == 2 and r["pool"]["grow_bytes"] == 2 << 20 and r["pool"]["trims"] == 1 and r["pool"]["release_threshold"] == 2**64 - 1' \
  "pool growth and the release threshold"
check 'r["host_syncs"] == 8 and r["blocking_reads"] == 5 and r["bad_ranges"] == 2' "host syncs, reads, refused ranges"
check 'sum(s["n"] for s in r["reads"]) == 5 and sum(s["computed"] for s in r["reads"]) == 4' \
  "reads of computed data (all but the uploaded buffer)"
check 'r["unimplemented"] == {"cuMemHostRegister_v2": 1}' "the unimplemented call reported"
check 'all([f for f in s["frames"] if "libcuda" not in f][0].split("+")[0].endswith("selftest") for s in r["reads"])' \
  "read sites: the first frame outside the stand-in is the caller's"

if [[ -x $TRAINER ]]; then
  CUDA_ROOT_DIR=$CUDA_ROOT_DIR "$HERE/build.sh" "$D/trainer-lib" "$TRAINER" > "$D/trainer-build.log" ||
    { cat "$D/trainer-build.log" >&2; exit 1; }
  echo "standin self-test: $(tail -1 "$D/trainer-build.log")"
fi
echo "standin self-test: ok"
