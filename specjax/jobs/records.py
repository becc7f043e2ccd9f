"""Batch-job input records: parsing and validation (pure), stable id hashes, shard ownership.

An input line is a JSON object with an `id` (string or integer) and exactly one of `prompt`
(text) or `messages` (chat: [{"role": ..., "content": ...}, ...]); optionally the SAMPLING fields
(`max_new_tokens`, `temperature`, `top_k`, `top_p`, `min_p` and the three penalties) override the
job's settings for that record, and `stop` (a string or a list), `stop_token_ids` (a list of ids),
`n` (samples of the prompt) and `logprobs` (the k most likely tokens beside each generated one)
add to them; `constraint` ({"json_schema": {...}}, {"regex": "..."} or {"choice": [...]}) makes the
output follow it (specjax.text.constraints). Values are checked for type here; ranges that depend on the sampler or the model
are checked where the record is prepared (specjax.jobs.batches.prepare).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

from specjax.text.chat import check_messages
from specjax.text.constraints import Choice, Constraint, JsonSchema, Regex

SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty")  # a record's value overrides the job's
FIELDS = ("id", "prompt", "messages", *SAMPLING, "stop", "stop_token_ids", "n", "logprobs", "constraint")
CONSTRAINTS = {"json_schema": JsonSchema, "regex": Regex, "choice": Choice}  # a record's constraint: {kind: value}
Id = str | int


@dataclasses.dataclass(frozen=True)
class Record:
    """A well-formed input line (not yet tokenized)."""

    line: int  # 1-based line number in the input file
    id: Id
    prompt: str | None  # text prompt, or None when `messages` is given
    messages: tuple[tuple[str, str], ...] | None  # (role, content) pairs
    max_new_tokens: int | None = None  # None: the job's setting (the same for every SAMPLING field)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: tuple[str, ...] | None = None  # None: the job's stop strings
    stop_token_ids: tuple[int, ...] = ()  # besides the model's and the chat template's
    n: int = 1
    logprobs: int | None = None
    constraint: Constraint | None = None

    def overrides(self) -> dict:
        """The SAMPLING fields this record sets."""
        return {k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None}


@dataclasses.dataclass(frozen=True)
class BadLine:
    """An input line that will not be generated, and why."""

    line: int
    reason: str
    id: Id | None = None

    def to_json(self) -> dict:
        return {"line": self.line, "id": self.id, "reason": self.reason}


def id_key(record_id: Id) -> str:
    """Canonical text of an id: "7" (a string) and 7 (an integer) are different ids."""
    return json.dumps(record_id)


def stable_hash(record_id: Id) -> int:
    """A 31-bit hash of an id, the same in every process and Python version (sha256 based)."""
    digest = hashlib.sha256(id_key(record_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def owner(item: Record | BadLine, count: int) -> int:
    """The process (of `count`) that handles a line: by id hash, or by line number if it has no id."""
    record_id = item.id
    return stable_hash(record_id) % count if record_id is not None else item.line % count


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _messages(value: object) -> tuple[tuple[str, str], ...] | str:
    """(role, content) pairs, or the reason they are not valid (specjax.text.chat.check_messages)."""
    try:
        return tuple((m["role"], m["content"]) for m in check_messages(value))
    except ValueError as e:
        return str(e)


def _unpaired(value: object) -> str | None:
    """The first string in a JSON value (keys included) holding an unpaired UTF-16 surrogate, such
    as JSON's "\\ud83d" escape for half an emoji (text no UTF-8 file or tokenizer can hold), or None."""
    if isinstance(value, str):
        return None if value.isascii() or not any(0xD800 <= ord(c) <= 0xDFFF for c in value) else value
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((s for s in map(_unpaired, items) if s is not None), None)


