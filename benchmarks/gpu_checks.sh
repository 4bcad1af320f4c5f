#!/usr/bin/env bash
# Every check a GPU session runs, in one go: `bash benchmarks/gpu_checks.sh` from the repo root.
#
# Steps, each with its own time limit, each run even if an earlier one failed:
#   1. pytest tests/kernels tests/engine: interpreted kernel tests, compiled CUDA kernel tests
#      (tests/kernels/test_paged_attention_cuda.py, test_fused_cuda.py), CUDA-graph decode vs eager
#      (tests/engine/test_decode_graphs.py); tests that need the downloaded SmolLM2 model skip
#      (INFINITE_LLM_TESTS_NO_DOWNLOAD=1: the GPU machine has no network).
#   2. benchmarks/kernels_gpu.py: kernel vs torch reference, GPU time, KV TB/s vs 4.3 TB/s, tile/split sweep.
#   3. benchmarks/engine_gpu.py: engine vs HF generate on a random-weight Llama-3.2-1B-shaped model.
#   4. benchmarks/mesh_gpu.py: 3 attention-server processes on the GPU behind gRPC vs the in-process engine,
#      when the serving packages' wheels travel in .whl/ (README "On GPUs" says which).
# Logs land in "$OUT" (default ./gpu_out): one <step>.log each, env.txt, summary.txt. Under ~12 minutes in
# all (limits 180 + 120 + 210 + 180 s). Python: $PYTHON, else the project's .venv/bin/python when there is one,
# else python3 (the H200 machine's has torch, triton, transformers). Without a CUDA GPU it says so in one line
# and exits 0; it exits 1 when a step failed.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
. benchmarks/gpu_env.sh gpu_checks.sh # PY, the steps' environment, SERVING_PYTHONPATH; exits without CUDA

SUMMARY=()
FAILED=0
run_step() { # run_step NAME LIMIT_SECONDS COMMAND...: log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" TIMED OUT"; fi
    SUMMARY+=("$name: rc=$rc$note in $((SECONDS - start))s")
    [ "$rc" -eq 0 ] || FAILED=1
    echo "   rc=$rc$note in $((SECONDS - start))s"
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "cuda available", torch.cuda.is_available())' 2>&1
    "$PY" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
    "$PY" -c 'import pytest; print("pytest", pytest.__version__)' 2>&1
} >"$OUT/env.txt"
cat "$OUT/env.txt"

if "$PY" -c 'import pytest' 2>/dev/null; then
    # --maxfail, not -x: one GPU session should report every broken kernel shape, not the first
    run_step pytest 180 "$PY" -m pytest -q -ra --maxfail=10 -p no:cacheprovider tests/kernels tests/engine
else
    SUMMARY+=("pytest: not installed, skipped")
fi
run_step kernels_gpu 120 "$PY" benchmarks/kernels_gpu.py
run_step engine_gpu 210 "$PY" benchmarks/engine_gpu.py
if [ -n "$SERVING_PYTHONPATH" ]; then
    run_step mesh_gpu 180 env PYTHONPATH="$SERVING_PYTHONPATH" "$PY" benchmarks/mesh_gpu.py
else
    SUMMARY+=("mesh_gpu: $PY lacks the serving packages and no usable wheels are in .whl/, skipped")
fi

{
    echo "==== summary"
    printf '%s\n' "${SUMMARY[@]}"
    echo "---- pytest"
    tail -n 15 "$OUT/pytest.log" 2>/dev/null | grep -E "passed|failed|error|FAILED|ERROR" || true
    echo "---- kernels_gpu (32k cases, sweeps)"
    grep -E "ctx=32k|^--|^   " "$OUT/kernels_gpu.log" 2>/dev/null || true
    echo "---- engine_gpu"
    cat "$OUT/engine_gpu.log" 2>/dev/null | grep -v -E "Warning|warn|^\s*$" | tail -n 30 || true
    echo "---- mesh_gpu"
    cat "$OUT/mesh_gpu.log" 2>/dev/null | grep -v -E "Warning|warn|^\s*$" | tail -n 10 || true
} | tee "$OUT/summary.txt"
exit "$FAILED"
