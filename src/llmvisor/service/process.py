"""Run the service as a child process on a loopback port: for the load command and the crash tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmvisor.errors import LlmvisorError
from llmvisor.net import free_loopback_port


class ServerProcess:
    """``python -m llmvisor.cli serve`` in a child process, bound to 127.0.0.1.

    The port is fixed at construction, so a restarted server answers at the same URL.
    """

    def __init__(self, model_path: str | Path, db_url: str, *, port: int | None = None, log_path: str | Path | None = None,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.model_path = str(model_path)
        self.db_url = db_url
        self.port = port or free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.extra_args = extra_args
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> ServerProcess:
        command = [
            sys.executable, "-m", "llmvisor.cli", "serve",
            "--model", self.model_path, "--db", self.db_url,
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *self.extra_args,
        ]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env={**os.environ, **self.env})
        finally:
            if self.log_path:
                log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlmvisorError(f"the service exited with code {self.process.returncode} at start (see {self.log_path or 'its log'})")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise LlmvisorError(f"the service did not answer at {self.url} within {timeout_s:g} s")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
