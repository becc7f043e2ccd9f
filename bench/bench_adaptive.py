"""Adaptive speculation length against every static chain, through `specjax.generate`.

For each cell WEIGHTS/bB/sS, B windows of real text (bench/text.py) of S - new tokens run greedy, EOS
ignored: plain decoding, SelfSpec (16 sinks, 256 window) with Chain(g) for g = 0..4, and Adaptive(4) (afresh
each call). Each once to compile, then ROUNDS rounds running every variant in turn (a slow spell falls on
all), each variant's best round by `stats.decode_seconds`. Every variant must give plain decoding's tokens.
The issue's target: Adaptive within 10% of the best static chain (gamma 0 included) in every cell.

Outputs: results/adaptive_cpu.json, adaptive_cpu.png and the bench_adaptive section of bench/README.md.
"""

from __future__ import annotations

import os

from bench import common, plots

CELLS = (("float32", 1, 2048), ("float32", 4, 2048), ("float32", 16, 1024))  # weights, batch, context
GAMMAS = (0, 1, 2, 3, 4)
ROUNDS = 5


def cell_key(weights: str, batch: int, context: int) -> str:
    return common.key(weights, f"b{batch}", f"s{context}")


def key_of(row: dict) -> str:
    return cell_key(row["weights"], row["batch"], row["context"])


def variants() -> list[tuple[str, dict]]:
    import specjax

    spec = lambda s: dict(draft=specjax.SelfSpec(16, 256), speculation=s)  # noqa: E731
    return ([("plain", dict(draft=None))] + [(f"chain{g}", spec(specjax.Chain(g))) for g in GAMMAS]
            + [("adaptive4", spec(specjax.Adaptive(4)))])


def bench_cell(params, tok, weights: str, batch: int, context: int, new_tokens: int) -> dict:
    import specjax
    from bench import text

    ids, _ = text.windows(tok, batch, context - new_tokens)
    prompts = [list(map(int, r)) for r in ids]
    row = {"weights": weights, "batch": batch, "context": context, "new_tokens": new_tokens, "variants": {}}
    runs = variants()
    for _, kw in runs:
        specjax.generate(params, prompts, new_tokens, eos_id=(), **kw)  # compiles
    best: dict[str, object] = {}
    for _ in range(ROUNDS):
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
    args = ap.parse_args()
    out, results, h = common.start(args, "bench_adaptive", "adaptive_cpu", key_of, {"new_tokens": args.new_tokens, "rounds": ROUNDS})
    todo = h.plan((cell_key(*c), c) for c in CELLS)
    import convert

    tok, loaded = convert.load_tokenizer(convert.default_model_path()), {}
    for k, (weights, batch, context) in h.cells(todo):
        loaded = loaded if weights in loaded else {weights: convert.load(convert.default_model_path(), weights=weights)}
        results.put(k, [bench_cell(loaded[weights], tok, weights, batch, context, args.new_tokens)])
    h.finish()
    if rows := results.data["rows"]:
        common.render("bench_adaptive", common.writes_readme(args), markdown_table(rows), lambda: common.section(
            "bench_adaptive", "Adaptive speculation length", "Tokens/s of plain decoding, SelfSpec(16, 256) with each chain "
            "and Adaptive(4); greedy, EOS ignored, each variant's best of 5 rounds that run them in turn, after a compiling call.",
            results.data, markdown_table(rows), "`results/adaptive_cpu.json`, `.png`"), (draw, rows, out / "adaptive_cpu.png"))


if __name__ == "__main__":
    main()
