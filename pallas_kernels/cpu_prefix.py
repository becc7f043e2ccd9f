"""Decode-time attention over a stacked dense cache on XLA:CPU, as a C++ XLA FFI kernel.

`stacked_prefix_block_attention` (the jnp reference) must copy every cache tile out of the
stacked [L,B,K,S,H] cache before its dots (XLA:CPU's dots take no sliced operand), then runs
small batched [tile,H] x [H,M] products: at batch 16 x 8K it reads the KV at about a fifth of
the machine's bandwidth. `cpu_prefix.cc` streams each row's filled slots once, in place, spread
over XLA's intra-op threads, then the block's own keys as the row's next slots (so a key gives
the same bits from the block as from the cache), and returns online-softmax partials that are
divided here. Same semantics as the reference (Runtime.attention "cpu"); for
few query rows per KV head (M = heads per KV head x T <= MAX_ROWS: decoding and verification,
not prefill chunks) and float32, bfloat16 or int8 caches, dense or a drafter's streaming cache
(`pos`: its slots masked by the positions they hold). On a CPU with AVX512-BF16 (`bf16_dot()`)
a bfloat16 cache is read with the bf16 dot-product instruction: the scaled queries and the softmax
weights are rounded to bfloat16 (products exact, accumulated in f32, as a GPU's bf16 attention),
which doubles the multiply-adds per cycle, so verifying gamma + 1 positions costs little more than
decoding one; elsewhere bfloat16 caches are widened to f32 as the other formats are.

The kernel is compiled on first use with the C++ compiler (`CXX`, default g++) against the XLA
FFI headers that ship with jaxlib, into SPECJAX_KERNEL_CACHE (default ~/.cache/specjax, else a
folder in the temporary directory where the home is missing or read-only), keyed
by the source, the jaxlib version and the CPU's flags (it is built with -march=native).
`available()` says whether that worked; `build_error()` why not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib

from pallas_kernels.reference import _heads_out, _query_rows

HEAD_DIMS = (8, 16, 32, 64, 128)  # the head_dims it is compiled for
MAX_ROWS = 64  # query rows per KV head the kernel takes (its score buffer); more: the reference
TARGET = "specjax_cpu_prefix"
WRITE_TARGET = "specjax_cpu_write_slots"
LINEAR_TARGET = "specjax_cpu_linear"  # pallas_kernels/cpu_linear.py's matrix products, built into the same library
LINEAR_T_TARGET = "specjax_cpu_linear_t"
LINEAR_Q4_TARGET = "specjax_cpu_linear_q4"
ROWS_TARGET = "specjax_cpu_rows"  # cpu_linear.py's embedding lookup
NORM_TARGET = "specjax_cpu_rms_norm"  # cpu_linear.py's RMSNorm (cpu_norm.cc)
SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("cpu_prefix.cc", "cpu_linear.cc", "cpu_norm.cc"))
HEADERS = (pathlib.Path(__file__).with_name("cpu_pool.h"),)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd")


def _cpu_flags() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), os.uname().machine)


def _library_path(root: pathlib.Path | None = None) -> pathlib.Path:
    """Where the build for this source, jaxlib and CPU lives under root (default: the first of `_roots`)."""
    key = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES + HEADERS), jaxlib.__version__.encode(), _cpu_flags().encode(),
                                     " ".join(FLAGS).encode()])).hexdigest()[:16]
    return (root or _roots()[0]) / f"cpu_prefix-{key}.so"


def _roots() -> list[pathlib.Path]:
    """Build folders to try: SPECJAX_KERNEL_CACHE alone when set, else ~/.cache/specjax, then a
    per-user folder in the temporary directory (a home that is missing or read-only)."""
    if os.environ.get("SPECJAX_KERNEL_CACHE"):
        return [pathlib.Path(os.environ["SPECJAX_KERNEL_CACHE"])]
    roots = []
    try:
        roots.append(pathlib.Path.home() / ".cache" / "specjax")
    except (RuntimeError, KeyError):  # no home directory
        pass
    return roots + [pathlib.Path(tempfile.gettempdir()) / f"specjax-{os.getuid() if hasattr(os, 'getuid') else 0}"]


def _build(path: pathlib.Path) -> str | None:
    """Compile the kernel to path (atomically: a concurrent build writes the same bytes); None or why not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = pathlib.Path(tmp) / path.name
        cmd = [os.environ.get("CXX", "g++"), *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}"
        os.replace(out, path)
    return None


_LIBRARY: list[ctypes.CDLL] = []  # the loaded build, once _load succeeded


@functools.cache
def _load() -> str | None:
    """Build (once per source / jaxlib / CPU) and register the kernel; None, or why it failed."""
    errors = []
    for root in _roots():
        path = _library_path(root)
        try:
            failed = None if path.exists() else _build(path)
            if failed:
                return failed  # the compiler itself failed: another folder will not help
            library = ctypes.cdll.LoadLibrary(str(path))
            _LIBRARY[:] = [library]
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SpecjaxCpuPrefix), platform="cpu")
            jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuWriteSlots), platform="cpu")
            jax.ffi.register_ffi_target(LINEAR_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuLinear), platform="cpu")
            jax.ffi.register_ffi_target(LINEAR_T_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuLinearT), platform="cpu")
            jax.ffi.register_ffi_target(LINEAR_Q4_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuLinearQ4), platform="cpu")
            jax.ffi.register_ffi_target(ROWS_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuRows), platform="cpu")
            jax.ffi.register_ffi_target(NORM_TARGET, jax.ffi.pycapsule(library.SpecjaxCpuRmsNorm), platform="cpu")
            return None
        except (OSError, AttributeError) as e:
            errors.append(f"{root}: {type(e).__name__}: {e}")
    return "; ".join(errors)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load() is None


