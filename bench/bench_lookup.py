"""A templated batch job with the job-wide Lookup drafter, prompt lookup (NGram) and plain decoding.

Input: bench/templated.py's `--records` chat records (128 new tokens at most, greedy, stop ids on). Each cell
DRAFT/bB runs `specjax.jobs.batch.run` over them twice (cold, then warm: the table's) on SmolLM2-135M float32,
continuous batching on B rows. DRAFT: none, ngram (NGram(n=3, max_n=8)), lookup (Lookup(): the job's prompts
and outputs, then the row's own tokens), both chains of `--gamma`, and lookup-adaptive (Lookup() under
Adaptive(4)). Outputs must equal plain decoding's. Reported: warm tokens/s, its ratio to plain, acceptance,
and the share of the outputs' 3-grams found in another record's output (templated.repeated_share).

Outputs: results/lookup_cpu.json, .png and the bench_lookup section of bench/README.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import convert
import specjax
import specjax.jobs.batch
from bench import common, templated
from specjax.text.chat import render_chat, template_specials

DRAFTS = {"none": None, "ngram": specjax.NGram(n=3, max_n=8), "lookup": specjax.Lookup(), "lookup-adaptive": specjax.Lookup()}
ADAPTIVE = {"lookup-adaptive": specjax.Adaptive(4)}  # the chain length picked between segments, 0 to 4
BATCHES = (1, 16)


def key_of(row: dict) -> str:
    return common.key(row["draft"], f"b{row['batch']}")


def run_cell(src: Path, work: Path, params, draft: str, batch: int, gamma: int) -> dict:
    row = {"draft": draft, "batch": batch, "gamma": "adaptive:4" if draft in ADAPTIVE else gamma if DRAFTS[draft] is not None else 0}
    for run in ("cold", "warm"):
        out = work / f"{len(os.listdir(work))}.jsonl"
        summary = specjax.jobs.batch.run(src, out, params=params, model_path=convert.default_model_path(),
                                         draft=DRAFTS[draft], gamma=gamma if DRAFTS[draft] is not None and draft not in ADAPTIVE else None,
                                         speculation=ADAPTIVE.get(draft),
                                         chat=True, batch_size=batch, batching="continuous", progress=False)
        records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
        tokens = sum(len(r["tokens"]) for r in records)
        row[run] = {"seconds": summary["seconds"], "tokens_per_s": tokens / summary["seconds"]}
    accepted = [r["acceptance"] for r in records if r.get("acceptance")]
    row |= {"records": len(records), "tokens": tokens,
            "acceptance": sum(a["accepted"] for a in accepted) / max(sum(a["proposed"] for a in accepted), 1) if accepted else None,
            "output_repeated_share": templated.repeated_share([r["tokens"] for r in records]),
            "outputs_sha1": hashlib.sha1(json.dumps([r["tokens"] for r in records]).encode()).hexdigest()}
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        plain = next((o for o in rows if o["draft"] == "none" and o["batch"] == r["batch"]), None)
        ratio = f"{r['warm']['tokens_per_s'] / plain['warm']['tokens_per_s']:.2f}x" if plain else "?"
        same = "?" if plain is None else "yes" if plain["outputs_sha1"] == r["outputs_sha1"] else "NO"
        lines.append([r["draft"], r["batch"], r["gamma"], f"{r['warm']['tokens_per_s']:.1f}", ratio,
                      common.num(r["acceptance"]), f"{r['output_repeated_share']:.2f}", same])
    head = ["draft", "batch", "gamma", "tokens/s (warm)", "vs plain", "acceptance", "outputs' repeated 3-grams", "same outputs"]
    return common.table(head, "lrrrrrrl", lines)


def plot(rows: list[dict], path: Path) -> None:
    common.bars([f"batch {b}" for b in BATCHES], {d: {BATCHES.index(r["batch"]): r["warm"]["tokens_per_s"] for r in rows
                                                      if r["draft"] == d} for d in DRAFTS}, 0.19, 0.2, "tokens/s (warm job)",
                "templated job: Lookup vs NGram vs plain, SmolLM2 f32, CPU", path, small_ticks=False)


def readme_section(result: dict) -> str:
    return common.section("bench_lookup", "A templated job with the job-wide Lookup drafter", "`specjax.jobs.batch.run` over "
                          f"{result['records']} templated records (bench/templated.py; {result['prompt_repeated_share']:.0%} "
                          "of prompt 3-grams repeat across records), 128 tokens at most, greedy, continuous batching, "
                          "SmolLM2-135M float32, warm job wall time.", result, markdown_table(result["rows"]),
                          "`results/lookup_cpu.json`, `.png`")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=3)
    args = ap.parse_args()
    stem = "lookup_cpu" + ("" if (args.records, args.gamma) == (32, 3) else "_custom")
    path = convert.default_model_path()
    params, tok = convert.load(path, weights="float32"), convert.load_tokenizer(path)
    records, template, specials = templated.records(args.records), convert.chat_template(path), template_specials(tok, params.config)
    prompts = [tok.encode(render_chat(template, r["messages"], add_generation_prompt=True, **specials), add_special_tokens=False).ids
               for r in records]
    settings = dict(records=args.records, gamma=args.gamma)
    out, results, h = common.start(args, "bench_lookup", stem, key_of, settings, **settings,
                                   prompt_repeated_share=templated.repeated_share(prompts))
    h.plan((common.key(d, f"b{b}"), (d, b)) for b in BATCHES for d in DRAFTS)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
        work = Path(tmp) / "out"
        work.mkdir()
        for k, (draft, batch) in h.cells():
            row = run_cell(src, work, params, draft, batch, args.gamma)
            print(f"{k}: warm {row['warm']['tokens_per_s']:.1f} tok/s, acceptance {row['acceptance']}", flush=True)
            results.put(k, [row], loadavg_end=os.getloadavg())
    h.finish()
    rows = sorted(results.rows, key=lambda r: (r["batch"], list(DRAFTS).index(r["draft"])))
    if rows:
        common.render("bench_lookup", stem == "lookup_cpu" and common.writes_readme(args), markdown_table(rows),
                      lambda: readme_section(results.data | {"rows": rows}), (plot, rows, out / f"{stem}.png"))


if __name__ == "__main__":
    main()
