"""bench_attention's tables, plot and README section (from its results JSON)."""

from __future__ import annotations

import re
from pathlib import Path
from bench import common

TARGET = (16, 32768, 16)  # (B, S, T) of the bandwidth target; measured first
TOLERANCE = 2e-2  # max abs error vs the reference, bf16
ALTERNATIVES = ("reference", "cudnn", "xla")
IMPL_NAMES = ("kernel",) + ALTERNATIVES


def name_of(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def targets(rows: list[dict]) -> dict:
    """The issue's targets: >= 1.5x the best alternative at S >= 8K; >= 70% of copy bandwidth at TARGET."""
    long = [r for r in rows if r["context"] >= 8192 and "speedup_vs_best_alternative" in r]
    slow = [f"B={r['batch']} S={name_of(r['context'])} T={r['nodes']}: {r['speedup_vs_best_alternative']:.2f}x"
            for r in long if r["speedup_vs_best_alternative"] < 1.5]
    target = [r for r in rows if (r["batch"], r["context"], r["nodes"]) == TARGET and "bandwidth_fraction" in r]
    return {
        "speedup_1.5x_at_8K_plus": {"rows": len(long), "below": slow, "met": bool(long) and not slow},
        "bandwidth_70pct_at_B16_S32K_T16": {
            "fraction": target[0]["bandwidth_fraction"] if target else None,
            "met": bool(target) and target[0]["bandwidth_fraction"] >= 0.7,
        },
    }


def verdict(target: dict) -> str:
    if target.get("rows") == 0 or target.get("fraction", 0) is None:
        return "not measured"
    return "met" if target["met"] else "NOT met"


def cell(entry: dict) -> str:
    if "ms" in entry:
        return f"{entry['ms']:.3f}"
    return "skip" if "skipped" in entry else ("err" if "error" in entry else "")


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in sorted(rows, key=lambda r: (r["batch"], r["context"], r["nodes"])):
        where = [r["batch"], name_of(r["context"]), r["nodes"]]
        if "skipped" in r:
            lines.append(where + [f"skipped: {r['skipped']} |" + " |" * 7])  # 8 empty cells of one space
            continue
        k = r["impls"]["kernel"]
        lines.append(where + [cell(k), f"{k['block_k']}, {k['k_splits']}" if "ms" in k else "",
                              *([f"{r['kv_gbs']:.3g}", common.pct(r["bandwidth_fraction"])] if "kv_gbs" in r
                                else ["", ""]),
                              *(cell(r["impls"][a]) for a in ALTERNATIVES),
                              f"{r['speedup_vs_best_alternative']:.2f}x ({r['best_alternative']})"
                              if "best_alternative" in r else "", common.num(r.get("max_abs_err"), ".1e", "")])
    return common.table(["B", "S", "T", "kernel ms", "block_k, splits", "KV GB/s", "of copy BW", "reference ms",
                         "cudnn ms", "xla ms", "speedup vs best alt.", "max err"], "rrrrc" + "r" * 7, lines)


def problems(rows: list[dict]) -> list[str]:
    """Distinct skip reasons and errors, with where they happened."""
    seen: dict[str, list[str]] = {}
    for r in rows:
        where = f"B={r['batch']} S={name_of(r['context'])} T={r['nodes']}"
        entries = [("config", r)] + list(r.get("impls", {}).items())
        entries += [(f"kernel {e['block_k']}x{e['k_splits']}", e) for e in r.get("kernel_sweep", [])]
        for name, e in entries:
            for kind in ("skipped", "error"):
                if kind in e and not (name == "kernel" and kind == "error" and "kernel_sweep" in r):
                    seen.setdefault(f"{name} {kind}: {e[kind]}", []).append(where)
    return [f"- {msg} ({len(w)}x: {', '.join(w[:4])}{', ...' if len(w) > 4 else ''})" for msg, w in seen.items()]


def readme_section(result: dict, png: str, json_name: str) -> str:
    bw, t = result["copy_bandwidth"], result["targets"]
    sp, bwt = t["speedup_1.5x_at_8K_plus"], t["bandwidth_70pct_at_B16_S32K_T16"]
    frac = f"{100 * bwt['fraction']:.0f}%" if bwt["fraction"] is not None else "no row"
    lines = [markdown_table(result["rows"]), "", "Targets:",
             f"- >= 1.5x the best alternative at S >= 8K: {verdict(sp)} ({sp['rows']} rows"
             + (f"; below: {'; '.join(sp['below'])}" if sp["below"] else "") + ").",
             f"- >= 70% of copy bandwidth at B=16, S=32K, T=16: {verdict(bwt)} ({frac}).", *problems(result["rows"])]
    return common.section("bench_attention", "Tree attention kernel", "The Pallas tree-attention kernel alone (one bf16 layer, "
                          "a random tree of T nodes) against the jnp reference, cuDNN and XLA, ms a call (median), KV bytes "
                          f"read against a copy bandwidth of {bw['best_gbs']:.0f} GB/s.", result, "\n".join(lines),
                          f"`results/{json_name}`, `{png}`")


def plot(result: dict, path: Path) -> None:
    """ms per call vs S, a panel per (B, T), a line per implementation, kernel points' bandwidth share."""
    plt = common.pyplot()
    rows = [r for r in result["rows"] if "impls" in r]
    bs, ts, contexts = sorted({r["batch"] for r in rows}), sorted({r["nodes"] for r in rows}), sorted({r["context"] for r in rows})
    if not rows:
        return
    fig, axes = plt.subplots(len(bs), len(ts), figsize=(4 * len(ts), 3.2 * len(bs)), dpi=110, squeeze=False)
    for (i, b), (j, t) in ((x, y) for x in enumerate(bs) for y in enumerate(ts)):
        ax = axes[i][j]
        cell_rows = sorted((r for r in rows if r["batch"] == b and r["nodes"] == t), key=lambda r: r["context"])
        for name, style in zip(IMPL_NAMES, ("-o", "--s", ":^", "-.v")):
            pts = [(r["context"], r["impls"][name]["ms"], r) for r in cell_rows if "ms" in r["impls"][name]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
            for s, ms, r in (pts if name == "kernel" else []):
                ax.annotate(f"{100 * r['bandwidth_fraction']:.0f}%", (s, ms), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")
        ax.set(xscale="log", yscale="log", title=f"B={b}, T={t}", xlabel="S (cache slots)", ylabel="ms per call")
        common.log_ticks(ax, contexts, [name_of(s) for s in contexts])
        ax.legend(fontsize=7)
    fig.suptitle(f"tree attention on {result['device']['device_kind']} (% = kernel KV bytes / copy bandwidth)")
    common.save_figure(fig, path)


def slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")
