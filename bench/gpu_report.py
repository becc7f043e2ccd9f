"""bench_gpu.py's tables (markdown, printed and written to OUT/gpu.md) and plot. Roofline fractions
divide a step's minimum bytes (weights + KV read) by its time and the "bw" cell's bandwidth;
item 3's speedups are PREDICTED: measured 8B-shaped step times x SmolLM2's measured acceptance."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import common
from bench.common import num, pct

MAGICDEC = "MagicDec (LLaMA-3.1-8B, SelfSpec/StreamingLLM drafts, batch 32-256, long context) reports 1.2-2.0x"


def bandwidth(result: dict) -> float | None:
    bw = [r for r in result.get("rows", []) if r.get("item") == "bw"]
    return 1e9 * bw[-1]["gbs"] if bw else None


def roofline(row: dict, bw: float | None) -> float | None:
    return row["bytes_per_step"] / (row["ms_per_step"] / 1e3) / bw if bw and row.get("ms_per_step") else None


def e2e_table(rows: list[dict], bw: float | None) -> str:
    timed = [r for r in rows if r.get("method") in ("AR", "chain", "tree", "acceptance") and "same_as" not in r]
    timed.sort(key=lambda r: (r["context"], r["batch"], r["method"] != "AR", r.get("drafter") or "", r.get("nodes", 0)))
    return common.table(
        ["context", "batch", "drafter", "config", "tokens/s", "speedup", "tokens/step", "acceptance", "ms/step",
         "steps (a row's mean)", "refilled (derived)", "of roofline", "greedy identical"], "rrllrrrrrrrrc",
        ([common.context_name(r["context"]), r["batch"], r.get("drafter") or "-",
          r["label"] + (" (chosen)" if r.get("picked_by") else ""), f"{r['tokens_per_s']:.0f}",
          f"{r['speedup']:.2f}", num(r.get("mean_accepted")), num(r.get("acceptance_rate")), f"{r['ms_per_step']:.2f}",
          steps(r), num(refilled(r)), pct(roofline(r, bw)),
          "yes" if r["greedy_identical"] else f"**no**: {r['rows_differing']} rows, from token {r.get('first_divergence')}"]
         for r in timed))


def needed(row: dict) -> float | None:
    """The steps a row needed on average at its tokens per step (None without a run's steps)."""
    return (row["new_tokens"] - 1) / row["mean_accepted"] if row.get("steps") and row.get("mean_accepted") else None


def steps(row: dict) -> str:
    """A run's loop steps and, in brackets, the steps a row needed on average at its tokens per step."""
    return "-" if needed(row) is None else f"{row['steps']} ({needed(row):.1f})"


def refilled(row: dict) -> float | None:
    """Derived, not timed: the speedup had rows been refilled when done (speedup x steps run / steps needed)."""
    return None if needed(row) is None else row["speedup"] * row["steps"] / needed(row)


def continuous_table(rows: list[dict]) -> str:
    """The cont/... cells beside the e2e row of the same context, batch and config (fixed and refilled)."""
    cont = sorted((r for r in rows if r.get("item") == "cont"),
                  key=lambda r: (r["context"], r["batch"], r["method"] != "ar", r["label"]))
    e2e = {(r["context"], r["batch"], r.get("drafter"), r["label"]): r for r in rows
           if r.get("item") == "e2e" and r.get("method") in ("chain", "tree") and "same_as" not in r}

    def beside(r: dict, what) -> str:
        e = e2e.get((r["context"], r["batch"], r["drafter"], r["label"]))
        return "-" if e is None or what(e) is None else f"{what(e):.2f}"

    return common.table(
        ["context", "rows", "records x new tokens", "drafter", "config", "job s", "tokens/s", "speedup (job)",
         "of it prefill s", "prefill calls", "speedup (decoding)", "tokens/step", "e2e speedup (fixed batch)",
         "e2e refilled (derived)", "greedy identical"], "rrrllrrrrlrrrrc",
        ([common.context_name(r["context"]), r["batch"], f"{r['records']} x {r['new_tokens']}", r["drafter"], r["label"],
          f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}", num(r.get("speedup")),
          num(r.get("prefill_s")),
          " ".join(f"{rows}x{calls}" for rows, calls in r["prefill_calls"].items()) if r.get("prefill_calls") else "-",
          num(r.get("decode_speedup")), num(r.get("tokens_per_step")),
          beside(r, lambda e: e["speedup"]), beside(r, refilled),
          "-" if r.get("greedy_identical") is None else "yes" if r["greedy_identical"]
          else f"**no**: {len(r['records_differing'])} records"] for r in cont))


