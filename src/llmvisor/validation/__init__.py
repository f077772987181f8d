"""Ground truth for attribution: shares compared with cost games measured on the real engine."""
