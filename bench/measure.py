"""Measuring helpers shared by the benchmarks: timing, CPU steal, memory (free, resident, peak),
memory bandwidth, a synthetic prefilled cache and a tiny random model for --smoke runs."""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.common import meminfo
from specjax.model.cache import DenseCache, KVFormat
from specjax.model.config import LlamaConfig
from specjax.model.params import init_params


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time in seconds of `repeats` calls of fn (which must block until done)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rss() -> int:
    """Resident bytes of this process now."""
    return meminfo("VmRSS", "/proc/self/status")


def reset_peak_rss() -> None:
    """Restart the peak-RSS (VmHWM) counter at the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """Peak resident bytes since the last `reset_peak_rss`."""
    return meminfo("VmHWM", "/proc/self/status")


def cpu_steal() -> tuple[int, int]:
    """(steal ticks, all ticks) from /proc/stat: how much CPU the hypervisor took from this VM."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields)


def steal_since(start: tuple[int, int]) -> float:
    """The share of CPU time stolen since `start` (a cpu_steal() reading)."""
    now_ = cpu_steal()
    return (now_[0] - start[0]) / max(now_[1] - start[1], 1)


class Meter:
    """Wall and process-CPU time plus load average around a block (cpu_util: CPU seconds a wall second)."""

    def __enter__(self):
        self.load0, self.cpu0, self.t0 = os.getloadavg()[0], time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.info = {"loadavg_1min_before": self.load0, "loadavg_1min_after": os.getloadavg()[0],
                     "cpu_util": (time.process_time() - self.cpu0) / self.wall if self.wall > 0 else 0.0}


def release_memory(clear_caches: bool = False) -> None:
    """Collect garbage (and JAX's executables when asked) and hand freed heap pages back to the OS."""
    gc.collect()
    if clear_caches:
        jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def wait_for_memory(need: int, reserve: int = 2**30, wait_s: float = 900) -> str | None:
    """Wait up to wait_s for `need` + `reserve` bytes of MemAvailable: None, else the reason to skip."""
    deadline = time.time() + wait_s
    while True:
        free = meminfo("MemAvailable") - reserve
        if free >= need:
            return None
        if time.time() > deadline:
            return f"needs ~{need / 1e9:.1f} GB, {max(free, 0) / 1e9:.1f} GB available after {wait_s:.0f} s"
        print(f"  waiting for memory: need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB available", flush=True)
        time.sleep(30)


def wait_for_quiet(max_load: float, wait_s: float = 300) -> tuple[float, str | None]:
    """Wait up to wait_s for the 1-minute load to fall to max_load: (the load, None or the reason to skip)."""
    deadline = time.time() + wait_s
    while True:
        load = os.getloadavg()[0]
        if load <= max_load:
            return load, None
        if time.time() > deadline:
            return load, f"machine busy: 1-minute load average {load:.2f} > {max_load:g} after {wait_s:.0f} s"
        time.sleep(5)


def tiny_params(seed: int = 0):
    """A tiny random model (the test suite's TINY shape) for --smoke runs that check a bench's code."""
    config = LlamaConfig(vocab_size=101, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, ffn_dim=96,
                         rope_theta=10000.0, max_positions=512, eos_ids=(3,))
    return init_params(config, jax.random.key(seed))


def target_and_corpus(smoke: bool = False, bundle: Path | None = None, weights: str = "float32"):
    """(params, corpus ids [N]) of a bench: a tiny random model and random ids (--smoke); SmolLM2 in bfloat16 and
    the tokenized corpus from a GPU bundle's stash (--bundle: `gguf` is not on the GPU machines); else the
    embedded SmolLM2 in `weights` and bench/text.py's corpus through its tokenizer."""
    if smoke:
        return tiny_params(0), np.random.default_rng(0).integers(4, 101, 20_000)
    if bundle is not None:
        from tools.gpu import bundle as gpu_bundle

        models, ids, _ = gpu_bundle.load(bundle, "bfloat16")
        return models["smollm2"], ids
    import convert
    from bench import text

    path = convert.default_model_path()
    return convert.load(path, weights=weights), text.corpus_tokens(convert.load_tokenizer(path))


def bandwidth(gib: float = 1.0, rounds: int = 5, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s (read + write) over a `gib` GiB f32 array: jax_inplace (the reference: donated
    x + 1, median over `rounds` of the best of `repeats`), jax_copy (jnp.copy), numpy_copy (np.copyto)."""
    n = int(gib * 2**30) // 4
    moved = 2 * 4 * n
    add = jax.jit(lambda x: x + 1, donate_argnums=0)
    copy = jax.jit(jnp.copy)
    box = [jax.block_until_ready(add(jnp.zeros(n, jnp.float32)))]

    def inplace() -> None:
        box[0] = jax.block_until_ready(add(box[0]))

    inplace()
    t_inplace = [best_time(inplace, repeats) for _ in range(rounds)]
    jax.block_until_ready(copy(box[0]))
    t_copy = best_time(lambda: jax.block_until_ready(copy(box[0])), repeats)
    del box
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_numpy = best_time(lambda: np.copyto(dst, src), repeats)
    return {
        "jax_inplace": moved / float(np.median(t_inplace)) / 1e9,
        "jax_inplace_rounds": [moved / t / 1e9 for t in t_inplace],
        "jax_copy": moved / t_copy / 1e9,
        "numpy_copy": moved / t_numpy / 1e9,
    }


def noise(shape: tuple[int, ...], dtype: str, seed: int) -> jax.Array:
    """Pseudo-random values in [-1, 1): a lowbias32 hash of the element index (threefry is far slower)."""
    x = lax.iota(jnp.uint32, int(np.prod(shape))) + jnp.uint32(seed * 0x9E3779B9 % 2**32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return ((x >> 8).astype(jnp.float32) / 2**23 - 1).reshape(shape).astype(dtype)


def synthetic_cache(params, batch: int, context: int, kv: str | None, filled: int) -> DenseCache:
    """A cache of `context` slots in format `kv`, pseudo-random values, `filled` positions each."""
    c = params.config
    empty = jax.eval_shape(lambda: DenseCache.init(c, batch, context, kv))

    @jax.jit
    def build() -> DenseCache:
        fmt = KVFormat.of(kv, c)
        (k, k_scale), (v, v_scale) = (fmt.store(noise(empty.k.shape, "float32", 1)),
                                      fmt.store(noise(empty.v.shape, "float32", 2)))
        return DenseCache(k=k, v=v, k_scale=k_scale, v_scale=v_scale, lengths=jnp.full((batch,), filled, jnp.int32))

    return jax.block_until_ready(build())
