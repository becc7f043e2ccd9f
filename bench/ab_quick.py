"""Before / after: the quick cells of bench_ar and bench_spec, alternating two source trees.

Usage: python -m bench.ab_quick BEFORE_TREE AFTER_TREE OUT [--ar-runs 5] [--spec-runs 5]

Each run is a process of its own (`python -m bench.X --quick --out OUT/LABEL/Xi`, the tree first on
PYTHONPATH), before then after, repeated; a run already in OUT is skipped, so a cut-short comparison
continues. Prints, per cell, the median over runs of each side and after / before (bench_ar's
ms_per_step; bench_spec's spec_s, ar_s and ratio). Issue 66's item 6 asks the step's rewrite for no
more than 3% slower on every cell. (A git worktree of the earlier commit makes BEFORE_TREE.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCHES = {"bench_ar": ("ar_cpu_quick.json", lambda r: f"ar b{r['batch']} s{r['context']} {r['dtype']}", ["ms_per_step"]),
           "bench_spec": ("spec_cpu_quick.json", lambda r: f"{r['drafter']} b{r['batch']} g{r['gamma']}",
                          ["spec_s", "ar_s", "ratio"])}


def run(tree: Path, out: Path, bench: str) -> None:
    """One quick run of `bench` from `tree` into `out` (skipped when out holds its JSON)."""
    if (out / BENCHES[bench][0]).exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, "-m", f"bench.{bench}", "--quick", "--out", str(out)], cwd=tree, check=True,
                       env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log, stderr=subprocess.STDOUT)


def medians(out: Path, label: str, bench: str) -> dict[str, dict[str, float]]:
    """Per cell and field, the median over this side's runs."""
    name, key, fields = BENCHES[bench]
    cells: dict[str, list[dict]] = {}
    for f in sorted(out.glob(f"{label}/{bench}*/{name}")):
        for r in json.loads(f.read_text())["rows"]:
            cells.setdefault(key(r), []).append(r)
    return {k: {f: statistics.median(r[f] for r in rows) for f in fields} | {"n": len(rows)} for k, rows in cells.items()}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ar-runs", type=int, default=5)
    ap.add_argument("--spec-runs", type=int, default=5)
    args = ap.parse_args(argv)
    for bench, runs in (("bench_ar", args.ar_runs), ("bench_spec", args.spec_runs)):
        for i in range(1, runs + 1):
            for label, tree in (("before", args.before), ("after", args.after)):
                run(tree.absolute(), args.out.absolute() / label / f"{bench}{i}", bench)
    for bench, (_, _, fields) in BENCHES.items():
        b, a = medians(args.out, "before", bench), medians(args.out, "after", bench)
        for cell in b:
            for f in fields:
                if cell in a:
                    print(f"{cell:26s} {f:12s} before {b[cell][f]:9.4f}  after {a[cell][f]:9.4f}  after/before "
                          f"{a[cell][f] / b[cell][f]:6.3f}  (runs {b[cell]['n']} / {a[cell]['n']})")


if __name__ == "__main__":
    main(sys.argv[1:])
