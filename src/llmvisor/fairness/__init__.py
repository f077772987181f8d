"""Fair sharing of an engine between tenants: the engine-agnostic policy and the experiment that measures it."""
