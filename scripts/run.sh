#!/usr/bin/env bash
# The main job: sets up .venv, builds, then runs examples/model_workload.py: a CogVLM-style decoder (and a Llama-sized
# single-expert one) on the fused ops against the CogVLM-style reference, sort + torch._grouped_mm, and torch.compile,
# checked against float64 and timed (prefill, training step, decode, peak memory, kernels per layer) on a CUDA GPU;
# without one, the CPU path at a small size, correctness only. Arguments go to the script (e.g. --quick, --out DIR).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec "$VPY" examples/model_workload.py "$@"
