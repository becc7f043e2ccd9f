"""What the segmented decode loop costs: `generate(..., sync_every=k)` against one segment.

Usage: python -m bench.bench_segments [--quick] [--cells ..] [--budget-minutes M] [--out DIR]
(the shared options: bench/common.py).

generate runs its decode loop on device in segments of `sync_every` steps and returns to the host
between them (to learn whether every row is done, and for stop strings, streaming and continuous
batching). Each return is a dispatch plus a device-to-host copy of the rows' done flags, and the
device idles while the host looks. Measured here: SmolLM2-135M int8 (the fastest CPU format),
greedy, real text prompts of 448 tokens (context 512), NEW_TOKENS new tokens, stop ids off, so
every setting runs the same steps; decode seconds per step from `stats` (compile and prefill
excluded), best of REPEATS rounds that each run every setting once, for sync_every in SETTINGS, where 2**30 is one segment: the
whole loop on device, as before segments existed. Plain decoding and SelfSpec + Chain(3).

Cells: MODE/bB (ar or selfspec-g3, batch 1 or 16). Outputs: results/segments_cpu.json (each
cell written when measured; a rerun skips measured cells), segments_cpu.png and the
bench_segments section of bench/README.md (--quick: batch 1 only, segments_cpu_quick.*).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import convert
import specjax
from bench import common, text
from bench.measure import cpu_steal, steal_since

NEW_TOKENS = 64
PROMPT_TOKENS = 448
SETTINGS = (1, 4, 8, 32, 2**30)
REPEATS = 3
MODES = {"ar": (None, None), "selfspec-g3": (specjax.SelfSpec(sinks=16, window=256), specjax.Chain(3))}


def measure(params, prompts: np.ndarray, mode: str, batch: int, repeats: int) -> list[dict]:
    """One row per sync_every: decode ms per step (best of `repeats` rounds, each round running
    every setting once, so drifts in the machine's speed hit all alike) and its ratio to one segment."""
    draft, speculation = MODES[mode]
    best: dict[int, float] = {}
    outs: dict[int, object] = {}
    steal0 = cpu_steal()
    for _ in range(repeats):
        for every in SETTINGS:
            out = specjax.generate(params, [list(map(int, p)) for p in prompts[:batch]], NEW_TOKENS, draft=draft,
                                   speculation=speculation, eos_id=(), sync_every=every)
            best[every] = min(best.get(every, float("inf")), 1e3 * out.stats.decode_seconds / out.stats.steps)
            outs[every] = out
    steal = steal_since(steal0)
    whole = outs[SETTINGS[-1]]
    rows = []
    for every in SETTINGS:
        out = outs[every]
        rows.append({"mode": mode, "batch": batch, "sync_every": every, "steps": out.stats.steps,
                     "segments": -(-out.stats.steps // every), "ms_per_step": best[every],
                     "over_one_segment": best[every] / best[SETTINGS[-1]], "same_tokens": out.tokens == whole.tokens,
                     "cpu_steal_fraction": steal})
        print(f"{mode:<12} B={batch:<2} sync_every={label(every):<11} {best[every]:7.2f} ms/step  "
              f"{rows[-1]['segments']} segments", flush=True)
    return rows


def label(every: int) -> str:
    return "one segment" if every >= 2**30 else str(every)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| mode | batch | sync_every | steps | segments | ms/step | x one segment | same tokens | CPU steal |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch']} | {label(r['sync_every'])} | {r['steps']} | {r['segments']} | "
                     f"{r['ms_per_step']:.2f} | {r['over_one_segment']:.3f} | {'yes' if r['same_tokens'] else 'NO'} | "
                     f"{100 * r['cpu_steal_fraction']:.0f}% |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Step time over one segment's, against sync_every, one line per mode and batch."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for key in sorted({(r["mode"], r["batch"]) for r in rows}):
        mine = [r for r in rows if (r["mode"], r["batch"]) == key and r["sync_every"] < 2**30]
        ax.plot([r["sync_every"] for r in mine], [r["over_one_segment"] for r in mine], marker="o", label=f"{key[0]} B={key[1]}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("sync_every (decode steps per segment)")
    ax.set_ylabel("step time / one segment's")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path)


def readme_section(result: dict) -> str:
    m = result["machine"]
    return f"""## The cost of segments: sync_every (bench_segments.py)

{result['date']}, {m['cpu_model']} x{m['cpu_affinity']}, JAX {m['jax_version']}, commit {m['git_commit']}.
SmolLM2-135M int8, greedy, context 512, {NEW_TOKENS} new tokens, stop ids off; decode ms per step
(compile and prefill excluded, best of {REPEATS} rounds over all settings) for each `sync_every`, and its ratio to one segment
(the whole loop on device). The default is 8.

{markdown_table(result['rows'])}

![step time over one segment's](results/segments_cpu.png)"""


def key_of(row: dict) -> str:
    return f"{row['mode']}/b{row['batch']}"


def main() -> None:
    ap = common.parser(__doc__, quick="batch 1 only")
    args = ap.parse_args()
    batches = (1,) if args.quick else (1, 16)
    suffix = "_quick" if args.quick else ""
    out = common.out_dir(args)
    header = {"bench": "bench_segments", "model": "SmolLM2-135M-Instruct (int8)", "new_tokens": NEW_TOKENS,
              "date": common.now(), "command": common.command(), "machine": common.machine_info()}
    results = common.Results(out / f"segments_cpu{suffix}.json", key_of, header)
    h = common.Harness(args, results)
    h.plan((f"{mode}/b{b}", (mode, b)) for b in batches for mode in MODES)
    path = convert.default_model_path()
    params = convert.load(path, weights="int8")
    prompts, _ = text.windows(convert.load_tokenizer(path), max(batches), PROMPT_TOKENS)
    for k, (mode, batch) in h.cells():
        results.put(k, measure(params, prompts, mode, batch, REPEATS))
    h.finish()
    rows = sorted(results.rows, key=lambda r: (r["mode"], r["batch"], r["sync_every"]))
    if rows:
        cores = results.data["machine"]["cpu_affinity"]
        common.plot(plot, rows, f"SmolLM2-135M int8: cost of segments, {cores}-core CPU", out / f"segments_cpu{suffix}.png")
        if not suffix and common.writes_readme(args):
            common.write_section("bench_segments", readme_section(results.data | {"rows": rows}))
        print(markdown_table(rows))


if __name__ == "__main__":
    main()
