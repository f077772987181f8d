"""Steps of two tenants with the request ids vLLM's OpenAI server makes, for the usage API and page tests.

``acme`` sends one completion of two prompts (answered as ``cmpl-<A>``, run by the engine as ``cmpl-<A>-0-<8 hex>``
and ``cmpl-<A>-1-<8 hex>``) and one more request; ``globex`` a chat completion (``chatcmpl-<B>``, run as
``chatcmpl-<B>-<8 hex>``). The steps span two hours and two engine classes, and co-batch both tenants.
"""

from __future__ import annotations

import numpy as np

T0_S = 1_750_000_000.0 - 1_750_000_000.0 % 3600
ACME_COMPLETION = "cmpl-4f0c2b7e9a1d4e3b8c6a5d2f1e0b9a87"
ACME_OTHER = "cmpl-77aa11bb22cc33dd44ee55ff66aa77bb"
GLOBEX_CHAT = "chatcmpl-b0b0c1c1d2d2e3e3f4f4a5a5b6b6c7c7"
ENGINE_IDS = {
    "acme": [f"{ACME_COMPLETION}-0-1a2b3c4d", f"{ACME_COMPLETION}-1-9f8e7d6c", f"{ACME_OTHER}-0-0badc0de"],
    "globex": [f"{GLOBEX_CHAT}-5e6f7a8b"],
}
CLASSES = ("", "00000000c0ffee01")


def usage_steps(n_steps: int = 60, seed: int = 0) -> list[list[dict]]:
    """Row groups for POST /v1/steps: each step runs every request of both tenants, on run ``run-<class>``."""
    rng = np.random.default_rng(seed)
    groups = []
    for step in range(n_steps):
        engine_class = CLASSES[step % 2]
        latency_s = round(float(rng.uniform(0.01, 0.1)), 6)
        rows = []
        for tenant, request_ids in ENGINE_IDS.items():
            for request_id in request_ids:
                row = {
                    "run_id": f"run-{engine_class or 'plain'}", "step_id": step // 2, "step_latency_s": latency_s,
                    "request_id": request_id, "tenant": tenant, "num_new_tokens": 1,
                    "num_context_tokens": int(rng.integers(0, 500)), "phase": "decode",
                    "timestamp_s": T0_S + step * 120.0,
                }
                if engine_class:
                    row["engine_fingerprint"] = engine_class
                rows.append(row)
        groups.append(rows)
    return groups
