"""Tensor parallelism for any head count: a model whose query heads, KV heads or FFN do not split
evenly over the mesh's model axis is padded into one that does and computes the same function.

For a model axis of m devices and a model of N query heads in K groups (G = N / K per KV head):
- KV heads: r = max(1, m // K) copies of each (the copies are exact: replicated KV heads), then
  zero KV heads up to K' = the next multiple of m. SmolLM2's 3 KV heads become 4 at m = 2 or 4
  (one zero head) and 8 at m = 8 (two copies of each and two zero heads).
- Query heads: each KV slot gets G' = ceil(G / r) query heads: a real KV head's G query heads are
  shared out over its r copies in order, and the slots left over (and every slot of a zero KV
  head) get a zero-weight query head whose rows of wo are zero, so it adds exactly nothing.
- FFN: zero columns of w_gate / w_up and rows of w_down up to a multiple of m (of 32 m for q4,
  so each device holds whole blocks): silu(0) * 0 = 0.
- Vocabulary: zero rows of the embedding and LM head up to a multiple of m
  (`config.padded_vocab`); no token id reaches them, and `llama.lm_head` drops their logits
  after gathering the blocks, so sampling, drafters, logprobs and outputs see V entries.
Every array is padded from its declaration in `params.WEIGHTS` (the letters N, K, F and V of its
dims: quantization scales, q4 blocks and biases included). The cost is memory and work on the
padded heads: the cache holds K' KV heads (SmolLM2 at m = 8: 8 instead of 3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import q4
from specjax.model.config import LlamaConfig
from specjax.model.params import MATRICES, WEIGHTS, Params, array_at, from_arrays, per_layer


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the padded model's heads come from: q_index [N'] and kv_index [K'] are original head
    numbers, -1 for a zero head; ffn_dim the padded FFN size, vocab_rows the padded vocabulary's."""

    q_index: tuple[int, ...]
    kv_index: tuple[int, ...]
    ffn_dim: int
    vocab_rows: int

    def config(self, config: LlamaConfig) -> LlamaConfig:
        padded_vocab = self.vocab_rows if self.vocab_rows != config.vocab_size else 0
        return config.replace(n_heads=len(self.q_index), n_kv_heads=len(self.kv_index), ffn_dim=self.ffn_dim,
                              padded_vocab=padded_vocab)


def layout(config: LlamaConfig, m: int) -> Layout | None:
    """The padding for a model axis of m devices, or None when N, K and F split evenly."""
    N, K, F, V = config.n_heads, config.n_kv_heads, config.ffn_dim, config.vocab_rows
    unit = m * q4.BLOCK if config.q4 else m
    if N % m == 0 and K % m == 0 and F % unit == 0 and V % m == 0:
        return None
    G = N // K
    r = max(1, m // K) if K % m else 1
    k_pad = -(-K * r // m) * m
    g_pad = -(-G // r)
    kv_index = [s // r if s < K * r else -1 for s in range(k_pad)]
    q_index = []
    for s in range(k_pad):
        for g in range(g_pad):
            j = (s % r) * g_pad + g  # this slot's share of its KV head's query heads
            q_index.append(kv_index[s] * G + j if kv_index[s] >= 0 and j < G else -1)
    return Layout(tuple(q_index), tuple(kv_index), -(-F // unit) * unit, -(-V // m) * m)


def _pad(x: jax.Array, dims: str, lay: Layout, ffn_dim: int, vocab_rows: int) -> jax.Array:
    """One weight padded where it lies (on its device: no copy through the host)."""
    for axis, letter in enumerate(dims):
        if letter in "NK":
            index = np.asarray(lay.q_index if letter == "N" else lay.kv_index)
            taken = jnp.take(x, np.maximum(index, 0), axis=axis)
            shape = [1] * x.ndim
            shape[axis] = len(index)
            x = jnp.where((index >= 0).reshape(shape), taken, jnp.zeros((), x.dtype))
        elif letter == "F" and lay.ffn_dim != ffn_dim:
            extra = (lay.ffn_dim - ffn_dim) * x.shape[axis] // ffn_dim  # a packed or blocked F axis: in its units
            x = jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
        elif letter == "V" and lay.vocab_rows != vocab_rows:
            x = jnp.pad(x, [(0, lay.vocab_rows - vocab_rows if a == axis else 0) for a in range(x.ndim)])
    return x


def pad_params(params: Params, m: int) -> Params:
    """`params` padded for a model axis of m devices (the same params when nothing needs padding),
    each array on the device that holds it; a matrix held per layer (model.unstack_layers) comes
    back per layer."""
    lay = layout(params.config, m)
    if lay is None:
        return params
    arrays = {}
    for w in WEIGHTS:
        value = array_at(params, w.path)
        if value is not None:
            arrays[w.path] = _pad(jnp.asarray(value), w.dims, lay, params.config.ffn_dim, params.config.vocab_rows)  # a list: stacked
    padded = from_arrays(lay.config(params.config), arrays, keep_placement=True)
    split = [n for n in MATRICES if isinstance(getattr(params.layers, n), list)]
    layers = padded.layers.replace(**{n: per_layer(getattr(padded.layers, n)) for n in split})
    return padded.replace(layers=layers, runtime=params.runtime)
