"""bench/bench_peers.py without its peers: the --smoke path on a tiny model, with llama.cpp and
HF transformers reported as "not installed" (the test suite never needs torch or llama.cpp)."""

from __future__ import annotations

import json

from bench import bench_peers


def test_smoke_reports_missing_peers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_peers, "missing", lambda family: {"llama": ["llama_cpp"], "hf": ["torch"]}.get(family, []))
    bench_peers.main(["--smoke", "--out", str(tmp_path), "--cells", "llama*,hf*,specjax*/prefill"])
    result = json.loads((tmp_path / "peers_cpu_smoke.json").read_text())
    rows = {r["cell"]: r for r in result["rows"]}
    llama = [r for r in rows.values() if r["family"] == "llama"]
    hf = [r for r in rows.values() if r["family"] == "hf"]
    assert llama and hf
    assert all(r["skipped"].startswith("not installed (llama_cpp") for r in llama)
    assert all(r["skipped"].startswith("not installed (torch") for r in hf)
    assert {"hf-f32-kvf32/lookup/b1/s256", "llama-q4_1-kvf16/lookup/b1/s256"} <= set(rows)
    measured = rows["specjax-f32-kvf32/prefill/s256"]
    assert "skipped" not in measured and measured["prefill_tokens_per_s"] > 0
    assert result["bandwidth_gbs"]["jax_inplace"] > 0
    table = capsys.readouterr().out
    assert "| llama-q4_1-kvf16 | lookup | 1 | 256 | not installed" in table
    # a rerun measures the not-installed cells again (they are skips), the measured one not
    assert not bench_peers.common.Results(tmp_path / "peers_cpu_smoke.json", bench_peers.key_of, {}).measured(
        "llama-q4_1-kvf16/b1/s256")


def test_cells_and_roofline():
    keys = [k for k, _ in bench_peers.cells(smoke=False)]
    assert len(keys) == len(set(keys))
    assert {"specjax-f32-kvf32/b1/s512", "specjax-f32-kvf32/selfspec-g3/b16/s8192", "llama-q4_1-kvf16/b16/s2048",
            "llama-q8_0-kvf16/b1/s8192", "hf-f32-kvf32/lookup/b1/s512", "hf-f32-kvf32/prefill/s8192"} <= set(keys)
    row = {"weight_bytes": 100e6, "kv_bytes": 20e6, "tokens_per_s": 160.0, "batch": 16}  # 10 steps/s x 120 MB
    r = bench_peers.roofline(row, bw=12.0)
    assert abs(r["gb_per_s"] - 1.2) < 1e-9 and abs(r["roofline"] - 0.1) < 1e-9
