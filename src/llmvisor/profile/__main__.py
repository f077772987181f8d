"""`python -m llmvisor.profile ...`: the profile command without the rest of the CLI."""

import sys

import typer

from llmvisor.errors import LlmvisorError
from llmvisor.profile.command import profile


def main() -> None:
    try:
        typer.run(profile)
    except LlmvisorError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
