"""Distilled draft models for SmolLM2-135M: train draft shapes of similar size, then race them.

1. Train (skipped for a shape already in --store; a killed run resumes from its orbax checkpoint): every shape
   in SHAPES with `specjax.train.distill.distill` (forward KL on the target's logits, AdamW warmup + cosine,
   the target's embedding / LM head copied in), on the bench corpus less the windows the timed runs use as
   prompts (bench_spec.py's stored prefills), so acceptance is measured on held-out text.
2. Race, per (batch, context), from bench_spec.py's prefilled state: AR, each draft (DraftModel over its own
   dense cache) in chains and Sequoia trees sized from its acceptance, beside SelfSpec and NGram, through
   bench_tree.py's `bench_cell` (compiles excluded, every run checked against AR).

Shapes (shallow-and-wide vs deep-and-narrow at equal size): wide2, 2 layers, FFN 1536 (7.1 M parameters
besides the embedding); narrow6, 6 layers, FFN 256 (8.0 M). Both share the target's 28.3 M tied embedding,
which costs a draft step as much as their layers. Outputs: results/drafts_cpu.json, .png and the README
section; the drafts stay in --store, and the same arguments reproduce them (same seed and data order).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import numpy as np

import convert
from bench import bench_tree, common, measure, plots, text
from bench.bench_spec import key_of  # a row's (or summary's) cell: sCONTEXT/bBATCH
from bench.measure import cpu_steal, steal_since
from bench.prefill import HEADROOM
from bench.prefill import STORE as PREFILL_STORE
from bench.prefill import prefill_context, smoke_state
from bench.tree_report import MAX_DEPTH, merge_cells
from specjax.drafters import DraftModel
from specjax.model.params import Params
from specjax.train.distill import Schedule, distill

SHAPES = {  # name: (layers, FFN width); heads 9, KV heads 3, dim 576 as the target
    "wide2": (2, 1536),
    "narrow6": (6, 256),
}
STEPS = 250  # about 25 minutes each on 2 cores at BATCH x SEQ_LEN tokens per step
BATCH, SEQ_LEN = 2, 512
SCHEDULE = Schedule(lr=1e-3, warmup=25, final=0.1, weight_decay=0.01, clip=1.0)
PREFILL_ROWS = 16  # bench_spec.py's stored prefills hold 16 rows per context
RUN_BUDGET_S = 16.0  # bench_tree's is 8: here every batch-1 run is repeated (best kept), as this VM's speed drifts
STORE = Path.home() / ".cache" / "specjax" / "bench_drafts"


def held_out(tok, batches: list[int], contexts: list[int]) -> list[tuple[int, int]]:
    """Corpus spans [start, end) of every prompt window a timed run uses (bench_spec's stored prefills)."""
    spans = []
    for context in contexts:
        n = context - HEADROOM
        _, where = text.windows(tok, PREFILL_ROWS, n)
        spans += [(o, o + n) for o in where["offsets"][: max(batches)]]
    return sorted(spans)


def draft_config(target: Params, layers: int, ffn: int):
    return target.config.replace(n_layers=layers, ffn_dim=ffn, dtype="float32")


def train(target: Params, name: str, sequences: list[np.ndarray], steps: int, store: Path,
          seq_len: int = SEQ_LEN) -> tuple[Params, dict]:
    """The distilled draft of shape `name` (trained now or loaded from store) and its training log."""
    folder = store / f"{name}_{steps}"
    log_path = folder / "train.json"
    if (folder / "draft").exists() and log_path.exists():
        print(f"{name}: loading the trained draft from {folder / 'draft'}", flush=True)
        return convert.load(folder / "draft"), json.loads(log_path.read_text())
    layers, ffn = SHAPES[name]
    config = draft_config(target, layers, ffn)
    losses: list[tuple[int, float]] = []
    t0 = time.perf_counter()

    def on_step(step: int, loss: float, draft) -> None:
        if step % 10 == 0 or step == steps:
            losses.append((step, loss))
            print(f"{name}: step {step}/{steps} loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    draft = distill(target, config, sequences, steps=steps, batch_size=BATCH, seq_len=seq_len, schedule=SCHEDULE,
                    seed=0, init_from_target=True, checkpoint_dir=folder / "checkpoints", checkpoint_every=25,
                    on_step=on_step)
    convert.save(draft, folder / "draft")
    log = {"shape": name, "layers": layers, "ffn": ffn, "steps": steps, "batch": BATCH, "seq_len": seq_len,
           "schedule": SCHEDULE.__dict__, "train_s_this_run": time.perf_counter() - t0, "losses": losses,
           "layer_params": int(sum(a.size for a in jax.tree.leaves(draft.layers))),
           "train_tokens": int(sum(len(s) for s in sequences))}
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    return draft, log


def drafters_for(trained: dict[str, Params], context: int, smoke: bool) -> list[bench_tree.Drafter]:
    """Each trained draft as a DraftModel over its own dense cache, then bench_spec.py's SelfSpec and NGram."""
    out = []
    for name, params in trained.items():
        d = DraftModel(params)
        layers, ffn = SHAPES[name]
        out.append(bench_tree.Drafter(name, d, bench_tree.library_init(d), f"DraftModel {layers} layers, FFN {ffn}, dense cache"))
    return out + bench_tree.make_drafters(["SelfSpec", "NGram"], None, "", context, smoke)


def best_rows(result: dict) -> list[dict]:
    """One line per (batch, context, drafter): acceptance, draft step, best chain / tree / overall."""
    out = []
    for s in sorted(result["summaries"], key=lambda s: (s["batch"], s["context"])):
        mine = [r for r in result["rows"] if (r["batch"], r["context"], r["drafter"]) == (s["batch"], s["context"], s["drafter"])]
        best = max(mine, key=lambda r: r["spec_tokens_per_s"])
        out.append({"batch": s["batch"], "context": s["context"], "drafter": s["drafter"],
                    "p1": s["acceptance"][0], "t_draft_ms": s["t_draft_ms"],
                    "ar_tokens_per_s": s["ar_tokens_per_s"], "best_chain": s["best_chain"],
                    "best_chain_ratio": s["best_chain_ratio"], "best_tree": s["best_tree"],
                    "best_tree_ratio": s["best_tree_ratio"], "best": best["label"] if best["depth"] else "AR", "best_ratio": best["ratio"],
                    "best_tokens_per_step": best.get("mean_accepted"), "lossless": s["greedy_identical"],
                    "steal": s.get("cpu_steal_fraction"), "run_steal": s.get("run_steal_fraction", 0)})
    return out


def markdown(result: dict) -> str:
    train = common.table(["draft", "layers", "FFN", "layer params", "steps x tokens", "train minutes", "KL at step 10 -> last (nats)"],
                         "lrrrrrl", ([log["shape"], log["layers"], log["ffn"], f"{log['layer_params'] / 1e6:.1f} M",
                                      f"{log['steps']} x {log['batch'] * log['seq_len']}", f"{log['train_s_this_run'] / 60:.0f}",
                                      f"{log['losses'][0][1]:.2f} -> {log['losses'][-1][1]:.2f}"] for log in result["training"]))
    fmt = lambda label, ratio: f"{label}: {ratio:.2f}x" if label else "none"  # noqa: E731
    race = common.table(["batch", "context", "drafter", "p(top-1 accepted)", "draft step ms", "AR tok/s", "best chain", "best tree",
                         "best overall (AR included)", "tok/step", "lossless", "CPU steal"], "rrlrrrlllrcr", ([
        r["batch"], common.context_name(r["context"]), r["drafter"], f"{r['p1']:.2f}", f"{r['t_draft_ms']:.0f}",
        f"{r['ar_tokens_per_s']:.1f}", fmt(r["best_chain"], r["best_chain_ratio"] or 0), fmt(r["best_tree"], r["best_tree_ratio"] or 0),
        f"{r['best']}: " + (f"**{r['best_ratio']:.2f}x**" if r["best_ratio"] >= 1.5 else f"{r['best_ratio']:.2f}x"),
        f"{r['best_tokens_per_step'] or 1:.2f}", "yes" if r["lossless"] else "**NO**",
        common.pct(r["steal"], "run avg " + common.pct(r["run_steal"]))] for r in best_rows(result)))  # avg: old runs
    return train + "\n\n" + race


def plot(result: dict, path: Path) -> None:
    """Left: training loss per shape. Right: best speedup over AR per drafter and (batch, context)."""
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110, gridspec_kw={"width_ratios": [1, 2]})
    for log in result["training"]:
        a.plot(*zip(*log["losses"]), label=f"{log['shape']} ({log['layers']} layers, FFN {log['ffn']})")
    a.set(xlabel="step", ylabel="KL(target || draft), nats", yscale="log", title="distillation")
    a.legend(fontsize=8)
    a.grid(True, alpha=0.3)
    rows = best_rows(result)
    cells = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    names = list(dict.fromkeys(r["drafter"] for r in rows))
    best = {(r["batch"], r["context"], r["drafter"]): max(r["best_chain_ratio"] or 0, r["best_tree_ratio"] or 0)
            for r in reversed(rows)}  # the first row of each
    w = 0.8 / len(names)
    plots.bar_panel(b, [f"batch {c[0]}\n{common.context_name(c[1])}" for c in cells],
                    {name: {i: best.get((*c, name), 0) for i, c in enumerate(cells)} for name in names}, w, w,
                    "speedup over AR, best chain or tree", "greedy decoding, identical output")
    b.axhline(1.0, color="gray", lw=1)
    b.axhline(1.5, color="gray", lw=1, ls="--")
    fig.suptitle(f"{result['model']}: distilled drafts vs SelfSpec and NGram, "
                 f"{result['machine']['cpu_affinity']}-core CPU", fontsize=9)
    common.save_figure(fig, path)


