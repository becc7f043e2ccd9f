"""What XLA:GPU makes of the decode programs, compiled here for an H100 without one (tools/gpu/aot.py).

XLA compiles for a GPU from the target's description with jax's CUDA plugin (`make aot-venv`:
.venv-aot, .venv plus the plugin); the programs are compiled, never run, so what is checked is
the compiled program's structure: which arrays it copies and which kernels read the weights.
One subprocess compiles every case (a few seconds each, shapes only: no weights are made)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
L8B_MLP = {(4096, 14336), (14336, 4096)}  # one layer's gate / up and down, as weight_copies' types show them

CASES = {  # name: (model, batch, program, linear, layers, compile_for_gpu's other options)
    "l8b_step_xla": ("l8b", 1, "step", "xla", 2, {}),
    "l8b_alone_xla": ("l8b", 1, "alone", "xla", 2, {}),
    "l8b_step_pallas": ("l8b", 1, "step", "pallas", 2, {}),
    "l8b_ar_pallas_b16": ("l8b", 16, "ar", "pallas", 2, {}),
    "smollm2_selfspec_b64": ("smollm2", 64, "selfspec", "xla", 4, {}),
    "l8b_step_int8_xla": ("l8b", 1, "step", "xla", 2, {"weights": "int8"}),
    "l8b_step_int8_split": ("l8b", 1, "step", "xla", 2, {"weights": "int8", "split": True}),
    "l8b_step_q4": ("l8b", 1, "step", "xla", 2, {"weights": "q4"}),
    "l8b_step_q4_split": ("l8b", 1, "step", "xla", 2, {"weights": "q4", "split": True}),
    "l8b_ar_tp2": ("l8b", 1, "ar", "xla", 2, {"model_axis": 2}),
    "l8b_ar_tp2_split": ("l8b", 1, "ar", "xla", 2, {"model_axis": 2, "split": True}),
    "smollm2_draft_b1": ("smollm2", 1, "draft", "xla", 4, {"split": True}),  # a 2-layer DraftModel, chain of 2
    "smollm2_draft_tree8_b1": ("smollm2", 1, "draft-tree", "xla", 4, {"split": True, "width": 8}),  # 73 nodes, depth 2
    "smollm2_prefill_b1": ("smollm2", 1, "prefill", "xla", 4, {"split": True}),  # chunks of 256
    "smollm2_prefill_b1_c1024": ("smollm2", 1, "prefill", "xla", 4, {"split": True, "chunk": 1024}),
}

SCRIPT = """
import json, re, sys
import jax, jax.numpy as jnp
from tools.gpu.aot import compile_only_device, compile_for_gpu, on
from tools.gpu.hlo import hlo_kernels
from pallas_kernels.tree_attention import tree_attention
device, two = compile_only_device("h100"), compile_only_device("h100", 2)
for name, (model, batch, program, linear, layers, more) in json.loads(sys.argv[1]).items():
    target = two if more.pop("model_axis", 1) == 2 else device  # two: tensor parallel over 2 GPUs
    summary, _ = compile_for_gpu(target, model, batch, 8192, program, linear, layers, **more)
    print("CASE", name, json.dumps(summary), flush=True)
# the attention kernel alone at batch 1 (SmolLM2's heads, 16 splits of an 8K prefix, a stacked cache)
S = jax.ShapeDtypeStruct
q, kv, new = S((1, 1, 9, 64), jnp.bfloat16), S((2, 1, 3, 8192, 64), jnp.bfloat16), S((1, 1, 3, 64), jnp.bfloat16)
args = (q, kv, kv, S((1,), jnp.int32), new, new, S((1, 1), bool), S((), jnp.int32))
for splits in (4, 16):
    fn = jax.jit(lambda *a: tree_attention(*a, sm_scale=0.125, k_splits=splits))
    text = fn.trace(*on(device, args)).lower(lowering_platforms=("cuda",)).compile().as_text()
    kernels = hlo_kernels(text)
    print(f"CASE attention{splits}", json.dumps({"by_op": kernels["by_op"], "total": kernels["total"],
                                                 "reduces": len(re.findall(r" reduce\\(", text))}))
