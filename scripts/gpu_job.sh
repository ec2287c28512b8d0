#!/usr/bin/env bash
# One GPU job: environment report, Liger-Kernel wheel, build + install, tests, RoPE benchmark.
#
#   OUT=/some/dir bash scripts/gpu_job.sh      # from anywhere; it cd's to the repository root
#
# On the device tool: run `bash scripts/gpu_job.sh` with carry=[".whl"] (the Liger wheel lives in the
# git-ignored .whl/ folder; without it the benchmark just prints "liger-kernel not available").
#
# Files written to $OUT (7, the device tool brings back at most 8):
#   job.log          environment, step timings and the final summary
#   build.log        full (verbose) build output
#   tests.log        pytest -m gpu, then the full suite
#   bench_rope.log   benchmark output
#   bench_rope.json  all benchmark numbers, bench_rope.md its table, rope_sweep.png the sweep plot
#
# Every step is guarded (a failing step does not stop the next ones) and runs under its own
# `timeout`; the timeouts are also clipped so that the whole job ends within JOB_BUDGET_S seconds
# (default 530 s, under 9 minutes), keeping time in reserve for the steps after it.
set -u -o pipefail

# ============================ build command: edit here ============================
BUILD_CMD="${BUILD_CMD:-python3 -m pip install --no-build-isolation --no-deps -v .}"
# ==================================================================================
PY="${PY:-python3}"
JOB_BUDGET_S="${JOB_BUDGET_S:-530}"
BENCH_ARGS="${BENCH_ARGS:-}"          # extra flags for bench_rope.py, e.g. "--quick"
LIGER_SITE="${LIGER_SITE:-/tmp/site}"

cd "$(dirname "${BASH_SOURCE[0]}")/.." || { echo "cannot cd to the repository root"; exit 1; }
REPO="$PWD"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT" || { echo "cannot create OUT=$OUT"; exit 1; }
JOB_LOG="$OUT/job.log"
: >"$JOB_LOG"

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export PIP_NO_INDEX=1   # no network on the GPU machine: never let pip wait on an index
export REPO OUT PY BUILD_CMD LIGER_SITE BENCH_ARGS JOB_LOG

SUMMARY=()
say() { echo "$*" | tee -a "$JOB_LOG"; }

# run_step NAME MAX_S RESERVE_S LOGFILE SHOW FUNCTION
#   timeout = min(MAX_S, budget left - RESERVE_S); SHOW=1 also streams the output to stdout.
run_step() {
    local name=$1 max=$2 reserve=$3 logf=$4 show=$5 fn=$6
    local left=$(( JOB_BUDGET_S - SECONDS - reserve ))
    local t=$(( max < left ? max : left ))
    if (( t < 15 )); then
        say "=== [$name] SKIPPED: not enough time left (elapsed ${SECONDS}s of ${JOB_BUDGET_S}s)"
        SUMMARY+=("$(printf '%-12s SKIPPED (time budget)' "$name")")
        return 0
    fi
    say "=== [$name] start at ${SECONDS}s, timeout ${t}s"
    echo "=== [$name] $(date -u +%H:%M:%S) timeout ${t}s" >>"$logf"
    local t0=$SECONDS rc
    export STEP_TIMEOUT_S=$t
    if [[ $show == 1 ]]; then
        timeout -k 10 "$t" bash -c "$fn" 2>&1 | tee -a "$logf"
        rc=${PIPESTATUS[0]}
    else
        timeout -k 10 "$t" bash -c "$fn" >>"$logf" 2>&1
        rc=$?
    fi
    local status="rc=$rc"
    (( rc == 124 || rc == 137 )) && status="TIMEOUT after ${t}s (rc=$rc)"
    (( rc == 0 )) && status="ok"
    say "=== [$name] $status in $(( SECONDS - t0 ))s"
    SUMMARY+=("$(printf '%-12s %s (%ss)' "$name" "$status" "$(( SECONDS - t0 ))")")
    return 0
}

