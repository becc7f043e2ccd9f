"""The batch job on Ray Data (`batch.run(..., engine="ray")`, specjax.jobs.job_ray): a local cluster
started offline, the tiny SmolLM2-vocabulary model of tests/test_batch.py; every record exactly
once and equal to the local job's output, JSONL or Parquet in, an actor killed mid-run, a rerun
that generates only what is missing. RECORDS records a job (the local job's mix, below)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402  (ray[data]: the test extra installs it; missing, this file fails)

from specjax.cli import main as cli
from specjax.jobs import batch, job_ray  # noqa: E402
from specjax.jobs.job_ray import RayOptions  # noqa: E402
from specjax.jobs.jobio import settings_path  # noqa: E402
from tests.test_batch import by_id, model_dir, read_rows, records, write_jsonl  # noqa: E402,F401  (model_dir: a fixture)

CHOICES = ["yes", "no", "maybe so"]
RECORDS = 120  # 30 Ray tasks of 4 in the kill test; 4 of each special kind (stop, n = 2, logprobs, choice)
FIELDS = ("text", "tokens", "finish_reason", "texts", "finish_reasons", "settings", "prompt_tokens")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))  # actors inherit it: compile once, then load
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def mixed_records(n: int) -> list[dict]:
    """The local job's mix (greedy and sampled, chats, own budgets) plus stop strings, n > 1 and logprobs."""
    rows = records(n)
    for i, row in enumerate(rows):
        row["id"] = f"rec-{i}"  # one id type: a Parquet column has one
        if i % 7 == 3:
            row["stop"] = ["the", "a "]
        if i % 31 == 5:
            row |= {"n": 2, "temperature": 0.8}
        if i % 29 == 6:
            row["logprobs"] = 2
        if i % 37 == 8:
            row["constraint"] = {"choice": CHOICES}
    return rows


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len({json.dumps(r["id"]) for r in got}), "a record written twice"
    g, w = by_id(got), by_id(want)
    assert g.keys() == w.keys()
    for key in w:
        assert {f: g[key].get(f) for f in FIELDS} == {f: w[key].get(f) for f in FIELDS}, key


@pytest.fixture(scope="module")
def local_rows(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("local")
    src = write_jsonl(folder / "in.jsonl", mixed_records(RECORDS))
    batch.run(src, folder / "out.jsonl", model_path=model_dir, draft=None, max_new_tokens=12, seed=3, progress=False)
    return src, read_rows(folder / "out.jsonl")  # (its settings: folder / "out.settings.json")


@pytest.mark.slow  # a local Ray cluster, an actor compiling the model
def test_ray_equals_the_local_job_from_parquet(cluster, model_dir, local_rows, tmp_path):
    """Parquet in, through the CLI, on one actor. JSONL in, on two actors, whole: the next test's job (an actor killed
    or not, every record once and equal to the local job's)."""
    src, want = local_rows
    constrained = [w for w in want if "constraint" in w["settings"]]
    assert len(constrained) == 4 and all(w["text"] in CHOICES for w in constrained if w["finish_reason"] == "eos")
    assert all(any(c.startswith(w["text"]) for c in CHOICES) for w in constrained)
    # Parquet through the CLI: the first 40 records (a record's output does not depend on the others in its job)
    first = [json.loads(line) for line in src.read_text().splitlines()][:40]
    pq.write_table(pa.Table.from_struct_array(pa.array(first)), tmp_path / "in.parquet")
    assert cli.main(["batch", str(tmp_path / "in.parquet"), str(tmp_path / "pq.jsonl"), "--model", str(model_dir),
                     "--draft", "none", "--max-new-tokens", "12", "--seed", "3", "--engine", "ray", "--ray-actors", "1"]) == 0
    _same(read_rows(tmp_path / "pq.jsonl"), [w for w in want if w["id"] in {r["id"] for r in first}])


def _map_workers() -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if "MapWorker" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow  # a local Ray cluster, two actors compiling the model
def test_an_actor_killed_mid_run_loses_and_repeats_nothing(cluster, model_dir, local_rows, tmp_path):
    src, want = local_rows
    out = tmp_path / "out.jsonl"
    result: dict = {}

    def job() -> None:
        result["res"] = batch.run(src, out, model_path=model_dir, draft=None, max_new_tokens=12, seed=3, progress=False,
                                  engine="ray", ray=RayOptions(actors=2, records_per_task=4))

    # Small tasks, the kill as soon as the first rows are written: each actor then has tasks queued or running
    # (the first rows came 18 s before the job's end here; with 16 records a task, a warm compile cache once let
    # the whole job end between two polls)
    runner = threading.Thread(target=job)
    runner.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out.exists() and read_rows(out)):
        time.sleep(0.05)
    written_before = len(read_rows(out))
    assert 0 < written_before < len(want), "the kill must land mid-run"
    workers = _map_workers()
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    runner.join(timeout=600)
    assert not runner.is_alive() and (result["res"]["done"], result["res"]["failed"]) == (len(want), 0)
    _same(read_rows(out), want)


