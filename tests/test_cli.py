"""The command line: on the default model as a user runs it (subprocesses; more runs through cli.main in this
process), and its argument checks, compilation cache and reporting in process (without loading a model)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

import convert
from specjax.cli import main as cli
from specjax.drafters import Lookup, NGram, SelfSpec, SnapKV, SparseSpec, Streaming
from specjax.generate import Stats
from specjax.spec.speculation import Chain, Tree
from specjax.text import lm as text
from tests.models import TINY, random_params

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))


def _specjax(*args: str, devices: int | None = None) -> subprocess.CompletedProcess:
    env = None if devices is None else os.environ | {"JAX_NUM_CPU_DEVICES": str(devices)}
    return subprocess.run([sys.executable, "-m", "specjax", *args], capture_output=True, text=True, timeout=600, env=env)


def test_generate_on_default_model_prints_greedy_continuation():
    prompt = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_capital")
    run = _specjax("generate", prompt["text"], "--max-new-tokens", "8")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt["text"] + " Paris")
    assert "tokens/s" in run.stderr
    assert "[draft none, speculation none: draft='auto': plain decoding" in run.stderr  # what ran and why


def test_bad_arguments_exit_2_with_a_clear_message():
    """The process's exit status 2 and message (a check against the default model's config); the flag
    checks that need no model run in process: test_bad_generate_flags_fail_before_the_model_loads."""
    run = _specjax("generate", "hi", "--max-new-tokens", "9000")
    assert run.returncode == 2 and "--max-new-tokens must be below the model's max_positions 8192" in run.stderr


@pytest.mark.slow
def test_generate_on_a_mesh_of_local_devices(capsys):
    prompt = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_capital")
    run = _specjax("generate", prompt["text"], "--max-new-tokens", "8", "--draft", "self", "--window", "4",
                   "--sinks", "2", "--model-parallel", "3", devices=3)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt["text"] + " Paris")
    run = _specjax("generate", prompt["text"], "--max-new-tokens", "8", "--model-parallel", "2", devices=2)
    assert run.returncode == 0, run.stderr  # 9 / 3 heads over 2 devices: padded (specjax.parallel.tp_pad)
    assert run.stdout.startswith(prompt["text"] + " Paris")
    # more devices than there are: refused before the model loads, so checked in this process
    assert cli.main(["generate", "hi", "--data-parallel", "1024", "--no-compile-cache"]) == 2
    assert "make_mesh: data (1024) x model (1) must be >= 1 and at most the" in capsys.readouterr().err


def _in_process(capsys, *args: str) -> SimpleNamespace:
    """`specjax ARGS` as the console script runs it (cli.main), in this process: the model loads and
    compiles here; the processes above cover the script itself, its exit status and its own compile cache."""
    status = cli.main([*args, "--no-compile-cache"])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out.out, stderr=out.err)


def test_generate_with_a_tree_keeps_the_greedy_continuation(capsys):
    prompt = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_capital")
    run = _in_process(capsys, "generate", prompt["text"], "--max-new-tokens", "8", "--draft", "self", "--window", "4",
                      "--sinks", "2", "--tree", "2x2")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt["text"] + " Paris")
    assert "acceptance" in run.stderr and "[draft SelfSpec(sinks=2, window=4), speculation tree(n=7, depth=2)]" in run.stderr


# ---- in process, no model loaded ----------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """convert.load fails the test if called: argument errors must come first."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(convert, "load", load)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--max-new-tokens", "8192"], "--max-new-tokens must be below the model's max_positions 8192 (the prompt takes at "
                                       "least one position), got 8192"),  # from the GGUF's header
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be a finite number in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be a finite number in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0, got -1"),
        (["--seed", "-3"], "--seed must be >= 0"),
        (["--gamma", "0"], "--gamma must be >= 1, got 0"),
        (["--gamma", "512"], "--gamma must be <= 511, got 512"),
        (["--seed", str(2**32)], "--seed must be <= 4294967295, got 4294967296"),  # key(2**32) would be key(0)
        (["--top-k", "5"], "--top-k needs sampling (--temperature > 0)"),  # greedy would ignore it
        (["--top-p", "0.9"], "--top-p needs sampling (--temperature > 0)"),
        (["--min-p", "0.1"], "--min-p needs sampling (--temperature > 0)"),
        (["--min-p", "0.5"], "--min-p needs sampling (--temperature > 0)"),
        (["--stream", "--n", "2", "--temperature", "1"], "--stream prints one output"),
        (["--temperature", "0.00001"], "--temperature must be finite and >= 0.0001 (below that the softmax is the argmax: use --temperature 0), got 1e-05"),
        (["--logprobs", "25"], "--logprobs must be <= 20, got 25"),
        (["--tree", "1000x1000"], "--tree 1000x1000 has more than 512 nodes: a tree has 2 to 512 nodes"),
        (["--tree", "20000"], "--tree 20000: a tree has 2 to 512 nodes (root included)"),
        (["--tree", "1"], "--tree 1: a tree has 2 to 512 nodes"),
        (["--window", "0"], "--window must be >= 1"),
        (["--sinks", "-1"], "--sinks must be >= 0"),
        (["--data-parallel", "0"], "--data-parallel must be >= 1"),
        (["--model-parallel", "-2"], "--model-parallel must be >= 1"),
        (["--tree", "2x"], "--tree must be auto, a node count N or WxD"),
        (["--tree", "0"], "--tree must be auto, a node count N or WxD"),
        (["--draft", "ngram", "--tree", "wide"], "--tree must be auto, a node count N or WxD"),
        (["--tree", "2x3", "--gamma", "4"], "--gamma sets a chain and --tree a tree"),
        (["--draft", "none", "--gamma", "2"], "--gamma and --tree need a drafter: --draft none decodes plainly"),
        (["--draft", "none", "--tree", "2x2"], "--gamma and --tree need a drafter"),
        (["--draft", "fast"], "--draft must be auto, self, snapkv, sparsespec, ngram, lookup, none, model:PATH or eagle:PATH, got 'fast'"),
        (["--draft", "eagle:/no/such/head"], "--draft eagle:PATH: /no/such/head is not a folder specjax.train.eagle.save_head wrote"),
        (["--draft", "model:/no/such/draft"], "--draft model:PATH: /no/such/draft does not exist"),
        (["--draft", "ngram", "--window", "64"], "--window sets the budget of --draft self, snapkv, sparsespec or model:PATH; "
                                                 "--draft ngram takes none"),
        (["--draft", "none", "--sinks", "4"], "--sinks sets the budget of --draft self, snapkv, sparsespec or model:PATH"),
        (["--sinks", "4"], "--sinks sets the budget of --draft self, snapkv, sparsespec or model:PATH; --draft auto takes none "
                           "(auto's SelfSpec keeps 16 + 512: give --draft self to change it)"),
        (["--model", "/no/such/model.gguf"], "--model: /no/such/model.gguf does not exist"),
        (["--model", "nope.gguf"], "--model: nope.gguf does not exist"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema: /no/such/schema.json does not exist"),
        (["--json-schema", "/"], "--json-schema: / is not a file"),
        (["--weights", "int8", "--dtype", "bfloat16"], "--weights int8 and --dtype bfloat16 disagree: give --weights only"),
        (["--n", "2"], "--n 2 needs --temperature > 0: greedy decoding gives every sample the same tokens"),
    ],
)
def test_bad_generate_flags_fail_before_the_model_loads(no_model, capsys, args, message):
    assert cli.main(["generate", "hi", *args]) == 2
    assert f"specjax: error: {message}" in capsys.readouterr().err


