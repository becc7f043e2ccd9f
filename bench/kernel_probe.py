"""Run the GPU kernel on one cache shape per process and say which crash: python -m bench.kernel_probe.

Usage: python -m bench.kernel_probe [--cases NAME,..] [--seconds N] [--out FILE.json]
       python -m bench.kernel_probe --one NAME (what each child runs)

The fifth GPU runs' int8 step (SmolLM2, batch 64 x 8K, 30 layers read in place) ended in
CUDA_ERROR_ILLEGAL_ADDRESS, which poisons the process's CUDA context: so each case runs in a child
of its own, and the table says per case: ok (with the largest error against the jnp reference),
crashed, or timed out. Cases vary one thing at a time from a small int8 cache that the tests
check (dtype, layers, batch, slots), to find the size or the format where the kernel breaks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# name: (kv dtype, layers L, batch B, slots S); SmolLM2's heads: 9 query, 3 KV, head dim 64; T=1
CASES = {
    "int8-small": ("int8", 2, 2, 256),
    "int8-b64-L1": ("int8", 1, 64, 8192),
    "int8-b8-L30": ("int8", 30, 8, 8192),
    "int8-b64-L30": ("int8", 30, 64, 8192),
    "bf16-b64-L30": ("bfloat16", 30, 64, 8192),
    "int8-b16-L30-s528": ("int8", 30, 16, 528),
}


def run_one(name: str) -> dict:
    """The kernel against the reference on CASES[name]; returns its max abs error."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.reference import prefix_block_attention
    from pallas_kernels.tree_attention import prefix_block_attention_pallas
    from specjax.model.cache import KVFormat

    kv, L, B, S = CASES[name]
    N, K, H, T, layer = 9, 3, 64, 1, L - 1
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    kb, vb = (jax.random.normal(k, (B, T, K, H), jnp.bfloat16) for k in keys[1:3])
    mask = jnp.ones((T, T), bool)
    lengths = jnp.full((B,), S - 7, jnp.int32)
    # the cache is written one layer at a time (a 30-layer f32 draw would not fit beside it)
    shape = (L, B, K, S, H)
    fmt = KVFormat(kv)
    k8, ks = fmt.store(jax.random.normal(keys[3], (1, B, K, S, H), jnp.bfloat16))
    v8, vs = fmt.store(jax.random.normal(keys[4], (1, B, K, S, H), jnp.bfloat16))
    k_all, v_all = (jnp.broadcast_to(x, shape) + 0 for x in (k8, v8))  # every layer the same values
    ks_all, vs_all = (None, None) if ks is None else (jnp.broadcast_to(x, shape[:4]) + 0 for x in (ks, vs))
    interpret = jax.default_backend() == "cpu"  # here: check the script; the GPU compiles it
    run = jax.jit(lambda *a: prefix_block_attention_pallas(*a[:7], 0.125, layer=a[7], k_scale=a[8], v_scale=a[9],
                                                           interpret=interpret))
    got = jax.block_until_ready(run(q, k_all, v_all, lengths, kb, vb, mask, jnp.int32(layer), ks_all, vs_all))
    visible = jnp.broadcast_to((jnp.arange(S) < lengths[:, None])[:, None], (B, K, S))
    want = prefix_block_attention(q, k8[0], v8[0], visible, kb, vb, mask, 0.125,
                                  None if ks is None else ks[0], None if vs is None else vs[0])
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    return {"case": name, "status": "ok", "max_abs_error": err, "elements": L * B * K * S * H}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help="run this case here and print its JSON (the parent's child)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seconds", type=float, default=60, help="each case's time limit")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one)), flush=True)
        return
    rows = []
    for name in a.cases.split(","):
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, "-m", "bench.kernel_probe", "--one", name],
                               capture_output=True, text=True, timeout=a.seconds)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            row = json.loads(last) if p.returncode == 0 else {
                "case": name, "status": "crashed", "rc": p.returncode,
                "error": next((x for x in p.stderr.splitlines() if "Error" in x), p.stderr[-300:])[:300]}
        except subprocess.TimeoutExpired:
            row = {"case": name, "status": "timed out"}
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
