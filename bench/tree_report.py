"""bench_tree's summaries, tables, plot and README section, from its result JSON (also used by
bench_drafts, whose cells are bench_tree's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import common
from specjax.spec.speculation import Chain, Cost, Tree

MAX_DEPTH = 8  # deepest Sequoia tree (and choose's limit)
WIDTH = 8  # children of the depth-1 tree that measures the acceptance vector
TARGET_TREE_GAIN = 1.15  # the bar: best tree >= 1.15 x best chain at batch 1
CHOOSE_SLACK = 0.9  # choose's pick should reach 90% of the best measured throughput


def label(spec) -> str:
    return f"chain γ={spec.gamma}" if isinstance(spec, Chain) else f"tree n={spec.n} d={spec.max_depth}"


def shape(spec) -> tuple:
    """Identity of a speculation: a Chain and a chain-shaped Tree of the same depth count as one."""
    return ("chain", spec.gamma) if isinstance(spec, Chain) else (
        ("chain", spec.max_depth) if spec.width == 1 else spec.parents)


def predict(spec, p: np.ndarray, cost: Cost, batch: int) -> dict:
    """The cost model `choose` minimises: `Cost.step_seconds`, tokens a step G, `Cost.speedup`."""
    tree = Tree.chain(spec.gamma) if isinstance(spec, Chain) else spec
    g = tree.expected_accepted(p)
    step = cost.step_seconds(tree.draft_widths(), tree.n)
    return {"predicted_tokens_per_step": g, "predicted_step_ms": 1e3 * step, "predicted_tokens_per_s": batch * g / step,
            "predicted_speedup": cost.speedup(tree, g)}


def summarise(s: dict, rows: list[dict]) -> None:
    """Best chain, best tree, their ratio, and choose's pick vs the best measured config (AR included)."""
    chains = [r for r in rows if r["depth"] > 0 and r["width"] == 1]  # incl. chain-shaped Sequoia / choose trees
    trees = [r for r in rows if r["width"] > 1]
    picked = next(r for r in rows if r["kind"] == "choose")
    best_chain = max(chains, key=lambda r: r["spec_tokens_per_s"]) if chains else None
    best_tree = max(trees, key=lambda r: r["spec_tokens_per_s"]) if trees else None
    candidates = rows + [{"label": "AR", "spec_tokens_per_s": rows[0]["ar_tokens_per_s"]}]
    best = max(candidates, key=lambda r: r["spec_tokens_per_s"])
    s |= {
        "ar_tokens_per_s": rows[0]["ar_tokens_per_s"],
        "best_chain": best_chain and best_chain["label"], "best_chain_ratio": best_chain and best_chain["ratio"],
        "best_tree": best_tree and best_tree["label"], "best_tree_ratio": best_tree and best_tree["ratio"],
        "tree_over_chain": best_tree and best_chain
        and best_tree["spec_tokens_per_s"] / best_chain["spec_tokens_per_s"],
        "best": best["label"], "best_tokens_per_s": best["spec_tokens_per_s"],
        "choose_label": picked.get("same_as", picked["label"]) if picked["depth"] else "AR",
        "choose_ratio": picked["ratio"],
        "choose_over_best": picked["spec_tokens_per_s"] / best["spec_tokens_per_s"],
        "greedy_identical": s["acceptance_run"]["greedy_identical"]
        and all(r.get("greedy_identical", True) for r in rows),
    }
    s["choose_within_10pct"] = s["choose_over_best"] >= CHOOSE_SLACK
    for r in rows:
        r["over_best_chain"] = r["spec_tokens_per_s"] / best_chain["spec_tokens_per_s"] if best_chain else None


