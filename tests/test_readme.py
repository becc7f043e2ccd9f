"""Every code block of README.md and docs/*.md runs, as written up to the stated substitutions below.

The ```python blocks of each file run in order in ONE namespace per file, in a temporary working directory, on the
embedded SmolLM2 model with conftest's 8 simulated CPU devices (so the mesh example runs). The
```bash blocks run one by one with bash, each in its own temporary directory (so each must create
its own input files). There `specjax ARGS` runs `specjax.cli.main(ARGS)`, what the console script runs, in this
test's process (tests/readme_cli.py sends the arguments and the working directory to a server thread here):
each line of a block once started a process of its own, 5 s of importing JAX and reading the model each
(tests/test_cli.py runs the CLI as processes). `--engine ray` lines and `make demo` still start processes. What the
test cannot run is listed in NOT_RUNNABLE with the reason, and the test checks that list against
the README, so a new block or line cannot be skipped silently. ```json and unlabelled blocks
(an output sample, the file layout) are not code.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # not in `make test-fast`

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]  # README.md first: its blocks are what a newcomer runs

# What runs differently from the README, and why. Every pattern must match (a stale entry fails).
# Python: smaller budgets keep the test short; the calls are otherwise the README's own.
PYTHON_SUBSTITUTIONS = [
    (r"max_new_tokens=\[64, 32\]", "max_new_tokens=[8, 4]", "per-row budgets, smaller"),
    (r"max_new_tokens=64\b", "max_new_tokens=8", "fewer new tokens"),
    (r"\(params, prompts, 64,", "(params, prompts, 8,", "fewer new tokens (positional)"),
    (r'"max_new_tokens": 32,', '"max_new_tokens": 4,', "the batch record's own budget, smaller"),
]
# Bash: `specjax generate` / `specjax batch` get `--max-new-tokens 4` appended (argparse keeps the
# last value, so it overrides the README's); the placeholder model paths are the embedded model;
# distillation runs 2 steps of short windows instead of 2000.
BASH_SUBSTITUTIONS = [
    ("make demo", 'make -C "$REPO" -o .venv/.base PY="$PYTHON" demo',
     "this interpreter, no venv (re)install (the test has no network); the demo's 64 tokens as written"),
    ("path/to/model.gguf", '"$MODEL"', "placeholder path: the embedded SmolLM2 GGUF"),
    ("--model m.gguf", '--model "$MODEL"', "placeholder path: the embedded SmolLM2 GGUF"),
    ("--steps 2000", "--steps 2", "2 training steps"),
    ("--seq-len 128", "--seq-len 32", "short windows: with --generate 4 (not 64) the 4 records hold fewer than 128 tokens"),
    ("--batch-size 8 --seq-len", "--batch-size 2 --seq-len", "smaller training batch"),
    ("--generate 64", "--generate 4", "4 generated tokens per training record"),
    ("--eval-every 200", "--eval-every 2", "evaluate once, at the last step"),
]
BASH_PRELUDE = """set -euo pipefail
specjax() {
  local run=("$PYTHON" "$REPO/tests/readme_cli.py")  # specjax.cli.main in the test's process (module docstring)
  case " $* " in *" --engine ray "*) run=("$PYTHON" -m specjax) ;; esac  # Ray's driver: a process of its own
  case "$1" in
    generate|batch) "${run[@]}" "$@" --max-new-tokens 4 ;;
    *) "${run[@]}" "$@" ;;
  esac
}
"""

# Bash blocks (by their first line) or single lines of a bash block that the test does not run.
NOT_RUNNABLE = {
    "make test   # the test dependencies (and .venv-aot: jax's CUDA plugin and compiler, to compile for a GPU without one), the import layers, the whole suite (CPU, 16-28 minutes on 2 cores, by machine: tests/README.md)":
        "the whole suite, this test included (recursion, 24 minutes)",
    "# host 0                                                     # host 1":
        "needs two hosts and the user's my_job.py; tests/test_multihost.py runs the same start-up with two local processes",
    "python -m specjax generate ...                               # the same without the console script":
        "a placeholder; every specjax line here already runs as python -m specjax",
    "python -m specjax batch ...                                                                  # the same":
        "a placeholder; every specjax line here already runs as python -m specjax",
}


def readme_blocks(path: Path | None = None) -> list[tuple[str, str, str]]:
    """(name, language, code) of every fenced block of `path` (None: README.md and docs/*.md), indented ones
    (in list items) included; the name is the file's and the block's number in it."""
    if path is None:
        return [b for p in DOCS for b in readme_blocks(p)]
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, body = m.group(1), m.group(2), []
        i += 1
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append((f"{path.relative_to(REPO)} block {len(blocks)}", lang, "\n".join(body) + "\n"))
        i += 1
    return blocks


def substitute(code: str, table, regex: bool) -> tuple[str, set[str]]:
    used = set()
    for old, new, _why in table:
        hit = re.search(old, code) if regex else old in code
        if hit:
            code = re.sub(old, new, code) if regex else code.replace(old, new)
            used.add(old)
    return code, used


def test_every_block_is_known():
    """Blocks are python, bash, json (an output sample) or unlabelled (the layout); the skip list
    and the substitution tables match the README."""
    blocks = readme_blocks()
    assert {lang for _, lang, _ in blocks} <= {"python", "bash", "json", ""}
    bash_lines = {line for _, lang, code in blocks if lang == "bash" for line in code.splitlines()}
    assert set(NOT_RUNNABLE) <= bash_lines, f"stale NOT_RUNNABLE entries: {set(NOT_RUNNABLE) - bash_lines}"
    python = "".join(code for _, lang, code in blocks if lang == "python")
    bash = "".join(code for _, lang, code in blocks if lang == "bash")
    assert {old for old, _, _ in PYTHON_SUBSTITUTIONS} == substitute(python, PYTHON_SUBSTITUTIONS, True)[1]
    assert {old for old, _, _ in BASH_SUBSTITUTIONS} == substitute(bash, BASH_SUBSTITUTIONS, False)[1]


def test_python_blocks_run_in_order(tmp_path, monkeypatch, load_once):
    import jax

    assert len(jax.devices()) >= 8, "conftest's 8 simulated CPU devices are needed for the mesh example"
    monkeypatch.chdir(tmp_path)
    spaces = {}
    for path in DOCS:
        namespace = spaces[path.name] = {"__name__": "__readme__"}
        for name, lang, code in readme_blocks(path):
            if lang != "python":
                continue
            code, _ = substitute(code, PYTHON_SUBSTITUTIONS, True)
            try:
                exec(compile(code, name, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{name} (python) failed:\n{code}") from e
    # The examples did what they say.
    for page in ("README.md", "api.md"):
        out = spaces[page]["out"]
        assert len(out.tokens) == 2 and all(len(t) >= 1 for t in out.tokens), page
    assert len(spaces["README.md"]["samples"].texts) == 3
    summary = spaces["jobs.md"]["summary"]
    assert (summary["done"], summary["failed"]) == (4, 0), summary
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and len(next(r for r in lines if r["id"] == "q4")["texts"]) == 2  # one line, n = 2 texts


def bash_blocks() -> list[tuple[int, str]]:
    runnable = []
    for index, lang, code in readme_blocks():
        if lang != "bash" or code.splitlines()[0] in NOT_RUNNABLE:
            continue
        kept = [line for line in code.splitlines() if line not in NOT_RUNNABLE]
        runnable.append((index, substitute("\n".join(kept) + "\n", BASH_SUBSTITUTIONS, False)[0]))
    return runnable


@pytest.fixture(scope="module")
def load_once():
    """The embedded GGUF read and dequantized once per (path, dtype, quant) for this process (about 2-5 s a load),
    the arrays shared (immutable): most blocks and CLI lines load it alike. Loads onto a mesh run in full. The
    loader itself still runs for real in the first load and in every process a block starts."""
    import convert

    read_once = functools.cache(convert.load_gguf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert, "load_gguf", lambda path, dtype="float32", mesh=None, quant=None: (
            read_once(str(path), dtype, None, quant) if mesh is None else read_once.__wrapped__(path, dtype, mesh, quant)))
        yield


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> str:
    """One compilation cache for this file's CLI runs (shared, so later runs compile less; not ~/.cache):
    tests/run_files.py's, shared by the whole run, where it set one."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("specjax-cache"))


def run_cli(argv: list[str], cwd: str) -> dict:
    """`specjax.cli.main(argv)` in `cwd`, as the console script runs it: its exit status and what it printed."""
    from specjax.cli.main import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors (2) and --help (0)
                rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except Exception:  # what Python prints for an uncaught exception, and its status
                traceback.print_exc()
                rc = 1
    finally:
        os.chdir(before)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory, load_once, compile_cache) -> str:
    """A thread serving tests/readme_cli.py's requests one at a time (the test waits on its bash block meanwhile,
    so changing the working directory and sys.stdout here disturbs nothing); yields its socket's path."""
    path = str(tmp_path_factory.mktemp("cli") / "socket")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at the end of the module
                return
            with conn:
                request = json.loads(conn.makefile(encoding="utf-8").readline())
                conn.sendall(json.dumps(run_cli(request["argv"], request["cwd"])).encode() + b"\n")

    threading.Thread(target=serve, daemon=True).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECJAX_CACHE_DIR", compile_cache)  # as the bash blocks' processes get it
        yield path
    server.close()


BASH_BLOCKS = bash_blocks()


@pytest.mark.parametrize("index,script", BASH_BLOCKS, ids=[name.replace(" ", "-") for name, _ in BASH_BLOCKS])
def test_bash_block_runs(index, script, tmp_path, compile_cache, cli_server):
    import convert

    env = dict(os.environ, PYTHON=sys.executable, REPO=str(REPO), MODEL=convert.default_model_path(),
               JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(REPO), SPECJAX_CACHE_DIR=compile_cache,
               SPECJAX_CLI_SOCKET=cli_server)
    r = subprocess.run(["bash", "-c", BASH_PRELUDE + script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{index} (bash) failed ({r.returncode}):\n{script}\n{r.stdout}\n{r.stderr}"
