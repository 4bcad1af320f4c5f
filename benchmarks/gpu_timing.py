"""Timing helpers shared by the GPU benchmarks (``kernels_gpu.py``, ``engine_gpu.py``).

Wall time of a call includes the host: Python, launch overhead (~7-8 us per kernel through torch, ENV.md)
and host syncs. Device time is the sum of the kernel (and memcpy/memset) durations that torch.profiler
records on the GPU, so ``device / wall`` is the fraction of a call the GPU is busy. One stream: the sum
equals the busy time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

H200_COPY_TBPS = 4.3  # device-to-device copy on the H200, read + write (ENV.md): the KV-read roofline
H200_BF16_TFLOPS = 790.0  # bf16 matmul measured on the H200 (ENV.md)


@dataclass(frozen=True)
class DeviceTime:
    """GPU activity per call of a profiled function."""

    busy_us: float  # kernels + memcpy + memset, microseconds
    kernels: float  # kernels launched (memcpy/memset not counted)
    by_name: tuple[tuple[str, float, float], ...] = ()  # (kernel name, us per call, launches per call), slowest first


def wall_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean wall time of ``fn`` in milliseconds after ``warmup`` calls (the first compiles kernels)."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e3


def device_time(fn: Callable[[], object], iters: int, warmup: int = 1) -> DeviceTime:
    """Mean GPU busy time and kernel count per call of ``fn``, from torch.profiler (zeros without CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        sync()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in gpu)
    kernels = sum(1 for e in gpu if not e.name.startswith(("Memcpy", "Memset")))
    totals: dict[str, list[float]] = {}
    for e in gpu:
        t = totals.setdefault(e.name, [0.0, 0.0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
    by_name = sorted(((n, us / iters, c / iters) for n, (us, c) in totals.items()), key=lambda r: -r[1])
    return DeviceTime(busy / iters, kernels / iters, tuple(by_name))


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
