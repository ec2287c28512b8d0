#!/usr/bin/env bash
# One GPU job: environment report, Liger-Kernel wheel, build + install, tests, the main job (the model workload),
# compute-sanitizer, RoPE benchmark, routed-GEMM benchmarks (linear_dual, ffn), the performance matrix.
#
#   OUT=/some/dir bash scripts/gpu_job.sh      # from anywhere; it cd's to the repository root
#
# On the device tool: run `bash scripts/gpu_job.sh` with carry=[".whl"] (the Liger wheel lives in the
# git-ignored .whl/ folder; without it the benchmark just prints "liger-kernel not available").
#
# Files written to $OUT (everything but job.log is packed into $OUT/all.tgz at the end, PACK=0 keeps them apart:
# the device tool brings back at most 8 files):
#   job.log          environment, step timings and the final summary
#   build.log        full (verbose) build output
#   tests.log        pytest -m gpu (every test file's GPU tier), compute-sanitizer, the cpp step (scripts/cpp_example.sh:
#                    CMake build, ctest of examples/cpp on CPU and CUDA, the installed package's consumer)
#   model.log, model/  the main job (examples/model_workload.py): its table, model_workload.json / .png
#   bench_rope.log   benchmark output; bench_rope.json all its numbers, bench_rope.md its table, rope_sweep.png
#   bench_routed.log benchmarks/bench_linear_dual.py then benchmarks/bench_ffn.py (tables and PASS/FAIL targets); the
#                    steps pdl (benchmarks/bench_pdl.py, also bench_pdl.json), profile (benchmarks/kernel_times.py,
#                    PROFILE_ARGS) and tune (python -m aot.tune, TUNE_ARGS: tune_sm<cc>.jsonl and sm<arch>.json)
#   matrix.log, matrix/  benchmarks/bench_matrix.py: matrix.json / .md / .png
#   bench_train.log, train_mlp/  benchmarks/bench_train_mlp.py (step bench-train): the MLP training step
#   bench_attention.log  benchmarks/bench_decode_attention.py (step bench-attn): the decode-attention op alone
#   bench_generate.log, generate/  benchmarks/bench_generate.py (step bench-gen): generation against the floor
#
# BENCHES selects the benchmark steps (default all three): e.g. BENCHES="linear_dual ffn" gives the routed
# benchmarks the time the RoPE benchmark would take. Each routed benchmark runs under `timeout 150`
# (ROUTED_BENCH_S); the RoPE benchmark keeps that much time in reserve for each of them, so with a slow
# build it is the RoPE sweep that shrinks (or is skipped), not the routed benchmarks.
#
# Every step is guarded (a failing step does not stop the next ones) and runs under its own
# `timeout`; the timeouts are also clipped so that the whole job ends within JOB_BUDGET_S seconds
# (default 530 s, under 9 minutes), keeping time in reserve for the steps after it.
set -u -o pipefail

