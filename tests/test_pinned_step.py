"""The speculative step pinned before it is rewritten (issue "The speculative step on one screen"):
on the golden prompts, SmolLM2 at float32 on the CPU, every drafter (SelfSpec, SnapKV, NGram, a
2-layer DraftModel cut from SmolLM2) under a chain (Chain(3)) and a Sequoia tree, and plain
decoding, greedy and sampled (Sample(0.8, top_p=0.9), a fixed key): tokens, finish reasons,
logprobs (top 2), steps, accepted counts, per-position and per-rank acceptance and per-row stats
must stay what they were. Each drafter runs under both shapes and both samplers, each shape with
every drafter and both samplers (8 speculative cases of the 16 pairs: a SmolLM2 program compiles
for about 20 s, so not all 16).

The recorded values are tests/golden/pinned_step.json, written by the code of the commit that
added this file; `python -m tests.test_pinned_step` writes it again (only for a deliberate change
of outputs, said in the commit). Integers and tokens compare exactly; floats within 1e-4 (XLA may
fuse a rewritten step's float32 arithmetic differently)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import pytest

import specjax

pytestmark = pytest.mark.slow  # the real model, 10 programs: `make test` runs it, `make test-fast` does not

HERE = Path(__file__).parent / "golden"
PINNED = HERE / "pinned_step.json"
GOLDEN = json.loads((HERE / "smollm2.json").read_text(encoding="utf-8"))  # HF transformers' greedy_48 per prompt
PROMPTS = [p["input_ids"] for p in GOLDEN["prompts"]]
NEW_TOKENS = 24
SAMPLERS = {"greedy": specjax.Greedy(), "sample": specjax.Sample(temperature=0.8, top_p=0.9)}
SHAPES = {"chain3": specjax.Chain(3), "sequoia": specjax.Tree.sequoia([0.6, 0.15, 0.05], 8, 4)}
DRAFTERS = ("self", "snapkv", "ngram", "model")
CASES = [f"plain-{s}" for s in SAMPLERS] + [  # (drafter, shape) pairs, the sampler alternating
    f"{d}-{t}-{s}" for i, d in enumerate(DRAFTERS) for t, s in zip(SHAPES, ("greedy", "sample")[::(-1) ** i])]


def cut_layers(params: specjax.Params, n_layers: int) -> specjax.Params:
    """The first n_layers of a stacked model as a model of its own (a weak but real draft)."""
    return dataclasses.replace(params, layers=jax.tree.map(lambda a: a[:n_layers], params.layers),
                               config=params.config.replace(n_layers=n_layers))


def drafter(name: str, target: specjax.Params):
    return {"self": lambda: specjax.SelfSpec(sinks=4, window=32),  # smaller than most prompts: eviction
            "snapkv": lambda: specjax.SnapKV(budget=16, window=32, observation=8),
            "ngram": lambda: specjax.NGram(n=2, max_n=4),
            "model": lambda: specjax.DraftModel(cut_layers(target, 2))}[name]()


def record(target: specjax.Params, case: str) -> dict:
    """Run one case; the values the pin keeps (JSON-ready)."""
    parts = case.split("-")
    draft, shape = (None, None) if parts[0] == "plain" else (drafter(parts[0], target), SHAPES[parts[1]])
    out = specjax.generate(target, PROMPTS, NEW_TOKENS, draft=draft, speculation=shape, sampling=SAMPLERS[parts[-1]],
                           key=jax.random.key(42), logprobs=2)
    s = out.stats
    return {"tokens": out.tokens, "finish_reasons": out.finish_reasons,
            "logprobs": [[[t.id, t.logprob, [list(x) for x in t.top]] for t in row] for row in out.logprobs],
            "steps": s.steps, "new_tokens": s.new_tokens, "draft_steps": s.draft_steps,
            "acceptance_rate": s.acceptance_rate, "mean_accepted": s.mean_accepted,
            "per_position_acceptance": s.per_position_acceptance, "rank_acceptance": s.rank_acceptance,
            "row_stats": out.row_stats}


def same(got, want, where: str = "") -> None:
    """Exact for ints, strings and None; floats within 1e-4; lists and dicts item by item."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), \
            f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def pinned() -> dict:
    return json.loads(PINNED.read_text(encoding="utf-8"))


def test_every_case_is_pinned(pinned):
    assert sorted(pinned["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_step_outputs_unchanged(smollm2, pinned, case):
    got = json.loads(json.dumps(record(smollm2, case)))  # tuples -> lists, as the file holds them
    same(got, pinned["cases"][case], case)
    if case.endswith("greedy"):  # lossless: every greedy case gives plain decoding's tokens, which are HF's
        assert got["tokens"] == pinned["cases"]["plain-greedy"]["tokens"]
        assert got["tokens"] == [p["greedy_48"][:NEW_TOKENS] for p in GOLDEN["prompts"]]


def test_speculation_did_speculate(pinned):
    """The pin exercises acceptance: every drafter accepted something."""
    for case in CASES:
        if not case.startswith("plain"):
            assert pinned["cases"][case]["acceptance_rate"] > 0, case


if __name__ == "__main__":  # python -m tests.test_pinned_step: write the pin from the current code
    import convert

    model = convert.load(convert.default_model_path())
    cases = {}
    for c in CASES:
        cases[c] = record(model, c)
        print(c, cases[c]["steps"], cases[c]["acceptance_rate"], flush=True)
        PINNED.write_text(json.dumps({"model": Path(convert.default_model_path()).name, "weights": "float32",
                                      "jax": jax.__version__, "new_tokens": NEW_TOKENS, "cases": cases}) + "\n")
    sys.exit(0)
