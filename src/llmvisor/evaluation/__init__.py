"""Judging latency models: held-out evaluation against baselines, and speed benchmarks."""
