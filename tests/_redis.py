"""A real Redis server for the shared fairness counters tests: Debian's `redis-server` (scripts/install-test.sh
installs it), started on a free loopback port with its data in a temporary folder and the append-only file on,
so a stopped and restarted server keeps its counters (as a production Redis with persistence would)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from _processes import start_process, stop_process
from llmvisor.net import free_loopback_port

REDIS_BINARY = shutil.which("redis-server")
SKIP_REASON = "needs Debian's redis-server binary (scripts/install-test.sh installs it)"


class RedisServer:
    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_loopback_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.process = start_process(
            [
                REDIS_BINARY,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.folder),
                "--appendonly", "yes",
                "--appendfsync", "always",
                "--save", "",
                "--daemonize", "no",
            ],
            log_path=self.folder / "redis.log",
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}: {(self.folder / 'redis.log').read_text()[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout_s:g} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: Redis writes its append-only file and exits; a later `start` serves the same data."""
        stop_process(self.process)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (clients time out instead of being refused)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
        self.stop()
