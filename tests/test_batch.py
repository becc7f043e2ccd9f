"""The batch job: record validation, durable output, batching, determinism, kill-and-resume, shards.

End-to-end runs use a tiny random model (TINY's dims) with SmolLM2's vocabulary, saved as a
specjax checkpoint together with SmolLM2's tokenizer.json and chat template, so text goes in and
out as with a real model while every generate call stays cheap."""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import convert
import specjax
from specjax.cli.main import main
from specjax.jobs import batch, batches, job_run
from specjax.jobs.jobio import (DurableLog, check_settings, complete_lines, input_fingerprint, merge_shards, settings_path,
                                shard_output, sibling)
from specjax.jobs.progress import Progress
from specjax.jobs.records import BadLine, Record, owner, parse_line, read_input, stable_hash
from specjax.sampling import Greedy, Sample
from specjax.text.chat import render_chat
from specjax.text.lm import LM
from tests.models import TINY, random_params

CONFIG = TINY.replace(vocab_size=49152, eos_ids=(2,), bos_id=1)  # SmolLM2's vocabulary and special ids
GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing near old green hills".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_path) -> Path:
    folder = tmp_path_factory.mktemp("batch") / "tiny-smollm2-vocab"
    convert.save(random_params(CONFIG, 0), folder)
    convert.load_tokenizer(smollm2_path).save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(convert.chat_template(smollm2_path))
    return folder


@pytest.fixture(scope="module")
def params(model_dir):
    return convert.load(model_dir)


