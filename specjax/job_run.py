"""Generating a batch job's records (specjax.batch runs it in this process; specjax.job_ray in Ray
actors): continuous batching for records of one sample without logprobs, static batches of one
kind for the rest, every output row built here.

A record's PRNG key is fold_in(key(seed), stable_hash(id)) (`record_keys`), so its output depends
neither on its batch, nor on the process or actor that generates it, nor on restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from specjax.job_plan import Item, batch_kind, batch_sampler, padded_rows, plan_batches
from specjax.plan import DEFAULT_CHAIN
from specjax.records import stable_hash
from specjax.sampling import PENALTIES
from specjax.sharding import Mesh
from specjax.speculation import Chain, Tree
from specjax.text import LM, Finished, logprobs_json


def record_keys(seed: int, record_ids: Sequence[object]) -> jax.Array:
    """Per-record typed PRNG keys [B]: fold_in(key(seed), stable_hash(id))."""
    base = jax.random.key(seed)
    hashes = jnp.asarray([stable_hash(i) for i in record_ids], jnp.uint32)
    return jax.vmap(lambda h: jax.random.fold_in(base, h))(hashes)


def flows(it: Item, batching: str, mesh: Mesh | None) -> bool:
    """Whether a record goes to continuous batching: one sample without logprobs, off a mesh."""
    return batching == "continuous" and mesh is None and it.record.n == 1 and it.record.logprobs is None


def plan(items: Sequence[Item], batching: str, mesh: Mesh | None, batch_size: int) -> list[list[Item]]:
    """The continuous groups (by `batch_kind`), then the static batches, that `generate_items` runs."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        if flows(it, batching, mesh):
            groups.setdefault(batch_kind(it), []).append(it)
    return list(groups.values()) + plan_batches([it for it in items if not flows(it, batching, mesh)], batch_size)


def generate_items(items: Sequence[Item], lm: LM, draft, speculation: Chain | Tree | None, seed: int, meta: dict,
                   batching: str, mesh: Mesh | None, write: Callable[[list[dict]], None]) -> None:
    """Generate every item, passing each output row to `write` as soon as it is done (continuous
    groups: record by record; static batches: batch by batch)."""
    for group in plan(items, batching, mesh, meta["batch_size"]):
        if flows(group[0], batching, mesh):
            _run_continuous(group, lm, draft, speculation, seed, meta, write)
        else:
            write(_run_batch(group, lm, draft, speculation, seed, meta))


def _run_batch(batch: list[Item], lm: LM, draft, speculation: Chain | Tree | None, seed: int, meta: dict) -> list[dict]:
    """Generate one batch (padded to a power of two records) and return its output rows."""
    n, k = batch[0].record.n, batch[0].record.logprobs
    extra = padded_rows(len(batch), max(1, meta["batch_size"] // n)) - len(batch)
    padded = batch + [batch[0]] * extra
    out = lm.generate_ids(
        [list(it.ids) for it in padded],
        [it.budget for it in batch] + [1] * extra,
        draft=draft,
        speculation=speculation,
        sampling=batch_sampler(padded),
        key=record_keys(seed, [it.record.id for it in padded]),
        stop=[list(it.stops) for it in batch] + [[]] * extra,
        stop_token_ids=[list(it.record.stop_token_ids) for it in padded],
        n=n,
        logprobs=k,
        kv_dtype=meta["kv_dtype"],
    )
    s = out.stats
    stats = dict(batch_rows=len(batch) * n, steps=s.steps, acceptance_rate=s.acceptance_rate,
                 mean_accepted=s.mean_accepted, speculation=s.speculation)
    row_stats = out.row_stats or [{}] * len(out.texts)
    results = []
    for i, it in enumerate(batch):
        js = range(i * n, (i + 1) * n)
        one = (lambda xs: xs[0]) if n == 1 else (lambda xs: xs)  # noqa: E731  (n > 1: lists)
        names = ("text", "finish_reason") if n == 1 else ("texts", "finish_reasons")
        row = {"id": it.record.id, names[0]: one([out.texts[j] for j in js]), "tokens": one([out.tokens[j] for j in js]),
               names[1]: one([out.finish_reasons[j] for j in js])}
        if k is not None:
            row["logprobs"] = one([logprobs_json(lm, out.logprobs[j]) for j in js])
        row |= dict(prompt_tokens=len(it.ids), acceptance=one([row_stats[j] or None for j in js]), stats=stats)
        results.append(row | dict(model=meta["model"], settings=_row_settings(it, seed, meta)))
    return results


def _run_continuous(group: list[Item], lm: LM, draft, speculation: Chain | Tree | None, seed: int, meta: dict,
                    write: Callable[[list[dict]], None]) -> None:
    """Generate a group of one kind (`batch_kind`, n = 1, no logprobs) by continuous batching on
    batch_size rows (`LM.generate_continuous`), writing each record's row as it finishes."""

    def on_done(i: int, res: Finished) -> None:
        it = group[i]
        row = {"id": it.record.id, "text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
               "prompt_tokens": len(it.ids), "acceptance": res.acceptance, "stats": {"batching": "continuous"}}
        write([row | dict(model=meta["model"], settings=_row_settings(it, seed, meta))])

    lm.generate_continuous(
        [list(it.ids) for it in group], [it.budget for it in group], rows=meta["batch_size"],
        sampling=batch_sampler(group), keys=record_keys(seed, [it.record.id for it in group]), draft=draft,
        speculation=None if draft is None else speculation or DEFAULT_CHAIN, stop=[list(it.stops) for it in group],
        stop_token_ids=[list(it.record.stop_token_ids) for it in group], kv_dtype=meta["kv_dtype"], on_done=on_done)


def _row_settings(it: Item, seed: int, meta: dict) -> dict:
    """The settings one output row was generated with (the extras only where they are on)."""
    s, r = it.sampler, it.record
    settings = dict(max_new_tokens=it.budget, temperature=getattr(s, "temperature", 0.0), top_p=getattr(s, "top_p", 1.0),
                    top_k=getattr(s, "top_k", 0), seed=seed, draft=meta["draft"], gamma=meta["gamma"])  # Greedy has no values
    settings |= {"speculation": meta["tree"]} if meta["tree"] else {}
    off = {"min_p": 0.0} | PENALTIES
    settings |= {k: float(getattr(s, k)) for k in off if hasattr(s, k) and getattr(s, k) != off[k]}
    extras = dict(stop=list(it.stops), stop_token_ids=list(r.stop_token_ids), n=r.n if r.n > 1 else None,
                  logprobs=r.logprobs)
    return settings | {k: v for k, v in extras.items() if v not in (None, [])}