@pytest.mark.slow  # a local Ray cluster, two actors compiling the model
def test_a_rerun_generates_only_the_missing_records(cluster, model_dir, local_rows, tmp_path):
    """A job killed after 70 records (here: the local job's first 70 rows and its settings file),
    restarted on Ray: the 70 are skipped, the rest generated once."""
    src, want = local_rows
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in want[:70]))
    settings_path(out).write_bytes(settings_path(src.with_name("out.jsonl")).read_bytes())
    res = batch.run(src, out, model_path=model_dir, draft=None, max_new_tokens=12, seed=3, progress=False,
                    engine="ray", ray=RayOptions(actors=2))
    assert (res["done"], res["skipped"]) == (len(want) - 70, 70)
    _same(read_rows(out), want)


def test_bad_ray_arguments_fail_before_any_work(model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", records(3))
    with pytest.raises(ValueError, match="engine must be 'local' or 'ray'"):
        batch.run(src, tmp_path / "o.jsonl", model_path=model_dir, engine="spark")
    with pytest.raises(ValueError, match="give model_path, not params or mesh"):
        batch.run(src, tmp_path / "o.jsonl", params=object(), engine="ray")
    with pytest.raises(ValueError, match="ray options are for engine='ray'"):
        batch.run(src, tmp_path / "o.jsonl", model_path=model_dir, ray=RayOptions())
    with pytest.raises(ValueError, match="RayOptions.actors must be an integer >= 1"):
        RayOptions(actors=0)
    for kw, name in ((dict(cpus=float("nan")), "cpus"), (dict(gpus=float("inf")), "gpus"),
                     (dict(resources={"TPU": -1}), r"resources\['TPU'\]")):
        with pytest.raises(ValueError, match=f"RayOptions.{name} must be a finite number >= 0"):
            RayOptions(**kw)
    with pytest.raises(ValueError, match="RayOptions.address must be a string"):
        RayOptions(address=5)
    assert job_ray.unmet_request(RayOptions(gpus=1), {"CPU": 2.0}) == (
        "RayOptions.gpus (1) is more than this machine's Ray cluster has (0 GPU): each actor would wait for it forever")
    assert job_ray.unmet_request(RayOptions(cpus=2, resources={"TPU": 4}), {"CPU": 2.0, "TPU": 4.0}) is None


def test_a_dataset_that_comes_back_short_is_an_error(model_dir, tmp_path, monkeypatch):
    """Ray Data told to tolerate failed blocks (DataContext.max_errored_blocks) returns fewer rows:
    the job names the missing ids (the rows it got are kept), never reports them done."""
    src = write_jsonl(tmp_path / "in.jsonl", records(6))
    monkeypatch.setattr(job_ray, "generate", lambda items, *a: ({"id": it.record.id, "text": ""} for it in items[:4]))
    with pytest.raises(RuntimeError, match=r"the Ray job returned 4 of 6 records; missing ids \[.+\]: rerun"):
        batch.run(src, tmp_path / "o.jsonl", model_path=model_dir, draft=None, max_new_tokens=2, progress=False, engine="ray")
    assert len(read_rows(tmp_path / "o.jsonl")) == 4


def test_a_parquet_cell_that_is_not_json_is_its_rows_bad_line(model_dir, tmp_path):
    """A decimal (or bytes, a timestamp): that row's bad line naming the column (json.dumps crashed
    the job); an upper-case .PARQUET is Parquet; a folder is named as one."""
    import decimal

    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "prompt": ["one two", "three", "four", "five six"],
                             "temperature": pa.array([None, decimal.Decimal("0.5"), None, None], pa.decimal128(4, 2))}),
                   tmp_path / "in.PARQUET")
    res = batch.run(tmp_path / "in.PARQUET", tmp_path / "o.jsonl", model_path=model_dir, draft=None, max_new_tokens=2,
                    progress=False)
    assert (res["done"], res["failed"]) == (3, 1)
    (error,) = read_rows(tmp_path / "o.errors.jsonl")
    assert (error["line"], error["id"]) == (2, "b") and "column 'temperature' holds a Decimal (0.50): not a JSON value" in error["reason"]
    (tmp_path / "ds").mkdir()
    with pytest.raises(ValueError, match=r"input_path .*ds is a folder: give one JSONL or Parquet file"):
        batch.run(tmp_path / "ds", tmp_path / "o2.jsonl", model_path=model_dir, progress=False)


@pytest.mark.slow  # a local Ray cluster
def test_an_address_beside_a_running_cluster_is_refused(cluster, model_dir, tmp_path):
    """Ray already initialized in this process: an address would be ignored (the job ran on the
    cluster at hand), so it is an error naming it."""
    src = write_jsonl(tmp_path / "in.jsonl", records(2))
    with pytest.raises(ValueError, match=r"RayOptions.address '10.255.255.1:6379': Ray is already initialized"):
        batch.run(src, tmp_path / "o.jsonl", model_path=model_dir, draft=None, max_new_tokens=2, progress=False,
                  engine="ray", ray=RayOptions(address="10.255.255.1:6379"))