# ============================ build command: edit here ============================
# The README's set-up (scripts/setup_env.sh: .venv reusing the machine's torch, AOT step, C++ build).
BUILD_CMD="${BUILD_CMD:-bash -c 'source scripts/setup_env.sh'}"
# ==================================================================================
PY="${PY:-python3}"
JOB_BUDGET_S="${JOB_BUDGET_S:-530}"
BENCH_ARGS="${BENCH_ARGS:-}"          # extra flags for bench_rope.py, e.g. "--quick"
BENCHES="${BENCHES:-rope linear_dual ffn}"  # benchmark steps to run
ROUTED_BENCH_S="${ROUTED_BENCH_S:-150}"    # timeout of each routed-GEMM benchmark
ROUTED_BENCH_ARGS="${ROUTED_BENCH_ARGS:-}" # extra flags for bench_linear_dual.py and bench_ffn.py, e.g. "--rep 50"
LIGER_SITE="${LIGER_SITE:-/tmp/site}"
TUNE_RESUME="${TUNE_RESUME:-}"
TUNE_ARGS="${TUNE_ARGS:-}"                 # e.g. "--ops rope,linear --rep 20" (aot/tune.py)
TUNE_S="${TUNE_S:-240}"                    # timeout of the tune step
CPP_S="${CPP_S:-300}"                      # timeout of the cpp step (its deployment tests include a 4-minute AOTI build)
BUILD_S="${BUILD_S:-420}"                  # timeout of the build step (a cold AOT compile of every kernel: 4-5 minutes)
TESTS_GPU_DESELECT="${TESTS_GPU_DESELECT:-}"  # test ids the tests-gpu step leaves out
TESTS_GPU_PATHS="${TESTS_GPU_PATHS:-tests}"   # what the tests-gpu step runs (files or node ids; default every file)
MODEL_ARGS="${MODEL_ARGS:-}"               # extra flags for examples/model_workload.py (e.g. --quick)
MATRIX_ARGS="${MATRIX_ARGS:-}"             # extra flags for benchmarks/bench_matrix.py (e.g. --ops ffn_fwd --full)
GEN_ARGS="${GEN_ARGS:-}"                   # extra flags for benchmarks/bench_generate.py (step bench-gen, e.g. --layers 4)
ATTN_ARGS="${ATTN_ARGS:-}"                 # extra flags for benchmarks/bench_decode_attention.py (step bench-attn)
TRAIN_ARGS="${TRAIN_ARGS:-}"               # extra flags for benchmarks/bench_train_mlp.py (e.g. --ms 8192)
PROFILE_ARGS="${PROFILE_ARGS:-}"           # extra flags for benchmarks/kernel_times.py (e.g. --only ffn_bwd)
PDL_ARGS="${PDL_ARGS:-}"                   # extra flags for benchmarks/bench_pdl.py (step pdl, e.g. --rounds 7)

cd "$(dirname "${BASH_SOURCE[0]}")/.." || { echo "cannot cd to the repository root"; exit 1; }
REPO="$PWD"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT" || { echo "cannot create OUT=$OUT"; exit 1; }
JOB_LOG="$OUT/job.log"
: >"$JOB_LOG"

export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export FUSED_BUILD_VERBOSE=1  # build.log gets the AOT progress and the compiler/linker commands
export PIP_NO_INDEX=1   # no network on the GPU machine: never let pip wait on an index
export TESTS_GPU_PATHS
export REPO OUT PY BUILD_CMD LIGER_SITE BENCH_ARGS ROUTED_BENCH_ARGS TUNE_ARGS TUNE_RESUME JOB_LOG TESTS_GPU_DESELECT \
    MODEL_ARGS MATRIX_ARGS PROFILE_ARGS PDL_ARGS GEN_ARGS ATTN_ARGS GEN_S

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
    echo "--- library size (bytes) and what it embeds"
    ls -l "$REPO"/.venv/lib/python3*/site-packages/fused_ops/_C*.so 2>/dev/null || true
    "$REPO/.venv/bin/python" -c "import fused_ops; print('built for', fused_ops.built_archs())" || true
    echo "--- import check"
    (cd /tmp && "$REPO/.venv/bin/python" -c "import fused_ops, torch; print('fused_ops from', fused_ops.__file__); print('ops:', [o for o in ('rope_fwd', 'rope_bwd', 'rope_fwd_', 'rope_fwd_qk', 'linear_dual', 'linear_dual_backward', 'ffn', 'ffn_backward') if hasattr(torch.ops.fused, o)])")
}