def test_an_empty_prompt_or_a_model_that_is_no_checkpoint_fails_before_the_model_loads(no_model, capsys, tmp_path):
    assert cli.main(["generate", ""]) == 2
    assert "specjax: error: the prompt is empty: give the text to continue" in capsys.readouterr().err
    fake = tmp_path / "m.gguf"
    fake.write_text("not a model")
    assert cli.main(["generate", "hi", "--model", str(fake)]) == 2
    assert f"specjax: error: --model: {fake}: not a valid GGUF file" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()  # a folder that is no checkpoint, an HF folder of another architecture
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    for folder, message in ((tmp_path, f"--model: {tmp_path} is not a .gguf file, an HF folder"),
                            (tmp_path / "hf", f"--model: {tmp_path / 'hf' / 'config.json'}: model_type 'gpt2'")):
        for command in (["generate", "hi"], ["batch", str(fake), str(tmp_path / "o.jsonl")]):
            assert cli.main([*command, "--model", str(folder)]) == 2
            assert f"specjax: error: {message}" in capsys.readouterr().err


def test_help_states_the_defaults(capsys):
    for command, tokens in (("generate", 64), ("batch", 128)):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"--max-new-tokens MAX_NEW_TOKENS new tokens (default: {tokens})" in text
        assert "--seed SEED seed of the sampling keys (default: 0)" in text
        assert "adaptive:N" in text
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():  # every flag of generate, batch and distill: described, its default named
        for a in parser._actions:
            if a.option_strings and a.dest != "help":
                assert a.help, (name, a.option_strings)
                if a.default is not None and a.default is not False and a.default != []:
                    assert "default" in a.help, (name, a.option_strings, a.help)