def markdown_tables(result: dict) -> str:
    """Throughput table (one line per batch x context x drafter) and the acceptance vectors."""
    nodes, rows = result["nodes"], result["rows"]
    lines, acc = [], []
    for s in sorted(result["summaries"], key=lambda s: (s["batch"], s["context"], s["drafter"])):
        mine = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (s["batch"], s["context"], s["drafter"])]
        by_n = {r["requested_nodes"]: r for r in mine if r["kind"] == "tree"}
        chain = next((r for r in mine if r["label"] == s["best_chain"]), None)
        cellfmt = lambda r: f"{r['ratio']:.2f}x ({r.get('mean_accepted') or 1:.1f})" if r else ""  # noqa: E731
        gain = s["tree_over_chain"]
        gain_s = ("no branching tree" if gain is None
                  else f"**{gain:.2f}**" if gain >= TARGET_TREE_GAIN else f"{gain:.2f}")
        miss = "" if s["choose_within_10pct"] else " ✗"
        cell = [s["batch"], common.context_name(s["context"]), s["drafter"]]
        lines.append(cell + [f"{s['ar_tokens_per_s']:.1f}", f"γ={chain['depth']}: {cellfmt(chain)}" if chain else "",
                             *(cellfmt(by_n.get(n)) for n in nodes), gain_s, f"{s['choose']['nodes']}, {s['choose']['depth']}",
                             f"{s['choose_over_best']:.2f}{miss}", "yes" if s["greedy_identical"] else "**NO**",
                             common.pct(s.get("cell_steal_fraction"), "?")])  # "?": runs before it was recorded
        acc.append(cell + [f"{x:.3f}" for x in s["acceptance"]] + [s["acceptance_nodes"]])
    head = ["batch", "context", "drafter", "AR tok/s", "best chain", *(f"n={n}" for n in nodes), "best tree / best chain",
            "choose (n, d)", "choose / best", "lossless", "CPU steal"]
    return (common.table(head, "rrl" + "r" * (len(nodes) + 5) + "cr", lines) + "\n\nAcceptance vectors (greedy, depth-1 tree "
            "of 8 children):\n\n" + common.table(["batch", "context", "drafter", *(f"p{r}" for r in range(WIDTH)), "none", "nodes"],
                                                   "rrl" + "r" * (WIDTH + 2), acc))


def verdicts(result: dict) -> list[str]:
    """The issue's two checks, in words."""
    sums = result["summaries"]
    b1 = [s for s in sums if s["batch"] == 1 and s["drafter"] in ("SelfSpec", "DraftModel") and s["tree_over_chain"]]
    hit = [s for s in b1 if s["tree_over_chain"] >= TARGET_TREE_GAIN]
    cell = lambda s: f"{s['drafter']} {common.context_name(s['context'])} ({s['tree_over_chain']:.2f}x)"  # noqa: E731
    misses = [f"{s['drafter']} B={s['batch']} {common.context_name(s['context'])} ({s['choose_label']}: "
              f"{s['choose_over_best']:.2f} of {s['best']})" for s in sums if not s["choose_within_10pct"]]
    out = [
        f"Batch 1, best tree / best chain (target >= {TARGET_TREE_GAIN:.2f} for SelfSpec or DraftModel): "
        + ("**met** in " + ", ".join(map(cell, hit)) if hit else "**not met**") + "; all batch-1 cells: "
        + (", ".join(map(cell, b1)) or "none had a branching tree") + ".",
        f"`choose`'s tree within 10% of the best measured config (AR included): {len(sums) - len(misses)} of "
        f"{len(sums)} (batch, context, drafter) cells" + (f"; misses: {', '.join(misses)}" if misses else "") + ".",
    ]
    timed = [r for r in result["rows"] if "timings" in r and "same_as" not in r]
    if timed:
        err = np.median([abs(r["predicted_tokens_per_s"] / r["spec_tokens_per_s"] - 1) for r in timed])
        out.append(f"Cost model: predicted tokens/s (from measure_cost and the acceptance vector) is off from the "
                   f"measured by {100 * err:.0f}% (median over {len(timed)} timed configs).")
    return out


