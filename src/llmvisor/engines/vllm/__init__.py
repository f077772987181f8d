"""vLLM integration: the step recorder (`recorder.RecordingScheduler`) and its settings.

This package is the only place in llmvisor that imports vLLM. Importing it (or `settings`) does not import
vLLM; only `recorder` and `engine` do, so the CLI starts without vLLM installed.
"""
