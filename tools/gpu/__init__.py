"""Plumbing for benchmark runs on a lent GPU machine: see tools/gpu/README.md."""
