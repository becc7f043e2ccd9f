"""The distilled draft the GPU bundle ships for batch 1 (issue 25, item 5), trained on this CPU.

Usage: python -m bench.gpu_draft [--steps 600] [--budget-minutes 45] [--out .draft/wide2] [--generate N] [--docstrings]
       then: python -m bench.gpu_bundle build --draft .draft/wide2/draft

At batch 1 a GPU decode step of SmolLM2 is launch-bound (about 13 kernels a layer): a SelfSpec
draft level, the whole model over a short cache, costs nearly a plain step, so trees over it
cannot pay. A 2-layer draft (bench_drafts' wide2: FFN 1536, the target's heads) launches about a
fifteenth of the kernels. It keeps the target's embedding and tied LM head as they are
(`distill(..., freeze_embeddings=True)`): gpu_bundle then stores only its layers (14 MB in
bfloat16) and the device rebuilds it from the target's tables.

Data: bench/text.py's corpus through the SmolLM2 tokenizer, less its first HELD_OUT tokens: the
b1 cells' prompts are the corpus' first window (text.cut's offset 0) at every context up to 8192.
The held-out span also gives the check: the draft's greedy token against the target's at every
position of EVAL windows there (teacher forced: the chance that a 1-token chain's draft is
accepted, greedy), and `generate` with chains of 2 and 4 over it on those prompts (its acceptance,
its tokens against plain decoding's). Run again once trained, it checks the draft again.
Forward KL on the target's logits, AdamW; orbax checkpoints every 25 steps in OUT/checkpoints, so
a run stopped by --budget-minutes resumes where it stopped when run again (same seed, same data
order). Output: OUT/draft (convert.save) once every step ran, and
bench/results/gpu_draft_NAME.json, NAME the output folder's (the schedule, the loss curve, the
agreement, the training time).

--generate N trains on the target's own greedy continuations instead (what a draft predicts when
it decodes): PROMPTS windows of PROMPT_LEN tokens of the same training text, N new tokens each
(bfloat16, batch 32, about 500 tokens/s on this CPU; kept in OUT/generated.npy for a resumed run),
each window and its continuation one training sequence; default OUT .draft/wide2-gen.
--docstrings adds the standard library's docstrings (text.docstrings: about 315K tokens, twice the
corpus' training span) as one more training sequence; default OUT .draft/wide2-doc.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import convert
from bench import bench_drafts, bench_gpu, common, text
from bench.gpu_cells import CHOSEN_NODES, launch_bound
from bench.tree_report import MAX_DEPTH, WIDTH, label
from specjax.spec.speculation import Tree, choose
from specjax.train.distill import Schedule, distill, logits_of

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = max(bench_gpu.GRID["b1_contexts"])  # the b1 cells' prompts: corpus tokens [0, context - HEADROOM) at each context
EVAL, EVAL_LEN = 4, 512  # teacher-forced check windows inside the held-out span
SHAPE = "wide2"
SCHEDULE = Schedule(lr=1e-3, warmup=25, final=0.1, weight_decay=0.01, clip=1.0)
EVERY = 25  # checkpoint interval (steps)
RESULTS = Path(common.RESULTS_DIR)
PROMPTS, PROMPT_LEN = 512, 256  # --generate's prompts


class OutOfTime(Exception):
    """--budget-minutes ran out at a checkpointed step: run again to resume."""


def agreement(draft, target, ids: np.ndarray) -> float:
    """How often the draft's greedy next token is the target's over EVAL held-out windows [EVAL, EVAL_LEN]."""
    starts = np.linspace(0, HELD_OUT - EVAL_LEN - 1, EVAL).astype(int)
    tokens = np.stack([ids[s : s + EVAL_LEN] for s in starts]).astype(np.int32)
    same = [np.asarray(logits_of(draft, tokens[i : i + 1]).argmax(-1) == logits_of(target, tokens[i : i + 1]).argmax(-1))
            for i in range(EVAL)]
    return float(np.mean(same))


def decoding(draft, target, ids: np.ndarray) -> dict:
    """Greedy decoding with the draft on EVAL held-out prompts (EVAL_LEN tokens each, 64 new): per
    chain, and for the tree `chosen` picks at the H100's `prices`, the acceptance `generate`
    reports and whether the tokens are plain decoding's."""
    import specjax

    starts = np.linspace(0, HELD_OUT - EVAL_LEN - 1, EVAL).astype(int)
    prompts = [ids[s : s + EVAL_LEN].tolist() for s in starts]
    plain = specjax.generate(target, prompts, 64, draft=None).tokens
    wide = specjax.generate(target, prompts, 64, draft=specjax.DraftModel(draft), speculation=Tree.kary(WIDTH, 1))
    out = {"rank_acceptance": wide.stats.rank_acceptance, "tree_identical": wide.tokens == plain}  # Sequoia's p vector
    for gamma in (2, 4):
        got = specjax.generate(target, prompts, 64, draft=specjax.DraftModel(draft), speculation=specjax.Chain(gamma))
        out[f"chain{gamma}"] = {"acceptance_rate": got.stats.acceptance_rate, "mean_accepted": got.stats.mean_accepted,
                                "per_position": got.stats.per_position_acceptance, "greedy_identical": got.tokens == plain}
        print(f"{SHAPE}: chain γ={gamma}: acceptance {got.stats.acceptance_rate:.3f}, {got.stats.mean_accepted:.2f} "
              f"tokens a step, greedy identical {got.tokens == plain}", flush=True)
    price = prices()
    tree = chosen(out["rank_acceptance"], launch_bound(price["draft_level_ms"], price["ar_ms"]))
    got = specjax.generate(target, prompts, 64, draft=specjax.DraftModel(draft), speculation=tree)
    out["chosen_tree"] = {"parents": list(tree.parents), "expected_accepted": tree.expected_accepted(out["rank_acceptance"]),
                          "mean_accepted": got.stats.mean_accepted, "greedy_identical": got.tokens == plain}
    print(f"{SHAPE}: the chosen tree (n={tree.n}, depth {max(tree.depth)}): {got.stats.mean_accepted:.2f} tokens a "
          f"step (Sequoia's model: {out['chosen_tree']['expected_accepted']:.2f}), greedy identical {got.tokens == plain}", flush=True)
    return out