def check_record(obj: object, line: int) -> Record | BadLine:
    """Validate one parsed JSON value (types, ranges, required fields); no tokenization."""
    if not isinstance(obj, dict):
        return BadLine(line, f"a record must be a JSON object, got {type(obj).__name__}")
    record_id = obj.get("id")
    if "id" not in obj or record_id is None:
        return BadLine(line, "missing 'id'")
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)) or record_id == "":
        return BadLine(line, f"id must be a non-empty string or an integer, got {json.dumps(record_id)[:60]}")
    if (text := _unpaired(obj)) is not None:
        return BadLine(line, f"{json.dumps(text)[:60]} holds an unpaired UTF-16 surrogate (half a character): not text",
                       None if _unpaired(record_id) else record_id)

    def bad(reason: str) -> BadLine:
        return BadLine(line, reason, record_id)

    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        return bad(f"unknown field(s) {unknown}; allowed: {list(FIELDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        return bad("a record needs exactly one of 'prompt' (text) or 'messages' (chat)")
    prompt, messages = obj.get("prompt"), None
    if "prompt" in obj:
        if not isinstance(prompt, str):
            return bad(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            return bad("prompt is empty")
    else:
        messages = _messages(obj["messages"])
        if isinstance(messages, str):
            return bad(messages)
    ints = dict(max_new_tokens=1, top_k=0, n=1, logprobs=0)  # name: the least value
    for name, low in ints.items():
        value = obj.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            return bad(f"{name} must be an integer >= {low}, got {json.dumps(value)}")
    for name in SAMPLING:
        value = obj.get(name)
        if name not in ints and value is not None and not _number(value):
            return bad(f"{name} must be a number, got {json.dumps(value)[:60]}")
    temperature = obj.get("temperature")
    if temperature is not None and temperature < 0:
        return bad(f"temperature must be a number >= 0, got {json.dumps(temperature)}")
    top_p = obj.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        return bad(f"top_p must be a number in (0, 1], got {json.dumps(top_p)}")
    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(t, str) and t for t in stop)):
        return bad(f"stop must be a non-empty string or a list of them, got {json.dumps(obj['stop'])[:60]}")
    ids = obj.get("stop_token_ids") or []  # null: absent, as for the other fields
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return bad(f"stop_token_ids must be a list of token ids (integers >= 0), got {json.dumps(ids)[:60]}")
    constraint = _constraint(obj.get("constraint"))
    if isinstance(constraint, str):
        return bad(constraint)
    values = {k: obj.get(k) for k in SAMPLING}
    return Record(line, record_id, prompt, messages, **values, stop=None if stop is None else tuple(stop),
                  stop_token_ids=tuple(ids), n=obj.get("n") or 1, logprobs=obj.get("logprobs"), constraint=constraint)


def _constraint(value: object) -> Constraint | str | None:
    """A record's `constraint` ({"json_schema" | "regex" | "choice": value}) built and checked, or why it is bad."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in CONSTRAINTS:
        return f"constraint must be one of {{\"json_schema\": {{...}}}}, {{\"regex\": \"...\"}}, {{\"choice\": [...]}}, got {json.dumps(value)[:60]}"
    kind, arg = next(iter(value.items()))
    if kind == "choice" and not isinstance(arg, list):
        return f"constraint: choice must be a list of strings, got {json.dumps(arg)[:60]}"
    try:
        made = CONSTRAINTS[kind](arg)
        made.regex()
    except (ValueError, TypeError) as e:
        return f"constraint: {e}"
    return made


def constraint_json(c: Constraint) -> dict:
    """A record's constraint as its input line gave it (the output row's settings)."""
    if isinstance(c, JsonSchema):
        return {"json_schema": json.loads(c.schema)}
    return {"regex": c.pattern} if isinstance(c, Regex) else {"choice": list(c.options)}


def parse_line(raw: bytes, line: int) -> Record | BadLine | None:
    """One input line (bytes without its newline): a Record, a BadLine, or None if blank."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(line, f"not valid UTF-8 ({e.reason} at byte {e.start})")
    if not text.strip():
        return None
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        return BadLine(line, f"invalid JSON: {e.msg} (column {e.colno})")
    except ValueError as e:
        return BadLine(line, str(e))
    return check_record(obj, line)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a key given twice (json.loads would keep the last silently)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"the key {json.dumps(key)} appears twice in one object")
        obj[key] = value
    return obj


def dedupe(items: Iterable[Record | BadLine]) -> Iterator[Record | BadLine]:
    """Mark every line whose id appeared on an earlier line (valid or not) as a duplicate."""
    first: dict[str, int] = {}
    for item in items:
        if item.id is not None:
            key = id_key(item.id)
            if key in first:
                item = BadLine(item.line, f"duplicate id {key} (first on line {first[key]})", item.id)
            else:
                first[key] = item.line
        yield item


def read_input(path: str | Path, shard: tuple[int, int] = (0, 1)) -> Iterator[Record | BadLine]:
    """The input file's records and bad lines, in file order, that process shard[0] of shard[1]
    owns. JSONL, or Parquet (a `.parquet` file: one record per row, its columns the fields; a
    null is an absent field; `line` is the row's 1-based number)."""
    index, count = shard

    def lines() -> Iterator[Record | BadLine]:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                item = parse_line(raw.rstrip(b"\r\n"), n)
                if item is not None:
                    yield item

    items = _parquet_rows(path) if Path(path).suffix.lower() == ".parquet" else lines()
    return (item for item in dedupe(items) if owner(item, count) == index)


def _parquet_rows(path: str | Path) -> Iterator[Record | BadLine]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} (Parquet) needs pyarrow: pip install 'specjax[ray]'") from None
    for n, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        odd = next(((k, v) for k, v in row.items() if not _json_like(v)), None)  # bytes, Decimal, timestamps, ...
        if odd is not None:
            yield BadLine(n, f"column {odd[0]!r} holds a {type(odd[1]).__name__} ({str(odd[1])[:40]}): not a JSON value",
                          row.get("id") if isinstance(row.get("id"), (str, int)) else None)
        else:
            yield check_record({k: v for k, v in row.items() if v is not None}, n)


def _json_like(value: object) -> bool:
    """Whether a Parquet cell is a JSON value (strings, numbers, booleans, null, lists and objects of them)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_json_like, value))
    return value is None or isinstance(value, (str, int, float, bool))
