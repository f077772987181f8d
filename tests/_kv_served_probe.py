"""The recorder as shipped, checking its KV meter against the engine at every reading, for a served engine:
``--scheduler-cls _kv_served_probe.KvCheckingScheduler`` with this folder on the server's PYTHONPATH (the engine-core
process imports it, as it imports the recorder). Used by test_vllm_kv_served.

At each reading the recorder hands its meter, the pool is read the slow, exact way and compared
(`_kv_checks.check_reading`). Beside the meter, and from those exact readings only, it integrates over time the held
and idle blocks and each request's exact share (Fractions), up to each step the recorder closes (`KvMeter.drain`): per step its interval and held and idle
block-ns, and per request its exact block-ns, so the test can compare the trace's columns with what the engine held. It writes what it found as JSON to the file named
by ``LLMVISOR_TEST_KV_CHECKS`` after every reading (written aside, then renamed): vLLM's default shutdown kills the
engine-core process, so nothing is left for an exit hook."""

from __future__ import annotations

import json
import os
from collections import Counter
from fractions import Fraction

from _kv_checks import check_reading
from llmvisor.engines.vllm.recorder import RecordingScheduler

ENV_CHECKS_PATH = "LLMVISOR_TEST_KV_CHECKS"
MAX_KEPT_MISMATCHES = 20


class KvCheckingScheduler(RecordingScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._checks_path = os.environ[ENV_CHECKS_PATH]
        meter = self._kv_meter
        if meter is None:
            self._facts = {"error": "the recorder runs no KV meter (no trace path or service URL?)"}
            self._write()
            return
        self._start_ns = self._last_ns = meter.reading[0]
        self._held = self._idle = 0
        self._shares: dict[str, Fraction] = {}
        self._exact: dict[str, Fraction] = {}  # Σ share × time of each request, from the exact readings
        self._held_ns = self._idle_ns = 0
        self._drains_held: Counter[str] = Counter()  # per request, the steps that apportioned it block-ns (each rounds)
        self._preempted: set[str] = set()
        self._facts = {
            "readings": 0, "num_mismatches": 0, "mismatches": [], "shared_readings": 0, "idle_readings": 0,
            "max_held_blocks": 0, "preempted_requests": 0, "steps": 0, "wall_ns": 0, "step_interval_ns": [],
            "step_held_block_ns": [], "step_idle_block_ns": [], "exact_block_ns": {}, "drains_held": {}, "kv_errors": 0,
        }
        self._drained = (self._start_ns, 0, 0)  # (time, held block-ns, idle block-ns) at the previous step's close
        observe, drain = meter.observe, meter.drain

        def checked_observe(now_ns, holders, held, idle):
            self._check(now_ns, holders, held, idle)
            observe(now_ns, holders, held, idle)

        def checked_drain(requests):
            self._integrate(meter.reading[0])  # the recorder advanced the meter to the step's end just before
            self._drains_held.update(meter._exact)  # the requests this step's held block-ns are apportioned among
            out = drain(requests)
            facts, (then_ns, held_ns, idle_ns) = self._facts, self._drained
            facts["step_interval_ns"].append(self._last_ns - then_ns)
            facts["step_held_block_ns"].append(self._held_ns - held_ns)
            facts["step_idle_block_ns"].append(self._idle_ns - idle_ns)
            self._drained = (self._last_ns, self._held_ns, self._idle_ns)
            facts.update(steps=facts["steps"] + 1, wall_ns=self._last_ns - self._start_ns,
                         exact_block_ns={r: str(v) for r, v in self._exact.items()}, drains_held=dict(self._drains_held))
            self._write()
            return out

        meter.observe, meter.drain = checked_observe, checked_drain

    def _integrate(self, now_ns: int) -> None:
        """The pool as last read exactly, held from the previous reading up to ``now_ns``."""
        dt = now_ns - self._last_ns
        if dt > 0:
            self._held_ns += self._held * dt
            self._idle_ns += self._idle * dt
            for request, share in self._shares.items():
                self._exact[request] = self._exact.get(request, Fraction(0)) + share * dt
            self._last_ns = now_ns

    def _check(self, now_ns: int, holders, held: int, idle: int) -> None:
        self._integrate(now_ns)
        check = check_reading(self.kv_cache_manager, {r.request_id for r in self.running}, holders, held, idle,
                              self._kv_idle.count)
        facts = self._facts
        facts["readings"] += 1
        if check.mismatches:
            facts["num_mismatches"] += 1
            if len(facts["mismatches"]) < MAX_KEPT_MISMATCHES:
                facts["mismatches"].append({"reading": facts["readings"], "mismatches": check.mismatches})
        pool = check.pool
        if pool is not None:
            self._held, self._idle = pool.held_blocks, pool.idle_cached_blocks
            self._shares = dict(zip(pool.holders, pool.effective_blocks))
            facts["max_held_blocks"] = max(facts["max_held_blocks"], pool.held_blocks)
            facts["idle_readings"] += pool.idle_cached_blocks > 0
        facts["shared_readings"] += check.shared
        self._preempted.update(r.request_id for r in self.requests.values() if r.num_preemptions)
        facts["preempted_requests"] = len(self._preempted)
        facts["kv_errors"] = self._kv_errors
        self._write()

    def _write(self) -> None:
        aside = f"{self._checks_path}.part"
        with open(aside, "w", encoding="utf-8") as handle:
            json.dump(self._facts, handle)
        os.replace(aside, self._checks_path)
