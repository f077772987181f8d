"""The reader's checks of the version-4 LoRA adapter columns (`llmvisor.core.trace_schema.LORA_COLUMNS`).

Per slice ``lora_name`` (the adapter its request runs with, empty for the base model) and ``lora_rank`` (the
adapter's rank, 0 for the base model); per step three adapter sets, each a JSON array of names: ``step_loras``, the
distinct adapters the step ran, ``step_lora_loads``, those loaded into a LoRA slot for the step (not resident there
before it), and ``step_lora_disk_loads``, those read from their files for it. A set is written sorted and compact
(`encode_adapters`); the reader takes any order.

Refused here, naming the file and the row, step or run: some of the columns without the others, a rank that does not
fit its adapter (<= 0 for an adapter, anything but 0 for the base model), one adapter with two ranks in a run, a set
that is not a JSON array of distinct non-empty names, a step whose rows disagree on a set, a slice whose adapter is
not in its step's ``step_loras``, a ``step_loras`` naming an adapter no slice of the step runs, and a load of an
adapter the step did not run.
"""

from __future__ import annotations

import json

import numpy as np

from llmvisor.core.trace_schema import (
    LORA_COLUMNS,
    LORA_STEP_COLUMNS,
    columns_together,
    first_disagreement,
    rejection,
    step_place,
)
from llmvisor.errors import plain


def encode_adapters(names) -> str:
    """A set of adapter names as the trace writes it: a JSON array, sorted, without spaces (``["a","b"]``)."""
    return json.dumps(sorted(set(names)), ensure_ascii=False, separators=(",", ":"))


def decode_adapters(text) -> frozenset[str] | None:
    """The set a ``step_lora*`` value names, or None if it is not a JSON array of distinct non-empty strings."""
    if not isinstance(text, str):
        return None
    try:
        names = json.loads(text)
    except ValueError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        return None
    return frozenset(names)


def lora_columns_present(path: str, names) -> bool:
    """Whether the LoRA columns are there; some without the others is refused."""
    return columns_together(path, names, LORA_COLUMNS, "LoRA", 4)


def _codes(values: np.ndarray) -> tuple[np.ndarray, list]:
    """Integer codes of ``values`` (object array) and the distinct values, in order of first appearance."""
    index: dict = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values.tolist()), np.int64, values.size)
    return codes, list(index)


