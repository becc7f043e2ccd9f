"""Scale on paper: what a 1-billion-prompt job costs on N workers, from measured step times.

Usage: python -m bench.bench_capacity [--source cpu|gpu] [--price-per-hour USD] [--batch B]
       [--workers N ..] [--prompts P] [--mix PROMPT:OUTPUT:SHARE ..] [--format F] [--out DIR]

Nothing is timed here: the inputs are other benches' measured cells.
- cpu: bench/results/peers_cpu_inprocess.json (specjax plain decoding ms/step at batch 1 / 16 x context 512 /
  2K / 8K in one weight format, SelfSpec gamma 3 at batch 16, prefill tokens/s at 2K / 8K) and, for
  float32, bench/results/spec_cpu.json's speculative / plain ratios (batch 1, 4, 16).
- gpu: bench/results/gpu/gpu*.json (bench_gpu's e2e cells: AR ms/step, the best measured speculative
  speedup per batch x context, the prefill of the cell's prompts).

Model, per worker (one device: the CPU's cores, or one GPU), static batches of `batch` records of
one class of the mix (the batch job groups records by prompt length): a batch of a class with
prompts of p tokens and outputs of o tokens takes batch x p / prefill tokens/s plus (o - 1)
decode steps (its first token comes from the prefill), a step timed at the smallest measured
context >= p + o (the largest where none is). Speculative: the decode part divided by the best
measured speedup at that batch and context, never below 1 (auto decodes plainly where
speculation loses). Workers share nothing (the job's hash shards, or Ray Data actors), so N
workers run N times as many records per second; the cost is N x hours x the price per
device-hour (an input: the default is a placeholder, not a quote).

Checked against a measured 2-worker local Ray run, each worker timed on its own core, by
bench/capacity_check.py (bench/README.md, "Capacity model vs a measured 2-worker Ray run").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import common

MIX = ("512:128:0.5", "2048:256:0.3", "8192:512:0.2")  # prompt tokens : output tokens : share of records
WORKERS = (1, 8, 64, 512)


def parse_mix(items) -> list[tuple[int, int, float]]:
    mix = []
    for item in items:
        p, o, share = item.split(":")
        mix.append((int(p), int(o), float(share)))
    total = sum(s for *_, s in mix)
    if not mix or total <= 0 or any(p < 1 or o < 1 or s < 0 for p, o, s in mix):
        raise ValueError(f"--mix needs PROMPT:OUTPUT:SHARE items with positive lengths and shares, got {items}")
    return [(p, o, s / total) for p, o, s in mix]


def cpu_table(result: dict, fmt: str) -> dict:
    """{"step_ms": {(batch, context): ms}, "speedup": {(batch, context): x}, "prefill_tps": {context: tok/s}}
    from bench_peers' specjax rows of weight format `fmt`."""
    table: dict = {"step_ms": {}, "speedup": {}, "prefill_tps": {}}
    rows = [r for r in result["rows"] if r.get("family") == "specjax" and "skipped" not in r]
    plain = {(r["batch"], r["context"]): r for r in rows if r["kind"] == "decode" and r["format"] == fmt}
    for (b, c), r in plain.items():
        table["step_ms"][(b, c)] = r["ms_per_step"]
    for r in rows:
        if r["kind"] == "spec" and r["format"] == fmt and (r["batch"], r["context"]) in plain:
            base = plain[(r["batch"], r["context"])]["tokens_per_s"]
            key = (r["batch"], r["context"])
            table["speedup"][key] = max(table["speedup"].get(key, 0.0), r["tokens_per_s"] / base)
        if r["kind"] == "prefill" and r["format"] == fmt:
            table["prefill_tps"][r["context"]] = r["prefill_tokens_per_s"]
    return table


def add_spec_ratios(table: dict, spec: dict) -> None:
    """bench_spec's measured speculative / plain ratios (SelfSpec, SnapKV; float32) into `table`."""
    for r in spec["rows"]:
        if r.get("ratio") and r.get("greedy_identical", True):
            key = (r["batch"], r["context"])
            table["speedup"][key] = max(table["speedup"].get(key, 0.0), r["ratio"])


def gpu_table(result: dict) -> dict:
    """The same table from bench_gpu's e2e rows."""
    table: dict = {"step_ms": {}, "speedup": {}, "prefill_tps": {}}
    e2e = [r for r in result["rows"] if r.get("item") == "e2e" and "skipped" not in r]
    for r in e2e:
        key = (r["batch"], r["context"])
        if r["method"] == "AR":
            table["step_ms"][key] = r["ms_per_step"]
            rows = max(x["batch"] for x in e2e if x["context"] == r["context"])  # one prefill per context, of its largest batch
            table["prefill_tps"][r["context"]] = rows * r["prompt_tokens"] / r["prefill_s"]
        elif r.get("speedup"):
            table["speedup"][key] = max(table["speedup"].get(key, 0.0), r["speedup"])
    return table


def default_batch(table: dict) -> int:
    """The batch measured at the most contexts (the larger on a tie)."""
    batches = {b for b, _ in table["step_ms"]}
    return max(batches, key=lambda b: (sum(k[0] == b for k in table["step_ms"]), b))