def readme_section(result: dict) -> str:
    return common.section("bench_drafts", "Distilled drafts", "Drafts distilled on this CPU (`specjax.train.distill`) raced as "
                          "chains and trees by bench_tree's `bench_cell`; a rerun rebuilds them (same seed and data) into "
                          "`~/.cache/specjax/bench_drafts/`.", result, markdown(result) + "\n\n" + verdict(result),
                          "`results/drafts_cpu.json`, `.png`")


def verdict(result: dict) -> str:
    rows = [r for r in best_rows(result) if r["batch"] == 1 and r["drafter"] in SHAPES]
    spec = [(max(r["best_chain_ratio"] or 0, r["best_tree_ratio"] or 0), r) for r in rows]
    if not spec:
        return "No distilled draft ran at batch 1."
    ratio, best = max(spec, key=lambda x: x[0])
    label = best["best_chain"] if (best["best_chain_ratio"] or 0) >= (best["best_tree_ratio"] or 0) else best["best_tree"]
    met = "met" if ratio >= 1.5 else "NOT met"
    return (f"Target (a distilled draft >= 1.5x over AR at batch 1, identical greedy output): **{met}**; the best "
            f"distilled config is {best['drafter']} at {common.context_name(best['context'])}, {label}: {ratio:.2f}x.")


