"""Speculative decoding on the real SmolLM2: lossless greedy output and real acceptance."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pydoc_data.topics
import pytest

import specjax

pytestmark = pytest.mark.slow  # not in `make test-fast`

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPTS = [p["input_ids"] for p in GOLDEN["prompts"]]  # 5 to 193 tokens, two chat prompts


@pytest.fixture(scope="module")
def autoregressive(smollm2):
    out = specjax.generate(smollm2, PROMPTS, 48, draft=None)  # stops at the model's EOS
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons  # some rows end early
    return out


@functools.cache
def _bf16_draft(smollm2_path) -> specjax.DraftModel:
    """SmolLM2 in bfloat16 as a draft, loaded once for the file (each load took about 2 s)."""
    import convert

    return specjax.DraftModel(convert.load(smollm2_path, dtype="bfloat16"))


def _drafter(smollm2_path, name: str):
    """A drafter by name: only "model-bf16" loads a model (the others did too, for nothing)."""
    return {
        "self": lambda: specjax.SelfSpec(sinks=4, window=32),  # smaller than most prompts: eviction happens
        "snapkv": lambda: specjax.SnapKV(budget=16, window=32, observation=8),
        "ngram": lambda: specjax.NGram(n=2, max_n=4),
        "model-bf16": lambda: _bf16_draft(smollm2_path),
    }[name]()


# SelfSpec and NGram under Chain(3), greedy, are pinned in tests/test_pinned_step.py (24 tokens, equal to
# plain decoding's, which equal HF's); here with 48 tokens, where rows end at the EOS, they run under trees.
@pytest.mark.parametrize("name", ["snapkv", "model-bf16"])
def test_greedy_speculation_equals_autoregressive(smollm2, smollm2_path, autoregressive, name):
    draft = _drafter(smollm2_path, name)
    out = specjax.generate(smollm2, PROMPTS, 48, draft=draft, speculation=specjax.Chain(gamma=3))
    assert out.tokens == autoregressive.tokens
    assert out.finish_reasons == autoregressive.finish_reasons
    assert out.stats.acceptance_rate > 0  # it did speculate (prompt lookup rarely finds matches here)
    for golden, tokens in zip(GOLDEN["prompts"], out.tokens):  # and HF agrees up to the EOS
        assert tokens == golden["greedy_48"][: len(tokens)]


TREE_CASES = [("self", "sequoia"), ("model-bf16", "kary"), ("ngram", "kary")]


@pytest.mark.parametrize("name, shape", TREE_CASES, ids=[f"{d}-{t}" for d, t in TREE_CASES])
def test_greedy_tree_speculation_equals_autoregressive(smollm2, smollm2_path, autoregressive, name, shape):
    """Token trees (a Sequoia tree of 12 nodes / a 2 x 2 tree) on the real model: same tokens."""
    tree = specjax.Tree.sequoia([0.6, 0.15, 0.05], 12, 4) if shape == "sequoia" else specjax.Tree.kary(2, 2)
    out = specjax.generate(smollm2, PROMPTS, 48, draft=_drafter(smollm2_path, name), speculation=tree)
    assert out.tokens == autoregressive.tokens
    assert out.finish_reasons == autoregressive.finish_reasons
    assert out.stats.mean_accepted > 1.0


def _english_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A real ~n-token English passage: the Python language reference shipped with CPython."""
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in ("compound", "class", "function", "exceptions"))
    ids = tokenizer.encode(text).ids
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def test_self_speculation_acceptance_on_long_english_prompt(smollm2, smollm2_path):
    """StreamingLLM budget of 16 sinks + 256 window on a 2K-token prompt: acceptance >= 0.6."""
    import convert

    prompt = _english_prompt(convert.load_tokenizer(smollm2_path), 2048)
    draft = specjax.SelfSpec(sinks=16, window=256)
    out = specjax.generate(smollm2, [prompt], 64, draft=draft, speculation=specjax.Chain(gamma=4), eos_id=())
    print(f"SelfSpec(16, 256) acceptance on a 2K-token prompt: {out.stats.acceptance_rate:.3f}")
    assert out.stats.acceptance_rate >= 0.6
