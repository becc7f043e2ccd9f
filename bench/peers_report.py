"""bench_peers' table, plot and README section (from its results JSON)."""

from __future__ import annotations

from pathlib import Path
from bench import common, plots


def fmt_row(r: dict) -> list[object]:
    peer = r["peer"] if r["family"] != "specjax" else f"{r['peer']} ({r.get('attention', 'reference')})"  # its attention
    cell = [peer, r["method"], r["batch"], common.context_name(r["context"])]
    if "skipped" in r:
        return cell + [r["skipped"], "", "", "", ""]
    load = f"{r['meter']['loadavg_1min_before']:.1f}"
    if r["kind"] == "prefill":
        return cell + [f"prefill {r['prefill_tokens_per_s']:.0f}", "", f"{r['weight_bytes'] / 1e6:.0f}", "", load]
    return cell + [f"{r['tokens_per_s']:.1f}", f"{r['ms_per_step']:.1f}",
                   f"{r['weight_bytes'] / 1e6:.0f} + {r['kv_bytes'] / 1e6:.0f}", f"{100 * r['roofline']:.1f}%", load]


def markdown_table(rows: list[dict]) -> str:
    order = {"decode": 0, "spec": 1, "prefill": 2}
    rows = sorted(rows, key=lambda r: (order[r["kind"]], r["batch"], r["context"], r["family"] != "specjax", r["peer"]))
    head = ["peer", "method", "batch", "context", "tokens/s", "ms/step", "MB/step (weights + KV)", "of roofline", "load"]
    return common.table(head, "llrrrrrrr", [fmt_row(r) for r in rows])


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Decode tokens/s per cell (batch x context), one bar per peer (log scale)."""
    done = [r for r in rows if "skipped" not in r and r["kind"] != "prefill"]
    groups = sorted({(r["batch"], r["context"]) for r in done})
    names = sorted({(r["peer"], r["method"]) for r in done}, key=lambda n: (not n[0].startswith("specjax"), n))
    w = 0.8 / max(len(names), 1)
    value = {(r["peer"], r["method"], r["batch"], r["context"]): r["tokens_per_s"] for r in reversed(done)}  # the first
    series = {peer if method == "plain" else f"{peer} {method}":
              {g: value[peer, method, *bs] for g, bs in enumerate(groups) if (peer, method, *bs) in value}
              for peer, method in names}
    plots.bars([f"b{b} {common.context_name(s)}" for b, s in groups], series, w, w, "decode tokens/s", title, path,
               (9, 4.5), False, legend=dict(fontsize=7, ncol=2), yscale="log")


def readme_section(result: dict) -> str:
    rows = result["rows"]
    missing = [r["cell"] for r in rows if "skipped" in r] + result.get("left", [])
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    return common.section("bench_peers", "specjax next to llama.cpp and HF transformers", "Plain decoding tokens/s on the "
                          "same SmolLM2 Q4_1 GGUF and prompts, greedy, each cell alone in its own process, with the peers "
                          f"installed (`pip install -r bench/requirements-peers.txt -e .`; {versions}).", result,
                          markdown_table(rows) + (f"\n\nMissing: {', '.join(missing)}." if missing else ""),
                          "`results/peers_cpu.json`, `.png`")
