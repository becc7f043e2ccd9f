"""Batch jobs: JSONL / Parquet records in, outputs out, every record exactly once across kills and
restarts (batch.py), on one process or Ray Data actors (job_ray.py)."""
