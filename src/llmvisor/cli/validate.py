"""`llmvisor validate`: measure exact Shapley values of real vLLM steps and judge every attribution rule by them.

Small batches (2 to 8 requests) have every subset measured (exact Shapley values); with ``--sampled-batches``
serving-size batches (16–64 requests: decode, prefill, mixed and shared-prefix decode steps) are measured along
sampled orders and their Shapley values estimated. vLLM is imported only when measurements are missing
(``llmvisor.engines.vllm.controlled``), so a finished journal is re-analysed without it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer

from llmvisor import extras, shipped
from llmvisor.cli import engine_options as eo
from llmvisor.cli import params
from llmvisor.core.files import replaced_atomically
from llmvisor.core.model import StepLatencyModel
from llmvisor.errors import LlmvisorError
from llmvisor.validation.analysis import HEADLINE_METHOD, Method, build_result, dumps_result, model_step_s, sampled_preparation_s
from llmvisor.validation.measurement import (
    InterferenceGuard,
    Journal,
    measure,
    measure_sampled,
    missing_measurements,
    missing_sampled_steps,
)
from llmvisor.validation.plans import (
    COALITION_KINDS,
    SAMPLED_KINDS,
    SAMPLED_SIZES,
    Design,
    Envelope,
    SharingLayout,
    draw_batches,
    read_length_mixes,
    sampled_plan,
    sampled_run_budget_s,
    tenant_plan,
)


def journal_path_for(output: Path) -> Path:
    """The measurement journal kept next to the result (``RESULT.journal.jsonl``)."""
    return output.with_name(output.name.removesuffix(".json") + ".journal.jsonl")


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--sampled-sizes``: comma-separated batch sizes."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise LlmvisorError(f"--sampled-sizes: comma-separated whole numbers (got {text!r})") from None
    if not sizes:
        raise LlmvisorError("--sampled-sizes: at least one size")
    return sizes


def parse_kinds(text: str) -> tuple[str, ...]:
    """``--sampled-kinds``: comma-separated `SampledKind` names."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in COALITION_KINDS]
    if unknown or not kinds:
        raise LlmvisorError(f"--sampled-kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(COALITION_KINDS)}")
    return kinds


ENGINE_KEYS = ("engine_model_config", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "threads", "dtype")
ENGINE_KEY_DEFAULTS = {"dtype": eo.DTYPE}
"""What a journal header without the key was measured under: ``dtype`` is recorded only when not vLLM's ``auto``, so
every journal measured before it was an option reads as ``auto``."""


def _journal_header(journal_path: Path) -> dict | None:
    """A journal's first line, what it was measured under; None when there is no journal yet."""
    if not journal_path.exists():
        return None
    with open(journal_path, encoding="utf-8") as handle:
        first = handle.readline()
    try:
        header = json.loads(first) if first.strip() else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("type") != "header":
        raise LlmvisorError(f"{journal_path}: not a validation journal (no header line); choose another --output")
    return header


def _check_journal_settings(journal_path: Path, header: dict | None, engine_settings: dict) -> None:
    """Refuse to mix measurements taken under different engine settings in one journal."""
    if header is None:
        return
    recorded = header.get("engine_settings", {})
    def value(settings: dict, key: str):
        return settings.get(key, ENGINE_KEY_DEFAULTS.get(key))

    differing = [k for k in ENGINE_KEYS if value(recorded, k) != value(engine_settings, k)]
    if differing:
        details = ", ".join(f"{k}: journal {value(recorded, k)!r} vs now {value(engine_settings, k)!r}" for k in differing)
        raise LlmvisorError(f"{journal_path}: measured under other engine settings ({details}); use the same settings or another --output")


def _check_journal_method(journal_path: Path, header: dict | None, measuring: str) -> None:
    """Refuse to extend a journal measured by another method than ``measuring`` (the one about to add to it)."""
    if header is None:
        return
    recorded = header.get("measuring", COLD_MEASURING)
    if recorded != measuring:
        raise LlmvisorError(
            f"{journal_path}: measured {recorded} (decode contexts grown and prepared again per "
            f"batch-round), and this llmvisor measures {measuring}; the two differ by more than noise in decode steps (docs/validation.md, "
            "'Measuring speed'), so they are not mixed in one journal: re-analyse it with --no-measure, or measure into another --output")


WARM_MEASURING, COLD_MEASURING = "warm", "cold"
"""A journal's measuring method (its header's ``measuring``): warm (``ControlledEngine(warm=True)``, what `validate`
measures with) or cold, the earlier method; a journal without the key (every one shipped before warm measuring) is cold."""


