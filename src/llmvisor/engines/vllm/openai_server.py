"""vLLM's OpenAI server with a bounded stop: ``python -m llmvisor.engines.vllm.openai_server`` takes the same
arguments as ``python -m vllm.entrypoints.openai.api_server`` and runs it, so SIGINT or SIGTERM ends it in time.

Why (vLLM 0.32): on SIGINT/SIGTERM the API server first stops the engine (``--shutdown-timeout``: 0 aborts the
requests in flight and kills the engine-core process at once; N > 0 lets them finish for up to N seconds), and
only then closes its HTTP server, which waits for every open connection with no time limit ("Waiting for
connections to close"). The HTTP server kept accepting requests meanwhile, and a request that reaches a stopped
engine, or whose abort was lost with the killed engine, never gets an answer: the server waits for it until it
is SIGKILLed, and a second SIGINT is ignored. This runs vLLM's own entry point with uvicorn's
``timeout_graceful_shutdown`` set, so after the engine has stopped, connections get
``LLMVISOR_HTTP_SHUTDOWN_GRACE_S`` seconds (default 5) to close before uvicorn cancels them and the process
exits. The engine has stopped by then, and every step it ran has left it (the recorder's delivery process), so
stopping this way bills every step the engine ran (docs/recorder.md, "Stopping the server").

It also runs vLLM's metrics in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a fresh
temporary directory removed at exit, unless one is set), as vLLM does by itself with ``--api-server-count`` > 1:
so the values the recorder's delivery process (or engine-core process) counts, the engine-side window metrics
(`llmvisor.metering.prometheus`), reach the server's own ``/metrics`` (docs/recorder.md, "Live metrics at the edge").
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile

from llmvisor.errors import LlmvisorError

ENV_HTTP_SHUTDOWN_GRACE_S = "LLMVISOR_HTTP_SHUTDOWN_GRACE_S"
DEFAULT_HTTP_SHUTDOWN_GRACE_S = 5.0
VLLM_ENTRY_POINT = "vllm.entrypoints.openai.api_server"
ENV_PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
_metrics_dir: tempfile.TemporaryDirectory | None = None


def http_shutdown_grace_s(environ=os.environ) -> float:
    """``LLMVISOR_HTTP_SHUTDOWN_GRACE_S``: seconds open connections get to close once the engine has stopped."""
    value = environ.get(ENV_HTTP_SHUTDOWN_GRACE_S)
    if value is None or value == "":
        return DEFAULT_HTTP_SHUTDOWN_GRACE_S
    try:
        grace_s = float(value)
    except ValueError:
        grace_s = -1.0
    if not grace_s >= 0 or grace_s == float("inf"):
        raise LlmvisorError(f"{ENV_HTTP_SHUTDOWN_GRACE_S} must be a number of seconds >= 0 (got {value!r})")
    return grace_s


def bound_http_shutdown(grace_s: float) -> None:
    """Make every `uvicorn.Config` made from now on default to ``timeout_graceful_shutdown=grace_s``.

    vLLM builds its uvicorn config itself and exposes no option for it; a subclass put in its place is picked up
    where vLLM calls ``uvicorn.Config(...)``, and an explicit ``timeout_graceful_shutdown`` still wins."""
    import uvicorn

    base = uvicorn.Config
    if getattr(base, "llmvisor_grace_s", None) is not None:
        base = base.__mro__[1]

    class BoundedShutdownConfig(base):
        llmvisor_grace_s = grace_s

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("timeout_graceful_shutdown", grace_s)
            super().__init__(*args, **kwargs)

    uvicorn.Config = BoundedShutdownConfig


def share_metrics_across_processes(environ=os.environ) -> str:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to a fresh directory, removed when this process exits, unless it is set;
    returns it. Call before prometheus_client is imported: its mode is fixed at import."""
    global _metrics_dir
    if environ.get(ENV_PROMETHEUS_MULTIPROC_DIR):
        return environ[ENV_PROMETHEUS_MULTIPROC_DIR]
    _metrics_dir = tempfile.TemporaryDirectory(prefix="llmvisor-metrics-")
    environ[ENV_PROMETHEUS_MULTIPROC_DIR] = _metrics_dir.name
    return _metrics_dir.name


def main() -> None:
    try:
        grace_s = http_shutdown_grace_s()
    except LlmvisorError as error:
        print(f"llmvisor: {error}", file=sys.stderr)
        sys.exit(2)
    share_metrics_across_processes()
    bound_http_shutdown(grace_s)
    sys.argv[0] = VLLM_ENTRY_POINT
    runpy.run_module(VLLM_ENTRY_POINT, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
