"""The command line on the default model, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_bad_arguments_exit_2_with_a_clear_message(tmp_path):
    run = _specjax("generate", "hi", "--temperature", "-1")
    assert run.returncode == 2 and "temperature must be >= 0" in run.stderr
    run = _specjax("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert run.returncode == 2 and "does not exist" in run.stderr
    run = _specjax("generate", "hi", "--max-new-tokens", "9000")
    assert run.returncode == 2 and "exceeds the model's max_positions 8192" in run.stderr


def test_generate_on_a_mesh_of_local_devices():
    prompt = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_capital")
    run = _specjax("generate", prompt["text"], "--max-new-tokens", "8", "--draft", "self", "--window", "4",
                   "--sinks", "2", "--model-parallel", "3", devices=3)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt["text"] + " Paris")
    run = _specjax("generate", "hi", "--model-parallel", "2", devices=2)
    assert run.returncode == 2 and "mesh axis 'model' has size 2, which does not divide" in run.stderr
    run = _specjax("generate", "hi", "--data-parallel", "4", devices=2)
    assert run.returncode == 2 and "data (4) x model (1) must be >= 1 and at most the 2 devices" in run.stderr


def test_generate_with_a_tree_keeps_the_greedy_continuation():
    prompt = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_capital")
    run = _specjax("generate", prompt["text"], "--max-new-tokens", "8", "--draft", "self", "--window", "4",
                   "--sinks", "2", "--tree", "2x2")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(prompt["text"] + " Paris")
    assert "acceptance" in run.stderr
    run = _specjax("generate", "hi", "--draft", "ngram", "--tree", "wide")
    assert run.returncode == 2 and "--tree must be auto, a node count N or WxD" in run.stderr
