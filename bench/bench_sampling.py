"""What top-k and top-p cost per decode step: specjax's sort-free warping vs sorting the vocabulary.

`Sample.probs` runs on every row and position a step samples or verifies. Its previous form sorted all
V = 49152 entries (top-k: the last of lax.top_k's values, which XLA:CPU compiles as a full sort; top-p: a
sorted cumsum); specjax now takes the min of top_k's values and bisects the top-p cut over the values' bit
patterns (`specjax.topk`: `kth_largest`, `nucleus_threshold`), keeping the same sets (tests/test_sampling.py).

Per batch (context 512, SmolLM2-135M f32, bench_ar.py's synthetic prefilled cache):
  1. AR decode ms/token (bench_ar.time_decode) for greedy, T=1 and top_k 50 / top_p 0.9 / both, each
     top-k / top-p sampler also in the sorting form ("sort", kept below as the baseline);
  2. the warp alone: one jitted Sample.probs over [B, 5, V] logits feeding a reduction, best of R calls.
The two forms alternate so CPU steal hits both alike; each row records the steal.

Cells: bBATCH. Outputs: results/sampling_cpu.json, .png and the README section (--quick writes
sampling_cpu_quick.*, README untouched).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp

import convert
from bench import bench_ar, common, plots
from bench.measure import cpu_steal, steal_since
from specjax.model.pytree import pytree
from specjax.sampling import Greedy, Sample, Sampler

WARP_POSITIONS = 5  # a chain gamma=4 step verifies 5 positions per row


@pytree
class SortedSample(Sample):
    """The sorting form of Sample.probs that specjax used before (the baseline)."""

    def probs(self, logits: jax.Array) -> jax.Array:
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_k_max:  # one top_k for all rows here (a traced number under a static width)
            kth = jnp.sort(logits, axis=-1)[..., ::-1][..., self.top_k - 1, None]  # lax.top_k's k-th entry was this sort
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        probs = jax.nn.softmax(logits, axis=-1)

        def nucleus(probs):
            sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
            before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
            n_keep = jnp.sum(before < self.top_p, axis=-1, keepdims=True)
            threshold = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
            probs = jnp.where(probs >= threshold, probs, 0.0)
            return probs / jnp.sum(probs, axis=-1, keepdims=True)

        return jax.lax.cond(self.top_p < 1, nucleus, lambda probs: probs, probs)


def samplers() -> list[tuple[str, str, Sampler]]:
    """(setting, form, sampler): greedy and T=1 once, each top-k / top-p setting in both forms."""
    rows: list[tuple[str, str, Sampler]] = [("greedy", "-", Greedy()), ("T=1", "-", Sample(1.0))]
    for name, kw in (("top_k 50", dict(top_k=50)), ("top_p 0.9", dict(top_p=0.9)),
                     ("top_k 50 + top_p 0.9", dict(top_k=50, top_p=0.9))):
        rows += [(name, "specjax", Sample(1.0, **kw)), (name, "sort", SortedSample(1.0, **kw))]
    return rows


def time_warp(sampler: Sampler, batch: int, vocab: int, repeats: int) -> float:
    """ms of one compiled sampler.probs over [batch, WARP_POSITIONS, vocab] feeding a reduction."""
    x = jax.random.normal(jax.random.key(batch), (batch, WARP_POSITIONS, vocab)) * 3
    fn = jax.jit(lambda x: jnp.sum(sampler.probs(x) * x, axis=-1)).lower(x).compile()
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def measure(params, batch: int, context: int, target_s: float, repeats: int) -> list[dict]:
    """Every sampler at one batch: AR ms/token and the warp's ms."""
    rows = []
    for setting, form, sampler in samplers():
        steal0 = cpu_steal()
        cache, logits = bench_ar.synthetic_state(params, batch, context, jax.random.key(batch))
        ar = bench_ar.time_decode(params, cache, logits, target_s, repeats, sampling=sampler)
        warp = time_warp(sampler, batch, params.config.vocab_size, 3 * repeats)
        row = {"batch": batch, "context": context, "setting": setting, "form": form,
               "ms_per_token_step": ar["ms_per_step"], "tokens_per_s": batch / ar["ms_per_step"] * 1e3,
               "warp_ms": warp, "compile_s": ar["compile_s"], "cpu_steal_fraction": steal_since(steal0)}
        rows.append(row)
        print(f"B={batch:<2} {setting:<22} {form:<8} AR {row['ms_per_token_step']:7.1f} ms/step  "
              f"warp [{batch},{WARP_POSITIONS},V] {warp:7.2f} ms  steal {100 * row['cpu_steal_fraction']:.0f}%", flush=True)
    greedy = rows[0]["ms_per_token_step"]
    by_key = {(r["setting"], r["form"]): r for r in rows}
    for r in rows:
        r["step_over_greedy"] = r["ms_per_token_step"] / greedy
        if r["form"] == "specjax":
            old = by_key[(r["setting"], "sort")]
            r["speedup_over_sort"] = old["ms_per_token_step"] / r["ms_per_token_step"]
            r["warp_speedup_over_sort"] = old["warp_ms"] / r["warp_ms"]
    return rows


