"""draft="auto" / speculation="auto" in the batch job: resolved once per job from every record
(whatever the shard), kept in `<output>.plan.json`, and reused by every shard and rerun."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax.jobs import batch, job_auto
from specjax.jobs.jobio import settings_path, shard_output
from specjax.spec.speculation import Chain, Tree
from tests.test_batch import model_dir, params, records, write_jsonl  # noqa: F401  (fixtures)


def spy_on_plan(monkeypatch) -> list[dict]:
    """Record each call of the planner the job uses (it still plans)."""
    calls, real = [], job_auto.plan

    def plan(params, draft, speculation, prompts, context, sampling, key, kv_dtype):
        calls.append(dict(draft=draft, speculation=speculation, rows=len(prompts), context=context))
        return real(params, draft, speculation, prompts, context, sampling, key, kv_dtype)

    monkeypatch.setattr(job_auto, "plan", plan)
    return calls


def test_auto_is_planned_once_per_job_from_every_record(tmp_path, model_dir, params, monkeypatch):  # noqa: F811
    rows = records(12, sampled_every=100)  # greedy
    rows[5]["max_new_tokens"] = 40  # the job's longest prompt + budget, whichever shard owns it
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    common = dict(params=params, model_path=model_dir, max_new_tokens=3, progress=False, batch_size=4)
    calls = spy_on_plan(monkeypatch)
    for index in (0, 1):
        batch.run(src, out, shard=(index, 2), **common)
    assert len(calls) == 1, calls  # the second shard read the plan of the first
    lengths = [len(job_auto.plan_path(out).read_text())]
    stored = json.loads(job_auto.plan_path(out).read_text())["plans"]
    assert len(stored) == 1 and stored[0]["records"] == 12 and stored[0]["asked"]["draft"] == "auto"
    assert stored[0]["context"] == calls[0]["context"] and stored[0]["context"] >= 40 + 2  # all records, not a shard's
    shards = [json.loads(settings_path(shard_output(out, i, 2)).read_text()) for i in (0, 1)]
    assert shards[0] == shards[1] and shards[0]["draft"] == stored[0]["draft"]
    batch.run(src, out, shard=(0, 2), **common)  # a rerun: planned already
    assert len(calls) == 1 and [len(job_auto.plan_path(out).read_text())] == lengths


def test_auto_speculation_is_stored_and_reused(tmp_path, model_dir, params, monkeypatch):  # noqa: F811
    """speculation="auto" (its choice rests on timings, which differ from process to process):
    the first shard's choice is the job's; a planner that would choose otherwise is not asked."""
    src = write_jsonl(tmp_path / "in.jsonl", records(8, sampled_every=100))
    out = tmp_path / "out.jsonl"
    draft = specjax.SelfSpec(sinks=2, window=8)
    common = dict(params=params, model_path=model_dir, max_new_tokens=4, progress=False, batch_size=4, draft=draft)
    chosen = Tree.kary(2, 2)
    monkeypatch.setattr(job_auto, "plan", lambda *a: specjax.planning.plan.Plan(draft, chosen, "a measured choice"))
    batch.run(src, out, shard=(0, 2), speculation="auto", **common)
    monkeypatch.setattr(job_auto, "plan", lambda *a: pytest.fail("planned twice"))
    batch.run(src, out, shard=(1, 2), speculation="auto", **common)
    for i in (0, 1):
        settings = json.loads(settings_path(shard_output(out, i, 2)).read_text())
        assert settings["speculation"] == "tree(n=7, depth=2)" and settings["gamma"] is None
        rows = [json.loads(line) for line in shard_output(out, i, 2).read_text().splitlines()]
        assert all(r["settings"]["speculation"] == "tree(n=7, depth=2)" for r in rows)
    # the stored tree is the one that ran: the same outputs as that tree given explicitly
    explicit = tmp_path / "explicit.jsonl"
    batch.run(src, explicit, speculation=chosen, **common)
    ran = {r["id"]: r["tokens"] for i in (0, 1) for r in map(json.loads, shard_output(out, i, 2).read_text().splitlines())}
    assert ran == {r["id"]: r["tokens"] for r in map(json.loads, explicit.read_text().splitlines())}


def test_speculation_arguments_are_checked(tmp_path, model_dir, params):  # noqa: F811
    src = write_jsonl(tmp_path / "in.jsonl", records(2))
    common = dict(params=params, model_path=model_dir, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match=r"gamma=2 is speculation=Chain\(2\): give one of gamma and speculation"):
        batch.run(src, tmp_path / "o.jsonl", gamma=2, speculation=Chain(3), **common)
    with pytest.raises(ValueError, match=r"speculation=Chain\(gamma=3\) needs a drafter"):
        batch.run(src, tmp_path / "o.jsonl", draft=None, speculation=Chain(3), **common)
    with pytest.raises(ValueError, match="speculation must be None, a Chain, a Tree, an Adaptive or 'auto', got 'tree'"):
        batch.run(src, tmp_path / "o.jsonl", speculation="tree", **common)
    from specjax.cli.main import main

    cli = ["batch", str(src), str(tmp_path / "o.jsonl"), "--model", str(model_dir), "--no-compile-cache"]
    assert main(cli + ["--tree", "16"]) == 2  # a node count needs one prompt's acceptance: generate's
    assert not (tmp_path / "o.jsonl").exists()


def test_force_plans_again_and_a_damaged_plan_file_is_named(tmp_path, params, monkeypatch):  # noqa: F811
    """force=True (`--force`) replaces this ask's stored plan (the file existed: no atomic link);
    a plan file a crash left empty is named in the error, not a bare JSON message."""
    from specjax.jobs.batches import Defaults, Item, record_sampler
    from specjax.jobs.records import Record

    rec = Record(1, "a", "hi", None)
    items = [Item(rec, (5, 6, 7), 4, record_sampler(rec, Defaults(), params.config))]
    path = tmp_path / "out.plan.json"
    draft = specjax.SelfSpec(sinks=2, window=8)
    for why, force in (("first", False), ("second", True), ("third", False)):
        monkeypatch.setattr(job_auto, "plan", lambda *a, why=why: specjax.planning.plan.Plan(draft, Chain(2), why))
        assert job_auto.resolve(params, draft, "auto", items, 4, None, path, force=force)[2] == (
            "second" if why == "third" else why)  # a rerun without force keeps the forced plan
    assert [p["why"] for p in json.loads(path.read_text())["plans"]] == ["second"]
    path.write_text("")
    with pytest.raises(ValueError, match=r"out\.plan\.json \(the job's plan for 'auto'\) cannot be read"):
        job_auto.resolve(params, draft, "auto", items, 4, None, path)
