"""Heartbeat: is the engine loop alive, and what did it last look like (the OS's watchdog).

A kernel's hung-task detector does not ask a stuck task whether it is stuck: a timer that
runs elsewhere notices that the task has not moved for too long. The engine loop is the
one task here that everything waits on, so it leaves a trace of each step: when the step
began, when it ended, and a copy of the engine's statistics taken between two steps.
Everything that must answer while a step runs, or while it hangs (``/health``,
``/stats``, ``/metrics``), reads this trace instead of waiting for the engine's thread:

    beat.begin()                     # the engine's thread, before a step
    beat.end(take_stats, fresh)      # after it: the stats are copied every ``stats_interval``
                                     # s, and at once when ``fresh`` (the engine is idle), so
                                     # the queues and blocks they show are exact at rest
    beat.problem()                   # anyone: None, or why the loop counts as hung

A step that runs past ``step_timeout`` seconds makes ``problem()`` say so; the async
engine's watchdog then declares the engine dead (engine/async_llm_engine.py). The loop's
first step may take ``FIRST_STEP_ALLOWANCE`` times as long: it can compile kernel variants
the warm-up did not meet (or all of them, when the warm-up was skipped).
"""

from __future__ import annotations

import threading
import time


class Heartbeat:
    FIRST_STEP_ALLOWANCE = 10     # the first step's timeout is this many step timeouts

    def __init__(self, step_timeout: float | None = None, stats_interval: float = 0.25) -> None:
        if step_timeout is not None and not (isinstance(step_timeout, (int, float))
                                             and not isinstance(step_timeout, bool) and step_timeout > 0):
            raise ValueError(f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}")
        self.step_timeout = step_timeout       # None: a step may take as long as it likes
        self.stats_interval = stats_interval   # the stats copy is at most this old while steps run
        self._lock = threading.Lock()
        self._step_started: float | None = None  # monotonic time the running step began; None between steps
        self._stats: dict | None = None
        self._stats_taken = 0.0
        self.steps = 0                         # steps finished

    def begin(self) -> None:
        with self._lock:
            self._step_started = time.monotonic()

    def end(self, take_stats, fresh: bool) -> None:
        """A step ended; copy the stats (``take_stats()``, a millisecond or two with long
        latency windows) if the copy is old, or ``fresh`` asks for it (the engine is idle).
        ``take_stats`` None: the step failed, and the engine's state is not worth copying."""
        now = time.monotonic()
        due = fresh or now - self._stats_taken >= self.stats_interval
        stats = take_stats() if take_stats is not None and due else None
        with self._lock:
            self._step_started = None
            self.steps += 1
            if stats is not None:
                self._stats, self._stats_taken = stats, now

    def set_stats(self, stats: dict) -> None:
        """The stats, taken while no step runs (before the loop starts)."""
        with self._lock:
            self._stats, self._stats_taken = stats, time.monotonic()

    @property
    def stats(self) -> dict | None:
        with self._lock:
            return self._stats

    def step_running_for(self) -> float | None:
        """Seconds the step now running has taken; None between steps."""
        with self._lock:
            started = self._step_started
        return None if started is None else time.monotonic() - started

    def problem(self) -> str | None:
        """Why the loop counts as hung (a step past the timeout), or None."""
        running = self.step_running_for()
        if self.step_timeout is None or running is None:
            return None
        limit = self.step_timeout * (1 if self.steps else self.FIRST_STEP_ALLOWANCE)
        if running <= limit:
            return None
        return (f"an engine step has run for {running:.1f} s, more than the step timeout of "
                f"{limit:g} s (serve --step-timeout{'' if self.steps else ', x' + str(self.FIRST_STEP_ALLOWANCE) + ' for the first step'}): "
                "a worker is hung or lost")
