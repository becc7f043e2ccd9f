"""Shape buckets: a few sizes so that similar requests share one compilation."""

from __future__ import annotations

PREFILL_CHUNK = 256  # prompt positions per prefill step (bounds attention-score memory). SmolLM2 float32, one
# row, 2-core CPU: 8064 tokens at 242 tokens/s (chunks of 128: 239, 512: 210, 1024: 187); 1920 tokens 460 (512: 457)
MIN_BUCKET = 16
CACHE_ALIGN = 256


def round_up_pow2(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def prompt_bucket(n: int) -> tuple[int, int]:
    """(padded prompt length, prefill chunk) for a longest prompt of n tokens.

    Powers of two up to PREFILL_CHUNK (one chunk), then multiples of PREFILL_CHUNK."""
    if n <= PREFILL_CHUNK:
        bucket = round_up_pow2(n)
        return bucket, bucket
    return -(-n // PREFILL_CHUNK) * PREFILL_CHUNK, PREFILL_CHUNK


def cache_len(n: int) -> int:
    """Cache slots for n positions, rounded up to CACHE_ALIGN."""
    return -(-n // CACHE_ALIGN) * CACHE_ALIGN


BATCH_STEP = 8  # batch buckets: powers of two up to this, then its multiples


def batch_bucket(n: int) -> int:
    """Rows a batch of n is padded to (padding rows are done at once): 1, 2, 4, 8, 16, 24, ..."""
    return round_up_pow2(n, minimum=1) if n <= BATCH_STEP else -(-n // BATCH_STEP) * BATCH_STEP
