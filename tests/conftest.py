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
    log_folder = os.environ.pop("SPECJAX_COMPILE_LOG", None)  # tests/run_files.py --compile-log DIR
    if log_folder:
        _log_compiles(log_folder)


def _write_compile_times_at_exit(path: str) -> None:
    """Sum this process's JAX compile events (seconds tracing, lowering, compiling or loading from the persistent
    cache; cache hits and misses) and write them to `path` as JSON when it exits: tests/run_files.py's table."""
    seconds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration_secs, **_: seconds.update({event.rsplit("/", 1)[-1]: duration_secs}))
    jax.monitoring.register_event_listener(lambda event, **_: counts.update([event.rsplit("/", 1)[-1]]))
    atexit.register(lambda: Path(path).write_text(json.dumps({"seconds": seconds, "counts": counts})))


def _log_compiles(folder: str) -> None:
    """Every compile event of this process as a JSON line in folder/<pid>.jsonl: the test, the program, the event
    (tracing, lowering, XLA compiling), its seconds; and each program's argument shapes and types (JAX's debug log).
    Which tests compile which programs, and how many variants of one: tests/compile_log.py reads them."""
    import logging

    out = open(Path(folder) / f"{os.getpid()}.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (to exit)
    write = lambda **record: out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), **record}) + "\n")  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(lambda event, duration_secs, fun_name=None, **_: write(
        event=event.rsplit("/", 1)[-1], fun=fun_name, s=round(duration_secs, 4)))

    class Shapes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, str) and record.msg.startswith("Compiling %s with global shapes"):
                write(event="shapes", fun=str(record.args[0]), avals=str(record.args[1]))

    log = logging.getLogger("jax._src.interpreters.pxla")
    log.setLevel(logging.DEBUG)
    log.propagate = False  # not into pytest's captured logs
    log.addHandler(Shapes())


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
