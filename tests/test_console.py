"""A command's terminal: its own lines and progress on the console, the libraries' logs in a file."""

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import MLPLAT

from mlplat.observability.progress import ProgressDisplay, ProgressReporter, describe


def test_describe_gives_rate_and_time_left():
    assert describe(120, 1000, "step", 100, 50.0, {"loss": 0.81234}) == "120/1000 steps, loss 0.8123, 2 steps/s, 7m20s left"
    assert describe(10, 10, "row", 10, 2.0, {}) == "10/10 rows, 5 rows/s"
    assert describe(0, 10, "row", 0, 0.0, {}) == "0/10 rows"


def test_a_reporter_without_ray_or_a_board_costs_nothing():
    reporter = ProgressReporter("sft", 3)
    for step in range(1, 4):
        reporter.update(step, loss=1.0)  # no Ray in this process's view, or no board: nothing to post, nothing raised
    assert reporter._board is None


QUIET = textwrap.dedent("""
    import os, sys, logging
    from pathlib import Path
    from mlplat.observability.console import quiet_terminal, status, result
    with quiet_terminal(Path(sys.argv[1])):
        print("library print")
        logging.getLogger("somelib").warning("library warning")
        os.write(2, b"native stderr\\n")
        os.system("echo child process")
        status("step 1: done")
        result('{"answer": 42}')
    print("after")
""")


def test_quiet_terminal_sends_everything_but_the_commands_lines_to_the_log(tmp_path):
    log = tmp_path / "logs" / "x.log"
    out = subprocess.run([sys.executable, "-c", QUIET, str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ['{"answer": 42}', "after"]
    assert out.stderr.splitlines() == [f"logs: {log} (-v shows them here)", "step 1: done"]
    assert set(log.read_text().splitlines()) == {"library print", "library warning", "native stderr", "child process"}


def test_worker_progress_reaches_the_drivers_display(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    def count(n):
        reporter = ProgressReporter("counting", n, unit="row", every_s=0)
        for i in range(1, n + 1):
            reporter.update(i, rows_seen=float(i))
        return n

    stream = io.StringIO()  # not a terminal: a line every 10%, not a bar
    with ProgressDisplay(stream):
        assert ray.get(count.remote(50)) == 50
        time.sleep(1.0)  # a poll or two
    lines = stream.getvalue().splitlines()
    assert lines and lines[-1].startswith("  counting: 50/50 rows, rows_seen 50"), lines
    assert len(lines) <= 11  # at most one per 10% of the way
    with pytest.raises(ValueError):
        ray.get_actor("mlplat-progress")  # the display took its board with it


def test_a_tasks_last_figures_are_on_the_board_when_it_returns(ray_cluster):
    """The driver's last poll is not ordered after a worker's calls to the board: the final post must have landed
    before the task returns. A board slow to take updates (but free to answer snapshots) shows it."""
    import ray

    from mlplat.observability.progress import BOARD_NAME, ProgressBoard

    class SlowBoard(ProgressBoard):
        def update(self, key: str, record: dict) -> None:
            time.sleep(1.0)
            super().update(key, record)

    @ray.remote(num_cpus=0)
    def count(n):
        ProgressReporter("counting", n, unit="row").update(n)  # the last post alone
        return n

    board = ray.remote(num_cpus=0, max_concurrency=4)(SlowBoard).options(name=BOARD_NAME).remote()
    try:
        assert ray.get(count.remote(5)) == 5
        assert [r["done"] for r in ray.get(board.snapshot.remote()).values()] == [5]
    finally:
        ray.kill(board)


PIPELINE = textwrap.dedent("""
    from mlplat.observability.progress import ProgressReporter
    from mlplat.pipeline import pipeline, step

    @step(num_cpus=0.5)
    def count(n: int) -> int:
        print("NOISE from the step")
        reporter = ProgressReporter("counting", n, unit="row", every_s=0)
        for i in range(1, n + 1):
            reporter.update(i)
        return n

    @pipeline(experiment="console")
    def counted(n: int = 20):
        return count(n)
""")


@pytest.mark.slow
def test_mlplat_run_shows_steps_and_progress_and_logs_the_rest(ray_cluster, tracking_uri, tmp_path):
    import ray

    (tmp_path / "counted.py").write_text(PIPELINE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"MLFLOW_TRACKING_URI": tracking_uri}  # auth kept
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run([MLPLAT, "run", "counted.py", "--address", address, "--workdir", "work"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["outputs"] == 20  # stdout is the result alone
    log = re.match(r"logs: (\S+) \(-v shows them here\)", out.stderr).group(1)
    assert "[counted] count: done in" in out.stderr and "counting: 20/20 rows" in out.stderr, out.stderr
    assert "NOISE" not in out.stderr + out.stdout
    assert "Connecting to existing Ray cluster" in (tmp_path / log).read_text()  # Ray's own lines went to the file
