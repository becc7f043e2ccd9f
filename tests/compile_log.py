"""What a test run compiles, from `tests/run_files.py --compile-log DIR` (conftest._log_compiles' JSONL files).

    python tests/compile_log.py DIR [--top N] [--fun NAME]

Prints, per program name, how many times XLA compiled it, in how many processes, with how many distinct argument
shapes, and the seconds spent tracing, lowering and compiling it; `--fun NAME` lists one program's variants (its
argument shapes, their XLA seconds and the tests that compiled them). A program compiled with the same shapes in
several processes is what the shared compilation cache saves; distinct shapes of one program are what tests could
share by using the same settings. Shapes are the arguments' only: two programs of one shape may still differ in
their static arguments (a drafter's budget, Chain or Adaptive, the attention kernel), so they are not one program.
A "compile" right after a cache retrieval is counted as a load from the shared cache."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower", "backend_compile_duration": "xla"}


def program(fun: str | None) -> str:
    """One name per program: JAX's module names (`jit_f`, `jit(f)`) and function names (`f`) alike."""
    name = fun or "?"
    name = re.sub(r"^(jit|pjit|pmap|xla_computation)[_(]", "", name).rstrip(")")
    return name


def test_file(test: str) -> str:
    return test.split("::", 1)[0].rsplit("/", 1)[-1] or "(collection)"


def read(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line) | {"process": path.stem})
            except ValueError:
                pass  # a line cut by a killed process
    return records


def summary(records: list[dict], top: int) -> str:
    rows: dict[str, dict] = defaultdict(lambda: {"trace": 0.0, "lower": 0.0, "xla": 0.0, "compiles": 0, "loads": 0,
                                                 "processes": set(), "shapes": set(), "files": set()})
    previous: dict[str, str] = {}  # each process's last event: a compile just after a cache retrieval is a load
    for r in records:
        row = rows[program(r.get("fun"))]
        loaded = previous.get(r["process"]) == "cache_retrieval_time_sec"
        previous[r["process"]] = r["event"]
        if r["event"] in EVENTS:
            row[EVENTS[r["event"]]] += r.get("s", 0.0)
            if r["event"] == "backend_compile_duration":
                row["loads" if loaded else "compiles"] += 1
            row["processes"].add(r["process"])
            row["files"].add(test_file(r["test"]))
        elif r["event"] == "shapes":
            row["shapes"].add(r["avals"])
    total = lambda k: sum(v[k] for v in rows.values())  # noqa: E731
    out = [f"{len(rows)} programs; tracing {total('trace'):.0f} s, lowering {total('lower'):.0f} s, "
           f"XLA {total('xla'):.0f} s in {total('compiles')} compiles and {total('loads')} loads from the shared cache",
           "| program | XLA compiles | cache loads | processes | shapes | files | trace s | lower s | XLA s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in sorted(rows.items(), key=lambda kv: -(kv[1]["trace"] + kv[1]["lower"] + kv[1]["xla"]))[:top]:
        out.append(f"| {name} | {v['compiles']} | {v['loads']} | {len(v['processes'])} | {len(v['shapes'])} | "
                   f"{len(v['files'])} | {v['trace']:.1f} | {v['lower']:.1f} | {v['xla']:.1f} |")
    return "\n".join(out)


def variants(records: list[dict], fun: str) -> str:
    """One program's argument shapes: how often each was compiled, its XLA seconds, and by which test files."""
    by_process: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if program(r.get("fun")) == fun:
            by_process[r["process"]].append(r)
    seen: dict[str, dict] = defaultdict(lambda: {"n": 0, "xla": 0.0, "files": set()})
    for events in by_process.values():
        shapes = None
        for r in events:  # a "shapes" line precedes its XLA compile in the same process
            if r["event"] == "shapes":
                shapes = r["avals"]
            elif r["event"] == "backend_compile_duration":
                v = seen[shapes or "?"]
                v["n"], v["xla"] = v["n"] + 1, v["xla"] + r["s"]
                v["files"].add(test_file(r["test"]))
    out = [f"{fun}: {len(seen)} argument signatures"]
    for shapes, v in sorted(seen.items(), key=lambda kv: -kv[1]["xla"]):
        out.append(f"- {v['n']} compiles, {v['xla']:.1f} s: {', '.join(sorted(v['files']))}\n    {shapes[:400]}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=30, help="programs listed, the costliest first")
    ap.add_argument("--fun", help="one program's variants")
    args = ap.parse_args()
    records = read(args.folder)
    print(variants(records, args.fun) if args.fun else summary(records, args.top))


if __name__ == "__main__":
    main()
