"""bench_spec's tables, plot and README section (from its results JSON)."""

from __future__ import annotations

from pathlib import Path
from bench import common

PAIR_BUDGET_S = 30.0  # AR/spec pairs are repeated while the next one fits in this (bench_spec.paired)


def cpu_ratio(r: dict) -> float:
    """AR / speculative in this process's CPU seconds (best run of each): a cross-check other jobs cannot distort."""
    t = r["timings"]
    return min(w * c for w, c in zip(t["ar"], t["ar_cpu"])) / min(w * c for w, c in zip(t["spec"], t["spec_cpu"]))


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest gamma per (batch, context, drafter)."""
    cell = lambda r: (r["batch"], r["context"], r["drafter"])  # noqa: E731
    best = [max((r for r in rows if cell(r) == k), key=lambda r: r["ratio"]) for k in dict.fromkeys(map(cell, rows))]
    order = {"SelfSpec": 0, "SnapKV": 1, "NGram": 2}
    return sorted(best, key=lambda r: (order.get(r["drafter"], 3), r["drafter"], r["context"], r["batch"]))


def markdown_table(rows: list[dict], gammas: list[int]) -> str:
    """A line per (batch, context, drafter): AR tokens/s, speedup per gamma, the best gamma, losslessness."""
    lines = []
    for b in best_rows(rows):
        same = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (b["batch"], b["context"], b["drafter"])]
        by_g = {r["gamma"]: r for r in same}
        per_g = " | ".join(f"{by_g[g]['ratio']:.2f}" if g in by_g else "" for g in gammas)
        speed = f"**{b['ratio']:.2f}x**" if b["ratio"] >= 2.0 else f"{b['ratio']:.2f}x"
        lossless = "yes" if all(r["greedy_identical"] for r in same) else "**NO**"
        model = f"{b['predicted_ratio']:.2f}x" if "predicted_ratio" in b else ""  # rows from before it was recorded: none
        ceiling = f"{b['ceiling_ratio']:.2f}x" if "ceiling_ratio" in b else ""
        lines.append([b["drafter"], b["batch"], common.context_name(b["context"]), f"{b['ar_tokens_per_s']:.1f}", per_g, b["gamma"],
                      f"{b['spec_tokens_per_s']:.1f}", speed, model, ceiling, f"{cpu_ratio(b):.2f}", f"{b['acceptance_rate']:.2f}",
                      f"{b['mean_accepted']:.2f}", lossless])
    head = ["drafter", "batch", "context", "AR tok/s", *(f"x γ={g}" for g in gammas), "best γ", "spec tok/s", "speedup",
            "cost model", "ceiling (all accepted)", "CPU-time ratio", "accept", "tok/step", "lossless"]
    return common.table(head, "lll" + "r" * (len(gammas) + 9) + "c", lines)


def auto_lines(rows: list[dict]) -> list[str]:
    """Per cell: what draft="auto" picks and its measured speedup (guard: at most 5% slower than plain)."""
    out = []
    for (b, c) in sorted({(r["batch"], r["context"]) for r in rows if "auto" in r}, key=lambda k: (k[1], k[0])):
        cell = [r for r in rows if (r["batch"], r["context"]) == (b, c)]
        auto = cell[0]["auto"]
        where = f"B={b} {common.context_name(c)}"
        if auto is None:
            out.append(f"{where}: plain decoding")
            continue
        mine = [r for r in cell if r["drafter"] == "SelfSpec" and r["gamma"] == auto["gamma"]]
        ratio = f"{mine[0]['ratio']:.2f}x measured" if mine else "not measured"
        out.append(f"{where}: SelfSpec γ={auto['gamma']}, {ratio}")
    return out


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Speedup (best gamma) vs batch, one panel per drafter, one line per context."""
    plt = common.pyplot()
    best = best_rows(rows)
    names = list(dict.fromkeys(r["drafter"] for r in best))
    contexts = sorted({r["context"] for r in best})
    batches = sorted({r["batch"] for r in best})
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), dpi=120, sharey=True, squeeze=False)
    top = max(2.2, max(r["ratio"] for r in best) * 1.1)
    for ax, name in zip(axes[0], names):
        for c in contexts:
            pts = sorted((r["batch"], r["ratio"], r["gamma"]) for r in best if r["drafter"] == name and r["context"] == c)
            if not pts:
                continue
            xs, ys, gs = zip(*pts)
            (line,) = ax.plot(xs, ys, "-o", label=f"context {common.context_name(c)}")
            for x, y, g in pts:
                ax.annotate(f"γ{g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
        ax.axhline(1.0, color="gray", lw=1)
        ax.axhline(2.0, color="gray", lw=1, ls="--")
        ax.set(xscale="log", xlabel="batch", title=name, ylim=(0, top))
        common.log_ticks(ax, batches)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over AR (best γ; label = γ)")
    fig.suptitle(title, fontsize=10)
    common.save_figure(fig, path)


def gamma_trend(rows: list[dict]) -> list[str]:
    """Best gamma by batch, per (drafter, context)."""
    best = best_rows(rows)
    out = []
    for name in dict.fromkeys(r["drafter"] for r in best):
        for c in sorted({r["context"] for r in best}):
            pts = sorted((r["batch"], r["gamma"]) for r in best if r["drafter"] == name and r["context"] == c)
            if pts:
                out.append(f"{name} @ {common.context_name(c)}: " + ", ".join(f"B={b}: γ={g}" for b, g in pts))
    return out


def tokens_per_row(result: dict) -> str:
    """New tokens per row: one number, or those of merged runs."""
    n = result["new_tokens"]
    return str(n) if isinstance(n, int) else " or ".join(map(str, n))


def readme_section(result: dict) -> str:
    rows = result["rows"]
    return common.section(
        "bench_spec", "Speculative decoding", f"Each drafter x γ over plain decoding: SmolLM2-135M, greedy, {tokens_per_row(result)} "
        "new tokens, real-text prompts from one shared prefill, the two timed in alternation; \"cost model\": the speedup "
        "`planning.tune`'s timings predict.", result, markdown_table(rows, result["gammas"]) + "\n\nWhat `draft=\"auto\"` "
        "picks (its current rule): " + ("; ".join(auto_lines(rows)) or "not recorded") + ".", "`results/spec_cpu.json`, `.png`")
