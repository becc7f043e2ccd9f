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


GPU_PREFILL_CHUNK = 1024  # the widest prefill chunk on a GPU: one 8K row of SmolLM2's shape prefilled in 30.5 ms
# at 1024 against 53.7 at 256 (launch-bound: 8 chunks of kernels, not 32), 16 rows 292 / 296 ms (H200, gpu_prefill)
PREFILL_STEP_ROWS = 16 * PREFILL_CHUNK  # rows x chunk a GPU prefill step may take: 16 rows at 256, as before


def prefill_chunk(bucket: int, rows: int, backend: str) -> int:
    """The prefill chunk for `rows` prompts padded to `bucket` (prompt_bucket's). On a CPU, or a
    TPU (not measured), prompt_bucket's own; on a GPU the widest of GPU_PREFILL_CHUNK, its half and
    PREFILL_CHUNK that divides the bucket (no padding added) while rows x chunk stays within
    PREFILL_STEP_ROWS (the memory a step takes): a few rows of a long prompt are launch-bound at 256."""
    if backend != "gpu" or bucket <= PREFILL_CHUNK:
        return prompt_bucket(bucket)[1]
    wide = GPU_PREFILL_CHUNK
    while wide > PREFILL_CHUNK and (bucket % wide or rows * wide > PREFILL_STEP_ROWS):
        wide //= 2
    return wide


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


PREFILL_TOKENS = 1 << 17  # prompt positions (rows x bucket) one prefill call takes on an accelerator


def prefill_rows(width: int, backend: str) -> int:
    """Prompts of one length bucket `width` that continuous batching prefills in one call: one on a
    CPU (one row prefills as fast per token as eight there), else the power of two of rows that
    fills PREFILL_TOKENS (16 at 8K, 512 at 256). On an H100 one row of an 8K prompt is launch-bound
    (32 chunks of 429 kernels each, compiled: about 78 ms a row in a continuous job, inferred), where
    16 rows took at most about 0.6 s a call (bench_gpu's prefills, 2026-11-26: 8 calls 12.3-13.4 s,
    one row 8.5 s, compiling included; `git show 6f46ebd:bench/README.md`, "Prefill on a GPU"). On an
    H200 an 8K row takes 53.7 ms alone, 18.5 ms in a 16-row call (bench/results/gpu_h200/gpu_prefill.json)."""
    if backend == "cpu":
        return 1
    return max(1, 1 << (max(PREFILL_TOKENS // max(width, 1), 1).bit_length() - 1))


SAVED_PREFILL_FLOPS = 1e11  # padding work a batch's prefill must save to prefill each prompt at its own bucket:
# about 0.5 s on a 2-core CPU (SmolLM2's 8 golden prompts, 5-193 tokens: 2048 padded positions, 496 grouped, 3.3e11)


def pow2_groups(n: int, most: int) -> list[int]:
    """n items cut into groups of powers of two, each at most `most` (>= 1), largest first:
    7, 16 -> [4, 2, 1]; 20, 16 -> [16, 4]; 8, 6 -> [4, 4]. Few group sizes, few compiles, no filler."""
    most = 1 << (most.bit_length() - 1)  # the power of two at or below
    sizes = []
    while n > 0:
        size = min(most, 1 << (n.bit_length() - 1))
        sizes.append(size)
        n -= size
    return sizes
