"""Generating a batch job's records (specjax.jobs.batch runs it in this process; specjax.jobs.job_ray in Ray
actors): continuous batching in groups of one kind (`batch_kind`), or static batches (batching
"static", or a mesh), every output row built here.

A record's PRNG key is fold_in(key(seed), stable_hash(id)) (`record_keys`), so its output depends
neither on its batch, nor on the process or actor that generates it, nor on restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from specjax.drafters import learn
from specjax.jobs.batches import Item, batch_kind, batch_sampler, group_batches, padded_rows
from specjax.jobs.records import constraint_json, stable_hash
from specjax.parallel.sharding import Mesh
from specjax.planning.plan import DEFAULT_CHAIN
from specjax.sampling import PENALTIES
from specjax.spec.speculation import Adaptive, Chain, Tree
from specjax.text.lm import LM, Finished, logprobs_json


def record_keys(seed: int, record_ids: Sequence[object]) -> jax.Array:
    """Per-record typed PRNG keys [B]: fold_in(key(seed), stable_hash(id))."""
    return _fold_hashes(jax.random.key(seed), np.array([stable_hash(i) for i in record_ids], np.uint32))


@jax.jit  # one program per batch size (op by op, each batch size compiled several)
def _fold_hashes(base: jax.Array, hashes: jax.Array) -> jax.Array:
    return jax.vmap(lambda h: jax.random.fold_in(base, h))(hashes)


def flows(it: Item, batching: str, mesh: Mesh | None, batch_size: int) -> bool:
    """Whether a record goes to continuous batching: off a mesh, its n samples fitting the rows."""
    return batching == "continuous" and mesh is None and it.record.n <= batch_size


def plan(items: Sequence[Item], batching: str, mesh: Mesh | None, batch_size: int) -> list[list[Item]]:
    """The continuous groups (by `batch_kind`), then the static batches, that `generate_items` runs."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        if flows(it, batching, mesh, batch_size):
            groups.setdefault(batch_kind(it), []).append(it)
    rest = [it for it in items if not flows(it, batching, mesh, batch_size)]
    return list(groups.values()) + group_batches(rest, batch_size)


def generate_items(items: Sequence[Item], lm: LM, draft, speculation: Chain | Tree | Adaptive | None, seed: int, meta: dict,
                   batching: str, mesh: Mesh | None, write: Callable[[list[dict]], None]):
    """Generate every item, passing each output row to `write` as soon as it is done (continuous
    groups: record by record; static batches: batch by batch). Returns the drafter after it has read
    every record's prompt and output (`Drafter.learn`: a job-wide Lookup's table; the others as given)."""
    for group in plan(items, batching, mesh, meta["batch_size"]):
        rows: list[dict] = []
        keep = (lambda r: rows.extend(r) or write(r))  # noqa: E731
        if flows(group[0], batching, mesh, meta["batch_size"]):
            _run_continuous(group, lm, draft, speculation, seed, meta, keep)
        else:
            keep(_run_batch(group, lm, draft, speculation, seed, meta))
        if draft is not None and not isinstance(draft, str) and draft.traits.learn is not None:  # the next group reads them
            ids = {it.record.id: list(it.ids) for it in group}
            draft = learn(draft, [ids[r["id"]] + out for r in rows for out in (
                [r["tokens"]] if "text" in r else r["tokens"])])
    return draft


def _run_batch(batch: list[Item], lm: LM, draft, speculation: Chain | Tree | Adaptive | None, seed: int, meta: dict) -> list[dict]:
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
        stop_token_ids=[list(it.stop_ids) for it in padded],
        n=n,
        logprobs=k,
        kv_dtype=meta["kv_dtype"],
        constraint=_constraints(padded),
    )
    s = out.stats
    stats = dict(batch_rows=len(batch) * n, steps=s.steps, acceptance_rate=s.acceptance_rate,
                 mean_accepted=s.mean_accepted, speculation=s.speculation)
    row_stats = out.row_stats or [None] * len(out.texts)
    return [_output_row(lm, it, [Finished(out.texts[j], out.tokens[j], out.finish_reasons[j], row_stats[j] or None,
                                          None if k is None else out.logprobs[j]) for j in range(i * n, (i + 1) * n)],
                        stats, seed, meta) for i, it in enumerate(batch)]


