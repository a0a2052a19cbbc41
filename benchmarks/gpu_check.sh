#!/usr/bin/env bash
# The GPU checks in one command: the CUDA tests (tests/gpu), then benchmarks/bench_gpu.py (every
# GPU row of the statistics engine's targets, with its baseline in the same run), then
# benchmarks/bench_health.py on the GPU (HealthMonitor's check against the plain Trainer).
#
#   benchmarks/gpu_check.sh            # or: make gpu-check
#   OUT=results benchmarks/gpu_check.sh
#
# Everything a report needs lands in $OUT (a new temporary folder if unset): environment.txt
# (GPU, driver, versions, commit), pytest_gpu.log and pytest_gpu.xml (per-test results and the
# memory figures the tests record), bench_gpu.log and bench_gpu.json (every figure, the summary
# against the targets last), profile.log (where the time of a logging step goes, host and GPU),
# bench_health.log, and aot.log and aot.json (last, for information: the states of a step's
# outputs through a torch.compile call each and through one call for all, then one graph of the
# state called through torch.compile and compiled ahead of time by AOTInductor). Nothing is installed:
# it runs the Python that holds a CUDA build of torch ($PYTHON; by default .venv/bin/python if
# there is one, else python3) on this checkout (PYTHONPATH). Designed for a few minutes on an
# H100 (the default limits add up to 640 s; a runner that stops at 600 s cuts the last,
# informational part first): each part has a time limit (TESTS_TIMEOUT, BENCH_TIMEOUT,
# PROFILE_TIMEOUT, HEALTH_TIMEOUT, AOT_TIMEOUT seconds; AOT_TIMEOUT=0 skips the last part; the
# benchmark's timing stops starting repeats after BENCH_BUDGET seconds; PYTEST_ARGS, "-x" by
# default, go to pytest, BENCH_ARGS to bench_gpu.py), and the benchmarks run even when a test
# fails. The exit status is non-zero if any part but the last failed. Without a CUDA device it
# stops, unless GPU_CHECK_DRY_RUN=1 (a check of the script itself: the tests skip, and the
# benchmark runs on the CPU at toy sizes).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$(mktemp -d -t lightning_recorder_gpu.XXXXXX)}"
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TESTS_TIMEOUT="${TESTS_TIMEOUT:-200}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-180}"
BENCH_BUDGET="${BENCH_BUDGET:-100}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-80}"
PROFILE_TIMEOUT="${PROFILE_TIMEOUT:-60}"
AOT_TIMEOUT="${AOT_TIMEOUT:-120}"  # 0: skip the last, informational part
PYTEST_ARGS="${PYTEST_ARGS--x}"  # PYTEST_ARGS= (empty) runs every test after a failure too
BENCH_ARGS="${BENCH_ARGS-}"  # more arguments of bench_gpu.py, e.g. --package-logger
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# cuBLAS is deterministic under torch.use_deterministic_algorithms only with a fixed workspace
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"

stamp() { echo "[$(date +%H:%M:%S)] gpu-check: $*"; }

stamp "results in $OUT; python: $PYTHON"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if commit=$(git rev-parse HEAD 2>/dev/null); then
        git diff --quiet HEAD 2>/dev/null || commit="$commit (with local changes)"
        echo "commit: $commit"
    else
        echo "commit: unknown (not a git checkout)"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PYTHON" - <<'PY' 2>&1
import os, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ("triton", "lightning", "torchmetrics", "tensorboard"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "not installed")
print("cpus", os.cpu_count())
PY
} > "$OUT/environment.txt"
cat "$OUT/environment.txt"

