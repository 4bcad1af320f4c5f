#!/usr/bin/env bash
# One short GPU session (about 6 minutes on an H200): the CUDA tests of the kernels and the graph decode,
# kernels_gpu.py with its tile/split sweep, engine_gpu.py (with a host profile of a graph-replayed step),
# and mesh_gpu.py (attention servers on the GPU behind gRPC). Logs under $OUT (default ./gpu_out).
#
# Python, and the serving wheels mesh_gpu.py may need: benchmarks/gpu_env.sh. Without a CUDA GPU it says so
# in one line and exits 0; it exits 1 when a step failed. The full set of checks is benchmarks/gpu_checks.sh.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
. benchmarks/gpu_env.sh gpu_session.sh # PY, the steps' environment, SERVING_PYTHONPATH; exits without CUDA
{
    date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
    "$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
FAILED=0
step() { # step NAME LIMIT COMMAND...: log to $OUT/NAME.log
    local name=$1 limit=$2 s=$SECONDS rc
    shift 2
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    echo "== $name rc=$rc in $((SECONDS - s)) s"
}
step pytest 130 "$PY" -m pytest -q -ra --maxfail=10 -p no:cacheprovider --durations=5 \
    tests/kernels/test_paged_attention_cuda.py tests/kernels/test_fused_cuda.py tests/engine/test_decode_graphs.py
tail -n 12 "$OUT/pytest.log"
step kernels_gpu 80 "$PY" benchmarks/kernels_gpu.py
cat "$OUT/kernels_gpu.log"
step engine_gpu 170 "$PY" benchmarks/engine_gpu.py
grep -v -i -E "warn|^\s*$|USDT" "$OUT/engine_gpu.log" | tail -n 60
if [ -n "$SERVING_PYTHONPATH" ]; then
    step mesh_gpu 150 env PYTHONPATH="$SERVING_PYTHONPATH" "$PY" benchmarks/mesh_gpu.py
    grep -v -i -E "warn|^\s*$|USDT" "$OUT/mesh_gpu.log" | tail -n 30
else
    echo "== mesh_gpu skipped: $PY lacks the serving packages and no usable wheels are in .whl/ (README \"On GPUs\")"
fi
exit "$FAILED"