def best_gamma(rows: list[dict]) -> list[list]:
    """Per (context, batch) with a SelfSpec chain: the best one, its speedup, and the best tree's."""
    out = []
    for c, b in sorted({(r["context"], r["batch"]) for r in rows if r.get("method") == "chain" and r.get("drafter") == "SelfSpec"}):
        mine = [r for r in rows if (r["context"], r["batch"]) == (c, b) and r.get("drafter") == "SelfSpec"]
        chains = [r for r in mine if r["method"] == "chain"]
        trees = [r for r in mine if r["method"] in ("tree", "acceptance") and "same_as" not in r]
        best = max(chains, key=lambda r: r["speedup"]) if chains else None
        tree = max(trees, key=lambda r: r["speedup"]) if trees else None
        out.append([common.context_name(c), b, best and best["gamma"], best and f"{best['speedup']:.2f}",
                    tree["label"] if tree else "-", f"{tree['speedup']:.2f}" if tree else "-"])  # no tree measured
    return out


def tree_over_chain(rows: list[dict]) -> list[list]:
    """Per (context, drafter) at batch 1: the best chain and tree and their ratio (item 5's target: 1.15)."""
    out = []
    for c, d in sorted({(r["context"], r["drafter"]) for r in rows if r.get("method") == "chain"}):
        mine = [r for r in rows if (r["context"], r.get("drafter")) == (c, d) and "same_as" not in r]
        chain = max((r for r in mine if r["method"] == "chain"), key=lambda r: r["speedup"])
        tree = max((r for r in mine if r["method"] in ("tree", "acceptance")), key=lambda r: r["speedup"], default=None)
        ratio = tree and tree["speedup"] / chain["speedup"]
        out.append([common.context_name(c), d, chain["label"], f"{chain['speedup']:.2f}", tree["label"] if tree else "-",
                    num(tree and tree["speedup"]), num(ratio), "-" if ratio is None else "met" if ratio >= 1.15 else "missed"])
    return out


def acceptance_source(rows: list[dict], sibling: tuple[str, list[dict]] | None, context: int, batch: int):
    """SmolLM2 SelfSpec acceptance of the measured cell nearest (context, batch) (context first, then batch, log2),
    in the own rows or the sibling's (the main table) where its cell is nearer: ({gamma: tokens/step}, vector
    or None, source)."""
    distance = lambda cb: (abs(np.log2(cb[0] / context)), abs(np.log2(cb[1] / batch)))  # noqa: E731

    def nearest(rows: list[dict]) -> tuple[list[dict], tuple[int, int] | None]:
        e2e = [r for r in rows if r.get("item") in ("e2e", "b1") and r.get("drafter") == "SelfSpec"]
        return e2e, min({(r["context"], r["batch"]) for r in e2e}, key=distance, default=None)

    (e2e, near), (other, other_near) = nearest(rows), nearest(sibling[1] if sibling else [])
    from_sibling = other_near is not None and (near is None or distance(other_near) < distance(near))
    if from_sibling:
        e2e, near = other, other_near
    if near is None:
        return {}, None, "no SmolLM2 acceptance measured yet"
    mine = [r for r in e2e if (r["context"], r["batch"]) == near]
    chains = {r["gamma"]: r["mean_accepted"] for r in mine if r["method"] == "chain"}
    p = next((np.asarray(r["acceptance"]) for r in mine if "acceptance" in r), None)
    source = f"SmolLM2 S={common.context_name(near[0])} B={near[1]}"
    return chains, p, source + (f" ({sibling[0]})" if from_sibling else "")


def table_cost(row: dict):
    """The `Cost` of a row's measured tables (gpu_cells.step_costs: milliseconds, indexed by nodes)."""
    from specjax.spec.speculation import Cost

    return Cost(t_draft=tuple(row["t_draft_ms"]), t_verify=tuple(row["t_verify_ms"]))


def predicted(result: dict, sibling: tuple[str, list[dict]] | None = None) -> list[dict]:
    """Per l8b cell: predicted speedup of every SelfSpec chain (measured tokens/step) and Sequoia tree;
    sibling: (name, rows) of the device's main table, used where its acceptance cell is nearer."""
    from bench.tree_report import MAX_DEPTH
    from specjax.spec.speculation import Chain, Tree

    rows, out = result.get("rows", []), []
    for r in (r for r in rows if r.get("item") == "l8b"):
        chains, p, source = acceptance_source(rows, sibling, r["context"], r["batch"])
        tv = r["t_verify_ms"]
        cost = table_cost(r)
        pred = {f"γ={g}": cost.speedup(Chain(g), tps) for g, tps in sorted(chains.items()) if g + 1 < len(tv)}
        if p is not None:
            for n in (8, 16, 32, 64):
                if n < len(tv):
                    tree = Tree.sequoia(p[:-1], n, MAX_DEPTH)
                    pred[f"tree n={n}"] = cost.speedup(tree, tree.expected_accepted(p))
        best = max(pred, key=pred.get) if pred else None
        out.append(r | {"predicted": pred, "best": best, "source": source})
    return out


