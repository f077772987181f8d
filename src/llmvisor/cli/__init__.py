"""The `llmvisor` command line: wires commands to the packages that do the work, and nothing else."""

from llmvisor.cli.main import app, main

__all__ = ["app", "main"]
