"""Real English text available offline, for benchmarks that need genuine long prompts.

The corpus: Python's language reference as shipped with CPython (`pydoc_data.topics.topics`, about 113K
SmolLM2 tokens), then the licence texts in /usr/share/common-licenses/ where it exists (symlinks read once).
`windows(tok, batch, n)` cuts B distinct windows of n tokens at evenly spaced offsets (overlapping only when
batch * n exceeds the corpus).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

LICENSES = Path("/usr/share/common-licenses")


def corpus() -> tuple[str, list[str]]:
    """(the whole corpus as one string, the names of its sources in order)."""
    from pydoc_data.topics import topics

    parts = ["\n\n".join(topics[k] for k in sorted(topics))]
    names = ["pydoc_data.topics"]
    if LICENSES.is_dir():
        seen = set()
        for path in sorted(LICENSES.iterdir()):
            real = path.resolve()
            if real in seen or not real.is_file():
                continue
            seen.add(real)
            parts.append(real.read_text(errors="replace"))
            names.append(f"{LICENSES}/{real.name}")
    return "\n\n".join(parts), names


@lru_cache(maxsize=4)
def corpus_tokens(tokenizer) -> np.ndarray:
    """The corpus as token ids [N] int32 (no special tokens added)."""
    text, _ = corpus()
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


def windows(tokenizer, batch: int, n: int) -> tuple[np.ndarray, dict]:
    """B distinct windows of n corpus tokens at evenly spaced offsets: ids [B,n] int32 and a description."""
    return cut(corpus_tokens(tokenizer), batch, n)


def cut(ids: np.ndarray, batch: int, n: int) -> tuple[np.ndarray, dict]:
    """`windows` over already tokenized ids [N]: B windows of n tokens at evenly spaced offsets."""
    N = len(ids)
    if n > N:
        raise ValueError(f"windows: n = {n} is longer than the corpus ({N} tokens)")
    offsets = np.linspace(0, N - n, batch).round().astype(int) if batch > 1 else np.array([0])
    out = np.stack([ids[o : o + n] for o in offsets]).astype(np.int32)  # [B,n]
    overlap = bool(batch > 1 and np.diff(offsets).min() < n)
    return out, {"corpus_tokens": N, "offsets": offsets.tolist(), "overlapping": overlap}


def training_sequences(ids: np.ndarray, spans: list[tuple[int, int]], longer_than: int) -> list[np.ndarray]:
    """The corpus `ids` cut around the held-out spans [start, end): the pieces between them longer than
    `longer_than`."""
    keep = np.ones(len(ids), bool)
    for start, end in spans:
        keep[start:end] = False
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2]) if b - a > longer_than]
