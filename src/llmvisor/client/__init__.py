"""Engine-side client of the accounting service, one module per job: `push` sends steps (`StepPusher`), `windows`
sends window aggregates (`WindowPusher`), `spool` keeps what the service cannot take yet on disk, `relay` hands the
engine's steps to a delivery process (`StepRelay`), `delivery` is that process (``python -m llmvisor.client``).
Every sender retries by the one policy of `llmvisor.retry`. The names below are the package's public face."""

from llmvisor.client.delivery import DELIVERY_CLOSE_TIMEOUT_S, StepDelivery, deliver, send_run_end
from llmvisor.client.push import (
    PUSHED_OPTIONAL_COLUMNS,
    REJECTED_STEPS,
    PusherStats,
    StepPusher,
    columns_body,
    service_url_from_env,
)
from llmvisor.client.relay import MAX_DELIVERY_RESTARTS, RelayCounts, StepRelay, process_running, wait_for_delivery
from llmvisor.client.spool import read_spool
from llmvisor.client.windows import ActiveModelCache, WindowDelivery, WindowPusher, store_steps_from_env, window_s_from_env

__all__ = [
    "DELIVERY_CLOSE_TIMEOUT_S", "MAX_DELIVERY_RESTARTS", "PUSHED_OPTIONAL_COLUMNS", "REJECTED_STEPS", "ActiveModelCache",
    "PusherStats", "RelayCounts", "StepDelivery", "StepPusher", "StepRelay", "WindowDelivery", "WindowPusher", "columns_body",
    "deliver", "process_running", "read_spool", "send_run_end", "service_url_from_env", "store_steps_from_env",
    "wait_for_delivery", "window_s_from_env",
]
