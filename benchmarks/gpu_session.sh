#!/usr/bin/env bash
# One short GPU session (about 6 minutes on an H200): the CUDA tests of the kernels and the graph decode,
# kernels_gpu.py with its tile/split sweep, engine_gpu.py (with a host profile of a graph-replayed step),
# and mesh_gpu.py (attention servers on the GPU behind gRPC). Logs under $OUT.
#
# The H200 machine lacks some serving packages (opentelemetry, grpcio-health-checking, -reflection, and has
# grpcio 1.84 where the generated code wants 1.85.1): mesh_gpu.py runs only when their wheels travel in
# .whl/ (README "On GPUs" says how to fetch them). The full set of checks is benchmarks/gpu_checks.sh.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 INFINITE_LLM_TESTS_NO_DOWNLOAD=1
unset TRITON_INTERPRET INFINITE_LLM_TRITON
{
    date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
    python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step() { # step NAME LIMIT COMMAND...: log to $OUT/NAME.log
    local name=$1 limit=$2 s=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name rc=$? in $((SECONDS - s)) s"
}
step pytest 130 python3 -m pytest -q -ra --maxfail=10 -p no:cacheprovider --durations=5 \
    tests/kernels/test_paged_attention_cuda.py tests/kernels/test_fused_cuda.py tests/engine/test_decode_graphs.py
tail -n 12 "$OUT/pytest.log"
step kernels_gpu 80 python3 benchmarks/kernels_gpu.py
cat "$OUT/kernels_gpu.log"
step engine_gpu 170 python3 benchmarks/engine_gpu.py
grep -v -i -E "warn|^\s*$|USDT" "$OUT/engine_gpu.log" | tail -n 60
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/wheels.log" 2>&1 || echo "wheels failed: $(tail -n 3 "$OUT/wheels.log")"
    step mesh_gpu 150 env PYTHONPATH="/tmp/site:$PWD" python3 benchmarks/mesh_gpu.py
    grep -v -i -E "warn|^\s*$|USDT" "$OUT/mesh_gpu.log" | tail -n 30
else
    echo "== mesh_gpu skipped: no .whl/ with the serving packages"
fi