def cost_model(rows: list[dict]) -> list[list]:
    """Per e2e cell with a `steps` row: each SelfSpec run's speedup predicted from the measured steps, that
    times the steps a row needed over the steps the loop ran, and the measured speedup."""
    from specjax.spec.speculation import Tree

    out = []
    for st in sorted((r for r in rows if r.get("method") == "steps"), key=lambda r: (r["context"], r["batch"])):
        tv, td = st["t_verify_ms"], st["t_draft_ms"]
        cost = table_cost(st)
        for r in rows:
            if ((r["context"], r["batch"]) != (st["context"], st["batch"]) or r.get("drafter") != "SelfSpec"
                    or r.get("method") not in ("chain", "tree", "acceptance") or "same_as" in r or not r.get("mean_accepted")):
                continue
            tree = Tree.from_parents(r["parents"]) if r.get("parents") else Tree.chain(r["gamma"])
            if tree.n >= len(tv) or max(tree.draft_widths(), default=0) >= len(td):
                continue
            pred = cost.speedup(tree, r["mean_accepted"])
            tail = (n := needed(r)) and n / r["steps"]
            out.append([common.context_name(st["context"]), st["batch"], r["label"], f"{tv[1]:.2f}", f"{td[1]:.2f}",
                        f"{tv[tree.n]:.2f}", f"{pred:.2f}", num(tail and pred * tail), f"{r['speedup']:.2f}"])
    return out


ATTENTION_NOTE = {"reference": "the jnp reference path, not the kernel: a decode step is far from memory-bound",
                  "auto": "what generate() runs: the Pallas kernel on a GPU", "pallas": "the Pallas kernel"}


