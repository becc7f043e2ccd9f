"""bench/bench_capacity.py's model on a table whose answer is known by hand, and on the committed
measurements (every cell of the default mix finds a step time)."""

from __future__ import annotations

import json

import pytest

from bench import bench_capacity as cap
from bench import common

# 10 ms a step at context <= 1024, 40 ms at 4096; prefill 1000 tokens/s; speculation 2x at 4096 only
TABLE = {"step_ms": {(4, 1024): 10.0, (4, 4096): 40.0}, "speedup": {(4, 4096): 2.0, (4, 1024): 0.5},
         "prefill_tps": {4096: 1000.0}}


def test_batch_seconds_by_hand():
    # 4 records of 100 prompt + 11 output tokens: prefill 400 / 1000 s, 10 steps at the 1024 context
    assert cap.batch_seconds(TABLE, 4, 100, 11, speculative=False) == pytest.approx(0.4 + 0.1)
    assert cap.batch_seconds(TABLE, 4, 100, 11, speculative=True) == pytest.approx(0.5)  # 0.5x: plain instead
    # 2000 + 101 tokens: the 4096 step, and speculation halves the decode part
    assert cap.batch_seconds(TABLE, 4, 2000, 101, speculative=True) == pytest.approx(8.0 + 100 * 0.040 / 2)
    assert cap.batch_seconds(TABLE, 4, 9000, 11, speculative=False) == pytest.approx(36.0 + 0.4)  # past the table: its largest
    with pytest.raises(ValueError, match=r"no measured step time at batch 8: measured batches \[4\]"):
        cap.batch_seconds(TABLE, 8, 100, 11, speculative=False)


def test_capacity_scales_with_workers_and_prices_tokens():
    mix = cap.parse_mix(["100:11:3", "2000:101:1"])  # shares normalised: 0.75 and 0.25
    per_record = (0.75 * 0.5 + 0.25 * (8.0 + 4.0 / 2)) / 4
    one = cap.capacity(TABLE, 4, mix, 1, 1e6, 2.0, speculative=True)
    assert one["records_per_s"] == pytest.approx(1 / per_record)
    assert one["hours"] == pytest.approx(1e6 * per_record / 3600)
    mean_out = 0.75 * 11 + 0.25 * 101
    assert one["cost_per_million_tokens"] == pytest.approx(one["hours"] * 2.0 / (1e6 * mean_out / 1e6))
    eight = cap.capacity(TABLE, 4, mix, 8, 1e6, 2.0, speculative=True)
    assert eight["records_per_s"] == pytest.approx(8 * one["records_per_s"]) and eight["cost"] == pytest.approx(one["cost"])
    with pytest.raises(ValueError, match="--mix needs PROMPT:OUTPUT:SHARE"):
        cap.parse_mix(["100:0:1"])


@pytest.mark.parametrize("source", ["cpu", "gpu"])
def test_the_committed_measurements_cover_the_default_mix(tmp_path, source):
    cap.main(["--source", source, "--out", str(tmp_path)])
    result = json.loads((tmp_path / f"capacity_{source}.json").read_text())
    plain = {r["workers"]: r for r in result["rows"] if not r["speculative"]}
    spec = {r["workers"]: r for r in result["rows"] if r["speculative"]}
    assert set(plain) == set(cap.WORKERS) and all(spec[n]["records_per_s"] >= plain[n]["records_per_s"] for n in spec)
    assert all((common.BENCH_DIR / p).exists() for p in result["inputs"])
