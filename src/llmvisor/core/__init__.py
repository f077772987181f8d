"""The engine-free core: step traces, their features, the step-latency model, its cost game and the attribution rules.

Nothing here imports an engine, a web framework or a plotting library; everything else in llmvisor builds on it.
"""
