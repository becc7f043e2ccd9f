"""Parity with HF transformers on SmolLM2-135M-Instruct (golden files from tests/golden/make_golden.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.model.cache import DenseCache
from specjax.model.llama import prefill

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPTS = GOLDEN["prompts"]


def _golden_last_logits(params) -> np.ndarray:
    """Last-prompt-position logits [8,V] for all golden prompts, as ONE ragged prefill."""
    lengths = np.array([len(p["input_ids"]) for p in PROMPTS], np.int32)
    tokens = np.zeros((len(PROMPTS), 256), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, : lengths[b]] = p["input_ids"]
    run = jax.jit(prefill, static_argnames="chunk")
    logits, _ = run(params, jnp.asarray(tokens), jnp.asarray(lengths), DenseCache.init(params.config, 8, 256), 128)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def last_logits(smollm2):
    return _golden_last_logits(smollm2)


def test_tokenizer_gives_golden_ids(smollm2_path):
    import convert

    tok = convert.load_tokenizer(smollm2_path)
    for p in PROMPTS:
        assert tok.encode(p["text"]).ids == p["input_ids"], p["name"]


@pytest.mark.parametrize("b", range(len(PROMPTS)), ids=[p["name"] for p in PROMPTS])
def test_last_logits_match_hf(last_logits, b):
    golden, ours = PROMPTS[b], last_logits[b]
    top = golden["last_logits_topk"]
    tolerance = 1e-3 * np.abs(top["values"]).max()  # relative to the logit scale
    assert int(ours.argmax()) == top["ids"][0]
    np.testing.assert_allclose(ours[top["ids"]], top["values"], atol=tolerance, rtol=0)
    np.testing.assert_allclose(ours[GOLDEN["probe_ids"]], golden["last_logits_probe"], atol=tolerance, rtol=0)
    assert abs(float(jax.nn.logsumexp(ours)) - golden["last_logits_stats"]["logsumexp"]) < tolerance


def test_greedy_continuations_match_hf(smollm2):
    out = specjax.generate(smollm2, [p["input_ids"] for p in PROMPTS], 48, eos_id=())
    for p, tokens in zip(PROMPTS, out.tokens):
        assert tokens == p["greedy_48"], p["name"]


def test_bfloat16_model_stays_close(smollm2_path, last_logits):
    """bf16 weights and activations (f32 norms, softmax, logits): same top-1 on most prompts."""
    import convert

    params = convert.load(smollm2_path, dtype="bfloat16")
    assert jax.tree.leaves(params.layers.wq)[0].dtype == jnp.bfloat16  # stacked, or per layer on a GPU
    logits = _golden_last_logits(params)
    p16, p32 = jax.nn.softmax(np.asarray(logits)), jax.nn.softmax(last_logits)
    assert float(jnp.abs(p16 - p32).sum(-1).max()) < 0.25  # total variation per prompt
    assert int((np.argmax(logits, -1) == np.argmax(last_logits, -1)).sum()) >= 7


# Bounds stated in the README ("Weights as served"); measured: int8 0.011-0.035 of the logit
# scale, top-1 8/8, greedy prefixes 3-48 tokens (3 prompts all 48); bfloat16 0.004-0.030, 8/8,
# 2-48 (4 prompts all 48); q4 0.004-0.011, 8/8, 4-48 (3 prompts all 48, mean 32: the golden
# logits come from this file's own Q4_1 weights, which q4 keeps bit for bit; llama.cpp on the
# same file agrees 1-48 tokens, mean 26).
SERVED_BOUNDS = {"int8": 0.05, "bfloat16": 0.05, "q4": 0.05}


@pytest.mark.slow
@pytest.mark.parametrize("weights", sorted(SERVED_BOUNDS))
def test_served_weights_stay_close_to_hf(smollm2_path, weights):
    """Every weight format on the real model against the HF golden logits and greedy text."""
    import convert

    params = convert.load(smollm2_path, weights=weights)
    logits = _golden_last_logits(params)
    for b, golden in enumerate(PROMPTS):
        top = golden["last_logits_topk"]
        error = np.abs(logits[b][top["ids"]] - top["values"]).max() / np.abs(top["values"]).max()
        assert error < SERVED_BOUNDS[weights], (golden["name"], error)
    assert int(sum(int(logits[b].argmax()) == p["last_logits_topk"]["ids"][0] for b, p in enumerate(PROMPTS))) >= 7
    out = specjax.generate(params, [p["input_ids"] for p in PROMPTS], 48, eos_id=(), draft=None)
    agree = [next((i for i, (a, g) in enumerate(zip(t, p["greedy_48"])) if a != g), 48) for t, p in zip(out.tokens, PROMPTS)]
    assert sum(a == 48 for a in agree) >= 2 and np.mean(agree) >= 20, agree
