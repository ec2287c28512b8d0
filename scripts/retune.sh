#!/usr/bin/env bash
# Re-tunes the kernel configs for this machine's GPU and rebuilds with them, in one command:
#   bash scripts/retune.sh [aot.tune options, e.g. --ops linear,linear_gather --ms 256,1024,4096 --passes 2 --budget-s 900]
# 1. sets up .venv and builds as scripts/test.sh does (Triton is there: it is the build-time compiler);
# 2. python -m aot.tune measures every candidate config on the GPU (resumable: results in tune_sm<cc>.jsonl; rerun
#    the command to continue an interrupted search) and rewrites aot/configs/sm<arch>.json with the winners;
# 3. rebuilds and reinstalls the package, which compiles the new table's configs in (only those not cached).
# Review the table diff (git diff aot/configs/) and docs/perf.md "Kernel configs" before committing it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
cc="$("$VPY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)')" || {
  echo "retune: needs a CUDA GPU (torch.cuda.get_device_capability failed)" >&2; exit 1; }
arch="$("$VPY" -c "from aot.tune import table_arch; print(table_arch($cc))")"
"$VPY" -m aot.tune --results "tune_sm${cc}.jsonl" --write "aot/configs/sm${arch}.json" "$@"
source "$ROOT/scripts/setup_env.sh"  # rebuild with the new table
"$VPY" -c "import fused_ops; print('[retune] rebuilt with aot/configs/sm${arch}.json; linear_tma m=16 ->',
           fused_ops.kernel_config('routed_linear_tma_kernel' if ${arch} == 90 else 'routed_linear_kernel', 'half', 16, ${cc}))"
