"""Send export bodies to a billing system's ingest URL, retrying what may succeed later (429, 5xx, connection errors)
and never what the receiver refused (any other 4xx). Bodies carry idempotency ids, so a retried or resumed send
is taken once by a receiver that deduplicates by id, while it remembers ids (Stripe: 24 hours); an optional progress file also keeps a resumed push from
re-sending the bodies already acknowledged."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import httpx

from llmvisor.errors import LlmvisorError
from llmvisor.retry import RetryableAnswer, check_answer, retry_policy

ATTEMPTS = 5
MAX_WAIT_S = 60.0  # the longest one Retry-After is obeyed for: a hostile or mistaken header cannot stall a push
BODY_QUOTE_CHARS = 300  # how much of a refusal's body the error line quotes


class PushError(LlmvisorError):
    """A body the receiver refused, or one that could not be sent after every retry."""


def quote_body(text: str) -> str:
    """A receiver's answer on one line, cut to BODY_QUOTE_CHARS."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_QUOTE_CHARS else flat[:BODY_QUOTE_CHARS] + f"... ({len(flat)} characters)"


def stripe_form(event: dict) -> bytes:
    """A Stripe meter event as Stripe's v1 API takes it: form-encoded, the payload as ``payload[key]`` fields."""
    from urllib.parse import urlencode

    fields = [(k, str(v)) for k, v in event.items() if k != "payload"]
    fields += [(f"payload[{k}]", str(v)) for k, v in event["payload"].items()]
    return urlencode(fields).encode()


class Progress:
    """The bodies a receiver acknowledged (2xx), one digest of URL and bytes a line, appended and flushed to disk after
    each acknowledgement. A resumed push skips them, so a receiver that does not deduplicate is not sent them twice and
    one that does is spared the requests (a Stripe export is one request per event). The digest covers the bytes, so a
    body whose content changed is sent again. A kill while writing leaves at most a partial last line, which is
    ignored: that body is sent again, which a deduplicating receiver drops by its id."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeDecodeError) as error:
            raise PushError(f"{self.path}: cannot read the push progress file ({error.__class__.__name__})") from None
        self.done: set[str] = {line for line in lines if len(line) == 64 and all(c in "0123456789abcdef" for c in line)}
        try:
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as error:
            raise PushError(f"{self.path}: cannot write the push progress file ({error.strerror})") from None

    @staticmethod
    def digest(url: str, content: bytes) -> str:
        return hashlib.sha256(url.encode() + b"\n" + content).hexdigest()

    def record(self, digest: str) -> None:
        self._file.write(digest + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(digest)

    def close(self) -> None:
        self._file.close()


def push(url: str, bodies: list, *, content_type: str = "application/json", headers: dict[str, str] | None = None,
         attempts: int = ATTEMPTS, wait_s: float = 0.5, max_wait_s: float = MAX_WAIT_S, timeout_s: float = 30.0,
         encode=None, progress: Path | None = None) -> int:
    """POST each body (JSON, or ``encode(body)`` bytes) in order; returns the number of requests made (retries
    included). With ``progress``, bodies that file records as acknowledged are skipped and each new acknowledgement is
    recorded."""
    requests = 0
    record = Progress(progress) if progress is not None else None

    def send(client: httpx.Client, content: bytes) -> None:
        nonlocal requests
        requests += 1
        response = client.post(url, content=content, headers={"content-type": content_type, **(headers or {})})
        status = check_answer(response).status_code  # 429 and 5xx are retried (llmvisor.retry)
        if status >= 400:
            raise PushError(f"{url}: the receiver refused the body with HTTP {status}: {quote_body(response.text)}")

    policy = retry_policy(attempts, wait_s, min(10 * wait_s, max_wait_s), max_retry_after_s=max_wait_s)

    def sent(number: int) -> str:
        return f"{number - 1} of {len(bodies)} bodies were acknowledged, nothing more was sent"

    try:
        with httpx.Client(timeout=timeout_s) as client:
            for number, body in enumerate(bodies, 1):
                content = encode(body) if encode is not None else json.dumps(body).encode()
                digest = Progress.digest(url, content)
                if record is not None and digest in record.done:
                    continue
                try:
                    policy(send, client, content)
                except RetryableAnswer as error:
                    raise PushError(f"{url}: {error.detail} after {attempts} attempts; {sent(number)}") from None
                except httpx.TransportError as error:
                    raise PushError(f"{url}: cannot connect ({error.__class__.__name__}) after {attempts} attempts; "
                                    f"{sent(number)}") from None
                except PushError as error:
                    raise PushError(f"{error} (body {number} of {len(bodies)}, {sent(number)})") from None
                if record is not None:
                    record.record(digest)
    finally:
        if record is not None:
            record.close()
    return requests
