#!/usr/bin/env bash
# Writes docs/results/scale.json, the figures docs/scale.md quotes: `llmvisor load --engines N --mode aggregate` for
# N = 10, 100 and 1,000 simulated engines (50 steps/s each, B = 32, request lengths from the Azure conversation mix,
# one window aggregate a second per engine, attributed at the edge, raw steps archived as Parquet) into 2 service
# processes on one PostgreSQL (a throwaway server, as the tests start it), 20 s a run, the first 5 s not counted;
# then `llmvisor audit` of some tenants over AUDIT_S seconds of the largest run (the ledger against the archive's
# re-attribution, to the nanosecond). The steps-mode runs (every step POSTed) are the comparison: with
# STEPS_MODE=keep (default) the ones already in docs/results/scale.json are kept as they were measured, with
# STEPS_MODE=rerun they are measured again (40 s a run). The aggregate runs are of the fleet configuration: the
# service keeps no row per request (LLMVISOR_REQUEST_TOTALS=0, a request's usage is in the archive); with
# COMPARE_REQUEST_TOTALS=N (default 1000, empty for none) one more run of N engines keeps them, for what they cost.
# Run it on a quiet machine, at normal priority: each run records the load average it saw.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ENGINES=${ENGINES:-"10 100 1000"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-20}
WINDOW_S=${WINDOW_S:-1}
STEPS_MODE=${STEPS_MODE:-keep}
AUDIT_TENANTS=${AUDIT_TENANTS:-"tenant-0 tenant-5 tenant-10 tenant-15"}
AUDIT_S=${AUDIT_S:-2}
COMPARE_REQUEST_TOTALS=${COMPARE_REQUEST_TOTALS-1000}
POSTGRES_URL="$(bash scripts/start-postgres.sh)"
# OUT_DIR: keep the runs' JSON, archives and audits there (default: a temporary directory, removed at the end)
OUT=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT"
trap 'bash scripts/start-postgres.sh --stop "$POSTGRES_URL"; [ -n "${OUT_DIR:-}" ] || rm -rf "$OUT"' EXIT
runs=()
largest=""
for n in $ENGINES; do
    "$PYTHON" -m llmvisor.cli load --engines "$n" --processes 2 --db "$POSTGRES_URL" --max-seconds "$SECONDS_PER_RUN" \
        --mode aggregate --window-s "$WINDOW_S" --archive "$OUT/archive-$n" --no-request-totals --json >"$OUT/aggregate-$n.json"
    runs+=("$OUT/aggregate-$n.json")
    largest=$n
done
# The audit: the first AUDIT_S whole seconds of the largest run (what a saturated service covered first), every
# tenant in AUDIT_TENANTS.
read -r audit_start audit_end < <("$PYTHON" -c 'import json, math, sys
period = json.load(open(sys.argv[1]))["runs"][0]["aggregate"]["period_s"]
start = math.floor(period[0])
print(start, start + int(sys.argv[2]))' "$OUT/aggregate-$largest.json" "$AUDIT_S")
audits=()
for tenant in $AUDIT_TENANTS; do
    # exit 1 is a mismatch, recorded in the result like a match; anything else stops the script
    "$PYTHON" -m llmvisor.cli audit --archive "$OUT/archive-$largest" --db "$POSTGRES_URL" --tenant "$tenant" \
        --start "$audit_start" --end "$audit_end" --json >"$OUT/audit-$tenant.json" || [ $? -eq 1 ]
    audits+=("$OUT/audit-$tenant.json")
done
compare=()
if [ -n "$COMPARE_REQUEST_TOTALS" ]; then
    n=$COMPARE_REQUEST_TOTALS
    "$PYTHON" -m llmvisor.cli load --engines "$n" --processes 2 --db "$POSTGRES_URL" --max-seconds "$SECONDS_PER_RUN" \
        --mode aggregate --window-s "$WINDOW_S" --archive "$OUT/archive-requests-$n" --request-totals --json >"$OUT/aggregate-requests-$n.json"
    compare+=("$OUT/aggregate-requests-$n.json")
fi
steps_runs=()
if [ "$STEPS_MODE" = rerun ]; then
    for n in $ENGINES; do
        "$PYTHON" -m llmvisor.cli load --engines "$n" --processes 2 --db "$POSTGRES_URL" --max-seconds 40 --json >"$OUT/steps-$n.json"
        steps_runs+=("$OUT/steps-$n.json")
    done
fi
"$PYTHON" scripts/summarise-fleet.py docs/results/scale.json --audit-engines "$largest" --audits "${audits[@]}" \
    --steps-runs "${steps_runs[@]}" --compare-runs "${compare[@]}" -- "${runs[@]}"
cat docs/results/scale.json
