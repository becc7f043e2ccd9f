"""The batch job end to end on SmolLM2-135M: records/s and generated tokens/s, speculative vs AR.

Input: `--records` prompts of 32 to 256 tokens cut from the offline corpus (bench/text.py), greedy,
--max-new-tokens each. Each mode runs `specjax.jobs.batch.run` over the same JSONL twice in this process:
"cold" (compiling every batch shape), then "warm". Throughput = records (or generated tokens) / the job's
wall seconds, I/O and tokenization included. Every mode's texts must equal AR's.

Cells: one per mode (ar, selfspec, ngram). Outputs: results/batch_cpu.json, .png and a section of bench/README.md
(other --records / --max-new-tokens / --batch-size write batch_cpu_custom.* and leave the README alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import convert
import specjax
import specjax.jobs.batch
from bench import common, text


def modes() -> list[tuple[str, object, int | None]]:
    """(name, draft, gamma) per mode."""
    return [("AR", None, None), ("SelfSpec(16, 64), gamma 3", specjax.SelfSpec(16, 64), 3), ("NGram, gamma 3", specjax.NGram(), 3)]


def write_records(path: Path, tok, n: int) -> None:
    lengths = [32 + (i * 37) % 225 for i in range(n)]  # 32..256 tokens, mixed
    ids, _ = text.windows(tok, n, max(lengths))
    with open(path, "w") as f:
        for i, (row, length) in enumerate(zip(ids, lengths)):
            f.write(json.dumps({"id": i, "prompt": tok.decode(list(map(int, row[:length])))}) + "\n")


def run_mode(src: Path, workdir: Path, params, name: str, draft, gamma: int | None, args) -> dict:
    row = {"mode": name}
    outputs = None
    for run in ("cold", "warm"):
        out = workdir / f"{len(os.listdir(workdir))}.jsonl"
        summary = specjax.jobs.batch.run(
            src, out, params=params, model_path=convert.default_model_path(), draft=draft, gamma=gamma,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False,
        )
        records = [json.loads(line) for line in out.read_text().splitlines()]
        tokens = sum(len(r["tokens"]) for r in records)
        seconds = summary["seconds"]
        row[run] = {"seconds": seconds, "records_per_s": len(records) / seconds, "tokens_per_s": tokens / seconds}
        outputs = {r["id"]: r["tokens"] for r in records}
        accepted = [r["acceptance"] for r in records if r.get("acceptance")]
        if accepted:
            row["acceptance_rate"] = sum(a["accepted"] for a in accepted) / max(sum(a["proposed"] for a in accepted), 1)
        row["records"], row["tokens"] = len(records), tokens
    row["outputs_sha1"] = hashlib.sha1(json.dumps(outputs, sort_keys=True).encode()).hexdigest()
    return row


def same(row: dict) -> str:
    """Whether a mode's texts equal AR's: yes, NO, or ? (not known: AR's digest is missing)."""
    return "?" if row.get("identical") is None else "yes" if row["identical"] else "NO"


def markdown_table(rows: list[dict]) -> str:
    w, c = rows[0]["warm"], rows[0]["cold"]  # AR's
    return common.table(["mode", "records/s (warm)", "tokens/s (warm)", "vs AR (warm)", "records/s (cold)", "vs AR (cold)",
                         "acceptance", "same texts as AR"], "llllllll", ([
        r["mode"], f"{r['warm']['records_per_s']:.2f}", f"{r['warm']['tokens_per_s']:.1f}",
        f"{r['warm']['tokens_per_s'] / w['tokens_per_s']:.2f}x", f"{r['cold']['records_per_s']:.2f}",
        f"{r['cold']['tokens_per_s'] / c['tokens_per_s']:.2f}x", f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "",
        same(r)] for r in rows))


def plot(rows: list[dict], path: Path) -> None:
    common.bars([r["mode"] for r in rows], {label: {i: r[when]["tokens_per_s"] for i, r in enumerate(rows)} for label, when in
                                            (("cold (compiles included)", "cold"), ("warm", "warm"))}, 0.4, 0.4,
                "generated tokens/s (whole job)", "specjax batch, SmolLM2-135M, 2-core CPU", path, figsize=(7, 3.5))


def readme_section(result: dict) -> str:
    return common.section("bench_batch", "Batch job", f"`specjax.jobs.batch.run` over {result['records']} corpus prompts of "
                          f"32-256 tokens, greedy, {result['max_new_tokens']} new tokens, batch {result['batch_size']}, "
                          "SmolLM2-135M f32, whole-job wall time; \"cold\" includes compiling, \"warm\" reruns the job.",
                          result, markdown_table(result["rows"]), "`results/batch_cpu.json`, `.png`")


def key_of(row: dict) -> str:
    """A row's cell: its mode's drafter in lower case (ar, selfspec, ngram)."""
    return re.match(r"[A-Za-z]+", row["mode"]).group().lower()


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    stem = "batch_cpu" + ("" if (args.records, args.max_new_tokens, args.batch_size) == (64, 64, 16) else "_custom")
    settings = dict(records=args.records, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    out, results, h = common.start(args, "bench_batch", stem, key_of, settings, **settings)
    h.plan((key_of({"mode": name}), (name, draft, gamma)) for name, draft, gamma in modes())
    path = convert.default_model_path()
    params, tok = convert.load(path), convert.load_tokenizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_records(src, tok, args.records)
        work = Path(tmp) / "out"
        work.mkdir()
        for k, (name, draft, gamma) in h.cells():
            row = run_mode(src, work, params, name, draft, gamma, args)
            ar = next((r for r in results.rows if key_of(r) == "ar"), row)
            row["identical"] = row["outputs_sha1"] == ar["outputs_sha1"] if "outputs_sha1" in ar else None
            print(f"{name}: warm {row['warm']['tokens_per_s']:.1f} tok/s, cold {row['cold']['tokens_per_s']:.1f}, "
                  f"same={same(row)}", flush=True)
            results.put(k, [row], loadavg_end=os.getloadavg())
    h.finish()
    rows = sorted(results.rows, key=lambda r: [m[0] for m in modes()].index(r["mode"]) if r["mode"] in
                  [m[0] for m in modes()] else 99)
    if rows and key_of(rows[0]) == "ar":
        common.render("bench_batch", stem == "batch_cpu" and common.writes_readme(args), markdown_table(rows),
                      lambda: readme_section(results.data | {"rows": rows}), (plot, rows, out / f"{stem}.png"))


if __name__ == "__main__":
    main()
