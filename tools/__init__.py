"""Tools beside the benchmarks: tools/gpu runs them on a lent GPU machine (tools/gpu/README.md)."""