def check_lora_columns(columns: dict, *, path: str, order: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
                       row_numbers: np.ndarray, run_id: np.ndarray, step_id: np.ndarray, request_id: np.ndarray) -> None:
    """Refuse LoRA columns that break the contract (module docstring). ``order`` sorts the rows by (run, step);
    ``starts``/``offsets`` are the sorted steps' first rows; the other arrays are in file order."""
    names = np.asarray(columns["lora_name"], dtype=object)
    ranks = np.asarray(columns["lora_rank"], dtype=np.int64)
    is_base = names == ""
    bad = is_base & (ranks != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise rejection(path, f"row {row_numbers[i]}", f"lora_rank: the base model (empty lora_name) has rank 0 (got {int(ranks[i])})")
    bad = ~is_base & (ranks <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise rejection(path, f"row {row_numbers[i]}", f"lora_rank: an adapter's rank must be >= 1 (got {int(ranks[i])})")
    sets: dict[str, tuple[np.ndarray, list[frozenset]]] = {}
    for column in LORA_STEP_COLUMNS:
        text_codes, texts = _codes(np.asarray(columns[column], dtype=object))
        decoded = [decode_adapters(text) for text in texts]
        if None in decoded:
            i = int(np.argmax(text_codes == decoded.index(None)))
            raise rejection(path, f"row {row_numbers[i]}", f"{column}: expected a JSON array of distinct adapter names "
                                                            f"(got {plain(texts[decoded.index(None)])!r})")
        set_index: dict[frozenset, int] = {}
        per_text = np.array([set_index.setdefault(s, len(set_index)) for s in decoded], dtype=np.int64)
        sets[column] = (per_text[text_codes], list(set_index))
    if not order.size:
        return

    def where(k: int) -> str:
        first = order[starts[k]]
        return step_place(step_id[first], run_id[first], row_numbers[order[offsets[k]:offsets[k + 1]]])

    def shown(adapters: frozenset) -> str:
        return json.dumps(sorted(adapters), ensure_ascii=False)

    step_of_sorted = np.repeat(np.arange(starts.size), np.diff(offsets))
    for column in LORA_STEP_COLUMNS:
        codes, distinct = sets[column]
        found = first_disagreement(codes[order], starts)
        if found is not None:
            k, low, high = found
            raise rejection(path, where(k), f"rows disagree on {column} ({shown(distinct[low])} vs {shown(distinct[high])})")

    step_sets, distinct_sets = sets["step_loras"]
    step_set_code = step_sets[order][starts]
    name_codes, distinct_names = _codes(names)
    sorted_names = name_codes[order]
    sorted_base = is_base[order]
    # every slice's adapter is in its step's set
    pairs = np.unique(np.stack([step_set_code[step_of_sorted][~sorted_base], sorted_names[~sorted_base]]), axis=1)
    for set_code, name_code in pairs.T.tolist():
        if distinct_names[name_code] not in distinct_sets[set_code]:
            rows = np.flatnonzero(~sorted_base & (sorted_names == name_code) & (step_set_code[step_of_sorted] == set_code))
            j = int(rows[0])
            raise rejection(path, where(int(step_of_sorted[j])),
                            f"adapter {plain(distinct_names[name_code])!r} of request {plain(request_id[order[j]])!r} "
                            f"is not in step_loras {shown(distinct_sets[set_code])}")
    # and the set names no adapter the step does not run: as many adapters as the step's distinct slice adapters
    adapter_steps = np.unique(np.stack([step_of_sorted[~sorted_base], sorted_names[~sorted_base]]), axis=1)[0]
    ran = np.bincount(adapter_steps, minlength=starts.size)
    size = np.array([len(s) for s in distinct_sets], dtype=np.int64)[step_set_code]
    extra = np.flatnonzero(size != ran)
    if extra.size:
        k = int(extra[0])
        slice_names = {distinct_names[c] for c, base in zip(sorted_names[offsets[k]:offsets[k + 1]].tolist(),
                                                             sorted_base[offsets[k]:offsets[k + 1]].tolist()) if not base}
        unused = sorted(distinct_sets[step_set_code[k]] - slice_names)
        raise rejection(path, where(k), f"step_loras names adapter {plain(unused[0])!r}, which no slice of the step runs")
    for column in ("step_lora_loads", "step_lora_disk_loads"):
        codes, distinct = sets[column]
        per_step = codes[order][starts]
        for set_code, load_code in np.unique(np.stack([step_set_code, per_step]), axis=1).T.tolist():
            outside = distinct[load_code] - distinct_sets[set_code]
            if outside:
                k = int(np.flatnonzero((step_set_code == set_code) & (per_step == load_code))[0])
                raise rejection(path, where(k), f"{column} names adapter {plain(sorted(outside)[0])!r}, which is not in step_loras")
    # one rank per adapter within a run
    sorted_run = run_id[order]
    run_codes, runs = _codes(sorted_run)
    adapter_rows = np.flatnonzero(~sorted_base)
    if adapter_rows.size:
        keyed = np.stack([run_codes[adapter_rows], sorted_names[adapter_rows], ranks[order][adapter_rows]])
        triples = np.unique(keyed, axis=1)
        same = (triples[0, 1:] == triples[0, :-1]) & (triples[1, 1:] == triples[1, :-1])
        if same.any():
            j = int(np.argmax(same))
            run, name = runs[triples[0, j]], distinct_names[triples[1, j]]
            raise rejection(path, f"run {plain(run)!r}", f"adapter {plain(name)!r} has two ranks ({int(triples[2, j])} and "
                                                         f"{int(triples[2, j + 1])})")
