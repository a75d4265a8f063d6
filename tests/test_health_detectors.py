"""Straggler detector and hang watchdog as pure logic: synthetic per-rank times, a real stuck thread."""

import random
import threading
import time

import pytest

from mlplat.health.hang import HangWatchdog
from mlplat.health.straggler import StragglerConfig, StragglerDetector


def test_straggler_is_flagged_after_k_consecutive_slow_windows():
    detector = StragglerDetector(StragglerConfig(margin=0.25, windows=3))
    healthy = [1.0, 1.02, 0.98, 1.01]
    slow = [1.0, 1.02, 1.6, 1.01]  # rank 2: 1.6x the others' median
    assert detector.observe(healthy).flagged == []
    first, second, third, fourth = (detector.observe(slow) for _ in range(4))
    assert first.flagged == second.flagged == [] and first.slowdowns[2] == pytest.approx(1.6 / 1.01)
    assert third.flagged == [2] and third.newly_flagged == [2]
    assert fourth.flagged == [2] and fourth.newly_flagged == []  # reported once per streak
    # One normal window ends the streak; it takes K slow windows again.
    assert detector.observe(healthy).flagged == []
    assert [detector.observe(slow).flagged for _ in range(3)] == [[], [], [2]]


def test_a_single_slow_window_or_a_small_margin_raises_nothing():
    detector = StragglerDetector(StragglerConfig(margin=0.25, windows=3, min_excess_s=0.05))
    pattern = [[1.0, 2.0], [1.0, 1.0], [1.0, 2.0], [1.0, 1.0], [1.0, 2.0]]  # slow every other window
    assert all(detector.observe(w).flagged == [] for w in pattern)
    tiny = [0.010, 0.020]  # 2x slower but only 10 ms: under min_excess_s
    assert all(detector.observe(tiny).flagged == [] for _ in range(5))


def test_no_false_alarm_on_noisy_healthy_ranks_and_a_real_straggler_is_found_in_the_noise():
    rng = random.Random(0)
    detector = StragglerDetector(StragglerConfig())  # the defaults: 25% margin, 3 windows
    for _ in range(2000):  # 8 ranks, 10% lognormal jitter per window, occasional 40% spikes on a random rank
        window = [rng.lognormvariate(0, 0.1) for _ in range(8)]
        if rng.random() < 0.1:
            window[rng.randrange(8)] *= 1.4
        assert detector.observe(window).flagged == []
    flagged_at = None
    for i in range(10):
        window = [rng.lognormvariate(0, 0.1) for _ in range(8)]
        window[5] *= 1.8
        if detector.observe(window).flagged:
            flagged_at = i + 1
            break
    assert flagged_at is not None and flagged_at <= 5


def test_watchdog_dumps_every_threads_stack_when_steps_stop(tmp_path):
    fired = []
    done = threading.Event()

    def stuck_in_a_collective():  # a recognisable frame in the dump
        done.wait(timeout=60)

    worker = threading.Thread(target=stuck_in_a_collective, name="fake-train-loop")
    worker.start()
    def on_hang(stacks_file):
        fired.append(stacks_file)
        done.set()

    watchdog = HangWatchdog(timeout_s=0.5, stacks_file=tmp_path / "stacks.txt", on_hang=on_hang, grace_s=30)
    watchdog.start()
    try:
        time.sleep(1.0)
        assert fired == []  # not armed before the first step
        watchdog.beat()
        assert done.wait(timeout=30), "the watchdog never fired"
    finally:
        watchdog.close()
        done.set()
        worker.join()
    stacks = fired[0].read_text()
    assert "no step completed" in stacks and "stuck_in_a_collective" in stacks and "Thread" in stacks

