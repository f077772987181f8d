"""Seconds and peak memory of the evaluation's block-bootstrap intervals at 10 M steps (or --steps N).

Usage: PYTHONPATH=src python scripts/bench-bootstrap.py [--steps N] [--resamples R]
"""

import argparse
import json

from llmvisor.evaluation.bench import run_bootstrap_benchmark

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10_000_000)
parser.add_argument("--resamples", type=int, default=1000)
args = parser.parse_args()
print(json.dumps(run_bootstrap_benchmark(n_steps=args.steps, n_resamples=args.resamples), indent=2))