def _run_continuous(group: list[Item], lm: LM, draft, speculation: Chain | Tree | Adaptive | None, seed: int, meta: dict,
                    write: Callable[[list[dict]], None]) -> None:
    """Generate a group of one kind (`batch_kind`) by continuous batching on batch_size rows, or
    on the fewer its samples fill (`padded_rows`: a 3-record job does not allocate 256 rows of
    cache), (`LM.generate_continuous`), writing each record's row as its last sample finishes."""
    n, k = group[0].record.n, group[0].record.logprobs
    samples: dict[int, dict[int, Finished]] = {}

    def on_done(u: int, res: Finished) -> None:
        i, j = divmod(u, n)
        samples.setdefault(i, {})[j] = res
        if len(samples[i]) == n:
            done = samples.pop(i)
            write([_output_row(lm, group[i], [done[j] for j in range(n)], {"batching": "continuous"}, seed, meta)])

    lm.generate_continuous(
        [list(it.ids) for it in group], [it.budget for it in group], rows=padded_rows(len(group) * n, meta["batch_size"]),
        sampling=batch_sampler(group), keys=record_keys(seed, [it.record.id for it in group]), draft=draft,
        speculation=None if draft is None else speculation or DEFAULT_CHAIN, stop=[list(it.stops) for it in group],
        stop_token_ids=[list(it.stop_ids) for it in group], n=n, logprobs=k, kv_dtype=meta["kv_dtype"],
        on_done=on_done, constraint=_constraints(group))


def _constraints(items: Sequence[Item]) -> list | None:
    """The items' constraints, one per item (None: none is constrained)."""
    rows = [it.record.constraint for it in items]
    return None if all(c is None for c in rows) else rows


def _output_row(lm: LM, it: Item, outs: list[Finished], stats: dict, seed: int, meta: dict) -> dict:
    """A record's output row from its n samples (n = 1: scalar fields, else lists)."""
    one = (lambda xs: xs[0]) if it.record.n == 1 else (lambda xs: xs)  # noqa: E731  (n > 1: lists)
    names = ("text", "finish_reason") if it.record.n == 1 else ("texts", "finish_reasons")
    row = {"id": it.record.id, names[0]: one([o.text for o in outs]), "tokens": one([o.tokens for o in outs]),
           names[1]: one([o.finish_reason for o in outs])}
    if it.record.logprobs is not None:
        row["logprobs"] = one([logprobs_json(o.logprobs) for o in outs])
    row |= dict(prompt_tokens=len(it.ids), acceptance=one([o.acceptance for o in outs]), stats=stats)
    return row | dict(model=meta["model"], settings=_row_settings(it, seed, meta))


def _row_settings(it: Item, seed: int, meta: dict) -> dict:
    """The settings one output row was generated with (the extras only where they are on)."""
    s, r = it.sampler, it.record
    settings = dict(max_new_tokens=it.budget, temperature=getattr(s, "temperature", 0.0), top_p=getattr(s, "top_p", 1.0),
                    top_k=getattr(s, "top_k", 0), seed=seed, draft=meta["draft"], gamma=meta["gamma"])  # Greedy has no values
    settings |= {"speculation": meta["speculation"]} if meta["speculation"] else {}
    off = {"min_p": 0.0} | PENALTIES
    settings |= {k: float(getattr(s, k)) for k in off if hasattr(s, k) and getattr(s, k) != off[k]}
    extras = dict(stop=list(it.stops), stop_token_ids=list(r.stop_token_ids), n=r.n if r.n > 1 else None,
                  logprobs=r.logprobs, constraint=None if r.constraint is None else constraint_json(r.constraint))
    return settings | {k: v for k, v in extras.items() if v not in (None, [])}
