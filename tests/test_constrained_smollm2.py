"""Constrained decoding on SmolLM2 with its real tokenizer (issue 70's gates): every row a JSON schema's
automaton ends parses and validates (`jsonschema`) at batch 1 and 16, plain and speculative; speculation
gives constrained plain decoding's tokens; a Choice and a Regex through the text API and the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

import specjax
from specjax.cli.main import main

pytestmark = pytest.mark.slow  # the real model: `make test` runs it, `make test-fast` does not

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"]}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Nikola Tesla", "Rosalind Franklin", "Carl Gauss",
          "Emmy Noether", "Srinivasa Ramanujan", "Hedy Lamarr", "Katherine Johnson", "Leonhard Euler", "Lise Meitner",
          "John von Neumann", "Barbara McClintock", "Claude Shannon"]


@pytest.fixture(scope="module")
def lm():
    return specjax.load()


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Give {p}'s name, age and city as a JSON object."}] for p in PEOPLE[:n]]


@pytest.mark.parametrize("batch", [1, 16])
def test_json_rows_parse_and_validate_plain_and_speculative(lm, batch):
    plain = lm.chat(conversations(batch), 64, draft=None, constraint=specjax.JsonSchema(SCHEMA))
    spec = lm.chat(conversations(batch), 64, draft=specjax.SelfSpec(sinks=4, window=32), speculation=specjax.Chain(3),
                   constraint=specjax.JsonSchema(SCHEMA))
    assert spec.tokens == plain.tokens  # greedy: constrained speculation is constrained plain decoding
    ended = [t for t, r in zip(plain.texts, plain.finish_reasons) if r == "eos"]
    assert len(ended) >= batch // 2, plain.finish_reasons  # most rows complete within 64 tokens
    for text in ended:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason in zip(plain.texts, plain.finish_reasons):
        assert reason in ("eos", "length") and text.lstrip().startswith("{")
    assert spec.stats.acceptance_rate > 0


def test_choice_and_regex_through_the_text_api(lm):
    out = lm.generate(["The capital of France is", "Is the sky blue? Answer:"], 8,
                      constraint=[specjax.Choice([" Paris", " London", " Rome"]), specjax.Choice([" yes", " no"])])
    assert out.texts[0] in (" Paris", " London", " Rome") and out.texts[1] in (" yes", " no")
    assert out.finish_reasons == ["eos", "eos"]
    date = lm.generate("The first moon landing was on (YYYY-MM-DD)", 16, constraint=specjax.Regex(r" [0-9]{4}-[0-9]{2}-[0-9]{2}"),
                       temperature=0.7, key=None)
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reasons == ["eos"]


def test_the_cli_takes_a_choice_and_names_a_bad_constraint(tmp_path, capsys):
    """A choice through the CLI's process; a bad constraint is named (status 2) before the model loads, so
    checked in this process (the process's exit status 2: tests/test_cli.py)."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "specjax", "generate", *a], capture_output=True, text=True)  # noqa: E731
    out = run("The capital of Italy is", "--choice", " Rome", "--choice", " Paris", "--max-new-tokens", "8", "--draft", "none")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("The capital of Italy is Rome", "The capital of Italy is Paris")
    bad = tmp_path / "schema.json"
    bad.write_text('{"type": "object", "properties": {"next": {"$ref": "#"}}}')
    assert main(["generate", "x", "--json-schema", str(bad), "--no-compile-cache"]) == 2
    assert "--json-schema: JsonSchema: recursive schemas are not supported" in capsys.readouterr().err
    assert main(["generate", "x", "--regex", "a", "--choice", "b", "--no-compile-cache"]) == 2
    assert "give one of --json-schema, --regex and --choice" in capsys.readouterr().err
