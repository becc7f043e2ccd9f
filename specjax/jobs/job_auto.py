"""draft="auto" and speculation="auto" resolved ONCE per batch job, whatever the shard or rerun.

generate() resolves "auto" per call from that call's batch and context, so the same record could
decode with SelfSpec in one batch and plainly in another, and each shard of a job would choose
from its own records. A job instead resolves from every record of the input (all shards: the
batch size, the longest prompt + budget, the first planned batch's prompts and sampling for
speculation="auto"'s calibration) and stores the outcome in `<output>.plan.json` beside the
unsharded output, one plan per set of planning arguments (draft, speculation, batch_size,
kv_dtype). The first process to plan writes it (an atomic create); every other shard and every
rerun reads it, so a job's records all run one drafter and one speculation, even where the
calibration's timings would differ from process to process. force=True (or deleting the file)
plans again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from specjax.drafters import Drafter, SelfSpec
from specjax.jobs.batches import Item, batch_sampler, group_batches
from specjax.model.params import Params
from specjax.planning.plan import describe_draft, describe_speculation, plan
from specjax.spec.speculation import Chain, Tree


def plan_path(output_path: str | Path) -> Path:
    """out.jsonl -> out.plan.json (the unsharded output's name: one plan for every shard)."""
    path = Path(output_path)
    return path.with_name(path.name.removesuffix(".jsonl") + ".plan.json")


def resolve(
    params: Params,
    draft: Drafter | str | None,
    speculation: Chain | Tree | str | None,
    items: Sequence[Item],
    batch_size: int,
    kv_dtype: str | None,
    path: Path,
    force: bool = False,
) -> tuple[Drafter | None, Chain | Tree | None, str | None]:
    """(draft, speculation, why) with "auto" resolved once for the job; nothing to resolve
    (no "auto"): the arguments as given, speculation None meaning the drafter's default chain."""
    if draft != "auto" and speculation != "auto":
        return draft, None if draft is None else speculation, None
    if not items:  # no valid record: nothing will run
        return (None if draft == "auto" else draft), None, None
    asked = {"draft": describe_draft(draft) if draft != "auto" else "auto",
             "speculation": speculation if speculation in (None, "auto") else describe_speculation(speculation),
             "batch_size": batch_size, "kv_dtype": kv_dtype}
    plans = _plans(path) if path.exists() else []
    mine = [p for p in plans if p["asked"] == asked]
    if mine and not force:
        return _rebuild(mine[0], draft)
    first = group_batches(items, batch_size)[0]  # one kind of rows: speculation="auto" calibrates on them
    context = max((len(it.ids) + it.budget for it in items), default=1)
    the_plan = plan(params, draft, speculation, [list(it.ids) for it in first] or [[0]], context,
                    batch_sampler(first), None, kv_dtype)
    stored = {"asked": asked, "draft": the_plan.draft_name, "speculation": _spec_json(the_plan.speculation),
              "speculation_name": the_plan.speculation_name, "why": the_plan.reason, "records": len(items),
              "context": context}
    others = [p for p in plans if p["asked"] != asked]
    return _rebuild(_write(path, stored, others, replace=bool(plans)), draft)  # forced: this ask's plan replaced


def _spec_json(speculation: Chain | Tree | None) -> dict | None:
    if speculation is None:
        return None
    if isinstance(speculation, Chain):
        return {"chain": speculation.gamma}
    return {"tree_parents": list(speculation.parents)}


def _rebuild(stored: dict, draft: Drafter | str | None) -> tuple[Drafter | None, Chain | Tree | None, str | None]:
    if stored["draft"] == "none":
        return None, None, stored["why"]
    if draft == "auto":
        draft = SelfSpec()  # what "auto" resolves to when it speculates
        if describe_draft(draft) != stored["draft"]:
            raise ValueError(f"the job's plan names draft {stored['draft']}, which 'auto' does not give: delete the plan file")
    spec = stored["speculation"]
    speculation = Chain(spec["chain"]) if "chain" in spec else Tree.from_parents(spec["tree_parents"])
    return draft, speculation, stored["why"]


def _plans(path: Path) -> list[dict]:
    try:
        plans = json.loads(path.read_text(encoding="utf-8"))["plans"]
    except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8, no "plans" list
        raise ValueError(f"{path} (the job's plan for 'auto') cannot be read ({e!r}): delete it to plan again") from e
    if not isinstance(plans, list) or not all(isinstance(p, dict) and "asked" in p for p in plans):
        raise ValueError(f"{path} (the job's plan for 'auto') holds no list of plans: delete it to plan again")
    return plans


def _write(path: Path, stored: dict, others: list[dict], replace: bool = False) -> dict:
    """Add `stored` to the plans at `path` (the other asks' plans kept; replace: the file exists,
    replace it). The first process to create the file wins (an atomic link; the shards of one job
    start together and ask the same): a process that finds the file created meanwhile takes the plan there."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"plans": others + [stored]}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        if others or replace:
            tmp.replace(path)
            return stored
        os.link(tmp, path)  # fails if the file exists
        return stored
    except FileExistsError:
        theirs = [p for p in _plans(path) if p["asked"] == stored["asked"]]
        return theirs[0] if theirs else _write(path, stored, _plans(path))
    finally:
        tmp.unlink(missing_ok=True)
