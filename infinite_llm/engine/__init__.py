"""The single-process engine (continuous batching over DistAttention partitions).

``RequestOutput`` (:mod:`.outputs`) is plain data; the engine itself (:mod:`.llm_engine`, torch and the model)
is imported only when first named, so the router and the SDK, which read outputs, never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infinite_llm.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from infinite_llm.engine.llm_engine import EngineConfig, LLMEngine

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562: the engine on first use
    if name in ("EngineConfig", "LLMEngine"):
        from infinite_llm.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
