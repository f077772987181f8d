"""llmvisor: measured, validated per-request attribution of co-batched LLM engine steps."""
__version__ = "0.1.0"