step_diag() {
    # How the extension was compiled and linked on this machine (the toolchain's flags come from Python's
    # sysconfig), and whether a bad-input call raises in a plain process.
    "$PY" -c 'import sysconfig
for k in ("CC", "CXX", "LDSHARED", "LDCXXSHARED", "CFLAGS", "LDFLAGS", "CCSHARED", "OPT", "BLDSHARED"):
    print(f"sysconfig {k} = {sysconfig.get_config_var(k)!r}")'
    env | grep -iE "flags|^cc=|^cxx=|^ldshared" || true
    local so
    so=$(ls "$REPO"/.venv/lib/python3*/site-packages/fused_ops/_C*.so 2>/dev/null | head -n 1)
    echo "so: $so"
    readelf -d "$so" | grep -E "NEEDED|RPATH|RUNPATH|SYMBOLIC|FLAGS"
    echo "defined std:: symbols (libstdc++ code linked in?):"
    nm -C --defined-only "$so" | grep -E "std::(locale|ostream|basic_ostream|codecvt|ios_base)" | head -n 8
    nm -C --defined-only "$so" | grep -cE "std::(locale|codecvt|ios_base)" || true
    grep -E "(^| )(x86_64-linux-gnu-g\+\+|g\+\+|c\+\+|gcc|x86_64-linux-gnu-gcc) .*-shared" "$OUT/build.log" | tail -n 1 | cut -c1-1500 || true
    grep -E "(c\+\+|g\+\+|gcc) .*-c .*rope_meta" "$OUT/build.log" | tail -n 1 | cut -c1-1500 || true
    "$PY" -X faulthandler scripts/repro_error_path.py; echo "repro rc=$?"
}

step_tests_gpu() {
    # TESTS_GPU_DESELECT: space-separated test ids to leave out (e.g. the 4-minute CUDA AOTInductor package build when
    # the job must also tune); say so in the results, they were not run.
    local d deselect=()
    for d in ${TESTS_GPU_DESELECT:-}; do deselect+=(--deselect "$d"); done
    "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu ${TESTS_GPU_PATHS:-tests} "${deselect[@]}"
    local rc=$?
    # The PDL checks of the compiled PTX (CPU tier, run by CI with its triton) again with the triton that built the
    # kernels this job just tested.
    echo "--- tests/test_pdl.py CPU tier with this machine's triton"
    "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu" tests/test_pdl.py || rc=$?
    return $rc
}

step_repro() {
    # A bad-input call on CUDA must raise, not crash; under cuda-gdb a crash leaves a native backtrace.
    if command -v cuda-gdb >/dev/null; then
        cuda-gdb -q -batch -ex run -ex bt --args "$PY" scripts/repro_error_path.py
    else
        "$PY" scripts/repro_error_path.py
    fi
}


