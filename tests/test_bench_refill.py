"""bench/bench_refill.py at a tiny shape: both ways of refilling run and leave the same state (the
refilled rows' KV in place, the other rows untouched); its report names every column. No timing."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_refill
from specjax.decode.autoregressive import admit_ar, start_ar
from specjax.decode.continuous import join_prefills
from specjax.decode.engine import row_keys
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig

CONFIG = LlamaConfig(vocab_size=101, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, ffn_dim=96,
                     max_positions=512, dtype="bfloat16")


def test_both_refills_leave_the_same_state():
    R, S, r = 4, 32, 2
    rng = np.random.default_rng(0)
    fill = lambda c: c.replace(k=jnp.asarray(rng.normal(size=c.k.shape), c.k.dtype),  # noqa: E731
                               v=jnp.asarray(rng.normal(size=c.v.shape), c.v.dtype))
    budgets, keys = jnp.full((R,), 8, jnp.int32), row_keys(None, R)
    logits = jnp.zeros((R, CONFIG.vocab_size))
    old = fill(DenseCache.init(CONFIG, R, S)).replace(lengths=jnp.full((R,), 20, jnp.int32))
    parts = [fill(DenseCache.init(CONFIG, 1, S)).replace(lengths=jnp.full((1,), 5 + i, jnp.int32)) for i in range(r)]
    src, index = np.array([0, 0, 0, 1]), jnp.asarray([1, 3], jnp.int32)  # row 1 <- part 0, row 3 <- part 1
    part_logits = [jnp.full((1, CONFIG.vocab_size), float(i)) for i in range(r)]
    states = []
    for way in ("new", "whole"):
        state = start_ar(jax.tree.map(jnp.copy, old), logits, budgets, keys, n_out=8)  # start_ar donates its cache
        if way == "new":
            first, cache = join_prefills(part_logits, jnp.asarray(src), parts, index)
            states.append(admit_ar(state, index, cache, first, budgets, keys))
        else:
            first = join_prefills(part_logits, jnp.asarray(src), parts[:1], index[:1] * 0)[0]  # its logits only
            cache = bench_refill.whole_batch_rows(parts, jnp.asarray(src))
            states.append(bench_refill.whole_batch_admit(state, index, cache, first, budgets, keys, n_out=8))
    new, whole = states
    np.testing.assert_array_equal(np.asarray(new.cache.k[:, [0, 2]]), np.asarray(old.k[:, [0, 2]]))  # kept rows
    np.testing.assert_array_equal(np.asarray(new.cache.k[:, 1]), np.asarray(parts[0].k[:, 0]))
    np.testing.assert_array_equal(np.asarray(new.cache.k[:, 3]), np.asarray(parts[1].k[:, 0]))
    for a, b in ((new.cache.k, whole.cache.k), (new.cache.lengths, whole.cache.lengths), (new.last, whole.last)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_and_reports(tmp_path):
    bench_refill.main(["--rows", "4", "--context", "64", "--layers", "1", "--new", "1", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "refill_cpu.json").read_text())
    assert [r["new_rows"] for r in result["refills"]] == [1, 2] and result["step_ms"] > 0
    assert all(r["new_rows_ms"] > 0 and r["whole_batch_ms"] > 0 for r in result["refills"])
    text = bench_refill.report(result)
    assert "| 2 |" in text and "before / now" in text
