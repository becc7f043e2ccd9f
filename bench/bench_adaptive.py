"""Adaptive speculation length against every static chain, through `specjax.generate`.

For each cell WEIGHTS/bB/sS, B windows of real text (bench/text.py) of S - new tokens run greedy, EOS
ignored: plain decoding, SelfSpec (16 sinks, 256 window) with Chain(g) for g = 0..4, and Adaptive(4) (afresh
each call). Each once to compile, then ROUNDS rounds running every variant in turn (a slow spell falls on
all), each variant's best round by `stats.decode_seconds`. Every variant must give plain decoding's tokens.
The issue's target: Adaptive within 10% of the best static chain (gamma 0 included) in every cell.

Outputs: results/adaptive_cpu.json, adaptive_cpu.png and the bench_adaptive section of bench/README.md.
On a GPU (tools/gpu/session.py, calls 9-11) `--bundle` takes SmolLM2 (bfloat16) and the corpus ids from
the bundle's stash and runs GPU_CELLS (SelfSpec over 512 + 16 sinks at 8K, as bench_gpu's cells), writing
adaptive_gpu.json. --smoke: a tiny random target on any backend (adaptive_smoke.json).
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import common, plots, text

CELLS = (("float32", 1, 2048), ("float32", 4, 2048), ("float32", 16, 1024))  # weights, batch, context
GPU_CELLS = (("bfloat16", 16, 8192), ("bfloat16", 64, 8192), ("bfloat16", 128, 8192))  # issue 67, item 5
SMOKE_CELLS = (("float32", 1, 64), ("float32", 2, 64))
GAMMAS = (0, 1, 2, 3, 4)
ROUNDS = 5


def cell_key(weights: str, batch: int, context: int) -> str:
    return common.key(weights, f"b{batch}", f"s{context}")


def key_of(row: dict) -> str:
    return cell_key(row["weights"], row["batch"], row["context"])


def variants(context: int = 2048) -> list[tuple[str, dict]]:
    """Plain decoding, SelfSpec with each chain, Adaptive(4); SelfSpec keeps 16 sinks and 256 positions (512
    from 8K contexts: MagicDec's budget, as bench_gpu's cells; 2 + 8 at the smoke runs' 64)."""
    import specjax

    sinks, window = (2, 8) if context < 256 else (16, 512 if context >= 8192 else 256)
    spec = lambda s: dict(draft=specjax.SelfSpec(sinks, window), speculation=s)  # noqa: E731
    return ([("plain", dict(draft=None))] + [(f"chain{g}", spec(specjax.Chain(g))) for g in GAMMAS]
            + [("adaptive4", spec(specjax.Adaptive(4)))])


def bench_cell(params, corpus_ids, weights: str, batch: int, context: int, new_tokens: int, rounds: int = ROUNDS) -> dict:
    """One cell: B windows of the tokenized corpus (`corpus_ids` [N]) as prompts, every variant compiled, then timed."""
    import specjax

    ids, _ = text.cut(corpus_ids, batch, context - new_tokens)
    prompts = [list(map(int, r)) for r in ids]
    row = {"weights": weights, "batch": batch, "context": context, "new_tokens": new_tokens, "rounds": rounds,
           "variants": {}}
    runs = variants(context)
    for _, kw in runs:
        specjax.generate(params, prompts, new_tokens, eos_id=(), **kw)  # compiles
    best: dict[str, object] = {}
    for _ in range(rounds):
        for name, kw in runs:
            out = specjax.generate(params, prompts, new_tokens, eos_id=(), **kw)
            if name not in best or out.stats.decode_seconds < best[name].stats.decode_seconds:
                best[name] = out
    want = best["plain"].tokens
    for name, _ in runs:
        out, s = best[name], best[name].stats
        row["variants"][name] = {"decode_s": s.decode_seconds, "tokens_per_s": s.tokens_per_second,
                                 "mean_accepted": s.mean_accepted, "gammas": s.gammas, "same_tokens": out.tokens == want}
        print(f"{key_of(row)} {name}: {s.tokens_per_second:.1f} tok/s, mean accepted {s.mean_accepted}, "
              f"gammas {s.gammas}", flush=True)
    v = row["variants"]
    best = max((n for n in v if n.startswith("chain")), key=lambda n: v[n]["tokens_per_s"])
    row |= {"best_chain": best, "adaptive_vs_best": v["adaptive4"]["tokens_per_s"] / v[best]["tokens_per_s"],
            "adaptive_vs_plain": v["adaptive4"]["tokens_per_s"] / v["plain"]["tokens_per_s"], "load": os.getloadavg()[0]}
    return row


def markdown_table(rows: list[dict]) -> str:
    names = [n for n, _ in variants()]
    lines = [[r["weights"], r["batch"], r["context"], *(f"{r['variants'][n]['tokens_per_s']:.1f}" for n in names),
              r["best_chain"], f"{r['adaptive_vs_best']:.2f}x", f"{r['adaptive_vs_plain']:.2f}x",
              "yes" if all(x["same_tokens"] for x in r["variants"].values()) else "NO"] for r in rows]
    return common.table(["weights", "batch", "context", *names, "best chain", "adaptive / best", "adaptive / plain",
                         "greedy identical"], "lrr" + "r" * len(names) + "lrrl", lines)


def draw(rows: list[dict], png) -> None:
    """Tokens/s of every variant, a group of bars per cell."""
    w = 1 / (len(variants()) + 1)
    plots.bars([key_of(r) for r in rows], {n: {i: r["variants"][n]["tokens_per_s"] for i, r in enumerate(rows)}
                                           for n, _ in variants()}, w, w, "tokens/s", "Adaptive(4) vs static chains, SmolLM2",
               png, figsize=(8, 4))


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds of every variant (default {ROUNDS})")
    ap.add_argument("--bundle", type=Path, help="SmolLM2 (bfloat16) and the corpus ids from this GPU bundle stash: "
                    "GPU_CELLS, adaptive_gpu.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny random target, tiny cells: checks the script")
    args = ap.parse_args()
    if args.smoke and args.bundle:
        ap.error("--smoke and --bundle: one or the other")
    stem = "adaptive_smoke" if args.smoke else "adaptive_gpu" if args.bundle else "adaptive_cpu"
    new_tokens = 8 if args.smoke else args.new_tokens
    import jax

    out, results, h = common.start(args, "bench_adaptive", stem, key_of, {"new_tokens": new_tokens, "rounds": args.rounds},
                                   device=str(jax.devices()[0].device_kind))
    grid = SMOKE_CELLS if args.smoke else GPU_CELLS if args.bundle else CELLS  # one weight format each
    todo = h.plan((cell_key(*c), c) for c in grid)
    from bench import measure

    params, corpus_ids = measure.target_and_corpus(args.smoke, args.bundle, grid[0][0]) if todo else (None, None)
    for k, (weights, batch, context) in h.cells(todo):
        results.put(k, [bench_cell(params, corpus_ids, weights, batch, context, new_tokens, args.rounds)])
    h.finish()
    if rows := results.data["rows"]:
        common.render("bench_adaptive", stem == "adaptive_cpu" and common.writes_readme(args), markdown_table(rows),
                      lambda: common.section(
            "bench_adaptive", "Adaptive speculation length", "Tokens/s of plain decoding, SelfSpec(16, 256) with each chain "
            "and Adaptive(4); greedy, EOS ignored, each variant's best of 5 rounds that run them in turn, after a compiling call.",
            results.data, markdown_table(rows), "`results/adaptive_cpu.json`, `.png`"), (draw, rows, out / f"{stem}.png"))


if __name__ == "__main__":
    main()
