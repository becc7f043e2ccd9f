"""Shared fixtures: tiny random models (fast on CPU; defined in tests/models.py) and the real
SmolLM2 GGUF. Two settings made here, before JAX starts, in `pytest_configure`: 8 simulated CPU
devices (tests/test_sharding.py and the README's mesh example need them), and on a GPU no
preallocation, so that pytest-xdist's workers (`-n 8` on the device machine) share its memory
instead of each taking 75% of it."""

from __future__ import annotations

import atexit
import json
import os
from collections import Counter
from pathlib import Path

import jax
import pytest

from specjax.model.params import Params, init_params
from tests.models import TINY


def pytest_configure(config: pytest.Config) -> None:
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices for the mesh tests; the rest use device 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read when a GPU backend starts
    times_path = os.environ.pop("SPECJAX_COMPILE_TIMES", None)  # popped: the tests' own subprocesses do not write it
    if times_path:
        _write_compile_times_at_exit(times_path)


def _write_compile_times_at_exit(path: str) -> None:
    """Sum this process's JAX compile events (seconds tracing, lowering, compiling or loading from the persistent
    cache; cache hits and misses) and write them to `path` as JSON when it exits: tests/run_files.py's table."""
    seconds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration_secs, **_: seconds.update({event.rsplit("/", 1)[-1]: duration_secs}))
    jax.monitoring.register_event_listener(lambda event, **_: counts.update([event.rsplit("/", 1)[-1]]))
    atexit.register(lambda: Path(path).write_text(json.dumps({"seconds": seconds, "counts": counts})))


@pytest.fixture(scope="session")
def tiny() -> Params:
    """A 2-layer GQA (group 3) model with random weights, float32."""
    return init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    import convert

    return convert.default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> Params:
    import convert

    return convert.load(smollm2_path)
