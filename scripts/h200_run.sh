#!/usr/bin/env bash
# What one device call runs on the NVIDIA H200 (see README, "NVIDIA platform").
#   scripts/h200_run.sh tests|tests-heavy|tests-light|sanitize|check|bench|mtp|ncu|soak|selftest   — logs go to $OUT (default ./out)
#   PYTEST_K / PYTEST_TIMEOUT narrow and cap the tests step; SANITIZE_TIMEOUT caps each sanitizer
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HIPMLA_CACHE_DIR=/tmp/hipmla-cache HIPMLA_TEST_LOG=$(realpath "$OUT")/emulator_errors.tsv
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -m hipmla nvidia-runtime 2>&1 | tail -1
for step in "$@"; do
    case "$step" in
    tests|tests-heavy|tests-light)
        # The whole GPU suite took 406 s on the H200 (2026-12-06) and did not finish in 570 s on
        # an H100: tests-heavy (the ragged and several-query-token batches) and tests-light (the
        # rest) split it over two calls of one warm machine.
        sel=()
        [ "$step" = tests-heavy ] && sel=(-k "ragged or several_query")
        [ "$step" = tests-light ] && sel=(-k "not (ragged or several_query)")
        # PYTEST_K narrows "tests" to one -k expression (a re-run of what a cut call left).
        [ "$step" = tests ] && [ -n "${PYTEST_K:-}" ] && sel=(-k "$PYTEST_K")
        timeout "${PYTEST_TIMEOUT:-560}" python3 -m pytest -v -rfE --tb=short --durations=12 -m gpu -n 14 -p no:cacheprovider ${sel[@]+"${sel[@]}"} tests \
            > "$OUT/gpu_$step.log" 2>&1
        echo "$step rc=$?"; grep -v PASSED "$OUT/gpu_$step.log" | tail -25 ;;
    sanitize)
        for tool in memcheck racecheck; do
            timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool $tool --target-processes all python3 scripts/sanitize_case.py \
                > "$OUT/sanitizer_$tool.log" 2>&1
            echo "sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|max \|" "$OUT/sanitizer_$tool.log" | tail -5
        done ;;
    check)
        timeout 400 python3 -m hipmla check --format all --sample 8 2>/dev/null | tee "$OUT/check.txt" ;;
    ncu)
        # Nsight Compute on the decoder's kernel: one launch per (format, shape), after warm-up.
        for case in ${NCU_CASES:-mxfp4:64x8k mxfp4:4x1k bf16:64x8k}; do
            fmt=${case%%:*}; shape=${case#*:}
            timeout 240 ncu --clock-control none -k regex:hipmla_decode -s 4 -c 1 \
                --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
                --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
                --section ComputeWorkloadAnalysis --section SourceCounters \
                --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
                python3 -m hipmla bench --format "$fmt" --shapes "$shape" --iters 3 --no-torch \
                > "$OUT/ncu_${fmt}_${shape}.txt" 2>&1
            echo "ncu $fmt $shape rc=$?"; grep -E "Duration|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|Memory Throughput|Warp Cycles Per Issued" "$OUT/ncu_${fmt}_${shape}.txt" | head -12
        done ;;
    bench)
        timeout 500 python3 -m hipmla bench --iters 50 --out "$OUT" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.txt" ;;
    mtp)
        timeout 400 python3 -m hipmla bench --mtp --iters 20 --out "$OUT" 2>"$OUT/bench_mtp_progress.log" | tee "$OUT/bench_mtp.txt" ;;
    soak)
        timeout 200 python3 scripts/soak.py --out "$OUT"; echo "soak rc=$?" ;;
    selftest)
        # Every kernel's known-answer check afresh, then the proof: the broken sm_90 build fails and falls back.
        timeout 300 python3 -m hipmla selftest --no-cache --json "$OUT/selftest.json" | tee "$OUT/selftest.txt"
        timeout 300 python3 scripts/selftest_proof.py --out "$OUT" 2>&1 | tee "$OUT/selftest_proof.txt" ;;
    esac
done