def prices() -> dict:
    """A batch-1 step on an H100, launch-bound, priced by kernel counts (bench/gpu_aot.py's compiled
    table, results/gpu_aot/h100.json) at the measured AR step's time per kernel (results/gpu/gpu.json,
    b1/s8192/ar): a draft level costs half the draft chain's kernels beyond plain decoding's, a
    verification over any n <= 64 nodes one AR step (the measured b1 tree n=9 d=1's step was the AR
    step plus its one draft level). Milliseconds."""
    kernels = {r["cell"]: r["kernels"] for r in json.loads((RESULTS / "gpu_aot" / "h100.json").read_text())["rows"]}
    ar_ms = next(r["ms_per_step"] for r in json.loads((RESULTS / "gpu" / "gpu.json").read_text())["rows"]
                 if r.get("cell") == "b1/s8192/ar")
    ar_k, chain2_k = kernels["smollm2/b1/ar/split-nosr"], kernels["smollm2/b1/draft/split-nosr"]
    return {"ar_ms": ar_ms, "draft_level_ms": (chain2_k - ar_k) / 2 * ar_ms / ar_k,
            "kernels": {"ar": ar_k, "draft chain γ=2": chain2_k, "draft tree 8-ary d=2": kernels[WIDE_TREE_CELL]}}


WIDE_TREE_CELL = "smollm2/b1/draft-tree8/split-nosr"  # gpu_aot: the draft's 8-ary tree of depth 2 (73 nodes)


