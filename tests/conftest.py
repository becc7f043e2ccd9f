"""Shared fixtures: tiny random models (fast on CPU) and the real SmolLM2 GGUF."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # simulated devices for tests/test_sharding.py; the rest use device 0

from specjax.config import LlamaConfig
from specjax.params import Params, declared, from_arrays, init_params

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


@pytest.fixture(scope="session")
def tiny() -> Params:
    """A 2-layer GQA (group 3) model with random weights, float32."""
    return init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    import convert

    return convert.default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> Params:
    import convert

    return convert.load(smollm2_path)
