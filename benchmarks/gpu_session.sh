#!/usr/bin/env bash
# One short GPU session (a few minutes): the CUDA tests of the kernels and the graph decode, then the
# benchmarks. Logs under $OUT. The full set is benchmarks/gpu_checks.sh.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 INFINITE_LLM_TESTS_NO_DOWNLOAD=1
unset TRITON_INTERPRET INFINITE_LLM_TRITON
timeout 130 python3 -m pytest -q -ra --maxfail=10 -p no:cacheprovider tests/kernels/test_paged_attention_cuda.py \
    tests/kernels/test_fused_cuda.py tests/engine/test_decode_graphs.py >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -n 15 "$OUT/pytest.log"
timeout 200 python3 benchmarks/engine_gpu.py >"$OUT/engine_gpu.log" 2>&1
echo "engine_gpu rc=$?"; grep -v -i -E "warn|^\s*$" "$OUT/engine_gpu.log" | tail -n 40
timeout 60 python3 benchmarks/kernels_gpu.py --quick >"$OUT/kernels_gpu.log" 2>&1
echo "kernels_gpu rc=$?"; tail -n 25 "$OUT/kernels_gpu.log"
