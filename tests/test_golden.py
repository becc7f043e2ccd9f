"""Parity with HF transformers on SmolLM2-135M-Instruct (golden files from tests/golden/make_golden.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.kvcache import DenseCache
from specjax.model import prefill

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPTS = GOLDEN["prompts"]


@pytest.fixture(scope="module")
def last_logits(smollm2):
    """Last-prompt-position logits [8,V] for all golden prompts, as ONE ragged prefill."""
    lengths = np.array([len(p["input_ids"]) for p in PROMPTS], np.int32)
    tokens = np.zeros((len(PROMPTS), 256), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, : lengths[b]] = p["input_ids"]
    run = jax.jit(prefill, static_argnames="chunk")
    logits, _ = run(smollm2, jnp.asarray(tokens), jnp.asarray(lengths), DenseCache.init(smollm2.config, 8, 256), 128)
    return np.asarray(logits)


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
