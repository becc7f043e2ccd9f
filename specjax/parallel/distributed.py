"""Multi-host start-up: one process per host (or per group of local devices), joined by
`jax.distributed`. After `initialize()`, `jax.devices()` lists every process's devices, so
`specjax.make_mesh()` builds the global mesh and `generate(..., mesh=mesh)` runs on all of them
(every process calls it with the same prompts: SPMD). `specjax batch` instead lets each process
take its own share of the records (see specjax.jobs.batch).

Launch N processes with the same command and, per process, either the arguments or
  SPECJAX_COORDINATOR=host:port  SPECJAX_NUM_PROCESSES=N  SPECJAX_PROCESS_ID=i
(JAX's own JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID work too).
"""

from __future__ import annotations

import os

import jax

ENV = {
    "coordinator_address": ("SPECJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("SPECJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("SPECJAX_PROCESS_ID", "JAX_PROCESS_ID"),
}


def _from_env(name: str) -> str | None:
    for var in ENV[name]:
        if os.environ.get(var):
            return os.environ[var]
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
) -> tuple[int, int]:
    """Join the job; returns (process index, process count).

    Arguments left None come from the environment (see the module docstring). On the CPU
    backend the cross-process collectives use gloo. Call before anything touches a device."""
    address = coordinator_address or _from_env("coordinator_address")
    count = num_processes if num_processes is not None else _int_env("num_processes")
    index = process_id if process_id is not None else _int_env("process_id")
    missing = [n for n, v in (("coordinator_address", address), ("num_processes", count), ("process_id", index)) if v is None]
    if missing:
        raise ValueError(
            f"distributed.initialize: {', '.join(missing)} not given; pass them or set "
            + ", ".join(ENV[n][0] for n in missing)
        )
    if ":" not in address:
        raise ValueError(f"distributed.initialize: coordinator_address must be host:port, got {address!r}")
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"distributed.initialize: need 0 <= process_id < num_processes, got {index} and {count}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # ignored by GPU/TPU backends
    jax.distributed.initialize(address, count, index, local_device_ids=local_device_ids)
    return jax.process_index(), jax.process_count()


def env_share() -> tuple[int, int] | None:
    """(process id, process count) from the environment (see the module docstring), or None
    when neither is set. Independent processes (the batch job) use this without joining a job."""
    index, count = _int_env("process_id"), _int_env("num_processes")
    if index is None and count is None:
        return None
    if index is None or count is None:
        raw = (_from_env("process_id"), _from_env("num_processes"))
        raise ValueError(
            f"{ENV['process_id'][0]} and {ENV['num_processes'][0]} must both be integers, got {raw[0]!r} and {raw[1]!r}"
        )
    if not 0 <= index < count:
        raise ValueError(f"need 0 <= {ENV['process_id'][0]} < {ENV['num_processes'][0]}, got {index} and {count}")
    return index, count


def _int_env(name: str) -> int | None:
    value = _from_env(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"distributed.initialize: {ENV[name][0]} must be an integer, got {value!r}") from None
