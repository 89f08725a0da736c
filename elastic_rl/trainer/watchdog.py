"""A deadline on a block of a trainer's work that may hang where no timeout of its own reaches: a
weight sync over NCCL (``trainer.weight_broadcast``), a colocated rank's move of its state on or off
the device (``trainer.offload``). Past the deadline the block is asked to end (``on_expiry``); if it
still has not ended after a grace, the process logs why and exits with the block's exit code, and
erld restarts it as any crash."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("elastic_rl.trainer")


class Watchdog:
    """Calls ``on_expiry`` (on a thread of its own) if the ``with`` block has not ended within
    ``timeout_s``; if the block has not ended ``grace_s`` after that either, logs why and calls
    ``exit(code)``: the last resort, for a hang that ``on_expiry`` did not end."""

    def __init__(
        self,
        timeout_s: float,
        what: str,
        code: int,
        on_expiry: Callable[[], None] = lambda: None,
        grace_s: float = 0.0,
        exit: Callable[[int], None] = os._exit,
    ):
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.what, self.code = what, code
        self.expired = threading.Event()
        self._ended = threading.Event()
        self._on_expiry, self._exit = on_expiry, exit
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._deadline = 0.0

    def _expire(self) -> None:
        self.expired.set()
        threading.Thread(target=self._on_expiry, name=f"{self.what} abort", daemon=True).start()
        if not self._ended.wait(self.grace_s):
            log.critical(
                "%s is still hung %.0f s after its deadline of %.0f s: exiting %d for erld to restart this trainer",
                self.what,
                self.grace_s,
                self.timeout_s,
                self.code,
            )
            self._exit(self.code)

    def remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def __enter__(self) -> Watchdog:
        self._deadline = time.monotonic() + self.timeout_s
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._ended.set()
        self._timer.cancel()
