"""Write docs/results/estimator.json: the regression Shapley estimator evaluated on the shipped validation journal.

Deterministic (seeded); no engine. Run from the repository root:

    python scripts/estimator-figures.py [--output docs/results/estimator.json] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmvisor.validation.analysis import rounded
from llmvisor.validation.estimator import estimator_figures

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "estimator.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures = rounded(estimator_figures(seed=args.seed))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
