"""Gzip'd ingest bodies (``Content-Encoding: gzip``): the service stores what it stores for the same JSON sent plain
(rows, content digests, idempotency), refuses a corrupt stream (400), one that decodes past the body limit (413,
without inflating it whole) and an encoding it does not take (415), storing nothing; the pushers send gzip and fall
back to plain JSON against a served service that refuses gzip or does not know it."""

from __future__ import annotations

import gzip
import json
import resource
import threading
import time
import zlib
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from _service_fixtures import T0_S, bearer, class_model, db_url, make_steps, measured_ns, model_path  # noqa: F401
from llmvisor.client import StepPusher, WindowPusher
from llmvisor.client.push import gzip_body, gzip_from_env
from llmvisor.core.model import StepLatencyModel
from llmvisor.ledger import Ledger
from llmvisor.metering import WindowAggregator
from llmvisor.net import free_loopback_port
from llmvisor.service.app import create_app

CLASS_W = "cccccccccccccccc"
GZIP = {"Content-Encoding": "gzip", "Content-Type": "application/json"}


def admin_key(db: str) -> str:
    ledger = Ledger(db)
    try:
        return ledger.create_key(is_admin=True)
    finally:
        ledger.close()


def steps_of(run_id: str, n_steps: int = 60, seed: int = 3) -> list[list[dict]]:
    groups = make_steps(run_id, n_steps, step_interval_s=0.27, seed=seed)
    for group in groups:
        for row in group:
            row["engine_fingerprint"] = CLASS_W
    return groups


def windows_of(model: StepLatencyModel, version: int, run_id: str, groups: list[list[dict]]) -> list:
    """The steps as the delivery process aggregates them into 1 s windows."""
    aggregator = WindowAggregator(run_id, CLASS_W, lambda: (model, version), window_s=1.0)
    out = []
    for g in groups:
        slices = [[r["request_id"], r["tenant"], r["num_new_tokens"], r["num_context_tokens"], r["phase"] == "prefill", 0, None] for r in g]
        out += aggregator.add(g[0]["step_id"], g[0]["timestamp_s"], g[0]["step_latency_s"], slices)
    return out + aggregator.close()


def register_model(client, key: str) -> tuple[StepLatencyModel, int]:
    added = client.post("/v1/models", headers=bearer(key),
                        json={"model": class_model(CLASS_W).to_dict(), "engine_class": CLASS_W, "activate": True})
    assert added.status_code == 201, added.text
    active = client.get(f"/v1/models/{CLASS_W}/active", headers=bearer(key)).json()
    return StepLatencyModel.from_dict(active["model"]), active["version"]


def ledger_view(client, key: str) -> dict:
    """What the ledger holds, as the service answers it: usage per tenant and request, totals, held ranges, and each
    stored step's content digest."""
    h = bearer(key)
    view = {"tenants": client.get("/v1/usage/tenants", headers=h).json(), "totals": client.get("/v1/usage/totals", headers=h).json()}
    for run in ("run-s", "run-w"):
        view[run] = client.get("/v1/usage/requests", headers=h, params={"run_id": run}).json()
        view[f"held-{run}"] = client.get("/v1/windows/held", headers=h, params={"run_id": run}).json()
    view["digests"] = [client.get(f"/v1/steps/run-s/{i}", headers=h).json()["content_sha256"] for i in range(60)]
    return view


def test_gzip_bodies_store_what_the_same_json_sent_plain_stores(model_path, db_url, tmp_path):
    """Steps and windows sent gzip'd to one ledger and plain to another: the same rows; sent plain again to the
    gzip one, every step and window is a duplicate (the content digests are the JSON's)."""
    steps_body = json.dumps({"steps": steps_of("run-s")}).encode()
    views = {}
    plain_db = f"sqlite:///{tmp_path}/plain.db"
    for name, db, headers, encode in (("plain", plain_db, {"Content-Type": "application/json"}, lambda b: b),
                                      ("gzip", db_url, GZIP, gzip_body)):
        key = admin_key(db)
        with TestClient(create_app(model_path, db)) as client:
            model, version = register_model(client, key)
            windows_body = json.dumps({"windows": [w.to_json() for w in windows_of(model, version, "run-w", steps_of("run-w"))]}).encode()
            for path, body in (("/v1/steps", steps_body), ("/v1/windows", windows_body)):
                answer = client.post(path, content=encode(body), headers={**bearer(key), **headers})
                assert answer.status_code == 200, answer.text
            views[name] = ledger_view(client, key)
            if name == "gzip":
                again = client.post("/v1/steps", content=steps_body, headers=bearer(key)).json()
                assert (again["steps_inserted"], again["steps_duplicate"]) == (0, 60)
                again = client.post("/v1/windows", content=windows_body, headers=bearer(key)).json()
                assert again["windows_inserted"] == 0 and again["windows_duplicate"] == again["windows_received"] > 0
                assert ledger_view(client, key) == views["gzip"]
    assert views["gzip"] == views["plain"]
    assert views["plain"]["totals"]["num_steps"] == 120 and views["plain"]["run-w"]["requests"]


