"""Whether the store is busy: requests holding leases, prompts being written, recent I/O.

Background maintenance (the reorganiser) runs only once the store has been idle for a
while and waits again between the blocks it writes, so that a request that arrives
meanwhile is delayed by at most one block write. Idleness is per process, on the
monotonic wall clock (not the store's injectable clock: it is about real time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Activity:
    """Counts the requests and writes in progress and remembers the last I/O."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._active = 0
        self._last = clock()

    def enter(self) -> None:
        """A request or write starts."""
        with self._cond:
            self._active += 1
            self._last = self._clock()

    def leave(self) -> None:
        """A request or write ends."""
        with self._cond:
            self._active = max(0, self._active - 1)
            self._last = self._clock()
            self._cond.notify_all()

    def touch(self) -> None:
        """Something used the store just now (a match, a read)."""
        self._last = self._clock()

    def wait_idle(self, seconds: float, stop: threading.Event | None = None) -> bool:
        """Block until the store has been idle for ``seconds``; False if ``stop`` was set."""
        while stop is None or not stop.is_set():
            with self._cond:
                if self._active:
                    self._cond.wait(0.05)
                    continue
                left = seconds - (self._clock() - self._last)
            if left <= 0:
                return True
            if stop is not None:
                stop.wait(left)
            else:
                time.sleep(left)
        return False