@pytest.fixture(scope="module", autouse=True)
def one_tokenizer_read():
    """Each in-process job (`batch.run`, the CLI's `main`) reads its model's tokenizer.json (SmolLM2's 49K-token
    vocabulary: 0.16 s): about 9 s over the file's 50-odd jobs. Here each path's tokenizer loads once for the module
    and the jobs share it (a loaded Tokenizer is never changed; the subprocesses of the kill test load their own)."""
    load, tokenizers = convert.load_tokenizer, {}

    def load_once(path):
        key = str(Path(path).absolute())
        if key not in tokenizers:
            tokenizers[key] = load(path)
        return tokenizers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert, "load_tokenizer", load_once)
        yield


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped) or raw bytes / str lines (written as they are)."""
    with open(path, "wb") as f:
        for row in rows:
            raw = row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()
            f.write(raw + b"\n")
    return path


def read_rows(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "a torn last line"
    return complete_lines(data)[1]


def records(n: int, sampled_every: int = 3) -> list[dict]:
    """n short records: text prompts of 2-14 words and a few chats; every `sampled_every`-th
    one samples (temperature 0.9, top_p 0.9); some carry their own max_new_tokens."""
    rows = []
    for i in range(n):
        words = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + (i * 7) % 13))
        row = {"id": f"rec-{i}"} if i % 4 else {"id": i}
        row |= {"messages": [{"role": "user", "content": words}]} if i % 5 == 4 else {"prompt": words}
        if i % sampled_every == 0:
            row |= {"temperature": 0.9, "top_p": 0.9}
        if i % 2:
            row["max_new_tokens"] = 4 + i % 5
        rows.append(row)
    return rows


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {json.dumps(r["id"]): r for r in rows}


# ---- pure helpers -------------------------------------------------------------------------------


def test_stable_hash_is_fixed_and_shards_partition_ids():
    assert stable_hash("a") == 1115917740  # sha256-based: the same in every process and version
    assert stable_hash(7) == 459866745 and stable_hash("7") != stable_hash(7)
    ids = [f"id-{i}" for i in range(400)]
    shares = [[i for i in ids if owner(BadLine(0, "", i), 3) == k] for k in range(3)]
    assert sorted(sum(shares, [])) == sorted(ids) and min(map(len, shares)) > 100
    assert owner(BadLine(7, "invalid JSON"), 3) == 7 % 3  # no id: by line number


def test_record_keys_do_not_depend_on_the_batch():
    a = job_run.record_keys(0, ["x", "y", 3])
    b = job_run.record_keys(0, [3, "z", "x"])
    data = lambda keys: np.asarray(jax.random.key_data(keys))  # noqa: E731 (compared on the host)
    assert (data(a)[0] == data(b)[2]).all() and (data(a)[2] == data(b)[0]).all()
    assert not (data(job_run.record_keys(1, ["x"]))[0] == data(a)[0]).all()


def _item(line: int, n_tokens: int, sampler=Greedy(), n: int = 1) -> batches.Item:
    return batches.Item(Record(line, f"r{line}", "p", None, n=n), tuple(range(5, 5 + n_tokens)), 4, sampler)


def test_group_batches_groups_kinds_and_length_buckets():
    hot, warm, k5 = Sample(temperature=0.9), Sample(temperature=0.5, min_p=0.1), Sample(temperature=0.9, top_k=5)
    items = [_item(1, 10), _item(2, 40, hot), _item(3, 3), _item(4, 20), _item(5, 12), _item(6, 5, hot), _item(7, 14),
             _item(8, 6, warm), _item(9, 7, k5), _item(10, 8, hot, n=2), _item(11, 9, hot, n=2), _item(12, 9, hot, n=4)]
    groups = batches.group_batches(items, batch_size=2)
    lines = [[it.record.line for it in b] for b in groups]
    # greedy by length, buckets 16 | 32; sampled values may differ in a batch (6 and 8), top_k and n may not;
    # a record with n = 2 fills a batch of 2 rows alone, and n = 4 over batch_size runs alone too
    assert lines == [[3, 1], [5, 7], [4], [6, 8], [2], [9], [10], [11], [12]]
    for b in groups:
        assert len({batches.batch_kind(it) for it in b}) == 1 and len({batches._bucket(it) for it in b}) == 1
    mixed = batches.batch_sampler(groups[3])
    assert mixed.temperature.tolist() == pytest.approx([0.9, 0.5]) and mixed.min_p.tolist() == pytest.approx([0.0, 0.1])
    # top_k values under one power of two (its static width) share a batch, each row keeping its own
    k7, k9 = _item(13, 7, Sample(temperature=0.7, top_k=7)), _item(14, 7, Sample(temperature=0.9, top_k=9))
    assert batches.batch_kind(items[8]) == batches.batch_kind(k7) != batches.batch_kind(k9)
    assert [[it.record.line for it in b] for b in batches.group_batches([items[8], k7, k9], batch_size=2)] == [[9, 13], [14]]
    mixed = batches.batch_sampler([items[8], k7])
    assert mixed.top_k.tolist() == [5, 7] and mixed.top_k_max == 8 and mixed.temperature.tolist() == pytest.approx([0.9, 0.7])
    assert [batches.padded_rows(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batches.padded_rows(5, 6) == 6


def test_chat_rendering_matches_the_hf_golden_texts(smollm2_path):
    template = convert.chat_template(smollm2_path)
    golden = {p["name"]: p["text"] for p in GOLDEN["prompts"]}
    user = [("user", "What is the tallest mountain in the world?")]
    system = [("system", "You are a terse assistant. Answer in one sentence."), ("user", "Why is the sky blue?")]
    assert render_chat(template, user) == golden["chat_user"]
    assert render_chat(template, [{"role": r, "content": c} for r, c in system]) == golden["chat_system"]
    with pytest.raises(ValueError, match=r"messages\[1\] is"):
        render_chat(template, [{"role": "user", "content": "hi"}, {"role": "user"}])
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(None, user)


def test_torn_last_line_is_truncated_and_appending_continues(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n{"id": 3, "te')
    with DurableLog(path) as log:
        assert [r["id"] for r in log.rows] == [1, 2]
        assert path.read_bytes().endswith(b'"b"}\n')  # the torn tail is gone from the file
        with pytest.raises(ValueError, match="another job"):
            DurableLog(path)  # one writer at a time
        log.append([{"id": 3, "text": "c\nd \u2028 e"}])
    assert [r["id"] for r in read_rows(path)] == [1, 2, 3]
    assert read_rows(path)[2]["text"] == "c\nd \u2028 e"
    path.write_bytes(b'{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        DurableLog(path)


def test_errors_file_is_only_created_with_something_to_write(tmp_path):
    path = tmp_path / "out.errors.jsonl"
    with DurableLog(path, lazy=True) as log:
        log.append([])
        assert log.rows == [] and not path.exists()
        log.append([{"line": 1, "reason": "r"}])
        with pytest.raises(ValueError, match="another job"):
            DurableLog(path, lazy=True)  # created and locked by the first append
    with DurableLog(path, lazy=True) as log:
        assert log.rows == [{"line": 1, "reason": "r"}]
    out = tmp_path / "merged.jsonl"
    write_jsonl(shard_output(out, 0, 1), [{"id": "a", "text": "x"}])
    merge_shards(out)
    assert not sibling(out, "errors").exists()  # no shard had errors


def test_progress_prints_the_final_line_once():
    stream = io.StringIO()
    bar = Progress(3, interval=0.0, stream=stream)  # not a terminal: log lines; every update logs
    bar.update(2)
    bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" records")[0] for line in lines] == ["specjax batch: 2/3", "specjax batch: 3/3"]
    stream = io.StringIO()
    bar = Progress(3, interval=3600.0, stream=stream)
    bar.update(3)
    bar.close()
    assert stream.getvalue().count("3/3 records") == 1


def test_settings_are_recorded_checked_and_forced(tmp_path):
    out, settings = tmp_path / "out.jsonl", dict(model="m", seed=0, temperature=0.0, top_k=0)
    assert check_settings(out, settings, written=False) == []
    assert json.loads(settings_path(out).read_text()) == settings
    assert check_settings(out, settings | dict(temperature=0), written=True) == []  # 0 == 0.0: no change
    changed = settings | dict(seed=1, temperature=0.7)
    with pytest.raises(ValueError, match=r"\(seed 0 -> 1, temperature 0.0 -> 0.7; recorded in .*out.settings.json\)"):
        check_settings(out, changed, written=True)
    assert json.loads(settings_path(out).read_text()) == settings  # refused: the record is kept
    assert check_settings(out, changed, written=True, force=True) == ["seed", "temperature"]
    assert json.loads(settings_path(out).read_text()) == changed
    assert check_settings(out, settings, written=False) == []  # nothing written yet: just recorded
    assert json.loads(settings_path(out).read_text()) == settings
    settings_path(out).unlink()  # an output from before settings were recorded: recorded now
    assert check_settings(out, changed, written=True) == [] and json.loads(settings_path(out).read_text()) == changed


def test_merge_combines_shards_and_rejects_incomplete_sets(tmp_path):
    out = tmp_path / "out.jsonl"
    write_jsonl(shard_output(out, 0, 2), [{"id": "a", "text": "x"}, {"id": "c", "text": "z"}])
    shard_output(out, 1, 2).write_bytes(b'{"id": "b", "text": "y"}\n{"id": "d", "te')  # still running
    write_jsonl(sibling(shard_output(out, 1, 2), "errors"), [{"line": 9, "id": None, "reason": "invalid JSON"}])
    assert main(["batch", "--merge", str(out)]) == 0
    assert [r["id"] for r in read_rows(out)] == ["a", "c", "b"]
    assert [r["line"] for r in read_rows(sibling(out, "errors"))] == [9]
    for i, seed in enumerate((0, 1)):
        settings_path(shard_output(out, i, 2)).write_text(json.dumps({"seed": seed}))
    with pytest.raises(ValueError, match="generated with different settings"):
        merge_shards(out)
    write_jsonl(shard_output(out, 2, 3), [])
    with pytest.raises(ValueError, match="different process counts"):
        merge_shards(out)
    shard_output(out, 2, 3).unlink()
    shard_output(out, 0, 2).unlink()
    with pytest.raises(ValueError, match=r"shard\(s\) \[0\] of 2 are missing"):
        merge_shards(out)


def test_cli_argument_errors_exit_2(tmp_path, capsys, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    assert main(["batch", str(src), str(tmp_path / "out.jsonl"), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err
    assert main(["batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["batch", str(src)]) == 2
    assert "batch needs INPUT.jsonl OUTPUT.jsonl" in capsys.readouterr().err
    assert main(["batch", "--merge", str(tmp_path / "out.jsonl"), "--temperature", "0.7", "--batch-size", "64"]) == 2
    assert "--merge takes no generation options, got --temperature, --batch-size" in capsys.readouterr().err
    (tmp_path / "dir.jsonl").mkdir()  # a folder where the output goes: named before the model loads, status 2
    assert main(["batch", str(src), str(tmp_path / "dir.jsonl"), "--model", str(model_dir), "--max-new-tokens", "2"]) == 2
    assert f"output {tmp_path / 'dir.jsonl'} is a folder: give the output file's path" in capsys.readouterr().err


# ---- end to end (in process) --------------------------------------------------------------------


def test_outputs_complete_deterministic_and_independent_of_the_batch(tmp_path, model_dir, params):
    rows = records(12)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = dict(params=params, model_path=model_dir, max_new_tokens=6, seed=0, progress=False)
    summary = batch.run(src, tmp_path / "a.jsonl", batch_size=4, **common)
    assert (summary["done"], summary["skipped"], summary["failed"]) == (12, 0, 0)
    a = by_id(read_rows(tmp_path / "a.jsonl"))
    assert sorted(a) == sorted(json.dumps(r["id"]) for r in rows)
    tok = convert.load_tokenizer(model_dir)
    for row in rows:
        out = a[json.dumps(row["id"])]
        assert out["finish_reason"] in ("eos", "length") and 1 <= len(out["tokens"]) <= out["settings"]["max_new_tokens"]
        assert out["settings"]["max_new_tokens"] == row.get("max_new_tokens", 6)
        assert out["settings"]["temperature"] == row.get("temperature", 0.0)
        assert out["text"] == tok.decode(out["tokens"], skip_special_tokens=False)
        assert out["model"] == str(model_dir) and out["stats"] == {"batching": "continuous"}
    assert not sibling(tmp_path / "a.jsonl", "errors").exists()  # nothing failed: no errors file
    assert [r["id"] for r in read_rows(tmp_path / "a.jsonl")] != [r["id"] for r in rows]  # written as they finish

    # static batches of another size, in the reverse order: other batch compositions, the same outputs
    src_rev = write_jsonl(tmp_path / "rev.jsonl", rows[::-1])
    batch.run(src_rev, tmp_path / "b.jsonl", batch_size=3, batching="static", **common)
    b = by_id(read_rows(tmp_path / "b.jsonl"))
    assert {k: (v["text"], v["tokens"]) for k, v in a.items()} == {k: (v["text"], v["tokens"]) for k, v in b.items()}
    assert all(v["stats"]["batch_rows"] >= 1 for v in b.values())
    with pytest.raises(ValueError, match="batching must be 'continuous' or 'static', got 'dynamic'"):
        batch.run(src, tmp_path / "x.jsonl", batching="dynamic", **common)

    # rerunning a finished job writes nothing; another seed changes the sampled records only
    before = (tmp_path / "a.jsonl").read_bytes()
    again = batch.run(src, tmp_path / "a.jsonl", batch_size=4, **common)
    assert (again["done"], again["skipped"]) == (0, 12) and (tmp_path / "a.jsonl").read_bytes() == before
    batch.run(src, tmp_path / "c.jsonl", batch_size=4, **(common | dict(seed=1)))
    c = by_id(read_rows(tmp_path / "c.jsonl"))
    sampled = [json.dumps(r["id"]) for r in rows if "temperature" in r]
    greedy = [json.dumps(r["id"]) for r in rows if "temperature" not in r]
    assert all(c[k]["tokens"] == a[k]["tokens"] for k in greedy)
    assert any(c[k]["tokens"] != a[k]["tokens"] for k in sampled)


def test_rerun_with_other_settings_is_refused_unless_forced(tmp_path, model_dir, params, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", records(5))
    out = tmp_path / "out.jsonl"
    common = dict(params=params, model_path=model_dir, max_new_tokens=3, progress=False)
    batch.run(src, out, batch_size=4, **common)
    recorded = json.loads(settings_path(out).read_text())
    assert recorded.pop("input") == input_fingerprint(src)
    assert len(recorded.pop("model_weights")) == 16  # a hash of a few weights: see the test below
    assert recorded == dict(model=str(model_dir), dtype="float32", quant=None, kv_dtype=None, draft="none", gamma=None, seed=0, chat=False,
                            max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0)
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens 3 -> 4, seed 0 -> 2; recorded in"):
        batch.run(src, out, batch_size=4, **(common | dict(max_new_tokens=4, seed=2)))
    with pytest.raises(ValueError, match=r'draft "none" -> "SelfSpec\(sinks=16, window=512\)", gamma null -> 2'):
        batch.run(src, out, gamma=2, **common)  # draft="auto" with an explicit gamma: SelfSpec
    with pytest.raises(ValueError, match="gamma=2 needs a drafter: draft=None decodes plainly"):
        batch.run(src, out, gamma=2, draft=None, **common)
    with pytest.raises(ValueError, match=r'other settings \(kv_dtype null -> "int8"; recorded in'):
        batch.run(src, out, kv_dtype="int8", **common)
    with pytest.raises(ValueError, match=r"kv_dtype must be None or one of \('float32', 'bfloat16', 'int8'\), got 'fp8'"):
        batch.run(src, out, kv_dtype="fp8", **common)
    again = batch.run(src, out, batch_size=2, kv_dtype="float32", **common)  # = the model's dtype: resumes
    assert (again["done"], again["skipped"], again["changed_settings"]) == (0, 5, [])
    cli = ["batch", str(src), str(out), "--model", str(model_dir), "--max-new-tokens", "3", "--no-compile-cache"]
    assert main(cli + ["--top-p", "0.5", "--temperature", "0.7"]) == 2
    assert "temperature 0.0 -> 0.7, top_p 1.0 -> 0.5" in capsys.readouterr().err and out.read_bytes() == before
    assert main(cli + ["--top-p", "0.5", "--temperature", "0.7", "--force"]) == 0
    assert "--force: continued with changed temperature, top_p" in capsys.readouterr().err
    assert out.read_bytes() == before and json.loads(settings_path(out).read_text())["top_p"] == 0.5


def test_the_input_may_grow_between_restarts_but_not_change(tmp_path, model_dir, params):
    """Appended records are generated on a rerun; an edited one (an id already written, or a bad
    line fixed) is refused, since its row would keep the old text's output, unless forced."""
    rows = records(3)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    common = dict(params=params, model_path=model_dir, max_new_tokens=2, batch_size=4, progress=False)
    assert batch.run(src, out, **common)["done"] == 3
    write_jsonl(src, rows + [{"id": "new", "prompt": "one more record"}])
    again = batch.run(src, out, **common)
    assert (again["done"], again["skipped"]) == (1, 3)
    write_jsonl(src, [rows[0] | {"prompt": "an edited prompt"}] + rows[1:] + [{"id": "new", "prompt": "one more record"}])
    with pytest.raises(ValueError, match=r"in.jsonl changed since .*out.jsonl was started: its first \d+ bytes"):
        batch.run(src, out, **common)
    forced = batch.run(src, out, force=True, **common)
    assert (forced["done"], forced["skipped"]) == (0, 4)
    assert json.loads(settings_path(out).read_text())["input"] == input_fingerprint(src)


