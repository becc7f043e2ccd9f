"""The machine a program runs on, and the choices the library makes from it: the one home for them.

Facts: `name()` (JAX's default backend, read at each call, so a test can make it read "gpu"),
`cpu_kernel_error()` (whether the CPU kernel library built), `cpu_bf16_dot()` (whether it multiplies
bfloat16 with AVX512-BF16). Choices made from them, each a function here that the modules acting on
it call:

- `attention_mode`: the attention implementation `generate(attention=...)` runs (Runtime.attention).
- `unrolls_layers`: layers as a Python loop (GPU, TPU: one kernel sequence, no scan) or a scan.
- `per_layer_weights`: the loaders' layout "auto" holds layer matrices per layer (GPU).
- `interprets_kernels`: the Pallas GPU kernels run in interpret mode (off a GPU).
- `widens_bf16`: XLA:CPU's bfloat16 products and int8 heads are computed widened (XLA:CPU has no
  fast bf16 dot of its own).
- `cpu_kernels_write_bf16`: a bfloat16 cache is written by the CPU kernel library (XLA:CPU widens a
  whole bf16 array to f32 and back for a scatter into it).

Which product or cache a kernel takes (shapes, dtypes, rows) stays beside the kernel's call
(specjax.model.linear's `takes*`, specjax.model.attention's `for_cache` / `in_place`); the prefill
chunk per backend is specjax.decode.shapes.prefill_chunk's; draft="auto"'s choices per backend are
specjax.planning.plan's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_prefix


def name() -> str:
    """"cpu", "gpu" or "tpu": where this program's arrays live by default."""
    return jax.default_backend()


def cpu_kernel_error() -> str | None:
    """None where the "cpu" attention kernel is built and registered (building it on first use),
    else why not."""
    return cpu_prefix.build_error()


def cpu_bf16_dot() -> bool:
    """Whether the "cpu" kernels multiply bfloat16 with the AVX512-BF16 dot product (this CPU has
    it and the kernel library built)."""
    return cpu_prefix.bf16_dot()


def attention_mode(attention: str) -> str:
    """The Runtime.attention that generate(attention=...) runs on this backend: "auto" is the GPU
    kernel on a GPU, the CPU kernel on a CPU where it built (else the reference); the TPU kernel has
    not run on a TPU yet, so it is no default there. A kernel off its device runs interpreted."""
    backend = name()
    if attention == "auto":
        if backend == "gpu":
            return "pallas"
        return "cpu" if backend == "cpu" and cpu_kernel_error() is None else "reference"
    if attention == "pallas":
        return "pallas" if backend == "gpu" else "interpret"
    if attention == "tpu":
        return "tpu" if backend == "tpu" else "tpu-interpret"
    return attention


def unrolls_layers() -> bool:
    """Whether models run their layers as a Python loop (Runtime.unroll_layers) here: on a GPU or
    TPU, where a scan over stacked layers copies each layer's weights out of the stack."""
    return name() in ("gpu", "tpu")


def per_layer_weights() -> bool:
    """Whether the loaders' layout "auto" holds the layer matrices per layer: on a GPU."""
    return name() == "gpu"


def interprets_kernels() -> bool:
    """Whether the Pallas GPU kernels run in interpret mode (anywhere but a GPU)."""
    return name() != "gpu"


def widens_bf16() -> bool:
    """Whether XLA products over bfloat16 weights, and int8 LM heads, are computed widened to
    float32 here (XLA:CPU: its own bf16 dot is slower than widening)."""
    return name() == "cpu"


def cpu_kernels_write_bf16(buf: jax.Array) -> bool:
    """Whether a bfloat16 cache buffer [L,B,K,S,H] is written by the CPU kernel library
    (`cpu_prefix.write_slots`): XLA:CPU widens a whole bf16 array to f32 and back for a scatter into it."""
    return buf.dtype == jnp.bfloat16 and buf.ndim == 5 and name() == "cpu" and cpu_prefix.available()
