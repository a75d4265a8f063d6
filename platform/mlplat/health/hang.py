"""Hang detection: when a rank stops completing steps, dump every thread's stack and let the job fail.

A hung collective (a peer that died silently, a deadlocked data loader, a wedged GPU)
blocks a rank forever without an error, so fault tolerance never kicks in. The watchdog
turns "no step for ``timeout_s``" into a stack dump and a failure that Ray Train's
``FailureConfig`` restarts from the last checkpoint.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from mlplat.config import Config


class HangConfig(Config):
    enabled: bool = True
    timeout_s: float = Field(default=1800.0, gt=0)  # no step completed for this long: a hang (keep it above the slowest checkpoint save)
    # After recording its stacks a rank waits this long before exiting: the peers blocked on it fire within
    # a second or two and record theirs too, before the first exit makes Ray Train tear the group down.
    exit_grace_s: float = Field(default=10.0, ge=0)


class HangWatchdog:
    """Calls ``on_hang(stacks_file)`` once when ``beat()`` has not been called for ``timeout_s``.

    Armed by the first ``beat()``: start-up (model loading, the first batch) is not a
    step. The dump comes from a Python thread, which cannot run while a hang holds the
    GIL; for that case faulthandler's C-level timer is armed too and, ``grace_s`` later
    than the Python thread would have fired, writes the stacks and exits the process.
    """

    def __init__(self, timeout_s: float, stacks_file: Path, on_hang: Callable[[Path], None], grace_s: float = 60.0):
        self.timeout_s, self.stacks_file, self.on_hang, self.grace_s = timeout_s, Path(stacks_file), on_hang, grace_s
        self._last_beat: float | None = None
        self._backstop_armed_at = -float("inf")
        self._backstop_file = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mlplat-hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self.stacks_file.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        """Progress: a step completed."""
        now = time.monotonic()
        self._last_beat = now
        # Re-arming starts a C thread, so only every quarter timeout; the backstop's
        # deadline (1.25 x timeout + grace after arming) never falls before last beat + timeout + grace.
        if now - self._backstop_armed_at > self.timeout_s / 4:
            if self._backstop_file is None:
                self._backstop_file = open(self.stacks_file.with_suffix(".backstop.txt"), "w")  # noqa: SIM115 -- faulthandler keeps the fd
            faulthandler.dump_traceback_later(1.25 * self.timeout_s + self.grace_s, exit=True, file=self._backstop_file)
            self._backstop_armed_at = now

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._backstop_file is not None:
            self._backstop_file.close()
            self._backstop_file = None

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll_s):
            if self._last_beat is not None and time.monotonic() - self._last_beat > self.timeout_s:
                with open(self.stacks_file, "w") as f:
                    f.write(f"no step completed for {time.monotonic() - self._last_beat:.0f} s (timeout {self.timeout_s:g} s)\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
                self.on_hang(self.stacks_file)
                return
