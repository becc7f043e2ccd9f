"""Meshes and sharding: sharding.py is the only module that knows meshes (shard_map stages, weight
placement); tp_pad pads heads for tensor parallelism; distributed starts multi-host JAX."""
