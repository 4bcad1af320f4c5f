"""Run the Triton kernels of these tests in the interpreter, on CPU tensors (DESIGN.md §7).

``triton.jit`` decides between interpreter and compiler when a function is *defined*, reading
``TRITON_INTERPRET`` then: for our kernels when their module is imported, and for triton's own library
functions (``tl.max``, ``tl.sum``: ``triton.language.standard``) when triton is imported. The whole suite runs
in one pytest process where triton may already have been imported without the variable (it is, by the
collection of these very modules), so for each test module here this fixture sets the variable and
re-imports what was defined compiled; afterwards it restores the variable and re-imports again, so nothing
outside this folder runs interpreted kernels.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest

# Order matters: the language package re-binds the reloaded standard library; paged_attention imports merge.
RELOADED_MODULES = (
    "triton.language.standard",
    "triton.language",
    "infinite_llm.kernels.merge",
    "infinite_llm.kernels.paged_attention",
)


def _interpreted() -> bool:
    """Whether triton's library and our kernels were all defined under ``TRITON_INTERPRET=1``."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from infinite_llm.kernels import merge, paged_attention

    kernels = (tl.standard.max, merge._merge_kernel, paged_attention._paged_attention_kernel)
    return all(isinstance(k, InterpretedFunction) for k in kernels)


def _set_interpret(value: str | None) -> None:
    """Set (or unset) ``TRITON_INTERPRET`` and re-define triton's library and our kernels to match."""
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    want = value == "1"
    if _interpreted() != want:
        for name in RELOADED_MODULES:
            importlib.reload(sys.modules[name])
    assert _interpreted() == want, "could not switch triton to the interpreter"


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter(request: pytest.FixtureRequest) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` and interpreted kernels for one test module; restored after it.

    A module that sets ``COMPILED_KERNELS = True`` (it needs CUDA) gets compiled kernels instead."""
    saved = os.environ.get("TRITON_INTERPRET")
    _set_interpret(None if getattr(request.module, "COMPILED_KERNELS", False) else "1")
    yield
    _set_interpret(saved)
