"""``billing/push.py`` against a real HTTP receiver on a loopback port that behaves as Stripe and Lago do: it rate
limits with 429 and Retry-After, fails with 5xx, refuses a bad event with 400 and a body, and deduplicates by id."""

from __future__ import annotations

import email.utils
import http.server
import json
import subprocess
import sys
import threading
import time
from urllib.parse import parse_qs

import pytest

from _billing_checks import run_cli
from _cli import invoke_cli
from _service_fixtures import db_url, model_path  # noqa: F401
from llmvisor.billing import charges
from llmvisor.billing.formats import stripe_events
from llmvisor.billing.push import BODY_QUOTE_CHARS, PushError, push
from llmvisor.ledger import Ledger
from llmvisor.retry import retry_after_s
from test_billing import PERIOD, served  # noqa: F401


class _Receiver(http.server.BaseHTTPRequestHandler):
    """Answers the server's script first ((status, headers, body) tuples, headers a dict or a function giving one as
    the answer leaves, or "drop" to close without an answer), then 200; refuses an event whose id contains "bad" with
    400; after ``fail_after`` acknowledged events answers 503 with Retry-After 0; with ``hold_at`` set, holds that
    request until ``release`` is set. Keeps every id it took once (``taken``) and the re-sent ones it dropped
    (``dropped``)."""

    def do_POST(self):  # noqa: N802
        server = self.server
        raw = self.rfile.read(int(self.headers["content-length"]))
        with server.lock:
            server.arrivals.append(time.monotonic())
            ids = _event_ids(raw, self.headers["content-type"])
            action = server.script.pop(0) if server.script else None
            number = len(server.arrivals)
        if action == "drop":
            self.close_connection = True
            return
        if action is None and server.hold_at == number:
            server.held.set()
            server.release.wait(30)
        if action is None and any("bad" in i for i in ids):
            action = (400, {}, json.dumps({"error": {"message": "event bad-1: value must be a positive integer " + "x" * 600}}))
        if action is None and server.fail_after is not None and len(server.acknowledged) >= server.fail_after:
            action = (503, {"Retry-After": "0"}, "")
        status, headers, text = action or (200, {}, "{}")
        headers = headers() if callable(headers) else headers  # built as the answer leaves, as a server dates it
        if status == 200:
            with server.lock:
                server.acknowledged.extend(ids)
                for i in ids:  # deduplicated by id, as Stripe and Lago do
                    (server.dropped.append if i in server.taken else server.taken.add)(i)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(text.encode())))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


def _event_ids(raw: bytes, content_type: str) -> list[str]:
    """The idempotency ids in a body: Stripe's form ``identifier``, Lago's ``transaction_id``s, or a JSON ``id``."""
    if "form" in content_type:
        return parse_qs(raw.decode())["identifier"]
    body = json.loads(raw)
    if isinstance(body, dict) and "events" in body:
        return [e["transaction_id"] for e in body["events"]]
    return [body["id"]] if isinstance(body, dict) else [e["id"] for e in body]


@pytest.fixture
def receiver():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.lock, server.script, server.arrivals = threading.Lock(), [], []
    server.acknowledged, server.taken, server.dropped = [], set(), []
    server.fail_after, server.hold_at, server.held, server.release = None, None, threading.Event(), threading.Event()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/events"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def gaps_s(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_429_waits_the_retry_after_seconds_and_503_is_retried(receiver):
    receiver.script = [(429, {"Retry-After": "2"}, ""), (429, {"Retry-After": "2"}, ""), (503, {}, "")]
    assert push(receiver.url, [{"id": "e-1"}], wait_s=0.01) == 4
    assert receiver.taken == {"e-1"}
    first, second, third = gaps_s(receiver.arrivals)
    # the header's 2 s each time: not the 0.01 s backoff, not doubled per attempt (4 s); a busy machine only adds time
    assert 0.95 <= first / 2.0 <= 1.6 and 0.95 <= second / 2.0 <= 1.6
    assert third / 1.0 < 0.5  # a 503 without Retry-After waits the backoff


def test_a_retry_after_date_is_honoured_and_a_hostile_one_is_bounded(receiver):
    # dated as the answer leaves, in whole seconds: 1 to 2 s after the first request arrived, however late the client
    # reads it (a client that reads it late waits less, and the gap between the arrivals stays the same)
    receiver.script = [(429, lambda: {"Retry-After": email.utils.formatdate(time.time() + 2, usegmt=True)}, "")]
    push(receiver.url, [{"id": "e-1"}], wait_s=0.01)
    [waited] = gaps_s(receiver.arrivals)
    assert 0.9 <= waited <= 3.5
    receiver.arrivals.clear()
    receiver.script = [(429, {"Retry-After": "86400"}, "")]
    push(receiver.url, [{"id": "e-2"}], wait_s=0.01, max_wait_s=0.3)
    [waited] = gaps_s(receiver.arrivals)
    assert 0.27 <= waited <= 3.0  # max_wait_s (0.3 s), not a day: a busy machine only adds time
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after_s("soon") is None
    assert retry_after_s(" 7 ") == 7.0


