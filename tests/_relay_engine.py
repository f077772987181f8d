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


def main(run_id: str) -> None:
    header = {
        "columns": {"run_id": run_id, "engine": "vllm", "engine_version": "test", "model": "m", "hardware": "h",
                    "tensor_parallel_size": 1},
        "warmup_steps": 0,
        "trace_path": None,
        "engine_fingerprint": None,
    }
    if os.environ.get("LLMVISOR_TEST_ENGINE_CLASS"):  # steps of an engine class (window mode attributes them at the edge)
        header["columns"][FINGERPRINT_COLUMN] = os.environ["LLMVISOR_TEST_ENGINE_CLASS"]
    relay = StepRelay(header)
    print(f"pid {relay.pid}", flush=True)
    sent = 0
    for line in sys.stdin:
        command, *args = line.split()
        if command == "send":
            for _ in range(int(args[0])):
                slices = [[f"request-{sent}-{k}-" + "x" * 40, f"tenant-{k % 3}", 1, 100 + k, False, 0, 100.0 + k]
                          for k in range(SLICES_PER_STEP)]
                relay.send([sent, 1_750_000_000.0 + 0.01 * sent, 0.01 + 1e-6 * (sent % 100), slices])
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