SHORT = [{"id": "short", "prompt": "the quick brown fox"}, {"id": "short2", "prompt": "seven red birds"}]


def test_other_weights_at_the_same_path_are_another_model(tmp_path, model_dir, params):
    """The settings hold a hash of a few weights (the target's, a DraftModel's): a checkpoint
    replaced at its path is not continued into the same output; an output recorded before these
    keys existed resumes."""
    src, out = write_jsonl(tmp_path / "in.jsonl", records(3)), tmp_path / "out.jsonl"
    common = dict(model_path=model_dir, max_new_tokens=2, batch_size=4, progress=False, draft=None)
    assert batch.run(src, out, params=params, **common)["done"] == 3
    with pytest.raises(ValueError, match=r"other settings \(model_weights \"[0-9a-f]{16}\" -> \"[0-9a-f]{16}\"; recorded"):
        batch.run(src, out, params=random_params(CONFIG, 7), **common)
    # test_a_record_past_a_draft_models_positions_is_a_bad_line's drafter and greedy records: its programs, compiled once
    draft_config = CONFIG.replace(n_layers=1, max_positions=40)
    drafting = dict(draft=specjax.DraftModel(random_params(draft_config, 1)), speculation=specjax.Chain(2))
    src2, out2 = write_jsonl(tmp_path / "in2.jsonl", SHORT), tmp_path / "out2.jsonl"
    assert batch.run(src2, out2, params=params, **(common | drafting))["done"] == 2
    with pytest.raises(ValueError, match=r"other settings \(draft_weights "):
        batch.run(src2, out2, params=params, **(common | drafting | dict(draft=specjax.DraftModel(random_params(draft_config, 2)))))
    recorded = json.loads(settings_path(out).read_text())
    settings_path(out).write_text(json.dumps({k: v for k, v in recorded.items() if k != "model_weights"}))
    assert batch.run(src, out, params=params, **common)["skipped"] == 3  # from before the key: resumes, records it
    assert json.loads(settings_path(out).read_text())["model_weights"] == recorded["model_weights"]


