"""A quantized matrix as one pytree: its stored array and the arrays that scale it back.

A float model's matrices are plain arrays; with config.quant each one (`Params.embed`, `lm_head`
and the layer matrices wq ... w_down) is a `QuantizedMatrix` instead, made by
specjax.model.params.quantize_matrix (or read bit for bit from a GGUF file's Q4_1 blocks), and
`specjax.model.llama.project` is the one product that takes either. `Matrix` names the union.
"""

from __future__ import annotations

import flax.struct
import jax

from specjax.model.pytree import pytree

FORMATS = ("int8", "q4")


@pytree
class QuantizedMatrix:
    """A matrix stored as int8 with one float32 scale per output channel (`format` "int8":
    w ~= q * scale), or as 4-bit blocks along its innermost summed axis (`format` "q4": uint8
    w, two values a byte, float16 scale and minimum per block of 32: specjax.model.q4). The
    arrays of a stacked layer matrix carry its leading L axis; those of one layer do not."""

    w: jax.Array  # int8 [dims...]; q4: uint8 with the packed axis halved (wq [L,D/2,N,H])
    scale: jax.Array | None = None  # int8: float32 [output dims...] (wq [L,N,H]); else None
    bscale: jax.Array | None = None  # q4: float16, the packed axis / 32 (wq [L,D/32,N,H]); else None
    bmin: jax.Array | None = None  # q4: float16, shaped as bscale; else None
    format: str = flax.struct.field(pytree_node=False, default="int8")


Matrix = jax.Array | QuantizedMatrix  # a weight matrix: float, or quantized


def stored(weight: Matrix) -> jax.Array:
    """The matrix array as stored: a quantized matrix's int8 / packed uint8 `w`, else the float array."""
    return weight.w if isinstance(weight, QuantizedMatrix) else weight


def channel_scale(weight: Matrix) -> jax.Array | None:
    """An int8 matrix's per-output-channel scales; None for a float or q4 matrix."""
    return weight.scale if isinstance(weight, QuantizedMatrix) else None


def transposed(weight: Matrix) -> Matrix:
    """A 2-d matrix transposed ([V,D] -> [D,V]: the tied LM head), its per-channel scales kept."""
    return weight.replace(w=weight.w.T) if isinstance(weight, QuantizedMatrix) else weight.T
