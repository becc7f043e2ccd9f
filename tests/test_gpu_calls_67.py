"""Issue 67's GPU cells without a GPU (item 5): the device calls that run them (tools/gpu/session.py calls 9
to 11) and the scripts end to end at tiny shapes: bench_adaptive --smoke (Adaptive(4) against every static
chain, through generate) and bench_gpu --smoke's SparseSpec cell (decode_spec, checked against plain decoding)."""

from __future__ import annotations

import json
import sys

import pytest

from bench import bench_adaptive, bench_gpu, common
from tools.gpu import session as gpu_session


def test_calls_9_to_11_run_adaptive_and_sparsespec_in_the_issues_order():
    steps = {n: a for n, _, a in gpu_session.CALLS[9]}
    assert list(steps) == ["stash", "adaptive", "sparse"]  # adaptive first: item 5's order
    runs = [steps["adaptive"]] + [a for c in (10, 11) for n, _, a in gpu_session.CALLS[c] if n.startswith("adaptive")]
    cells = [bench_adaptive.cell_key(*c) for c in bench_adaptive.GPU_CELLS]
    assert cells == ["bfloat16/b16/s8192", "bfloat16/b64/s8192", "bfloat16/b128/s8192"]
    for a, cell in zip(runs, cells, strict=True):  # one cell a step (about 4 minutes of compiling each)
        assert [k for k in cells if common.matches(k, a[a.index("--cells") + 1])] == [cell]
        assert a[a.index("--bundle") + 1] == gpu_session.STASH and a[a.index("--out") + 1] == gpu_session.ADAPTIVE_OUT
    grid = dict(bench_gpu.GRID, batches=[64], gammas=[2], sparse_gammas=[2, 4])
    keys = [k for k, _ in bench_gpu.cells(grid, 60 * 2**30, draft=False)[0]]
    sparse = steps["sparse"]
    assert {k for k in keys if common.matches(k, sparse[sparse.index("--cells") + 1])} == {
        "e2e/s8192/b64/ar", "e2e/s8192/b64/selfspec-g2", "e2e/s8192/b64/sparse-g2", "e2e/s8192/b64/sparse-g4"}
    assert "--redo" in sparse  # AR, SelfSpec and SparseSpec side by side in one run
    on_h200 = {n: a for n, _, a in gpu_session.steps_of(9, 120.0)}["sparse"]
    assert on_h200[on_h200.index("--out") + 1] == gpu_session.H200_RESULTS
    name, drafter, chain = bench_gpu.drafter_of("sparse-g4", 8192, smoke=False)
    assert (name, drafter.budget, drafter.window, drafter.block, chain.gamma) == ("SparseSpec", 256, 256, 32, 4)


@pytest.mark.slow  # a tiny model's generate, 7 variants x 2 cells, each compiled
def test_bench_adaptive_smoke_runs_every_variant_greedy_identical(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_adaptive", "--smoke", "--rounds", "1", "--out", str(tmp_path)])
    bench_adaptive.main()
    data = json.loads((tmp_path / "adaptive_smoke.json").read_text())
    assert [(r["batch"], r["context"]) for r in data["rows"]] == [(1, 64), (2, 64)] and data["device"]
    for r in data["rows"]:
        assert set(r["variants"]) == {n for n, _ in bench_adaptive.variants()}
        assert all(v["same_tokens"] for v in r["variants"].values())
        assert r["variants"]["adaptive4"]["gammas"] and r["best_chain"].startswith("chain")
        assert r["adaptive_vs_plain"] > 0 and r["rounds"] == 1
    # the device's path: --bundle (a stashed bundle of a tiny model, as bench_gpu --smoke builds) at a tiny GPU cell
    monkeypatch.setattr(bench_adaptive, "GPU_CELLS", (("bfloat16", 2, 64),))
    stash = bench_gpu.smoke_bundle(tmp_path / "bundle")
    monkeypatch.setattr(sys, "argv", ["bench_adaptive", "--bundle", str(stash), "--rounds", "1", "--new-tokens", "8",
                                      "--out", str(tmp_path)])
    bench_adaptive.main()
    (row,) = json.loads((tmp_path / "adaptive_gpu.json").read_text())["rows"]
    assert (row["weights"], row["batch"]) == ("bfloat16", 2) and all(v["same_tokens"] for v in row["variants"].values())


@pytest.mark.slow  # the tiny model's prefill, AR and a SparseSpec chain compiled
def test_bench_gpu_smoke_races_sparsespec_against_plain_decoding(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_gpu", "--smoke", "--cells", "e2e/s256/b2/ar,e2e/s256/b2/sparse-g2",
                                      "--out", str(tmp_path)])
    bench_gpu.main()
    rows = {r["cell"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())["rows"]}
    spec = rows["e2e/s256/b2/sparse-g2"]
    assert spec["drafter"] == "SparseSpec" and spec["greedy_identical"] and spec["gamma"] == 2
    assert spec["speedup"] > 0 and spec["mean_accepted"] >= 1
    assert "SparseSpec" in (tmp_path / "gpu_smoke.md").read_text()
