"""`llmvisor.retry`, the one retry policy of every HTTP sender: what it retries, how long it waits, when it gives up,
against an in-process transport (no sockets, no real sleeps)."""

from __future__ import annotations

import httpx
import pytest

from llmvisor.retry import RetryableAnswer, backoff_s, check_answer, retry_policy


def answers(*statuses: int, headers: dict | None = None):
    """A client whose POSTs get ``statuses`` in turn (an int, or ConnectError for 0), and the list of requests made."""
    made = []

    def handle(request: httpx.Request) -> httpx.Response:
        status = statuses[min(len(made), len(statuses) - 1)]
        made.append(request)
        if status == 0:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, headers=headers or {})

    return httpx.Client(transport=httpx.MockTransport(handle), base_url="http://service"), made


def run(policy, client: httpx.Client, waits: list[float]):
    policy.sleep = waits.append
    return policy(lambda: check_answer(client.post("/x")))


def test_backoff_doubles_up_to_the_cap_and_jitter_stays_within_it():
    assert [backoff_s(n, 0.1, 0.5) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]
    for n in range(1, 8):
        base = min(0.1 * 2 ** (n - 1), 0.5)
        assert all(base / 2 <= w <= min(base * 1.5, 0.5) for w in (backoff_s(n, 0.1, 0.5, jitter=True) for _ in range(50)))


def test_429_5xx_and_connection_errors_are_retried_other_answers_are_not():
    client, made = answers(503, 0, 429, 200)
    waits: list[float] = []
    assert run(retry_policy(4, 0.1, 5.0), client, waits).status_code == 200
    assert len(made) == 4 and waits == [0.1, 0.2, 0.4]
    for refused in (400, 401, 404, 409, 422):
        client, made = answers(refused)
        assert run(retry_policy(4, 0.1, 5.0), client, []).status_code == refused and len(made) == 1


def test_the_last_error_is_raised_after_the_attempts():
    client, made = answers(502)
    with pytest.raises(RetryableAnswer) as raised:
        run(retry_policy(3, 0.1, 5.0), client, [])
    assert len(made) == 3 and raised.value.detail == "HTTP 502" and raised.value.response.status_code == 502
    client, made = answers(0)
    with pytest.raises(httpx.ConnectError):
        run(retry_policy(2, 0.1, 5.0), client, [])
    assert len(made) == 2


def test_retry_after_is_obeyed_up_to_its_cap():
    client, _ = answers(503, 200, headers={"Retry-After": "1"})
    waits: list[float] = []
    run(retry_policy(4, 0.1, 5.0), client, waits)
    assert waits == [1.0]
    client, _ = answers(429, 200, headers={"Retry-After": "86400"})
    waits = []
    run(retry_policy(4, 0.1, 0.5), client, waits)  # capped by max_wait_s
    assert waits == [0.5]
    client, _ = answers(429, 200, headers={"Retry-After": "86400"})
    waits = []
    run(retry_policy(4, 0.1, 0.5, max_retry_after_s=60.0), client, waits)  # a cap of its own (the billing push)
    assert waits == [60.0]


def test_give_up_stops_before_the_attempts_run_out():
    client, made = answers(503)
    with pytest.raises(RetryableAnswer):
        run(retry_policy(10, 0.1, 5.0, give_up=lambda: len(made) >= 2), client, [])
    assert len(made) == 2
