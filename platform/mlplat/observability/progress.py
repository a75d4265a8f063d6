"""Progress of work running in Ray workers, shown by the driver: training steps, rows evaluated.

    worker (rank 0 of a training job, a pipeline step's task)      driver (mlplat quickstart|run|train)
      ProgressReporter.update(step, loss=...)  --at most 1/s-->  ProgressBoard actor  <--polls 2/s--  ProgressDisplay
                                                                                                   -> bars on the terminal

Ray Train v2 runs its report callbacks on its controller actor, not in the driver, and a
pipeline's steps are tasks, so neither can draw on the driver's terminal: they post their latest
figures to one named actor of the job, which the driver's display reads. Without a display (the
SDK, tests, plain ``torch.distributed``) there is no board and reporting costs nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
import uuid
from typing import TextIO

BOARD_NAME = "mlplat-progress"
_lock = threading.Lock()
_bars: dict[str, object] = {}  # the display's open tqdm bars: lines are written above them


class ProgressBoard:
    """The job's latest progress per task (a Ray actor, created by the driver's display)."""

    def __init__(self):
        self.tasks: dict[str, dict] = {}

    def update(self, key: str, record: dict) -> None:
        self.tasks[key] = record

    def snapshot(self) -> dict[str, dict]:
        return self.tasks


class ProgressReporter:
    """Posts ``done``/``total`` (and figures such as the loss) to the job's board, if a display reads one.

    Posts are fire-and-forget and at most one per ``every_s`` (the last one always, and waited for), so a
    training step never waits on them."""

    LOOKUP_EVERY_S = 5.0

    def __init__(self, task: str, total: int, unit: str = "step", every_s: float = 1.0):
        self.key, self.task, self.total, self.unit, self.every_s = f"{task}/{uuid.uuid4().hex[:8]}", task, total, unit, every_s
        self._board, self._looked_up, self._posted = None, float("-inf"), float("-inf")

    def update(self, done: int, **figures: float) -> None:
        now = time.monotonic()
        if done < self.total and now - self._posted < self.every_s:
            return
        board = self._find_board(now, retry=done >= self.total)  # the last figures are worth another look
        if board is None:
            return
        self._posted = now
        record = {"task": self.task, "done": done, "total": self.total, "unit": self.unit, "figures": figures, "time": time.time()}
        try:
            posted = board.update.remote(self.key, record)
            if done >= self.total:
                # The last figures land before the task returns: the driver's final poll, sent after it sees the result,
                # is not ordered after this worker's calls to the board and could otherwise miss them.
                sys.modules["ray"].get(posted, timeout=10)
        except Exception:  # noqa: BLE001 - the board went away with its driver: progress is not worth failing a step
            self._board = None

    def _find_board(self, now: float, retry: bool):
        ray = sys.modules.get("ray")  # a process without Ray (plain torch.distributed) has no board to find
        if self._board is not None or ray is None or not ray.is_initialized():
            return self._board
        if now - self._looked_up < self.LOOKUP_EVERY_S and not retry:
            return None
        self._looked_up = now
        try:
            self._board = ray.get_actor(BOARD_NAME)
        except ValueError:
            self._board = None
        return self._board


class ProgressDisplay:
    """Draws the board's tasks on ``stream``: a tqdm bar each on a terminal, a line every 10% otherwise.

    Creates the board as soon as Ray is up (a recipe starts its cluster after checking its inputs)."""

    POLL_S = 0.5

    def __init__(self, stream: TextIO):
        self.stream, self.interactive = stream, stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlplat-progress", daemon=True)
        self._board = None
        self._shown: dict[str, dict] = {}  # key -> {"bar": tqdm | None, "done": int, "next_line": int, "closed": bool}

    def __enter__(self) -> ProgressDisplay:
        self._poll()  # the board exists before any work starts where Ray is already up
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()  # the last figures
        for key in list(self._shown):
            self._close(key)
        if self._board is not None:
            import ray

            with contextlib.suppress(Exception):  # already gone with a cluster that shut down
                ray.kill(self._board)

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self._poll()

    def _poll(self) -> None:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        try:
            if self._board is None:
                self._board = ray.remote(num_cpus=0)(ProgressBoard).options(name=BOARD_NAME, get_if_exists=True).remote()
            tasks = ray.get(self._board.snapshot.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - Ray shutting down, a slow GCS: the next poll tries again
            return
        for key, record in sorted(tasks.items(), key=lambda item: item[1]["time"]):
            self._show(key, record)

    def _show(self, key: str, record: dict) -> None:
        shown = self._shown.setdefault(key, {"bar": None, "done": -1, "next_line": 0, "closed": False, "start": time.monotonic(),
                                             "first": record["done"]})
        if shown["closed"] or record["done"] == shown["done"]:
            return
        shown["done"] = done = record["done"]
        total, figures = record["total"], record["figures"]
        if self.interactive:
            if shown["bar"] is None:
                from tqdm import tqdm

                shown["bar"] = tqdm(total=total, initial=done, desc=f"  {record['task']}", unit=record["unit"], file=self.stream,
                                    ncols=shutil.get_terminal_size().columns, leave=True)  # 80 where a terminal says 0
                _bars[key] = shown["bar"]
            bar = shown["bar"]
            bar.n = done
            bar.set_postfix({name: f"{value:.4g}" for name, value in figures.items()}, refresh=False)
            bar.refresh()
        elif done >= shown["next_line"] or done >= total:
            shown["next_line"] = done + max(1, total // 10)
            line = describe(done, total, record["unit"], done - shown["first"], time.monotonic() - shown["start"], figures)
            write_line(f"  {record['task']}: {line}", self.stream)
        if done >= total:
            self._close(key)

    def _close(self, key: str) -> None:
        shown = self._shown[key]
        if shown["bar"] is not None and not shown["closed"]:
            with _lock:
                _bars.pop(key, None)
            shown["bar"].close()
        shown["closed"] = True


def describe(done: int, total: int, unit: str, done_since: int, elapsed_s: float, figures: dict[str, float]) -> str:
    """``120/1000 steps, loss 0.812, 3.1 steps/s, 4m44s left``: the rate is ``done_since`` units in ``elapsed_s``."""
    parts = [f"{done}/{total} {unit}s"] + [f"{name} {value:.4g}" for name, value in figures.items()]
    if elapsed_s > 0 and done_since > 0:
        rate = done_since / elapsed_s
        parts.append(f"{rate:.3g} {unit}s/s")
        if done < total:
            left = int((total - done) / rate)
            parts.append(f"{left // 60}m{left % 60:02d}s left")
    return ", ".join(parts)


def write_line(message: str, stream: TextIO) -> None:
    """A whole line, written above any progress bars being drawn on ``stream``."""
    with _lock:
        bars = list(_bars.values())
    if bars:
        from tqdm import tqdm

        tqdm.write(message, file=stream)
    else:
        print(message, file=stream, flush=True)

