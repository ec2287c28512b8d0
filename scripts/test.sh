#!/usr/bin/env bash
# The test command: sets up .venv, builds, runs every test tier (CPU, interpreter, and GPU when one is visible).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m gpu`.
set -euo pipefail
# Without a visible GPU no kernel image runs: the test build then compiles sm_80 only, which exercises the whole build
# path in a quarter of the time; tests/test_aot_build.py cross-compiles one variant of every kernel that only the sm_90
# build has. FUSED_ARCHS set by the caller wins (e.g. FUSED_ARCHS=auto for the portable build a wheel gets).
NO_GPU=""
nvidia-smi -L >/dev/null 2>&1 || NO_GPU=1
if [ -z "${FUSED_ARCHS:-}" ] && [ -n "$NO_GPU" ]; then
  export FUSED_ARCHS=80
  echo "[test] no GPU visible: building for sm_80 only (set FUSED_ARCHS to choose)"
fi
# The C++ library through CMakeLists.txt where cmake is installed (setup.py, FUSED_BUILD_CMAKE): tests/test_cmake_build.py
# then reuses that build tree instead of compiling the library a second time (143 s on 2 cores).
export FUSED_BUILD_CMAKE="${FUSED_BUILD_CMAKE:-auto}"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
# Without a GPU the tests run on every core: pytest-xdist (a test-only dependency, installed when missing; without it,
# e.g. offline, they run in one process), one test file per worker, so that a file's module fixtures (the CMake build)
# run once (measured on 2 cores: 425 s, against 608 s distributing test by test with those files grouped). With a GPU
# they run in one process: the GPU tier shares one device. FUSED_TEST_WORKERS=1: one process.
workers=()
if [ -n "$NO_GPU" ] && [ "${FUSED_TEST_WORKERS:-}" != "1" ]; then
  "$VPY" -c "import xdist" >/dev/null 2>&1 || "$VPY" -m pip install -q --retries 1 --timeout 20 pytest-xdist \
    || echo "[test] WARNING: could not install pytest-xdist; the tests run in one process"
  if "$VPY" -c "import xdist" >/dev/null 2>&1; then
    workers=(-n "${FUSED_TEST_WORKERS:-$(nproc)}" --dist loadfile)
  fi
fi
exec "$VPY" -m pytest -q -ra "${workers[@]}" tests "$@"