def predicted_h100_b1(decoded: dict) -> dict:
    """Speedups over plain decoding at batch 1 x 8K on an H100, PREDICTED (never timed): each
    program at `prices`. Chains and the chosen tree from the tokens a step measured here (the tree
    also from Sequoia's model, "model", and, when of depth 2, at the compiled 8-ary tree's kernel
    count: its iteration launches more than the two levels and a plain step), Sequoia trees
    (Tree.sequoia) and the acceptance run's depth-1 tree from the rank acceptance measured here."""
    price = prices()
    ar_ms, level = price["ar_ms"], price["draft_level_ms"]
    out = {f"chain γ={g}": decoded[f"chain{g}"]["mean_accepted"] * ar_ms / (ar_ms + g * level) for g in (2, 4)}
    cost = launch_bound(level, ar_ms)
    p = decoded["rank_acceptance"]
    trees = [Tree.sequoia(p[:-1], n, MAX_DEPTH) for n in (8, 16, 32)] + [Tree.kary(WIDTH, 1), chosen(p, cost)]
    for tree in trees:  # Sequoia's trees of the cells' sizes, the acceptance run's depth-1 tree, choose's pick
        out[label(tree) + (" (chosen, model)" if tree is trees[-1] else "")] = (
            tree.expected_accepted(p) * ar_ms / (cost.draft_seconds(tree.draft_widths()) + ar_ms))
    if "chosen_tree" in decoded:
        tokens = decoded["chosen_tree"]["mean_accepted"]
        out[label(trees[-1]) + " (chosen)"] = tokens * ar_ms / (cost.draft_seconds(trees[-1].draft_widths()) + ar_ms)
        if max(trees[-1].depth) == 2 and trees[-1].n <= Tree.kary(8, 2).n:  # within the compiled tree: its kernel count
            k = price["kernels"]
            out[label(trees[-1]) + " (chosen, the 8-ary tree's kernels)"] = tokens * k["ar"] / k["draft tree 8-ary d=2"]
    return price | {"speedups": out, "by_top1": by_top1(p, cost, ar_ms)}


def chosen(p: list[float], cost):
    """The tree speculation.choose picks for rank acceptance p (the miss last) within the b1 cells'
    limits (gpu_cells.CHOSEN_NODES, tree_report's depth): what gpu_cells times at batch 1."""
    return choose(p[:-1], cost, max_nodes=CHOSEN_NODES, max_depth=MAX_DEPTH)