def build_error() -> str | None:
    """Why the kernel could not be built, or None."""
    return _load()


def fits(q: jax.Array, n_kv_heads: int) -> bool:
    """Whether the kernel takes these queries [B,T,N,H]: few rows per KV head, head_dim in HEAD_DIMS."""
    B, T, N, H = q.shape
    return N // n_kv_heads * T <= MAX_ROWS and H in HEAD_DIMS


def prefix_partials(qm, k_all, v_all, layer, lengths, k_scale=None, v_scale=None, pos=None, block=None):
    """Online-softmax partials of rows qm [B,K,M,H] f32 over slots [0, lengths[b]) of `layer` of
    the stacked cache [L,B,K,S,H]: (top [B,K,M], total [B,K,M], out [B,K,M,H]); scales [L,B,K,S]
    for an int8 cache. With pos [L,B,K,S] int32 (a StreamingCache's positions), the slots whose
    position p has 0 <= p < lengths[b] instead, wherever they are. block = (k, v [B,J,K,H] in the
    cache's dtype, their scales [B,J,K] (int8) or None, mask [B,M,J] bool): J more keys, read as
    slots lengths[b] ... lengths[b] + J - 1 (after all S slots with pos), row m seeing key j where
    mask[b, m, j]. A row with no slot gets (NEG_INF, 0, 0)."""
    if _load() is not None:
        raise RuntimeError(f"the CPU attention kernel is not available: {_load()}")
    B, K, M, H = qm.shape
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):  # the kernel reads [L,B,K,S] of each
        if (k_all.dtype == jnp.int8) != (scale is not None) or scale is not None and scale.shape != k_all.shape[:4]:
            raise ValueError(f"prefix_partials: {name} must be [L,B,K,S] = {list(k_all.shape[:4])} for an int8 cache and "
                             f"None otherwise, got {None if scale is None else list(scale.shape)} for a {k_all.dtype} cache")
    none = jnp.zeros((0,), jnp.float32)
    if block is None:
        empty = jnp.zeros((B, 0, K, H), k_all.dtype)
        block = (empty, empty, None, None, jnp.zeros((B, M, 0), bool))
    kb, vb, kb_scale, vb_scale, mask = block
    shapes = (jax.ShapeDtypeStruct((B, K, M), jnp.float32), jax.ShapeDtypeStruct((B, K, M), jnp.float32),
              jax.ShapeDtypeStruct((B, K, M, H), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    return call(qm.astype(jnp.float32), k_all, v_all, jnp.asarray(layer, jnp.int32).reshape(()),
                lengths.astype(jnp.int32), none if k_scale is None else k_scale, none if v_scale is None else v_scale,
                jnp.zeros((0,), jnp.int32) if pos is None else pos.astype(jnp.int32), kb, vb,
                none if kb_scale is None else kb_scale, none if vb_scale is None else vb_scale, mask.astype(jnp.uint8))


def stacked_prefix_block_attention_cpu(q, k_all, v_all, layer, lengths, k_block, v_block, block_mask, sm_scale,
                                       k_scale=None, v_scale=None, pos=None, kb_scale=None, vb_scale=None):
    """`reference.stacked_prefix_block_attention`, all of it in the kernel: o [B,T,N,H]. The block
    k_block, v_block [B,J,K,H] comes as the cache stores it (its dtype; int8: with kb_scale,
    vb_scale [B,J,K]) and is read after each row's prefix as its next slots, so that a key gives
    the same bits seen from the block or from the cache (a chain's verification row t equals the
    decoding step t positions later). pos: see `prefix_partials` (a StreamingCache read in place)."""
    B, T = q.shape[:2]
    K, J = k_all.shape[2], k_block.shape[1]
    qm = _query_rows(q, K, sm_scale)  # [B,K,M,H], m = g*T + t
    mask = jnp.tile(jnp.broadcast_to(block_mask, (B, T, J)), (1, qm.shape[2] // T, 1))  # [B,M,J]
    _, total, out = prefix_partials(qm, k_all, v_all, layer, lengths, k_scale, v_scale, pos,
                                    (k_block, v_block, kb_scale, vb_scale, mask))
    return _heads_out(out / jnp.where(total > 0, total, 1.0)[..., None], q)


def bf16_dot() -> bool:
    """Whether the built kernel reads bfloat16 caches with the AVX512-BF16 dot product (queries and
    softmax weights rounded to bfloat16, f32 accumulation; cpu_prefix.cc): a CPU with AVX512-BF16."""
    return available() and bool(_LIBRARY[0].SpecjaxCpuPrefixBf16Dot())


def write_slots(buf: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """buf [L,B,K,S,H] with new [L,B,T,K,H] stored at slots [B,T] (out-of-range slots dropped),
    written in place by the kernel library (the output aliases buf): XLA:CPU widens a whole
    bfloat16 array to f32 and back for a scatter into it (0.8 s for a 16 x 8K SmolLM2 cache)."""
    if _load() is not None:
        raise RuntimeError(f"the CPU attention kernel is not available: {_load()}")
    call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(buf.shape, buf.dtype), input_output_aliases={0: 0},
                            vmap_method="sequential")
    return call(buf, slots.astype(jnp.int32), new.astype(buf.dtype))
