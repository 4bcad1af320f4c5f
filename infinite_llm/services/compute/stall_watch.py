"""Per-call deadlines on the data plane: an attention server that stops answering is given up on within
seconds, not at the step's 30 s deadline (issue 11: a paused server hung everyone on it).

Each layer reply is owed from the moment its ``LayerInput`` was sent. A server gets
``max(STALL_MIN_S, STALL_FACTOR x the slowest reply it gave over its last WINDOW layers)``: far above its
own recent pace (a prefill chunk's layer takes longer than a decode's, hence the slowest, not the mean), and
never less than ``STALL_MIN_S``, which covers a big prefill after a run of decodes on a loaded machine. When
a reply is overdue its call is cancelled, and the transport raises ``Unavailable``: the compute instance then
recomputes the step's sequences on the servers that answer, as for a dead server (``engine_loop``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

STALL_MIN_S = 5.0  # the least a layer reply is waited for (seconds)
STALL_FACTOR = 8.0  # times a server's slowest recent layer reply
WINDOW = 256  # layer replies remembered per server (~8 steps of a 30-layer model)
TICK_S = 0.05  # how often overdue replies are looked for (seconds)


class StallWatch:
    """Cancels calls whose reply is overdue. Thread-safe; one daemon thread, started on first use."""

    def __init__(self, min_s: float = STALL_MIN_S, factor: float = STALL_FACTOR) -> None:
        self.min_s, self.factor = min_s, factor
        self._recent: dict[str, deque[float]] = {}
        self._owed: dict[int, tuple[float, Callable[[], None], list[bool]]] = {}  # -> (deadline, cancel, fired)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def limit(self, server: str) -> float:
        """Seconds a reply of ``server`` may take."""
        with self._lock:
            recent = self._recent.get(server)
            slowest = max(recent) if recent else 0.0
        return max(self.min_s, self.factor * slowest)

    def observe(self, server: str, seconds: float) -> None:
        """A reply of ``server`` took ``seconds``."""
        with self._lock:
            self._recent.setdefault(server, deque(maxlen=WINDOW)).append(seconds)

    @contextlib.contextmanager
    def owed(
        self, server: str, since: float, cancel: Callable[[], None], until: float = float("inf")
    ) -> Iterator[Callable[[], bool]]:
        """While inside, ``cancel()`` is called once the reply is ``limit(server)`` seconds past ``since``
        (``time.perf_counter()``), or at ``until`` if that comes first (a step's deadline). Yields a function
        that tells whether that happened."""
        fired = [False]
        token = next(self._ids)
        deadline = min(since + self.limit(server), until)
        with self._lock:
            self._owed[token] = (deadline, cancel, fired)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
                self._thread.start()
        try:
            yield lambda: fired[0]
        finally:
            with self._lock:
                self._owed.pop(token, None)

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            now = time.perf_counter()
            with self._lock:
                overdue = [(c, f) for t, (d, c, f) in list(self._owed.items()) if d < now and not f[0]]
                for _, fired in overdue:
                    fired[0] = True
            for cancel, _ in overdue:
                cancel()
