"""Why the local mesh runs its other services niced: a compute instance's OpenMP region beside bursty neighbours.

One decode-sized Linear (``[16, 576] x [576, 1536]``, fp32, 2 intra-op threads: the compute instance's shape)
is timed alone, then beside 3 processes that each spin 0.3 ms and sleep 0.5 ms (an attention server's or the
router's bursts), at niceness 0 and at ``--nice``, in interleaved rounds. An OpenMP region ends when its last
thread does, so a thread queued behind a neighbour stalls the whole region. Prints microseconds per call and
ends with ``beside niced neighbours: X.XXx faster``. Run: ``.venv/bin/python benchmarks/neighbour_nice.py``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

BURST = """import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 3e-4:
        pass
    time.sleep(5e-4)
"""


def linear_us(x: torch.Tensor, w: torch.Tensor, calls: int) -> float:
    for _ in range(100):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nice", type=int, default=10, help="the neighbours' niceness in the niced rounds")
    ap.add_argument("--neighbours", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    torch.set_num_threads(2)
    w, x = torch.randn(1536, 576), torch.randn(16, 576)
    print(f"alone: {linear_us(x, w, a.calls):.1f} us per call", flush=True)
    times: dict[int, list[float]] = {0: [], a.nice: []}
    for r in range(a.rounds):
        for nice in times:
            cmd = ["nice", "-n", str(nice), sys.executable, "-c", BURST]
            neighbours = [subprocess.Popen(cmd) for _ in range(a.neighbours)]
            try:
                time.sleep(0.3)
                times[nice].append(linear_us(x, w, a.calls))
            finally:
                for p in neighbours:
                    p.kill()
                    p.wait()
            print(f"round {r}: {a.neighbours} neighbours at nice {nice:2d}: {times[nice][-1]:.1f} us", flush=True)
    print(f"alone: {linear_us(x, w, a.calls):.1f} us per call")
    plain, niced = statistics.median(times[0]), statistics.median(times[a.nice])
    print(f"median: nice 0 {plain:.1f} us, nice {a.nice} {niced:.1f} us")
    print(f"beside niced neighbours: {plain / niced:.2f}x faster")


if __name__ == "__main__":
    main()
