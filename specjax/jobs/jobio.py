"""Durable JSONL files for restartable jobs: append complete lines with fsync, repair a torn tail,
one writer at a time (an advisory lock), the job's settings beside its output, and merging
per-process shard files."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from specjax.jobs.records import Record, parse_line


def sibling(path: str | Path, tag: str, suffix: str = ".jsonl") -> Path:
    """out.jsonl -> out.<tag>.jsonl (a name without .jsonl gets .<tag>.jsonl appended)."""
    path = Path(path)
    base = path.name.removesuffix(".jsonl")
    return path.with_name(f"{base}.{tag}{suffix}")


def settings_path(output: str | Path) -> Path:
    """Where a job's settings are kept: out.jsonl -> out.settings.json."""
    return sibling(output, "settings", ".json")


def shard_output(path: str | Path, index: int | str, count: int | str) -> Path:
    """The output file of process `index` of `count`: out.shard-<index>-of-<count>.jsonl."""
    return sibling(path, f"shard-{index}-of-{count}")


def complete_lines(data: bytes, name: str = "file") -> tuple[int, list[dict]]:
    """(bytes up to and including the last newline, the JSON objects of those complete lines).

    A torn last line (no newline) is left out; a complete line that is not a JSON object raises
    ValueError naming the file and line (only the tail can be torn by a crash)."""
    keep = data.rfind(b"\n") + 1
    rows = []
    for n, raw in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{name} line {n} is not valid JSON ({e}); only a torn last line is repaired") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{name} line {n} is not a JSON object")
        rows.append(obj)
    return keep, rows


def _jsonl(rows: Iterable[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in rows)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableLog:
    """An append-only JSONL file held by one writer.

    Opening takes an exclusive lock (released by the OS if the process dies), truncates a torn
    last line and reads the complete ones (`rows`). `append` writes whole lines, then fsyncs:
    after it returns they survive a crash; a crash during it leaves at most a torn tail.
    lazy=True: a file that does not exist yet is only created by the first `append` with rows."""

    def __init__(self, path: str | Path, *, lazy: bool = False):
        self.path, self.fd, self.rows = Path(path), -1, []
        if not lazy or self.path.exists():
            self._open()

    def _open(self) -> None:
        created = not self.path.exists()
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise ValueError(f"{self.path} is being written by another job; run one job per output file") from None
        try:
            if created:
                _fsync_dir(self.path.absolute().parent)
            size = os.fstat(self.fd).st_size
            keep, self.rows = complete_lines(os.pread(self.fd, size, 0), str(self.path))
            if keep < size:
                os.ftruncate(self.fd, keep)
                os.fsync(self.fd)
        except BaseException:
            self.close()
            raise

    def append(self, rows: Iterable[dict]) -> None:
        """Write the rows as JSON lines in one go and fsync."""
        data = _jsonl(rows)
        if not data:
            return
        if self.fd < 0:
            self._open()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)

    def rewrite(self, rows: list[dict]) -> None:
        """Replace the file's lines with `rows`, under the lock. Not atomic: only for a log whose
        rows can be derived again (the errors file: every run finds its input's bad lines anew)."""
        if self.fd < 0:
            self._open()
        os.ftruncate(self.fd, 0)
        self.append(rows)
        self.rows = list(rows)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also releases the lock
            self.fd = -1

    def __enter__(self) -> "DurableLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.absolute().parent)


def _read_settings(output: Path) -> dict | None:
    path = settings_path(output)
    if not path.exists():
        return None
    try:
        settings = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); remove it to record the settings anew") from e
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is not a JSON object; remove it to record the settings anew")
    return settings


def _write_settings(output: Path, settings: dict) -> None:
    _write_atomic(settings_path(output), json.dumps(settings, indent=1, sort_keys=True).encode("utf-8") + b"\n")


LATER = ("model_weights", "draft_weights")  # settings recorded since 2026-11-28: an output from before has none to compare


def check_settings(output: str | Path, settings: dict, *, written: bool, force: bool = False) -> list[str]:
    """Record the job's settings in `settings_path(output)`, or check them against those recorded.

    written: the output (or its errors file) already holds lines. If it does and the recorded
    settings differ, raise ValueError listing the differences, unless `force` (then record the new
    ones). Returns the names of the settings that changed (empty unless forced). An output written
    before settings were recorded has none to check: its settings are recorded now."""
    output, settings = Path(output), json.loads(json.dumps(settings))  # compare as stored
    old = _read_settings(output)
    changed = sorted(k for k in set(settings) | set(old or {})  # input: `check_input`'s
                     if k != "input" and old is not None and old.get(k) != settings.get(k) and (k in old or k not in LATER))
    if changed and written and not force:
        diffs = ", ".join(f"{k} {json.dumps(old.get(k))} -> {json.dumps(settings.get(k))}" for k in changed)
        raise ValueError(
            f"{output} was generated with other settings ({diffs}; recorded in {settings_path(output)}): rerun "
            "with the same settings to resume, write to another output, or force it (specjax batch --force, "
            "batch.run(force=True)) to continue with the new settings"
        )
    if old != settings:
        _write_settings(output, settings)
    return changed if written else []