DEVICE=cuda
if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    if [ "${GPU_CHECK_DRY_RUN:-0}" != 1 ]; then
        stamp "no CUDA device: tests/gpu would skip everything and the benchmark measure nothing"
        exit 1
    fi
    DEVICE=cpu  # a dry run of this script: the tests skip, the benchmark runs at toy sizes
    # the CPU is slower than a GPU at the benchmarks' work: time limits for a busy CPU
    BENCH_TIMEOUT=$((BENCH_TIMEOUT * 5)) BENCH_BUDGET=$((BENCH_BUDGET * 5))
    HEALTH_TIMEOUT=$((HEALTH_TIMEOUT * 8)) PROFILE_TIMEOUT=$((PROFILE_TIMEOUT * 8))
    AOT_TIMEOUT=$((AOT_TIMEOUT * 4))
    stamp "no CUDA device: a dry run (the tests skip, the benchmark runs on the CPU at toy sizes)"
fi

stamp "tests/gpu (limit ${TESTS_TIMEOUT} s) ..."
# shellcheck disable=SC2086  # PYTEST_ARGS: words
timeout -s INT -k 30 "$TESTS_TIMEOUT" "$PYTHON" -m pytest tests/gpu -q $PYTEST_ARGS -p no:cacheprovider \
    -rfEs --durations=15 --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
tests=${PIPESTATUS[0]}
stamp "tests/gpu: exit status $tests"

stamp "benchmarks/bench_gpu.py (limit ${BENCH_TIMEOUT} s, timing budget ${BENCH_BUDGET} s) ..."
# shellcheck disable=SC2086  # BENCH_ARGS: words
timeout -s INT -k 30 "$BENCH_TIMEOUT" "$PYTHON" benchmarks/bench_gpu.py \
    --device "$DEVICE" --json "$OUT/bench_gpu.json" --budget "$BENCH_BUDGET" $BENCH_ARGS 2>&1 \
    | grep --line-buffered -v -e "^INFO" -e "LitLogger" -e "available: " -e "Using bfloat16" \
        -e 'stopped: `max_steps=' \
    | tee "$OUT/bench_gpu.log"
bench=${PIPESTATUS[0]}
stamp "bench_gpu: exit status $bench"

stamp "benchmarks/bench_gpu.py --profile resnet-18 (limit ${PROFILE_TIMEOUT} s) ..."
timeout -s INT -k 20 "$PROFILE_TIMEOUT" "$PYTHON" benchmarks/bench_gpu.py --device "$DEVICE" \
    --profile resnet-18 > "$OUT/profile.log" 2>&1
profile=$?
stamp "profile of a logging step: exit status $profile (in profile.log)"

HEALTH_ARGS="--repeats 3"
[ "$DEVICE" = cpu ] && HEALTH_ARGS="--quick"
stamp "benchmarks/bench_health.py (limit ${HEALTH_TIMEOUT} s) ..."
# shellcheck disable=SC2086  # HEALTH_ARGS: words
timeout -s INT -k 20 "$HEALTH_TIMEOUT" "$PYTHON" benchmarks/bench_health.py --device "$DEVICE" \
    $HEALTH_ARGS 2>&1 \
    | grep --line-buffered -v -e "^INFO" -e "LitLogger" -e "available: " -e 'stopped: `max_steps=' \
    | tee "$OUT/bench_health.log"
health=${PIPESTATUS[0]}
stamp "bench_health: exit status $health"

# Last, for information (its status does not count): the states of a step's outputs through a
# torch.compile call each and through one call for all (its table printed first, kept in aot.log
# if the limit stops the rest), then one graph of the state called as the engine calls it
# (torch.compile) and compiled ahead of time by AOTInductor; host time per output and per call
aot=skipped
if [ "$AOT_TIMEOUT" -gt 0 ]; then
    stamp "benchmarks/bench_gpu.py --aot (limit ${AOT_TIMEOUT} s) ..."
    timeout -s INT -k 20 "$AOT_TIMEOUT" "$PYTHON" benchmarks/bench_gpu.py --device "$DEVICE" \
        --aot --json "$OUT/aot.json" > "$OUT/aot.log" 2>&1
    aot=$?
    stamp "a call each, one call for all, AOTInductor: exit status $aot (in aot.log)"
fi

stamp "done: tests $tests, benchmark $bench, profile $profile, health benchmark $health, call comparisons $aot; results in $OUT"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$profile" -eq 0 ] && [ "$health" -eq 0 ]
