#!/usr/bin/env bash
# The test command: sets up .venv, builds, runs every test tier (CPU, interpreter, and GPU when one is visible).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m gpu`.
set -euo pipefail
# Without a visible GPU no kernel image runs: the test build then compiles sm_80 only, which exercises the whole build
# path in a quarter of the time; tests/test_aot_build.py cross-compiles one variant of every kernel that only the sm_90
# build has. FUSED_ARCHS set by the caller wins (e.g. FUSED_ARCHS=auto for the portable build a wheel gets).
if [ -z "${FUSED_ARCHS:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  export FUSED_ARCHS=80
  echo "[test] no GPU visible: building for sm_80 only (set FUSED_ARCHS to choose)"
fi
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec "$VPY" -m pytest -q -ra tests "$@"