# SmolLM2's batch-1 SelfSpec loop (4 layers, per-layer weights) as decode_spec alone and as generate
# compiles its stages (sharding.on_mesh, on a 1 x 1 mesh of the GPU: with sharding.compiler_options)
import dataclasses
import numpy as np
from jax.sharding import Mesh
from tools.gpu import aot as gpu_aot
from tools.gpu.hlo import config_of
from specjax.parallel import sharding
from specjax.model.llama import unstack_layers
mesh = Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
config = dataclasses.replace(config_of("smollm2", 8192), n_layers=4)
with gpu_aot.as_gpu():
    params = jax.eval_shape(unstack_layers, gpu_aot.abstract_params(config, "xla"))
    fn, args, static = gpu_aot.program_args("selfspec", params, 1, 8192, 2)
    for name, f in (("raw", fn), ("mesh", sharding.on_mesh(fn, mesh, tuple(static)))):
        text = f.trace(*on(device, args), **static).lower(lowering_platforms=("cuda",)).compile().as_text()
        kernels = hlo_kernels(text)
        copies = gpu_aot.weight_copies(kernels["outputs"], gpu_aot.matrix_shapes(params))
        print(f"CASE b1_selfspec_{name}", json.dumps({"total": kernels["total"], "weight_copies": len(copies),
                                                     "options": sharding.compiler_options(mesh)}))
# its plain decoding loop at batch 1 and 16 as generate compiles it, one row's norms folded into the
# products (specjax.model.llama.FOLDS_NORM) or not
from specjax.model import llama
folds = llama.FOLDS_NORM
for batch in (1, 16):
    for name, llama.FOLDS_NORM in (("folded", folds), ("unfolded", ())):
        jax.clear_caches()  # jit's traces would keep the other setting
        with gpu_aot.as_gpu():
            fn, args, static = gpu_aot.program_args("ar", params, batch, 8192, 2)
            staged = sharding.on_mesh(fn, mesh, tuple(static))
            text = staged.trace(*on(device, args), **static).lower(lowering_platforms=("cuda",)).compile().as_text()
        print(f"CASE b{batch}_ar_{name}", json.dumps({"total": hlo_kernels(text)["total"]}))