RESUMED_OPTIONS = {
    "batches": ("batches",),
    "max_batch": ("max_batch",),
    "repeat": ("repeat",),
    "replicate_every": ("replicate_every",),
    "adversarial_fraction": ("adversarial_fraction",),
    "max_prefill_tokens": ("max_prefill_tokens",),
    "max_model_len": ("max_model_len",),
    "max_num_batched_tokens": ("max_num_batched_tokens",),
    "max_num_seqs": ("max_num_seqs",),
    "kv_cache_gib": ("kv_cache_gib",),
    "threads": ("threads",),
    "dtype": ("dtype",),
    "seed": ("seed",),
    "sampled_batches": ("sampled", "batches"),
    "orders": ("sampled", "orders"),
    "sampled_repeat": ("sampled", "repeat"),
    "sampled_sizes": ("sampled", "sizes"),
    "sampled_kinds": ("sampled", "kinds"),
    "design": ("sampled", "design"),
    "coalitions_per_request": ("sampled", "coalitions_per_request"),
    "replicate_share": ("sampled", "replicate_share"),
    "exact_sharing_batches": ("sampled", "exact_sharing_batches"),
    "pools": ("sampled", "pools"),
    "pool_coalitions_per_request": ("sampled", "pool_coalitions_per_request"),
    "pool_chunk": ("sampled", "pool_chunk"),
    "sharing_layout": ("sampled", "sharing_layout"),
    "tenant_batches": ("tenants", "batches"),
    "tenant_sizes": ("tenants", "sizes"),
    "tenant_repeat": ("tenants", "repeat"),
    "tenant_rounds": ("tenants", "rounds"),
}
"""Options a re-run takes from the existing result's settings when not given: `validate -o RESULT` re-analyses (or
resumes) the plan RESULT was measured with, instead of drawing another plan from the defaults."""


_NOT_RECORDED = object()


def settings_of_existing_result(ctx: typer.Context, output: Path, given: dict) -> dict:
    """``given`` with every option left at its default replaced by the value the existing result recorded."""
    if ctx is None or not output.is_file():  # called from Python: every argument counts as given
        return given
    try:
        settings = json.loads(output.read_text(encoding="utf-8")).get("settings", {})
    except (OSError, json.JSONDecodeError, AttributeError):
        return given
    resumed = dict(given)
    for option, path in RESUMED_OPTIONS.items():
        source = ctx.get_parameter_source(option)
        if source is not None and source.name != "DEFAULT":
            continue
        value = settings
        for key in path:
            value = value.get(key, _NOT_RECORDED) if isinstance(value, dict) else _NOT_RECORDED
        if value is _NOT_RECORDED:
            continue
        if option in ("sampled_sizes", "sampled_kinds", "tenant_sizes") and isinstance(value, list):
            value = ",".join(map(str, value))
        resumed[option] = value
    return resumed


