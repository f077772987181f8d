"""``python -m llmvisor.service``: the service commands without the rest of the CLI (used by tests and `load`)."""

import sys

import typer

from llmvisor.errors import LlmvisorError
from llmvisor.service.command import keys_create, keys_list, keys_revoke, serve

app = typer.Typer(add_completion=False, no_args_is_help=True)
app.command("serve")(serve)
keys = typer.Typer(no_args_is_help=True, help="API keys.")
keys.command("create")(keys_create)
keys.command("list")(keys_list)
keys.command("revoke")(keys_revoke)
app.add_typer(keys, name="keys")

if __name__ == "__main__":
    try:
        app(standalone_mode=False)
    except LlmvisorError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except Exception as error:  # click's usage errors
        import click

        if isinstance(error, click.ClickException):
            error.show()
            sys.exit(error.exit_code)
        raise
