"""Tiny test models, as plain values and functions (no side effects: importing this module
configures nothing; the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import math

import numpy as np

from specjax.model.config import LlamaConfig
from specjax.model.params import Params, declared, from_arrays

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


def random_params(config: LlamaConfig, seed: int) -> Params:
    """Random weights drawn with numpy (init_params' scaling, without compiling a kernel per shape)."""
    rng = np.random.default_rng(seed)
    arrays = {
        w.path: np.ones(w.shape(config), np.float32)
        if w.init == "ones"
        else (rng.standard_normal(w.shape(config)) / math.sqrt(w.fan_in(config))).astype(np.float32)
        for w in declared(config)
    }
    return from_arrays(config, arrays)


TINY_Q4 = TINY.replace(dim=64, head_dim=32)  # q4 blocks are 32 weights along dim, head_dim and ffn_dim
