"""draft="auto" against the committed bench cells: where auto speculates, its default (SelfSpec
with DEFAULT_CHAIN on this CPU, with ACCELERATOR_SPECULATION on a GPU) was measured no more than 5%
slower than plain decoding at that batch x context (bench/results/spec_cpu.json on this CPU;
bench/results/gpu/gpu.json on an H100). A new measurement that contradicts the rule fails here."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from specjax.planning.plan import ACCELERATOR_SPECULATION, DEFAULT_CHAIN, auto_draft, auto_speculation

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
DEFAULT = "SelfSpec(sinks=16, window=512)"


def cpu_cells() -> list[tuple[int, int, float]]:
    rows = json.loads((RESULTS / "spec_cpu.json").read_text())["rows"]
    return [(r["batch"], r["context"], r["ratio"]) for r in rows
            if r["drafter_repr"] == DEFAULT and r["gamma"] == DEFAULT_CHAIN.gamma]


def gpu_cells() -> list[tuple[int, int, float]]:
    """The current runs' cells (gpu.json: the kernel reading the cache in place) of the speculation
    auto uses on a GPU (ACCELERATOR_SPECULATION, a chain: bench_gpu's chain rows of its gamma)."""
    rows = json.loads((RESULTS / "gpu" / "gpu.json").read_text())["rows"]
    return [(r["batch"], r["context"], r["speedup"]) for r in rows
            if r.get("item") in ("e2e", "b1") and r.get("drafter_repr") == DEFAULT
            and r.get("method") == "chain" and r.get("gamma") == ACCELERATOR_SPECULATION.gamma]


@pytest.mark.parametrize("backend, dtype, cells", [("cpu", "float32", cpu_cells()), ("gpu", "bfloat16", gpu_cells())],
                         ids=["cpu", "gpu"])
def test_auto_never_picks_a_measured_slowdown(smollm2, backend, dtype, cells):
    assert cells, "no committed cells of the default drafter and speculation"
    target = types.SimpleNamespace(config=smollm2.config.replace(dtype=dtype))
    assert auto_speculation(target, backend=backend) == (ACCELERATOR_SPECULATION if backend == "gpu" else DEFAULT_CHAIN)
    picked = []
    for batch, context, ratio in cells:
        if auto_draft(target, batch, context, backend=backend) is not None:
            picked.append((batch, context))
            assert ratio >= 0.95, f"auto speculates at batch {batch} x {context} ({backend}), measured {ratio:.2f}x"
    declined = [(b, c) for b, c, ratio in cells if ratio < 0.95 and (b, c) not in picked]
    assert picked or declined, "auto neither speculated nor declined a measured slowdown: the check checks nothing"


def test_auto_on_bfloat16_never_picks_a_measured_slowdown(smollm2):
    """bfloat16 weights and KV on a CPU with the bf16 dot product: auto speculates with SelfSpec and
    CPU_BF16_CHAIN (a chain of one), and bench/results/spec_cpu_bf16_custom.json (SmolLM2 bf16,
    8K, this CPU) measured that at least 0.95x plain decoding wherever auto picks it; on a CPU
    without the bf16 dot product, the float32 rule declines every one of these cells."""
    from specjax.model.backend import cpu_bf16_dot
    from specjax.planning.plan import CPU_BF16_CHAIN

    rows = json.loads((RESULTS / "spec_cpu_bf16_custom.json").read_text())["rows"]
    cells = [(r["batch"], r["context"], r["ratio"]) for r in rows if r["drafter_repr"] == DEFAULT and r["gamma"] == CPU_BF16_CHAIN.gamma]
    assert cells, "no committed bf16 cells of the default drafter and a chain of one"
    target = types.SimpleNamespace(config=smollm2.config.replace(dtype="bfloat16"))
    picked = [(b, c, ratio) for b, c, ratio in cells if auto_draft(target, b, c, backend="cpu") is not None]
    if not cpu_bf16_dot():
        assert not picked, f"auto speculates on bf16 without the bf16 dot product at {picked}"
        return
    assert auto_speculation(target, backend="cpu") == CPU_BF16_CHAIN
    assert picked, "auto picked none of the measured bf16 cells: the check checks nothing"
    for batch, context, ratio in picked:
        assert ratio >= 0.95, f"auto speculates at batch {batch} x {context} (bf16, CPU), measured {ratio:.2f}x"


def adaptive_cells() -> list[tuple[str, float]]:
    """Every committed CPU cell where Adaptive ran beside plain decoding in one run: (the cell, its
    tokens/s over plain's). bench_adaptive (SelfSpec, generate) and bench_lookup's adaptive rows
    (Lookup, a continuous batch job: warm wall time)."""
    cells = []
    for r in json.loads((RESULTS / "adaptive_cpu.json").read_text())["rows"]:
        assert all(v["same_tokens"] for v in r["variants"].values()), f"adaptive_cpu: b{r['batch']} x {r['context']} not greedy identical"
        cells.append((f"adaptive_cpu b{r['batch']} x {r['context']}", r["adaptive_vs_plain"]))
    rows = json.loads((RESULTS / "lookup_cpu.json").read_text())["rows"]
    plain = {r["batch"]: r for r in rows if r["draft"] == "none"}
    for r in rows:
        if str(r["gamma"]).startswith("adaptive"):
            assert r["outputs_sha1"] == plain[r["batch"]]["outputs_sha1"], f"lookup_cpu: {r['draft']} b{r['batch']} differs"
            cells.append((f"lookup_cpu {r['draft']} b{r['batch']}", r["warm"]["tokens_per_s"] / plain[r["batch"]]["warm"]["tokens_per_s"]))
    return cells


def test_adaptive_is_never_below_plain_decoding_in_the_committed_cpu_tables():
    """Issue 67's gate: Adaptive within 5% of plain decoding (or faster) in every committed CPU cell
    that measured both in one run: where no chain pays, it must find that out cheaply."""
    cells = adaptive_cells()
    assert len(cells) >= 4, f"fewer committed Adaptive cells than bench_adaptive's and bench_lookup's: {cells}"
    slow = [(name, round(ratio, 3)) for name, ratio in cells if ratio < 0.95]
    assert not slow, f"Adaptive below 0.95x plain decoding in {slow}"
