#!/usr/bin/env bash
# The main job: sets up .venv, builds, then runs the fused ops on a transformer-block workload, checks them against
# PyTorch and prints a speed table (on a CUDA GPU; without one, it runs the CPU path and says so).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec "$VPY" examples/transformer_block.py "$@"
