"""``python -m llmvisor.cli``: the same command line as `llmvisor` (used where no script is on PATH)."""

from llmvisor.cli.main import main

if __name__ == "__main__":
    main()
