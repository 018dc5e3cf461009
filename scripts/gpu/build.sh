#!/usr/bin/env bash
# build.sh: build the `cuda` variant of this workspace on a machine with no GPU and no CUDA
# toolkit, for the GPU machines (H100/H200, sm_90; NVIDIA driver 580 = CUDA 13.0, glibc 2.39,
# CUDA 13.0 libraries in /usr/local/cuda/lib64), and pack what the `device` tool carries.
#
#   scripts/gpu/build.sh                 # every step below, in order
#   scripts/gpu/build.sh wheels root     # some steps only (each is cached; safe to rerun)
#
# Steps:
#   wheels  pip-download the pinned CUDA 13.0 wheels (nvcc, nvvm, crt, cccl, cudart, nvrtc,
#           cublas, curand) into WHEELS
#   root    assemble a CUDA root from them in CUDA_ROOT_DIR (unversioned .so links, targets/)
#   cubins  check the committed Triton cubins against CUDA 13.0's ptxas (scripts/gpu/cubins.sh
#           --check); CUBINS=write rewrites them instead, CUBINS=skip skips; by default (auto) it
#           runs only when .venv-triton exists (scripts/python/triton_setup.sh makes it)
#   clone   clone the repository's committed REV (HEAD) into PROJ: uncommitted changes are not built
#   stub    a link-time stub libcuda.so (the driver library is not on PyPI), and
#           CUDA_ROOT_DIR/lib/stubs/run/libcuda.so.1 to start the executables on a CPU machine
#           (LD_LIBRARY_PATH=that dir; every driver call fails with CUDA_ERROR_NO_DEVICE)
#   cargo   cargo build the trainer, the workspace tests (--no-run) and trainer's bench
#           (--no-run), all with the cuda features, into CARGO_TARGET_DIR (/tmp/cuda-target)
#   pack    stripped executables, manifest.tsv, BUILD-INFO.txt, run-tests.sh, the project's
#           files and the data into PACK (/tmp/gpu-pack; ZSTD=1 also writes PACK.tar.zst)
#   carry   .gpu/pack.tar.xz at the repository root (git ignores /.gpu/): pack/bin/trainer and
#           pack/bin/libcucount.so (scripts/gpu/cucount.c), the
#           test executables whose source opens a CUDA device, pack/manifest.tsv (their rows) and
#           pack/BUILD-INFO.txt; at most 64 MiB (the device tool's limit), or it fails
#
# Overridable: PROJ CARGO_TARGET_DIR WHEELS CUDA_ROOT_DIR PACK CARRY DATA JOBS CUDA_COMPUTE_CAP REV
# EXTRA_WHEELS (more pins for the wheels step)
# Skip parts of `cargo`: SKIP_BENCH=1 SKIP_TESTS=1.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
REV=${REV:-HEAD}
PROJ=${PROJ:-/tmp/cudaproj}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/cuda-target}
WHEELS=${WHEELS:-/tmp/cudawheels}
CUDA_ROOT_DIR=${CUDA_ROOT_DIR:-/tmp/cudaroot}
PACK=${PACK:-/tmp/gpu-pack}
CARRY=${CARRY:-$SRC/.gpu/pack.tar.xz}
CARRY_LIMIT=$((64 * 1024 * 1024))
DATA=${DATA:-$SRC/data/tinyshakespeare.txt}
[[ -f $DATA ]] || DATA=$SRC/../shared/data/tinyshakespeare.txt
JOBS=${JOBS:-2}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}   # cudaforge turns 90 into sm_90a / compute_90a
LOGDIR=${LOGDIR:-/tmp/cuda-build-logs}
ALL_STEPS=(wheels root cubins clone stub cargo pack carry)
STEPS=("$@")
((${#STEPS[@]})) || STEPS=("${ALL_STEPS[@]}")
for s in "${STEPS[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || { echo "build.sh: unknown step $s (${ALL_STEPS[*]})" >&2; exit 2; }
done
want() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
mkdir -p "$LOGDIR"
T0=$SECONDS

# CUDA 13.0 GA / update 1 (the GPU machines' nvcc is 13.0.88). nvcc, nvvm, crt, cccl and the
# cudart headers generate code; the cublas/curand/nvrtc/cudart libraries are only linked
# against (sonames libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13,
# libcudart.so.13): the GPU machine's own copies are used at run time.
WHEEL_PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14
  nvidia-curand==10.4.0.35
)
wheel_of() { # pin -> the downloaded wheel's path (glob)
  local name=${1%%==*} ver=${1##*==}
  compgen -G "$WHEELS/${name//-/_}-${ver}-*.whl" | head -1
}

# ---------------------------------------------------------------- wheels
if want wheels; then
  mkdir -p "$WHEELS"
  missing=()
  # EXTRA_WHEELS: more pins downloaded with the same tags (.ci/build-nccl.sh: NCCL)
  read -r -a extra <<< "${EXTRA_WHEELS:-}"
  for pin in "${WHEEL_PINS[@]}" "${extra[@]}"; do [[ -n $(wheel_of "$pin") ]] || missing+=("$pin"); done
  if ((${#missing[@]})); then
    log "downloading wheels: ${missing[*]}"
    # Every tag these wheels use (the compiler wheels, nvcc and runtime, are manylinux2014,
    # the others 2_27, NCCL 2_18): some pips take --platform literally, without older tags.
    pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_18_x86_64 --platform manylinux_2_27_x86_64 \
      --python-version 3.11 -d "$WHEELS" "${missing[@]}"
  fi
  for pin in "${WHEEL_PINS[@]}" "${extra[@]}"; do
    [[ -n $(wheel_of "$pin") ]] || { echo "build.sh: wheel $pin not downloaded" >&2; exit 1; }
  done
fi

# ---------------------------------------------------------------- root
if want root && [[ ! -f $CUDA_ROOT_DIR/.complete ]]; then
  log "assembling the CUDA root in $CUDA_ROOT_DIR"
  rm -rf "$CUDA_ROOT_DIR" "$CUDA_ROOT_DIR.stage"
  mkdir -p "$CUDA_ROOT_DIR.stage"
  for pin in "${WHEEL_PINS[@]}"; do
    whl=$(wheel_of "$pin")
    [[ -n $whl ]] || { echo "build.sh: wheel $pin missing: run the wheels step" >&2; exit 1; }
    unzip -q -o "$whl" 'nvidia/cu13/*' -d "$CUDA_ROOT_DIR.stage"
  done
  mv "$CUDA_ROOT_DIR.stage/nvidia/cu13" "$CUDA_ROOT_DIR"
  rm -rf "$CUDA_ROOT_DIR.stage"
  (
    cd "$CUDA_ROOT_DIR"
    rm -f lib/libnvblas.so.13 lib/*.alt.so*          # not needed: a smaller root
    chmod +x bin/* nvvm/bin/* 2>/dev/null || true
    for so in lib/lib*.so.*; do                      # unversioned names for the linker (-lcudart)
      base=${so%%.so.*}.so
      [[ -e $base ]] || ln -s "$(basename "$so")" "$base"
    done
    ln -sfn lib lib64
    mkdir -p targets/x86_64-linux                    # nvcc.profile: $(TOP)/targets/x86_64-linux
    ln -sfn ../../include targets/x86_64-linux/include
    ln -sfn ../../lib targets/x86_64-linux/lib
  )
  touch "$CUDA_ROOT_DIR/.complete"
fi
cuda_env() {
  [[ -f $CUDA_ROOT_DIR/.complete ]] || { echo "build.sh: no CUDA root: run the wheels and root steps" >&2; exit 1; }
  export PATH=$CUDA_ROOT_DIR/bin:$PATH
  export CUDA_HOME=$CUDA_ROOT_DIR CUDA_ROOT=$CUDA_ROOT_DIR CUDA_PATH=$CUDA_ROOT_DIR
  export NVCC=$CUDA_ROOT_DIR/bin/nvcc
  export CUDARC_CUDA_VERSION=13000   # what cudarc would parse from `nvcc --version`; pinned
  [[ $(nvcc --version) == *"release 13.0,"* ]] || { echo "build.sh: nvcc is not 13.0" >&2; exit 1; }
}

# ---------------------------------------------------------------- cubins
if want cubins; then
  mode=${CUBINS:-auto}
  [[ $mode == auto ]] && { [[ -x $SRC/.venv-triton/bin/python ]] && mode=check || mode=skip; }
  case $mode in
    check) log "cubins: checking the committed cubins against CUDA 13.0's ptxas"
           CUDA_ROOT_DIR=$CUDA_ROOT_DIR bash "$SRC/scripts/gpu/cubins.sh" --check ;;
    write) log "cubins: recompiling with CUDA 13.0's ptxas (commit the result before building)"
           CUDA_ROOT_DIR=$CUDA_ROOT_DIR bash "$SRC/scripts/gpu/cubins.sh" ;;
    skip)  log "cubins: skipped (no .venv-triton; scripts/python/triton_setup.sh, or CUBINS=check)" ;;
    *)     echo "build.sh: CUBINS=$mode (auto, check, write or skip)" >&2; exit 2 ;;
  esac
fi

# ---------------------------------------------------------------- clone
if want clone; then
  [[ -d $PROJ/.git ]] || { log "cloning $SRC into $PROJ"; git clone -q "$SRC" "$PROJ"; }
  git -C "$PROJ" fetch -q "$SRC" "$REV"
  git -C "$PROJ" checkout -q --detach FETCH_HEAD
  log "project at $(git -C "$PROJ" rev-parse HEAD)"
  (cd "$PROJ" && nice -n 10 cargo fetch -q)
fi

# ---------------------------------------------------------------- stub
if want stub; then
  [[ -f $PROJ/Cargo.lock ]] || { echo "build.sh: no $PROJ: run the clone step" >&2; exit 1; }
  # cudarc (dynamic linking) links -lcuda: give the linker a stub with the real soname that
  # defines every cu* entry point of cudarc's driver bindings. At run time the GPU machine's
  # libcuda.so.1 is loaded instead.
  cudarc_ver=$(awk '/^name = "cudarc"/{getline; gsub(/[^0-9.]/,""); print}' "$PROJ/Cargo.lock")
  CUDARC_DIR=$(compgen -G "${CARGO_HOME:-$HOME/.cargo}/registry/src/*/cudarc-$cudarc_ver" | head -1)
  [[ -n $CUDARC_DIR ]] || { echo "build.sh: cudarc $cudarc_ver not in the cargo registry (clone step)" >&2; exit 1; }
  STUB=$CUDA_ROOT_DIR/lib/stubs/libcuda.so
  if [[ ! -f $STUB || $CUDARC_DIR/src/driver/sys/mod.rs -nt $STUB ]]; then
    log "building the stub $STUB from $CUDARC_DIR"
    mkdir -p "$(dirname "$STUB")"
    # Every entry point returns CUDA_ERROR_NO_DEVICE (100), so a run against the stub fails
    # cleanly; cuGetErrorString/Name fill in a message.
    { echo '#include <stddef.h>'
      echo 'int cuGetErrorString(int e, const char **s) { if (s) *s = "no CUDA driver (libcuda link stub)"; return 0; }'
      echo 'int cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }'
      grep -ohP '^\s+fn \Kcu\w+(?=\()' "$CUDARC_DIR"/src/driver/sys/mod.rs | sort -u |
        grep -vxE 'cuGetError(String|Name)' | sed 's/.*/int &(void) { return 100; }/'
    } > "$CUDA_ROOT_DIR/lib/stubs/libcuda_stub.c"
    gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$STUB" "$CUDA_ROOT_DIR/lib/stubs/libcuda_stub.c"
    mkdir -p "$CUDA_ROOT_DIR/lib/stubs/run"
    ln -sfn ../libcuda.so "$CUDA_ROOT_DIR/lib/stubs/run/libcuda.so.1"
  fi
fi

# ---------------------------------------------------------------- cargo
FEATS="candle-train/cuda,trainer/cuda,candle-remat/cuda,candle-amp/cuda,candle-pipeline/cuda"
BUILD_S=
if want cargo; then
  cuda_env
  [[ -f $CUDA_ROOT_DIR/lib/stubs/libcuda.so ]] || { echo "build.sh: no libcuda stub: run the stub step" >&2; exit 1; }
  # RUNPATH: the GPU machine finds libcudart/libcublas/... in /usr/local/cuda/lib64 without
  # LD_LIBRARY_PATH (which still wins); libcuda.so.1 comes from the driver's directory.
  export RUSTFLAGS="${RUSTFLAGS:-} -C link-arg=-Wl,-rpath,/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib"
  CARGO=(nice -n 10 cargo)
  cd "$PROJ"
  log "cargo build --release -p trainer --features cuda"
  "${CARGO[@]}" build --release -j "$JOBS" -p trainer --features cuda \
    --message-format=json-render-diagnostics > "$LOGDIR/build.json" 2> >(tee "$LOGDIR/build.log" >&2)
  if [[ ${SKIP_TESTS:-0} != 1 ]]; then
    log "cargo test --workspace --release --features $FEATS --no-run"
    "${CARGO[@]}" test --workspace --release -j "$JOBS" --features "$FEATS" --no-run \
      --message-format=json-render-diagnostics > "$LOGDIR/tests.json" 2> >(tee "$LOGDIR/tests.log" >&2)
  else
    rm -f "$LOGDIR/tests.json"
  fi
  if [[ ${SKIP_BENCH:-0} != 1 ]]; then
    log "cargo bench -p trainer --features cuda --no-run"
    "${CARGO[@]}" bench -j "$JOBS" -p trainer --features cuda --no-run \
      --message-format=json-render-diagnostics > "$LOGDIR/bench.json" 2> >(tee "$LOGDIR/bench.log" >&2)
  else
    rm -f "$LOGDIR/bench.json"
  fi
  cd - >/dev/null
  BUILD_S=$((SECONDS - T0))
  echo "$BUILD_S" > "$LOGDIR/build-seconds"
fi

# ---------------------------------------------------------------- pack
if want pack; then
  cuda_env
  [[ -f $LOGDIR/build.json ]] || { echo "build.sh: no $LOGDIR/build.json: run the cargo step" >&2; exit 1; }
  COMMIT=$(git -C "$PROJ" rev-parse HEAD)
  log "packing into $PACK"
  rm -rf "$PACK"; mkdir -p "$PACK"/{bin,tests,benches,shared/data,project}
  git -C "$PROJ" archive "$COMMIT" | tar -x -C "$PACK/project"
  [[ -f $DATA ]] && cp "$DATA" "$PACK/shared/data/"
  # manifest.tsv: name, kind, package, target, package dir (relative to the project root),
  # original path; from cargo's JSON: the executables of the test profile, and the benches.
  jq_sel='select(.reason=="compiler-artifact" and .executable != null)
    | [.manifest_path, .target.kind[0], .target.name, (.profile.test|tostring), .executable] | @tsv'
  (cd "$PROJ" && cargo metadata -q --no-deps --format-version 1) |
    jq -r '.packages[] | [.manifest_path, .name] | @tsv' > "$LOGDIR/pkgs.tsv"
  : > "$PACK/manifest.tsv"
  add() { # cargo-json-file
    jq -r "$jq_sel" "$1" | while IFS=$'\t' read -r manifest kind tname istest exe; do
      pkg=$(awk -F'\t' -v m="$manifest" '$1 == m { print $2 }' "$LOGDIR/pkgs.tsv")
      pdir=$(dirname "$(realpath --relative-to="$PROJ" "$manifest")")
      case $kind in
        bin) if [[ $istest == true ]]; then name="$pkg--bin-$tname"; dir=tests
             else [[ $tname == trainer ]] || continue; name=trainer; dir=bin; fi ;;
        lib|rlib|cdylib) name="$pkg--lib"; dir=tests ;;
        test) name="$pkg--test-$tname"; dir=tests ;;
        bench) name="$pkg--bench-$tname"; dir=benches ;;
        *) continue ;;
      esac
      [[ -e $PACK/$dir/$name ]] && continue
      strip -o "$PACK/$dir/$name" "$exe"
      [[ $dir == bin ]] ||
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$dir/$name" "$kind" "$pkg" "$tname" "$pdir" "$exe" >> "$PACK/manifest.tsv"
    done
  }
  add "$LOGDIR/build.json"
  [[ -f $LOGDIR/tests.json ]] && add "$LOGDIR/tests.json"
  [[ -f $LOGDIR/bench.json ]] && add "$LOGDIR/bench.json"
  [[ -x $PACK/bin/trainer ]] || { echo "build.sh: the trainer is missing from the pack" >&2; exit 1; }
  # Paths baked in at compile time (env!): CARGO_BIN_EXE_trainer (trainer/tests/cli.rs) and
  # CARGO_MANIFEST_DIR/../../shared/data (trainer's unit tests); run-tests.sh recreates them.
  BAKED_TRAINER=$CARGO_TARGET_DIR/release/trainer
  BAKED_DATA=$(realpath -m "$PROJ/trainer/../../shared/data/tinyshakespeare.txt")
  cat > "$PACK/BUILD-INFO.txt" <<EOF
project commit: $COMMIT (from $SRC)
built: $(date -u +%FT%TZ) on $(uname -m), $(getconf GNU_LIBC_VERSION), $(rustc --version)
cuda: nvcc $(nvcc --version | tail -2 | head -1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP (PTX/SASS for sm_90a); CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION
wheels: ${WHEEL_PINS[*]}
features: trainer: cuda; tests: $FEATS
runtime needs: NVIDIA driver >= 580 (CUDA 13.0) libcuda.so.1; /usr/local/cuda/lib64: libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13
baked paths: $BAKED_TRAINER  $BAKED_DATA
cargo seconds (last cargo step): $(cat "$LOGDIR/build-seconds" 2>/dev/null || echo unknown)
EOF
  cat > "$PACK/run-tests.sh" <<EOF
#!/usr/bin/env bash
# Runs every packed test executable. Usage: ./run-tests.sh [args for each test exe]
# e.g. ./run-tests.sh --test-threads=1   or  ONLY=trainer ./run-tests.sh   (substring of the name)
# Each exe runs with cwd = its package dir inside ./project (as cargo test does). Logs: ./logs/
# On a CPU machine: LD_LIBRARY_PATH=$CUDA_ROOT_DIR/lib/stubs/run ./run-tests.sh (no CUDA device).
set -u
HERE=\$(cd "\$(dirname "\$0")" && pwd)
export LD_LIBRARY_PATH=\${LD_LIBRARY_PATH:+\$LD_LIBRARY_PATH:}/usr/local/cuda/lib64
export RUST_BACKTRACE=\${RUST_BACKTRACE:-1}
provide() { # baked-path pack-path: the compile-time absolute paths, as links into this pack
  if [[ -e \$1 ]]; then [[ \$1 -ef \$2 ]] || echo "NOTE: \$1 exists (not this pack's copy); the tests use it" >&2
  else mkdir -p "\$(dirname "\$1")" && ln -s "\$2" "\$1" || echo "WARNING: cannot create \$1" >&2; fi
}
provide "$BAKED_TRAINER" "\$HERE/bin/trainer"
[[ -f \$HERE/shared/data/tinyshakespeare.txt ]] && provide "$BAKED_DATA" "\$HERE/shared/data/tinyshakespeare.txt"
mkdir -p "\$HERE/logs"
pass=0; fail=0; failed=()
while IFS=\$'\t' read -r exe kind pkg tname pdir orig; do
  [[ \$exe == tests/* ]] || continue
  [[ -n \${ONLY:-} && \$exe != *\$ONLY* ]] && continue
  name=\$(basename "\$exe")
  echo "=== \$name (cwd project/\$pdir)"
  ( cd "\$HERE/project/\$pdir" && "\$HERE/\$exe" "\$@" ) > "\$HERE/logs/\$name.log" 2>&1
  rc=\$?
  tail -n 3 "\$HERE/logs/\$name.log"
  if ((rc == 0)); then pass=\$((pass+1)); else fail=\$((fail+1)); failed+=("\$name(rc=\$rc)"); fi
done < "\$HERE/manifest.tsv"
echo "=== \$pass passed, \$fail failed \${failed[*]:-}"
((fail == 0))
EOF
  chmod +x "$PACK/run-tests.sh"
  log "pack: $(du -sh "$PACK" | cut -f1) in $PACK"
  if [[ ${ZSTD:-0} == 1 ]]; then
    tar -C "$(dirname "$PACK")" -cf - "$(basename "$PACK")" | zstd -q -T0 -19 --long=27 -f -o "$PACK.tar.zst"
    log "also $(du -h "$PACK.tar.zst" | cut -f1) as $PACK.tar.zst"
  fi
fi

# ---------------------------------------------------------------- carry
if want carry; then
  [[ -f $PACK/manifest.tsv && -x $PACK/bin/trainer ]] || { echo "build.sh: no pack in $PACK: run the pack step" >&2; exit 1; }
  # the test executables whose source opens a CUDA device (scripts/gpu/run.sh's rule, also
  # reading the test's module folder: tests/linear_cross_entropy.rs keeps its CUDA case in
  # tests/linear_cross_entropy/memory_and_cuda.rs)
  # shellcheck source=scripts/gpu/lib.sh
  source "$SRC/scripts/gpu/lib.sh"
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/pack/bin" "$stage/pack/tests"
  cp "$PACK/bin/trainer" "$stage/pack/bin/"
  # run.sh's counter of driver calls (its counts part builds it there if missing)
  cc -O2 -shared -fPIC -o "$stage/pack/bin/libcucount.so" "$SRC/scripts/gpu/cucount.c" -ldl -lpthread
  cp "$PACK/BUILD-INFO.txt" "$stage/pack/"
  : > "$stage/pack/manifest.tsv"
  # An executable whose tests are all compiled out (candle-comm's nccl tests without the `nccl`
  # feature) has nothing to run: listed under the stub driver, it names no test.
  stub_libs=$CUDA_ROOT_DIR/lib/stubs/run:$CUDA_ROOT_DIR/lib
  while IFS=$'\t' read -r exe kind pkg tname pdir orig; do
    if [[ $exe != tests/* ]] || ! cuda_capable "$PACK/project" "$pdir" "$kind" "$tname"; then continue; fi
    listed=$(LD_LIBRARY_PATH=$stub_libs "$PACK/$exe" --list 2> /dev/null || true)
    if ! grep -q ': test$' <<< "$listed"; then
      log "carry: $exe lists no test in this build: not carried"
      continue
    fi
    cp "$PACK/$exe" "$stage/pack/tests/"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$exe" "$kind" "$pkg" "$tname" "$pdir" "$orig" >> "$stage/pack/manifest.tsv"
  done < "$PACK/manifest.tsv"
  [[ -s $stage/pack/manifest.tsv ]] || echo "build.sh: warning: no CUDA test executable in $PACK" >&2
  mkdir -p "$(dirname "$CARRY")"
  log "carry: compressing $(du -sh "$stage/pack" | cut -f1) ($(wc -l < "$stage/pack/manifest.tsv") test executables)"
  tar -C "$stage" -cf - pack | xz -T2 -9 > "$CARRY.part"
  size=$(stat -c %s "$CARRY.part")
  if ((size > CARRY_LIMIT)); then
    rm -f "$CARRY.part" "$CARRY"   # no stale pack left to carry
    echo "build.sh: the carry pack is $size bytes, over the device tool's 64 MiB ($CARRY_LIMIT): carry fewer executables" >&2
    exit 1
  fi
  mv "$CARRY.part" "$CARRY"
  log "carry: $CARRY, $size bytes: $(cut -f1 "$stage/pack/manifest.tsv" | xargs -n1 basename | tr '\n' ' ')"
fi
log "done in $((SECONDS - T0)) s (steps: ${STEPS[*]})"