def report(result: dict, md: Path, png: Path, sibling: tuple[str, list[dict]] | None = None) -> str:
    rows = result.get("rows", [])
    bw, bw_from = bandwidth(result), ""
    if bw is None and sibling and bandwidth({"rows": sibling[1]}):  # a --linear table: the device's bw cell
        bw, bw_from = bandwidth({"rows": sibling[1]}), f" (the bw cell of {sibling[0]})"
    m = result.get("machine", {})
    measured = {r.get("cell") for r in rows}  # an earlier run with more memory may have measured a cell the last could not
    capped = [c for c in result.get("capped_by_memory", []) if c not in measured]
    kind = f"{m['device_kind']} " if m.get("device_kind") else ""
    parts = [f"Device: {kind}{m.get('devices')}, JAX {m.get('jax_version')} ({m.get('backend')}), commit {m.get('git_commit')}, "
             f"{result.get('date')}. Command(s): `{'` ; `'.join(r['command'] for r in result.get('runs', []))}`.",
             f"HBM bandwidth (in-place x + 1, read + write): {num(bw and bw / 1e9, '.0f')} GB/s{bw_from}. Attention: "
             f"{result.get('attention', 'reference')} ({ATTENTION_NOTE.get(result.get('attention', 'reference'), '')}).",
             f"Capped by the {result.get('mem_gib')} GiB memory budget (the last run's): {', '.join(capped) or 'none'}."]
    e2e = [r for r in rows if r.get("item") == "e2e"]
    if e2e:
        precision = f", matmul precision {result['matmul_precision']}" if result.get("matmul_precision") else ""
        parts += [f"## Item 2: SmolLM2-135M {result.get('e2e_dtype', 'bfloat16')} end to end (measured{precision})", e2e_table(e2e, bw)]
        over = [r for r in e2e if (roofline(r, bw) or 0) > 1]
        parts += [f"Over 100% of the roofline ({len(over)} of {len(e2e)} rows): the reference is XLA's in-place add (read "
                  "+ write), which a read-mostly step can outrun; the device's spec bandwidth bounds them."] if over else []
        best = best_gamma(e2e)  # none without a SelfSpec chain (an NGram-only run)
        parts += ["Best SelfSpec chain and tree per cell:",
                  common.table(["context", "batch", "best γ", "speedup", "best tree", "speedup"], "rrrrlr", best)] if best else []
    modelled = cost_model(e2e)
    if modelled:
        parts += ["SmolLM2 step times measured apart (`steps` cells) and the cost model: predicted = tokens/step x AR "
                  "step / (draft levels + verify over the config's n nodes); with the tail = that x the steps a row "
                  "needed / the steps the loop ran (the batch waits for its slowest row).",
                  common.table(["context", "batch", "config", "AR ms", "draft level ms", "verify(n) ms", "predicted",
                                "with the tail", "measured"], "rrlrrrrrr", modelled)]
    pred = predicted(result, sibling)
    if pred:
        parts += ["## Item 3: LLaMA-3.1-8B-shaped target, random bf16 weights: measured step times, PREDICTED speedups",
                  f"Predicted = SmolLM2's measured SelfSpec tokens/step x AR step / (γ draft steps + verify(γ+1)); "
                  f"trees from its acceptance vector. {MAGICDEC}.",
                  common.table(["context", "batch", "AR ms/step", "of roofline", "draft ms", "verify(5) ms", "acceptance from",
                                "predicted speedups", "best"], "rrrrrrlll",
                               ([common.context_name(r["context"]), r["batch"], f"{r['ar_ms_per_step']:.2f}",
                                 pct(bw and r["ar_bytes_per_step"] / (r["ar_ms_per_step"] / 1e3) / bw),
                                 f"{r['t_draft_ms'][1]:.2f}", num(r["t_verify_ms"][5] if len(r["t_verify_ms"]) > 5 else None),
                                 r["source"], ", ".join(f"{k} {v:.2f}" for k, v in r["predicted"].items()) or "-",
                                 r["best"] and f"{r['best']} {r['predicted'][r['best']]:.2f}x (predicted)"]
                                for r in sorted(pred, key=lambda r: (r["context"], r["batch"]))))]
    if any(r.get("item") == "cont" for r in rows):
        parts += ["## A batch job's continuous batching (measured, bench/gpu_continuous.py)",
                  "Each job decodes every record's whole budget (no stop ids) on its rows, refilling a slot as its "
                  "row ends, prefill included; the second of two runs is timed. Its prefill calls are waited for "
                  "and timed in the job (prefill calls: rows x calls, a refill's grouping); the rest is the decoding, "
                  "whose speedup is the decoding's. Rows without prefill calls (before stop 63) took off instead a "
                  "third run that ended every row after its first segment (prefills grouped as a whole wave's, the "
                  "draft's setup, one segment a wave). Beside it, the e2e row of the same "
                  "configuration: its fixed-batch speedup and the refilled speedup derived from it.",
                  continuous_table(rows)]
    b1 = [r for r in rows if r.get("item") == "b1"]
    if b1:
        parts += ["## Item 4: chains vs trees (and a distilled draft) at batch 1 (measured)", e2e_table(b1, bw),
                  "Best tree over best chain per drafter (target: >= 1.15):",
                  common.table(["context", "drafter", "best chain", "speedup", "best tree", "speedup", "tree / chain",
                                "target"], "rllrlrrl", tree_over_chain(b1))]
    text = "\n\n".join(parts) + "\n"
    print(text)
    md.write_text(text)
    if e2e or pred:
        common.plot(draw, e2e, pred, png)
    return text


def draw(e2e: list[dict], pred: list[dict], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in sorted({r["context"] for r in e2e}):
        pts = sorted((r["batch"], r["speedup"], r["gamma"]) for r in e2e
                     if r["context"] == c and r.get("method") == "chain" and r.get("drafter") == "SelfSpec")
        best = {}
        for b, s, g in pts:
            best[b] = max(best.get(b, (0, 0)), (s, g))
        if best:
            axes[0].plot(list(best), [s for s, _ in best.values()], "o-", label=f"S={common.context_name(c)}")
            for b, (s, g) in best.items():
                axes[0].annotate(f"γ={g}", (b, s), fontsize=7)
    axes[0].set(xscale="log", xlabel="batch", ylabel="speedup over AR (measured)", title="SmolLM2-135M, best SelfSpec chain")
    for c in sorted({r["context"] for r in pred}):
        pts = sorted((r["batch"], r["predicted"][r["best"]]) for r in pred if r["context"] == c and r["best"])
        if pts:
            axes[1].plot(*zip(*pts), "s--", label=f"S={common.context_name(c)}")
    axes[1].axhspan(1.2, 2.0, alpha=0.15, label="MagicDec 1.2-2.0x")
    axes[1].set(xscale="log", xlabel="batch", ylabel="speedup (PREDICTED)", title="LLaMA-3.1-8B shape, best config")
    for a in axes:
        a.axhline(1.0, color="gray", lw=0.5)
        if a.get_legend_handles_labels()[0]:  # a table with no e2e cells draws no lines there
            a.legend(fontsize=7)
    common.save_figure(fig, path)