step_cpp() {
    # The deployment paths (README, "Deployment"). 1. scripts/cpp_example.sh: the CMake build of the library and of
    # examples/cpp, ctest (TorchScript and AOTInductor inference, training, on CPU and CUDA), a consumer of the
    # installed package config. Without cmake on this machine that part is skipped, and said so. 2. The Python-side
    # deployment tests (TorchScript, torch.compile / torch.export / AOTInductor, the no-JIT test of every op): all of
    # them, or only their CPU tier when the tests-gpu step runs the GPU tier anyway.
    local rc=0
    if command -v cmake >/dev/null || [[ -x "$(dirname "$PY")/cmake" ]]; then
        echo "--- cpp: scripts/cpp_example.sh ($(command -v cmake || echo "$(dirname "$PY")/cmake"))"
        VPY="$PY" FUSED_CMAKE_BUILD=/tmp/fused_cmake bash scripts/cpp_example.sh || rc=$?
        echo "--- cpp: cpp_example.sh exit status $rc"
    else
        echo "--- cpp: cmake NOT FOUND on this machine: the CMake build, ctest and the consumer were SKIPPED (not run)"
        rc=3
    fi
    # The Python-side deployment tests: their GPU tier is part of tests-gpu and their CPU tier of every CI run, so
    # they run here only when tests-gpu is not in STEPS.
    if [[ " $STEPS " != *" tests-gpu "* ]]; then
        echo "--- cpp: Python-side deployment tests (all tiers)"
        "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_deploy_torchscript.py tests/test_deploy_pt2.py \
            tests/test_package.py || rc=$?
    fi
    return $rc
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

step_main() {
    # The main job (scripts/run.sh runs the same script): the model workload (examples/model_workload.py): CogVLM-style and Llama layers against the
    # reference, sort + grouped_mm and torch.compile; its JSON and PNG go to $OUT/model/.
    "$PY" examples/model_workload.py --out "$OUT/model" $MODEL_ARGS
}

step_matrix() {
    # The performance matrix (benchmarks/bench_matrix.py): every op on the models' shapes, ratios to cuBLAS / copy
    # bandwidth, host time per call; matrix.json / .md / .png in $OUT/matrix/. Stops starting cells before the timeout.
    local budget=$(( STEP_TIMEOUT_S - 40 ))
    (( budget < 30 )) && budget=30
    "$PY" benchmarks/bench_matrix.py --out "$OUT/matrix" --budget-s "$budget" $MATRIX_ARGS
}

step_sanitizer() {
    # compute-sanitizer memcheck and racecheck over the fuzzer's small cases (tests/fuzz.py --sanitizer).
    local tool rc=0
    command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer NOT FOUND: skipped (not run)"; return 3; }
    for tool in memcheck racecheck; do
        echo "--- compute-sanitizer --tool $tool"
        compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
            "$PY" tests/fuzz.py --sanitizer --device cuda || rc=$?
    done
    return $rc
}

step_bench_linear_dual() {
    "$PY" benchmarks/bench_linear_dual.py $ROUTED_BENCH_ARGS
}

step_bench_ffn() {
    "$PY" benchmarks/bench_ffn.py $ROUTED_BENCH_ARGS
}

step_bench_train() {
    # The MLP training step (benchmarks/bench_train_mlp.py): fused saved / recompute vs grouped_mm, gather+cuBLAS,
    # torch.compile; tables in $OUT/train_mlp/.
    "$PY" benchmarks/bench_train_mlp.py --out "$OUT/train_mlp" $TRAIN_ARGS
}

step_bench_generate() {
    # Generation (benchmarks/bench_generate.py): ms per token of the full-depth CogVLM2-19B LM against the bandwidth
    # floor, today's eager decode and HF's compiled static-cache Llama-3-8B; bench_generate.json in $OUT/generate/.
    "$PY" benchmarks/bench_generate.py --out "$OUT/generate" --budget-s "$(( ${GEN_S:-240} - 15 ))" $GEN_ARGS
}

step_bench_attention() {
    # The decode-attention op alone (benchmarks/bench_decode_attention.py): fraction of copy bandwidth on the KV read
    # against F.scaled_dot_product_attention on the same cache.
    "$PY" benchmarks/bench_decode_attention.py $ATTN_ARGS
}

step_pdl() {
    # Programmatic dependent launch on / off in alternating rounds (benchmarks/bench_pdl.py): what it saves or costs per
    # routed case.
    "$PY" benchmarks/bench_pdl.py --out "$OUT" $PDL_ARGS
}

step_profile() {
    # Per-kernel device times of the routed ops' main cases (benchmarks/kernel_times.py): where the time goes.
    "$PY" benchmarks/kernel_times.py $PROFILE_ARGS
}

step_tune() {
    # Config search with Triton's JIT (aot/tune.py): every measurement goes to $OUT/tune_sm<cc>.jsonl (resumable: put
    # a previous run's file there first, e.g. TUNE_RESUME=path in the repo), the winners to $OUT/sm<arch>.json (copy
    # it to aot/configs/ and rebuild), the default-vs-tuned table to bench_routed.log. It stops starting new shapes
    # 45 s before its timeout.
    local cc arch budget=$(( STEP_TIMEOUT_S - 45 ))
    cc=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)")
    arch=$("$PY" -c "from aot.tune import table_arch; print(table_arch($cc))")
    [[ -n "${TUNE_RESUME:-}" && -f "$TUNE_RESUME" ]] && cp "$TUNE_RESUME" "$OUT/tune_sm$cc.jsonl"
    # TUNE_ARGS may hold several runs separated by ';' (e.g. decode m with many shapes, then one large m): they all
    # append to the one result file; a run's own --budget-s (given last) overrides the step's.
    local run
    IFS=';' read -ra runs <<<"${TUNE_ARGS:- }"
    for run in "${runs[@]}"; do
        echo "--- tune: $run"
        "$PY" -m aot.tune --results "$OUT/tune_sm$cc.jsonl" --write "$OUT/sm$arch.json" --budget-s "$budget" $run
    done
}

