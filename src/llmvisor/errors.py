"""Errors a user can cause; the CLI prints them as one line and exits with code 2."""

import difflib
from collections.abc import Iterable


def unknown_name(names: Iterable, known: Iterable[str], *, kind: str = "field") -> str | None:
    """The one input-contract message for the first of ``names`` not in ``known`` (None when all are known):
    ``unknown field engine_fingerprint_id; did you mean engine_fingerprint?``, the suggestion the closest known
    name (difflib), left out when none is close. Every write route and file reader refuses with it, since a
    misspelled optional name dropped in silence bills wrongly (a step billed as class "", sharing not priced)."""
    known = list(known)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            shown = name if isinstance(name, str) and name.isprintable() and 0 < len(name) <= 100 else repr(name)[:100]
            return f"unknown {kind} {shown}" + (f"; did you mean {close[0]}?" if close else "")
    return None


def plain(value):
    """A numpy scalar as the Python number or string it holds, for messages (``-0.01``, not ``np.float64(-0.01)``)."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", None) == 0 else value


class LlmvisorError(Exception):
    """An error caused by the user's input or configuration, reported without a traceback."""


class TraceError(LlmvisorError, ValueError):
    """A step trace breaks the format contract (`docs/trace-format.md`)."""


class ModelError(LlmvisorError, ValueError):
    """A model file cannot be used (wrong version, missing fields, not fitted)."""


class NotFittedError(LlmvisorError, AttributeError):
    """An estimator was used before `fit`."""


class MissingExtraError(LlmvisorError, ImportError):
    """A command or module needs an optional dependency set (an extra) that is not installed.

    An ImportError too, so `import llmvisor.service` without FastAPI fails the way Python code expects.
    """
