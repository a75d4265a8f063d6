"""The terminal of an ``mlplat`` command: its own lines on the console, every library's logs in a file.

Ray (its processes' C++ logs included), Ray Data, Ray Train, MLflow and the workers' output that
Ray forwards to the driver all write to the process's file descriptors 1 and 2, from Python and
from native code, so ``quiet_terminal`` points those at a log file and keeps a copy of the
terminal's streams for the command's own lines:

    status(...)   pipeline steps, progress, notes     -> the terminal's stderr
    result(...)   what the command returns (summary, JSON) -> the terminal's stdout

Outside ``quiet_terminal`` (``-v``, the SDK, tests) both go to ``sys.stderr`` / ``sys.stdout``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_status_stream: TextIO | None = None
_result_stream: TextIO | None = None


def status(message: str) -> None:
    """A line for the person watching: a step started or finished, a note."""
    from mlplat.observability.progress import write_line

    write_line(message, status_stream())


def result(text: str) -> None:
    """What the command produced, on stdout (pipeable), whatever the logs do."""
    stream = _result_stream or sys.stdout
    print(text, file=stream, flush=True)


def status_stream() -> TextIO:
    return _status_stream or sys.stderr


def log_file_path(directory: str | Path, command: str) -> Path:
    return Path(directory) / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"


@contextlib.contextmanager
def quiet_terminal(log_path: Path | None) -> Iterator[None]:
    """Within it, file descriptors 1 and 2 (and every process started meanwhile, Ray's included) write
    to ``log_path``; ``status`` and ``result`` still reach the terminal. ``None``: change nothing (-v)."""
    global _status_stream, _result_stream
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_err, terminal_out = _terminal_copy(sys.stderr), _terminal_copy(sys.stdout)
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    _status_stream, _result_stream = terminal_err, terminal_out
    status(f"logs: {log_path} (-v shows them here)")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _status_stream = _result_stream = None
        for stream, original in ((terminal_err, sys.stderr), (terminal_out, sys.stdout)):
            if stream is not original:
                stream.close()


def _terminal_copy(stream: TextIO) -> TextIO:
    """A stream on a duplicate of ``stream``'s descriptor, untouched by the redirect; a stream with no
    descriptor (pytest's capture, a notebook's) is not affected by it and is kept as it is."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8")


@contextlib.contextmanager
def command_terminal(command: str, log_dir: str | Path, verbose: bool) -> Iterator[None]:
    """An ``mlplat`` command's terminal: libraries' logs in ``log_dir/logs/COMMAND-TIME.log`` unless
    ``verbose``, the progress of its Ray workers drawn as it goes."""
    from mlplat.observability.progress import ProgressDisplay

    ray = sys.modules.get("ray")
    ray_was_up = ray is not None and ray.is_initialized()
    with quiet_terminal(None if verbose else log_file_path(log_dir, command)):
        try:
            with ProgressDisplay(status_stream()):
                yield
        finally:
            ray = sys.modules.get("ray")
            if not verbose and not ray_was_up and ray is not None and ray.is_initialized():
                ray.shutdown()  # the cluster this command started: its parting lines belong in the log too
