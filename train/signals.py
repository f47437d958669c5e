"""SIGTERM and Ctrl-C end a run after the step in progress, with a checkpoint, instead of mid-write."""

from __future__ import annotations

import signal
import threading


class Interrupted(Exception):
    """The run stopped on a signal after saving a checkpoint of `step`."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, with a checkpoint of it; "
                         f"run the same command again to resume")


class StopSignals:
    """Within the block, SIGTERM and SIGINT set `received` (the first signal's number) rather than
    raise; a second one of either kind stops at once, as usual. Outside the main thread, a no-op."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is not None:  # a second signal: the user means it
            self.__exit__()
            signal.raise_signal(signum)
        self.received = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
