"""Ground truth for attribution: shares compared with cost games measured on the real engine.

`game` (Shapley and leave-one-out of a cost game), `plans` (the batches, from real length mixes),
`measurement` (running every subset of a batch on an engine, into a resumable journal), `analysis`
(per-batch truth and shares, error quantiles, the result) and `report` (HTML sections, Markdown tables).
"""