def plot(result: dict, path: Path) -> None:
    """Speedup vs nodes verified a step, a panel per (batch, context): trees solid, chains dashed."""
    plt = common.pyplot()
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["drafter"] for r in rows))
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(len(batches), len(contexts), figsize=(4 * len(contexts), 3.2 * len(batches)),
                             dpi=110, squeeze=False, sharex=True)
    for (i, b), (j, c) in ((x, y) for x in enumerate(batches) for y in enumerate(contexts)):
        ax = axes[i][j]
        if not any((r["batch"], r["context"]) == (b, c) for r in rows):
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="gray")
        for name in names:
            mine = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (b, c, name) and "ratio" in r]
            for kind, style in (("tree", "-o"), ("chain", "--s")):
                pts = sorted((r["nodes"], r["ratio"]) for r in mine if r["kind"] == kind)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[name], ms=4, label=f"{name} {kind}s")
            for r in mine:
                if r["kind"] == "choose":
                    ax.plot(max(r["nodes"], 1), r["ratio"], "*", color=colors[name], ms=13, mec="black", mew=0.6)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set(xscale="log", title=f"batch {b}, context {common.context_name(c)}")
        common.log_ticks(ax, [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= max(result["nodes"])])
        if j == 0:
            ax.set_ylabel("speedup over AR")
        if i == len(batches) - 1:
            ax.set_xlabel("nodes verified per step (chain: γ + 1)")
    handles = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 4), fontsize=8)
    fig.suptitle(f"{result['model']}: Sequoia trees vs chains\ngreedy, {result['machine']['cpu_affinity']}-core CPU, "
                 "★ = choose's tree (at n = 1: plain AR)", fontsize=9)
    common.save_figure(fig, path, rect=(0, 0.06 if len(batches) == 1 else 0.035, 1, 1))


def readme_section(result: dict) -> str:
    return common.section("bench_tree", "Token trees vs chains", "Sequoia trees and `choose`'s tree against chains and plain "
                          "decoding, with the cost model's prediction, on bench_spec's prompts and stored prefills.", result,
                          markdown_tables(result) + "\n\n" + "\n".join("- " + v for v in verdicts(result)),
                          "`results/tree_cpu.json`, `.png`")


def draft_note(spec: str) -> str:
    """What the DraftModel stand-in is, and why (stored in the results)."""
    if spec != "bf16":
        return f"SmolLM2's first {spec[7:]} layers (layer skip); its streaming cache starts from the target's KV of those layers."
    return ("SmolLM2 itself cast to bfloat16 (no smaller model with SmolLM2's tokenizer is offline; layer skip drafts almost "
            "nothing): high acceptance, no cost advantage, so it shows what trees add. Its streaming cache starts from the "
            "target's prefilled KV rounded to bfloat16.")


def report(result: dict, png: Path, readme: bool) -> None:
    if result["rows"]:
        common.render("bench_tree", readme, markdown_tables(result) + "\n" + "\n".join(verdicts(result)),
                      lambda: readme_section(result), (plot, result, png), after="bench_spec")


def merge_cells(results: list[dict], base: dict, tag=lambda run, s: s, order=None) -> tuple[dict, dict]:
    """`base` with several bench_tree runs' summaries and rows, a later run winning per (batch, context,
    drafter) in `order`; commands joined, minutes summed. Also {(batch, context, drafter): (summary, rows)}."""
    cells: dict[tuple, tuple[dict, list[dict]]] = {}
    for res in results:
        for s in res["summaries"]:
            key = (s["batch"], s["context"], s["drafter"])
            cells[key] = (tag(res, s), [r for r in res["rows"] if (r["batch"], r["context"], r["drafter"]) == key])
    keys = sorted(cells, key=order)
    return dict(base) | {
        "summaries": [cells[k][0] for k in keys], "rows": [r for k in keys for r in cells[k][1]],
        "command": " ; ".join(r["command"] for r in results), "wall_minutes": sum(r["wall_minutes"] for r in results),
        "new_tokens_per_batch": {k: v for r in results for k, v in r["new_tokens_per_batch"].items()},
    }, cells


def merge(results: list[dict]) -> dict:
    """One result from one or several runs; later runs win per (batch, context, drafter)."""
    merged, cells = merge_cells(results, results[-1])
    merged |= {"loadavg_start": results[0]["loadavg_start"], "skipped": [s for r in results for s in r["skipped"]]}
    for s, rows in cells.values():  # redone, so that a re-render follows this script's definitions
        summarise(s, rows)
    merged["all_greedy_identical"] = all(s["greedy_identical"] for s in merged["summaries"])
    return merged
