# shellcheck shell=bash
# Shared by scripts/gpu/build.sh (which tests to carry) and scripts/gpu/run.sh (which tests to run
# on the device): sourced, not run.

# cuda_capable PROJECT PDIR KIND TNAME: whether the test target TNAME of the package in
# PROJECT/PDIR opens a CUDA device (its source file, or any file of its folder, names
# new_cuda / cuda_if_available / Device::Cuda). The others run on the CPU only and check
# nothing on a GPU.
cuda_capable() {
  local t=$1/$2/tests/$4 srcs=()
  [[ $3 == test ]] || return 1
  [[ -f $t.rs ]] && srcs+=("$t.rs")
  [[ -d $t ]] && srcs+=("$t")
  ((${#srcs[@]})) && grep -rqE --include='*.rs' 'new_cuda|cuda_if_available|Device::Cuda' "${srcs[@]}"
}
