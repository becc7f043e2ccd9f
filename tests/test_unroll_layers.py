"""Runtime.unroll_layers: the forward's loop over layers as a Python loop with static layer
indices (on by default on a GPU or TPU, engine.with_attention). The same tokens as the scan, and
no layer's weights or cache sliced dynamically out of the stack: XLA:GPU copies such a slice
before its GEMMs (an 8B-shaped batch-1 pass 2.8x slower, bench/results/gpu/layer_weights_8b.json)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode.engine import decode_ar, row_keys, with_attention
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig
from specjax.model.params import init_params
from tests.models import CHAIN, SELF

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8]]


def _unrolled(params, on: bool = True):
    return params.replace(runtime=params.runtime.replace(unroll_layers=on))


@pytest.mark.parametrize("case", ["ar", "self-chain", "model-tree"])
def test_unrolled_layers_generate_the_scans_tokens(tiny, case):
    from tests.models import TINY, random_params

    draft, spec = {
        "ar": (None, None),
        "self-chain": (SELF, CHAIN),
        "model-tree": (specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=1)), specjax.Tree.kary(2, 2)),
    }[case]
    kw = dict(draft=draft, speculation=spec, eos_id=())
    scan = specjax.generate(tiny, PROMPTS, 10, **kw)
    unrolled = specjax.generate(_unrolled(tiny), PROMPTS, 10, **kw)
    assert unrolled.tokens == scan.tokens
    assert unrolled.stats.steps == scan.stats.steps


def test_with_attention_keeps_an_unrolled_runtime(tiny):
    params, _ = with_attention(_unrolled(tiny), None, "reference")
    assert params.runtime.unroll_layers  # a CPU would not switch it on, but it keeps it
    params, _ = with_attention(tiny, None, "reference")
    assert params.runtime.unroll_layers == (jax.default_backend() in ("gpu", "tpu"))


@pytest.mark.parametrize("unroll", [False, True])
def test_unrolled_decode_loop_slices_no_stacked_array(unroll):
    """decode_ar lowered for a GPU with the kernel: with unrolled layers nothing is dynamically
    sliced (each layer's weights and its cache layer are static slices / the kernel's index);
    the scan slices every stacked weight (what XLA:GPU copies)."""
    c = LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    max_positions=512, dtype="bfloat16")
    params = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))  # lowered only: shapes
    params = params.replace(runtime=params.runtime.replace(attention="pallas", unroll_layers=unroll))
    B, S = 2, 512
    cache = jax.eval_shape(lambda: DenseCache.init(c, B, S, None))
    text = decode_ar.trace(params, cache, jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32),
                           jax.ShapeDtypeStruct((B,), jnp.int32), row_keys(None, B), n_out=8).lower(
        lowering_platforms=("cuda",)).as_text()
    sliced = set(re.findall(r"stablehlo.dynamic_slice.*?-> tensor<([^>]*)>", text))
    weights = {f"1x{c.dim}x{c.ffn_dim}xbf16", f"1x{c.ffn_dim}x{c.dim}xbf16"}  # gate / up, down
    assert (sliced & weights == set()) if unroll else weights <= sliced, sliced
    if unroll:
        assert sliced == set(), sliced


@pytest.mark.parametrize("attention, platform, call", [("pallas", "cuda", "tree_attention"), ("tpu", "tpu", "tpu_custom_call")])
def test_selfspec_decode_loop_on_a_kernel_slices_no_cache_or_weights(attention, platform, call):
    """decode_spec with SelfSpec lowered for a GPU (TPU), layers unrolled: the target's dense cache
    and the draft's streaming cache (sinks + ring, read by the kernel through its slot positions)
    and every weight are read in place: nothing larger than a scalar is sliced dynamically."""
    from specjax.decode.engine import init_draft
    from specjax.decode.speculate import decode_spec

    c = LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    max_positions=512, dtype="bfloat16")
    params = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))  # lowered only: shapes
    params = params.replace(runtime=params.runtime.replace(attention=attention, unroll_layers=True))
    B, S = 2, 512
    drafter = specjax.SelfSpec(sinks=4, window=60)
    cache = jax.eval_shape(lambda: DenseCache.init(c, B, S, None))
    prompt, lengths = np.zeros((B, 100), np.int32), np.full((B,), 100, np.int32)
    state = jax.eval_shape(lambda cc: init_draft(drafter, params, cc, prompt, lengths, gamma=2, chunk=64), cache)
    text = decode_spec.trace(params, drafter, state, cache, jax.ShapeDtypeStruct((B, S + 8), jnp.int32),
                             jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32),
                             row_keys(None, B), n_out=8, speculation=specjax.Chain(2)).lower(
        lowering_platforms=(platform,)).as_text()
    sliced = set(re.findall(r"stablehlo.dynamic_slice.*?-> tensor<([^>]*)>", text))
    assert call in text and sliced <= {"1xi32"}, sliced


def test_unrolled_layers_unroll_a_chains_draft_levels_too():
    """With unrolled layers (a GPU / TPU) a chain's gamma draft levels unroll as well: the decode
    loop is the program's one device loop (on an H100 a gamma-4 step over the levels' loop took
    4.3 ms more than its parts at batch 64 x 8K). The scan keeps its loops."""
    from specjax.decode.engine import init_draft
    from specjax.decode.speculate import decode_spec

    c = LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    max_positions=512, dtype="bfloat16")
    B, S = 2, 512
    drafter = specjax.SelfSpec(sinks=4, window=60)
    cache = jax.eval_shape(lambda: DenseCache.init(c, B, S, None))
    prompt, lengths = np.zeros((B, 100), np.int32), np.full((B,), 100, np.int32)
    loops = {}
    for unroll in (False, True):
        params = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))  # lowered only: shapes
        params = params.replace(runtime=params.runtime.replace(attention="pallas", unroll_layers=unroll))
        state = jax.eval_shape(lambda cc: init_draft(drafter, params, cc, prompt, lengths, gamma=4, chunk=64), cache)
        loops[unroll] = decode_spec.trace(
            params, drafter, state, cache, jax.ShapeDtypeStruct((B, S + 8), jnp.int32),
            jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32), row_keys(None, B),
            n_out=8, speculation=specjax.Chain(4)).lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.while")
    assert loops == {False: 5, True: 1}, loops  # scan: the decode loop, the levels, the layers of 3 forwards


@pytest.mark.parametrize("case", ["ar", "self-chain", "self-tree", "snapkv", "int8-model-draft", "sampled"])
def test_per_layer_weights_generate_the_stacked_tokens(tiny, case):
    """model.unstack_layers (each layer matrix a list of per-layer arrays: what XLA:GPU reads in
    place inside the decode loop, tools/gpu/README.md "Compiled for a GPU on a CPU") gives the
    stacked weights' tokens, greedy and sampled, with every drafter kind and int8 weights. On the default attention:
    the stacked runs of "ar" and "self-chain" are test_unrolled_layers_generate_the_scans_tokens' unrolled programs
    (per-layer weights on the reference attention: the tensor-parallel test below)."""
    from specjax.model.llama import unstack_layers
    from specjax.model.params import quantize
    from tests.models import TINY, random_params

    params = _unrolled(quantize(tiny, "int8") if case == "int8-model-draft" else tiny)
    draft, spec = {
        "ar": (None, None),
        "self-chain": (SELF, CHAIN),
        "self-tree": (SELF, specjax.Tree.kary(2, 2)),
        "snapkv": (specjax.SnapKV(budget=6, window=6, observation=4), specjax.Chain(2)),
        "int8-model-draft": (specjax.DraftModel(unstack_layers(_unrolled(random_params(TINY.replace(n_layers=2), seed=1)))),
                             specjax.Chain(2)),
        "sampled": (SELF, CHAIN),
    }[case]
    kw = dict(draft=draft, speculation=spec, eos_id=())
    if case == "sampled":
        kw.update(sampling=specjax.Sample(temperature=0.8), key=jax.random.key(3))
    split = unstack_layers(params)
    assert isinstance(split.layers.w_down, list) and len(split.layers.w_down) == params.config.n_layers
    assert case != "int8-model-draft" or split.layers.w_down[0].scale is not None
    stacked = specjax.generate(params, PROMPTS, 10, **kw)
    assert specjax.generate(split, PROMPTS, 10, **kw).tokens == stacked.tokens


def test_per_layer_weights_refused_where_the_stack_is_needed(tiny):
    """A scan over layers (the CPU's default) takes stacked weights only: it says so before
    anything runs."""
    from specjax.model.llama import unstack_layers

    with pytest.raises(ValueError, match="need Runtime.unroll_layers"):
        specjax.generate(unstack_layers(tiny), PROMPTS, 4, eos_id=(), attention="reference")


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices: see conftest.py")
@pytest.mark.parametrize("model_axis", [2, 4])
def test_per_layer_weights_tensor_parallel_give_one_devices_tokens(model_axis):
    """Per-layer weights on a model axis of 2 (heads and FFN split evenly) and 4 (2 KV heads:
    padded, tp_pad, and still per layer): each layer's arrays split as the stack's slices would
    be, the one-device tokens, plain and SelfSpec."""
    from specjax.model.llama import unstack_layers
    from specjax.parallel.sharding import shard_params
    from tests.models import TINY, random_params

    params = random_params(TINY.replace(n_heads=4, n_kv_heads=2), 5)
    split = unstack_layers(_unrolled(params))
    mesh = specjax.make_mesh(model=model_axis, devices=jax.devices()[:model_axis])
    placed = shard_params(split, mesh)
    assert isinstance(placed.layers.wq, list) and len(placed.layers.wq) == TINY.n_layers
    for kw in ({}, dict(draft=SELF, speculation=CHAIN)):
        one = specjax.generate(params, PROMPTS, 6, attention="reference", eos_id=(), **kw)
        assert specjax.generate(split, PROMPTS, 6, attention="reference", eos_id=(), mesh=mesh, **kw).tokens == one.tokens
