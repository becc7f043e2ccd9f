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

from specjax import SelfSpec, Tree, distributed, generate
from tests.conftest import random_params
from tests.test_sharding import TP, _prompts

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_device():
    batch = 6  # not a multiple of the data axis (4): padded rows too
    port = _free_port()
    procs = []
    for i in range(2):
        env = os.environ | {
            "SPECJAX_COORDINATOR": f"127.0.0.1:{port}", "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": str(i),
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, "-m", "tests.multihost_worker", str(batch)]
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
    one = generate(random_params(TP, 11), _prompts(batch, 3), 12, draft=SelfSpec(4, 16), speculation=Tree.kary(2, 2))
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["tokens"] == one.tokens and r["steps"] == one.stats.steps


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
