#!/usr/bin/env bash
# One short GPU session (about 5 minutes on an H200): the CUDA tests of the kernels and the graph decode,
# kernels_gpu.py with its tile/split sweep, engine_gpu.py (with a host profile of a graph-replayed step),
# and which serving packages the machine has. Logs under $OUT. The full set is benchmarks/gpu_checks.sh.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 INFINITE_LLM_TESTS_NO_DOWNLOAD=1
unset TRITON_INTERPRET INFINITE_LLM_TRITON
{
    date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
    python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)'
    python3 -m pip list 2>/dev/null | grep -i -E "^(grpcio|protobuf|opentelemetry|pydantic|fastapi|uvicorn|aetcd|tenacity|transformers|prometheus)"
    python3 -c 'import infinite_llm.services.attention.server' 2>&1 | tail -n 1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
s=$SECONDS
timeout -k 5 150 python3 -m pytest -q -ra --maxfail=10 -p no:cacheprovider --durations=8 \
    tests/kernels/test_paged_attention_cuda.py tests/kernels/test_fused_cuda.py tests/engine/test_decode_graphs.py \
    >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? in $((SECONDS - s)) s"; tail -n 25 "$OUT/pytest.log"
s=$SECONDS
timeout -k 5 100 python3 benchmarks/kernels_gpu.py >"$OUT/kernels_gpu.log" 2>&1
echo "kernels_gpu rc=$? in $((SECONDS - s)) s"; tail -n 45 "$OUT/kernels_gpu.log"
s=$SECONDS
timeout -k 5 200 python3 benchmarks/engine_gpu.py >"$OUT/engine_gpu.log" 2>&1
echo "engine_gpu rc=$? in $((SECONDS - s)) s"; grep -v -i -E "warn|^\s*$|USDT" "$OUT/engine_gpu.log" | tail -n 70