def test_retries_end_in_one_clear_line(receiver):
    receiver.script = [(429, {"Retry-After": "0"}, "")] * 3
    with pytest.raises(PushError) as raised:
        push(receiver.url, [{"id": "e-1"}, {"id": "e-2"}], attempts=3, wait_s=0.01)
    assert str(raised.value) == (f"{receiver.url}: HTTP 429 after 3 attempts; 0 of 2 bodies were acknowledged, "
                                 "nothing more was sent")
    assert len(receiver.arrivals) == 3 and receiver.taken == set()


def test_a_connection_error_is_retried(receiver):
    receiver.script = ["drop"]
    assert push(receiver.url, [{"id": "e-1"}], wait_s=0.01) == 2 and receiver.taken == {"e-1"}
    with pytest.raises(PushError, match=r"cannot connect \(ConnectError\) after 2 attempts") as raised:
        push("http://127.0.0.1:9/events", [{"id": "e-1"}], attempts=2, wait_s=0.01)
    assert "\n" not in str(raised.value)


def test_a_400_is_refused_at_once_quoting_the_receivers_body(receiver):
    with pytest.raises(PushError) as raised:
        push(receiver.url, [{"id": "good-1"}, {"id": "bad-1"}, {"id": "good-2"}], wait_s=0.01)
    line = str(raised.value)
    assert line.startswith(f"{receiver.url}: the receiver refused the body with HTTP 400: "
                           '{"error": {"message": "event bad-1: value must be a positive integer xxx')
    assert "characters) (body 2 of 3, 1 of 3 bodies were acknowledged, nothing more was sent)" in line
    assert len(line) < BODY_QUOTE_CHARS + 250 and "\n" not in line
    assert len(receiver.arrivals) == 2 and receiver.taken == {"good-1"}  # not retried, nothing after it sent


def _expected_ids(db: str) -> list[str]:
    ledger = Ledger(db)
    found = stripe_events(charges(ledger, PERIOD[0] * 1_000_000, PERIOD[1] * 1_000_000), {}, warn=lambda _line: None)
    ledger.close()
    return [event["identifier"] for event in found]


def _export(db: str, url: str, *more: str) -> list[str]:
    return ["export", "--format", "stripe", "--db", db, "--start", str(PERIOD[0]), "--end", str(PERIOD[1]), "--push", url, *more]


def test_a_push_failing_after_n_events_resumes_without_duplicates(receiver, served, tmp_path):  # noqa: F811
    ids = _expected_ids(served)
    assert len(ids) >= 4
    progress = tmp_path / "push.progress"
    receiver.fail_after = 2
    failed = run_cli(*_export(served, receiver.url, "--progress", str(progress)))
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]  # after Stripe's warnings
    assert failed.returncode == 2 and len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert f"HTTP 503 after 5 attempts; 2 of {len(ids)} bodies were acknowledged" in failed.stderr
    assert receiver.acknowledged == ids[:2]
    receiver.fail_after = None
    resumed = invoke_cli(*_export(served, receiver.url, "--progress", str(progress)))
    assert resumed.returncode == 0, resumed.stderr
    assert receiver.acknowledged == ids  # each event sent and taken once: the progress file skipped the first two
    assert receiver.taken == set(ids) and receiver.dropped == []
    again = run_cli(*_export(served, receiver.url))  # delivered: a re-push is refused (Stripe dedupes 24 h only)
    assert again.returncode == 2 and "already exported as stripe" in again.stderr and receiver.acknowledged == ids
    forced = invoke_cli(*_export(served, receiver.url, "--force"))  # only what stripe does not have: nothing
    assert forced.returncode == 0 and receiver.acknowledged == ids
    assert receiver.taken == set(ids) and receiver.dropped == []


def test_a_killed_push_resumes_and_the_receiver_takes_each_event_once(receiver, served, tmp_path):  # noqa: F811
    ids = _expected_ids(served)
    progress = tmp_path / "push.progress"
    receiver.hold_at = 3
    process = subprocess.Popen([sys.executable, "-m", "llmvisor.cli", *_export(served, receiver.url, "--progress", str(progress))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert receiver.held.wait(120)
        process.kill()  # while the receiver holds the third event: it takes it, the pusher never hears so
        process.wait(30)
    finally:
        receiver.release.set()
    deadline = time.monotonic() + 10
    while len(receiver.acknowledged) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.acknowledged == ids[:3]
    receiver.hold_at = None
    resumed = invoke_cli(*_export(served, receiver.url, "--progress", str(progress)))
    assert resumed.returncode == 0, resumed.stderr
    assert receiver.acknowledged == ids[:3] + ids[2:]  # only the unacknowledged third is sent again
    assert receiver.taken == set(ids) and receiver.dropped == [ids[2]]  # the receiver's dedupe drops it
