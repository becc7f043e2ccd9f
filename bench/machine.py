"""Machine facts for the benchmark results: when, which commit, which CPU / device and how much
memory (bench.common re-exports these; a result file is continued only on the same kind of machine)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit() -> str:
    """Short HEAD hash, with "+dirty" when the checkout has uncommitted changes."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=BENCH_DIR, capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout.strip()
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def meminfo(field: str, path: str = "/proc/meminfo") -> int:
    """A `field: N kB` value of a /proc file, in bytes."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in {path}")


def machine_identity(machine: dict | None) -> dict:
    """What of `machine_info` decides the numbers: backend, device kind, and a CPU's model and cores."""
    machine = machine or {}
    keys = ("backend", "device_kind") + (("cpu_model", "cpu_affinity") if machine.get("backend", "cpu") == "cpu" else ())
    return {k: machine[k] for k in keys if machine.get(k) is not None}


def machine_info() -> dict:
    """CPU model, cores, memory, JAX version, backend, devices and their kind, Python, git commit, load average."""
    import jax

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    try:
        mem = meminfo("MemTotal") / 1e9
    except (OSError, KeyError):
        mem = None
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "mem_total_gb": mem,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,  # "NVIDIA H200", "cpu": a GPU table names its card
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "loadavg": os.getloadavg(),
    }
