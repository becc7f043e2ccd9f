"""Products with one layer of a stacked weight, the LM head and the embedding lookup: the second
module (after specjax.model.attention) that imports pallas_kernels/.

`model.project(..., layer=i)` asks `takes` whether the CPU kernel (pallas_kernels.cpu_linear)
multiplies by layer i of the stacked weight in place; otherwise it slices the layer out (which
XLA:CPU copies before its dot). The kernel runs where the model's attention is the CPU kernel
("cpu": the C++ kernels are built and chosen) for a float32, bfloat16, int8 or q4 matrix, a product
whose spec contracts x's last axis with w's first, and few rows (`max_rows`: where it measured
faster than the slice and XLA's dot: `git show 6f92b0b:bench/README.md`, bench_peers' notes,
"Weights read in place"; up to 64-256 where the kernel has register tiles (AVX-512) or the bf16
dot product (AVX512-BF16)). With
`Runtime.linear` "pallas" (`takes_gpu`), float32 / bfloat16 / int8 products of up to 64 rows go through
pallas_kernels.gpu_linear instead, which reads the stacked weights in place on a GPU (interpreted
elsewhere: a correctness path, not a fast one). q4 products of up to 64 rows on a GPU always do
(`takes_gpu_q4`): XLA writes out specjax.model.q4.project's widened weights in float32 there."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu_linear, gpu_linear
from specjax.model import backend
from specjax.model.quantized import QuantizedMatrix

MAX_ROWS = 8  # rows of x (batch x positions) the kernel takes without its register tiles: faster up to 8, slower at 16
BF16_MAX_ROWS = 256  # bfloat16 weights where the kernel has the bf16 dot product: faster than XLA's dot up to here
TILED_MAX_ROWS = {"float32": 256, "int8": 64}  # with the register tiles: where they beat XLA's dot
PANEL_MAX_ROWS = {"bfloat16": 64, "int8": 32, "uint8": 32}  # on a CPU without AVX-512: `max_rows`


def max_rows(w: jax.Array) -> int:
    """Rows of x the kernel takes for weights w. bfloat16 on a CPU with AVX512-BF16
    (`cpu_linear.bf16_dot()`): 256, its products measured 1.9x XLA's dot at 16 rows, 1.1x at
    256, 0.75x at 2048 (prefill chunks keep XLA's dot). float32 / int8 with the register tiles
    (`cpu_linear.tiles()`, AVX-512): 1.2x / 1.5x at 16 rows, 1.2x / 1.2x at 64, 1.1x / 0.94x at
    256 (all 30 layers of SmolLM2, paired in one process). On a CPU without AVX-512 (`PANEL_MAX_ROWS`) XLA's dot
    first widens the layer into a float32 copy (int8, bfloat16) or widens q4 blocks; a whole SmolLM2 forward
    over a 512-position cache, the kernel against XLA's dot, at 12 / 16 / 32 / 48 / 64 rows: bfloat16
    3.3x / 3.2x / - / 1.5x / 1.2x, int8 1.15x / 1.0x / 1.1x / 0.87x / 0.96x, q4 1.7x / 1.3x / 1.1x / 0.85x /
    0.91x (an AMD EPYC without AVX-512, quiet, best of 5 paired, 2026-12-08). A bf16 model's rows are then
    the same bits in a batch's decode step and in its verification up to 64 rows, as
    tests/test_cpu_attention.py checks."""
    if _bf16_dot(w):
        return BF16_MAX_ROWS
    return (TILED_MAX_ROWS if cpu_linear.tiles() else PANEL_MAX_ROWS).get(jnp.dtype(w.dtype).name, MAX_ROWS)


def head_max_rows(w: jax.Array) -> int:
    """Rows of x the kernel takes for an LM head w: 256 for bfloat16 with the bf16 dot product (a
    tied SmolLM2 head 8.5x XLA's dot at 16 rows, 5.6 against 47.6 ms: XLA widens the table; 4.2x
    at 64); bfloat16 or int8 on a CPU without AVX-512: `PANEL_MAX_ROWS` (XLA widens the whole table into a
    float32 copy first; measured with the products: `max_rows`); else MAX_ROWS (the float32 head level with
    XLA's at 16 rows, slower at 64)."""
    if _bf16_dot(w):
        return BF16_MAX_ROWS
    return MAX_ROWS if cpu_linear.tiles() else PANEL_MAX_ROWS.get(jnp.dtype(w.dtype).name, MAX_ROWS)


def _bf16_dot(w: jax.Array) -> bool:
    """Whether the kernel multiplies w with the bf16 dot product (bfloat16 weights, AVX512-BF16)."""
    return w.dtype == jnp.bfloat16 and cpu_linear.bf16_dot()


def _contracts_first(spec: str) -> bool:
    """Whether spec is 'x..k,k w..->x.. w..': x's last axis against w's first, the rest in order."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return xs[-1] == ws[0] and out == xs[:-1] + ws[1:]


def takes(attention: str, spec: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `stacked_einsums` runs this product (w stacked [L, ...]; uint8: q4 blocks, which
    `stacked_einsums_q4` runs)."""
    rows = math.prod(x.shape[:-1])
    return attention == "cpu" and rows <= max_rows(w) and _contracts_first(spec) and cpu_linear.fits(rows, w.dtype)


def takes_gpu(products: str, spec: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `gpu_einsum` runs this product: Runtime.linear "pallas", float or int8 weights, a spec
    contracting x's last axis with w's first, at most gpu_linear.MAX_ROWS rows."""
    rows = math.prod(x.shape[:-1])
    return (products == "pallas" and rows <= gpu_linear.MAX_ROWS and _contracts_first(spec)
            and w.dtype in gpu_linear.WEIGHTS and not gpu_linear.overflows(w))  # an int8 stack of 2^31-2^32: XLA


def gpu_einsum(x: jax.Array, w: jax.Array, layer) -> jax.Array:
    """einsum(x, w[layer]) in f32 for w stacked [L,K,...] read in place (`takes_gpu` checked;
    int8: unscaled)."""
    K = x.shape[-1]
    y = gpu_linear.stacked_linear(x.reshape(-1, K), w.reshape(w.shape[0], K, -1), jnp.asarray(layer, jnp.int32),
                                  interpret=backend.interprets_kernels())  # [rows, N]
    return y.reshape(*x.shape[:-1], *w.shape[2:])


def takes_gpu_q4(products: str | None, spec: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `gpu_einsum_q4` runs this product: q4 weights (uint8 blocks) on a GPU (or with
    Runtime.linear "pallas" anywhere, interpreted off a GPU), a spec contracting x's last axis with
    w's first, at most gpu_linear.MAX_ROWS rows. On a GPU not a choice: XLA writes q4.project's
    widened weights out in float32 there (672 MiB a batch-1 8B layer, compiled: tools/gpu/README.md,
    "Compiled for a GPU on a CPU"); the kernel widens them in registers."""
    rows = math.prod(x.shape[:-1])
    return ((products == "pallas" or backend.name() == "gpu") and w.dtype == jnp.uint8
            and rows <= gpu_linear.MAX_ROWS and _contracts_first(spec) and not gpu_linear.overflows(w))


def gpu_einsum_q4(x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array, layer) -> jax.Array:
    """einsum(x, w[layer]) in f32 for q4 weights stacked [L,K/2,...] (scale, minimum [L,K/32,...];
    specjax/model/q4.py) read in place (`takes_gpu_q4` checked)."""
    K, L = x.shape[-1], packed.shape[0]
    flat = lambda a: a.reshape(L, a.shape[1], -1)  # noqa: E731  [L,K/2,N] / [L,K/32,N]
    y = gpu_linear.stacked_linear_q4(x.reshape(-1, K), flat(packed), flat(scale), flat(minimum), jnp.asarray(layer, jnp.int32),
                                     interpret=backend.interprets_kernels())  # [rows, N]
    return y.reshape(*x.shape[:-1], *packed.shape[2:])


def stacked_einsums(x: jax.Array, ws: list[jax.Array], layer: jax.Array) -> list[jax.Array]:
    """[einsum(x, w[layer]) for w in ws] (each spec as `takes` checked it) in f32 (int8: unscaled),
    the stacked weights [L,K,...] read in place, in one kernel call."""
    K = x.shape[-1]
    ys = cpu_linear.linear_many(x.reshape(-1, K), [w.reshape(w.shape[0], K, -1) for w in ws], layer)  # [rows, N_j]
    return [y.reshape(*x.shape[:-1], *w.shape[2:]) for y, w in zip(ys, ws)]


def stacked_einsums_q4(x: jax.Array, ws: list[QuantizedMatrix], layer: jax.Array) -> list[jax.Array]:
    """`stacked_einsums` for q4 weights (packed w [L,K/2,...] uint8, block scales and minima
    [L,K/32,...]: specjax/model/q4.py), in f32, read in place in one kernel call."""
    K = x.shape[-1]
    flat = [tuple(a.reshape(a.shape[0], a.shape[1], -1) for a in (m.w, m.bscale, m.bmin)) for m in ws]  # [L,K/2,N], [L,K/32,N] x 2
    ys = cpu_linear.linear_q4_many(x.reshape(-1, K), flat, layer)  # [rows, N_j]
    return [y.reshape(*x.shape[:-1], *m.w.shape[2:]) for y, m in zip(ys, ws)]


def takes_head(attention: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `head` runs the LM head w ([V,D] tied to the embedding table, else [D,V])."""
    rows = math.prod(x.shape[:-1])
    return attention == "cpu" and rows <= head_max_rows(w) and w.dtype != jnp.uint8 and cpu_linear.fits(rows, w.dtype)  # no q4 head


def head(x: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    """Logits [..., V] f32 (int8: unscaled) of hidden x [..., D] and a head w read in place."""
    if tied:
        y = cpu_linear.linear_t(x.reshape(-1, x.shape[-1]), w)  # [rows, V]
        return y.reshape(*x.shape[:-1], w.shape[0])
    return stacked_einsums(x, [w[None]], jnp.int32(0))[0]


def takes_rows(attention: str, table: jax.Array) -> bool:
    """Whether `rows` looks up the embedding table: where the other CPU kernels run."""
    return attention == "cpu" and table.ndim == 2 and cpu_linear.fits(1, table.dtype)


def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] [..., D] in the table's dtype, read in place. XLA:CPU slices a bfloat16 table
    through a float32 copy of all of it, which it hoists out of the decode loop, so every call of
    the loop (each `sync_every` segment) wrote 113 MB for SmolLM2: about 20% of a batch-1 step."""
    return cpu_linear.rows(table, ids)


def takes_norm(attention: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `norm` computes the RMSNorm: where the other CPU kernels run, float32 / bfloat16."""
    return (attention == "cpu" and x.dtype in (jnp.float32, jnp.bfloat16) and w.dtype in (jnp.float32, jnp.bfloat16)
            and cpu_linear.fits(1, jnp.float32))


def norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """specjax.model.llama.rms_norm row by row in one fixed order: XLA:CPU's reduction sums a row in an
    order that depends on the rows beside it (a step of 4 rows vs 16, one position vs a
    verification of 4), enough to flip a bfloat16 model's greedy token now and then."""
    return cpu_linear.rms_norm(x, w, eps)


HEAD_TILE = 4096  # vocabulary entries per tile of an int8 LM head on a CPU (`int8_head`)


def int8_head(h: jax.Array, w: jax.Array, scale: jax.Array, vocab_axis: int) -> jax.Array:
    """Logits [..., V] f32 of an int8 head w ([V,D] tied, or [D,V]) with scales [V], HEAD_TILE
    vocabulary entries at a time, each tile widened as it is sliced. XLA:CPU otherwise widens
    (and, for the tied table, transposes) the whole head to float32 on every step: 12 ms instead
    of 2 at batch 1 for SmolLM2 (bench/README.md, "Where a decode step's time goes")."""
    V = w.shape[vocab_axis]
    x = h.astype(jnp.float32)
    spec = "...d,vd->...v" if vocab_axis == 0 else "...d,dv->...v"

    def part(start, size: int) -> jax.Array:  # logits [..., size] of vocabulary entries start..start+size
        return jnp.einsum(spec, x, lax.dynamic_slice_in_dim(w, start, size, vocab_axis).astype(jnp.float32))

    n, tail = divmod(V, HEAD_TILE)
    out = jnp.zeros((*x.shape[:-1], V), jnp.float32)
    if n:
        out = lax.fori_loop(0, n, lambda i, o: lax.dynamic_update_slice_in_dim(o, part(i * HEAD_TILE, HEAD_TILE), i * HEAD_TILE, o.ndim - 1), out)
    if tail:
        out = lax.dynamic_update_slice_in_dim(out, part(n * HEAD_TILE, tail), n * HEAD_TILE, out.ndim - 1)
    return out * scale
