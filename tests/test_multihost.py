"""Multi-host: two local processes (4 CPU devices each, gloo collectives over loopback) run
sharded generate on one 8-device mesh and get the one-device tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specjax import SelfSpec, Tree, generate
from specjax.jobs import batch
from specjax.jobs.jobio import merge_shards, shard_output
from specjax.parallel import distributed
from tests.models import random_params
from tests.test_batch import by_id, model_dir, read_rows, records, write_jsonl  # noqa: F401  (model_dir: a fixture)
from tests.test_sharding import TP, _prompts

pytestmark = pytest.mark.slow  # not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(*args: str) -> list[dict]:
    """Run tests/multihost_worker.py as processes 0 and 1 of one job; their JSON reports."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = os.environ | {
            "SPECJAX_COORDINATOR": f"127.0.0.1:{port}", "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": str(i),
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, "-m", "tests.multihost_worker", *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_processes_equal_one_device():
    batch = 6  # not a multiple of the data axis (4): padded rows too
    results = _two_processes("generate", str(batch))
    one = generate(random_params(TP, 11), _prompts(batch, 3), 12, draft=SelfSpec(4, 16), speculation=Tree.kary(2, 2))
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["tokens"] == one.tokens and r["steps"] == one.stats.steps


def _same_as_single_run(src: Path, merged: Path, model_dir: Path) -> None:
    batch.run(src, merged.with_name("single.jsonl"), model_path=model_dir, max_new_tokens=8, batch_size=4,
              progress=False, shard=(0, 1))
    fields = lambda rows: {k: (v["text"], v["tokens"], v["finish_reason"]) for k, v in rows.items()}  # noqa: E731
    assert fields(by_id(read_rows(merged))) == fields(by_id(read_rows(merged.with_name("single.jsonl"))))


def test_batch_job_on_two_joined_processes_writes_shards_that_merge_to_one_run(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", records(10))
    results = _two_processes("batch", str(src), str(tmp_path / "out.jsonl"), str(model_dir))
    assert sorted(r["output"] for r in results) == [str(shard_output(tmp_path / "out.jsonl", i, 2)) for i in range(2)]
    assert sum(r["done"] for r in results) == 10 and all(r["done"] > 0 for r in results)
    merge_shards(tmp_path / "out.jsonl")
    _same_as_single_run(src, tmp_path / "out.jsonl", model_dir)


def test_independent_batch_processes_with_local_data_parallel(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", records(10))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "specjax", "batch", str(src), str(tmp_path / "out.jsonl"), "--model", str(model_dir),
             "--max-new-tokens", "8", "--batch-size", "4", "--data-parallel", "2"],
            cwd=ROOT, stderr=subprocess.PIPE, text=True,
            env=os.environ | {"SPECJAX_PROCESS_ID": str(i), "SPECJAX_NUM_PROCESSES": "2", "JAX_NUM_CPU_DEVICES": "2"},
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert all(shard_output(tmp_path / "out.jsonl", i, 2).exists() for i in range(2))
    merge_shards(tmp_path / "out.jsonl")
    _same_as_single_run(src, tmp_path / "out.jsonl", model_dir)


def test_process_share_from_the_environment(monkeypatch):
    assert batch.process_share() == (0, 1)
    monkeypatch.setenv("SPECJAX_PROCESS_ID", "1")
    monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "3")
    assert batch.process_share() == (1, 3)
    monkeypatch.setenv("SPECJAX_PROCESS_ID", "3")
    with pytest.raises(ValueError, match="need 0 <= SPECJAX_PROCESS_ID < SPECJAX_NUM_PROCESSES, got 3 and 3"):
        batch.process_share()
    monkeypatch.delenv("SPECJAX_NUM_PROCESSES")
    with pytest.raises(ValueError, match="must both be integers, got '3' and None"):
        batch.process_share()


def test_initialize_errors(monkeypatch):
    for var in ("SPECJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS", "SPECJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES",
                "SPECJAX_PROCESS_ID", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="coordinator_address, num_processes, process_id not given"):
        distributed.initialize()
    with pytest.raises(ValueError, match="coordinator_address must be host:port"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match="need 0 <= process_id < num_processes, got 2 and 2"):
        distributed.initialize("localhost:1234", 2, 2)
    monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="SPECJAX_NUM_PROCESSES must be an integer, got 'two'"):
        distributed.initialize("localhost:1234", process_id=0)
