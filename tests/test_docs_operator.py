"""The documented operator commands run as written: the ```bash operator``` blocks of a doc, in order, in one
shell, in an empty folder. docs/recorder.md: service, keys, vLLM's OpenAI server with the recorder pushing, a
completion stored pending (no model of the engine yet), the engine's /metrics counting the steps acknowledged, traffic, calibration, the calibrated model activated,
the tenant's usage billed with it, a price and the period's FOCUS bill. docs/service.md: fit, keys,
serve, both JSON ingest forms, every usage query.

The docs say ports 8080 (the service) and 8000 (vLLM), as a user types them; the tests run them on free ports
(another service or vLLM may hold 8080 and 8000 on the machine), and after each readiness loop (`until curl ...;
do kill -0 $PID; ...; done`) check that the port answering is held by that PID's own process tree, so a foreign
server on the port cannot pass for the documented one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _billing_checks import check_exports_tie_to_the_ledger, read_csv
from _processes import START_TIMEOUT_S, run_process, running
from _tiny_llama import SUITE_VLLM_ENV, write_suite_engine
from llmvisor.billing import list_prices
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.trace import read_trace
from llmvisor.ledger import Ledger
from llmvisor.net import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_DOC = ROOT / "docs" / "recorder.md"
SERVICE_DOC = ROOT / "docs" / "service.md"
FAIRNESS_DOC = ROOT / "docs" / "fairness.md"
BLOCK = re.compile(r"^```bash operator\n(.*?)^```", re.S | re.M)
DOC_PORTS = (8000, 8080)  # vLLM's OpenAI server, the accounting service
READINESS = re.compile(r"^until curl -sf \S*?(?:localhost|127\.0\.0\.1):(\d+)/\S* > /dev/null; do kill -0 \$(\w+);.*done$", re.M)
# After a readiness loop: the port's listener is the waited-for process or one of its children.
FOREIGN = """\
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Ok(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok)
print("listening", flush=True)
server.serve_forever()
"""
OWNS_PORT = """\
import sys, psutil
port, pid = int(sys.argv[1]), int(sys.argv[2])
ours = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
holders = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
if not holders & ours:
    sys.exit(f"port {port} answers, but it is held by {sorted(holders) or 'another user'}, not by {pid}")
"""


def operator_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def operator_script(text: str, ports: dict[int, int] | None = None) -> str:
    """The blocks as one bash script that stops its background servers however it ends; with ``ports``, each
    documented port replaced by the one given and each readiness loop followed by the check that the port is the
    waited-for process's."""
    script = "\n".join(["set -euo pipefail", "trap 'kill $(jobs -p) 2> /dev/null || true' EXIT", *operator_blocks(text)])
    if ports:
        script = re.sub(r"\b(" + "|".join(map(str, ports)) + r")\b", lambda m: str(ports[int(m.group())]), script)
        script = READINESS.sub(lambda m: f"{m.group()}\nowns-port {m.group(1)} ${m.group(2)}", script)
    return script


def test_every_readiness_loop_fails_when_its_server_dies_and_is_checked():
    """Each doc's readiness loops name the process they wait for (`kill -0 $PID`), so the test can check the port
    is that process's; a loop without it would pass on any server holding the port."""
    for doc in (OPERATOR_DOC, SERVICE_DOC, FAIRNESS_DOC):
        script = operator_script(doc.read_text(encoding="utf-8"), ports={8000: 18000, 8080: 18080})
        loops = re.findall(r"^until curl.*$", script, re.M)
        assert loops and len(loops) == len(READINESS.findall(script)), (doc.name, loops)
        assert script.count("\nowns-port ") == len(loops), doc.name
        assert not re.search(r"\b(8000|8080)\b", script), doc.name
    substituted = operator_script("```bash operator\nserve --port 8080 &\nP=$!\n"
                                  "until curl -sf http://127.0.0.1:8080/healthz > /dev/null; do kill -0 $P; sleep 0.2; done\n```\n", {8080: 4321})
    assert substituted.endswith("serve --port 4321 &\nP=$!\nuntil curl -sf http://127.0.0.1:4321/healthz > /dev/null; do kill -0 $P; sleep 0.2; done\n"
                                "owns-port 4321 $P\n")


def test_the_operator_blocks_are_the_whole_journey():
    blocks = operator_blocks(OPERATOR_DOC.read_text(encoding="utf-8"))
    joined = "\n".join(blocks)
    for step in ("llmvisor keys create --admin", "llmvisor serve", "--scheduler-cls llmvisor.engines.vllm.recorder.RecordingScheduler",
                 '"vllm_xargs": {"tenant": "team-a"}', "/v1/usage/tenants", "llmvisor calibrate", "llmvisor prices add",
                 "llmvisor export --format focus"):
        assert step in joined, step
    assert "--load-format dummy --skip-tokenizer-init" in joined
    assert not re.search(r"127\.0\.0\.1:8000|LLMVISOR_SERVICE_URL=\S*:8000|serve .*--port 8000", joined)
    assert len(blocks) >= 5
    assert operator_script("```bash operator\necho a\n```\ntext\n```bash\necho b\n```\n").endswith("echo a\n")


