"""`ProfilingScheduler`: the recording scheduler, steerable between steps by a profiling driver.

Two controls, both cleared by default so the scheduler behaves as vLLM's own:

- ``token_budget``: caps the tokens of the next steps (vLLM's ``max_num_scheduled_tokens``), so prefill
  chunks and mixed steps of chosen sizes occur;
- ``decode_batch_size``: runs only that many of the running requests that are decoding (a subset drawn
  with the control's seed); the others wait, their KV cache kept, so decode batches of any size occur at
  contexts already prefilled, without prefilling again.

Held-back requests also lower the admission limit for that step, so no more than ``max_num_seqs`` requests
are ever running. With LoRA on, the subset keeps at least one request of every adapter among the decoding requests:
vLLM admits a waiting request with another adapter only while the adapters of the running requests it schedules
leave a slot free (and asserts so the next step), so an adapter held back entirely would let the running requests
need more than ``max_loras`` slots. The one exception is ``base_only``: a step of base-model decodes alone, every
adapter's requests held back and no waiting request admitted (the admission limit lowered to the requests that run),
so nothing can take the slots of the adapters held back. It is what tells the per-request decode price apart from the
LoRA path's price on a base-model token: in a step with an adapter both are paid by every base-model request, and only
base-model decode steps price the first alone (issue #38). It applies only when every running request is decoding;
otherwise the step runs as without it.
"""

from __future__ import annotations

import numpy as np

from llmvisor.engines.vllm.recorder import RecordingScheduler


class ProfilingScheduler(RecordingScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._default_token_budget = self.max_num_scheduled_tokens
        self.token_budget: int | None = None
        self.decode_batch_size: int | None = None
        self.base_only = False
        self._subset_rng = np.random.default_rng(0)

    def set_controls(self, *, token_budget=..., decode_batch_size=..., base_only: bool = False, seed: int | None = None) -> None:
        """``base_only`` holds for the next step only (set it with its ``decode_batch_size``)."""
        if token_budget is not ...:
            self.token_budget = token_budget
        if decode_batch_size is not ...:
            self.decode_batch_size = decode_batch_size
        self.base_only = base_only
        if seed is not None:
            self._subset_rng = np.random.default_rng(seed)

    def _decode_subset(self, decoding: list) -> set[int]:
        """Indices of the decoding requests that run: ``decode_batch_size`` drawn at random, plus one of each adapter's
        requests (drawn first) when LoRA is on (module docstring)."""
        if not self.lora_config:
            return set(self._subset_rng.choice(len(decoding), self.decode_batch_size, replace=False).tolist())
        order = self._subset_rng.permutation(len(decoding)).tolist()
        first_of: dict[int, int] = {}
        for i in order:
            lora = decoding[i].lora_request
            if lora is not None:
                first_of.setdefault(lora.lora_int_id, i)
        chosen = dict.fromkeys(first_of.values())
        for i in order:
            if len(chosen) >= self.decode_batch_size:
                break
            chosen.setdefault(i)
        return set(chosen)

    def _schedule_step(self, *args, **kwargs):
        default_budget = self._default_token_budget
        if self.token_budget is not None:
            self.max_num_scheduled_tokens = max(1, min(self.token_budget, default_budget))
        held_back = []
        admit_none = False
        if self.decode_batch_size is not None:
            decoding = [r for r in self.running if not r.is_prefill_chunk]
            base = [r for r in decoding if r.lora_request is None]
            if self.base_only and self.lora_config and len(decoding) == len(self.running) and base:
                picked = self._subset_rng.choice(len(base), min(self.decode_batch_size, len(base)), replace=False).tolist()
                chosen_ids = {id(base[i]) for i in picked}
                held_back = [r for r in decoding if id(r) not in chosen_ids]
                admit_none = True
            elif len(decoding) > self.decode_batch_size:
                chosen = self._decode_subset(decoding)
                held_back = [r for i, r in enumerate(decoding) if i not in chosen]
        self.base_only = False
        if not held_back:
            try:
                return super()._schedule_step(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = default_budget
        held = {id(r) for r in held_back}
        order = {id(r): i for i, r in enumerate(self.running)}
        self.running = [r for r in self.running if id(r) not in held]
        limits = self.max_num_running_reqs, self.max_num_active_reqs
        self.max_num_running_reqs -= len(held_back)
        self.max_num_active_reqs = len(self.running) if admit_none else self.max_num_active_reqs - len(held_back)
        try:
            return super()._schedule_step(*args, **kwargs)
        finally:
            self.max_num_running_reqs, self.max_num_active_reqs = limits
            self.max_num_scheduled_tokens = default_budget
            merged = self.running + held_back
            self.running = sorted(merged, key=lambda r: order.get(id(r), len(order)))
