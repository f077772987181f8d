"""Write docs/results/ground-truth.json: what the shipped validation journals support for issue #39 (per-tenant
half-widths, the estimator's measured permutation ratio, coverage on exact batches, the additive-projection bias, the
sharing rules' verdicts) and the tenants run the later session must do. Deterministic (seeded); no engine.

    python scripts/ground-truth-figures.py [--output docs/results/ground-truth.json] [--seed 0]
        [--sharing-result docs/results/validation-sharing.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmvisor.validation.analysis import rounded
from llmvisor.validation.groundtruth import groundtruth_figures

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
DEFAULT_OUTPUT = RESULTS / "ground-truth.json"
DEFAULT_SHARING = RESULTS / "validation-sharing.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharing-result", type=Path, default=DEFAULT_SHARING,
                        help="the sharing run's result, its gzipped journal beside it (left out where it is missing)")
    args = parser.parse_args()
    sharing = args.sharing_result if args.sharing_result.is_file() else None
    figures = rounded(groundtruth_figures(seed=args.seed, n_bootstrap=500, trials=10, sharing_result=sharing))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
