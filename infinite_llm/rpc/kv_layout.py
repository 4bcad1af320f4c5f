"""KV layouts as members of a cluster compare them: text, without torch (the manager imports this)."""

from __future__ import annotations

from infinite_llm.pb.v1 import tensor_pb2


def kv_layout_text(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """A KV layout as the manager compares members and errors name it: ``dtype`` a Tensor dtype name
    ("float32", "bfloat16", "float16"), the rest counts (``head_dim`` in elements)."""
    return f"{dtype} for {num_layers} layers x {num_kv_heads} KV heads x {head_dim}"


def kv_layout_of(layout: tensor_pb2.KVLayout) -> str:
    """:func:`kv_layout_text` of a ``KVLayout`` message; '' when it is unset (a member that did not tell)."""
    if not layout.num_layers:
        return ""
    return kv_layout_text(layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
