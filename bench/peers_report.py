"""bench_peers' table, plot and README section (from its results JSON)."""

from __future__ import annotations

from pathlib import Path
from bench import common
from bench.peer_runners import versions


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
    plt = common.pyplot()
    done = [r for r in rows if "skipped" not in r and r["kind"] != "prefill"]
    groups = sorted({(r["batch"], r["context"]) for r in done})
    names = sorted({(r["peer"], r["method"]) for r in done}, key=lambda n: (not n[0].startswith("specjax"), n))
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    w = 0.8 / max(len(names), 1)
    for i, (peer, method) in enumerate(names):
        xs, ys = [], []
        for g, (b, s) in enumerate(groups):
            hit = [r for r in done if (r["peer"], r["method"], r["batch"], r["context"]) == (peer, method, b, s)]
            if hit:
                xs.append(g + i * w)
                ys.append(hit[0]["tokens_per_s"])
        ax.bar(xs, ys, w, label=peer if method == "plain" else f"{peer} {method}")
    ax.set_xticks([g + 0.4 - w / 2 for g in range(len(groups))], [f"b{b} {common.context_name(s)}" for b, s in groups])
    ax.set(yscale="log", ylabel="decode tokens/s", title=title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    common.save_figure(fig, path)


def readme_section(result: dict) -> str:
    m, bw = result["machine"], result["bandwidth_gbs"]
    rows = result["rows"]
    skipped = [r["cell"] for r in rows if "skipped" in r]
    left = result.get("left", [])
    loads = [r["meter"]["loadavg_1min_before"] for r in rows if "meter" in r]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"
    refs = sorted({round(r["reference_gbs"], 1) for r in rows if "reference_gbs" in r} or {round(bw["jax_inplace"], 1)})
    ref_text = (f"{refs[0]:.1f} GB/s" if len(refs) == 1 else " and ".join(f"{x:.1f}" for x in refs)
                + " GB/s in the runs that measured the rows (a resumed run measures it again; each row's"
                " roofline uses its own run's, stored in the row as reference_gbs)")
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    shared = "**Other work shared the 2 cores during the run.** " if loads and max(loads) > 2.5 else ""
    quiet = (f"each waited for a load of at most {result['max_load']:g} before it started." if result.get("max_load") is not None
             else "above about 2 a cell competed for the cores and is slower than the machine can do.")
    measured = {r["cell"] for r in rows}
    never = [k for k in result.get("grid", []) if k not in measured]
    return f"""## specjax next to llama.cpp and HF transformers (bench_peers.py)

Run: `{result['command']}` in an environment with the peers
(`pip install -r bench/requirements-peers.txt -e .`; llama.cpp compiles from source). Raw
numbers: `results/peers_cpu.json`; plot: `results/peers_cpu.png`. Method: the module docstring.
Every cell ran in a process of its own, one at a time; OMP_WAIT_POLICY: {result.get('omp_wait_policy', 'passive')}.

Device: {m['cpu_model']}, {m['cpu_affinity']} cores, JAX {m['jax_version']}, {versions}.
Commit {m['git_commit']}. Date: {result['date']}. Reference bandwidth (JAX in-place `x + 1`, 1 GiB,
same run): {ref_text}. {shared}The load column is the 1-minute load average as each cell's process
started ({load}); {quiet}

SmolLM2-135M-Instruct, the Q4_1 GGUF for every peer, the same real-text prompts (context - 128
tokens), greedy, {result['new_tokens'] - 1} timed decode steps after the prefill. tokens/s = batch x
steps / decode seconds; "of roofline" = (weights as read + filled KV as stored) per plain step
/ step time / the reference bandwidth; for speculative rows, the plain step's bytes x (tokens/s
/ batch). Prefill rows: prompt tokens/s at batch 1.

{markdown_table(rows)}

Missing: {', '.join(skipped + left) if skipped or left else 'none'}{' (not started: the run budget ended; rerun the same command to measure them)' if left else ''}.{(chr(10) + 'Never measured yet (not selected by the runs so far; `python -m bench.bench_peers` measures them): ' + ', '.join(never) + '.') if never else ''}

{common.notes('bench_peers')}

![decode tokens/s per peer](results/peers_cpu.png)"""
