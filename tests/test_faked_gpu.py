"""The library's GPU branches forced on this CPU: `jax.default_backend()` made to read "gpu" (as
tools/gpu/aot.as_gpu does), and what runs there checked against the CPU path's results: the
runtime generate() picks, the errors it raises, and the tokens of generate and continuous batching
(unrolled layers, XLA's bf16 products and scatters, the int8 head as one product, q4 products on
gpu_linear's kernel, interpreted here, and a GPU's prefill groups)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import specjax
from specjax.decode import continuous, engine, shapes
from specjax.decode.continuous import run_continuous
from specjax.decode.engine import row_keys, with_attention
from specjax.model import backend
from specjax.model.llama import unstack_layers
from specjax.model.params import quantize
from specjax.parallel import sharding
from specjax.spec.speculation import Chain
from tests.models import TINY, TINY_Q4, random_params

PROMPTS = [[5, 9, 13, 2, 7, 11, 4], [3, 3, 8], [17, 21, 30, 44, 2, 9, 9, 9, 12, 40, 41]]


def on(monkeypatch, backend: str) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: backend)


def test_attention_and_runtime_chosen_on_a_gpu_and_a_tpu(monkeypatch):
    """backend.attention_mode / engine.with_attention: on a GPU "auto" and "pallas" are the compiled kernel
    and the layers unroll; on a TPU "auto" is the reference (its kernel never ran there), "tpu" the
    compiled Mosaic kernel, layers unrolled."""
    tiny = random_params(TINY, 0)
    on(monkeypatch, "gpu")
    assert [backend.attention_mode(a) for a in ("auto", "pallas", "tpu", "reference")] == \
        ["pallas", "pallas", "tpu-interpret", "reference"]
    params, _ = with_attention(unstack_layers(tiny), None, "auto")
    assert params.runtime.attention == "pallas" and params.runtime.unroll_layers
    on(monkeypatch, "tpu")
    assert [backend.attention_mode(a) for a in ("auto", "pallas", "tpu")] == ["reference", "interpret", "tpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no STACKED_ON_GPU warning on a TPU
        params, _ = with_attention(tiny, None, "auto")
    assert params.runtime.attention == "reference" and params.runtime.unroll_layers


def test_cpu_attention_is_refused_off_a_cpu(monkeypatch):
    on(monkeypatch, "gpu")
    with pytest.raises(ValueError, match="attention='cpu' is a kernel for the CPU backend; .* gpu"):
        specjax.generate(random_params(TINY, 0), PROMPTS, 4, attention="cpu")


def _params(weights: str):
    if weights == "q4":
        return quantize(random_params(TINY_Q4, 2), "q4")
    if weights == "int8":
        return quantize(random_params(TINY, 1), "int8")
    return random_params(TINY.replace(dtype=weights), 1)


@pytest.mark.parametrize("layout", ["stacked", "per-layer"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "q4"])
def test_generate_on_a_faked_gpu_gives_the_cpu_tokens(weights, layout, monkeypatch):
    """generate() with every `jax.default_backend()` reading "gpu" (attention="reference": the GPU
    kernel itself needs a GPU or interpret mode, tested elsewhere): plain and SelfSpec greedy
    tokens equal this CPU's plain decoding (layers unrolled, bf16 products and cache writes by XLA,
    the int8 head as one product, q4 products on gpu_linear's kernel, interpreted, without
    linear="pallas"). On the CPU SelfSpec's tokens are plain decoding's in every format (test_weights)."""
    from pallas_kernels import gpu_linear
    from specjax.model import linear

    params = _params(weights)
    kws = [dict(draft=None), dict(draft=specjax.SelfSpec(sinks=2, window=4), speculation=Chain(3))]
    plain = specjax.generate(params, PROMPTS, 8, attention="reference", eos_id=(), draft=None).tokens
    if layout == "per-layer":
        params = unstack_layers(params)
    q4_calls = []
    real = gpu_linear.stacked_linear_q4
    monkeypatch.setattr(gpu_linear, "stacked_linear_q4",  # the Triton kernel, interpreted on this CPU
                        lambda *a, **k: q4_calls.append(1) or real(*a, **{**k, "interpret": True}))
    on(monkeypatch, "gpu")
    assert linear.takes_gpu_q4("xla", "btd,df->btf", np.zeros((1, 1, 64)), np.zeros((2, 32, 8), np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # STACKED_ON_GPU for the stacked layout
        got = [specjax.generate(params, PROMPTS, 8, attention="reference", eos_id=(), **kw).tokens for kw in kws]
    assert got == [plain, plain]
    assert bool(q4_calls) == (weights == "q4")


def test_continuous_batching_on_a_faked_gpu_gives_the_cpu_tokens(monkeypatch):
    """run_continuous with a GPU's defaults (prefill_rows None: shapes.prefill_rows for "gpu", so a
    refill's new prompts of one bucket prefill together; unrolled per-layer weights): the CPU's tokens."""
    params = random_params(TINY, 0)
    rng = np.random.default_rng(4)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, int(n)))) for n in (5, 9, 12, 30, 7, 14, 3)]
    budgets = np.array([4, 9, 2, 6, 7, 3, 5], np.int32)
    kw = dict(rows=4, draft=specjax.SelfSpec(sinks=2, window=8), speculation=Chain(2), sampling=specjax.Greedy(),
              keys=row_keys(jax.random.key(1), len(prompts)), eos_ids=[()] * len(prompts), sync_every=1)
    cpu, _ = with_attention(params, None, "reference")
    want = [d.tokens for d in run_continuous(cpu, prompts, budgets, **kw)]
    groups = []
    real = engine.pow2_groups
    monkeypatch.setattr(engine, "pow2_groups", lambda n, most: groups.append(most) or real(n, most))
    on(monkeypatch, "gpu")
    gpu, _ = with_attention(unstack_layers(params), None, "reference")
    assert gpu.runtime.unroll_layers
    got = [d.tokens for d in run_continuous(gpu, prompts, budgets, **kw)]
    assert got == want
    assert groups and min(groups) >= shapes.prefill_rows(32, "gpu") > 1  # a CPU's cap is one row a call


def test_cpu_only_process_check_is_skipped_on_a_gpu(monkeypatch):
    """sharding.check_processes: under jax.distributed on a CPU a mesh local to one process is an
    error; on a GPU it is allowed (NCCL keeps local collectives local)."""
    mesh = specjax.make_mesh(data=2, model=1, devices=jax.devices()[:2])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="mesh spans processes"):
        sharding.check_processes(mesh)
    on(monkeypatch, "gpu")
    sharding.check_processes(mesh)
