"""Metering at the edge: attribute steps where they run and ship one aggregate per run instance and window.

Engine-free (imports `llmvisor.core`, `llmvisor.errors` and numpy only), so the delivery process, the load
generator and the service share it. See `llmvisor.metering.windows`.
"""

from llmvisor.metering.windows import (
    DEFAULT_WINDOW_S,
    RequestWindow,
    UnattributedWindow,
    WindowAggregate,
    WindowAggregator,
    WindowError,
    union_ranges,
)

__all__ = ["DEFAULT_WINDOW_S", "RequestWindow", "UnattributedWindow", "WindowAggregate", "WindowAggregator", "WindowError", "union_ranges"]
