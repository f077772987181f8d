"""Write docs/results/ground-truth.json: what the shipped validation journals support for issue #39 (per-tenant
half-widths, the estimator's measured permutation ratio, coverage on exact batches, the additive-projection bias, the
sharing rules' verdicts) and the tenants run the later session must do. Deterministic (seeded); no engine.

    python scripts/ground-truth-figures.py [--output docs/results/ground-truth.json] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmvisor.validation.analysis import rounded
from llmvisor.validation.groundtruth import groundtruth_figures

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "ground-truth.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures = rounded(groundtruth_figures(seed=args.seed, n_bootstrap=500, trials=10))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
