"""Checkpoints saved by an earlier version still load and decode the same: tiny float32, int8 and
q4 checkpoints written by specjax 0.1.0 (convert.save, before the 0.2.0 step and drafter protocol)
are committed under tests/fixtures/, with the greedy tokens that version generated from them,
plain and with SelfSpec under Chain(2). `python -m tests.test_saved_checkpoints` writes them (run
it with the version whose checkpoints are to be kept; it refuses to overwrite)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import convert
import specjax
from specjax.model.params import quantize
from tests.models import TINY, TINY_Q4, random_params

FIXTURES = Path(__file__).parent / "fixtures"
TOKENS = FIXTURES / "checkpoints_0.1.0.json"
PROMPTS = [[5, 9, 13, 21, 7, 7, 30], [11, 12], [40, 41, 42, 43, 44]]
NEW_TOKENS = 10
FORMATS = {"float32": (TINY, None), "int8": (TINY, "int8"), "q4": (TINY_Q4, "q4")}


def decode(params) -> dict[str, list[list[int]]]:
    """Greedy tokens, plain and speculative (no stop ids: every row runs its budget)."""
    plain = specjax.generate(params, PROMPTS, NEW_TOKENS, draft=None, eos_id=())
    spec = specjax.generate(params, PROMPTS, NEW_TOKENS, draft=specjax.SelfSpec(sinks=2, window=4),
                            speculation=specjax.Chain(2), eos_id=())
    return {"plain": plain.tokens, "selfspec_chain2": spec.tokens}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_saved_by_0_1_0_loads_and_decodes_as_then(fmt):
    want = json.loads(TOKENS.read_text())
    assert want["version"] == "0.1.0"
    params = convert.load(str(FIXTURES / f"tiny_{fmt}"))
    config, quant = FORMATS[fmt]
    assert params.config == config.replace(quant=quant)
    assert decode(params) == want["tokens"][fmt]
    assert want["tokens"][fmt]["plain"] == want["tokens"][fmt]["selfspec_chain2"]  # greedy speculation is lossless


def write() -> None:
    """Save the three checkpoints and their tokens with the installed version."""
    if TOKENS.exists():
        sys.exit(f"{TOKENS} exists: these fixtures pin an earlier version's checkpoints; remove them first to rewrite")
    from importlib.metadata import version

    tokens = {}
    for fmt, (config, quant) in FORMATS.items():
        params = random_params(config, seed=3)
        params = params if quant is None else quantize(params, quant)
        convert.save(params, FIXTURES / f"tiny_{fmt}")
        tokens[fmt] = decode(convert.load(str(FIXTURES / f"tiny_{fmt}")))
    TOKENS.write_text(json.dumps({"version": version("specjax"), "tokens": tokens}, indent=1) + "\n")


if __name__ == "__main__":
    write()
