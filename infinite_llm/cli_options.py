"""Option types and value parsers that the ``infinite-llm`` mesh commands share (``serve <role>``, ``up``,
``status``; ``generate`` uses the dtype and device parsers), and the consoles they print on.

Each parser turns a flag's text into the value a config takes, or raises ``typer.BadParameter`` naming the
flag (exit 2, before anything starts). torch is imported only inside the parsers that need it.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)

API_KEY_ENV = "INFINITE_LLM_API_KEY"  # the router's and the gateway's --api-key; up's services inherit it
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",  # GPUs without bf16 (V100, T4)
    "fp16": "float16",
    "half": "float16",
}

Host = Annotated[str, typer.Option(help="Interface to listen on.")]
PORT_RANGE = {"min": 0, "max": 65535}  # typer.Option bounds of every port flag: exit 2 beyond them


def target_option(value: str | list[str] | None) -> str | list[str] | None:
    """Callback of a flag naming gRPC targets (HOST:PORT, dns:///NAME:PORT, ...): refuse a port above 65535,
    which gRPC would wrap around (exit 2)."""
    from infinite_llm.rpc.options import check_target

    for target in [value] if isinstance(value, str) else value or []:
        if target:
            try:
                check_target(target)
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
    return value


# A manager client's target: one manager, or all of them (hot standbys: the calls go to the one that leads)
MANAGER_TARGET_HELP = (
    "Global manager HOST:PORT, or a gRPC target naming every manager (dns:///NAME:PORT, ipv4:IP1:PORT,IP2:PORT): "
    "calls go to the leader."
)
ManagerTarget = Annotated[str, typer.Option(help=MANAGER_TARGET_HELP, callback=target_option)]
Model = Annotated[str | None, typer.Option(help="HF checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct).")]
BlockSize = Annotated[int, typer.Option(help="Tokens per rBlock (must match across the mesh).", min=1)]
Transport = Annotated[
    str,
    typer.Option(
        help="How attention tensors travel: grpc, or torch (torch.distributed: gloo on CPU, NCCL on GPU; "
        "gRPC keeps the control, and a pair whose process group cannot form falls back to gRPC)."
    ),
]
Device = Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")]
NodeName = Annotated[
    str,
    typer.Option(
        envvar="NODE_NAME",
        help="The node (machine) this process runs on; in Kubernetes spec.nodeName through the downward API. "
        "Attention servers and compute instances with the same node name are each other's homes ('' = none).",
    ),
]
PrefixCaching = Annotated[
    bool,
    typer.Option(
        "--prefix-caching/--no-prefix-caching",
        help="Share the KV of full rBlocks of identical prompt prefixes across the cluster (on by default).",
    ),
]


MetricsPort = Annotated[int, typer.Option(help="Serve Prometheus /metrics on this HTTP port (0 = off).", **PORT_RANGE)]
ShutdownGrace = Annotated[
    float,
    typer.Option(
        help="Seconds the requests in flight get to finish after SIGTERM (new ones are refused and health says "
        "NOT_SERVING at once); match the pod's terminationGracePeriodSeconds.",
        min=0,
    ),
]


def split_ids(values: list[str] | None, param_hint: str) -> tuple[str, ...]:
    """Ids of a repeatable, comma-separated option (``--home a --home b,c``), checked; BadParameter otherwise."""
    from infinite_llm.core.errors import InvalidRequest
    from infinite_llm.core.ids import check_id

    ids = [v.strip() for value in values or () for v in value.split(",")]
    try:
        return tuple(dict.fromkeys(check_id(param_hint.lstrip("-"), i) for i in ids))
    except InvalidRequest as e:
        raise typer.BadParameter(e.message, param_hint=param_hint) from None


def transport_option(text: str) -> str:
    """``--transport``: grpc or torch."""
    if text not in ("grpc", "torch"):
        raise typer.BadParameter(f"unknown transport {text!r}; use grpc or torch", param_hint="--transport")
    return text


def device_option(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N, and a CUDA device only where this machine has one."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise typer.BadParameter(f"unknown device {text!r}; use cpu, cuda or cuda:N", param_hint="--device")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(f"{text!r}: this machine has no CUDA device", param_hint="--device")
    return text


def kv_memory_option(text: str) -> int:
    """``--kv-memory`` in bytes (``64MiB``, ``2GiB``, a plain number)."""
    return size_option(text, "--kv-memory")


def size_option(text: str, flag: str) -> int:
    """A size flag's value in bytes (``64MiB``, ``2GiB``, a plain number); BadParameter naming ``flag``."""
    from infinite_llm.rpc.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=flag) from None


def dtype_name(text: str) -> str:
    """The canonical name (``float32`` / ``bfloat16`` / ``float16``) of a ``--dtype`` value; BadParameter
    otherwise."""
    if text not in DTYPE_NAMES:
        raise typer.BadParameter(f"unknown dtype {text!r}; use float32, bfloat16 or float16", param_hint="--dtype")
    return DTYPE_NAMES[text]


def torch_dtype(text: str):  # noqa: ANN201
    """The ``torch.dtype`` of a ``--dtype`` value."""
    import torch

    return getattr(torch, dtype_name(text))


def stdout_console() -> Console:
    """stdout for tables and address lines. Rich cuts them to 80 columns when stdout is not a terminal (a log
    file, a pipe), which hid the log paths and metrics addresses of ``up``; there rows stay whole, unless
    ``COLUMNS`` says otherwise."""
    console = Console(soft_wrap=True)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(soft_wrap=True, width=400)
