"""Stopping the real servers the tests start (Prometheus, Redis)."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
