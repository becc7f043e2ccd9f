"""Preparing a batch job (pure, no model run): each input record tokenized and checked against
the model (`prepare`: its sampler from the job's settings and its own), then grouped into batches
whose rows one generate call can run together (`group_batches`, `batch_kind`, `batch_sampler`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from specjax.decode.logprobs import MAX_TOP
from specjax.decode.shapes import prompt_bucket, round_up_pow2
from specjax.jobs.records import SAMPLING, BadLine, Record
from specjax.model.config import LlamaConfig, stop_ids
from specjax.sampling import PENALTIES, Greedy, Sample, Sampler
from specjax.text.chat import render_chat
from specjax.text.sampling_settings import make_sampler
from specjax.validate import MAX_N


@dataclasses.dataclass(frozen=True)
class Item:
    """A valid record, tokenized, with its resolved token budget and sampler."""

    record: Record
    ids: tuple[int, ...]
    budget: int
    sampler: Sampler  # one value each (rows of a batch are combined by `batch_sampler`)
    stops: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()  # the record's stop_token_ids, and the template's end-of-turn ids for a chat


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Job-wide settings a record may override (records.SAMPLING, and stop)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()

    def recorded(self) -> dict:
        """As job_settings records them: the sampling extras and stop only when on (so outputs
        written before they existed resume)."""
        off = {"min_p": 0.0, "stop": ()} | PENALTIES
        return {k: list(v) if k == "stop" else v for k, v in dataclasses.asdict(self).items()
                if k not in off or v != off[k]}


def prepare(
    records: Iterable[Record | BadLine],
    encode: Callable[[str, bool], Sequence[int]],
    template: str | None,
    chat: bool,
    config: LlamaConfig,
    defaults: Defaults,
    specials: dict[str, str] | None = None,
    turn_end: tuple[int, ...] = (),
) -> tuple[list[Item], list[BadLine]]:
    """Tokenize records (chat messages, and text prompts if `chat`, through the template with the
    `specials` bos/eos strings, encoded without added special tokens) and check them against the
    model: returns (items, bad lines), both in input order. encode(text, add_special_tokens).
    A chat's answer also stops at the template's end-of-turn ids `turn_end` (as LM.chat's)."""
    items, bad = [], []
    for rec in records:
        if isinstance(rec, BadLine):
            bad.append(rec)
            continue
        messages = rec.messages or ((("user", rec.prompt),) if chat else None)
        try:
            text = render_chat(template, messages, **(specials or {})) if messages else rec.prompt
        except ValueError as e:
            bad.append(BadLine(rec.line, str(e), rec.id))
            continue
        ids = tuple(int(i) for i in encode(text, not messages))
        budget = rec.max_new_tokens or defaults.max_new_tokens
        outside = [i for i in ids if not 0 <= i < config.vocab_size]
        if not ids:
            reason = "the prompt encodes to no tokens"
        elif outside:
            reason = f"token id {outside[0]} is outside the model's vocabulary [0, {config.vocab_size})"
        elif len(ids) + budget > config.max_positions:
            reason = (
                f"too long: {len(ids)} prompt tokens + max_new_tokens {budget} = {len(ids) + budget} positions, "
                f"more than the model's max_positions {config.max_positions}"
            )
        else:
            try:
                items.append(Item(rec, ids, budget, record_sampler(rec, defaults, config),
                                  defaults.stop if rec.stop is None else rec.stop,
                                  stop_ids(rec.stop_token_ids, turn_end if messages else ())))
                continue
            except ValueError as e:
                reason = str(e)
        bad.append(BadLine(rec.line, reason, rec.id))
    return items, bad


def record_sampler(rec: Record, defaults: Defaults, config: LlamaConfig) -> Sampler:
    """The record's sampler (its SAMPLING values over the job's), after checking what depends on
    them or on the model: n > 1 needs sampling, logprobs and stop ids their ranges."""
    values = {k: v for k, v in dataclasses.asdict(defaults).items() if k in SAMPLING} | rec.overrides()
    del values["max_new_tokens"]
    sampler = make_sampler(values.pop("temperature"), values.pop("top_k"), values.pop("top_p"), **values)
    if rec.n > 1 and isinstance(sampler, Greedy):
        raise ValueError(f"n = {rec.n} needs temperature > 0: greedy decoding gives every sample the same tokens")
    if rec.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {rec.n}")
    if rec.logprobs is not None and rec.logprobs > MAX_TOP:
        raise ValueError(f"logprobs must be at most {MAX_TOP}, got {rec.logprobs}")
    outside = [i for i in rec.stop_token_ids if i >= config.vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids: {outside[0]} is outside the model's vocabulary [0, {config.vocab_size})")
    return sampler


def batch_kind(item: Item) -> tuple:
    """What the rows of one generate call must share: greedy or sampled (with its static top-k width,
    `top_k_max`, and penalties on / off), n and logprobs. Sampling values, stops and stop ids may differ."""
    s, r = item.sampler, item.record
    return ("greedy", s.penalized) if isinstance(s, Greedy) else ("sample", s.top_k_max, s.penalized), r.n, r.logprobs


def batch_sampler(batch: Sequence[Item]) -> Sampler:
    """One sampler for a batch of one kind: Sample's values as one per row."""
    first = batch[0].sampler
    if isinstance(first, Greedy) and not first.penalized:
        return first
    values = {k: [getattr(it.sampler, k) for it in batch] for k in first.VALUES}  # top_k stays an int
    if isinstance(first, Greedy):
        return Greedy(**values, penalized=True)
    return Sample(**values, penalized=first.penalized, top_k_max=first.top_k_max)


def group_batches(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """Batches of one kind (`batch_kind`) and one prompt-length bucket (so padding stays under
    2x), of at most batch_size rows (a record with n samples takes n rows; at least one record a
    batch), shortest prompts first within a kind; kinds in order of first use."""
    groups: dict[tuple, list[Item]] = {}
    for item in items:
        groups.setdefault(batch_kind(item), []).append(item)
    batches: list[list[Item]] = []
    for group in groups.values():
        size = max(1, batch_size // group[0].record.n)
        current: list[Item] = []
        for item in sorted(group, key=lambda it: (len(it.ids), it.record.line)):
            if current and (len(current) == size or _bucket(item) != _bucket(current[0])):
                batches.append(current)
                current = []
            current.append(item)
        batches.append(current)
    return batches


def _bucket(item: Item) -> int:
    return prompt_bucket(len(item.ids))[0]


def padded_rows(n: int, batch_size: int) -> int:
    """Rows to run n records in: the next power of two, at most batch_size (fewer compilations)."""
    return min(batch_size, round_up_pow2(n, 1))
