"""Lost steps made visible: which runs miss step ids, as a Prometheus gauge, and an error line once a gap has
outlived the window in which the engine's spool would have filled it.

A run instance numbers its steps 0, 1, 2, ... (the recorder does), and the ledger keeps the ids it received as
ranges (`Ledger.run_gaps`). A gap fills by itself when spooled steps are replayed; one still open
``alert_after_s`` after a later step arrived is taken as lost, and logged once at ERROR with its ids. The
ledger is read at each batch for its runs and every ``check_interval_s`` for all runs, so every service process
sharing a database exports the same counts, and a run that stopped sending is checked too.

A run's lost tail (steps after the last one stored that never arrived) counts once its end-of-run record is stored
(``POST /v1/runs/{run_id}/end``, sent by the recorder's delivery process when the engine stops): the ids up to the record's last
step are missing, as old as the record. A run without one is open, and its tail is not counted.

Bounded cardinality, like the tenant labels: the ``max_runs`` runs with the most recent gaps are named; the
steps missing in other runs are summed under ``run="other"`` per engine class.

``llmvisor_steps_missing`` is the gauge; ``llmvisor_steps_missing_total`` (a gauge with a counter's suffix) is the
same value under its old name, kept one release for dashboards and alerts that read it, deprecated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmvisor.ledger import Ledger, RunGaps

log = logging.getLogger("llmvisor.service")

DEFAULT_GAP_ALERT_AFTER_S = 600.0
DEFAULT_GAP_CHECK_INTERVAL_S = 30.0
MAX_RUNS_WITH_GAPS = 100
MAX_RUNS_READ = 10_000
MAX_ALERTS_REMEMBERED = 100_000
OTHER_RUN_LABEL = "other"
MISSING_STEPS_METRIC = "llmvisor_steps_missing"
DEPRECATED_MISSING_STEPS_METRIC = "llmvisor_steps_missing_total"
"""The gauge's old name (a counter's suffix on a gauge): the same samples, exported for one release, deprecated."""


class GapMonitor(Collector):
    """``llmvisor_steps_missing{run,engine_class}`` (and its deprecated old name ``llmvisor_steps_missing_total``) and
    ``llmvisor_runs_missing_steps`` from the ledger's ranges and end-of-run records, and the ERROR line for a gap
    older than ``alert_after_s``."""

    def __init__(self, ledger: Ledger, *, alert_after_s: float = DEFAULT_GAP_ALERT_AFTER_S, max_runs: int = MAX_RUNS_WITH_GAPS):
        self.ledger = ledger
        self.alert_after_s = alert_after_s
        self.max_runs = max_runs
        self._missing: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._alerted: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self.alerts_logged = 0

    def observe_runs(self, run_ids: Iterable[str]) -> None:
        """Re-read the gaps of the runs a batch just stored steps of (a gap may have opened or filled)."""
        for run_id in dict.fromkeys(run_ids):
            gaps = self.ledger.run_gaps(run_id)
            if gaps is not None:
                self._update(gaps)

    def refresh(self) -> None:
        """Re-read every run with gaps (the periodic check); runs whose gaps filled drop to 0."""
        gapped = self.ledger.runs_with_gaps(limit=MAX_RUNS_READ)
        names = {gaps.run_id for gaps in gapped}
        with self._lock:
            for run_id, (engine_class, missing) in list(self._missing.items()):
                if run_id not in names and missing:
                    self._missing[run_id] = (engine_class, 0)
        for gaps in reversed(gapped):  # oldest first, so the most recent end up last (kept longest)
            self._update(gaps)

    def _update(self, gaps: RunGaps) -> None:
        now_us = time.time_ns() // 1000
        overdue = [g for g in gaps.gaps if now_us - g.since_us >= self.alert_after_s * 1e6]
        with self._lock:
            before = self._missing.pop(gaps.run_id, (gaps.engine_class, 0))[1]
            if gaps.num_missing or before:
                self._missing[gaps.run_id] = (gaps.engine_class, gaps.num_missing)
            while len(self._missing) > MAX_RUNS_READ:
                self._missing.popitem(last=False)
            fresh = []
            for gap in overdue:
                key = (gaps.run_id, gap.first_step_id, gap.last_step_id)
                if key not in self._alerted:
                    self._alerted[key] = None
                    fresh.append(gap)
            while len(self._alerted) > MAX_ALERTS_REMEMBERED:
                self._alerted.popitem(last=False)
        for gap in fresh:
            self.alerts_logged += 1
            log.error(
                "llmvisor: run %s (engine class %s) is missing steps %d..%d (%d steps) for %.0f s, longer than the "
                "spool's retry window (%g s): they are taken as lost and are not billed",
                gaps.run_id, gaps.engine_class or "''", gap.first_step_id, gap.last_step_id, gap.num_steps,
                (now_us - gap.since_us) / 1e6, self.alert_after_s,
            )

    def collect(self):
        about = (
            "Step ids a run never delivered below its highest id received (gaps in its numbering, from 0) and, once its "
            "end-of-run record is stored, up to the last step it recorded (a lost tail); falls as spooled steps are "
            f'replayed. The {self.max_runs} runs with the latest gaps are named, the rest summed under run="{OTHER_RUN_LABEL}".'
        )
        missing = GaugeMetricFamily(MISSING_STEPS_METRIC, about, labels=["run", "engine_class"])
        deprecated = GaugeMetricFamily(
            DEPRECATED_MISSING_STEPS_METRIC, f"Deprecated: the same as {MISSING_STEPS_METRIC} (its old name, kept one release). {about}",
            labels=["run", "engine_class"],
        )
        runs = GaugeMetricFamily("llmvisor_runs_missing_steps", "Runs with at least one gap in their step ids (all runs, not capped).")
        with self._lock:
            items = list(self._missing.items())
            runs.add_metric([], float(sum(1 for _c, count in self._missing.values() if count)))
        named = items[-self.max_runs :]
        others: dict[str, int] = {}
        for _run, (engine_class, count) in items[: max(len(items) - self.max_runs, 0)]:
            others[engine_class] = others.get(engine_class, 0) + count
        for family in (missing, deprecated):
            for run_id, (engine_class, count) in named:
                family.add_metric([run_id, engine_class], float(count))
            for engine_class, count in others.items():
                family.add_metric([OTHER_RUN_LABEL, engine_class], float(count))
        yield missing
        yield deprecated
        yield runs
