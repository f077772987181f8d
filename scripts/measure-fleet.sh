#!/usr/bin/env bash
# Writes docs/results/fleet.json, the figures docs/scale.md quotes: `llmvisor load --engines N` for N = 10, 100
# and 1,000 simulated engines (50 steps/s each, B=32, a POST of the steps that ended every 200 ms, as the engine
# pusher sends) into 2 service processes on one PostgreSQL (a throwaway server, as the tests start it), 20 s a
# run; then the per-step costs measured scaled to fleets of 1,000 and 10,000 replicas. Run it on a quiet machine:
# each run records the load average it saw.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ENGINES=${ENGINES:-"10 100 1000"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-20}
POSTGRES_URL="$(bash scripts/start-postgres.sh)"
trap 'bash scripts/start-postgres.sh --stop' EXIT
OUT=$(mktemp -d)
for n in $ENGINES; do
    "$PYTHON" -m llmvisor.cli load --engines "$n" --processes 2 --db "$POSTGRES_URL" --max-seconds "$SECONDS_PER_RUN" --json >"$OUT/$n.json"
done
"$PYTHON" - "$OUT" docs/results/fleet.json $ENGINES <<'PY'
import json, math, os, sys
from pathlib import Path

folder, output, engines = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
runs = [json.loads((folder / f"{n}.json").read_text())["runs"][0] for n in engines]
table_bytes = ("steps_bytes", "slice_batches_bytes", "usage_per_second_bytes")
# Costs per step: the service's at the pusher's own batch size (the smallest fleet, 10 steps a POST) and at the
# largest batches seen (the largest fleet, where POSTs waited and carried more); PostgreSQL's from the largest run.
small, large = runs[0], runs[-1]
per_step = {
    "service_cpu_s_small_batches": small["service_cpu_s_per_step"],
    "steps_per_post_small_batches": small["mean_steps_per_post"],
    "service_cpu_s_large_batches": large["service_cpu_s_per_step"],
    "steps_per_post_large_batches": large["mean_steps_per_post"],
    "postgres_cpu_s": large["postgres_per_step"]["cpu_s"],
    "wal_bytes": large["postgres_per_step"]["wal_bytes"],
    "table_bytes": sum(large["postgres_per_step"][name] for name in table_bytes),
}
extrapolation = {}
for replicas in (1000, 10000):
    steps_per_s = replicas * small["settings"]["steps_per_s_per_engine"]
    extrapolation[str(replicas)] = {
        "steps_per_s": steps_per_s,
        "service_cores_small_batches": steps_per_s * per_step["service_cpu_s_small_batches"],
        "service_cores_large_batches": steps_per_s * per_step["service_cpu_s_large_batches"],
        "postgres_cores": steps_per_s * per_step["postgres_cpu_s"],
        "wal_mb_per_s": steps_per_s * per_step["wal_bytes"] / 1e6,
        "storage_gb_per_day": steps_per_s * per_step["table_bytes"] * 86400 / 1e9,
    }
result = {
    "command": "bash scripts/measure-fleet.sh",
    "machine": {"cpus": os.cpu_count()},
    "runs": runs,
    "per_step": per_step,
    "extrapolation": extrapolation,
}
output.write_text(json.dumps(result, indent=2) + "\n")
PY
cat docs/results/fleet.json
