"""Input checks shared by the Triton launchers (``paged_attention.py``, ``merge.py``).

Every launcher runs these before a launch, so a bad call raises :class:`InvalidRequest` on the host instead
of reading out of bounds on the device. Imports triton; only the launchers import this module.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from infinite_llm.core.errors import InvalidRequest

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting(kernel: object) -> bool:
    """True when ``kernel`` was built under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors, in numpy)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, tensors: dict[str, torch.Tensor]) -> None:
    """All ``tensors`` on one device, and that device CUDA unless ``kernel`` is interpreted.

    Raises:
        InvalidRequest: naming the first tensor on another device, or the CPU device when not interpreting.
    """
    names = list(tensors)
    device = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != device:
            raise InvalidRequest(f"{name} is on {tensors[name].device}, {names[0]} on {device}")
    if device.type != "cuda" and not interpreting(kernel):
        raise InvalidRequest(f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 for CPU")


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """Raises :class:`InvalidRequest` if ``tensor.dtype`` is not one of ``allowed``."""
    if tensor.dtype not in allowed:
        raise InvalidRequest(f"{name} has dtype {tensor.dtype}; expected one of {[str(d) for d in allowed]}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raises :class:`InvalidRequest` if ``tensor.shape != shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise InvalidRequest(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(shape)}")


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)`` (Triton block sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()
