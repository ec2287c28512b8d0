#!/usr/bin/env bash
# The test command: sets up .venv, builds, runs every test tier (CPU, interpreter, and GPU when one is visible).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m gpu`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec "$VPY" -m pytest -q -ra tests "$@"