# ------------------------------------------------------------------------------- steps
step_env() {
    echo "--- nvidia-smi"
    timeout 30 nvidia-smi || echo "(nvidia-smi failed)"
    echo "--- versions"
    "$PY" - <<'EOF' || echo "(python/torch check failed)"
import platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device", torch.cuda.get_device_name(0), "| SMs", p.multi_processor_count,
              "| L2", getattr(p, "L2_cache_size", "?"), "| mem", p.total_memory)
except Exception as e:
    print("torch import failed:", e)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton import failed:", e)
try:
    import matplotlib
    print("matplotlib", matplotlib.__version__)
except Exception as e:
    print("matplotlib missing:", e)
EOF
    "$PY" -m pip --version
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    command -v gcc >/dev/null && gcc --version | head -n 1
    echo "nproc $(nproc); $(df -h /tmp | tail -n 1)"
    (git -C "$REPO" log --oneline -1 2>/dev/null && git -C "$REPO" status --short 2>/dev/null | head -n 20) || true
}

step_liger() {
    shopt -s nullglob
    local whls=("$REPO"/.whl/*.whl)
    if (( ${#whls[@]} == 0 )); then
        echo "no wheel in $REPO/.whl/ (was .whl carried?); the benchmark will report liger-kernel not available"
        return 0
    fi
    echo "installing ${whls[*]##*/} into $LIGER_SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$LIGER_SITE" "${whls[@]}"
}

step_build() {
    echo "BUILD_CMD: $BUILD_CMD"
    eval "$BUILD_CMD" || return $?
    echo "--- import check"
    (cd /tmp && "$PY" -c "import fused_ops, torch; print('fused_ops from', fused_ops.__file__); print('ops:', [o for o in ('rope_fwd', 'rope_bwd', 'rope_fwd_', 'rope_fwd_qk') if hasattr(torch.ops.fused, o)])")
}

step_tests_gpu() {
    "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
}

step_tests_all() {
    "$PY" -m pytest -q -p no:cacheprovider tests
}

step_bench() {
    # let the benchmark stop its sweep early rather than be killed mid-way (it also writes partial
    # results on SIGTERM)
    local budget=$(( STEP_TIMEOUT_S - 60 ))
    (( budget < 30 )) && budget=30
    PYTHONPATH="$LIGER_SITE${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" benchmarks/bench_rope.py --out "$OUT" --budget-s "$budget" $BENCH_ARGS
}

export -f step_env step_liger step_build step_tests_gpu step_tests_all step_bench

# ------------------------------------------------------------------------------- run
say "gpu_job: repo $REPO, OUT $OUT, budget ${JOB_BUDGET_S}s, $(date -u)"
#        name        max  reserve  log                    show  function
run_step env          45     0    "$JOB_LOG"              1     step_env
run_step liger        60     0    "$JOB_LOG"              1     step_liger
run_step build       240   240    "$OUT/build.log"        0     step_build
echo "--- last lines of build.log:"; tail -n 25 "$OUT/build.log" 2>/dev/null
run_step tests-gpu   120   210    "$OUT/tests.log"        1     step_tests_gpu
run_step tests-all   120   190    "$OUT/tests.log"        1     step_tests_all
run_step bench       330    15    "$OUT/bench_rope.log"   1     step_bench

{
    echo
    echo "================ gpu_job summary (${SECONDS}s) ================"
    printf '%s\n' "${SUMMARY[@]}"
    echo "--- pytest:"
    grep -E '(passed|failed|errors?|no tests ran|deselected|skipped).* in [0-9.]+s' "$OUT/tests.log" 2>/dev/null | tail -n 4
    echo "--- benchmark targets:"
    grep -E '^- (PASS|FAIL|N/A):' "$OUT/bench_rope.md" 2>/dev/null || echo "(no bench_rope.md)"
    grep -E '^bench_rope: ' "$OUT/bench_rope.log" 2>/dev/null | tail -n 2
    echo "--- files in $OUT:"; ls -la "$OUT"
} 2>&1 | tee -a "$JOB_LOG"
exit 0
