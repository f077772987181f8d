"""The `llmvisor` command line. Errors a user can cause end as one line on stderr and exit code 2."""

from __future__ import annotations

import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
import typer.core
import typer.main
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from llmvisor import __version__, extras
from llmvisor.cli import params
from llmvisor.cli.console import print_table, stderr, stdout
from llmvisor.errors import LlmvisorError

ClickException = getattr(typer, "TyperException", None)  # typer 0.2x: the base of the click errors it raises
if ClickException is None:  # older typer raises click's own
    from click.exceptions import ClickException

ADAPTERS: dict[str, dict[str, tuple[str, str, tuple[str, ...]]]] = {
    "": {
        "profile": ("llmvisor.cli.profile", "profile", ("vllm",)),
        "calibrate": ("llmvisor.cli.calibrate", "calibrate", ()),
        "validate": ("llmvisor.cli.validate", "validate", ()),
        "serve": ("llmvisor.cli.serve", "serve", ("service",)),
        "load": ("llmvisor.cli.load", "load", ("service",)),
        "refit": ("llmvisor.cli.models", "refit", ("service",)),
        "adjust": ("llmvisor.cli.models", "adjust", ("service",)),
        "export": ("llmvisor.cli.export", "export", ("service", "export")),
        "close-period": ("llmvisor.cli.export", "close_period", ("service",)),
        "audit": ("llmvisor.cli.audit", "audit", ("service", "archive")),
    },
    "prices": {
        "add": ("llmvisor.cli.prices", "prices_add", ("service",)),
        "list": ("llmvisor.cli.prices", "prices_list", ("service",)),
    },
    "models": {
        "add": ("llmvisor.cli.models", "models_add", ("service",)),
        "list": ("llmvisor.cli.models", "models_list", ("service",)),
        "activate": ("llmvisor.cli.models", "models_activate", ("service",)),
    },
    "keys": {
        "create": ("llmvisor.cli.serve", "keys_create", ("service",)),
        "list": ("llmvisor.cli.serve", "keys_list", ("service",)),
        "revoke": ("llmvisor.cli.serve", "keys_revoke", ("service",)),
    },
    "ledger": {"migrate": ("llmvisor.cli.serve", "ledger_migrate", ("service",))},
    "experiment": {
        "fairness": ("llmvisor.cli.experiment", "fairness", ("vllm", "report")),
        "fairness-memory": ("llmvisor.cli.experiment", "fairness_memory", ("vllm", "report")),
        "admission": ("llmvisor.cli.experiment", "admission", ("vllm",)),
        "fleet": ("llmvisor.cli.experiment", "fleet", ("vllm", "report")),
        "calibration": ("llmvisor.cli.experiment", "calibration", ("vllm", "service")),
    },
}
"""Commands whose code lives beside its domain, by group: (module, function, extras it needs). They are
imported only when run or listed in help, so `llmvisor fit` never imports the service, an engine or a plot."""


TYPER_SETTINGS = {"add_completion": False, "pretty_exceptions_enable": False, "rich_markup_mode": None}
"""Every Typer app of the command line: plain (click) help, which wraps the help text and never cuts an option
name, where rich's help table cuts long names at 80 columns; tracebacks of real bugs stay plain too."""


