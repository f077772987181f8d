"""The pushers' files on disk: a spool holds what the service could not take yet (replayed when it answers, and on
the next start), a rejected file what it refused for its content. Steps are kept in the trace format (one JSON row a
line, `llmvisor.core.trace`), windows as one JSON object a line. A spool is replayed by renaming it first
(`take_for_replay`), so new spooling goes to a fresh file while the old one is sent; the callers hold their spool
lock around every call here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmvisor.core.trace import TraceWriter


def append_steps(path: Path, steps: list[list[dict]]) -> None:
    """Append steps' rows to a trace-format file, flushed once at the end (`TraceWriter` raises OSError, TypeError or
    ValueError when they cannot be written)."""
    writer = TraceWriter(path, flush_every_steps=len(steps))
    for step in steps:
        writer.write_step(step)
    writer.close()


def read_spool(path: Path) -> tuple[list[list[dict]], int]:
    """Steps of a spool file, from consecutive rows of one (run_id, step_id); a step spooled twice in a
    row starts a new group at the repeated request. Returns (steps, unreadable lines)."""
    steps: list[list[dict]] = []
    unreadable = 0
    current_key = None
    current_requests: set = set()
    try:
        handle = open(path, encoding="utf-8")
    except FileNotFoundError:
        return [], 0
    with handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            if not isinstance(row, dict):
                unreadable += 1
                continue
            key = (row.get("run_id"), row.get("step_id"))
            request = row.get("request_id")
            if key != current_key or request in current_requests:
                steps.append([])
                current_key, current_requests = key, set()
            steps[-1].append(row)
            current_requests.add(request if isinstance(request, (str, int, float)) or request is None else repr(request))
    return steps, unreadable


def append_lines(path: Path, lines: list[str]) -> None:
    """Append one line each (JSON objects), flushed and synced to disk."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
        handle.flush()
        os.fsync(handle.fileno())


def take_for_replay(spool_path: Path, replay_path: Path) -> bool:
    """Whether there is a file to replay: a replay file left from before (not yet all acknowledged), else the spool,
    renamed to the replay file first."""
    if not replay_path.exists():
        if not spool_path.exists():
            return False
        os.replace(spool_path, replay_path)
    return True
