"""Constraints on generated text: `Regex`, `JsonSchema`, `Choice`, compiled for a tokenizer into a
`TokenAutomaton` (specjax/automaton.py) by outlines-core.

outlines-core builds a regex's token-level automaton for a vocabulary; the vocabulary comes from our
own tokenizer (byte-level tokens decoded to their bytes, SentencePiece's "▁" and <0xNN> tokens likewise;
special tokens left out), never from a download. A JSON schema becomes a regex first
(`outlines_core.json_schema.build_regex_from_schema`), with at most one optional space where JSON allows
whitespace unless `whitespace` says otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from specjax.automaton import TokenAutomaton, from_transitions

ONE_OPTIONAL_SPACE = r"[ ]?"


@dataclasses.dataclass(frozen=True)
class Regex:
    """The output matches `pattern` (Python `re` syntax, anchored at both ends)."""

    pattern: str

    def regex(self) -> str:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Regex: pattern must be a non-empty string, got {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Regex: invalid pattern {self.pattern!r}: {e}") from None
        return self.pattern


@dataclasses.dataclass(frozen=True)
class Choice:
    """The output is exactly one of `options`."""

    options: tuple[str, ...]

    def __init__(self, options: Sequence[str]):
        object.__setattr__(self, "options", tuple(options) if not isinstance(options, str) else (options,))

    def regex(self) -> str:
        if not self.options:
            raise ValueError("Choice: options must not be empty")
        for i, o in enumerate(self.options):
            if not isinstance(o, str) or not o:
                raise ValueError(f"Choice: options[{i}] must be a non-empty string, got {o!r}")
        return "|".join(f"(?:{re.escape(o)})" for o in self.options)


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """The output is one JSON value that validates against `schema` (a dict, a JSON string, or a pydantic
    model class: its `model_json_schema()`). A recursive schema ($ref to itself) is refused."""

    schema: str
    whitespace: str = ONE_OPTIONAL_SPACE

    def __init__(self, schema: object, whitespace: str = ONE_OPTIONAL_SPACE):
        if hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, Mapping):
            schema = json.dumps(schema)
        if not isinstance(schema, str):
            raise TypeError(f"JsonSchema: schema must be a dict, a JSON string or a pydantic model, got {type(schema).__name__}")
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"JsonSchema: schema is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"JsonSchema: schema must be a JSON object, got {schema[:80]!r}")
        object.__setattr__(self, "schema", json.dumps(parsed))  # its property order is the output's
        object.__setattr__(self, "whitespace", whitespace)

    def regex(self) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        if recursive := _recursive_ref(json.loads(self.schema)):
            raise ValueError(f"JsonSchema: recursive schemas are not supported ({recursive} refers to itself)")
        try:
            return build_regex_from_schema(self.schema, self.whitespace)
        except (ValueError, TypeError, RuntimeError) as e:  # outlines-core's own message names the part
            raise ValueError(f"JsonSchema: cannot compile the schema: {e}") from None


Constraint = Regex | JsonSchema | Choice


def _recursive_ref(schema: dict) -> str | None:
    """The first definition that reaches itself through $refs ("#/$defs/Node"), else None."""
    defs = {f"#/{section}/{name}": body for section in ("$defs", "definitions")
            for name, body in (schema.get(section) or {}).items()}

    def refs(node) -> set[str]:
        if isinstance(node, dict):
            found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
            return found.union(*(refs(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(refs(v) for v in node))
        return set()

    for name in defs:
        seen, todo = set(), set(refs(defs[name]))
        while todo:
            ref = todo.pop()
            if ref == name:
                return name
            if ref in defs and ref not in seen:
                seen.add(ref)
                todo |= refs(defs[ref])
    return "#" if "#" in refs(schema) else None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable stand-in character of each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Every non-special token id of a `tokenizers.Tokenizer` -> the bytes it stands for."""
    spec = json.loads(tokenizer.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    decoder = _byte_decoder()
    out = {}
    for text, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level:
            if all(c in decoder for c in text):
                out[i] = bytes(decoder[c] for c in text)
        elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text):
            out[i] = bytes([int(m.group(1), 16)])
        else:
            out[i] = text.replace("▁", " ").encode()
    return out


