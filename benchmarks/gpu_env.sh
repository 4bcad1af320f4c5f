# Sourced by gpu_session.sh and gpu_checks.sh (from the repo root, after OUT is set): the Python they run,
# the environment of their steps, and the serving packages mesh_gpu.py needs.
#
# PY: $PYTHON, else the project's .venv/bin/python when there is one, else python3. Without a CUDA GPU the
# calling script ($1: its name) says so in one line and exits 0.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 # a step killed at its limit still leaves its output in the log
export INFINITE_LLM_TESTS_NO_DOWNLOAD=1
unset TRITON_INTERPRET INFINITE_LLM_TRITON
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "$1: $PY sees no CUDA GPU (or has no torch): nothing to check"
    exit 0
fi

# SERVING_PYTHONPATH: a PYTHONPATH under which $PY imports the serving packages mesh_gpu.py needs, empty
# when it cannot. The H200 machine lacks opentelemetry, grpcio-health-checking and -reflection, and has
# grpcio 1.84 where the generated code wants 1.85.1: their wheels are installed from .whl/ when they travel
# there (README "On GPUs" says how to fetch them), only where they are missing.
SERVING='import grpc, grpc_health, grpc_reflection, opentelemetry.sdk; assert grpc.__version__ == "1.85.1"'
SERVING_PYTHONPATH=""
if "$PY" -c "$SERVING" 2>/dev/null; then
    SERVING_PYTHONPATH=$PYTHONPATH
elif ls .whl/*.whl >/dev/null 2>&1 &&
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >"$OUT/wheels.log" 2>&1 &&
    env PYTHONPATH="/tmp/site:$PYTHONPATH" "$PY" -c "$SERVING" 2>/dev/null; then
    SERVING_PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
