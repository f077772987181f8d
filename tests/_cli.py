"""`llmvisor` commands run in the test's own process (typer's CliRunner), for tests that use a command as a step
(prices stored, a period exported, a model added) and check what it wrote, not the process it ran in.

A command run as ``python -m llmvisor.cli`` pays the interpreter's start and its imports each time (numpy, typer,
SQLAlchemy, pyarrow, the service: 0.5-1.3 s on an idle 2-core machine, twice that when it is shared); here they are
imported once per test process. What a process adds on top stays tested where it is the point: the documented
commands (tests/test_doc_commands.py, tests/test_docs_operator.py), the one-line refusals on stderr (the tests of a
command's bad input keep a process: in-process, pytest would take a stray warning or log line off stderr), a command
killed mid-push, and the JSON contract of tests/test_cli_json.py. The refusals and the JSON contract run as
processes forked from an interpreter that has imported the commands (`_processes.cli_process`), each still a
process of its own whose stdout and stderr are checked as it wrote them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import traceback

from typer.testing import CliRunner

from llmvisor.cli.main import app


def invoke_cli(*args, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``llmvisor ARGS`` in this process; returns what `subprocess.run` would (exit status, stdout, stderr), with
    an uncaught exception's traceback at the end of stderr, as the process would have printed it."""
    argv = [str(a) for a in args]
    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(app, argv, env=env)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["llmvisor", *argv], result.exit_code, result.stdout, stderr)
