"""The single-process engine (continuous batching over DistAttention partitions)."""

from infinite_llm.engine.llm_engine import EngineConfig, LLMEngine
from infinite_llm.engine.outputs import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]