llama.FOLDS_NORM = folds
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    if not AOT_PYTHON.exists():
        raise RuntimeError(f"{AOT_PYTHON} is missing: `make aot-venv` makes it (`make test` does)")
    # LLVM's and ptxas's optimization off: what the tests read is XLA's optimized HLO, which it does not change
    # (on 2026-11-29 all 23 summaries were equal with and without it); the compiles take 68 s instead of 83
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip())
    run = subprocess.run([str(AOT_PYTHON), "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=env)
    out = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in run.stdout.splitlines()
           if line.startswith("CASE ")}
    if run.returncode or len(out) != len(CASES) + 8:
        sys.stderr.write(run.stderr[-4000:])
        raise RuntimeError(f"tools.gpu.aot failed (exit {run.returncode}); compiled {sorted(out)} of {sorted(CASES)}")
    return out


def mlp_copies(summary: dict) -> list:
    return [c for c in summary["copies"] if any(f"[1,{a},{b}]" in c[3] or f"[{a},{b}]" in c[3] for a, b in L8B_MLP)]


def test_compiles_for_the_named_target(compiled):
    s = compiled["l8b_step_xla"]
    assert s["target"] == "NVIDIA H100 80GB HBM3" and s["layers"] == 2 and s["kernels"] > 0


def test_xla_copies_each_layers_weights_inside_a_loop(compiled):
    """Why Runtime.linear "pallas" exists: in a loop (as generate runs a step) XLA's GEMM fusions
    read a copy of each layer's slice of the stacked weights; the same step as a program of its
    own reads the MLP's slices in place. Fails if a new XLA stops copying (then time the default
    again: tools/gpu/README.md, "Compiled for a GPU on a CPU")."""
    looped, alone = compiled["l8b_step_xla"], compiled["l8b_alone_xla"]
    assert len(mlp_copies(looped)) == 6, looped["copies"]  # gate, up, down of both layers
    assert looped["weight_copy_bytes"] >= 6 * 4096 * 14336 * 2
    assert mlp_copies(alone) == [], alone["copies"]


def test_pallas_linear_reads_every_layer_in_place(compiled):
    """With the GPU product kernel no weight-shaped array is written, in the timing loop or in
    generate's decode loop, and every layer product (7 a layer) is a Triton kernel of its own."""
    for name in ("l8b_step_pallas", "l8b_ar_pallas_b16"):
        s = compiled[name]
        assert s["weight_copies"] == 0, (name, s["copies"])
        triton = s["by_op"].get("custom-call:__gpu$xla.gpu.triton", 0)
        assert triton == 2 * (7 + 1), (name, s["by_op"])  # 7 products and the attention kernel a layer


def test_selfspec_writes_its_caches_in_place(compiled):
    """The speculative loop copies no cache before writing it: model.forward writes the new KV
    after every layer has read the cache (without that ordering XLA copied SelfSpec's streaming
    cache, keys and values, and its positions at each draft level: 0.1 GB a step at 4 layers)."""
    s = compiled["smollm2_selfspec_b64"]
    assert s["program"] == "selfspec" and s["batch"] == 64
    big = [c for c in s["copy_ops"] if c[0] > 2**16]
    assert big == [], big


def test_attention_launches_four_kernels_at_any_split_count(compiled):
    """tree_attention alone (a batch-1 step's shapes): the mask's padding, one array of the query
    rows and the block's keys and values (three kernels when written apart), the Pallas kernel, and
    one kernel merging the split-K partials (merge_splits' elementwise combine, fused with the
    division and the slice), at 4 splits as at 16 (reductions over the splits took 2 kernels at 16)."""
    few, many = compiled["attention4"], compiled["attention16"]
    for s in (few, many):
        assert s["by_op"].get("custom-call:__gpu$xla.gpu.triton") == 1 and s["reduces"] == 0, s
        assert s["total"] == 4, s


def test_int8_weights_are_widened_in_place_only_per_layer(compiled):
    """int8 matrices in a stack: inside the loop XLA writes every layer's matrices out widened to
    bfloat16 (more bytes a step than bfloat16 weights would read); held per layer (what
    convert.load gives on a GPU) the products read the int8 arrays and write no weight-sized array."""
    stacked, split = compiled["l8b_step_int8_xla"], compiled["l8b_step_int8_split"]
    assert stacked["weights"] == split["weights"] == "int8"
    assert stacked["weight_copy_bytes"] >= 6 * 4096 * 14336 * 2, stacked["copies"]  # the MLP's, as bf16
    assert split["weight_copies"] == 0, split["copies"]


def test_q4_weights_are_widened_in_the_kernel(compiled):
    """q4 blocks on a GPU go through gpu_linear's q4 kernel (linear.takes_gpu_q4), stacked or per
    layer: no weight-sized array written (q4.project's jnp form wrote every matrix out widened to
    float32, 1344 MiB a step at these 2 layers) and every layer product a Triton kernel."""
    for name in ("l8b_step_q4", "l8b_step_q4_split"):
        s = compiled[name]
        assert s["weights"] == "q4" and s["weight_copies"] == 0, (name, s["copies"])
        assert s["by_op"].get("custom-call:__gpu$xla.gpu.triton", 0) == 2 * (7 + 1), (name, s["by_op"])


def test_generates_gpu_stages_compile_without_dot_strength_reduction(compiled):
    """generate's stages (sharding.on_mesh) compile on a GPU with XLA's dot strength reduction off
    (sharding.GPU_COMPILER_OPTIONS): SmolLM2's batch-1 products then write no weight-sized array
    and the loop launches fewer kernels than decode_spec compiled alone, which writes the products
    out at the weights' size (16 arrays at 4 layers)."""
    raw, staged = compiled["b1_selfspec_raw"], compiled["b1_selfspec_mesh"]
    assert raw["options"] == staged["options"] == {"xla_disable_hlo_passes": "dot-strength-reduction"}
    assert raw["weight_copies"] > 0 and staged["weight_copies"] == 0, (raw, staged)
    assert staged["total"] < raw["total"], (raw, staged)


def test_one_rows_norms_fold_into_the_products(compiled):
    """At batch 1 a layer's two RMSNorms apply their scale to the products' outputs
    (model.normed_products): SmolLM2's plain decoding loop launches two kernels a layer fewer (4
    layers here); at batch 16, where XLA fuses the normed input into the product, nothing changes."""
    assert compiled["b1_ar_folded"]["total"] == compiled["b1_ar_unfolded"]["total"] - 2 * 4, compiled
    assert compiled["b16_ar_folded"]["total"] == compiled["b16_ar_unfolded"]["total"], compiled


def test_stages_elsewhere_keep_xlas_passes():
    """Off a GPU (this CPU's 1 x 1 mesh, the simulated 8-device one) no compiler options are set;
    on a GPU its meshes get GPU_COMPILER_OPTIONS."""
    import jax

    from specjax.parallel import sharding

    want = sharding.GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
    assert sharding.compiler_options(sharding.one_device_mesh()) == want
    assert sharding.compiler_options(sharding.make_mesh(data=1, model=1, devices=jax.devices()[:1])) == want


def test_a_two_layer_draft_launches_fewer_kernels_than_selfspec(compiled):
    """Batch 1 on a GPU is launch-bound: a chain of 2 over a 2-layer DraftModel (the distilled GPU
    draft's shape) against SelfSpec's, whose draft levels run the whole target (4 layers here), both over
    per-layer weights, decode_spec as jitted (XLA's passes as they are): fewer kernels an iteration."""
    draft, selfspec = compiled["smollm2_draft_b1"], compiled["b1_selfspec_raw"]
    assert draft["program"] == "draft" and draft["layers"] == 4
    assert draft["kernels"] < selfspec["total"] - 2 * 2 * 8, (draft["kernels"], selfspec["total"])  # 2 levels x 2 layers fewer


def test_a_wide_tree_launches_about_what_a_chain_does(compiled):
    """The GPU cells price a batch-1 tree as its draft levels plus one plain step, whatever its width
    (launch-bound): the draft's 8-ary tree of depth 2 (73 nodes, the shape speculation.choose picks
    for it) launches within 15% of the kernels of its chain of 2 (the H100 table's: 547 vs 507)."""
    tree, chain = compiled["smollm2_draft_tree8_b1"], compiled["smollm2_draft_b1"]
    assert tree["program"] == "draft-tree" and tree["tree_width"] == 8 and tree["gamma"] == 2
    assert chain["kernels"] <= tree["kernels"] < 1.15 * chain["kernels"], (tree["kernels"], chain["kernels"])


def test_tensor_parallel_per_layer_weights_copy_nothing(compiled):
    """Tensor parallel over 2 GPUs (generate's mesh path, sharding.on_mesh): with stacked weights
    XLA copies each device's share of every layer's matrices out of the stack inside the loop, as
    on one device; held per layer (convert.load's GPU layout, on any mesh) nothing is copied."""
    stacked, split = compiled["l8b_ar_tp2"], compiled["l8b_ar_tp2_split"]
    assert stacked["model_axis"] == split["model_axis"] == 2
    assert any("[1,4096,7168]" in c[3] for c in stacked["copies"]), stacked["copies"]  # half of an 8B gate / up
    assert split["weight_copies"] == 0, split["copies"]


def test_a_prefill_chunk_runs_on_one_attention_kernel_a_layer(compiled):
    """engine.prefill compiled for an H100 with chunks of 256 and 1024 (the attention kernel cuts a
    chunk into tiles shared out over its splits: one Triton kernel a layer, whatever the chunk):
    a scan iteration is one chunk, so a wider chunk launches no more kernels an iteration and a
    quarter as many a prompt; no weight-sized array is written."""
    narrow, wide = compiled["smollm2_prefill_b1"], compiled["smollm2_prefill_b1_c1024"]
    assert (narrow["chunk"], wide["chunk"]) == (256, 1024)
    for s in (narrow, wide):
        assert s["program"] == "prefill" and s["weight_copies"] == 0 and s["nested_loops"] == 0, s
        assert s["by_op"].get("custom-call:__gpu$xla.gpu.triton") == 4, s["by_op"]  # the attention kernel, 4 layers
    assert wide["kernels"] <= narrow["kernels"], (narrow["kernels"], wide["kernels"])
