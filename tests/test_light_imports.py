"""The code of the processes that never run the model imports no torch: the router, the manager, the
gateway and the client SDK (a user of the SDK needs no torch installed; the manager process never loads it:
~75 MB resident instead of ~340 MB, and it starts in under a second instead of the ~3-6 s an import of torch
costs on 2 busy cores). The router and gateway load the model's tokenizer at start without torch too (through
transformers' ``TokenizersBackend``; ``AutoTokenizer`` would import torch)."""

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


@pytest.mark.parametrize(
    "build",
    [
        "from infinite_llm.services.router.server import RouterConfig, build_servicer\n"
        "tokenizer = build_servicer(RouterConfig(compute_addresses=('127.0.0.1:50070',))).tokenizer",
        "from infinite_llm.services.gateway.server import GatewayConfig, build_app\n"
        "from infinite_llm.models.registry import load_tokenizer, resolve_model\n"
        "build_app(GatewayConfig())\n"
        "tokenizer = load_tokenizer(resolve_model(None))",
    ],
    ids=["router", "gateway"],
)
def test_router_and_gateway_start_with_the_real_tokenizer_and_no_torch(build, default_weights):
    """The default model's tokenizer (the cache's, converted from its GGUF file) loads, encodes and renders a
    chat in the router's and the gateway's start-up path, and torch is never imported."""
    code = (
        "import sys\n"
        f"{build}\n"
        "ids = tokenizer.encode_chat([{'role': 'user', 'content': 'What is 2 + 2?'}])\n"
        "print(len(ids), ','.join(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    expected = len(default_weights[2].encode_chat([{"role": "user", "content": "What is 2 + 2?"}]))
    assert out.stdout.split() == [str(expected)], out.stdout + out.stderr[-2000:]
