"""The HTTP routes, one module per resource, each with a module-level ``router``."""