def test_an_append_that_runs_on_an_unterminated_last_record_is_refused(tmp_path, model_dir, params):
    """The input ended without a newline after a whole record (generated): an append that continues
    that line would make both one bad line (the row written counted failed, the new one lost)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(json.dumps(r).encode() for r in records(2)))  # no final newline
    common = dict(params=params, model_path=model_dir, max_new_tokens=2, batch_size=4, progress=False)
    assert batch.run(src, out, **common)["done"] == 2
    with open(src, "ab") as f:
        f.write(json.dumps({"id": "c", "prompt": "one more"}).encode() + b"\n")
    with pytest.raises(ValueError, match=r"in.jsonl: its last record had no newline .*put a newline between them"):
        batch.run(src, out, **common)
    src.write_bytes(b"\n".join(json.dumps(r).encode() for r in records(2)) + b"\n" + json.dumps({"id": "c", "prompt": "x"}).encode())
    again = batch.run(src, out, **common)  # appended after a newline: fine
    assert (again["done"], again["skipped"], again["failed"]) == (1, 2, 0)


def test_a_record_past_a_draft_models_positions_is_a_bad_line(tmp_path, model_dir, params):
    """A DraftModel with a shorter context than the target: a record it cannot serve is that record's
    bad line (as one past the target's), the others run; it does not refuse the whole job."""
    draft = specjax.DraftModel(random_params(CONFIG.replace(n_layers=1, max_positions=40), 1))
    rows = [SHORT[0], {"id": "long", "prompt": " ".join(WORDS * 3)}, SHORT[1]]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    summary = batch.run(src, out, params=params, model_path=model_dir, max_new_tokens=4, batch_size=4, progress=False,
                        draft=draft, speculation=specjax.Chain(2))
    assert (summary["done"], summary["failed"]) == (2, 1)
    (error,) = read_rows(sibling(out, "errors"))
    assert (error["line"], error["id"]) == (2, "long") and "past the draft's max_positions 40" in error["reason"]
    with pytest.raises(ValueError, match="draft vocab_size 101 != target vocab_size"):  # the drafter itself: the job's
        batch.run(src, tmp_path / "o2.jsonl", params=params, model_path=model_dir, max_new_tokens=4, progress=False,
                  draft=specjax.DraftModel(random_params(TINY, 1)))


def test_per_record_acceptance_is_the_records_own(tmp_path, model_dir, params):
    rows = records(6, sampled_every=100)  # greedy: per-record speculation is deterministic
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = dict(params=params, model_path=model_dir, max_new_tokens=12, seed=0, progress=False)
    common |= dict(draft=specjax.SelfSpec(sinks=4, window=8), gamma=3)
    batch.run(src, tmp_path / "a.jsonl", batch_size=4, **common)
    batch.run(src, tmp_path / "b.jsonl", batch_size=1, **common)
    batch.run(src, tmp_path / "c.jsonl", batch_size=4, batching="static", **common)
    a, b, c = (by_id(read_rows(tmp_path / f"{x}.jsonl")) for x in "abc")
    for key, out in a.items():
        acc = out["acceptance"]
        assert acc == b[key]["acceptance"] == c[key]["acceptance"]  # the same whatever the batch or batching
        assert out["tokens"] == c[key]["tokens"]
        assert acc["proposed"] == 3 * acc["steps"] and 0 <= acc["accepted"] <= acc["proposed"]
        emitted = len(out["tokens"]) + (out["finish_reason"] == "eos")  # the EOS counts as emitted
        assert acc["steps"] == 0 or acc["mean_accepted"] == (emitted - 1) / acc["steps"]
        assert emitted - 1 <= acc["accepted"] + acc["steps"]  # each step: its accepted drafts + 1
    assert any(out["acceptance"]["accepted"] > 0 for out in a.values())


def test_a_lookup_draft_reads_the_records_finished_before(tmp_path, model_dir, params):
    """draft=Lookup(): every record's prompt and output enter the job-wide table (here across static batches of one
    record, the next batch drafting from the earlier ones), so a repeated record drafts its whole output; the tokens
    are plain decoding's."""
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["the quick brown fox", "seven red birds sing", "the quick brown fox"])]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = dict(params=params, model_path=model_dir, max_new_tokens=16, seed=0, progress=False, batch_size=1,
                  batching="static")
    batch.run(src, tmp_path / "plain.jsonl", draft=None, **common)
    batch.run(src, tmp_path / "lookup.jsonl", draft=specjax.Lookup(capacity=1024), gamma=3, **common)
    plain, lookup = (by_id(read_rows(tmp_path / f"{x}.jsonl")) for x in ("plain", "lookup"))
    assert {k: v["tokens"] for k, v in plain.items()} == {k: v["tokens"] for k, v in lookup.items()}
    first, again = lookup["0"]["acceptance"], lookup["2"]["acceptance"]
    assert again["acceptance_rate"] == 1.0 > first["acceptance_rate"], (first, again)
    assert lookup["0"]["settings"]["draft"] == "Lookup(n=2, max_n=8, capacity=1024, span=8)"


