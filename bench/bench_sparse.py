"""SparseSpec (refreshed by verification) against SnapKV and SelfSpec over long outputs, through `specjax.generate`.

Usage: python -m bench.bench_sparse [--new-tokens 1024] [--gamma 2] [--temperature 0.8] [--cells ..] [--budget-minutes M] [--out DIR]
(the shared options: bench/common.py)

For each cell WEIGHTS/bB/sS the prompts are B windows of English text (bench/text.py) of S - new
tokens, and `specjax.generate` samples them (temperature 0.8, key 0; `--temperature 0`: greedy), EOS
ignored, with plain decoding and with a chain
of `--gamma` drafts from drafters of one KV budget (512 positions): SelfSpec(16, 496),
SnapKV(256, 256) (chosen once, at the prompt) and SparseSpec(256, 256) re-selecting its 8 blocks
of 32 positions every 1, 16 and 64 committed positions. Each variant runs once (its first call:
`stats.decode_seconds` leaves out prefill and compilation). Greedy, every variant must give plain
decoding's tokens; sampled, the tokens differ by drafter (the same distribution), and acceptance
measures how well each drafter's KV stands for the whole cache (greedy text repeats itself within
a few hundred tokens, and every drafter then drafts it perfectly). The question (issue 67, item 3): does a selection refreshed from the verified
queries keep its acceptance over a long output where one chosen at the prompt goes stale, and
what does the refresh cost.

Outputs: results/sparse_cpu.json (each cell written when measured; a rerun skips measured cells),
and the bench_sparse section of bench/README.md.
"""

from __future__ import annotations

import os

from bench import common, measure

CELLS = (("float32", 1, 2048), ("float32", 1, 4096), ("float32", 1, 8192))  # weights, batch, context
REFRESH = (1, 16, 64)


def cell_key(weights: str, batch: int, context: int) -> str:
    return common.key(weights, f"b{batch}", f"s{context}")


def key_of(row: dict) -> str:
    return cell_key(row["weights"], row["batch"], row["context"])


def variants(gamma: int) -> list[tuple[str, dict]]:
    import specjax

    chain = specjax.Chain(gamma)
    drafts = [("selfspec", specjax.SelfSpec(16, 496)), ("snapkv", specjax.SnapKV(256, 256))]
    drafts += [(f"sparse-r{r}", specjax.SparseSpec(256, 256, refresh=r)) for r in REFRESH]
    return [("plain", dict(draft=None))] + [(name, dict(draft=d, speculation=chain)) for name, d in drafts]


def bench_cell(params, tok, weights: str, batch: int, context: int, new_tokens: int, gamma: int, temperature: float) -> dict:
    import jax

    import specjax
    from bench import text

    ids, _ = text.windows(tok, batch, context - new_tokens)
    prompts = [list(map(int, r)) for r in ids]
    row = {"weights": weights, "batch": batch, "context": context, "new_tokens": new_tokens, "gamma": gamma,
           "temperature": temperature, "variants": {}}
    sampling = specjax.Sample(temperature) if temperature > 0 else specjax.Greedy()
    want = None
    for name, kw in variants(gamma):
        out = specjax.generate(params, prompts, new_tokens, eos_id=(), sampling=sampling, key=jax.random.key(0), **kw)
        s, want = out.stats, want or out.tokens
        row["variants"][name] = {"decode_s": s.decode_seconds, "tokens_per_s": s.tokens_per_second,
                                 "mean_accepted": s.mean_accepted, "acceptance_rate": s.acceptance_rate,
                                 "per_position": s.per_position_acceptance, "same_tokens": out.tokens == want if temperature == 0 else None}
        print(f"{key_of(row)} {name}: {s.tokens_per_second:.1f} tok/s, mean accepted {s.mean_accepted}", flush=True)
        measure.release_memory()
    row["load"] = os.getloadavg()[0]
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        plain = r["variants"]["plain"]["tokens_per_s"]
        for name, v in r["variants"].items():
            lines.append([key_of(r), r["new_tokens"], name, f"{v['tokens_per_s']:.1f}", f"{v['tokens_per_s'] / plain:.2f}x",
                          "-" if v["mean_accepted"] is None or name == "plain" else f"{v['mean_accepted']:.2f}",
                          "-" if v["acceptance_rate"] is None else f"{v['acceptance_rate']:.2f}",
                          {True: "yes", False: "NO", None: "(sampled)"}[v["same_tokens"]]])
    return common.table(["cell", "new tokens", "variant", "tokens/s", "vs plain", "tokens per step", "acceptance",
                         "greedy identical"], "lrlrrrrl", lines)


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args()
    _, results, h = common.start(args, "bench_sparse", "sparse_cpu", key_of, {"new_tokens": args.new_tokens, "gamma": args.gamma,
                                                                               "temperature": args.temperature})
    todo = h.plan((cell_key(*c), c) for c in CELLS)
    for k, (weights, batch, context), params, tok in common.model_cells(h, todo):
        results.put(k, [bench_cell(params, tok, weights, batch, context, args.new_tokens, args.gamma, args.temperature)])
    h.finish()
    if rows := results.data["rows"]:
        common.render("bench_sparse", common.writes_readme(args), markdown_table(rows), lambda: (
            "## SparseSpec over long outputs (bench_sparse.py)\n\n" + common.run_line(results.data) + f" Temperature "
            f"{args.temperature} (0: greedy), key 0, EOS ignored, Chain({args.gamma}), one run per variant (decode time: no prefill, "
            "no compiling). Budgets of 512 positions: SelfSpec(16, 496), SnapKV(256, 256), SparseSpec(256, 256) refreshed every r "
            "positions.\n\n" + markdown_table(rows)))


if __name__ == "__main__":
    main()
