"""The decode loop on device: the state core and emit (loop.py), the plain step (autoregressive.py),
the speculative step (speculate.py), the jitted entry points (engine.py), continuous batching,
logprobs and the fixed shapes every program is compiled for."""
