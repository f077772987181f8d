"""`llmvisor profile`: drive a real engine through a plan and record its step trace.

`plans` builds what to run (an envelope sweep, or a replay of a real request mix) and `stats` summarizes
what was recorded (envelope coverage, noise floor); neither imports vLLM. `command` holds the CLI function;
the engine itself is driven by `llmvisor.engines.vllm.driver`, imported only when a profile runs.
"""
