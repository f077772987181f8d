"""The accounting service: HTTP ingest of step traces into the ledger, usage queries, metrics.

`create_app` builds the FastAPI app; `llmvisor.service.command` holds the CLI commands and
`llmvisor.service.client.StepPusher` the engine-side client. See docs/service.md.
"""

from llmvisor.service.app import create_app

__all__ = ["create_app"]
