"""The code of the processes that never run the model imports no torch: the router, the manager, the
gateway and the client SDK (a user of the SDK needs no torch installed; the manager process never loads it:
~75 MB resident instead of ~340 MB, and it starts in under a second instead of the ~3-6 s an import of torch
costs on 2 busy cores). The router and gateway still load torch at run time, through transformers'
tokenizer (``models/tokenizer.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers")


@pytest.mark.parametrize(
    "module",
    [
        "infinite_llm.services.router.server",
        "infinite_llm.services.manager.server",
        "infinite_llm.services.manager.autoscale",
        "infinite_llm.services.gateway.server",
        "infinite_llm.services.admin",
        "infinite_llm.client",
        "infinite_llm.cli",
    ],
)
def test_module_imports_without_torch(module):
    code = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
