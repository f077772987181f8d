"""The accounting service: HTTP ingest of step traces into the ledger, usage queries, metrics.

`create_app` builds the FastAPI app; `llmvisor.cli.serve` holds the CLI commands and
`llmvisor.client.push.StepPusher` the engine-side client. See docs/service.md.
"""

from llmvisor import extras

extras.require("llmvisor.service", "service")

from llmvisor.service.app import create_app  # noqa: E402

__all__ = ["create_app"]
