"""A stand-in for the vLLM engine-core process: relays steps through the real `StepRelay` to a real delivery
process, on commands read from stdin (one a line), so tests can stop, kill and idle it at chosen moments.

Commands: ``send N`` (N more steps, ids contiguous from 0; answers ``sent TOTAL``), ``pid`` (answers ``pid
DELIVERY_PID``), ``close`` (closes the relay as the recorder's shutdown does; answers ``closed DELIVERY_PID``)
and ``exit``. Each step has 16 slices with long request ids, about 1.7 kB a step in the pipe."""

from __future__ import annotations

import os
import sys

from llmvisor.client import StepRelay
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN

SLICES_PER_STEP = 16


def relay_header(run_id: str, engine_class: str | None = None) -> dict:
    """The header the recorder gives its relay; with ``engine_class`` its steps carry that class (window mode
    attributes them at the edge)."""
    header = {
        "columns": {"run_id": run_id, "engine": "vllm", "engine_version": "test", "model": "m", "hardware": "h",
                    "tensor_parallel_size": 1},
        "warmup_steps": 0,
        "trace_path": None,
        "engine_fingerprint": None,
    }
    if engine_class:
        header["columns"][FINGERPRINT_COLUMN] = engine_class
    return header


def relay_step(step_id: int) -> list:
    """Step ``step_id`` as relayed: dated 0.01 s apart from 1,750,000,000 s (100 steps a 1 s window, all in the
    past, so the clock closes every window at once), 16 slices of 3 tenants."""
    slices = [[f"request-{step_id}-{k}-" + "x" * 40, f"tenant-{k % 3}", 1, 100 + k, False, 0, 100.0 + k]
              for k in range(SLICES_PER_STEP)]
    return [step_id, 1_750_000_000.0 + 0.01 * step_id, 0.01 + 1e-6 * (step_id % 100), slices]


def main(run_id: str) -> None:
    header = relay_header(run_id, os.environ.get("LLMVISOR_TEST_ENGINE_CLASS"))
    relay = StepRelay(header)
    print(f"pid {relay.pid}", flush=True)
    sent = 0
    for line in sys.stdin:
        command, *args = line.split()
        if command == "send":
            for _ in range(int(args[0])):
                relay.send(relay_step(sent))
                sent += 1
            print(f"sent {sent}", flush=True)
        elif command == "pid":
            print(f"pid {relay.pid}", flush=True)
        elif command == "close":
            relay.close()
            print(f"closed {relay.pid}", flush=True)
        elif command == "exit":
            return


if __name__ == "__main__":
    main(sys.argv[1])
