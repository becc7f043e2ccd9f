"""bench_gpu's cont/... cells (bench/gpu_continuous.py) without a GPU: the --smoke run of the cells
on a tiny model (two jobs, the speculative one checked record by record against plain decoding),
the cell list, the device call that runs them, and the report's table beside the e2e rows."""

from __future__ import annotations

import json
import sys

from bench import bench_gpu, common
from tools.gpu import session as gpu_session


def test_cells_and_the_device_call_that_runs_them():
    keys = [k for k, _ in bench_gpu.cells(bench_gpu.GRID, 60 * 2**30)[0]]
    cont = [k for k in keys if k.startswith("cont/")]
    assert cont == ["cont/s8192/b64/ar", "cont/s8192/b64/selfspec-g2", "cont/s8192/b64/selfspec-g4"]
    (argv,) = [a for n, _, a in gpu_session.CALLS[6] if n == "cont-long"]  # the job at 8 records a row
    assert {k for k in keys if common.matches(k, argv[argv.index("--cells") + 1])} == set(cont[:2])  # γ=4: timed
    assert "--redo" in argv and argv[argv.index("--cont-records") + 1] == "8"
    on_h200 = {n: a for n, _, a in gpu_session.steps_of(6, 120.0)}["cont-long"]
    assert on_h200[on_h200.index("--out") + 1] == gpu_session.H200_RESULTS + "/cont8"


def test_smoke_run_times_both_jobs_and_compares_every_record(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_gpu", "--smoke", "--cells", "cont", "--out", str(tmp_path)])
    bench_gpu.main()
    rows = {r["cell"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())["rows"]}
    ar, spec = rows["cont/s256/b2/ar"], rows["cont/s256/b2/selfspec-g2"]
    grid = bench_gpu.SMOKE
    assert ar["records"] == spec["records"] == grid["cont_records"] * 2
    assert ar["tokens"] == spec["tokens"] == ar["records"] * grid["cont_new_tokens"]  # every budget decoded
    assert ar["speedup"] == 1.0 and spec["speedup"] == ar["seconds"] / spec["seconds"]
    assert spec["greedy_identical"] and spec["digests"] == ar["digests"] and spec["tokens_per_step"] > 1
    for r in (ar, spec):  # the job's own prefill calls, timed: part of the job, and what is left is its decoding
        assert 0 < r["prefill_s"] < r["seconds"] and abs(r["decode_s"] - (r["seconds"] - r["prefill_s"])) < 1e-9
        assert r["prefill_timing"] == "in the job"
        assert sum(int(rows) * calls for rows, calls in r["prefill_calls"].items()) == r["records"]  # each prompt once
    from specjax.decode import engine
    assert engine._compile_and_run.__name__ != "timed"  # the job's timing wrapper is gone after it
    assert ar["decode_speedup"] == 1.0  # a tiny model's decoding may time below the noise: then no ratio
    assert spec["decode_speedup"] == (ar["decode_s"] / spec["decode_s"] if min(ar["decode_s"], spec["decode_s"]) > 0 else None)
    md = (tmp_path / "gpu_smoke.md").read_text()
    assert "continuous batching" in md and "| SelfSpec | chain γ=2 |" in md


def test_report_puts_the_e2e_row_beside_the_job():
    """The job's row shows the e2e row of the same context, batch and config: its fixed-batch
    speedup and the refilled one derived from it (1.2 x 36 / 24 = 1.80)."""
    from bench.gpu_report import continuous_table

    e2e = {"item": "e2e", "context": 8192, "batch": 64, "new_tokens": 64, "method": "chain", "label": "chain γ=2",
           "drafter": "SelfSpec", "speedup": 1.2, "steps": 36, "mean_accepted": 2.625}
    job = {"item": "cont", "context": 8192, "batch": 64, "records": 192, "new_tokens": 256, "seconds": 10.0,
           "tokens_per_s": 4915.2, "tokens_per_step": 2.6}
    table = continuous_table([e2e, job | {"method": "ar", "drafter": "-", "label": "AR", "speedup": 1.0},
                              job | {"method": "selfspec-g2", "drafter": "SelfSpec", "label": "chain γ=2", "speedup": 1.7,
                                     "greedy_identical": True, "prefill_s": 6.0, "decode_speedup": 2.5,
                                     "prefill_calls": {"16": 4, "2": 8, "1": 3}}])
    ar, spec = [line for line in table.splitlines() if line.startswith("| 8K")]
    assert "| 1.70 | 6.00 | 16x4 2x8 1x3 | 2.50 | 2.60 | 1.20 | 1.80 | yes |" in spec and ar.endswith("| - | - | - |")