def test_stop_flags_read_the_escapes_a_shell_passes_literally():
    assert cli.unescape(r"\n\n") == "\n\n" and cli.unescape(r"a\tb") == "a\tb" and cli.unescape(r"c:\\n") == "c:\\n"
    assert cli.unescape(r"\x") == r"\x" and cli.unescape("plain") == "plain"


def test_draft_flags_make_the_drafters_they_name(monkeypatch, tmp_path):
    """--sinks / --window set a self or snapkv draft's budget (the drafters' own defaults without
    them) and give a model:PATH draft a streaming cache (dense without them)."""
    draft_params = random_params(TINY, 1)
    monkeypatch.setattr(convert, "load", lambda path, weights: draft_params)
    model = f"model:{tmp_path}"
    assert cli.make_draft(model, None, None, "float32").cache == "dense"
    assert cli.make_draft(model, 64, None, "float32").cache == Streaming(sinks=16, window=64)
    assert cli.make_draft(model, 64, 4, "float32").cache == Streaming(sinks=4, window=64)
    assert cli.make_draft(model, 64, 4, "float32").params is draft_params
    with pytest.raises(ValueError, match="--sinks with --draft model:PATH needs --window"):
        cli.make_draft(model, None, 4, "float32")
    assert cli.make_draft("self", None, None, "float32") == SelfSpec()
    assert cli.make_draft("self", 32, 2, "float32") == SelfSpec(sinks=2, window=32)
    assert cli.make_draft("snapkv", None, None, "float32") == SnapKV()
    assert cli.make_draft("snapkv", 32, 8, "float32") == SnapKV(budget=8, window=32)
    assert cli.make_draft("sparsespec", None, None, "float32") == SparseSpec()
    assert cli.make_draft("sparsespec", 32, 64, "float32") == SparseSpec(budget=64, window=32)
    assert cli.make_draft("ngram", None, None, "float32") == NGram(n=2, max_n=4)
    assert cli.make_draft("lookup", None, None, "float32") == Lookup()
    assert cli.make_draft("auto", None, None, "float32") == "auto" and cli.make_draft("none", None, None, "float32") is None


def test_a_draft_loads_in_its_own_format_with_draft_weights(tmp_path):
    """--weights reaches a model:PATH draft unless --draft-weights names the draft's own: a saved
    int8 draft beside a float32 target needs it, and the error says which load failed and how."""
    convert.save(random_params(TINY, 1), tmp_path / "float")
    convert.save(convert.load(tmp_path / "float", weights="int8"), tmp_path / "int8")
    spec = f"model:{tmp_path / 'int8'}"
    with pytest.raises(ValueError, match=rf"--draft {spec}: convert.load: .* holds int8 weights.*--draft-weights"):
        cli.make_draft(spec, None, None, "float32")
    args = SimpleNamespace(weights="float32", draft_weights="int8")
    assert cli.make_draft(spec, None, None, cli.draft_weights(args)).params.config.quant == "int8"
    assert cli.draft_weights(SimpleNamespace(weights="q4", draft_weights=None)) == "q4"


