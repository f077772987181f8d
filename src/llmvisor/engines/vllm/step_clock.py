"""When each engine step starts and ends, seen only through the scheduler's calls (imports no vLLM).

The recorder sees two calls per step N: ``schedule()`` returning the step (S(N)) and ``update_from_output()``
entered with its output (U(N)). How these bracket the step's execution depends on how the engine runs:

- *Serial* (vLLM's ``step()``, or a batch queue whose executor runs the forward pass in the engine thread,
  as the CPU build's in-process ``uni`` executor does): nothing else runs between S(N) and the engine
  thread's next call into the scheduler, so step N runs from S(N) to that next call. Without a batch
  queue the next call is U(N); with one it is U(N-1) or S(N+1), because the engine schedules the next step
  before it hands the previous output back.
- *Overlapped* (async scheduling with an executor that runs the step elsewhere: a GPU stream or worker
  processes): step N is submitted at S(N) but executes after step N-1 on the device, and its output is
  ready when U(N) is entered. Step N then runs from ``max(S(N), U(N-1))`` to U(N): consecutive output
  arrivals while the engine stays busy, and from its own submission when the engine was idle before it
  (an idle gap, which is excluded). When the engine thread is still busy scheduling the next step as an
  output becomes ready, that output is seen late; the error moves time between neighbouring steps and
  leaves their sum unchanged.
"""

from __future__ import annotations


class StepClock:
    """Start and latency of every step, from `scheduler_called`, `scheduled` and `output_arrived` events."""

    def __init__(self, *, overlapped: bool) -> None:
        self.overlapped = overlapped
        self._scheduled_s: dict[int, float] = {}
        self._running: list[int] = []
        self._ended_s: dict[int, float] = {}
        self._last_output_s = float("-inf")

    def scheduler_called(self, now_s: float) -> None:
        """The engine thread entered the scheduler: in serial mode the steps it was executing are done."""
        if self._running:
            for key in self._running:
                self._ended_s[key] = now_s
            self._running.clear()

    def scheduled(self, key: int, now_s: float) -> None:
        """Step ``key`` was handed to the engine."""
        self._scheduled_s[key] = now_s
        if not self.overlapped:
            self._running.append(key)

    def output_arrived(self, key: int, now_s: float) -> tuple[float, float] | None:
        """Step ``key``'s output reached the scheduler: its (start, latency) in seconds, or None for a step
        that was not `scheduled` (an empty one)."""
        scheduled_s = self._scheduled_s.pop(key, None)
        previous_output_s = self._last_output_s
        self._last_output_s = now_s
        if scheduled_s is None:
            return None
        if self.overlapped:
            start_s = max(scheduled_s, previous_output_s)
            return start_s, now_s - start_s
        end_s = self._ended_s.pop(key, now_s)
        if key in self._running:
            self._running.remove(key)
        return scheduled_s, end_s - scheduled_s
