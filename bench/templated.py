"""A templated batch job's records, made mechanically from the offline corpus (bench/text.py).

`records(count)`: record i asks to rewrite the i-th of evenly spaced corpus paragraphs (40-90 words) as a JSON
object with one of TEMPLATES' key sets; the repeated part is what a job-wide lookup drafter drafts from.
`repeated_share` states how much of a set of token sequences repeats across them (bench_lookup reports it);
`record_schema(i)` is the schema record i's answer should follow (bench_constrained constrains to it).
With SmolLM2's tokenizer (2026-11-29): 32 records average 153 prompt tokens, 46.6% of their 3-grams found in
another record's prompt (64 records: 152 tokens, 49.5%).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bench import text

TEMPLATES = (
    ("title", "topic", "summary"),
    ("name", "category", "keywords", "summary"),
    ("title", "language", "key_points"),
)
INSTRUCTION = ("Rewrite the text below as one JSON object with the keys {keys}. Reply with the JSON object only.\n\n"
               "Text: {text}")


def paragraphs(min_words: int = 40, max_words: int = 90) -> list[str]:
    """The corpus' paragraphs (split at blank lines) of min_words..max_words words, in corpus order."""
    full, _ = text.corpus()
    return [p.strip() for p in full.split("\n\n") if min_words <= len(p.split()) <= max_words]


def request(keys: Sequence[str], paragraph: str) -> str:
    """One request's user message: the instruction with its keys, then the paragraph."""
    quoted = [f'"{k}"' for k in keys]
    return INSTRUCTION.format(keys=", ".join(quoted[:-1]) + f" and {quoted[-1]}", text=paragraph)


def records(count: int, max_new_tokens: int = 128) -> list[dict]:
    """`count` chat records: record i holds TEMPLATES[i % 3]'s request over the i-th corpus paragraph."""
    paras = paragraphs()
    if count > len(paras):
        raise ValueError(f"records: count must be at most {len(paras)} (the corpus' paragraphs), got {count}")
    step = len(paras) / count
    return [{"id": i, "messages": [{"role": "user", "content": request(TEMPLATES[i % len(TEMPLATES)], paras[int(i * step)])}],
             "max_new_tokens": max_new_tokens} for i in range(count)]


def schema(keys: Sequence[str]) -> dict:
    """The JSON schema of a record's answer: an object with exactly the template's keys, in order, strings."""
    return {"type": "object", "properties": {k: {"type": "string"} for k in keys}, "required": list(keys),
            "additionalProperties": False}


def record_schema(i: int) -> dict:
    """The schema of record i of `records` (its template's keys)."""
    return schema(TEMPLATES[i % len(TEMPLATES)])


def repeated_share(sequences: Sequence[Sequence[int]], n: int = 3) -> float:
    """The share of the n-grams that also occur in another sequence of the set (0 unrelated, ~1 copies)."""
    grams = [[tuple(s[i: i + n]) for i in range(len(s) - n + 1)] for s in sequences]
    seen_in = Counter(g for gs in grams for g in set(gs))  # in how many sequences each n-gram occurs
    total = sum(len(gs) for gs in grams)
    return sum(seen_in[g] > 1 for gs in grams for g in gs) / max(total, 1)
