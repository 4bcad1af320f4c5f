"""AttentionServer: an attention-memory server holding rBlocks and computing partial attention.

``server.py`` (config, start/serve/main) -> ``servicer.py`` (gRPC, codec) -> ``served_rmanager.py``
(RManager plus reservations, validation, migration) -> ``core.rmanager.RManager``.

The server's names are imported on first use, so ``ServedRManager`` (the compute part) imports without the
serving stack (opentelemetry, prometheus): a GPU machine that only checks kernels has torch, not the mesh.
"""

from __future__ import annotations

import importlib
from typing import Any

from infinite_llm.services.attention.served_rmanager import ServedRManager

_SERVER_NAMES = ("AttentionServer", "AttentionServerConfig", "main", "serve", "start")
__all__ = ["ServedRManager", *_SERVER_NAMES]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - PEP 562 lazy attribute
    if name in _SERVER_NAMES:
        return getattr(importlib.import_module("infinite_llm.services.attention.server"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