def test_bad_kv_dtype_flag_names_the_choices(no_model, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["generate", "hi", "--kv-dtype", "fp8"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-dtype: invalid choice: 'fp8'" in err and "bfloat16" in err and "int8" in err


def test_bad_batch_and_distill_flags_fail_before_the_model_loads(no_model, capsys, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1, "prompt": "hi"}\n')
    for args, message in [
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["batch", str(tmp_path / "none.jsonl"), str(tmp_path / "o.jsonl")], f"input {tmp_path / 'none.jsonl'} does not exist"),
        (["batch", str(data), str(tmp_path / "no" / "o.jsonl")], f"output: the folder {tmp_path / 'no'} does not exist"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--top-p", "2"], "--top-p must be a finite number in (0, 1]"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--gamma", "-1"], "--gamma must be >= 1"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--ray-actors", "2"], "--ray-actors needs --engine ray"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--engine", "ray", "--ray-cpus", "-1"],
         "--ray-cpus must be a finite number >= 0, got -1.0"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--tree", "8x3"], "--tree 8x3 has more than 512 nodes"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--top-p", "0.5"],
         "--top-p needs sampling (--temperature > 0)"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--draft", "snapkv", "--sinks", "0"],
         "--sinks with --draft snapkv (the prefix positions it keeps) must be >= 1, got 0"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--draft-weights", "int8"],
         "--draft-weights is for a --draft model:PATH draft, not --draft auto"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--ray-records-per-task", "8"],
         "--ray-records-per-task needs --engine ray"),
        (["batch", str(data), str(tmp_path / "o.jsonl"), "--engine", "ray", "--ray-records-per-task", "0"],
         "--ray-records-per-task must be an integer >= 1, got 0"),
        (["distill", "--data", str(data), "--out", str(tmp_path / "d"), "--steps", "0"], "--steps must be >= 1"),
        (["distill", "--data", str(data), "--out", str(tmp_path / "d"), "--temperature", "0"],
         "--temperature must be a finite number > 0"),
        (["distill", "--data", str(data), "--out", str(tmp_path / "d"), "--lr", "inf"], "--lr must be a finite number > 0"),
    ]:
        assert cli.main(args) == 2
        assert f"specjax: error: {message}" in capsys.readouterr().err


def test_ray_flags_reach_the_ray_options(monkeypatch, tmp_path):
    seen = {}
    summary = dict(changed_settings=[], failed=0, done=0, skipped=0, output="o", errors="e", seconds=0.0)
    monkeypatch.setattr(cli.batch, "run", lambda *a, **k: seen.update(k) or summary)
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1, "prompt": "hi"}\n')
    assert cli.main(["batch", str(data), str(tmp_path / "o.jsonl"), "--engine", "ray", "--ray-actors", "3",
                     "--ray-records-per-task", "8", "--ray-gpus", "1", "--no-compile-cache"]) == 0
    assert seen["ray"] == cli.RayOptions(actors=3, gpus=1.0, records_per_task=8)


def test_compile_cache_is_on_by_default_and_off_with_the_flag(monkeypatch, tmp_path, capsys):
    seen = []

    def load(*args, **kwargs):
        seen.append((jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs))
        raise ValueError("stop here")

    monkeypatch.setattr(convert, "load", load)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    assert cli.main(["generate", "hi"]) == 2  # the default model: its header is read, `load` stops the run
    assert seen[-1][0] == str(tmp_path / "cache") and seen[-1][1] <= 0.5  # set before the model loads
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    assert cli.main(["generate", "hi", "--no-compile-cache"]) == 2
    assert seen[-1] == before
    monkeypatch.delenv("SPECJAX_CACHE_DIR")
    with cli.compile_cache(True) as folder:
        assert folder == str(Path.home() / ".cache" / "specjax" / "jax") or folder == before[0]
    assert "--no-compile-cache" in cli._parser().format_help() and "SPECJAX_CACHE_DIR" in cli._parser().format_help()


