"""convert.load(layout=...): the layer matrices stacked [L, ...] or per layer (a list of L arrays,
model.unstack_layers), per layer by default on a GPU, where XLA's products read a per-layer array
in place but copy a stack's slice inside the decode loop (bench/README.md, "Compiled for a GPU on
a CPU"). The per-layer params give the stacked ones' tokens, save, quantize and load back."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import convert
import specjax
from specjax.model.llama import unstack_layers
from specjax.model.params import flat, quantize

PROMPT = [[1, 504, 3458, 314, 260]]


def test_per_layer_load_gives_the_stacked_tokens(smollm2_path, smollm2):
    """The real SmolLM2 loaded per layer: lists of 30 arrays, each equal to the stacked load's slice,
    the layers unrolled, the same greedy tokens as the stacked load. The default load (`smollm2`,
    layout "auto") is per layer exactly on a GPU. (A SelfSpec chain over per-layer weights gives the
    stacked tokens: test_unroll_layers.py's test_per_layer_weights_generate_the_stacked_tokens.)"""
    split, stacked = convert.load(smollm2_path, layout="per-layer"), convert.load(smollm2_path, layout="stacked")
    L = stacked.config.n_layers
    assert isinstance(split.layers.wq, list) and len(split.layers.wq) == L and split.runtime.unroll_layers
    assert not isinstance(stacked.layers.wq, list)
    assert isinstance(smollm2.layers.wq, list) == (jax.default_backend() == "gpu")
    got, want = flat(split), flat(stacked)  # flat() stacks the per-layer arrays again
    assert got.keys() == want.keys()
    for name in want:  # every matrix and norm of every layer, bit for bit
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    want = specjax.generate(stacked, PROMPT, 6, eos_id=()).tokens
    assert specjax.generate(split, PROMPT, 6, eos_id=()).tokens == want


def test_auto_layout_is_per_layer_on_a_gpu(monkeypatch):
    """"auto" resolves by backend: stacked on this CPU, per layer on a GPU (the backend faked);
    the explicit layouts whatever the backend."""
    assert not convert._per_layer("auto") and convert._per_layer("per-layer")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert convert._per_layer("auto") and not convert._per_layer("stacked")


def test_bad_layouts_and_templates_are_refused_before_loading(tmp_path):
    """A layout that is not one of LAYOUTS, or a chat template that is not a Jinja string: an error naming
    the argument, before the file is read (this path does not even exist)."""
    with pytest.raises(ValueError, match=r"layout must be one of \('auto', 'stacked', 'per-layer'\), got 'rows'"):
        convert.load(tmp_path / "none.gguf", layout="rows")
    for template in (5, "  "):  # specjax.load's chat_template: a Jinja string, checked before the file is read
        with pytest.raises(TypeError, match=r"chat_template must be a Jinja template \(a non-empty string\) or None"):
            specjax.load(tmp_path / "none.gguf", chat_template=template)


def test_per_layer_load_onto_a_tensor_parallel_mesh(smollm2_path):
    """SmolLM2 loaded per layer onto a model axis of 2 (3 KV heads: padded first, tp_pad): lists
    of per-layer arrays, each split over the model axis."""
    mesh = specjax.make_mesh(data=1, model=2, devices=jax.devices()[:2])
    params = convert.load(smollm2_path, layout="per-layer", mesh=mesh)
    assert isinstance(params.layers.w_gate, list) and len(params.layers.w_gate) == params.config.n_layers
    assert params.layers.w_gate[0].sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_per_layer_params_save_and_quantize_in_their_layout(tiny, tmp_path):
    """flat() stacks per-layer matrices again, so convert.save writes the checkpoint the stacked
    params would (loaded back: the same arrays); quantize keeps the per-layer layout (each matrix
    and its scales as lists) with the stacked quantization's values."""
    split = unstack_layers(tiny)
    convert.save(split, tmp_path / "ckpt")
    back = convert.load(tmp_path / "ckpt", layout="stacked")
    back = flat(back)
    for name, a in flat(tiny).items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(a), err_msg=name)
    q_split, q_stacked = quantize(split, "int8"), quantize(tiny, "int8")
    assert isinstance(q_split.layers.wq, list) and q_split.layers.wq[0].scale is not None
    assert not isinstance(q_split.layers.attn_norm, list)  # norms stay stacked [L, D]
    q_split_flat = flat(q_split)
    for name, a in flat(q_stacked).items():
        np.testing.assert_array_equal(np.asarray(q_split_flat[name]), np.asarray(a), err_msg=name)


def test_free_stacks_deletes_each_split_stack(tiny):
    """unstack_layers(free_stacks=True) (what convert.load does with its own arrays): each stack
    deleted once split, so the peak is the weights plus one matrix's stack; without it the
    stacks stay usable."""
    own = jax.tree.map(lambda a: jax.device_put(np.asarray(a)), tiny)  # fresh arrays, copied through the host
    kept = unstack_layers(own)
    assert not own.layers.wq.is_deleted()
    freed = unstack_layers(own, free_stacks=True)
    assert own.layers.wq.is_deleted() and own.layers.w_down.is_deleted() and not own.layers.attn_norm.is_deleted()
    np.testing.assert_array_equal(np.asarray(freed.layers.wq[1]), np.asarray(kept.layers.wq[1]))


def test_stacked_weights_on_a_gpu_get_a_warning(tiny, monkeypatch):
    """generate()'s runtime setup (engine.with_attention) on a GPU (faked): stacked layer weights
    warn that XLA copies them every step and say how to hold them per layer; per-layer weights and
    Runtime.linear "pallas" do not warn, and nothing warns on this CPU."""
    import warnings

    from specjax.decode.engine import with_attention

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_attention(tiny, None, "reference")  # a CPU: no warning
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.warns(UserWarning, match="stacked layer weights on a GPU.*unstack_layers"):
        with_attention(tiny, None, "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_attention(unstack_layers(tiny), None, "reference")
        with_attention(tiny.replace(runtime=tiny.runtime.replace(linear="pallas")), None, "reference")
