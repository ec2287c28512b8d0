#!/usr/bin/env bash
# The C++ deployment example in one command (README, "Deployment"): builds the op library and examples/cpp with
# CMake, runs ctest (the model exported from Python, then TorchScript and AOTInductor inference and training from
# C++, on the CPU and, when a GPU is visible, on CUDA), installs the library with its CMake package config, and builds
# and runs a consumer of that install (examples/cpp on its own: find_package + target_link_libraries) without
# LD_LIBRARY_PATH.
#
#   bash scripts/cpp_example.sh
#
# Environment: VPY, a Python with torch, triton (build time) and fused_ops, skips the set-up of .venv
# (scripts/setup_env.sh, which otherwise runs first); FUSED_CMAKE_BUILD (default build/cmake, the tree the pip build,
# setup.py, made the library in where cmake is installed: with the same FUSED_ARCHS only the examples compile);
# FUSED_ARCHS (default auto: aot/compile.py resolve_archs); MAX_JOBS. Works offline. Exit status: 0 all passed (CUDA
# entries may show as skipped without a GPU), 1 a failure, 3 cmake is not installed (nothing was built).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VPY:-}" ]; then
  source "$ROOT/scripts/setup_env.sh"
fi
cd "$ROOT"
export PATH="$(dirname "$VPY"):$PATH"  # a cmake or ninja installed into the venv by pip counts too
say() { echo "[cpp_example] $*"; }
if ! command -v cmake >/dev/null; then
  say "cmake is not installed: the C++ example was NOT built or run"
  exit 3
fi
BUILD="${FUSED_CMAKE_BUILD:-$ROOT/build/cmake}"
ARCHS="${FUSED_ARCHS:-auto}"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
# The pip build's AOT cache, when there is one: the CMake build then compiles only C++ (see CMakeLists.txt).
CACHE=()
[ -d "$ROOT/build/aot/cache" ] && CACHE=(-DFUSED_AOT_CACHE="$ROOT/build/aot/cache")
say "$(cmake --version | head -n 1); build folder $BUILD; archs $ARCHS; python $VPY"

cmake -S "$ROOT" -B "$BUILD" ${GEN[@]+"${GEN[@]}"} -DPython3_EXECUTABLE="$VPY" -DFUSED_ARCHS="${ARCHS//,/;}" \
  -DCMAKE_BUILD_TYPE=Release ${CACHE[@]+"${CACHE[@]}"}
cmake --build "$BUILD" -j "${MAX_JOBS:-$(nproc)}"
say "ctest (the check lines of each program follow its name)"
(cd "$BUILD" && ctest --output-on-failure -V)

say "install, then a consumer project against the install"
cmake --install "$BUILD" --prefix "$BUILD/install" >/dev/null
cmake -S "$ROOT/examples/cpp" -B "$BUILD/consumer" ${GEN[@]+"${GEN[@]}"} -DCMAKE_PREFIX_PATH="$BUILD/install" \
  -DPython3_EXECUTABLE="$VPY" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD/consumer" --target fused_infer
readelf -d "$BUILD/consumer/fused_infer" | grep -E "NEEDED|RUNPATH|RPATH" || true
for dev in cpu cuda; do
  rc=0
  env -u LD_LIBRARY_PATH "$BUILD/consumer/fused_infer" "$dev" "$BUILD/examples/cpp/exported" || rc=$?
  if [ "$rc" = 77 ]; then
    say "consumer on $dev: SKIPPED (no device)"
  elif [ "$rc" != 0 ]; then
    say "consumer on $dev: FAILED (exit $rc)"
    exit 1
  fi
done
say "all passed"
