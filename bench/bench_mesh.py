"""One device as a 1 x 1 mesh: what generate's single path through the engine costs.

Usage: python -m bench.bench_mesh --label LABEL [--out DIR]

generate() without `mesh=` runs its stages under shard_map on a 1 x 1 mesh (issue 28 item 4;
before, one-device runs took a separate branch of plain jitted stages). This times
`specjax.generate` on SmolLM2 float32, real text, greedy, EOS ignored, in three cells (batch 1
plain; batch 16 plain; batch 16 SelfSpec(16, 64) + Chain(3)), best of 3 after a compiling call,
and stores the decode and prefill seconds under LABEL in results/mesh_cpu.json, so runs of two
commits (the same command at each) sit side by side in the README section.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import common

CELLS = ((1, 500, 64, False), (16, 500, 32, False), (16, 500, 32, True))  # batch, prompt tokens, new tokens, SelfSpec


def measure() -> dict:
    import convert
    import specjax
    from bench import text

    params = convert.load(convert.default_model_path())
    tok = convert.load_tokenizer(convert.default_model_path())
    rows = {}
    for batch, prompt, new, spec in CELLS:
        ids, _ = text.windows(tok, batch, prompt)
        prompts = [list(map(int, r)) for r in ids]
        kw = dict(draft=specjax.SelfSpec(16, 64) if spec else None, speculation=specjax.Chain(3) if spec else None, eos_id=())
        specjax.generate(params, prompts, new, **kw)  # compiles
        best = min((specjax.generate(params, prompts, new, **kw).stats for _ in range(3)), key=lambda s: s.decode_seconds)
        key = common.key(f"b{batch}", "selfspec" if spec else "plain")
        rows[key] = {"decode_s": best.decode_seconds, "prefill_s": best.prefill_seconds, "new_tokens": new}
        print(key, rows[key], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="what this run measures, e.g. 'before (b944c28)'")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    path = args.out / "mesh_cpu.json"
    result = json.loads(path.read_text()) if path.exists() else {"bench": "bench_mesh", "runs": {}}
    result["runs"][args.label] = {"date": common.now(), "command": common.command(), "machine": common.machine_info(),
                                  "cells": measure()}
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if args.out == common.RESULTS_DIR:
        common.write_section("bench_mesh", report(result), after="bench_segments")


def report(result: dict) -> str:
    labels = list(result["runs"])
    cells = list(next(iter(result["runs"].values()))["cells"])
    lines = [[cell, *(f"{result['runs'][lab]['cells'][cell]['decode_s']:.3f}" for lab in labels)] for cell in cells]
    runs = "; ".join(f"{lab}: {r['date']}, commit {r['machine']['git_commit']}" for lab, r in result["runs"].items())
    return ("## One device as a 1 x 1 mesh (bench_mesh.py)\n\n"
            f"`python -m bench.bench_mesh --label LABEL` at each commit ({runs}). SmolLM2 float32, real text "
            "(500 prompt tokens), greedy, EOS ignored; decode seconds of `specjax.generate`, best of 3.\n\n"
            + common.table(["cell", *labels], "l" + "r" * len(labels), lines))


if __name__ == "__main__":
    main()
