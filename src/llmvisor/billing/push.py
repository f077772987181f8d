"""Send export bodies to a billing system's ingest URL, retrying what may succeed later (5xx, connection errors)
and never what the receiver refused (4xx). Bodies carry idempotency ids, so a retried send cannot double-bill."""

from __future__ import annotations

import json

import httpx
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from llmvisor.errors import LlmvisorError

ATTEMPTS = 5


class PushError(LlmvisorError):
    """A body the receiver refused, or one that could not be sent after every retry."""


class _Retryable(Exception):
    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def _should_retry(error: BaseException) -> bool:
    return isinstance(error, _Retryable | httpx.TransportError)


def stripe_form(event: dict) -> bytes:
    """A Stripe meter event as Stripe's v1 API takes it: form-encoded, the payload as ``payload[key]`` fields."""
    from urllib.parse import urlencode

    fields = [(k, str(v)) for k, v in event.items() if k != "payload"]
    fields += [(f"payload[{k}]", str(v)) for k, v in event["payload"].items()]
    return urlencode(fields).encode()


def push(url: str, bodies: list, *, content_type: str = "application/json", headers: dict[str, str] | None = None,
         attempts: int = ATTEMPTS, wait_s: float = 0.5, timeout_s: float = 30.0, encode=None) -> int:
    """POST each body (JSON, or ``encode(body)`` bytes); returns the number of requests made (retries included)."""
    requests = 0

    with httpx.Client(timeout=timeout_s) as client:

        @retry(retry=retry_if_exception(_should_retry), stop=stop_after_attempt(attempts),
               wait=wait_exponential(multiplier=wait_s, max=10 * wait_s), reraise=True)
        def send(body) -> None:
            nonlocal requests
            requests += 1
            content = encode(body) if encode is not None else json.dumps(body).encode()
            response = client.post(url, content=content, headers={"content-type": content_type, **(headers or {})})
            if response.status_code >= 500:
                raise _Retryable(f"HTTP {response.status_code}")
            if response.status_code >= 400:
                raise PushError(f"{url}: the receiver refused the body with HTTP {response.status_code}: "
                                f"{' '.join(response.text.split())[:200]}")

        for body in bodies:
            try:
                send(body)
            except _Retryable as error:
                raise PushError(f"{url}: {error.detail} after {attempts} attempts; nothing more was sent") from None
            except httpx.TransportError as error:
                raise PushError(f"{url}: cannot connect ({error.__class__.__name__}) after {attempts} attempts") from None
    return requests