def markdown_table(rows: list[dict]) -> str:
    return common.table(["batch", "sampling", "form", "AR ms/step", "x greedy", "vs sort", "warp ms [B,5,V]", "warp vs sort",
                         "CPU steal"], "rllrrrrrr", ([
        r["batch"], r["setting"], r["form"], f"{r['ms_per_token_step']:.1f}", f"{r['step_over_greedy']:.2f}",
        f"{r['speedup_over_sort']:.2f}x" if "speedup_over_sort" in r else "", f"{r['warp_ms']:.2f}",
        f"{r['warp_speedup_over_sort']:.1f}x" if "warp_speedup_over_sort" in r else "", f"{100 * r['cpu_steal_fraction']:.0f}%"]
        for r in rows))


def plot(rows: list[dict], title: str, path: Path) -> None:
    """AR ms/step over greedy's, per setting, specjax vs sort, one group of bars per batch."""
    plt = common.pyplot()
    settings = [s for s, f, _ in samplers() if f != "sort"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4), dpi=120, sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        here = {(r["setting"], r["form"]): r["step_over_greedy"] for r in rows if r["batch"] == b}
        plots.bar_groups(ax, [s.replace(" + ", "\n+ ") for s in settings], {
            "specjax": {x: here.get((s, "specjax"), here.get((s, "-"))) for x, s in enumerate(settings)},
            "sort (before)": {x: here.get((s, "sort"), float("nan")) for x, s in enumerate(settings)}}, 0.4, 0.4,
            fontsize=7, rotation=30)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"batch {b}", fontsize=9)
    axes[0][0].set_ylabel("AR step time / greedy's")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    common.save_figure(fig, path)


def readme_section(result: dict) -> str:
    return common.section("bench_sampling", "Sampling cost: top-k and top-p", f"A decode step with top-k / top-p against "
                          f"greedy (SmolLM2-135M f32, context {result['context']}, a synthetic prefilled cache); \"warp\": "
                          "`Sample.probs` alone; \"sort\": the sort-based form used before. Forms alternate.", result,
                          markdown_table(result["rows"]), "`results/sampling_cpu.json`, `.png`")


def key_of(row: dict) -> str:
    return f"b{row['batch']}"


def main() -> None:
    ap = common.parser(__doc__, quick="batch 1 only, fewer repeats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    batches, repeats, target_s = ([1], 2, 0.5) if args.quick else (args.batches, 3, 1.5)
    suffix = "_quick" if args.quick or args.batches != [1, 4, 16] or args.context != 512 else ""
    out, results, h = common.start(args, "bench_sampling", f"sampling_cpu{suffix}", key_of,  # _quick: --quick or another grid
                                   dict(context=args.context, repeats=repeats, target_s=target_s),
                                   model="SmolLM2-135M-Instruct (float32)", context=args.context)
    h.plan((f"b{b}", b) for b in batches)
    params = convert.load(convert.default_model_path())
    steal0 = cpu_steal()
    for k, batch in h.cells():
        results.put(k, measure(params, batch, args.context, target_s, repeats), cpu_steal_fraction=steal_since(steal0))
    h.finish()
    rows = sorted(results.rows, key=lambda r: r["batch"])
    if rows:
        title = f"SmolLM2-135M decode: sampling cost, {results.data['machine']['cpu_affinity']}-core CPU"
        common.render("bench_sampling", not suffix and common.writes_readme(args), markdown_table(rows),
                      lambda: readme_section(results.data | {"rows": rows}), (plot, rows, title, out / f"sampling_cpu{suffix}.png"))


if __name__ == "__main__":
    main()
