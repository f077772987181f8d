#!/usr/bin/env bash
# Writes docs/results/scale.json, the figures docs/scale.md quotes: `llmvisor load --engines N` for N = 10, 100
# and 1,000 simulated engines (50 steps/s each, B=32, a POST of the steps that ended every 200 ms, as the engine
# pusher sends) into 2 service processes on one PostgreSQL (a throwaway server, as the tests start it), 40 s a
# run, the first 5 s not counted; then the per-step costs measured scaled to fleets of 1,000 and 10,000 replicas. Run it on a quiet machine:
# each run records the load average it saw.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ENGINES=${ENGINES:-"10 100 1000"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-40}
POSTGRES_URL="$(bash scripts/start-postgres.sh)"
trap 'bash scripts/start-postgres.sh --stop "$POSTGRES_URL"' EXIT
OUT=$(mktemp -d)
for n in $ENGINES; do
    "$PYTHON" -m llmvisor.cli load --engines "$n" --processes 2 --db "$POSTGRES_URL" --max-seconds "$SECONDS_PER_RUN" --json >"$OUT/$n.json"
done
runs=()
for n in $ENGINES; do runs+=("$OUT/$n.json"); done
"$PYTHON" scripts/summarise-fleet.py docs/results/scale.json "${runs[@]}"
cat docs/results/scale.json