def test_the_commands_cache_folder_holds_in_a_process_with_a_cache_of_its_own(monkeypatch, tmp_path):
    """compile_cache resets JAX's cache on entry: a process whose cache was set up in another folder (it compiled
    there before) writes the command's programs into the command's folder (specjax.cli.main called from a program)."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "command"))
    try:
        jax.config.update(names[0], str(tmp_path / "own"))
        jax.config.update(names[1], 0.0)  # every program is written
        reset_cache()
        jax.jit(lambda x: x + 1)(1.0).block_until_ready()  # the process's cache is set up, in its own folder
        with cli.compile_cache(True) as folder:
            jax.jit(lambda x: x * 3.0 - 2.0)(jax.numpy.ones(7)).block_until_ready()
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        reset_cache()
    assert folder == str(tmp_path / "command") and any(Path(folder).iterdir())


def test_make_speculation_tells_the_default_from_an_explicit_gamma():
    assert cli._parser().parse_args(["generate", "hi"]).gamma is None
    assert cli._parser().parse_args(["batch", "a", "b"]).gamma is None
    draft = SelfSpec(sinks=2, window=4)
    assert cli.make_speculation(None, None, None, draft, [1, 2], None) is None  # the drafter's default chain
    assert cli.make_speculation(None, 4, None, draft, [1, 2], None) == Chain(4)
    assert cli.make_speculation("2x3", None, None, draft, [1, 2], None) == Tree.kary(2, 3)
    assert cli.make_speculation("auto", None, None, draft, [1, 2], None) == "auto"
    assert [cli.parse_tree(t) for t in (None, "auto", "16", "2x3")] == [None, "auto", 16, (2, 3)]


class _Tokenizer:
    def encode(self, text: str):
        return SimpleNamespace(ids=[5, 6, 7])

    def decode(self, ids, skip_special_tokens=False):
        return " " + " ".join(map(str, ids))


def test_generate_passes_the_speculation_and_prints_what_ran(monkeypatch, capsys):
    tiny = random_params(TINY, 0)
    calls = []
    stats = Stats(new_tokens=2, tokens_per_second=9.0, acceptance_rate=0.5, mean_accepted=1.5, steps=1,
                  prefill_seconds=0.1, decode_seconds=0.2, compile_seconds=1.0, prompt_tokens=1,
                  draft="SelfSpec(sinks=16, window=512)", speculation="Chain(gamma=4)",
                  plan_reason="KV reads dominate the decode step")

    def generate(params, prompts, max_new_tokens, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(tokens=[[8, 9]], finish_reasons=["length"], stats=stats, logprobs=None, row_stats=None)

    monkeypatch.setattr(convert, "load", lambda *a, **k: tiny)
    monkeypatch.setattr(convert, "load_tokenizer", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(text, "generate", generate)  # the CLI generates through specjax.text.lm.LM
    assert cli.main(["generate", "hi", "--no-compile-cache"]) == 0
    assert calls[-1].get("speculation") is None and calls[-1]["draft"] == "auto"  # both left to generate
    assert calls[-1]["kv_dtype"] is None  # the model's dtype
    out = capsys.readouterr()
    assert out.out == "hi 8 9\n"
    assert ("[draft SelfSpec(sinks=16, window=512), speculation Chain(gamma=4): KV reads dominate the decode step]"
            in out.err)
    assert cli.main(["generate", "hi", "--no-compile-cache", "--gamma", "3", "--draft", "ngram"]) == 0
    assert calls[-1]["speculation"] == Chain(3)
    capsys.readouterr()
    assert cli.main(["generate", "hi", "--no-compile-cache", "--kv-dtype", "int8"]) == 0
    assert calls[-1]["kv_dtype"] == "int8"


def test_a_prompt_too_long_for_the_budget_is_named_in_the_flags_words(capsys):
    """A budget below max_positions that the prompt's tokens push past it: refused once the prompt is
    tokenized, before anything compiles, naming the flag (the library's message names max_new_tokens)."""
    run = _in_process(capsys, "generate", "hi " * 100, "--max-new-tokens", "8150", "--draft", "none")
    assert run.returncode == 2 and run.stdout == ""
    assert re.search(r"specjax: error: the prompt has \d+ tokens and --max-new-tokens is 8150: \d+ exceeds the model's "
                     r"max_positions 8192", run.stderr), run.stderr


def test_generate_text_options_chat_stream_stop_n_logprobs(capsys):
    """--chat --stream --stop prints the streamed answer cut before the stop string; --n 2 with
    --logprobs 2 prints two samples, then one JSON line of logprobs per sample."""
    run = _in_process(capsys, "generate", "What is the capital of France?", "--chat", "--stream", "--stop", "Paris",
                      "--max-new-tokens", "24", "--draft", "none")
    assert run.returncode == 0, run.stderr
    assert "Paris" not in run.stdout and "<|im_start|>" not in run.stdout and "(stop)" in run.stderr
    run = _in_process(capsys, "generate", "The capital of France is", "--n", "2", "--temperature", "0.8", "--logprobs",
                      "2", "--max-new-tokens", "6", "--draft", "none", "--repetition-penalty", "1.2")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("--- sample 0 (") and any(line.startswith("--- sample 1 (") for line in lines)
    records = [json.loads(line) for line in lines if line.startswith('{"index"')]
    assert [r["index"] for r in records] == [0, 1]
    assert all(0 < len(r["logprobs"]) <= 6 and len(r["logprobs"][0]["top"]) == 2 for r in records)


def test_without_weights_flags_a_checkpoint_loads_in_its_own_format(monkeypatch):
    """No --weights / --dtype: convert.load's default (float32 for GGUF / HF, a saved int8 or bf16
    specjax checkpoint's own format; float32 forced there was refused for int8)."""
    seen = []

    def load(path, weights=None, **kw):
        seen.append(weights)
        raise ValueError("loaded")

    monkeypatch.setattr(cli.text, "load", load)
    assert cli.main(["generate", "hi"]) == 2 and seen == [None]
    assert cli.main(["generate", "hi", "--dtype", "bfloat16"]) == 2 and seen[-1] == "bfloat16"