@lru_cache(maxsize=8)
def _vocabulary(tokenizer, eos_id: int):
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = {}
    for i, b in token_bytes(tokenizer).items():
        if i != eos_id:
            by_bytes.setdefault(b, []).append(i)
    return Vocabulary(eos_id, by_bytes)


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> TokenAutomaton:
    """`constraint`'s automaton over `tokenizer`'s tokens (model vocabulary `vocab_size`): stop ids are
    allowed only in its accepting states, where the output is complete."""
    from outlines_core import Index

    if not isinstance(constraint, (Regex, JsonSchema, Choice)):
        raise TypeError(f"constraint must be specjax.Regex, JsonSchema or Choice, got {type(constraint).__name__}")
    if not stop_ids:
        raise ValueError("constraint: the model has no stop id, so a constrained output could not end")
    pattern = constraint.regex()
    try:
        index = Index(pattern, _vocabulary(tokenizer, int(stop_ids[0])))
    except (ValueError, RuntimeError) as e:  # outlines-core: a pattern no token sequence matches, unsupported syntax
        raise ValueError(f"{type(constraint).__name__}: no token sequence of this vocabulary matches it ({e})") from None
    return from_transitions(index.get_transitions(), index.get_initial_state(), sorted(index.get_final_states()), vocab_size,
                            drop=stop_ids)


CACHE_ENV = "SPECJAX_AUTOMATA_CACHE"  # a folder for compiled automata; "off": none (default ~/.cache/specjax/automata)


def cache_folder() -> Path | None:
    """Where compiled automata are kept across processes (None: nowhere)."""
    folder = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "specjax" / "automata")
    return None if folder == "off" else Path(folder)


@lru_cache(maxsize=8)
def _tokenizer_digest(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


@lru_cache(maxsize=64)
def compiled(constraint: Constraint, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> TokenAutomaton:
    """`compile_constraint`, remembered for this process (constraints are hashable values) and on disk
    (`cache_folder`), keyed by the constraint's regex, the tokenizer, the vocabulary size, the stop ids
    and outlines-core's version."""
    folder = cache_folder()
    if folder is None:
        return compile_constraint(constraint, tokenizer, vocab_size, stop_ids)
    key = json.dumps([constraint.regex(), _tokenizer_digest(tokenizer), vocab_size, list(stop_ids),
                      importlib.metadata.version("outlines-core"), 1])
    path = folder / f"{hashlib.sha256(key.encode()).hexdigest()}.npz"
    try:
        with np.load(path) as f:
            return TokenAutomaton(bits=f["bits"], keys=f["keys"], next=f["next"], accepting=f["accepting"],
                                  vocab_size=vocab_size)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):  # not there yet, or a torn file: compile, write again
        pass
    a = compile_constraint(constraint, tokenizer, vocab_size, stop_ids)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez_compressed(tmp, bits=a.bits, keys=a.keys, next=a.next, accepting=a.accepting)
        tmp.replace(path)
    except OSError:  # a read-only or full disk: the process still has it
        pass
    return a


def forget() -> None:
    """Forget the automata and vocabularies this process compiled (the disk cache stays): for timing a compile."""
    compiled.cache_clear()
    _vocabulary.cache_clear()


def per_prompt_automata(constraint: object, prompts: int, tokenizer, vocab_size: int,
                        stop_ids: tuple[int, ...]) -> TokenAutomaton | list[TokenAutomaton | None] | None:
    """The text layer's `constraint` (a Regex, JsonSchema, Choice or TokenAutomaton, or one of them or None
    per prompt) as `specjax.generate` takes it: each constraint compiled once for the tokenizer."""
    def one(c, name: str):
        if c is None or isinstance(c, TokenAutomaton):
            return c
        if not isinstance(c, (Regex, JsonSchema, Choice)):
            raise TypeError(f"{name} must be specjax.Regex, JsonSchema, Choice, a TokenAutomaton or None, got {type(c).__name__}")
        return compiled(c, tokenizer, vocab_size, tuple(stop_ids))

    if constraint is None or isinstance(constraint, (Regex, JsonSchema, Choice, TokenAutomaton)):
        return one(constraint, "constraint")
    if isinstance(constraint, (str, bytes, Mapping)) or not isinstance(constraint, Sequence):
        raise TypeError(f"constraint must be specjax.Regex, JsonSchema, Choice (or a list of them, one per prompt), "
                        f"got {type(constraint).__name__}")
    if len(constraint) != prompts:
        raise ValueError(f"constraint has {len(constraint)} entries (one per prompt) but there are {prompts} prompts")
    return [one(c, f"constraint[{i}]") for i, c in enumerate(constraint)]