def ingest_errors(client, key: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics", headers=bearer(key)).text):
        for sample in family.samples:
            if sample.name == "llmvisor_ingest_errors_total":
                out[sample.labels["reason"]] = sample.value
    return out


def gzip_of_zeros(n_bytes: int) -> bytes:
    """A gzip stream of ``n_bytes`` zero bytes, built without holding them."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [deflate.compress(chunk) for _ in range(n_bytes >> 20)]
    return b"".join([*parts, deflate.flush()])


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_bad_gzip_body_is_a_400_naming_why_a_bomb_a_413_another_encoding_a_415_and_nothing_is_stored(model_path, db_url):
    key = admin_key(db_url)
    limit = 1 << 20
    with TestClient(create_app(model_path, db_url, max_body_bytes=limit)) as client:
        model, version = register_model(client, key)
        steps_body = json.dumps({"steps": steps_of("run-s")}).encode()
        windows_body = json.dumps({"windows": [w.to_json() for w in windows_of(model, version, "run-w", steps_of("run-w"))]}).encode()
        h = {**bearer(key), **GZIP}
        for path, body in (("/v1/steps", steps_body), ("/v1/windows", windows_body)):
            corrupt = client.post(path, content=b"\x1f\x8b" + body[:200], headers=h)
            assert corrupt.status_code == 400, corrupt.text
            assert corrupt.json()["detail"].startswith("request body (Content-Encoding: gzip): not a valid gzip stream (Error -3")
            not_gzip = client.post(path, content=body, headers=h)
            assert not_gzip.status_code == 400 and "incorrect header check" in not_gzip.json()["detail"]
            truncated = client.post(path, content=gzip_body(body)[:-12], headers=h)
            assert truncated.status_code == 400, truncated.text
            assert truncated.json()["detail"] == "request body (Content-Encoding: gzip): the gzip stream is truncated (the body ends before its end)"
            # valid JSON padded past the limit: small on the wire, over it decoded
            padded = client.post(path, content=gzip_body(body + b" " * limit), headers=h)
            assert padded.status_code == 413 and padded.json()["detail"] == f"request body that decodes to more than {limit} bytes; at most {limit}"
            other = client.post(path, content=body, headers={**bearer(key), "Content-Encoding": "br"})
            assert other.status_code == 415 and other.headers["accept-encoding"] == "gzip, identity"
            assert other.json()["detail"] == "Content-Encoding 'br' is not accepted here; send gzip, identity"
        # any route: a key created from a gzip'd body; the small routes' limit bounds it decoded
        created = client.post("/v1/keys", content=gzip_body(b'{"tenant": "acme"}'), headers=h)
        assert created.status_code == 201 and created.json()["tenant"] == "acme"
        small = client.post("/v1/keys", content=gzip_body(b'{"tenant": "acme"}' + b" " * (64 << 10)), headers=h)
        assert small.status_code == 413 and small.json()["detail"].startswith("request body that decodes to more than 65536 bytes")
        # a bomb: 256 MiB of zeros in a quarter of a megabyte is refused at the limit, never inflated whole
        bomb = gzip_of_zeros(256 << 20)
        before = peak_rss_bytes()
        answer = client.post("/v1/windows", content=bomb, headers=h)
        assert answer.status_code == 413 and peak_rss_bytes() - before < 64 << 20
        totals = client.get("/v1/usage/totals", headers=bearer(key)).json()
        assert totals["num_steps"] == 0 and client.get("/v1/usage/tenants", headers=bearer(key)).json()["tenants"] == []
        errors = ingest_errors(client, key)
    assert (errors["bad_gzip"], errors["too_large"], errors["bad_encoding"]) == (6, 3, 2)


# ---------------------------------------------------------------------------------------------------------
# The pushers against a served service


class SeenEncodings:
    """In front of a served app: records each POST's Content-Encoding; ``forget_encoding`` drops the header before
    the app sees it, as a service older than gzip bodies never read it (it then reads the gzip bytes as JSON)."""

    def __init__(self, app, *, forget_encoding: bool = False):
        self.app, self.forget_encoding = app, forget_encoding
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            self.seen.append((scope["path"], headers.get(b"content-encoding", b"identity").decode()))
            if self.forget_encoding:
                scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-encoding"])
        await self.app(scope, receive, send)


@contextmanager
def served(app):
    port = free_loopback_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


FAST = dict(max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.05, retry_interval_s=0.2, flush_interval_s=0.02, request_timeout_s=10.0)


@pytest.mark.parametrize("service", ["gzip", "refuses_gzip", "older"])
def test_the_pushers_send_gzip_and_fall_back_to_plain_json_where_the_service_cannot_read_it(model_path, tmp_path, service):
    """``refuses_gzip``: a service started with ``gzip_bodies=False`` (415); ``older``: a served app that never sees
    the Content-Encoding header (a 422 / 400 on the gzip bytes, the same body plain taken)."""
    db = f"sqlite:///{tmp_path}/ledger.db"
    key = admin_key(db)
    app = SeenEncodings(create_app(model_path, db, gzip_bodies=service != "refuses_gzip"), forget_encoding=service == "older")
    with served(app) as url:
        with httpx.Client(base_url=url) as client:
            model, version = register_model(client, key)
        steps, window_steps = steps_of("run-s"), steps_of("run-w", seed=4)
        windows = windows_of(model, version, "run-w", window_steps)
        step_pusher = StepPusher(url, key, tmp_path / "spool.jsonl", **FAST)
        window_pusher = WindowPusher(url, key, tmp_path / "spool.jsonl", **FAST)
        for k, group in enumerate(steps):
            step_pusher.push_step(group)
            if k % 20 == 19:  # several POSTs: after a fallback, the later ones go plain at once
                assert step_pusher.flush(timeout_s=30)
        for window in windows:
            window_pusher.push(window)
            time.sleep(0.05)
        assert step_pusher.close(timeout_s=30) and window_pusher.close(timeout_s=30)
    for pusher, n in ((step_pusher, len(steps)), (window_pusher, len(windows))):
        assert (pusher.stats.acknowledged, pusher.stats.rejected, pusher.stats.spooled) == (n, 0, 0)
        assert pusher.gzip_posts.enabled is (service == "gzip")
    ledger = Ledger(db)
    try:
        totals = ledger.totals()
    finally:
        ledger.close()
    assert totals.num_steps == len(steps) + len(window_steps)
    assert totals.measured_ns == measured_ns(steps) + measured_ns(window_steps)
    for path in ("/v1/steps", "/v1/windows"):
        sent = [encoding for p, encoding in app.seen if p == path]
        assert len(sent) >= 3
        if service == "gzip":
            assert set(sent) == {"gzip"}
        else:  # the first body gzip'd, then the same plain, and every later one plain
            assert sent[0] == "gzip" and set(sent[1:]) == {"identity"}


def test_compression_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMVISOR_PUSH_GZIP", raising=False)
    assert gzip_from_env() is True
    monkeypatch.setenv("LLMVISOR_PUSH_GZIP", "0")
    assert gzip_from_env() is False
    monkeypatch.setenv("LLMVISOR_SERVICE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LLMVISOR_SERVICE_KEY", "lvk_x_y")
    monkeypatch.setenv("LLMVISOR_SPOOL", str(tmp_path / "spool.jsonl"))
    for pusher in (StepPusher.from_env(), WindowPusher.from_env()):
        assert pusher.gzip_posts.enabled is False
        pusher.close(0.1)
    monkeypatch.setenv("LLMVISOR_PUSH_GZIP", "maybe")
    with pytest.raises(ValueError, match="LLMVISOR_PUSH_GZIP='maybe'"):
        gzip_from_env()
    assert gzip.decompress(gzip_body(b'{"steps": []}')) == b'{"steps": []}'