def validate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Result JSON; measurements go to RESULT.journal.jsonl beside it, and a re-run resumes from it: options not given are those RESULT was measured with.", dir_okay=False, metavar="RESULT")],
    model: eo.LatencyModel = None,
    engine_model: eo.EngineModel = None,
    batches: Annotated[int, typer.Option(help="Batches to validate (alternating prefill and decode); 0 with --sampled-batches: only those.", min=0)] = 100,
    max_batch: Annotated[int, typer.Option(help="Largest batch (2 to 8); every non-empty subset of a batch is measured.", min=2, max=8)] = 5,
    repeat: Annotated[int, typer.Option(help="Times each subset step is measured; the median is kept.", min=1)] = 3,
    replicate_every: Annotated[int, typer.Option(help="Measure every Nth pair of batches twice, independently, for the noise floor (0: never).", min=0)] = 4,
    adversarial_fraction: Annotated[float, typer.Option(help="Share of batches with one long request among short ones.", min=0, max=1)] = 0.2,
    workloads: Annotated[Path | None, typer.Option(help="Folder with azure-2023-conv.csv, azure-2023-code.csv, arxiv-summarization.csv. Default: the shipped ones.", file_okay=False, metavar="DIR")] = None,
    max_prefill_tokens: Annotated[int | None, typer.Option(help="Most tokens in a prefill batch (default: max_num_batched_tokens).", min=1)] = None,
    max_model_len: eo.MaxModelLen = eo.MAX_MODEL_LEN,
    max_num_batched_tokens: eo.MaxNumBatchedTokens = eo.MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: eo.MaxNumSeqs = eo.MAX_NUM_SEQS,
    kv_cache_gib: eo.KvCacheGib = eo.KV_CACHE_GIB,
    threads: eo.Threads = eo.THREADS,
    dtype: eo.Dtype = eo.DTYPE,
    sampled_batches: Annotated[int, typer.Option(help="Serving-size batches to validate too, their Shapley values estimated from sampled orders (0: none).", min=0)] = 0,
    orders: Annotated[int, typer.Option(help="Sampled orders per serving-size batch (even: each comes with its reverse); every prefix of each is one measured step.", min=2)] = 8,
    sampled_sizes: Annotated[str, typer.Option(help="Sizes of the serving-size batches, comma-separated (each at most --max-num-seqs).", metavar="N,N,...")] = ",".join(map(str, SAMPLED_SIZES)),
    sampled_kinds: Annotated[str, typer.Option(help="Kinds of serving-size batches, comma-separated, cycled.", metavar="KIND,KIND,...")] = ",".join(SAMPLED_KINDS),
    sampled_repeat: Annotated[int, typer.Option(help="Times each prefix step of a serving-size batch is measured (median kept); more orders usually buy more than repeats.", min=1)] = 1,
    design: Annotated[str, typer.Option(help="Serving-size batches measured on 'prefixes' of sampled orders (permutation sampling) or on random complementary 'coalitions' (the regression estimator).", metavar="DESIGN")] = "prefixes",
    coalitions_per_request: Annotated[float, typer.Option(help="With --design coalitions: coalitions measured per request of a batch (× n, plus the full batch).", min=1)] = 4.0,
    replicate_share: Annotated[float, typer.Option(help="With --design coalitions: share of every batch's coalitions measured again, independently (its replicate noise).", min=0, max=1)] = 0.25,
    exact_sharing_batches: Annotated[int, typer.Option(help="With --design coalitions: mixed-sharing decode batches of 6–7 requests (2 prefix groups and own contexts) with every subset measured twice.", min=0)] = 0,
    pools: Annotated[int, typer.Option(help="With --design coalitions: pools of batches sharing one prefill (a batch of the largest size, then largest ÷ s batches of each smaller size s drawn from its requests), after the other batches.", min=0)] = 0,
    pool_coalitions_per_request: Annotated[float | None, typer.Option(help="With --pools: coalitions per request of a pooled batch (default: --coalitions-per-request).", min=1)] = None,
    pool_chunk: Annotated[int | None, typer.Option(help="With --pools: coalitions per guarded batch-round of a pooled batch (default: 32, as the other batches); the held contexts are prepared once per round, and each grows by the steps it runs in it.", min=2)] = None,
    sharing_layout: Annotated[str, typer.Option(help="With --design coalitions: readers of the serving-size mixed-sharing batches in 'groups' (2–3 prefix groups of 30%, 20%, 10% of the batch) or 'pairs' (documents each read by a short question and a long continuation: what tells rules that split a document by position or context length from the equal split).", metavar="LAYOUT")] = "groups",
    tenant_batches: Annotated[int, typer.Option(help="Serving-size batches of 2–4 unequal tenants (heavy, light, one sharing a document, medium) whose tenants' game is measured exactly: every coalition of tenants, --tenant-repeat times per round (0: none).", min=0)] = 0,
    tenant_sizes: Annotated[str, typer.Option(help="Sizes of the tenant batches, comma-separated, cycled (each at most --max-num-seqs).", metavar="N,N,...")] = ",".join(map(str, SAMPLED_SIZES)),
    tenant_repeat: Annotated[int, typer.Option(help="Times each coalition of tenants is measured per round.", min=2)] = 6,
    tenant_rounds: Annotated[int, typer.Option(help="Independent rounds per tenant batch (decode contexts prepared afresh each).", min=1)] = 2,
    guard_max_redos: Annotated[int, typer.Option(help="Times a batch-round the interference guard flags is measured again before it is kept, flagged.", min=0)] = 4,
    guard_max_wait_s: Annotated[float, typer.Option(help="Longest wait for the machine to quieten between redos, in seconds.", min=0)] = 600.0,
    guard_every: Annotated[int, typer.Option(help="Subset steps between the interference guard's canaries within a batch-round "
                                                  "(recorded with the run; fewer canaries measure faster and see a short spell "
                                                  "of load less often).", min=1)] = 8,
    time_limit_s: Annotated[float | None, typer.Option(help="Stop measuring after this many seconds (the batch-round under way is dropped) and write the result of what the journal holds; a re-run resumes.", min=1)] = None,
    measure_missing: Annotated[bool, typer.Option("--measure/--no-measure", help="Measure what the journal lacks (--no-measure: only analyse it).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of the batches and the measuring order.", min=0)] = 0,
    n_bootstrap: params.Bootstrap = 1000,
    keep_steps: Annotated[bool, typer.Option(help="Keep the recorder's trace of every engine step run (RESULT.steps.jsonl).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print only the summary JSON to stdout.")] = False,
    ctx: typer.Context = None,
) -> None:
    """Validate per-request shares against exact Shapley values measured on the real engine."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    options = settings_of_existing_result(ctx, output, {
        "batches": batches, "max_batch": max_batch, "repeat": repeat, "replicate_every": replicate_every,
        "adversarial_fraction": adversarial_fraction, "max_prefill_tokens": max_prefill_tokens,
        "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
        "kv_cache_gib": kv_cache_gib, "threads": threads, "dtype": dtype, "seed": seed, "sampled_batches": sampled_batches,
        "orders": orders, "sampled_repeat": sampled_repeat, "sampled_sizes": sampled_sizes, "sampled_kinds": sampled_kinds,
        "design": design, "coalitions_per_request": coalitions_per_request, "replicate_share": replicate_share,
        "exact_sharing_batches": exact_sharing_batches, "pools": pools, "pool_coalitions_per_request": pool_coalitions_per_request,
        "pool_chunk": pool_chunk, "sharing_layout": sharing_layout, "tenant_batches": tenant_batches, "tenant_sizes": tenant_sizes, "tenant_repeat": tenant_repeat,
        "tenant_rounds": tenant_rounds,
    })
    batches, max_batch, repeat, replicate_every = options["batches"], options["max_batch"], options["repeat"], options["replicate_every"]
    adversarial_fraction, max_prefill_tokens = options["adversarial_fraction"], options["max_prefill_tokens"]
    max_model_len, max_num_batched_tokens, max_num_seqs = options["max_model_len"], options["max_num_batched_tokens"], options["max_num_seqs"]
    kv_cache_gib, threads, seed = options["kv_cache_gib"], options["threads"], options["seed"]
    dtype = eo.check_dtype(options["dtype"])
    sampled_batches, orders, sampled_repeat = options["sampled_batches"], options["orders"], options["sampled_repeat"]
    sampled_sizes, sampled_kinds = options["sampled_sizes"], options["sampled_kinds"]
    design, coalitions_per_request = options["design"], options["coalitions_per_request"]
    replicate_share, exact_sharing_batches = options["replicate_share"], options["exact_sharing_batches"]
    pools, pool_coalitions_per_request, pool_chunk = options["pools"], options["pool_coalitions_per_request"], options["pool_chunk"]
    tenant_batches, tenant_repeat, tenant_rounds = options["tenant_batches"], options["tenant_repeat"], options["tenant_rounds"]
    tenant_sizes, sharing_layout = options["tenant_sizes"], options["sharing_layout"]
    if pools and design != Design.COALITIONS:
        raise LlmvisorError("--pools: only with --design coalitions")
    if design not in tuple(Design):
        raise LlmvisorError(f"--design: {design!r} is not one of {', '.join(Design)}")
    if sharing_layout not in tuple(SharingLayout):
        raise LlmvisorError(f"--sharing-layout: {sharing_layout!r} is not one of {', '.join(SharingLayout)}")
    if sharing_layout != SharingLayout.GROUPS and design != Design.COALITIONS:
        raise LlmvisorError("--sharing-layout pairs: only with --design coalitions")
    model = model if model is not None else shipped.latency_model_path()
    latency_model = StepLatencyModel.from_json(model)
    if repeat < 1:
        raise LlmvisorError(f"--repeat: must be at least 1 (got {repeat})")
    if replicate_every < 0:
        raise LlmvisorError(f"--replicate-every: must be 0 or more (got {replicate_every})")
    if n_bootstrap < 0:
        raise LlmvisorError(f"--bootstrap: must be 0 or more (got {n_bootstrap})")
    if output.suffix.lower() != ".json":
        raise LlmvisorError(f"{output}: the result must be a .json file")
    params.check_output_file(output)
    engine_dir = engine_model if engine_model is not None else shipped.engine_model_dir()
    config_path = engine_dir / "config.json"
    if not config_path.is_file():
        raise LlmvisorError(f"{engine_dir}: no config.json in the engine model folder")
    mixes = read_length_mixes(workloads if workloads is not None else shipped.workloads_dir())
    envelope = Envelope(max_model_len, max_num_batched_tokens, max_num_seqs)
    specs, length_rules = [], {}
    if batches or not (sampled_batches or tenant_batches):
        specs, length_rules = draw_batches(
            mixes,
            envelope,
            n_batches=batches,
            max_batch=max_batch,
            adversarial_fraction=adversarial_fraction,
            replicate_every=replicate_every,
            max_prefill_tokens=max_prefill_tokens,
            seed=seed,
        )

    sampled_specs = []
    if sampled_batches < 0:
        raise LlmvisorError(f"--sampled-batches: must be 0 or more (got {sampled_batches})")
    if sampled_repeat < 1:
        raise LlmvisorError(f"--sampled-repeat: must be at least 1 (got {sampled_repeat})")
    sampled_settings = {
        "design": design, "batches": sampled_batches, "orders": orders, "repeat": sampled_repeat, "antithetic": design == Design.PREFIXES,
        "sizes": list(parse_sizes(sampled_sizes)), "kinds": list(parse_kinds(sampled_kinds)),
    }
    if design == Design.COALITIONS:
        sampled_settings |= {"coalitions_per_request": coalitions_per_request, "replicate_share": replicate_share,
                             "exact_sharing_batches": exact_sharing_batches, "exact_sharing_sizes": [6, 7], "chunk": 32}
        if pools:
            sampled_settings |= {"pools": pools, "pool_coalitions_per_request": pool_coalitions_per_request}
            if pool_chunk is not None:
                sampled_settings["pool_chunk"] = pool_chunk
        if sharing_layout != SharingLayout.GROUPS:  # recorded only when chosen: earlier results re-draw as they were
            sampled_settings["sharing_layout"] = sharing_layout
    if sampled_batches or (design == Design.COALITIONS and exact_sharing_batches):
        sampled_specs = sampled_plan(mixes, envelope, sampled_settings, seed=seed)

    tenant_settings = {"batches": tenant_batches, "sizes": list(parse_sizes(tenant_sizes)), "tenant_counts": [2, 3, 4],
                       "phases": ["decode", "prefill"], "repeat": tenant_repeat, "rounds": tenant_rounds,
                       "max_prefill_tokens": max_prefill_tokens}
    tenant_specs = tenant_plan(mixes, envelope, tenant_settings, seed=seed) if tenant_batches else []

    engine_settings = {
        "engine_model_config": json.loads(config_path.read_text(encoding="utf-8")),
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
        "threads": threads,
        **({"dtype": dtype} if dtype != eo.DTYPE else {}),  # as every journal before the option: vLLM's auto
    }
    journal_path = journal_path_for(output)
    packed = journal_path.with_name(journal_path.name + ".gz")
    if not journal_path.exists() and packed.exists():
        # A shipped result carries its journal compressed: unpack it, so this run re-analyses (or extends) it.
        with gzip.open(packed, "rb") as source, open(journal_path, "wb") as target:
            shutil.copyfileobj(source, target)
    header = _journal_header(journal_path)
    _check_journal_settings(journal_path, header, engine_settings)
    journal = Journal(journal_path)
    if header is None:
        journal.write_header({"engine_settings": engine_settings, "seed": seed, "measuring": WARM_MEASURING})
    todo = missing_measurements(specs, journal, repeat)
    n_missing_exact = sum(len(masks) for masks in todo.values())
    n_missing_sampled = missing_sampled_steps([*sampled_specs, *tenant_specs], journal, sampled_repeat)
    n_missing = n_missing_exact + n_missing_sampled
    if n_missing and measure_missing:
        _check_journal_method(journal_path, header, WARM_MEASURING)
    budget_s = sampled_run_budget_s(sampled_specs, model_step_s(latency_model), repeat=sampled_repeat) if sampled_specs else 0.0
    preparation_s = sampled_preparation_s(sampled_specs, latency_model) if sampled_specs else 0.0
    if sampled_specs:
        n_steps = sum(len(b.subsets(r)) for b in sampled_specs for r in range(b.rounds)) * sampled_repeat
        console.print(
            f"[bold]validate[/]: {len(sampled_specs)} "
            + (f"sampled batches × {orders} orders" if design == Design.PREFIXES else "serving-size batches on random coalitions")
            + f": {n_steps} subset steps, "
            f"{budget_s / 60:.1f} min of controlled steps by the model, about {preparation_s / 60:.1f} min more preparing "
            f"decode contexts ({n_missing_sampled} steps still to measure; warm-up and canaries come on top)"
        )

    engine_facts: dict = {}
    counts = {"measured_now": 0, "rejected_now": 0}
    journal_before = {k: list(v) for k, v in journal.measurements.items()}
    rejected_before, discarded_before = journal.n_rejected, len(journal.interference)
    started = time.perf_counter()
    invoked = time.monotonic()
    time_up = False

    def advance(progress, task, n: int) -> None:
        progress.advance(task, n)
        if time_limit_s is not None and time.monotonic() - invoked > time_limit_s:
            raise _TimeUp

    if n_missing and measure_missing:
        extras.require("llmvisor validate (measuring on the engine)", "vllm")
        from llmvisor.engines.vllm.controlled import ControlledEngine

        console.print(f"[bold]validate[/]: {n_missing} subset steps to measure on {engine_dir} (journal {journal_path})")
        with ControlledEngine(
            engine_dir,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            kv_cache_gib=kv_cache_gib,
            num_threads=threads,
            dtype=dtype,
            trace_path=output.with_name(output.name.removesuffix(".json") + ".steps.jsonl") if keep_steps else None,
            seed=seed,
            run_id=f"validate-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}",
        ) as engine:
            engine_facts = engine.describe()
            prefill = next((b for b in [*specs, *sampled_specs, *tenant_specs] if b.phase == "prefill"), None)
            decode = next((b for b in [*specs, *sampled_specs, *tenant_specs] if b.phase == "decode"), None)
            engine.warm_up(
                prefill_lengths=list(prefill.num_new_tokens) if prefill else [16, 32],
                decode_contexts=list(decode.num_context_tokens) if decode else [16, 32],
                n_steps=3,
            )
            with Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                disable=json_output and not console.is_terminal,
            ) as progress:
                task = progress.add_task("subset steps", total=n_missing)
                guard = InterferenceGuard(max_redos=guard_max_redos, max_wait_s=guard_max_wait_s, every=guard_every)
                try:
                    counts = measure(engine, specs, journal, repeat=repeat, seed=seed, guard=guard, on_step=lambda n: advance(progress, task, n))
                    if n_missing_sampled:
                        more = measure_sampled(
                            engine, measuring_order(sampled_specs) + tenant_specs, journal, repeat=sampled_repeat, seed=seed, guard=guard,
                            on_step=lambda n: advance(progress, task, n),
                        )
                        counts = {k: counts.get(k, 0) + more.get(k, 0) for k in {*counts, *more}}
                except _TimeUp:
                    time_up = True
                    now = Journal(journal_path)
                    counts = {"measured_now": sum(len(v) for v in now.measurements.values()) - sum(len(v) for v in journal_before.values()),
                              "rejected_now": now.n_rejected - rejected_before, "discarded_batch_rounds": len(now.interference) - discarded_before}
                    journal = now
                    console.print(f"[bold]validate[/]: --time-limit-s {time_limit_s:g} reached; a re-run resumes from the journal")
    measure_s = time.perf_counter() - started

    previous_runs: list[dict] = []
    if output.exists():
        try:
            previous_runs = list(json.loads(output.read_text(encoding="utf-8")).get("settings", {}).get("measurement_runs", []))
        except (OSError, json.JSONDecodeError, AttributeError):
            previous_runs = []
    if counts.get("measured_now"):
        previous_runs.append(
            {
                "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "measured_steps": counts.get("measured_now", 0),
                "rejected_steps": counts.get("rejected_now", 0),
                "discarded_batch_rounds": counts.get("discarded_batch_rounds", 0),
                "flagged_batch_rounds": counts.get("flagged_batch_rounds", 0),
                "guard_max_redos": guard_max_redos,
                "guard_max_wait_s": guard_max_wait_s,
                "guard_carry_s": guard.carry_s,
                "guard_every": guard_every,
                "stopped_by_time_limit": time_up,
                "wall_s": round(measure_s, 1),
                **engine_facts,
            }
        )
    model_bytes = Path(model).read_bytes()
    settings = {
        "model": shipped.portable_path(model),
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "model_boundary_new_tokens": latency_model.boundary_,
        "model_segments": latency_model.to_dict()["segments"],
        "engine_model_dir": shipped.portable_path(engine_dir),
        **{k: val for k, val in engine_settings.items() if k != "engine_model_config"},
        "engine_model_config": engine_settings["engine_model_config"],
        "kv_cache_gib": kv_cache_gib,
        "batches": batches,
        "min_batch": 2,
        "max_batch": max_batch,
        "repeat": repeat,
        "replicate_every": replicate_every,
        "adversarial_fraction": adversarial_fraction,
        "max_prefill_tokens": max_prefill_tokens,
        "seed": seed,
        "workloads": [f"{m.name}.csv" for m in mixes],
        "length_rules": length_rules,
        "journal": journal_path.name,
        "measurement_runs": previous_runs,
    }
    if sampled_specs:
        settings["sampled"] = {**sampled_settings, "model_budget_s": round(budget_s, 1), "model_preparation_s": round(preparation_s, 1)}
    if tenant_specs:
        settings["tenants"] = tenant_settings
    if previous_runs and previous_runs[-1].get("engine"):
        settings["engine"] = previous_runs[-1]["engine"]
    result = build_result(specs, journal, latency_model, repeat=repeat, n_bootstrap=n_bootstrap, seed=seed, settings=settings,
                          sampled_batches=sampled_specs, sampled_repeat=sampled_repeat, agreement_orders=max(orders, 4))
    if design == Design.COALITIONS:
        from llmvisor.validation.coalitions import (
            analyse_coalition_batch,
            batch_record_json,
            coalition_summary,
            jsonable,
            measurement_cost,
            permutation_reference,
            sharing_own_terms,
        )

        coalition_records = [r for r in (analyse_coalition_batch(b, journal, latency_model, sampled_repeat) for b in sampled_specs) if r is not None]
        shipped_result = shipped.result_path(shipped.VALIDATION_RESULT)
        reference = permutation_reference(json.loads(shipped_result.read_text(encoding="utf-8"))) if shipped_result.is_file() else None
        if coalition_records:
            result["summary"] = {**result["summary"], **jsonable(coalition_summary(coalition_records, permutation_reference=reference, seed=seed))}
            result["summary"]["measurement_cost"] = jsonable(measurement_cost(journal, previous_runs))
            own_terms = sharing_own_terms(sampled_specs, journal, coalition_records, latency_model)
            if own_terms is not None:
                result["summary"]["sharing_own_terms"] = jsonable(own_terms)
        result["n_sampled_batches_measured"] = len(coalition_records)
        result["sampled_batches"] = [batch_record_json(r) for r in coalition_records]
    if tenant_specs:
        from llmvisor.validation.coalitions import jsonable
        from llmvisor.validation.tenants import analyse_tenant_batch, tenant_summary

        tenant_records = [r for r in (analyse_tenant_batch(b, journal, latency_model) for b in tenant_specs) if r is not None]
        result["summary"]["tenants"] = jsonable(tenant_summary(tenant_records, n_bootstrap=n_bootstrap, seed=seed))
        result["n_tenant_batches_planned"] = len(tenant_specs)
        result["tenant_batches"] = jsonable(tenant_records)
    with replaced_atomically(output) as tmp:
        Path(tmp).write_text(dumps_result(result), encoding="utf-8")
    if json_output:
        typer.echo(json.dumps(result["summary"], indent=2))
    else:
        print_summary(console, result)
        sampled_note = f", {result['n_sampled_batches_measured']} sampled" if sampled_specs else ""
        console.print(f"wrote {output} ({result['n_batches_measured']} batches{sampled_note}; journal {journal_path.name})")


class _TimeUp(Exception):
    """--time-limit-s reached while measuring."""


def measuring_order(batches: list) -> list:
    """The order serving-size batches are measured in: two exact ones, the first cycle's largest batches, the other
    exact ones, the pooled batches (a pool's together, each prefill shared by more batches), then each cycle of kinds and sizes largest first (a run cut short has exact batches and the largest
    batches of every kind); a batch's journal key does not depend on it."""
    exact = [b for b in batches if b.coalitions and b.size < 16 and len(b.coalitions) == (1 << b.size) - 1]
    pooled = [b for b in batches if getattr(b, "pool_index", ())]  # in plan order: each pool's batches together, sharing its prefill
    rest = [b for b in batches if b not in exact and b not in pooled]
    cycle = max(1, len({(b.kind, b.size) for b in rest}))
    rest = sorted(rest, key=lambda b: (rest.index(b) // cycle, -b.size, rest.index(b)))
    largest = [b for b in rest[:cycle] if b.size == rest[0].size] if rest else []
    return exact[:2] + largest + exact[2:] + pooled + [b for b in rest if b not in largest]


def goal_line(summary: dict, phase: str) -> str:
    """The phase's goals, each with its threshold and whether it was met, as one line of words."""
    goal, met = summary.get("goal", {}), summary.get("goal_met", {}).get(phase) or {}

    def verdict(key: str) -> str:
        return {True: "met", False: "not met"}.get(met.get(key), "not judged")

    parts = []
    if "median" in met:
        parts.append(f"p50 ≤ {100 * goal.get('median_max', float('nan')):.0f}% of the step {verdict('median')}")
    if "p90" in met:
        parts.append(f"p90 ≤ {100 * goal.get('p90_max', float('nan')):.0f}% {verdict('p90')}")
    if "vs_token_count" in met:
        parts.append(f"p90 ≥ {goal.get('p90_improvement_vs_token_count_min', float('nan')):g}× better than token_count {verdict('vs_token_count')}")
    return f"{phase} goals of {HEADLINE_METHOD}: " + ("; ".join(parts) if parts else "not judged")


SUMMARY_METHODS = (
    Method.SHAPLEY,
    Method.SHAPLEY_PREDICTED,
    Method.PROPORTIONAL,
    Method.PAPER,
    Method.MODEL_EXACT_SHAPLEY,
    Method.TOKEN_COUNT,
    Method.EQUAL_SPLIT,
    Method.MEASURED_ADDITIVE_FIT,
)


def print_summary(console, result: dict) -> None:
    """A rich table: error quantiles per method and phase, with the noise floor and the LOO gap."""
    from rich.table import Table

    summary = result["summary"]
    tenants = summary.get("tenants")
    if tenants and tenants.get("by_size"):
        from llmvisor.validation.tenants import headline_sentences

        for sentence in headline_sentences(tenants):
            console.print(f"tenants, {sentence}")
    if not summary or set(summary) == {"tenants"}:
        console.print("no batch fully measured yet" if not tenants else "")
        return

    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}%"

    table = Table(title="|share − measured Shapley| / step time")
    for column in ("phase", "method", "p50 [95% CI]", "p90 [95% CI]", "p99", "p90 gain vs tokens"):
        table.add_column(column, justify="right" if column != "method" else "left")
    for phase, tables in summary.get("errors", {}).items():
        for method in SUMMARY_METHODS:
            m = tables["shapley"].get(method)
            if not m:
                continue
            gain = summary["improvement_vs_token_count"][phase].get(method)
            table.add_row(
                phase,
                method,
                f"{pct(m['p50'])} [{pct(m['p50_ci95'][0])}, {pct(m['p50_ci95'][1])}]",
                f"{pct(m['p90'])} [{pct(m['p90_ci95'][0])}, {pct(m['p90_ci95'][1])}]",
                pct(m["p99"]),
                "–" if gain is None else f"{gain:.2f}×",
            )
    if summary.get("errors"):
        console.print(table)
    for phase in summary.get("errors", {}):
        floor = summary["noise_floor"]["shapley"].get(phase, {})
        gap = summary["loo_sum_gap_fraction"].get(phase, {})
        step = summary["noise_floor"]["step"].get(phase, {})
        console.print(
            f"{phase}: noise floor of measured Shapley p50 {pct(floor.get('p50'))} p90 {pct(floor.get('p90'))}; "
            f"step repeat spread p50 {pct(step.get('p50'))} p90 {pct(step.get('p90'))}; "
            f"(Σ LOO − T)/T median {pct(gap.get('p50'))}"
        )
        console.print(goal_line(summary, phase))
    estimator = summary.get("estimator")
    if estimator:
        console.print(f"coalitions: exact coverage of the regression's 95% intervals {pct(estimator.get('exact_coverage_95'))}; "
                      f"half-width ratio vs permutation (equal steps) {estimator.get('halfwidth_ratio_vs_permutation')}; "
                      f"half-width ÷ share p50 {summary['sampled'].get('halfwidth_over_share_p50')}")
    for kind, entry in summary.get("sampled", {}).items():
        if "errors" not in entry:
            continue
        errors = entry["errors"]
        cells = "; ".join(
            f"{m} p50 {pct(errors[m]['p50'])} p90 {pct(errors[m]['p90'])}" for m in (Method.SHAPLEY, Method.TOKEN_COUNT) if m in errors
        )
        width = entry["estimate_ci95_half_width_fraction_of_step"]
        console.print(f"{kind} ({entry['n_batches']} batches, sizes {entry['sizes']}): |share − estimated Shapley| / T: {cells}; "
                      f"estimate's 95% half-width p50 {pct(width.get('p50'))} p90 {pct(width.get('p90'))}")
    agreement = summary.get("sampler_agreement")
    if agreement and agreement["n_batches"]:
        err = agreement["abs_error_fraction_of_step"]
        console.print(f"sampler vs exact ({agreement['n_batches']} exact batches, {agreement['n_orders']} orders): |φ̂ − φ| / T "
                      f"p50 {pct(err['p50'])} p90 {pct(err['p90'])}; 95% intervals hold the exact value for {pct(agreement['ci95_coverage'])}")