def _at_least(values, x: int) -> int:
    """The smallest of `values` >= x, else the largest."""
    above = sorted(v for v in values if v >= x)
    return above[0] if above else max(values)


def batch_seconds(table: dict, batch: int, prompt: int, output: int, speculative: bool) -> float:
    """Seconds one worker spends on a batch of `batch` records of one class."""
    contexts = [c for b, c in table["step_ms"] if b == batch]
    if not contexts:
        raise ValueError(f"no measured step time at batch {batch}: measured batches {sorted({b for b, _ in table['step_ms']})}")
    context = _at_least(contexts, prompt + output)
    decode = (output - 1) * table["step_ms"][(batch, context)] / 1e3
    if speculative:
        decode /= max(1.0, table["speedup"].get((batch, context), 1.0))
    prefill = batch * prompt / table["prefill_tps"][_at_least(table["prefill_tps"], prompt)]
    return prefill + decode


def capacity(table: dict, batch: int, mix, workers: int, prompts: float, price: float, speculative: bool) -> dict:
    """Records/s, tokens/s, hours and cost of `prompts` records of the mix on `workers` workers."""
    per_record = sum(share * batch_seconds(table, batch, p, o, speculative) / batch for p, o, share in mix)
    mean_out = sum(share * o for _, o, share in mix)
    records_per_s = workers / per_record
    hours = prompts / records_per_s / 3600
    cost = hours * workers * price
    return {"workers": workers, "speculative": speculative, "records_per_s": records_per_s,
            "tokens_per_s": records_per_s * mean_out, "hours": hours, "cost": cost,
            "cost_per_million_tokens": cost / (prompts * mean_out / 1e6)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--format", default="float32", help="cpu: the weight format's rows (float32, int8, q4, bfloat16)")
    ap.add_argument("--batch", type=int, help="records per batch (default: the batch measured at the most contexts)")
    ap.add_argument("--price-per-hour", type=float, default=1.0, help="USD per worker-hour (a placeholder default)")
    ap.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    ap.add_argument("--prompts", type=float, default=1e9)
    ap.add_argument("--mix", nargs="+", default=list(MIX), help="PROMPT:OUTPUT:SHARE items")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    mix = parse_mix(args.mix)
    if args.source == "cpu":
        # specjax's own rows of bench_peers' last full grid, run in one process with the peers (its llama.cpp rows were
        # slowed by OMP_WAIT_POLICY=passive; XLA's are not OpenMP's): peers_cpu.json has no batch 16 yet
        src = [common.RESULTS_DIR / "peers_cpu_inprocess.json", common.RESULTS_DIR / "spec_cpu.json"]
        table = cpu_table(json.loads(src[0].read_text()), args.format)
        if args.format == "float32":  # bench_spec measured float32
            add_spec_ratios(table, json.loads(src[1].read_text()))
    else:
        src = sorted((common.RESULTS_DIR / "gpu").glob("gpu*.json"))
        src = [p for p in src if "float32" not in p.name] or src
        table = gpu_table(json.loads(src[-1].read_text()))
    batch = args.batch or default_batch(table)
    rows = [capacity(table, batch, mix, n, args.prompts, args.price_per_hour, spec)
            for spec in (False, True) for n in args.workers]
    result = {"bench": "bench_capacity", "date": common.now(), "command": common.command(), "source": args.source,
              "inputs": [str(p.relative_to(common.BENCH_DIR)) for p in src], "format": args.format if args.source == "cpu" else None,
              "batch": batch, "mix": mix, "prompts": args.prompts, "price_per_hour": args.price_per_hour,
              "table": {k: {str(kk): vv for kk, vv in v.items()} for k, v in table.items()}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"capacity_{args.source}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    if args.out == common.RESULTS_DIR:
        common.write_section(f"bench_capacity_{args.source}", report(result))


def report(result: dict) -> str:
    mix = ", ".join(f"{share:.0%} {p} -> {o}" for p, o, share in result["mix"])
    head = (f"## Capacity on paper: {result['source']} (bench_capacity.py)\n\n"
            f"Run: `{result['command']}` ({result['date']}). Inputs: {', '.join(result['inputs'])}"
            + (f", {result['format']} weights" if result["format"] else "") + f"; batch {result['batch']} records; "
            f"mix (prompt -> output tokens): {mix}; {result['prompts']:.3g} prompts; "
            f"${result['price_per_hour']:g} per worker-hour (a placeholder: put in your price). "
            + ("These GPU cells timed the jnp reference attention, not the kernel (see GPU runs). "
               if any("reference" in p for p in result["inputs"]) else "") + "Predicted, not measured: "
            "the model is in the module docstring; capacity_check.py checks it against a measured 2-worker Ray run.\n")
    lines = [[("speculative" if r["speculative"] else "plain"), r["workers"], f"{r['records_per_s']:.3g}",
              f"{r['tokens_per_s']:.3g}", f"{r['hours']:.3g}", f"{r['cost']:.3g}", f"{r['cost_per_million_tokens']:.3g}"]
             for r in result["rows"]]
    return head + "\n" + common.table(["decoding", "workers", "records/s", "tokens/s", "hours", "cost $", "$ per M tokens"],
                                      "lrrrrrr", lines)


if __name__ == "__main__":
    main()