export -f step_pdl step_matrix step_sanitizer step_tune step_profile step_diag step_repro step_main step_env step_liger step_build step_tests_gpu step_tests_all step_bench step_bench_linear_dual \
    step_bench_ffn step_cpp step_bench_train step_bench_generate step_bench_attention

has_bench() { [[ " $BENCHES " == *" $1 "* ]]; }
# time kept for the routed benchmarks that follow a step (their timeout + 5 s of start-up each)
ROUTED_AFTER_ROPE=0
has_bench linear_dual && ROUTED_AFTER_ROPE=$(( ROUTED_AFTER_ROPE + ROUTED_BENCH_S + 5 ))
has_bench ffn && ROUTED_AFTER_ROPE=$(( ROUTED_AFTER_ROPE + ROUTED_BENCH_S + 5 ))
ROUTED_AFTER_LINEAR=0
has_bench ffn && ROUTED_AFTER_LINEAR=$(( ROUTED_BENCH_S + 5 ))

# ------------------------------------------------------------------------------- run
say "gpu_job: repo $REPO, OUT $OUT, budget ${JOB_BUDGET_S}s, $(date -u)"
#        name        max  reserve  log                    show  function
STEPS="${STEPS:-env liger build diag tests-gpu main cpp bench-rope bench-linear bench-ffn tune}"
export STEPS
has_step() { [[ " $STEPS " == *" $1 "* ]]; }
#        name        max  reserve  log                    show  function
has_step env && run_step env          45     0    "$JOB_LOG"              1     step_env
has_step liger && run_step liger        60     0    "$JOB_LOG"              1     step_liger
has_step build && run_step build    "$BUILD_S"   120    "$OUT/build.log"        0     step_build
echo "--- last lines of build.log:"; tail -n 25 "$OUT/build.log" 2>/dev/null
# what the build step made; every later step uses it (without a build step, e.g. STEPS="env tune", the machine's)
[[ -x "$REPO/.venv/bin/python" ]] && PY="$REPO/.venv/bin/python"
export PY
has_step diag && run_step diag         60    60    "$OUT/job.log"          1     step_diag
has_step repro && run_step repro        60    60    "$OUT/tests.log"        1     step_repro
has_step tests-gpu && run_step tests-gpu  500    40    "$OUT/tests.log"        1     step_tests_gpu
has_step main && run_step main   "${MODEL_S:-300}"  0    "$OUT/model.log"        1     step_main
has_step sanitizer && run_step sanitizer  240  0    "$OUT/tests.log"        1     step_sanitizer
has_step cpp && run_step cpp          "${CPP_S:-300}"     0    "$OUT/tests.log"        1     step_cpp
has_step bench-rope && run_step bench   120 $(( 15 + ROUTED_AFTER_ROPE )) "$OUT/bench_rope.log" 1 step_bench
has_step bench-linear && run_step bench-linear "$ROUTED_BENCH_S" $(( 15 + ROUTED_AFTER_LINEAR )) "$OUT/bench_routed.log" 1 step_bench_linear_dual
has_step bench-ffn && run_step bench-ffn "$ROUTED_BENCH_S" 15 "$OUT/bench_routed.log" 1 step_bench_ffn
has_step bench-train && run_step bench-train "${TRAIN_S:-240}" 0 "$OUT/bench_train.log" 1 step_bench_train
has_step bench-attn && run_step bench-attn "${ATTN_S:-90}" 0 "$OUT/bench_attention.log" 1 step_bench_attention
has_step bench-gen && run_step bench-gen "${GEN_S:-240}" 0 "$OUT/bench_generate.log" 1 step_bench_generate
has_step pdl && run_step pdl       "${PDL_S:-150}"  0    "$OUT/bench_routed.log" 1     step_pdl
has_step profile && run_step profile   90    0    "$OUT/bench_routed.log" 1     step_profile
has_step tune && run_step tune   "$TUNE_S"    5    "$OUT/bench_routed.log" 1     step_tune
has_step matrix && run_step matrix "${MATRIX_S:-400}" 0   "$OUT/matrix.log"       1     step_matrix

