"""A ``TorchFunctionMode`` that catches device faults of the step path on a machine without a GPU.

CI has no GPU, so a step that builds an index on the CPU and uses it on CUDA (the fault that stopped the
engine on its first CUDA step) cannot fail there. This mode records, for code of the package:

- every tensor factory (``torch.tensor``, ``zeros``, ``arange``, ...) called without an explicit
  ``device=``: on CPU it works by accident, on CUDA it puts the tensor on the wrong device;
- every op whose tensor arguments live on more than one device (0-dim CPU scalars excepted, as torch allows).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

PACKAGE = str(Path(__file__).resolve().parents[1] / "infinite_llm")
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
}


class DeviceGuard(TorchFunctionMode):
    """Records device faults (see the module docstring) in ``violations`` as ``"file:line: what"``."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self._record(f"{func.__name__}() without device=")
        elif func not in FACTORIES:
            flat, _ = tree_flatten((args, kwargs))
            devices = {
                t.device for t in flat if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
            }
            if len(devices) > 1:
                self._record(f"{getattr(func, '__name__', func)} mixes {sorted(map(str, devices))}")
        return func(*args, **kwargs)

    def _record(self, what: str) -> None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if frame.filename.startswith(PACKAGE):
                self.violations.append(
                    f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno}: {what}"
                )
                return
