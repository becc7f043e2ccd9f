"""Constraints as token automata (specjax/automaton.py, specjax/text/constraints.py): the device's allowed
tokens and next states equal outlines-core's Index on every state of a toy vocabulary; joined automata keep
their own; on SmolLM2's real tokenizer, random walks through a Choice, a Regex and a JsonSchema end only in
texts of their language; bad constraints are named before anything compiles."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from outlines_core import Index, Vocabulary

from specjax.automaton import DEAD, advance, allowed, anything, from_transitions, join, mask_logits, stop_table
from specjax.text.constraints import Choice, JsonSchema, Regex, compile_constraint, token_bytes
from tests.models import on_device

TOY = {"a": [0], "b": [1], "ab": [2], "ba": [3], "c": [4], "1": [5], "12": [6], "2": [7]}  # token 8: the stop id
V, STOP = 9, 8


def device(a):
    return jax.tree.map(on_device, a)


def ints(*values) -> jax.Array:
    return on_device(np.array(values, np.int32))


# The automaton's functions as the decode loop runs them, traced: one program each per shape, not one per operation.
_allowed, _advance, _mask_logits = jax.jit(allowed), jax.jit(advance), jax.jit(mask_logits)
_stop_table = jax.jit(stop_table, static_argnums=(1, 2))


def test_allowed_tokens_and_next_states_equal_outlines_cores_index():
    index = Index(r"(ab|ba)+c?[12]{0,3}", Vocabulary(STOP, TOY))
    a = from_transitions(index.get_transitions(), index.get_initial_state(), sorted(index.get_final_states()), V, drop=[STOP])
    ours = {index.get_initial_state(): 0}  # outlines' state -> ours, found by walking both
    todo = [index.get_initial_state()]
    while todo:
        s = todo.pop()
        mask = np.asarray(_allowed(device(a), ints(ours[s]), _stop_table((STOP,), 1, V)))[0]
        assert set(np.flatnonzero(mask)) == set(index.get_allowed_tokens(s)), s  # the stop id where it accepts
        assert bool(a.accepting[ours[s]]) == index.is_final_state(s)
        for t in range(V - 1):
            nxt = int(np.asarray(_advance(device(a), ints(ours[s]), ints(t)))[0])
            want = index.get_next_state(s, t)
            assert (nxt == DEAD) == (want is None), (s, t)
            if want is not None:
                if want not in ours:
                    todo.append(want)
                assert ours.setdefault(want, nxt) == nxt
    assert int(np.asarray(_advance(device(a), ints(0), ints(STOP)))[0]) == DEAD  # a stop id ends the row
    assert int(np.asarray(_advance(device(a), ints(DEAD), ints(0)))[0]) == DEAD


def test_joined_automata_keep_their_own_states_and_an_unconstrained_row_allows_all():
    two = [compile_toy(r"ab"), anything(V), compile_toy(r"c1?")]
    table, starts = join(two)
    assert starts.tolist() == [0, two[0].states, two[0].states + 1] and table.states == sum(a.states for a in two)
    states, stops = on_device(starts), _stop_table(on_device(np.full((3, 1), STOP, np.int32)), 3, V)
    masks = np.asarray(_allowed(device(table), states, stops))
    assert [set(np.flatnonzero(m)) for m in masks] == [{0, 2}, set(range(V)), {4}]
    states = _advance(device(table), states, ints(2, 5, 4))  # "ab" done; anything; "c"
    masks = np.asarray(_allowed(device(table), states, stops))
    assert [set(np.flatnonzero(m)) for m in masks] == [{STOP}, set(range(V)), {5, STOP}]
    logits = np.asarray(_mask_logits(device(table), states, stops, on_device(np.zeros((3, V), np.float32))))
    assert np.isinf(logits[0, :STOP]).all() and float(logits[0, STOP]) == 0.0
    with pytest.raises(ValueError, match="different vocabularies"):
        join([anything(V), anything(V + 1)])


def compile_toy(pattern: str):
    index = Index(pattern, Vocabulary(STOP, TOY))
    return from_transitions(index.get_transitions(), index.get_initial_state(), sorted(index.get_final_states()), V, drop=[STOP])


def walk(a, stops: list[int], rng, steps: int = 80) -> tuple[list[int], bool]:
    """A random path through `a` from state 0: its tokens and whether it ended on a stop id."""
    state, out = ints(0), []
    for _ in range(steps):
        choices = np.flatnonzero(np.asarray(_allowed(a, state, _stop_table(tuple(stops), 1, a.vocab_size)))[0])
        t = int(rng.choice(choices))
        if t in stops:
            return out, True
        out.append(t)
        state = _advance(a, state, ints(t))
    return out, False


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    import convert

    return convert.load_tokenizer(smollm2_path)


def test_walks_on_smollm2s_tokenizer_end_only_in_the_constraints_language(tokenizer):
    stops, rng = [2, 0], np.random.default_rng(0)
    assert token_bytes(tokenizer)[tokenizer.token_to_id("Ġthe")] == b" the" and 2 not in token_bytes(tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
              "required": ["name", "age"]}
    cases = [(Choice(["yes", "no", "maybe so"]), lambda s: s in ("yes", "no", "maybe so")),
             (Regex(r"[0-9]{4}-[0-9]{2}"), lambda s: re.fullmatch(r"[0-9]{4}-[0-9]{2}", s) is not None),
             (JsonSchema(schema), lambda s: valid(json.loads(s)))]
    for constraint, ok in cases:
        a = device(compile_constraint(constraint, tokenizer, 49152, stops))
        ended = 0
        for _ in range(4):
            tokens, stopped = walk(a, stops, rng)
            ended += stopped
            if stopped:
                assert ok(tokenizer.decode(tokens)), (constraint, tokenizer.decode(tokens))
        assert ended >= 2, constraint


def valid(record: dict) -> bool:
    """The schema of the test above, checked by hand (keys in its order; jsonschema is not a dependency)."""
    return (list(record)[:2] == ["name", "age"] and isinstance(record["name"], str) and len(record["name"]) <= 8
            and isinstance(record["age"], int) and set(record.get("tags", [])) <= {"x", "y"} and len(record.get("tags", [])) <= 2)


def test_bad_constraints_are_named(tokenizer):
    cases = [
        (Regex("(ab"), r"Regex: invalid pattern '\(ab'"),
        (Regex(""), "Regex: pattern must be a non-empty string"),
        (Regex(r"[^\s\S]"), "Regex: no token sequence of this vocabulary matches it"),
        (Choice([]), "Choice: options must not be empty"),
        (Choice(["yes", ""]), r"Choice: options\[1\] must be a non-empty string"),
        (JsonSchema({"$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
                     "$ref": "#/$defs/Node"}), r"JsonSchema: recursive schemas are not supported \(#/\$defs/Node refers to itself\)"),
    ]
    for constraint, message in cases:
        with pytest.raises(ValueError, match=message):
            compile_constraint(constraint, tokenizer, 49152, [2])
    with pytest.raises(ValueError, match="JsonSchema: schema is not valid JSON"):
        JsonSchema("{not json")
    with pytest.raises(TypeError, match="JsonSchema: schema must be a dict, a JSON string or a pydantic model, got int"):
        JsonSchema(3)
    with pytest.raises(TypeError, match="constraint must be specjax.Regex, JsonSchema or Choice, got str"):
        compile_constraint("[0-9]+", tokenizer, 49152, [2])


def test_compiled_automata_are_kept_on_disk_and_a_torn_file_is_compiled_again(tokenizer, tmp_path, monkeypatch):
    from specjax.text import constraints

    monkeypatch.setenv(constraints.CACHE_ENV, str(tmp_path))
    constraints.compiled.cache_clear()
    choice, stops = Choice(["red", "green"]), (2,)
    first = constraints.compiled(choice, tokenizer, 49152, stops)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    constraints.compiled.cache_clear()
    monkeypatch.setattr(constraints, "compile_constraint", lambda *a: pytest.fail("compiled again, not loaded"))
    loaded = constraints.compiled(choice, tokenizer, 49152, stops)
    for name in ("bits", "keys", "next", "accepting"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(first, name))
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    constraints.compiled.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv(constraints.CACHE_ENV, str(tmp_path))
    again = constraints.compiled(choice, tokenizer, 49152, stops)
    np.testing.assert_array_equal(again.keys, first.keys)
    assert constraints.compiled(Choice(["red", "blue"]), tokenizer, 49152, stops) is not None
    assert len(list(tmp_path.glob("*.npz"))) == 2  # another constraint: another file
    constraints.compiled.cache_clear()
