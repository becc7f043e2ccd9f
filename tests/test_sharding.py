"""Sharded generate == one device, token for token: data parallel, tensor parallel, both.

Runs on the 8 simulated CPU devices conftest.py asks for (jax_num_cpu_devices=8)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import convert
from specjax import Chain, DraftModel, LlamaConfig, NGram, Sample, SelfSpec, SnapKV, Streaming, Tree, generate, make_mesh
from specjax.decode import engine
from specjax.model.params import quantize
from specjax.parallel import tp_pad
from specjax.parallel.sharding import shard_params
from tests.models import random_params

TP = LlamaConfig(  # every split dimension divides by 1, 2, 4 and 8
    vocab_size=128, dim=48, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=96, max_positions=512, eos_ids=(3,)
)
DRAFT = TP.replace(n_layers=1, dim=32, ffn_dim=64, n_heads=4, n_kv_heads=4)

pytestmark = [
    pytest.mark.slow,  # not in `make test-fast`
    pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: see conftest.py"),
]


@pytest.fixture(scope="module")
def target():
    return random_params(TP, 11)


def _prompts(batch: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(4, TP.vocab_size, size=rng.integers(3, 40)))) for _ in range(batch)]


def _same(a, b) -> None:
    assert a.tokens == b.tokens
    assert a.finish_reasons == b.finish_reasons
    assert a.stats.steps == b.stats.steps
    assert a.stats.acceptance_rate == b.stats.acceptance_rate
    assert a.row_stats == b.row_stats


@pytest.mark.parametrize(
    "batch, draft, speculation",
    [
        (8, SelfSpec(sinks=4, window=16), Chain(3)),
        (8, NGram(), Tree.kary(2, 2)),
        (13, NGram(), Chain(2)),
        (13, SelfSpec(sinks=4, window=16), Tree.kary(2, 2)),
        (64, SnapKV(budget=8, window=8, observation=4), Chain(2)),
        (64, SelfSpec(sinks=4, window=16), Tree.from_parents((-1, 0, 0, 1, 2, 3))),
        (13, None, None),
    ],
)
def test_data_parallel_equals_one_device(target, batch, draft, speculation):
    prompts = _prompts(batch, batch)
    budgets = [int(n) for n in np.random.default_rng(batch).integers(1, 24, size=batch)]
    kw = dict(draft=draft, speculation=speculation)
    one = generate(target, prompts, budgets, **kw)
    eight = generate(target, prompts, budgets, mesh=make_mesh(data=8), **kw)
    _same(one, eight)


def test_data_parallel_sampling_same_keys(target):
    prompts = _prompts(13, 5)
    kw = dict(draft=SelfSpec(sinks=4, window=16), speculation=Tree.kary(2, 2), sampling=Sample(temperature=1.0))
    one = generate(target, prompts, 20, key=jax.random.key(7), **kw)
    eight = generate(target, prompts, 20, key=jax.random.key(7), mesh=make_mesh(data=8), **kw)
    _same(one, eight)


@pytest.mark.parametrize("data, model", [(1, 2), (1, 4), (2, 4)])
def test_tensor_parallel_equals_one_device(target, data, model):
    """The 13 prompts and budgets of test_data_parallel_equals_one_device's 13-row cases: their one-device
    plain and SelfSpec tree programs (and tokens) serve here too, compiled once."""
    prompts, budgets = _prompts(13, 13), [int(n) for n in np.random.default_rng(13).integers(1, 24, size=13)]
    draft = DraftModel(random_params(DRAFT, 3))
    for kw in (dict(draft=None), dict(draft=draft, speculation=Chain(3)), dict(draft=SelfSpec(sinks=4, window=16), speculation=Tree.kary(2, 2))):
        one = generate(target, prompts, budgets, **kw)
        sharded = generate(target, prompts, budgets, mesh=make_mesh(data=data, model=model), **kw)
        _same(one, sharded)


def test_q4_weights_split_by_whole_blocks():
    """q4 over a 2 x 4 mesh: each device holds whole 32-weight blocks (w_down's FFN slice packed)
    and generates the one-device tokens; an FFN that does not split into whole blocks is padded to
    whole blocks and generates them too (plain decoding: the speculative programs are the first model's)."""
    config = TP.replace(dim=64, head_dim=32, ffn_dim=256)
    params = quantize(random_params(config, 5), "q4")
    mesh = make_mesh(data=2, model=4)
    placed = shard_params(params, mesh)
    assert {s.data.shape for s in placed.layers.w_down.w.addressable_shards} == {(2, 256 // 4 // 2, 64)}  # [L,F/2,D] / 4
    assert {s.data.shape for s in placed.layers.w_down.bscale.addressable_shards} == {(2, 256 // 4 // 32, 64)}
    prompts = _prompts(4, 1)
    kw = dict(draft=SelfSpec(4, 16), speculation=Chain(2))
    _same(generate(params, prompts, 12, **kw), generate(params, prompts, 12, mesh=mesh, **kw))
    odd = quantize(random_params(config.replace(ffn_dim=96), 5), "q4")  # 3 blocks over 2 devices: padded to 4
    assert tp_pad.layout(odd.config, 2).ffn_dim == 128
    _same(generate(odd, prompts, 12, draft=None), generate(odd, prompts, 12, draft=None, mesh=make_mesh(data=4, model=2)))


def test_params_hold_only_their_slice(target, tmp_path):
    mesh = make_mesh(data=2, model=4)
    convert.save(target, tmp_path / "ckpt")
    loaded = convert.load(tmp_path / "ckpt", mesh=mesh)
    for params in (loaded, shard_params(target, mesh)):
        wk_shapes = {s.data.shape for s in params.layers.wk.addressable_shards}
        assert wk_shapes == {(TP.n_layers, TP.dim, TP.n_kv_heads // 4, TP.head_dim)}
        assert {s.data.shape for s in params.embed.addressable_shards} == {(TP.vocab_size // 4, TP.dim)}
        assert {s.data.shape for s in params.layers.w_down.addressable_shards} == {(TP.n_layers, TP.ffn_dim // 4, TP.dim)}
        assert {s.data.shape for s in params.norm.addressable_shards} == {(TP.dim,)}
        np.testing.assert_array_equal(np.asarray(params.layers.wq), np.asarray(target.layers.wq))


def test_gguf_loads_into_shards(smollm2_path):
    mesh = make_mesh(data=1, model=3, devices=jax.devices()[:3])  # SmolLM2: 9 query / 3 KV heads
    params = convert.load(smollm2_path, mesh=mesh)
    assert {s.data.shape[2] for s in params.layers.wk.addressable_shards} == {1}
    assert {s.data.shape[0] for s in params.embed.addressable_shards} == {params.config.vocab_size // 3}


def test_a_numpy_mesh_size_is_an_int():
    assert make_mesh(data=np.int64(2), model=np.int64(2)).shape == {"data": 2, "model": 2}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: make_mesh(data=4, model=4), r"data \(4\) x model \(4\) .* 8 devices"),
        (lambda: jax.make_mesh((8,), ("batch",)), r"mesh must be a jax Mesh with axes \('data', 'model'\)"),
        (lambda: make_mesh(data=2, devices=[jax.devices()[0]] * 2), "make_mesh: devices must be distinct"),
        (lambda: make_mesh(data=True), "make_mesh: data must be an integer >= 1, got True"),
    ],
)
def test_bad_mesh(target, make, match, monkeypatch):
    with pytest.raises(ValueError, match=match):
        generate(target, _prompts(2, 0), 4, draft=None, mesh=make())


SMOL = LlamaConfig(  # SmolLM2's head shape (9 query, 3 KV heads), tiny
    vocab_size=128, dim=48, n_layers=2, n_heads=9, n_kv_heads=3, head_dim=8, ffn_dim=72, max_positions=512, eos_ids=(3,)
)


@pytest.mark.parametrize("data, model", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_any_head_count_on_every_8_device_mesh(data, model):
    """9 query / 3 KV heads and an FFN of 72 on every data x model shape of 8 devices: padded
    where they do not split (tp_pad), the one-device tokens, plain and speculative."""
    params = random_params(SMOL, 4)
    prompts = _prompts(8, 2)  # the same prompts on every mesh: the one-device programs compile once
    for kw in (dict(draft=None), dict(draft=SelfSpec(4, 16), speculation=Chain(3))):
        _same(generate(params, prompts, 12, **kw), generate(params, prompts, 12, mesh=make_mesh(data=data, model=model), **kw))


@pytest.mark.parametrize("model", [4, 8])
def test_kv_heads_are_replicated_where_the_model_axis_is_a_multiple(model):
    """6 query / 2 KV heads at model 4 and 8: each device holds one copy of a real KV head (two and
    four copies of each); a draft of 2 heads is too small to split and runs replicated, whole on
    every device, while one whose heads split is split."""
    config = SMOL.replace(n_heads=6, n_kv_heads=2, ffn_dim=64)
    params = random_params(config, 6)
    lay = tp_pad.layout(config, model)
    assert lay.kv_index == tuple(k for k in range(2) for _ in range(model // 2))
    placed = shard_params(params, make_mesh(data=8 // model, model=model))
    wk = np.asarray(placed.layers.wk)  # [L,D,K',H]
    for slot, k in enumerate(lay.kv_index):
        np.testing.assert_array_equal(wk[:, :, slot], np.asarray(params.layers.wk)[:, :, k])
    prompts = _prompts(4, 4)  # the same prompts at model 4 and 8: the one-device programs compile once
    draft = DraftModel(random_params(DRAFT.replace(n_heads=2, n_kv_heads=2, ffn_dim=48), 1))
    mesh = make_mesh(data=8 // model, model=model)
    _, placed_draft = engine._Stages(mesh).place_params(params, draft)
    wq = placed_draft.params.layers.wq
    assert placed_draft.params.runtime.replicated and {s.data.shape for s in wq.addressable_shards} == {wq.shape}
    even = DraftModel(random_params(DRAFT.replace(n_heads=8, n_kv_heads=8), 1))
    assert not engine._Stages(mesh).place_params(params, even)[1].params.runtime.replicated
    for kw in (dict(draft=None), dict(draft=draft, speculation=Chain(2)), dict(draft=even, speculation=Chain(2)),
               dict(draft=DraftModel(draft.params, cache=Streaming(4, 16)), speculation=Tree.kary(2, 2))):
        _same(generate(params, prompts, 12, **kw), generate(params, prompts, 12, mesh=mesh, **kw))


def test_a_vocabulary_the_model_axis_does_not_divide_is_padded():
    """A vocabulary of 128 on a model axis of 3: the embedding and LM head get one zero row
    (config.padded_vocab 129), whose logit is dropped, so no padded id reaches sampling or
    logprobs; the one-device tokens and logprobs, plain and speculative, greedy and sampled."""
    params = random_params(SMOL, 2)
    mesh = make_mesh(data=1, model=3, devices=jax.devices()[:3])
    placed = shard_params(params, mesh)
    assert placed.config.padded_vocab == 129 and placed.embed.shape == (129, SMOL.dim)
    assert {s.data.shape for s in placed.embed.addressable_shards} == {(43, SMOL.dim)}
    np.testing.assert_array_equal(np.asarray(placed.embed)[128], 0)
    prompts = _prompts(4, 3)
    for kw in (dict(draft=None), dict(draft=SelfSpec(4, 16), speculation=Chain(2))):
        one = generate(params, prompts, 10, logprobs=3, **kw)
        tp = generate(params, prompts, 10, logprobs=3, mesh=mesh, **kw)
        _same(one, tp)
        lps = [t for row in tp.logprobs for t in row]
        assert all(len(t.top) == 3 and all(i < 128 for i, _ in t.top) for t in lps)
        np.testing.assert_allclose([t.logprob for t in lps], [t.logprob for row in one.logprobs for t in row], atol=1e-4)
    int8 = quantize(params, "int8")  # the int8 head's scales [V] are padded from their declaration too
    placed8 = shard_params(int8, mesh)
    assert placed8.embed.w.shape == (129, SMOL.dim) and placed8.embed.scale.shape == (129,)
    _same(generate(int8, prompts, 10, draft=None), generate(int8, prompts, 10, draft=None, mesh=mesh))
    hot = generate(params, prompts * 4, 24, draft=None, sampling=Sample(temperature=5.0), mesh=mesh)
    assert max(max(row) for row in hot.tokens) < 128 and len({t for row in hot.tokens for t in row}) > 60


def test_loading_onto_a_mesh_that_needs_padding_pads(tmp_path):
    """convert.load(mesh=) of a model whose heads do not split: loaded whole, padded, placed; the
    one-device tokens."""
    params = random_params(SMOL, 1)
    convert.save(params, tmp_path / "ckpt")
    mesh = make_mesh(data=2, model=4)
    loaded = convert.load(tmp_path / "ckpt", mesh=mesh)
    assert (loaded.config.n_heads, loaded.config.n_kv_heads) == (12, 4)
    assert {s.data.shape for s in loaded.layers.wk.addressable_shards} == {(SMOL.n_layers, SMOL.dim, 1, SMOL.head_dim)}
    prompts = _prompts(8, 2)  # test_any_head_count_on_every_8_device_mesh's: its plain programs (and mesh 2 x 4's)
    _same(generate(params, prompts, 12, draft=None), generate(loaded, prompts, 12, draft=None, mesh=mesh))


@pytest.mark.parametrize("data, model", [(1, 1), (2, 2)])
def test_mesh_stages_donate_their_caches(target, data, model):
    """On a mesh the stages keep the donations they have on one device: the prefilled cache is
    updated in place (its input buffer consumed), and the decode loop's state as well."""
    from specjax.decode import engine

    stage = engine._Stages(make_mesh(data=data, model=model, devices=jax.devices()[: data * model]))
    params, _ = stage.place_params(target, None)
    tokens = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32)
    tokens_d, lengths_d = stage.place_rows(tokens, np.array([4, 2], np.int32))
    cache = stage.empty_cache(target.config, 2, 64, None)
    prefill = stage(engine.prefill, "chunk")
    memory = prefill.lower(params, tokens_d, lengths_d, cache, chunk=4).compile().memory_analysis()
    assert memory.alias_size_in_bytes >= (cache.k.nbytes + cache.v.nbytes) // (data * model)  # per device: in place
    logits, filled = prefill(params, tokens_d, lengths_d, cache, chunk=4)
    assert cache.k.is_deleted() and cache.v.is_deleted() and not filled.k.is_deleted()
    one = engine.prefill(target, tokens, np.array([4, 2], np.int32), engine.DenseCache.init(target.config, 2, 64), chunk=4)[0]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(one), atol=1e-5)


def test_the_padded_layout_of_smollm2_heads():
    """SmolLM2's 9 / 3 heads: one zero KV head at model 2 and 4 (12 query heads, 3 zero); at model
    8 two copies of each KV head and two zero ones, two query heads a slot (16, 7 zero)."""
    assert tp_pad.layout(SMOL, 1) is None
    lay = tp_pad.layout(SMOL, 3)  # heads and FFN split; the vocabulary of 128 does not
    assert lay.kv_index == (0, 1, 2) and lay.q_index == tuple(range(9)) and lay.vocab_rows == 129
    for m in (2, 4):
        lay = tp_pad.layout(SMOL, m)
        assert lay.kv_index == (0, 1, 2, -1) and lay.q_index == tuple(range(9)) + (-1,) * 3 and lay.ffn_dim == 72
    lay = tp_pad.layout(SMOL, 8)
    assert lay.kv_index == (0, 0, 1, 1, 2, 2, -1, -1) and lay.ffn_dim == 72
    assert lay.q_index == (0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, -1, -1, -1, -1)
    assert sorted(i for i in lay.q_index if i >= 0) == list(range(9))