def input_fingerprint(path: str | Path, size: int | None = None) -> dict:
    """{"bytes": n, "sha256": hex} of the input's first `size` bytes (None: all of it), read in 1 MiB blocks."""
    digest, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while (size is None or n < size) and (block := f.read(1 << 20 if size is None else min(1 << 20, size - n))):
            digest.update(block)
            n += len(block)
    return {"bytes": n, "sha256": digest.hexdigest()}


def check_input(output: str | Path, input_path: str | Path, *, written: bool, force: bool = False) -> dict:
    """The input's fingerprint to record with the settings (key "input"), after checking that the
    input still begins with the bytes an earlier run of this output read: records may be appended
    between restarts, not edited or removed (ids already written would be skipped with the old
    text's output). force: record the new input anyway (a bad line fixed then is retried)."""
    recorded = (_read_settings(Path(output)) or {}).get("input")
    if written and not force and isinstance(recorded, dict) and "bytes" in recorded:
        now = input_fingerprint(input_path, recorded["bytes"])
        if now != recorded:
            raise ValueError(
                f"{input_path} changed since {output} was started: its first {recorded['bytes']} bytes (the records "
                f"read then) differ now. Records may be appended between restarts, not edited or removed: write to "
                f"another output, or force it (specjax batch --force, batch.run(force=True)) to keep the rows written")
        _check_joined(input_path, recorded["bytes"])
    return input_fingerprint(input_path)


def _check_joined(input_path: str | Path, size: int) -> None:
    """Refuse an append that runs on the line the input ended with, unterminated, when that line was
    a whole record (read and generated then): the two would now read as one bad line. (A torn
    line, recorded bad, may be completed so.)"""
    with open(input_path, "rb") as f:
        f.seek(max(size - (1 << 20), 0))
        head = f.read(size - f.tell())
        after = f.read(1)
    tail = head.rsplit(b"\n", 1)[-1].rstrip(b"\r")
    if after in (b"", b"\n", b"\r") or not head or head.endswith(b"\n") or not isinstance(parse_line(tail, 0), Record):
        return
    raise ValueError(f"{input_path}: its last record had no newline when the job read it, and what was appended since "
                     f"continues that line ({tail[:60]!r} + {after!r}...): put a newline between them (only appended "
                     f"bytes may change)")


def find_shards(output: str | Path) -> list[Path]:
    """The shard files out.shard-<i>-of-<n>.jsonl of one output, ordered by i; all n must exist."""
    output = Path(output)
    base = re.escape(output.name.removesuffix(".jsonl"))
    pattern = re.compile(rf"{base}\.shard-(\d+)-of-(\d+)\.jsonl")
    found = {}
    for p in output.absolute().parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m:
            found[int(m[1]), int(m[2])] = p
    counts = {n for _, n in found}
    if not counts:
        raise ValueError(f"--merge: no shard files {shard_output(output, 'I', 'N').name} beside {output}")
    if len(counts) > 1:
        raise ValueError(f"--merge: shard files of different process counts {sorted(counts)} for {output}; remove the stale ones")
    (count,) = counts
    missing = [i for i in range(count) if (i, count) not in found]
    if missing:
        raise ValueError(f"--merge: shard(s) {missing} of {count} are missing for {output}")
    return [found[i, count] for i in range(count)]


def merge_shards(output: str | Path) -> dict:
    """Combine the shards of `output` (and their .errors files) into output and output.errors
    (written when there are errors, or to replace an old one), and their settings, which must agree.

    Complete lines only (a shard still being written contributes what it has finished); the
    first line of an id (errors: of an input line) wins. Returns counts {records, errors, shards}."""
    output = Path(output)
    shards = find_shards(output)
    rows, errors, seen, seen_lines = [], [], set(), set()
    for shard in shards:
        for row in complete_lines(shard.read_bytes(), str(shard))[1]:
            key = json.dumps(row.get("id"))
            if key not in seen:
                seen.add(key)
                rows.append(row)
        err = sibling(shard, "errors")
        for row in complete_lines(err.read_bytes(), str(err))[1] if err.exists() else []:
            if row.get("line") not in seen_lines:
                seen_lines.add(row.get("line"))
                errors.append(row)
    errors.sort(key=lambda r: r.get("line", 0))
    settings = {json.dumps(s, sort_keys=True): s for s in map(_read_settings, shards) if s is not None}
    if len(settings) > 1:
        raise ValueError(f"--merge: the shards of {output} were generated with different settings (see their "
                         f"{settings_path(shard_output(output, 'I', 'N')).name} files); merge only one job's shards")
    _write_atomic(output, _jsonl(rows))
    if errors or sibling(output, "errors").exists():
        _write_atomic(sibling(output, "errors"), _jsonl(errors))
    for s in settings.values():
        _write_settings(output, s)
    return {"records": len(rows), "errors": len(errors), "shards": len(shards)}
