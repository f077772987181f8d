"""Errors a user can cause; the CLI prints them as one line and exits with code 2."""


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