class AdapterGroup(TyperGroup):
    """A command group that also offers the ADAPTERS of its group, each imported on first use.

    Every command it hands out gets readable metavars (`params.tidy`) and has old option spellings rewritten
    with a warning (`params.rename_deprecated`); command-line mistakes click finds (a missing option, a count
    below its floor) end as one line on stderr and exit 2, as user errors do.
    """

    group = ""

    def list_commands(self, ctx):
        return [*super().list_commands(ctx), *ADAPTERS[self.group]]

    def get_command(self, ctx, name):
        if name in ADAPTERS[self.group] and name not in self.commands:
            self.commands[name] = adapter_command(" ".join(filter(None, ("llmvisor", self.group, name))), *ADAPTERS[self.group][name])
            self.commands[name].name = name
        command = super().get_command(ctx, name)
        return command if command is None else params.tidy(command, ctx)

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and not isinstance(command, TyperGroup):
            rest = params.rename_deprecated(command, rest, warn)
        return name, command, rest

    def format_help(self, ctx, formatter):
        params.tidy(self, ctx)
        return super().format_help(ctx, formatter)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # its message is the help (typer tells it by name too)
                error.show()
                sys.exit(error.exit_code)
            context = getattr(error, "ctx", None)
            see = f" (see `{context.command_path} --help`)" if context is not None else ""
            stderr.print(f"[bold red]error:[/] {escape(error.format_message())}{escape(see)}", highlight=False, soft_wrap=True)
            sys.exit(2 if error.exit_code == 2 else error.exit_code)
        except typer.Abort:
            stderr.print("aborted", highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def warn(message: str) -> None:
    stderr.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def adapter_group(group: str) -> type[AdapterGroup]:
    return type(f"AdapterGroup[{group or 'llmvisor'}]", (AdapterGroup,), {"group": group})


def adapter_command(command_line: str, module: str, function: str, needs: tuple[str, ...]):
    """The command `function` of `module`; with its extra missing, one whose --help still shows its options (and
    the extra to install) and which otherwise prints the install hint and exits 2, whatever the arguments."""
    missing = extras.missing_modules(*needs)
    hint = extras.hint(command_line, *needs, missing=missing) if missing else None
    try:
        callback = getattr(importlib.import_module(module), function)
    except ImportError:
        if hint is None:
            raise
        return missing_extra_command(hint)
    single = typer.Typer(**TYPER_SETTINGS)
    if hint is None:
        if "vllm" in needs:
            callback = checking_torch_addons(command_line, callback)
        single.command()(user_errors(callback))
        return typer.main.get_command(single)
    summary = f"(not installed) {hint}"
    single.command(cls=NeedsExtraCommand, help=f"{summary}\n\n{callback.__doc__ or ''}")(callback)
    command = typer.main.get_command(single)
    command.hint = hint
    return command


class NeedsExtraCommand(typer.core.TyperCommand):
    """A command whose extra is missing: --help shows its options; any other use prints the hint, exit 2."""

    hint = ""

    def parse_args(self, ctx, args):
        words = args[: args.index("--")] if "--" in args else args
        if any(word in ctx.help_option_names for word in words):
            return super().parse_args(ctx, args)
        stderr.print(f"[bold red]error:[/] {escape(self.hint)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)


def checking_torch_addons(command_line: str, command):
    """``command`` preceded by the check that vLLM can start in this install (``extras.check_torch_addons``);
    run, not at help time, since it imports torch."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        extras.check_torch_addons(command_line)
        return command(*args, **kwargs)

    return wrapper


def missing_extra_command(message: str):
    """Stands in for a command whose module cannot be imported without its extra: one line and exit 2."""
    single = typer.Typer(**TYPER_SETTINGS)

    @single.command(
        help=f"(not installed) {message}",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    def missing_extra(ctx: typer.Context) -> None:
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)

    return typer.main.get_command(single)


app = typer.Typer(
    name="llmvisor",
    help="Measure, model and attribute co-batched LLM engine steps to requests and tenants.",
    no_args_is_help=True,
    cls=adapter_group(""),
    **TYPER_SETTINGS,
)
keys_app = typer.Typer(cls=adapter_group("keys"), help="API keys of the accounting service.", no_args_is_help=True, **TYPER_SETTINGS)
app.add_typer(keys_app, name="keys")
ledger_app = typer.Typer(cls=adapter_group("ledger"), help="The accounting service's ledger database.", no_args_is_help=True, **TYPER_SETTINGS)
app.add_typer(ledger_app, name="ledger")
models_app = typer.Typer(cls=adapter_group("models"), help="Fitted models per engine class (the service's registry).", no_args_is_help=True, **TYPER_SETTINGS)
app.add_typer(models_app, name="models")
prices_app = typer.Typer(cls=adapter_group("prices"), help="Prices per engine class (the price book).", no_args_is_help=True, **TYPER_SETTINGS)
app.add_typer(prices_app, name="prices")
experiment_app = typer.Typer(cls=adapter_group("experiment"), help="Experiments on the real engine.", no_args_is_help=True, **TYPER_SETTINGS)
app.add_typer(experiment_app, name="experiment")


def print_version(value: bool) -> None:
    if value:
        stdout.print(f"llmvisor {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def llmvisor_options(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", callback=print_version, is_eager=True)] = False,
) -> None:
    """Measure, model and attribute co-batched LLM engine steps to requests and tenants."""


TracePaths = Annotated[list[Path], typer.Argument(help="Step-trace files (.jsonl, .csv, .parquet).", metavar="TRACE", dir_okay=False)]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print only JSON to stdout.")]


def user_errors(command):
    """Turn an LlmvisorError into one line on stderr and exit code 2; anything else stays loud."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except LlmvisorError as error:
            stderr.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _parse_segments(text: str):
    if text in ("auto", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise LlmvisorError(f"--segments: expected auto, none or a number of tokens, got {text!r}") from None
    if not value > 0:
        raise LlmvisorError(f"--segments: a boundary must be > 0 tokens, got {text!r}")
    return value


def _parse_threshold(text: str):
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise LlmvisorError(f"--outlier-threshold: expected a number or none, got {text!r}") from None
    if not value > 0:
        raise LlmvisorError(f"--outlier-threshold: must be > 0, got {text!r}")
    return value


def model_params(segments: str, ols: bool, outlier_threshold: str, keep_warmup: bool) -> dict:
    return {
        "segments": _parse_segments(segments),
        "positive": not ols,
        "outlier_threshold": _parse_threshold(outlier_threshold),
        "drop_warmup": not keep_warmup,
    }


SegmentsOption = Annotated[str, typer.Option(help="auto (cross-validated boundary or none), none, or a boundary in new tokens per step.", metavar="auto|none|N")]
OlsOption = Annotated[bool, typer.Option("--ols", help="Plain least squares (the paper's variant) instead of NNLS.")]
OutlierOption = Annotated[str, typer.Option(help="Drop steps slower than the first fit by median + K·MAD of relative residuals; 'none' keeps all.", metavar="K|none")]
WarmupOption = Annotated[bool, typer.Option("--keep-warmup", help="Fit on steps marked is_warmup too.")]


def coefficient_table(model) -> Table:
    table = Table(title="Coefficients (seconds per unit)")
    table.add_column("feature")
    for name in model.segment_names_:
        table.add_column(name, justify="right")
    for k, feature in enumerate(model.feature_names_):
        table.add_row(feature, *(f"{coef[k]:.4g}" for coef in model.coef_))
    return table


@app.command()
@user_errors
def fit(
    traces: TracePaths,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the model JSON.", dir_okay=False, metavar="FILE")],
    segments: SegmentsOption = "auto",
    ols: OlsOption = False,
    outlier_threshold: OutlierOption = "5",
    keep_warmup: WarmupOption = False,
    json_output: JsonFlag = False,
) -> None:
    """Fit the step-latency model on traces and save it as versioned JSON."""
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.core.trace import read_traces

    params.check_output_file(output)
    trace = read_traces(traces)
    model = StepLatencyModel(**model_params(segments, ols, outlier_threshold, keep_warmup)).fit(trace)
    model.to_json(output)
    info = model.fit_info_
    if json_output:
        print_json({"output": str(output), "boundary_new_tokens": model.boundary_, "model": model.to_dict()})
        return
    print_table(coefficient_table(model), stderr)
    boundary = "none" if model.boundary_ is None else f"{model.boundary_:g} new tokens per step"
    if info["boundary_search"].get("reason"):
        boundary += f" ({info['boundary_search']['reason']})"
    stderr.print(
        f"steps: {info['n_steps_used']} used of {info['n_steps_total']} "
        f"({info['n_warmup_dropped']} warm-up, {info['n_outliers_dropped']} outliers dropped); "
        f"boundary: {boundary}; train relative error p50 {info['train_rel_err_p50']:.1%}, p90 {info['train_rel_err_p90']:.1%}",
        highlight=False,
    )
    if info["unidentified_features"]:
        stderr.print(f"not identified by these traces (held at 0): {', '.join(info['unidentified_features'])}")
    stderr.print(f"wrote {output}")


def evaluation_table(result: dict, models: dict | None = None, steps: str = "") -> Table:
    """The error table of ``models`` (default: ``result["models"]``), titled with the test runs and ``steps``."""
    table = Table(title=f"Held-out step-latency error{steps} (test runs: {', '.join(result['test_runs'])})")
    for column in ("model", "phase", "steps", "R²", "p50", "p90 [95% CI]", "p99 [95% CI]", "signed p50 [95% CI]", "signed p10 / p90"):
        table.add_column(column, justify="right" if column not in ("model", "phase") else "left")
    for name, phases in (result["models"] if models is None else models).items():
        for phase, metrics in phases.items():
            if not metrics.get("n_steps"):
                continue

            def cell(key: str, sign: str = "", metrics: dict = metrics) -> str:
                ci = metrics.get(f"{key}_ci95")
                text = f"{metrics[key]:{sign}.1%}"
                return text + (f" [{ci[0]:{sign}.1%}, {ci[1]:{sign}.1%}]" if ci else "")

            r2 = metrics.get("r2")
            table.add_row(
                name,
                phase,
                str(metrics["n_steps"]),
                "-" if r2 is None else f"{r2:.3f}",
                cell("rel_err_p50"),
                cell("rel_err_p90"),
                cell("rel_err_p99"),
                cell("signed_err_p50", "+"),
                f"{metrics['signed_err_p10']:+.1%} / {metrics['signed_err_p90']:+.1%}",
            )
    return table


def unseen_phase_lines(result: dict) -> list[str]:
    """One line per model that predicted steps of a phase its training steps never held."""
    lines = []
    for name, phases in result["models"].items():
        counts = {phase: phases[phase].get("n_unseen_phase_fallback", 0) for phase in ("prefill", "decode")}
        if any(counts.values()):
            held = ", ".join(f"{n} {phase}" for phase, n in counts.items() if n)
            lines.append(f"{name}: predicted {held} step(s) of a phase absent from its training steps (extrapolated from the other phase)")
    return lines


def noise_floor_line(result: dict) -> str:
    from llmvisor.profile.stats import floor_text

    parts = []
    for which, floor in result.get("noise_floor", {}).items():
        if floor:
            parts.append(f"{which}: {floor_text(floor)}")
    return "noise floor (re-measuring identical steps) — " + ("; ".join(parts) if parts else "not measured in these traces")


class MultiFileOptionsCommand(typer.core.TyperCommand):
    """Lets ``--train A B --test C D`` name several files after one flag, as ``--train A --train B ...`` would.

    Click options take one value each; before parsing, the words that follow a flag in ``MULTI_FILE_FLAGS``
    (up to the next word starting with ``-``) each get the flag repeated in front of them."""

    MULTI_FILE_FLAGS = ("--train", "--test")

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_multi_file_flags(args, self.MULTI_FILE_FLAGS))


def expand_multi_file_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    flag = None
    for k, word in enumerate(args):
        if word == "--":
            return out + args[k:]
        if word.startswith("-"):
            flag = word if word in flags else None
            out.append(word)
        elif flag is not None and out and out[-1] != flag:
            out += [flag, word]
        else:
            out.append(word)
    return out


@app.command("eval", cls=MultiFileOptionsCommand)
@user_errors
def eval_command(
    train: Annotated[list[Path], typer.Option("--train", help="Traces to fit on (several may follow one --train).", dir_okay=False, metavar="TRACE")],
    test: Annotated[list[Path], typer.Option("--test", help="Held-out traces (other runs) to judge on (several may follow one --test).", dir_okay=False, metavar="TRACE")],
    json_output: JsonFlag = False,
    bootstrap: params.Bootstrap = 1000,
    segments: SegmentsOption = "auto",
    ols: OlsOption = False,
    outlier_threshold: OutlierOption = "5",
    keep_warmup: WarmupOption = False,
) -> None:
    """Fit llmvisor and the baselines on --train, report errors on --test per phase."""
    extras.require("llmvisor eval", "eval")
    from llmvisor.core.trace import read_traces
    from llmvisor.evaluation.heldout import evaluate, to_json_ready

    train_trace, test_trace = read_traces(train), read_traces(test)
    if test_trace.n_steps == 0:
        raise LlmvisorError(f"{', '.join(map(str, test))}: no steps to evaluate on (--test)")
    result = evaluate(
        train_trace,
        test_trace,
        llmvisor_params=model_params(segments, ols, outlier_threshold, keep_warmup),
        n_bootstrap=bootstrap,
    )
    if json_output:
        print_json(to_json_ready(result))
        return
    print_table(evaluation_table(result))
    if result["by_lora"]:
        print_table(evaluation_table(result, result["by_lora"]["adapter"], ", steps that ran a LoRA adapter"))
    stdout.print("signed error = (predicted − measured) / measured: negative means predicted faster than measured", highlight=False)
    for line in unseen_phase_lines(result):
        stdout.print(f"[yellow]warning:[/] {line}", highlight=False)
    for phase, values in result.get("improvement", {}).items():
        stdout.print(
            f"improvement over token_count ({phase}): p90 {values['p90']:.2f}×, p99 {values['p99']:.2f}×",
            highlight=False,
        )
    stdout.print(noise_floor_line(result), highlight=False)


@app.command("attribute")
@user_errors
def attribute_command(
    traces: TracePaths,
    model: Annotated[Path, typer.Option("--model", "-m", help="Latency model JSON from `llmvisor fit`.", dir_okay=False, metavar="FILE")],
    by: Annotated[str, typer.Option(help="Attribute to each tenant or each request.", metavar="tenant|request")] = "tenant",
    rule: Annotated[str, typer.Option(help="Attribution rule.", metavar="shapley|proportional|paper")] = "shapley",
    json_output: JsonFlag = False,
    top: Annotated[int, typer.Option(help="Rows to show in the table (JSON holds all).", min=1)] = 20,
) -> None:
    """Attribute every step's measured time to requests or tenants (streaming; memory stays bounded)."""
    from llmvisor.core.attribution import RULES, AttributionRule, aggregate, attribute
    from llmvisor.core.model import StepLatencyModel
    from llmvisor.core.trace import iter_traces

    if by not in ("tenant", "request"):
        raise LlmvisorError(f"--by: expected tenant or request, got {by!r}")
    if rule not in RULES:
        raise LlmvisorError(f"--rule: expected one of {', '.join(RULES)}, got {rule!r}")
    rule = AttributionRule(rule)
    fitted = StepLatencyModel.from_json(model)
    totals: dict[str, float] = {}
    measured_s = 0.0
    n_steps = 0
    n_equal_split = 0
    for piece in iter_traces(traces):
        result = attribute(fitted, piece, rule)
        measured_s += float(result.total_measured_s)
        n_steps += piece.n_steps
        n_equal_split += result.n_equal_split
        for key, value in aggregate(piece, result, by).items():
            totals[key] = totals.get(key, 0.0) + value
    if n_steps == 0:
        raise LlmvisorError(f"{', '.join(map(str, traces))}: no steps to attribute")
    attributed_s = float(sum(totals.values()))
    output = {
        "rule": rule.value,
        "n_steps": n_steps,
        "n_steps_split_equally": n_equal_split,
        "total_measured_s": measured_s,
        "total_attributed_s": attributed_s,
        "unattributed_s": measured_s - attributed_s,
        "by": {
            key: {"attributed_s": value, "fraction": value / attributed_s if attributed_s else 0.0}
            for key, value in sorted(totals.items(), key=lambda item: -item[1])
        },
    }
    if json_output:
        print_json(output)
        return
    table = Table(title=f"Attributed engine time by {by} (rule: {rule})")
    table.add_column(by)
    table.add_column("attributed s", justify="right")
    table.add_column("fraction", justify="right")
    for key, row in list(output["by"].items())[:top]:
        table.add_row(key, f"{row['attributed_s']:.3f}", f"{row['fraction']:.1%}")
    print_table(table)
    stdout.print(
        f"{n_steps} steps; measured {measured_s:.3f} s, attributed {attributed_s:.3f} s"
        + (f", unattributed {measured_s - attributed_s:.3f} s" if rule is AttributionRule.PAPER else "")
        + (f"; {n_equal_split} steps split equally (the model predicted ≤ 0 for every request)" if n_equal_split else ""),
        highlight=False,
    )


@app.command()
@user_errors
def bench(json_output: JsonFlag = False) -> None:
    """Measure per-step attribution latency, offline throughput and fit time in this run."""
    extras.require("llmvisor bench", "eval")
    from llmvisor.evaluation.bench import run_benchmarks

    with stderr.status("benchmarking") as status:
        result = run_benchmarks(progress=lambda message: status.update(message))
    if json_output:
        print_json(result)
        return
    table = Table(title="Per-step attribution vs random-forest prediction (p50, µs)")
    for column in ("batch size", "llmvisor", "decode-only", "with prefill", "random forest", "speed-up"):
        table.add_column(column, justify="right")
    for key in result["attribute_step_us"]:
        with_prefill = result["attribute_step_us_with_prefill"][key]
        table.add_row(
            key,
            f"{result['attribute_step_us'][key]:.2f}",
            f"{result['attribute_step_us_decode_only'][key]:.2f}",
            "-" if with_prefill is None else f"{with_prefill:.2f}",
            f"{result['random_forest_step_us'][key]:.0f}",
            f"{result['speedup_vs_random_forest'][key]:.0f}×",
        )
    print_table(table)
    stdout.print(
        f"offline attribution: {result['offline_slices_per_s'] / 1e6:.1f} M slices/s; "
        f"fit on {result['fit_n_steps']} steps ({result['fit_n_slices']} slices) with segment search: {result['fit_100k_steps_s']:.2f} s",
        highlight=False,
    )


@app.command()
@user_errors
def demo(
    output_dir: Annotated[Path, typer.Option("-o", "--output", help="Folder for the HTML report, model and summary.", file_okay=False, metavar="DIR")] = Path("llmvisor-report"),
    json_output: JsonFlag = False,
    bootstrap: params.Bootstrap = 1000,
) -> None:
    """Fit on the shipped vLLM sweep, evaluate on held-out workloads, attribute per tenant, write a report."""
    extras.require("llmvisor demo", "eval", "report")
    from llmvisor.report.demo import run_demo

    params.check_output_folder(output_dir)

    with stderr.status("demo") as status:
        outcome = run_demo(output_dir, n_bootstrap=bootstrap, progress=lambda message: status.update(message))
    if json_output:
        print_json(outcome["summary"])
        return
    result = outcome["result"]
    model = outcome["model"]
    boundary = "none" if model.boundary_ is None else f"{model.boundary_:g} new tokens per step"
    info = model.fit_info_
    stdout.print(
        f"fitted on {info['n_steps_used']:,} of {info['n_steps_total']:,} sweep steps ({info['n_warmup_dropped']:,} warm-up and "
        f"{info['n_outliers_dropped']:,} outlier steps dropped by the stated rules); segment boundary: {boundary}",
        highlight=False,
    )
    print_table(evaluation_table(result))
    for phase, values in result.get("improvement", {}).items():
        if values["p90"]:
            stdout.print(f"improvement over token_count ({phase}): p90 {values['p90']:.2f}×, p99 {values['p99']:.2f}×", highlight=False)
    stdout.print(noise_floor_line(result), highlight=False)
    by_rule = outcome["by_rule"]
    table = Table(title="Engine time per tenant, multi-tenant run (s)")
    table.add_column("tenant")
    for rule in by_rule:
        table.add_column(rule, justify="right")
    for tenant in sorted(next(iter(by_rule.values()))):
        table.add_row(tenant, *(f"{totals.get(tenant, 0.0):.2f}" for totals in by_rule.values()))
    print_table(table)
    validation = outcome["summary"].get("validation")
    if validation:
        for phase, errors in validation["errors"].items():
            ours, tokens = errors["shapley"]["shapley"], errors["shapley"].get("token_count")
            stdout.print(
                f"validation vs measured Shapley values ({phase}): shapley share error p50 {ours['p50']:.1%}, "
                f"p90 {ours['p90']:.1%} of step time"
                + (f"; token_count p90 {tokens['p90']:.1%}" if tokens else ""),
                highlight=False,
            )
    stdout.print(f"report: {outcome['report']}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
