"""The deadline after a stop signal: a process that cannot reach its step boundary (blocked in a collective
for a peer that is gone) ends itself, but a long step is not taken for a stuck one (the run ended 20 s
into a 50 s step, with no checkpoint), and a process that reached its boundary saves undisturbed. A single
process has no peer to wait for: no deadline there."""

import os
import signal
import time

import pytest

from jaxdist.train import loop_guards
from jaxdist.train.step_watchdog import StopDeadline


@pytest.fixture
def signals_caught():
    """SIGTERM handled by Python (as the trainer's StopRequests does), restored after the test."""
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, previous)


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_the_grace_period_is_at_least_twice_the_longest_step(signals_caught):
    exits = []
    deadline = StopDeadline(0.2, exit_fn=exits.append)
    try:
        deadline.allow(0.6)  # steps take 0.6 s: a stop waits 1.2 s for the boundary
        began = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert not wait_for(lambda: exits, 0.8), "ended within a step's time"
        assert wait_for(lambda: exits, 3.0)
        assert exits == [128 + signal.SIGTERM] and time.monotonic() - began >= 1.2
    finally:
        deadline.close()


def test_a_process_at_its_boundary_gets_the_period_again_for_its_save(signals_caught):
    exits = []
    deadline = StopDeadline(0.6, exit_fn=exits.append)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.4)
        deadline.restart()  # the loop reached its step boundary: the stop's save has 0.6 s from here
        assert not wait_for(lambda: exits, 0.4), "ended 0.6 s after the signal, in the save"
        assert wait_for(lambda: exits, 2.0)  # a save that hangs (a peer gone) still ends the process
    finally:
        deadline.close()


def test_a_single_process_arms_no_deadline_and_a_launched_worker_does(monkeypatch):
    monkeypatch.delenv(loop_guards.NUM_PROCESSES_ENV, raising=False)
    stop = loop_guards.StopRequests()
    try:
        assert stop.deadline is None
    finally:
        stop.close()
    monkeypatch.setenv(loop_guards.NUM_PROCESSES_ENV, "2")
    monkeypatch.setenv("JAXDIST_STOP_GRACE_S", "0.1")
    stop = loop_guards.StopRequests()
    try:
        assert stop.deadline is not None
        stop.check()
        time.sleep(0.3)
        stop.check()  # boundary to boundary: the grace covers two such steps
        assert stop.deadline.grace() >= 0.6
    finally:
        stop.close()
