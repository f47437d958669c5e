"""In a multi-process run, a process that dies leaves the others waiting in a collective that never
completes. The watchdog ends such a wait with one line once no step has finished for a while."""

from __future__ import annotations

import os
import sys
import threading
import time


class Watchdog:
    """Ends the process (status 1) with `message()` when `pet` has not been called for `timeout`
    seconds between `start` and `stop`."""

    def __init__(self, timeout: float, message):
        self.timeout, self.message = timeout, message
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jtopoep-watchdog", daemon=True)

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout / 4)):
            if time.monotonic() - self._last > self.timeout:
                # On a line of its own: a progress bar may have left the cursor mid-line.
                print(f"\nerror: {self.message()}", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread is stuck in a collective; nothing else can end it

    def start(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread.start()
        return self

    def pet(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()