def vllm_cache_root() -> str:
    """The vLLM cache the suite's own engines use (VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm, else ~/.cache/vllm).
    The doc's HOME is an empty folder; without this each documented server would compile its model afresh, where an
    operator's second start loads the graph vLLM compiled and saved the first time."""
    return os.environ.get("VLLM_CACHE_ROOT") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm")


def doc_env(tmp_path: Path) -> dict:
    """A bare environment with `llmvisor`, `owns-port` and this Python on the PATH."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "llmvisor").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m llmvisor.cli "$@"\n')
    (shims / "llmvisor").chmod(0o755)
    (shims / "owns-port.py").write_text(OWNS_PORT)
    (shims / "owns-port").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{shims / "owns-port.py"}" "$@"\n')
    (shims / "owns-port").chmod(0o755)
    env = {"PATH": f"{shims}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "HOME": str(tmp_path)}
    if os.environ.get("LLMVISOR_STORE_STEPS"):  # the journeys run in either delivery mode (docs/recorder.md)
        env["LLMVISOR_STORE_STEPS"] = os.environ["LLMVISOR_STORE_STEPS"]
    return env


def test_a_foreign_server_on_the_port_fails_the_readiness_check(tmp_path):
    """A server this test holds the port with answers the documented loop; the check after it refuses it."""
    port = free_loopback_port()
    env = doc_env(tmp_path)
    doc = ("```bash operator\nsleep 300 &\nP=$!\n"
           "until curl -sf http://127.0.0.1:8080/healthz > /dev/null; do kill -0 $P; sleep 0.2; done\necho ready\n```\n")
    with running([sys.executable, "-c", FOREIGN, str(port)], stdout=subprocess.PIPE) as foreign:
        assert foreign.stdout.readline().strip() == b"listening"
        done = run_process(["bash", "-c", operator_script(doc, {8080: port})], cwd=tmp_path, env=env, timeout_s=120)
        assert done.returncode != 0 and "ready" not in done.stdout
        assert f"port {port} answers, but it is held by [{foreign.pid}]" in done.stderr, done.stderr
        unchecked = run_process(["bash", "-c", operator_script(doc, {8080: port}).replace("\nowns-port", "\n# owns-port")], cwd=tmp_path,
                                env=env, timeout_s=120)
        assert unchecked.returncode == 0 and "ready" in unchecked.stdout  # what the loop alone would have accepted


def run_doc(doc: Path, tmp_path: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, Path]:
    """Run a doc's operator blocks in an empty folder, with `llmvisor` and this Python on the PATH, on free ports;
    the script's process group is stopped when it ends or times out."""
    env = {**doc_env(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": vllm_cache_root(), **SUITE_VLLM_ENV,
           "ENGINE_MODEL": str(write_suite_engine(tmp_path / "suite-engine"))}  # the docs' override (see _tiny_llama)
    work = tmp_path / "work"
    work.mkdir()
    script = operator_script(doc.read_text(encoding="utf-8"), ports={port: free_loopback_port() for port in DOC_PORTS})
    done = run_process(["bash", "-c", script], cwd=work, env=env, timeout_s=timeout_s)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in work.glob("*.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    return done, work


def test_the_documented_service_commands_run(tmp_path):
    done, work = run_doc(SERVICE_DOC, tmp_path, timeout_s=600)
    acknowledged = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"steps_received"')]
    uploaded = read_trace(work / "run.parquet")
    assert [(a["steps_inserted"], a["slices_inserted"]) for a in acknowledged] == [(1, 2), (1, 2), (uploaded.n_steps, uploaded.n_slices)]
    totals = json.loads(re.search(r'\{"start":null,"end":null,"num_steps".*?\}', done.stdout).group())
    uploaded_ns = int(acknowledged[2]["attributed_ns"])
    assert abs(uploaded_ns - uploaded.step_latency_s_per_step.sum() * 1e9) <= uploaded.n_steps  # each step rounded to 1 ns
    assert totals["num_steps"] == 2 + uploaded.n_steps
    assert totals["attributed_ns"] == totals["measured_ns"] == 31_000_000 + 12_000_000 + uploaded_ns


@pytest.mark.vllm
@pytest.mark.measures  # its `llmvisor calibrate` profiles the served engine
@pytest.mark.slow  # the whole journey: a served engine, traffic, then a profile for the calibration (about 4 minutes)
def test_the_documented_operator_commands_run(tmp_path):
    done, work = run_doc(OPERATOR_DOC, tmp_path, timeout_s=START_TIMEOUT_S + 900)
    held = json.loads(next(line for line in done.stdout.splitlines() if '"pending_steps"' in line))
    assert held["num_steps"] == 0 and held["attributed_ns"] == 0 and held["pending_steps"] > 0  # no model of this engine yet
    # the delivery process's counters reach vLLM's /metrics (PROMETHEUS_MULTIPROC_DIR, set by the wrapper)
    acknowledged = re.search(r"^llmvisor_pusher_steps_acknowledged_total (\S+)$", done.stdout, re.M)
    assert acknowledged and float(acknowledged.group(1)) == held["pending_steps"], done.stdout[-2000:]
    assert re.search(r"v1 active; \d+ pending steps attributed", done.stdout)
    usage = json.loads(next(line for line in done.stdout.splitlines() if '"tenants"' in line))
    assert [t["tenant"] for t in usage["tenants"]] == ["team-a"] and usage["tenants"][0]["attributed_ns"] > 0
    assert usage["tenants"][0]["num_new_tokens"] == 6 + 15  # the prompt, then one token per decode step
    served = read_trace(work / "served.jsonl")
    assert (work / "served.jsonl.engine.json").exists()
    served_id = json.loads((work / "served.jsonl.engine.json").read_text())["id"]
    assert served.engine_fingerprint_ids() == [served_id]
    assert set(served.tenant) == {"team-a", "team-0", "team-1", "team-2"}
    calibration = json.loads((work / "calibration.json").read_text())
    assert calibration["fingerprint_matches"] is True
    profiles = calibration["profiles"]  # one, or more when drift left too few steps (each a trace beside the first)
    assert 1 <= len(profiles) <= 3 and all((work / Path(p["trace"]).name).exists() for p in profiles)
    assert len(calibration["level_drift"]["drifted"]) == len(profiles)
    assert calibration["fit"]["n_steps_total"] == sum(p["n_steps"] for p in profiles)
    assert StepLatencyModel.from_json(work / "calibrated.json").engine_fingerprint_["id"] == served_id
    figures = calibration["evaluation"]["models"]
    assert figures["calibrated"]["n_steps"] == figures["baseline"]["n_steps"] > 100
    # the bill: the documented FOCUS file is the one every contract check passes on this served ledger (cost =
    # ledger × price to the cent, tokens, ids, the metering formats, focus-validator), and vLLM's prefix cache found
    # some of the traffic's shared first prompt tokens, billed at the cached price
    db_url = f"sqlite:///{work / 'ledger.db'}"
    ledger = Ledger(db_url)
    try:
        [price] = [p for p in list_prices(ledger) if p.engine_class == served_id]
        split = {r.tenant: r for r in ledger.tenant_usage()}
    finally:
        ledger.close()
    period_s = (price.valid_from_us // 1_000_000, price.valid_from_us // 1_000_000 + 3 * 3600)
    checks = tmp_path / "bill-checks"
    checks.mkdir()
    # the documented bill is the period's FOCUS export, checked as it is (the check also finds a second one refused)
    summary = check_exports_tie_to_the_ledger(db_url, period_s, checks, focus_file=work / "bill.csv")
    assert set(summary["tenants"]) == {"team-a", "team-0", "team-1", "team-2"}
    bill = read_csv(work / "bill.csv")
    assert sum(r.num_cached_prompt_tokens for r in split.values()) > 0
    assert any(r["SkuId"].startswith("cached-prompt-token/") for r in bill)
    if not summary["focus_validated"]:
        pytest.skip("no FOCUS validator at .venv-focus/bin/focus-validator (scripts/install-test.sh creates it); every other check passed")


@pytest.mark.vllm
def test_the_documented_fair_scheduler_commands_run(tmp_path):
    """docs/fairness.md: the OpenAI server with FairScheduler reading the documented fair.toml and pushing every step
    to the accounting service; two tenants served, both billed, and the server stops within its bound."""
    done, work = run_doc(FAIRNESS_DOC, tmp_path, timeout_s=START_TIMEOUT_S + 300)
    assert re.search(r"llmvisor: fair scheduler: cost attributed, tenant key 'tenant', weights \{'team-a': 2\.0\}, 0 quotas, tpot_slo_s 0\.2", done.stdout)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"id"')]
    assert [answer["usage"]["completion_tokens"] for answer in answers] == [8, 8]
    usage = json.loads(next(line for line in done.stdout.splitlines() if '"tenants"' in line))
    billed = {t["tenant"]: t for t in usage["tenants"]}
    assert set(billed) == {"team-a", "team-b"}, usage
    for tenant in billed.values():  # the prompt, then one token per decode step
        assert tenant["attributed_ns"] > 0 and tenant["num_new_tokens"] == 4 + 7
    assert "its steps are billed with the fallback model" in (work / "service.log").read_text(encoding="utf-8")
