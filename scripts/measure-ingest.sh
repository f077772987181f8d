#!/usr/bin/env bash
# Writes docs/results/load.json, the ingest rates the README and docs/service.md quote: `llmvisor load` into
# SQLite and into PostgreSQL (a throwaway server, as the tests start it), with Parquet and with JSON-column bodies,
# B=32, steps 20 ms apart, 1000 steps per POST, two connections. Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
POSTGRES_URL="$(bash scripts/start-postgres.sh)"
trap 'bash scripts/start-postgres.sh --stop "$POSTGRES_URL"' EXIT
OUT=$(mktemp -d)
for body in parquet columns; do
    "$PYTHON" -m llmvisor.cli load --db sqlite --db "$POSTGRES_URL" --body "$body" --json >"$OUT/$body.json"
done
"$PYTHON" - "$OUT" docs/results/load.json <<'PY'
import json, sys
from pathlib import Path

folder, output = Path(sys.argv[1]), Path(sys.argv[2])
runs = [json.loads((folder / f"{body}.json").read_text()) for body in ("parquet", "columns")]
settings = {k: v for k, v in runs[0]["settings"].items() if k != "body"}
targets = [
    {"database": t["database"], "body": run["settings"]["body"], **{k: t[k] for k in ("steps", "elapsed_s", "steps_per_s", "slices_per_s", "failed_posts", "reconciled")}}
    for run in runs
    for t in run["targets"]
]
output.write_text(json.dumps({"command": "bash scripts/measure-ingest.sh", "settings": settings, "targets": targets}, indent=2) + "\n")
PY
cat docs/results/load.json
