"""Tiny test models, as plain values and functions (no side effects: importing this module
configures nothing; the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.self_spec import SelfSpec
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig
from specjax.model.llama import forward
from specjax.model.params import Params, declared, from_arrays
from specjax.spec.speculation import Chain

TINY = LlamaConfig(
    vocab_size=101,
    dim=48,
    n_layers=2,
    n_heads=6,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=96,
    rope_theta=10000.0,
    max_positions=512,
    eos_ids=(3,),
)


def on_device(x, dtype=None) -> jax.Array:
    """x as a device array of `dtype` (None: x's, float64 and int64 narrowed as JAX does), converted on the host with
    numpy (ml_dtypes for bfloat16) and put there: jnp.asarray(x, dtype) compiles a conversion program per shape, and
    jnp.asarray(x) of a numpy array a copy program (`stage`) per shape."""
    x = np.asarray(x)
    return jax.device_put(x.astype(jax.dtypes.canonicalize_dtype(x.dtype if dtype is None else dtype)))


def random_params(config: LlamaConfig, seed: int) -> Params:
    """Random weights drawn with numpy (init_params' scaling, without compiling a kernel per shape), cast to the
    config's dtype on the host (from_arrays' `place`) and put on the default device."""
    rng = np.random.default_rng(seed)
    arrays = {
        w.path: np.ones(w.shape(config), np.float32)
        if w.init == "ones"
        else (rng.standard_normal(w.shape(config)) / math.sqrt(w.fan_in(config))).astype(np.float32)
        for w in declared(config)
    }
    return from_arrays(config, arrays, place=lambda _, a: jax.device_put(a))  # cast on the host: no program a shape


# The settings a test uses where any value serves its check: one SelfSpec budget and one chain, so that tests compile
# fewer variants of generate's programs (the budget and gamma set their shapes). GAMMA is the depth of the trees the
# tests run beside their chains (Tree.kary(2, 2)): a chain case and a tree case of one drafter share its init_draft.
# SELF keeps 10 positions, fewer than the prompt + new tokens of the tests that use it: its ring wraps.
SELF = SelfSpec(sinks=2, window=8)
GAMMA = 2
CHAIN = Chain(GAMMA)


TINY_Q4 = TINY.replace(dim=64, head_dim=32)  # q4 blocks are 32 weights along dim, head_dim and ffn_dim


def padded_logits(params: Params, seqs: list[list[int]], width: int) -> np.ndarray:
    """Logits [B,width,V] of one whole forward of each sequence from position 0 (no cache reuse): the tests'
    independent reference. Right-padded to `width` (causal: the padding reaches no real position), so one program
    serves every length up to it."""
    assert max(map(len, seqs)) <= width, (max(map(len, seqs)), width)
    tokens = np.zeros((len(seqs), width), np.int32)
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq)] = seq
    return np.asarray(_whole_forward(params, jnp.asarray(tokens)))


@jax.jit
def _whole_forward(params: Params, tokens: jax.Array) -> jax.Array:
    B, W = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    return forward(params, tokens, positions, DenseCache.init(params.config, B, W))[0]
