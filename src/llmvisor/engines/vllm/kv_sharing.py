"""Which context tokens of a step's slices lie in KV blocks that other slices of the step read too (no vLLM).

With prefix caching, requests whose prompts start alike hold the same physical KV blocks for that prefix.
Per slice of a step, with c its context tokens and the first ceil(c / block_size) of its blocks its context
blocks:

- ``num_shared_context_tokens``: its context tokens in blocks that at least one other slice's context holds;
- ``effective_context_tokens``: Σ over its context blocks of (tokens of the block within its context) /
  (number of the step's slices whose context holds the block); c when nothing is shared.

A cached block's hash chains its whole prefix, so shared blocks are a common prefix of the block lists: two
slices can only share a block if they share their first block. Slices are grouped by first block id, and
only groups of two or more are walked, block by block, while two or more of them still hold the same block.
The work is one lookup per slice plus the shared blocks themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence


def shared_context_tokens(
    first_block_ids: Sequence[Hashable | None],
    context_blocks: Callable[[int], Sequence],
    num_context_tokens: Sequence[int],
    block_size: int,
    block_id: Callable[[object], Hashable] | None = None,
) -> tuple[list[int], list[float]]:
    """(num_shared_context_tokens, effective_context_tokens) per slice.

    ``first_block_ids[i]``: id of slice i's first context block, None when it has no context;
    ``context_blocks(i)``: slice i's blocks in order (at least its context blocks), asked only for slices
    whose first block another slice holds too; ``block_id`` maps a block to its id (default: the block is
    its id), applied only to the blocks walked.
    """
    shared = [0] * len(num_context_tokens)
    effective = [float(c) for c in num_context_tokens]
    groups: dict[Hashable, list[int]] = {}
    sharing_any = False
    for i, first in enumerate(first_block_ids):
        if first is None:
            continue
        group = groups.get(first)
        if group is None:
            groups[first] = [i]
        else:
            group.append(i)
            sharing_any = True
    if not sharing_any:
        return shared, effective
    for members in groups.values():
        if len(members) > 1:
            _walk_group(members, context_blocks, block_id, num_context_tokens, block_size, shared, effective)
    return shared, effective


def _walk_group(members, context_blocks, block_id, num_context_tokens, block_size, shared, effective) -> None:
    blocks = {i: context_blocks(i) for i in members}
    num_blocks = {i: min(len(blocks[i]), -(-num_context_tokens[i] // block_size)) for i in members}
    shared_share = dict.fromkeys(members, 0.0)
    active = members
    position = 0
    while len(active) > 1:
        buckets: dict[Hashable, list[int]] = {}
        for i in active:
            if position < num_blocks[i]:
                block = blocks[i][position]
                buckets.setdefault(block if block_id is None else block_id(block), []).append(i)
        active = []
        for holders in buckets.values():
            if len(holders) < 2:
                continue
            for i in holders:
                tokens = min(block_size, num_context_tokens[i] - position * block_size)
                shared[i] += tokens
                shared_share[i] += tokens / len(holders)
            active.extend(holders)
        position += 1
    for i in members:
        effective[i] = shared_share[i] + (num_context_tokens[i] - shared[i])