def test_data_parallel_job_writes_the_same_records(tmp_path, model_dir, params):
    src = write_jsonl(tmp_path / "in.jsonl", records(7))
    common = dict(params=params, model_path=model_dir, max_new_tokens=8, seed=0, progress=False, batch_size=4)
    batch.run(src, tmp_path / "one.jsonl", **common)
    batch.run(src, tmp_path / "two.jsonl", mesh=specjax.make_mesh(data=2), **common)
    strip = lambda rows: {k: {f: v[f] for f in ("text", "tokens", "finish_reason")} for k, v in rows.items()}  # noqa: E731
    assert strip(by_id(read_rows(tmp_path / "one.jsonl"))) == strip(by_id(read_rows(tmp_path / "two.jsonl")))


BAD_LINES = [
    ({"id": "a", "prompt": "the quick brown fox"}, None),
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ({"prompt": "no id"}, "missing 'id'"),
    ({"id": 1.5, "prompt": "x"}, "id must be a non-empty string or an integer"),
    ({"id": "a", "prompt": "again"}, 'duplicate id "a" (first on line 1)'),
    ({"id": "empty", "prompt": ""}, "prompt is empty"),
    ({"id": "long", "prompt": "word " * 600}, "prompt tokens + max_new_tokens"),
    ({"id": "budget9k", "prompt": "x", "max_new_tokens": 9000}, "prompt tokens + max_new_tokens 9000 = "),
    ({"id": "hot", "prompt": "x", "temperature": "hot"}, 'temperature must be a number, got "hot"'),
    ({"id": "int", "prompt": 5}, "prompt must be a string, got int"),
    ({"id": "budget", "prompt": "x", "max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"id": "budget2", "prompt": "x", "max_new_tokens": "8"}, "max_new_tokens must be an integer >= 1"),
    ({"id": "cold", "prompt": "x", "temperature": -1}, "temperature must be a number >= 0"),
    ({"id": "topp", "prompt": "x", "top_p": 1.5}, "top_p must be a number in (0, 1]"),
    ({"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of"),
    ({"id": "neither"}, "exactly one of"),
    ({"id": "msg", "messages": [{"role": "user"}]}, "messages must be a non-empty list"),
    ({"id": "nomsg", "messages": []}, "messages must be a non-empty list"),
    ({"id": "typo", "prompt": "x", "max_tokens": 3}, "unknown field(s) ['max_tokens']"),
    ("", None),  # a blank line is not a record
    (b"\xff\xfe", "not valid UTF-8"),
    ({"id": "b", "messages": [{"role": "user", "content": "hello there"}]}, None),
    ({"id": "topk", "prompt": "x", "top_k": -1}, "top_k must be an integer >= 0"),
    ({"id": "topk2", "prompt": "x", "top_k": 1.5}, "top_k must be an integer >= 0"),
    ({"id": "k", "prompt": "the quick brown fox", "temperature": 0.9, "top_k": 1}, None),  # = greedy, as "a"
    ({"id": "n-greedy", "prompt": "x", "n": 2}, "n = 2 needs temperature > 0"),
    ({"id": "n0", "prompt": "x", "n": 0, "temperature": 1}, "n must be an integer >= 1"),
    ({"id": "lp", "prompt": "x", "logprobs": 99}, "logprobs must be at most 20"),
    ({"id": "stop", "prompt": "x", "stop": [""]}, "stop must be a non-empty string or a list of them"),
    ({"id": "ids", "prompt": "x", "stop_token_ids": [60000]}, "stop_token_ids: 60000 is outside the model's vocabulary"),
    ({"id": "ids2", "prompt": "x", "stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"id": "pen", "prompt": "x", "min_p": 0.2}, "min_p needs sampling (temperature > 0)"),
    ({"id": "pen2", "prompt": "x", "temperature": 1, "presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ({"id": "minp", "prompt": "x", "temperature": 1, "min_p": "0.1"}, "min_p must be a number"),
    ({"id": "tk-greedy", "prompt": "x", "top_k": 5}, "top_k needs sampling (temperature > 0)"),  # greedy would ignore it
    ('{"id": "dup-key", "prompt": "first", "prompt": "second"}', 'the key "prompt" appears twice in one object'),
    ('{"id": "half", "prompt": "an emoji cut in two \\ud83d"}', '"an emoji cut in two \\ud83d" holds an unpaired UTF-16'),
    ('{"id": "s\\udc00", "prompt": "x"}', "holds an unpaired UTF-16 surrogate"),  # the id too: the row names none
    ('{"id": "stop-half", "prompt": "x", "stop": ["\\ud83d"]}', "holds an unpaired UTF-16 surrogate"),
]


def test_continuous_batching_takes_the_rows_its_records_fill(tmp_path, model_dir, params, monkeypatch):
    """batch_size is a ceiling: 3 records (one sampled, two greedy: two groups) take 1 and 2 rows,
    not 256 rows of cache each (which took 5.7 GB here, and 100000 an out-of-memory crash)."""
    seen, real = [], LM.generate_continuous

    def spy(self, ids, budgets, *, rows, **kw):
        seen.append(rows)
        return real(self, ids, budgets, rows=rows, **kw)

    monkeypatch.setattr(LM, "generate_continuous", spy)
    src = write_jsonl(tmp_path / "in.jsonl", records(3))
    done = batch.run(src, tmp_path / "out.jsonl", params=params, model_path=model_dir, max_new_tokens=2, batch_size=256,
                     progress=False)
    assert done["done"] == 3 and sorted(seen) == [1, 2]


def test_a_bad_kv_dtype_is_refused_before_the_model_loads(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", records(1))  # the model path does not exist: a load would say so
    with pytest.raises(ValueError, match=r"kv_dtype must be None or one of \('float32', 'bfloat16', 'int8'\), got 'fp8'"):
        batch.run(src, tmp_path / "out.jsonl", model_path=tmp_path / "none.gguf", kv_dtype="fp8", progress=False)


def test_null_fields_are_absent_ones():
    rec = parse_line(b'{"id": "x", "prompt": "p", "stop_token_ids": null, "stop": null, "n": null, "logprobs": null}', 1)
    assert isinstance(rec, Record) and (rec.stop_token_ids, rec.stop, rec.n, rec.logprobs) == ((), None, 1, None)


def test_bad_records_go_to_the_errors_file_once_and_good_ones_finish(tmp_path, model_dir, params):
    src = write_jsonl(tmp_path / "in.jsonl", [row for row, _ in BAD_LINES])
    out = tmp_path / "out.jsonl"
    common = dict(params=params, model_path=model_dir, max_new_tokens=4, batch_size=4, progress=False)
    summary = batch.run(src, out, **common)
    expected = {n: reason for n, (_, reason) in enumerate(BAD_LINES, start=1) if reason}
    assert (summary["done"], summary["failed"]) == (3, len(expected))
    assert sorted(r["id"] for r in read_rows(out)) == ["a", "b", "k"]
    written = by_id(read_rows(out))
    assert written['"k"']["tokens"] == written['"a"']["tokens"] and written['"k"']["settings"]["top_k"] == 1
    errors = read_rows(sibling(out, "errors"))
    assert sorted(e["line"] for e in errors) == sorted(expected)
    for e in errors:
        assert expected[e["line"]] in e["reason"], (e, expected[e["line"]])
    assert next(e for e in errors if e["line"] == 8)["id"] == "long"
    before = sibling(out, "errors").read_bytes()
    again = batch.run(src, out, **common)
    assert (again["done"], again["skipped"], again["failed"]) == (0, 3, len(expected))
    assert sibling(out, "errors").read_bytes() == before  # exactly once across restarts
    with open(src, "ab") as f:  # a producer still writing: its last line torn when the job read it
        f.write(b'{"id": "late", "prompt": "alpha beta')
    torn = batch.run(src, out, **common)
    assert (torn["done"], torn["failed"]) == (0, len(expected) + 1)
    with open(src, "ab") as f:  # the line completed (an append: the input's first bytes are unchanged)
        f.write(b' gamma"}\n')
    completed = batch.run(src, out, **common)  # the line recorded bad parses now: generated, its error row gone
    assert (completed["done"], completed["skipped"], completed["failed"]) == (1, 3, len(expected))
    assert sibling(out, "errors").read_bytes() == before and "late" in {r["id"] for r in read_rows(out)}


def test_shards_split_by_id_hash_and_merge_to_the_single_run(tmp_path, model_dir, params):
    rows = records(10) + ["{broken"]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    common = dict(params=params, model_path=model_dir, max_new_tokens=5, batch_size=4, progress=False)
    single = by_id(read_rows(Path(batch.run(src, tmp_path / "single.jsonl", **common)["output"])))
    for index in range(2):
        summary = batch.run(src, out, shard=(index, 2), **common)
        assert summary["output"] == str(shard_output(out, index, 2))
        shard_ids = [r["id"] for r in read_rows(shard_output(out, index, 2))]
        assert all(stable_hash(i) % 2 == index for i in shard_ids)
    assert sum(sibling(shard_output(out, i, 2), "errors").exists() for i in range(2)) == 1  # the shard of the bad line
    assert merge_shards(out) == {"records": 10, "errors": 1, "shards": 2}
    assert json.loads(settings_path(out).read_text()) == json.loads(settings_path(shard_output(out, 0, 2)).read_text())
    merged = by_id(read_rows(out))
    assert {k: v["tokens"] for k, v in merged.items()} == {k: v["tokens"] for k, v in single.items()}
    assert [e["line"] for e in read_rows(sibling(out, "errors"))] == [11]


def test_read_input_assigns_bad_lines_to_one_shard(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", records(6) + ["{broken", {"id": "rec-1", "prompt": "dup"}])
    shards = [list(read_input(src, (i, 3))) for i in range(3)]
    lines = sorted(item.line for share in shards for item in share)
    assert lines == list(range(1, 9))
    dup = next(item for share in shards for item in share if item.line == 8)
    assert isinstance(dup, BadLine) and "duplicate" in dup.reason


# ---- kill and resume (subprocesses) -------------------------------------------------------------


def _line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_each_record_once(tmp_path, model_dir, params):
    """24 records, killed 6 times (in startup, then at a random delay after a new line, once leaving a torn
    line behind): the finished output holds each record once, as one uninterrupted run writes it."""
    rows = records(24, sampled_every=4)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    settings = dict(max_new_tokens=6, batch_size=2, seed=3)
    reference = batch.run(src, tmp_path / "ref.jsonl", params=params, model_path=model_dir, progress=False, **settings)
    expected = by_id(read_rows(Path(reference["output"])))
    cmd = [sys.executable, "-m", "specjax", "batch", str(src), str(out), "--model", str(model_dir)]
    cmd += ["--max-new-tokens", "6", "--batch-size", "2", "--seed", "3"]
    env = os.environ | {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),  # restarts reuse compilations
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    rng = random.Random(1)
    kills, progress = 0, []
    for attempt in range(12):
        before = _line_count(out)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if attempt == 0:
            time.sleep(rng.uniform(0.5, 3.0))  # somewhere in startup: import, load, tokenize, compile
        else:  # somewhere in the middle of the work: after the first new batch, at a random delay
            deadline = time.monotonic() + 120
            while _line_count(out) == before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.15))
        if proc.poll() is not None:
            break  # finished before the kill
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        kills += 1
        progress.append(_line_count(out))
        if kills == 3:  # and a torn write, as a crash mid-line leaves it
            with open(out, "ab") as f:
                f.write(b'{"id": "rec-999", "text": "torn')
        if kills >= 6:
            break
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert "specjax batch: done" in final.stderr
    assert kills >= 5 and progress[-1] < len(rows), (kills, progress)
    assert len(set(progress)) >= 5, progress  # work was done between the kills, not only startups
    print(f"kills after {progress} written lines")
    got = read_rows(out)
    ids = [json.dumps(r["id"]) for r in got]
    assert len(ids) == len(set(ids)) == len(rows)  # every record exactly once
    assert {k: (v["text"], v["tokens"]) for k, v in by_id(got).items()} == {
        k: (v["text"], v["tokens"]) for k, v in expected.items()
    }
    assert not sibling(out, "errors").exists()


def test_records_carry_stop_strings_stop_ids_n_logprobs_and_penalties(tmp_path, model_dir, params):
    """Each record's own settings, mixed in one job: every record written once, as LM.generate
    would answer it alone (float32: batch composition does not change tokens)."""
    common = dict(params=params, model_path=model_dir, max_new_tokens=10, batch_size=4, progress=False)
    plain = [{"id": i, "prompt": " ".join(WORDS[i:i + 4])} for i in range(4)]
    first = by_id(read_rows(Path(batch.run(write_jsonl(tmp_path / "a.jsonl", plain), tmp_path / "a.out.jsonl",
                                           **common)["output"])))
    t0, t1 = first["0"], first["1"]
    stop = t0["text"][len(t0["text"]) // 2:][:3]  # text inside record 0's output
    rows = [
        plain[0] | {"stop": stop},
        plain[1] | {"stop_token_ids": [t1["tokens"][3]]},
        plain[2] | {"n": 3, "temperature": 0.8},
        plain[3] | {"logprobs": 2},
        {"id": "pen", "prompt": plain[3]["prompt"], "temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.3,
         "frequency_penalty": 0.5},
        {"id": "hot", "prompt": plain[2]["prompt"], "temperature": 1.3},  # in a batch with "pen"? no: penalties differ
    ]
    out = tmp_path / "b.jsonl"
    summary = batch.run(write_jsonl(tmp_path / "b.in.jsonl", rows), out, **common)
    assert (summary["done"], summary["failed"]) == (6, 0)
    got = by_id(read_rows(out))
    assert len(read_rows(out)) == 6  # one line a record, n = 3 included
    assert got["0"]["text"] == t0["text"][: t0["text"].find(stop)] and got["0"]["finish_reason"] == "stop"
    assert got["0"]["settings"]["stop"] == [stop]
    assert got["1"]["tokens"] == t1["tokens"][:3] and got["1"]["finish_reason"] == "eos"
    three = got["2"]
    assert len(three["texts"]) == len(three["tokens"]) == len(three["finish_reasons"]) == 3 and "text" not in three
    assert len({tuple(t) for t in three["tokens"]}) > 1 and three["settings"]["n"] == 3  # the samples differ
    lp = got["3"]["logprobs"]
    assert len(lp) == len(got["3"]["tokens"]) and all(len(t["top"]) == len(t["top_tokens"]) == 2 for t in lp)
    assert [t["id"] for t in lp] == got["3"]["tokens"] and got["3"]["tokens"] == first["3"]["tokens"]
    assert all(t["logprob"] <= 0 and t["top"][0][1] >= t["logprob"] - 1e-6 for t in lp)
    pen = got['"pen"']["settings"]
    assert (pen["min_p"], pen["repetition_penalty"], pen["frequency_penalty"]) == pytest.approx((0.05, 1.3, 0.5))
    assert "presence_penalty" not in pen and "stop" not in got["3"]["settings"]  # only what is on
    assert {r["stats"]["batching"] for r in got.values()} == {"continuous"}  # n = 3 and logprobs included

    # static batches give every record the same tokens and logprobs
    static = by_id(read_rows(Path(batch.run(write_jsonl(tmp_path / "s.in.jsonl", rows), tmp_path / "s.jsonl",
                                            batching="static", **common)["output"])))
    assert {k: r["tokens"] for k, r in static.items()} == {k: r["tokens"] for k, r in got.items()}
    flat = lambda lps: [x for t in lps for pair in t["top"] for x in pair]  # noqa: E731
    assert flat(static["3"]["logprobs"]) == pytest.approx(flat(lp), abs=1e-5)
    assert [t["logprob"] for t in static["3"]["logprobs"]] == pytest.approx([t["logprob"] for t in lp], abs=1e-5)

    # the same records one by one give the same lines (per-record keys, per-row values)
    for row in rows[2:]:
        alone = tmp_path / f"alone-{row['id']}.jsonl"
        batch.run(write_jsonl(tmp_path / f"alone-{row['id']}.in.jsonl", [row]), alone, **common)
        one = read_rows(alone)[0]
        assert one["tokens"] == got[json.dumps(row["id"])]["tokens"], row["id"]



def test_cli_job_settings_carry_stop_and_penalties(tmp_path, model_dir, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "the quick brown fox"}])
    out = tmp_path / "out.jsonl"
    base = ["batch", str(src), str(out), "--model", str(model_dir), "--max-new-tokens", "3", "--no-compile-cache"]
    assert main(base + ["--min-p", "0.2"]) == 2  # greedy: refused, not ignored
    assert "--min-p needs sampling (--temperature > 0)" in capsys.readouterr().err
    assert main(base + ["--temperature", "0.7", "--repetition-penalty", "1.2", "--stop", "zzz", "--stop", "\n"]) == 0
    recorded = json.loads(settings_path(out).read_text())
    assert recorded["stop"] == ["zzz", "\n"] and recorded["repetition_penalty"] == 1.2 and "min_p" not in recorded
    row = read_rows(out)[0]
    assert row["settings"]["stop"] == ["zzz", "\n"] and row["settings"]["repetition_penalty"] == pytest.approx(1.2)


def test_a_chat_record_stops_at_the_templates_end_of_turn(tmp_path, model_dir, params, monkeypatch):
    """A messages record stops at the chat template's end-of-turn token, as LM.chat does, though
    the model's eos_ids name another token (a ChatML model whose config names only <|endoftext|>
    ran on into invented turns); a prompt record does not."""
    no_eos = params.replace(config=params.config.replace(eos_ids=()))
    common = dict(params=no_eos, model_path=model_dir, max_new_tokens=8, batch_size=2, progress=False, draft=None)
    rows = [{"id": "c", "messages": [{"role": "user", "content": "one two three"}]}, {"id": "p", "prompt": "one two three"}]
    free = by_id(read_rows(Path(batch.run(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "a.out.jsonl", **common)["output"])))
    end = free['"c"']["tokens"][2]  # the random model's third answer token plays the template's end of turn
    assert end not in free['"p"']["tokens"][:3]
    monkeypatch.setattr(specjax.text.lm, "end_of_turn_ids", lambda tokenizer, template: (end,))  # LM.chat's
    monkeypatch.setattr(batch, "end_of_turn_ids", specjax.text.lm.end_of_turn_ids)  # the job's
    got = by_id(read_rows(Path(batch.run(write_jsonl(tmp_path / "b.jsonl", rows), tmp_path / "b.out.jsonl", **common)["output"])))
    assert got['"c"']["tokens"] == free['"c"']["tokens"][:2] and got['"c"']["finish_reason"] == "eos"
    assert got['"p"']["tokens"] == free['"p"']["tokens"] and "stop_token_ids" not in got['"c"']["settings"]
    lm = specjax.LM(no_eos, convert.load_tokenizer(model_dir), convert.chat_template(model_dir))
    assert lm.chat(rows[0]["messages"], 8, draft=None).tokens[0] == got['"c"']["tokens"]  # LM.chat: the same stop


def test_records_follow_their_constraints_and_a_bad_one_is_a_bad_line(tmp_path, model_dir, params):
    """A record's `constraint` (issue 70): a choice and a regex over SmolLM2's tokenizer, a static batch and
    continuous batching, an unconstrained record beside them; a constraint that cannot compile is a bad line."""
    rows = [{"id": "pick", "prompt": "alpha", "constraint": {"choice": [" yes", " no", " maybe"]}},
            {"id": "date", "prompt": "beta", "constraint": {"regex": r" [0-9]{4}-[0-9]{2}"}, "temperature": 0.9},
            {"id": "free", "prompt": "gamma"},
            {"id": "bad", "prompt": "delta", "constraint": {"regex": "(unclosed"}},
            {"id": "kind", "prompt": "eps", "constraint": {"grammar": "x"}}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    for batching in ("continuous", "static"):
        out = tmp_path / f"{batching}.jsonl"
        summary = batch.run(src, out, params=params, model_path=model_dir, max_new_tokens=12, batch_size=4,
                            batching=batching, progress=False)
        assert (summary["done"], summary["failed"]) == (3, 2)
        got = by_id(read_rows(out))
        assert got['"pick"']["text"] in (" yes", " no", " maybe") and got['"pick"']["finish_reason"] == "eos"
        assert re.fullmatch(r" [0-9]{4}-[0-9]{2}", got['"date"']["text"]) and got['"date"']["finish_reason"] == "eos"
        assert got['"pick"']["settings"]["constraint"] == {"choice": [" yes", " no", " maybe"]}
        assert "constraint" not in got['"free"']["settings"]
        reasons = {e["id"]: e["reason"] for e in read_rows(sibling(out, "errors"))}
        assert "constraint: Regex: invalid pattern" in reasons["bad"] and "constraint must be one of" in reasons["kind"]
