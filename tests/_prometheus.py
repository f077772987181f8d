"""A real Prometheus server for the fleet tests: Debian's `prometheus` binary (scripts/install-test.sh installs
it), started on a free loopback port with a temporary config and data directory, scraping every second."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from _processes import start_process, stop_process
from llmvisor.net import free_loopback_port

PROMETHEUS_BINARY = shutil.which("prometheus")
SCRAPE_INTERVAL_MS = 1000

CONFIG = """\
global:
  scrape_interval: {interval_ms}ms
  scrape_timeout: {interval_ms}ms
  evaluation_interval: {interval_ms}ms
scrape_configs:
  - job_name: llmvisor
    authorization:
      type: Bearer
      credentials_file: {key_file}
    static_configs:
      - targets: [{targets}]
"""


class PrometheusServer:
    """Scrapes ``targets`` (host:port of llmvisor services) with the admin key ``api_key`` (their /metrics needs one)."""

    def __init__(self, targets: list[str], api_key: str, folder: Path):
        self.folder = folder
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key_file = folder / "admin-key"
        key_file.write_text(api_key)
        key_file.chmod(0o600)
        self.config = folder / "prometheus.yml"
        self.config.write_text(
            CONFIG.format(interval_ms=SCRAPE_INTERVAL_MS, key_file=key_file, targets=", ".join(f'"{t}"' for t in targets))
        )
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        self.process = start_process(
            [
                PROMETHEUS_BINARY,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            log_path=self.folder / "prometheus.log",
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with code {self.process.returncode}: {(self.folder / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus did not become ready within {timeout_s:g} s")

    def query(self, promql: str) -> list[dict]:
        """The instant vector of ``promql`` now: a list of {"metric": labels, "value": [time, "value"]}."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10.0)
        response.raise_for_status()
        payload = response.json()
        assert payload["status"] == "success", payload
        return payload["data"]["result"]

    def wait_for_scrapes_after(self, moment_s: float, n_targets: int, timeout_s: float = 30.0) -> None:
        """Until every target has been scraped (successfully) after ``moment_s`` (Unix seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # timestamp() of a selector is its sample's (scrape) time; of an expression such as `up == 1` it would
            # be the evaluation time, hence the `and`.
            scraped = self.query('timestamp(up{job="llmvisor"}) and up{job="llmvisor"} == 1')
            if len(scraped) == n_targets and min(float(s["value"][1]) for s in scraped) > moment_s:
                return
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not scrape all {n_targets} targets within {timeout_s:g} s: {self.query('up')}")

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