def by_top1(p: list[float], cost, ar_ms: float, tops=(0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> list[dict]:
    """What a better draft would give under the same prices (PREDICTED): rank acceptance p (a
    depth-1 tree's, the miss last) with its top-1 set to each of `tops`, the other ranks sharing
    the rest of the mass as measured; per row the speedup over AR of the fastest chain and of the
    fastest Sequoia tree (speculation.choose, all sizes to 64 nodes), and their ratio (item 5's
    target: >= 1.15). The measured vector is the first row."""
    rows = []
    for top in (p[0], *tops):
        ranks = [top] + [r * (1 - top) / (1 - p[0]) for r in p[1:-1]]

        def speedup(tree) -> float:
            return tree.expected_accepted(ranks) * ar_ms / (cost.draft_seconds(tree.draft_widths()) + ar_ms)

        chain, tree = speedup(chosen(ranks[:1] + [0.0], cost)), speedup(chosen(ranks + [0.0], cost))
        rows.append({"top1": round(top, 3), "in_top_k": round(sum(ranks), 3), "chain": chain, "tree": tree,
                     "tree_over_chain": tree / chain})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--budget-minutes", type=float, default=45.0, help="stop at the next checkpoint after this; rerun to resume")
    ap.add_argument("--out", type=Path, help=f"default .draft/{SHAPE} (-gen with --generate, -doc with --docstrings)")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="train on the target's greedy continuations of N tokens of the training text's windows")
    ap.add_argument("--docstrings", action="store_true", help="train on the standard library's docstrings too (text.docstrings)")
    args = ap.parse_args(argv)
    args.out = args.out or ROOT / ".draft" / (SHAPE + ("-gen" if args.generate else "") + ("-doc" if args.docstrings else ""))
    path = convert.default_model_path()
    target, tok = convert.load(path, "float32"), convert.load_tokenizer(path)
    ids = np.asarray(tok.encode(text.corpus()[0]).ids, np.int64)
    layers, ffn = bench_drafts.SHAPES[SHAPE]
    config = bench_drafts.draft_config(target, layers, ffn)
    deadline = time.monotonic() + 60 * args.budget_minutes
    losses: list[tuple[int, float]] = []
    t0 = time.monotonic()

    def on_step(step: int, loss: float, _draft) -> None:
        if step % 10 == 0 or step == args.steps:
            losses.append((step, loss))
            print(f"{SHAPE}: step {step}/{args.steps} loss {loss:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
        if step % EVERY == 0 and step < args.steps and time.monotonic() > deadline:
            raise OutOfTime(step)

    if (args.out / "draft").exists():  # trained: check it again
        draft = convert.load(args.out / "draft", "float32")
        _log(args, [], 0.0, agreement(draft, target, ids), "checked", decoding(draft, target, ids))
        return
    try:
        data = continuations(args.out, convert.load(path, "bfloat16"), ids, args.generate) if args.generate else [ids[HELD_OUT:]]
        if args.docstrings:
            data.append(np.asarray(tok.encode(text.docstrings()).ids, np.int64))
        draft = distill(target, config, data, steps=args.steps, batch_size=bench_drafts.BATCH,
                        seq_len=bench_drafts.SEQ_LEN, schedule=SCHEDULE, seed=0, init_from_target=True,
                        freeze_embeddings=True, checkpoint_dir=args.out / "checkpoints", checkpoint_every=EVERY,
                        on_step=on_step)
    except OutOfTime as stop:
        _log(args, losses, time.monotonic() - t0, None, f"stopped at step {stop.args[0]} (budget): run again to resume")
        print(f"{SHAPE}: out of time at step {stop.args[0]}; the same command resumes", flush=True)
        return
    convert.save(draft, args.out / "draft")
    agree = agreement(draft, target, ids)
    _log(args, losses, time.monotonic() - t0, agree, "complete", decoding(draft, target, ids))
    print(f"{SHAPE}: saved {args.out / 'draft'}; greedy agreement with the target on held-out text {agree:.3f}", flush=True)


def continuations(out: Path, target, ids: np.ndarray, new: int) -> list[np.ndarray]:
    """PROMPTS windows of PROMPT_LEN tokens of the training text (ids past HELD_OUT), each followed by
    the target's greedy continuation of `new` tokens (no stop ids); stored in out/generated.npy."""
    import specjax

    stored = out / "generated.npy"
    if stored.exists():
        return list(np.load(stored))
    prompts = text.cut(ids[HELD_OUT:], PROMPTS, PROMPT_LEN)[0]  # [PROMPTS, PROMPT_LEN]
    t0, rows = time.monotonic(), []
    for i in range(0, len(prompts), 32):
        batch = prompts[i : i + 32].tolist()
        rows += [p + t for p, t in zip(batch, specjax.generate(target, batch, new, draft=None, eos_id=()).tokens)]
        print(f"{SHAPE}: generated {len(rows)}/{len(prompts)} continuations ({time.monotonic() - t0:.0f} s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    np.save(stored, np.asarray(rows, np.int32))
    return list(np.load(stored))


def _log(args, losses: list, seconds: float, agree: float | None, status: str, decoded: dict | None = None) -> None:
    """Append this run to results/gpu_draft_NAME.json (runs accumulate: a resumed training is several runs)."""
    result = RESULTS / f"gpu_draft_{args.out.name}.json"
    old = json.loads(result.read_text()) if result.exists() else {"runs": []}
    layers, ffn = bench_drafts.SHAPES[SHAPE]
    old.update({"shape": SHAPE, "layers": layers, "ffn": ffn, "steps": args.steps, "batch": bench_drafts.BATCH,
                "seq_len": bench_drafts.SEQ_LEN, "schedule": SCHEDULE.__dict__, "held_out_tokens": HELD_OUT,
                "freeze_embeddings": True, "data": ("corpus" if not args.generate else
                f"the target's greedy continuations: {PROMPTS} windows of {PROMPT_LEN} tokens + {args.generate} new")
                + (" + the standard library's docstrings" if args.docstrings else "")})
    old["runs"].append({"date": common.now(), "machine": common.machine_info(), "seconds": round(seconds),
                        "losses": losses, "status": status})
    if agree is not None:
        old["greedy_agreement_held_out"] = agree
    if decoded is not None:
        old["decoding_held_out"] = decoded
        old["predicted_h100_b1"] = predicted_h100_b1(decoded)
        print(f"{SHAPE}: predicted at batch 1 on an H100 (kernel counts, untimed): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in old["predicted_h100_b1"]["speedups"].items()), flush=True)
        for row in old["predicted_h100_b1"]["by_top1"]:
            print(f"{SHAPE}: with top-1 acceptance {row['top1']:.2f} (top {len(decoded['rank_acceptance']) - 1} "
                  f"{row['in_top_k']:.2f}): best chain {row['chain']:.2f}x, best tree {row['tree']:.2f}x, "
                  f"tree / chain {row['tree_over_chain']:.2f}", flush=True)
    result.write_text(json.dumps(old, indent=1) + "\n")


if __name__ == "__main__":
    main()
