"""Fixtures for the model-loading tests, on top of the shared ones in tests/conftest.py.

Shared (session, loaded once for the whole suite): ``default_model_path`` (the SmolLM2 GGUF),
``default_weights`` (our ``load_model_files`` output) and ``hf_model`` (transformers' load of the same GGUF,
the reference). Here: transformers' tokenizer from the GGUF, and the default model resolved into a *cold*
cache in a temporary directory, to test cache building and stdout hygiene.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infinite_llm.models import registry


@contextlib.contextmanager
def stdout_captured() -> Iterator[list[str]]:
    """Capture everything written to stdout, by Python code (sys.stdout) or at fd 1 (C code, subprocesses).

    Yields a list that holds the captured text once the block exits.
    """
    result: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as raw, contextlib.redirect_stdout(io.StringIO()) as py_out:
        sys.__stdout__.flush()
        saved_fd = os.dup(1)
        os.dup2(raw.fileno(), 1)
        try:
            yield result
        finally:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            raw.seek(0)
            result.append(py_out.getvalue() + raw.read().decode(errors="replace"))


@pytest.fixture(scope="session")
def cold_default_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[registry.ResolvedModel, str]:
    """(the default model resolved into a fresh, empty cache, what resolving it wrote to stdout)."""
    with pytest.MonkeyPatch.context() as mp, stdout_captured() as out:
        mp.setenv(registry.CACHE_ENV, str(tmp_path_factory.mktemp("model-cache")))
        resolved = registry.resolve_model(None)
    return resolved, out[0]


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    """transformers' tokenizer converted from the same GGUF: the reference tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, local_files_only=True
    )