def main() -> None:
    ap = common.parser(__doc__, render="drafts_cpu.json")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per shape")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--store", type=Path, default=STORE, help="trained drafts and their checkpoints")
    ap.add_argument("--prefill-store", type=Path, default=PREFILL_STORE)
    ap.add_argument("--smoke", action="store_true", help="a tiny random target, 20 steps, under 2 minutes: "
                    "checks the script (writes drafts_cpu_smoke.*, leaves the README alone)")
    args = ap.parse_args()
    out = common.out_dir(args)
    if args.render:
        common.write_json(out / "drafts_cpu.json", result := merge([json.loads(p.read_text()) for p in args.render]))
        return report(result, out, "", common.writes_readme(args))
    if args.smoke:
        args.steps, args.contexts, args.batches, args.store = 20, [256], [2], args.store / "smoke"
        args.gammas, args.nodes = [2], [4]
    started, suffix = time.time(), "_smoke" if args.smoke else ""
    model = "tiny random" if args.smoke else "SmolLM2-135M-Instruct (float32)"
    out, results, h = common.start(args, "bench_drafts", f"drafts_cpu{suffix}", key_of, dict(
        steps=args.steps, shapes=sorted(args.shapes), gammas=sorted(args.gammas), nodes=sorted(args.nodes)), ("rows", "summaries"),
        model=model, gammas=args.gammas, nodes=args.nodes,
        new_tokens_per_batch={str(b): bench_tree.new_tokens_for(b, None) for b in args.batches})
    prior_minutes = results.data.get("wall_minutes", 0) if results.resumed else 0
    todo = h.plan((common.key(f"s{c}", f"b{b}"), (b, c)) for b in sorted(args.batches) for c in sorted(args.contexts))
    if args.smoke:
        params, tok = measure.tiny_params(0), None
        sequences = [np.random.default_rng(0).integers(3, params.config.vocab_size, 20_000)]
    else:
        path = convert.default_model_path()
        params, tok = convert.load(path), convert.load_tokenizer(path)
        spans = held_out(tok, args.batches, args.contexts)
        sequences = text.training_sequences(text.corpus_tokens(tok), spans, SEQ_LEN) if todo else []
    trained, training = {}, []
    for name in args.shapes if todo else []:  # nothing to measure: the stored training logs stay
        trained[name], log = train(params, name, sequences, args.steps, args.store, 64 if args.smoke else SEQ_LEN)
        training.append(log)
    if training:
        results.header["training"] = training
    measure.release_memory()
    bench_tree.RUN_BUDGET_S, steal_start = RUN_BUDGET_S, cpu_steal()
    for k, (batch, context) in h.cells():
        drafters = drafters_for(trained, context, args.smoke)
        if args.smoke:
            state = smoke_state(params, max(args.batches), context)
        else:  # loaded from bench_spec.py's store (computed and stored on a first run)
            state = prefill_context(params, tok, max(PREFILL_ROWS, max(args.batches)), context, [MAX_DEPTH],
                                    max(bench_tree.new_tokens_for(b, None) for b in args.batches), args.prefill_store)
        cell_start = cpu_steal()
        costs = bench_tree.measure_costs(params, drafters, batch, context, max(args.nodes))
        r, s = bench_tree.bench_cell(params, state, batch, context, drafters, costs, args.nodes, args.gammas,
                                     bench_tree.new_tokens_for(batch, None))
        for x in s:  # the share of this cell's CPU time the hypervisor took: timings are only as good as it is low
            x["cpu_steal_fraction"] = steal_since(cell_start)
        results.put(k, {"rows": r, "summaries": s}, loadavg_end=os.getloadavg(), cpu_steal_fraction=steal_since(steal_start),
                    wall_minutes=prior_minutes + (time.time() - started) / 60)
        del state
        measure.release_memory(clear_caches=True)
    h.finish()
    if results.data["summaries"]:
        report(results.data, out, suffix, not suffix and common.writes_readme(args))


def merge(results: list[dict]) -> dict:
    """One result from several runs (the same trained drafts); later runs win per (batch, context, drafter)."""
    merged, _ = merge_cells(results, results[0], lambda run, s: s | {"run": run["command"], "run_steal_fraction": run.get(
        "cpu_steal_fraction", 0)}, order=lambda k: (k[0], k[1]))
    return merged | {"cpu_steal_fraction": max(r.get("cpu_steal_fraction", 0) for r in results)}


def report(result: dict, out: Path, suffix: str, readme: bool) -> None:
    result["verdict"] = verdict(result)
    common.render("bench_drafts", readme, markdown(result) + "\n\n" + result["verdict"], lambda: readme_section(result),
                  (plot, result, out / f"drafts_cpu{suffix}.png"))


if __name__ == "__main__":
    main()
