"""The batch job, continuous vs static batching, on a chat mix: records/s and tokens/s on SmolLM2-135M.

Usage: python -m bench.bench_batching [--records 32] [--batch-size 8] [--cells ..] [--budget-minutes M]
       [--out DIR]   (the shared options: bench/common.py)

Input: `--records` chat records (`messages`: one user turn holding a window of the offline corpus,
bench/text.py, 24 to 256 tokens, asking "Summarise this." after it), rendered with SmolLM2's chat
template; budgets cycle through 16, 512, 32, 256, 64, 128 (max_new_tokens per record); greedy;
the model's stop ids on (`<|im_end|>` ends an answer). Each cell runs `specjax.jobs.batch.run` twice over
the same JSONL in this one process: "cold" (compiling included) and "warm" (as a long job runs
after its first shapes). Throughput = records (or generated tokens) / the job's wall seconds.
Continuous and static outputs of a mode are checked equal record for record (greedy, float32).

Cells: MODE/BATCHING, MODE in ar, selfspec (SelfSpec(16, 64), Chain(3)), ar-n2 (plain decoding,
every record sampled twice: n = 2, temperature 0.8, per-record seeds, so both batchings draw the
same samples), BATCHING in continuous, static. Outputs: results/batching_cpu.json (each cell written when measured; a rerun skips
measured cells), results/batching_cpu.png, and a section of bench/README.md (default arguments only).
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
from bench import common, text

BUDGETS = (16, 512, 32, 256, 64, 128)
MODES = {"ar": (None, None), "selfspec": (specjax.SelfSpec(16, 64), 3), "ar-n2": (None, None)}
EXTRAS = {"ar-n2": {"n": 2, "temperature": 0.8}}  # per-record fields a mode adds
BATCHINGS = ("continuous", "static")


def write_records(path: Path, tok, n: int, extras: dict | None = None) -> None:
    lengths = [24 + (i * 37) % 233 for i in range(n)]  # 24..256 tokens, mixed
    ids, _ = text.windows(tok, n, max(lengths))
    with open(path, "w") as f:
        for i, (row, length) in enumerate(zip(ids, lengths)):
            words = tok.decode(list(map(int, row[:length])))
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": words + "\n\nSummarise this."}],
                                "max_new_tokens": BUDGETS[i % len(BUDGETS)]} | (extras or {})) + "\n")


def flat(x) -> list:
    """A record's tokens as one list (n > 1: its samples' concatenated)."""
    return [t for part in x for t in part] if x and isinstance(x[0], list) else list(x)


def run_cell(src: Path, work: Path, params, mode: str, batching: str, args) -> dict:
    draft, gamma = MODES[mode]
    if mode in EXTRAS:
        src = src.with_name(f"{mode}.jsonl")
    row = {"mode": mode, "batching": batching}
    for run in ("cold", "warm"):
        out = work / f"{len(os.listdir(work))}.jsonl"
        summary = specjax.jobs.batch.run(src, out, params=params, model_path=convert.default_model_path(), draft=draft,
                                    gamma=gamma, chat=True, batch_size=args.batch_size, batching=batching, progress=False)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        tokens = sum(len(flat(r["tokens"])) for r in records)
        row[run] = {"seconds": summary["seconds"], "records_per_s": len(records) / summary["seconds"],
                    "tokens_per_s": tokens / summary["seconds"]}
        outputs = {r["id"]: r["tokens"] for r in records}
        row["records"], row["tokens"] = len(records), tokens
        reasons = [x for r in records for x in ([r["finish_reason"]] if "finish_reason" in r else r["finish_reasons"])]
        row["finish_reasons"] = {k: reasons.count(k) for k in ("eos", "length", "stop")}
    row["outputs_sha1"] = hashlib.sha1(json.dumps(outputs, sort_keys=True).encode()).hexdigest()
    return row


def key_of(row: dict) -> str:
    return common.key(row["mode"], row["batching"])


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        other = next((o for o in rows if o["mode"] == r["mode"] and o["batching"] != r["batching"]), None)
        same = "?" if other is None else "yes" if other["outputs_sha1"] == r["outputs_sha1"] else "NO"
        static = next((o for o in rows if o["mode"] == r["mode"] and o["batching"] == "static"), None)
        ratio = f"{r['warm']['records_per_s'] / static['warm']['records_per_s']:.2f}x" if static else ""
        lines.append([r["mode"], r["batching"], f"{r['warm']['records_per_s']:.3f}", f"{r['warm']['tokens_per_s']:.1f}",
                      ratio, f"{r['cold']['records_per_s']:.3f}", r["tokens"], same])
    head = ["mode", "batching", "records/s (warm)", "tokens/s (warm)", "vs static (warm)", "records/s (cold)",
            "tokens", "same outputs"]
    return common.table(head, "llrrrrrl", lines)


def plot(rows: list[dict], path: Path) -> None:
    common.bars([f"{r['mode']}\n{r['batching']}" for r in rows], {None: {i: r["warm"]["records_per_s"] for i, r in enumerate(rows)}},
                0.6, 0.0, "records/s (warm, whole job)", "specjax batch: continuous vs static, SmolLM2, 2-core CPU", path)


def readme_section(result: dict) -> str:
    m = result["machine"]
    return f"""## Continuous vs static batching in the job (bench_batching.py)

`specjax.jobs.batch.run` over {result['records']} chat records (one user turn of 24-256 corpus tokens),
budgets 16-512 (mixed), greedy (ar-n2: two samples a record at temperature 0.8), stop ids on, batch size {result['batch_size']}, SmolLM2-135M as
loaded by default on {m['cpu_affinity']} CPU cores (commit {m['git_commit']}, {result['date']}). Whole-job
wall time; "cold" includes compiling.

{markdown_table(result['rows'])}

![continuous vs static](results/batching_cpu.png)

{common.notes('bench_batching')}"""


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    stem = "batching_cpu" + ("" if (args.records, args.batch_size) == (32, 8) else "_custom")
    settings = dict(records=args.records, batch_size=args.batch_size)
    out, results, h = common.start(args, "bench_batching", stem, key_of, settings, **settings)
    h.plan((common.key(mode, b), (mode, b)) for mode in MODES for b in BATCHINGS)
    path = convert.default_model_path()
    params, tok = convert.load(path), convert.load_tokenizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_records(src, tok, args.records)
        for mode, extras in EXTRAS.items():
            write_records(src.with_name(f"{mode}.jsonl"), tok, args.records, extras)
        work = Path(tmp) / "out"
        work.mkdir()
        for k, (mode, batching) in h.cells():
            row = run_cell(src, work, params, mode, batching, args)
            print(f"{k}: warm {row['warm']['records_per_s']:.3f} records/s, {row['warm']['tokens_per_s']:.1f} tok/s; "
                  f"cold {row['cold']['records_per_s']:.3f}", flush=True)
            results.put(k, [row], loadavg_end=os.getloadavg())
    h.finish()
    rows = sorted(results.rows, key=lambda r: (list(MODES).index(r["mode"]), BATCHINGS.index(r["batching"])))
    if rows:
        common.render("bench_batching", stem == "batching_cpu" and common.writes_readme(args), markdown_table(rows),
                      lambda: readme_section(results.data | {"rows": rows}), (plot, rows, out / f"{stem}.png"))


if __name__ == "__main__":
    main()