{
    echo
    echo "================ gpu_job summary (${SECONDS}s) ================"
    printf '%s\n' "${SUMMARY[@]}"
    echo "--- pytest:"
    grep -E '(passed|failed|errors?|no tests ran|deselected|skipped).* in [0-9.]+s' "$OUT/tests.log" 2>/dev/null | tail -n 4
    echo "--- benchmark targets:"
    grep -E '^- (PASS|FAIL|N/A):' "$OUT/bench_rope.md" 2>/dev/null || echo "(no bench_rope.md)"
    grep -E '^bench_rope: ' "$OUT/bench_rope.log" 2>/dev/null | tail -n 2
    echo "--- routed benchmark targets (bench_routed.log):"
    grep -E '^- (PASS|FAIL|N/A): .*\(target ' "$OUT/bench_routed.log" 2>/dev/null || echo "(no routed targets)"
    grep -E '^bench_(linear_dual|ffn): ' "$OUT/bench_routed.log" 2>/dev/null | tail -n 4
    echo "--- cpp step (tests.log): ctest, consumer, deployment tests"
    grep -E "^\[cpp_example\]|^--- cpp: (cmake NOT FOUND|cpp_example)|tests passed, .* failed out of|^\s+[0-9]+ - cpp_\S+ \(" \
        "$OUT/tests.log" 2>/dev/null | tail -n 20 || echo "(no cpp step output)"
    echo "--- routed-op test failures (tests.log):"
    routed_failed=$(grep -E '^(FAILED|ERROR) tests/test_(linear_dual|ffn)_ops\.py' "$OUT/tests.log" 2>/dev/null | sort -u)
    if [[ -n $routed_failed ]]; then head -n 40 <<<"$routed_failed"; else echo "(none)"; fi
    echo "--- model workload (model.log):"
    grep -E "^(\||all checks|FAIL|CHECK)" "$OUT/model.log" 2>/dev/null | tail -n 40 || echo "(no model step)"
    echo "--- MLP training step (train_mlp/bench_train_mlp.md):"
    cat "$OUT/train_mlp/bench_train_mlp.md" 2>/dev/null || echo "(no bench-train step)"
    echo "--- decode attention (bench_attention.log):"
    tail -n 30 "$OUT/bench_attention.log" 2>/dev/null || echo "(no bench-attn step)"
    echo "--- generation (bench_generate.log):"
    tail -n 40 "$OUT/bench_generate.log" 2>/dev/null || echo "(no bench-gen step)"
    echo "--- matrix summary:"
    sed -n '/^## Summary/,/^## Host/p' "$OUT/matrix/matrix.md" 2>/dev/null || echo "(no matrix)"
    echo "--- files in $OUT:"; ls -laR "$OUT"
} 2>&1 | tee -a "$JOB_LOG"
# The device tool brings back at most 8 files: everything but job.log goes into one archive (PACK=0 keeps them).
if [[ "${PACK:-1}" == 1 ]]; then
    tar czf /tmp/gpu_job_all.tgz -C "$OUT" --exclude=job.log . && mv /tmp/gpu_job_all.tgz "$OUT/all.tgz" &&
        find "$OUT" -mindepth 1 -maxdepth 1 ! -name all.tgz ! -name job.log -exec rm -rf {} +
fi
exit 0
