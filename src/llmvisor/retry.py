"""The one retry policy of llmvisor's HTTP senders (the engine side's step, window and end-of-run senders in
`llmvisor.client`, the billing push in `llmvisor.billing.push`).

What is retried: what may succeed later, connection errors (`httpx.TransportError`) and the answers 429 and 5xx
(`RetryableAnswer`); never another answer, which the receiver gave for the request itself. How long to wait: the
receiver's Retry-After when it gave one (capped: a hostile or mistaken header cannot stall a sender), else
exponential backoff from ``wait_s``, doubled per attempt up to ``max_wait_s``, jittered where many senders may retry
at once. When to give up: after ``attempts``, or earlier when the sender runs out of time (``give_up``); the last
error is raised then. The engine-side pushers wrap it around each POST only: what they do once it gives up (spool,
try the service again every ``retry_interval_s``, replay) is their own outage logic, not a retry loop.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_any


def retryable_status(status: int) -> bool:
    """An answer that may succeed later: 429 (too many requests) or 5xx."""
    return status == 429 or status >= 500


def retry_after_s(value: str | None, now_s: float | None = None) -> float | None:
    """Retry-After as seconds from now: delay-seconds or an HTTP-date (RFC 9110 10.2.3); None when absent or unreadable
    (then the backoff applies). A date in the past is 0."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now_s is None else now_s))


class RetryableAnswer(Exception):
    """An answer that may succeed later (429, 5xx), with the receiver's Retry-After in seconds when it gave one."""

    def __init__(self, response: httpx.Response):
        self.response, self.status = response, response.status_code
        self.detail, self.retry_after_s = f"HTTP {self.status}", retry_after_s(response.headers.get("retry-after"))
        super().__init__(self.detail)


def check_answer(response: httpx.Response) -> httpx.Response:
    """The response, unless its status may succeed later: then `RetryableAnswer` (to be retried)."""
    if retryable_status(response.status_code):
        raise RetryableAnswer(response)
    return response


def is_retryable(error: BaseException) -> bool:
    return isinstance(error, RetryableAnswer | httpx.TransportError)


def failure_reason(error: BaseException) -> str:
    """One line for a failed attempt: ``HTTP 503``, or the connection error's type and message."""
    return error.detail if isinstance(error, RetryableAnswer) else f"{type(error).__name__}: {error}"


def backoff_s(attempt: int, wait_s: float, max_wait_s: float, *, jitter: bool = False) -> float:
    """The wait after failed attempt number ``attempt`` (1, 2, ...): ``wait_s`` doubled per attempt, at most
    ``max_wait_s``; with ``jitter`` times a random factor in [0.5, 1.5), still at most ``max_wait_s``."""
    base = min(wait_s * 2 ** (attempt - 1), max_wait_s)
    return min(base * (0.5 + random.random()), max_wait_s) if jitter else base


class WaitRetryAfter:
    """Tenacity wait: the receiver's Retry-After when it gave one (at most ``max_retry_after_s``), else `backoff_s`."""

    def __init__(self, wait_s: float, max_wait_s: float, *, max_retry_after_s: float | None = None, jitter: bool = False):
        self.wait_s, self.max_wait_s, self.jitter = wait_s, max_wait_s, jitter
        self.max_retry_after_s = max_wait_s if max_retry_after_s is None else max_retry_after_s

    def __call__(self, retry_state) -> float:
        error = retry_state.outcome.exception()
        asked = error.retry_after_s if isinstance(error, RetryableAnswer) else None
        if asked is not None:
            return min(self.max_retry_after_s, asked)
        return backoff_s(retry_state.attempt_number, self.wait_s, self.max_wait_s, jitter=self.jitter)


def retry_policy(attempts: int, wait_s: float, max_wait_s: float, *, max_retry_after_s: float | None = None,
                 jitter: bool = False, give_up: Callable[[], bool] | None = None) -> Retrying:
    """The retry policy (see the module): call it as ``policy(send, *args)``; ``send`` raises `RetryableAnswer` (see
    `check_answer`) or a connection error for what may succeed later. Retry-After is obeyed up to
    ``max_retry_after_s`` (default ``max_wait_s``); ``give_up()`` true after a failed attempt stops early."""
    stop = stop_after_attempt(attempts)
    if give_up is not None:
        stop = stop_any(stop, lambda _state: give_up())
    return Retrying(retry=retry_if_exception(is_retryable), stop=stop, reraise=True,
                    wait=WaitRetryAfter(wait_s, max_wait_s, max_retry_after_s=max_retry_after_s, jitter=jitter))
