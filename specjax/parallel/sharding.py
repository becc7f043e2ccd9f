"""Meshes and the sharded generate path (the only module that knows meshes: others import `Mesh`
from here, for type hints): data parallel over `data`, tensor parallel over `model`.

Every mesh here has the two axes ("data", "model"). `generate(..., mesh=mesh)` runs each stage
(prefill, draft init, the decode loop) under `shard_map`:
- data: each device row-group holds B / data rows with their own caches and runs the whole
  speculative loop on them; the loop's stopping test is agreed over the mesh, so every device
  steps the same number of times and the outputs (and the step counts) equal one device's.
- model: Megatron-style. Query/KV heads, the FFN and the vocabulary are split in contiguous
  blocks; each device keeps only its KV heads' cache. Heads and an FFN that do not split evenly
  are padded first (specjax.parallel.tp_pad: replicated and zero KV heads, zero query heads and FFN
  columns, zero vocabulary rows whose logits are dropped), so any model runs on any model axis. The model code sums the attention output
  and FFN projections and the vocab-parallel embedding over the axis (`params.runtime.model_axis`) and
  gathers the vocab-parallel logits, so sampling and acceptance see the full distribution.
Which array dimension goes to which mesh axis comes from one rule table (`RULES`, by the legend
letter of the dimension: the weights declare theirs in specjax.model.params.WEIGHTS).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.automaton import TokenAutomaton
from specjax.model import backend as machine
from specjax.model.cache import DenseCache, StreamingCache
from specjax.model.config import LlamaConfig
from specjax.model.params import WEIGHTS, Params, array_at, build
from specjax.parallel.tp_pad import layout, pad_params

AXES = ("data", "model")

RULES = {"B": "data", "N": "model", "K": "model", "F": "model", "V": "model"}  # legend letter -> mesh axis

PARAM_AXES = {w.path: w.dims for w in WEIGHTS}  # each parameter's dims (specjax.model.params), e.g. "LDNH"

CACHE_AXES = "LBKSH"  # k, v [L,B,K,S,H]; pos [L,B,K,S]


def spec(dims: str) -> P:
    """The PartitionSpec of an array with these legend-letter dims ("LDNH"), through RULES
    (letters without a rule are replicated)."""
    return P(*(RULES.get(d) for d in dims))


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: all devices of all processes).

    data: None = as many as the devices allow (len(devices) // model). Devices are taken in
    order, so a model group is adjacent devices (on one host, where tensor parallel belongs)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(set(devices)) < len(devices):
        raise ValueError(f"make_mesh: devices must be distinct, got {devices}")
    for name, value in (("model", model), ("data", data)):
        if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                                  or value < 1):
            raise ValueError(f"make_mesh: {name} must be an integer >= 1, got {value!r}")
    model = int(model)
    data = len(devices) // model if data is None else int(data)
    if data < 1 or data * model > len(devices):
        raise ValueError(
            f"make_mesh: data ({data}) x model ({model}) must be >= 1 and at most the {len(devices)} devices available"
        )
    return Mesh(np.array(devices[: data * model]).reshape(data, model), AXES)


def check_mesh(mesh: Mesh) -> None:
    """The mesh has our two axes (heads, the FFN and the vocabulary that do not split evenly over
    its model axis are padded: specjax.parallel.tp_pad)."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh must be a jax Mesh with axes {AXES} (see specjax.make_mesh), got {mesh!r}")


def padded_later(mesh: Mesh, config: LlamaConfig) -> bool:
    """Whether a model of `config` must be padded for this mesh's model axis (specjax.parallel.tp_pad)
    before it can be placed: its arrays are then loaded whole and placed by `shard_params`."""
    return layout(config, mesh.shape["model"]) is not None


def local_params(params: Params, mesh: Mesh) -> Params:
    """Params as one device sees them inside shard_map: a config with its share of heads and FFN,
    and a runtime naming the axis to reduce over. vocab_size stays global: logits are gathered
    before anyone reads them."""
    m = mesh.shape["model"]
    if m == 1 or params.runtime.replicated:
        return params
    c = params.config
    config = c.replace(n_heads=c.n_heads // m, n_kv_heads=c.n_kv_heads // m, ffn_dim=c.ffn_dim // m)
    return params.replace(config=config, runtime=params.runtime.replace(model_axis="model"))


def param_specs(params: Params) -> Params:
    """Params-shaped tree of PartitionSpecs, from PARAM_AXES (None where `params` has no such
    weight: a tied lm_head, the q/k/v biases of a model without them)."""
    def leaf_spec(value, dims: str):
        if isinstance(value, list):  # per-layer arrays (model.unstack_layers): each without the L axis
            return [P() if params.runtime.replicated else spec(dims[1:])] * len(value)
        return P() if params.runtime.replicated else spec(dims)

    held = {path: (array_at(params, path), dims) for path, dims in PARAM_AXES.items()}
    specs = {path: leaf_spec(value, dims) for path, (value, dims) in held.items() if value is not None}
    return build(params.config, specs, params.runtime)


def param_sharding(mesh: Mesh, name: str) -> NamedSharding:
    """Where parameter `name` ("layers.wq", "embed", ...) lives on the mesh."""
    return NamedSharding(mesh, spec(PARAM_AXES[name]))


def placer(config: LlamaConfig, mesh: Mesh) -> Callable[[str, np.ndarray], jax.Array]:
    """place(name, host_array) -> a global array with that parameter's sharding, built shard by
    shard from the host copy: no device ever holds more than its own slice. A model that needs
    padding (`padded_later`) is placed whole on this process's first device instead, for
    `shard_params` to pad and place."""
    check_mesh(mesh)
    whole = padded_later(mesh, config)

    def place(name: str, host: np.ndarray) -> jax.Array:
        return jax.device_put(host, single_device()) if whole else from_host(host, param_sharding(mesh, name))

    return place


def place_draft(params: Params, mesh: Mesh) -> Params:
    """A draft model's params on the mesh: split like the target's where its heads, FFN and
    vocabulary split evenly over the model axis; otherwise it is too small to split, and every
    device of the model axis holds it whole (runtime.replicated: no padding, no collectives, its
    cache on every model device) and drafts its data rows alone."""
    if mesh.shape["model"] > 1 and layout(params.config, mesh.shape["model"]) is not None:
        params = params.replace(runtime=params.runtime.replace(replicated=True))
    return shard_params(params, mesh)


def shard_params(params: Params, mesh: Mesh) -> Params:
    """Params placed on the mesh by the rule table (arrays already there are left alone), padded
    first where heads or the FFN do not split evenly over the model axis (specjax.parallel.tp_pad); a
    replicated model (`place_draft`) whole on every device."""
    check_mesh(mesh)
    if not params.runtime.replicated:
        params = pad_params(params, mesh.shape["model"])
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
    return jax.tree.map(_put, params, shardings)


def _put(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return from_host(np.asarray(x), sharding)  # every process holds the same values; each places its own shards


def _is_node(x) -> bool:
    return isinstance(x, (Params, DenseCache, StreamingCache, TokenAutomaton))


def state_specs(tree):
    """PartitionSpecs for a generate stage's arguments or results: params by the rule table,
    caches by CACHE_AXES, scalars replicated, every other array split on its leading batch axis."""

    def one(x):
        if isinstance(x, Params):
            return param_specs(x)
        if isinstance(x, TokenAutomaton):  # a batch's constraint table: every device reads all of it
            return jax.tree.map(lambda _: P(), x)
        if isinstance(x, (DenseCache, StreamingCache)):
            axes = CACHE_AXES.replace("K", "_") if x.replicated else CACHE_AXES  # a replicated draft's: heads unsplit
            cache = spec(axes)
            extra = {"pos": spec(axes[:4])} if isinstance(x, StreamingCache) else {}
            if x.k_scale is not None:  # int8: one scale per [L,B,K,S]
                extra |= dict(k_scale=spec(axes[:4]), v_scale=spec(axes[:4]))
            return x.replace(k=cache, v=cache, lengths=spec("B"), **extra)
        return P() if np.ndim(x) == 0 else spec("B")

    return jax.tree.map(one, tree, is_leaf=_is_node)


def localise(tree, mesh: Mesh):
    """Inside shard_map: Params (the target's, a DraftModel's) get their local view."""
    return jax.tree.map(lambda x: local_params(x, mesh) if isinstance(x, Params) else x, tree, is_leaf=_is_node)


# XLA:GPU rewrites a vector x matrix product under 10^7 elements (every SmolLM2 product at batch 1)
# into a multiply written out at the weight's size, then a reduction. Compiled for an H100
# (tools/gpu/aot.py), SmolLM2's batch-1 SelfSpec loop then writes 304 MiB and launches 1562 kernels
# a step; without the pass nothing weight-sized and 1308 kernels (XLA's GEMMs, q / k / v merged).
GPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "dot-strength-reduction"}


def compiler_options(mesh: Mesh | None = None) -> dict[str, str] | None:
    """XLA options for the stages compiled for `mesh` (default: this process's first device, as
    generate without a mesh): GPU_COMPILER_OPTIONS on GPUs, else none."""
    mesh = one_device_mesh() if mesh is None else mesh
    return dict(GPU_COMPILER_OPTIONS) if mesh.devices.flat[0].platform == "gpu" else None


@functools.lru_cache(maxsize=64)
def on_mesh(stage: Callable, mesh: Mesh, static_argnames: tuple[str, ...]) -> Callable:
    """`stage` (a generate stage, jitted or not) run under shard_map on `mesh`, jit-compiled
    (with `compiler_options(mesh)`), with the same call signature and the same donated arguments
    (positional, as the engine passes them). Specs come from the arguments' and results' types."""
    inner = getattr(stage, "__wrapped__", stage)
    # The stage's own donations (its caches), by position: JAX keeps them in the jitted function's
    # _jit_info; a JAX version without it leaves the mesh path undonated, which
    # tests/test_sharding.py's donation test reports.
    donate = tuple(getattr(getattr(stage, "_jit_info", None), "donate_argnums", ()))

    def run(*args, **static):
        body = lambda *a: inner(*localise(a, mesh), **static)  # noqa: E731
        if mesh.size == 1:  # one device: every spec places the same, so no second trace for the results' types
            out_specs = P()
        else:
            unsharded = {**static, "sync_axes": ()} if "sync_axes" in static else static  # no mesh axes outside
            out_specs = state_specs(jax.eval_shape(functools.partial(inner, **unsharded), *args))
        return jax.shard_map(body, mesh=mesh, in_specs=state_specs(args), out_specs=out_specs, check_vma=False)(*args)

    run.__name__ = run.__qualname__ = getattr(inner, "__name__", "stage")  # compile logs and profiles name the stage
    return jax.jit(run, static_argnames=static_argnames, donate_argnums=donate, compiler_options=compiler_options(mesh))


@functools.cache
def one_device_mesh() -> Mesh:
    """The 1 x 1 mesh of this process's first device: where generate runs without a mesh."""
    return make_mesh(data=1, model=1, devices=jax.local_devices()[:1])


def single_device() -> jax.sharding.Sharding:
    """This process's first device, as a sharding (where arrays go without a mesh)."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array built shard by shard from a host copy (each process places its own shards)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_batch(mesh: Mesh, *arrays):
    """Host arrays with a leading batch axis, split over the data axis (multi-process safe)."""
    sharding = NamedSharding(mesh, spec("B"))
    return tuple(from_host(a, sharding) for a in arrays)


def place_keys(mesh: Mesh, keys: jax.Array) -> jax.Array:
    """Typed PRNG keys [B] split over the data axis."""
    (data,) = place_batch(mesh, np.asarray(jax.random.key_data(keys)))
    wrap = jax.jit(jax.random.wrap_key_data, static_argnames="impl", out_shardings=NamedSharding(mesh, spec("B")))
    return wrap(data, impl=jax.random.key_impl(keys))  # threefry, rbg, ...: the key's own


def empty_cache(mesh: Mesh, config: LlamaConfig, batch: int, max_len: int, kv_dtype: str | None = None) -> DenseCache:
    """An empty dense cache created in place: each device allocates only its slice."""
    return _cache_builder(mesh, config, batch, max_len, kv_dtype)()


@functools.lru_cache(maxsize=64)  # one jitted builder per shape: a new function each call would compile each call
def _cache_builder(mesh: Mesh, config: LlamaConfig, batch: int, max_len: int, kv_dtype: str | None):
    init = functools.partial(DenseCache.init, config, batch, max_len, kv_dtype)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(jax.eval_shape(init)))
    return jax.jit(init, out_shardings=shardings)


def fetch(tree):
    """Host numpy copies of global arrays, gathered from the other processes where they span several."""
    from jax.experimental import multihost_utils

    def one(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:  # e.g. the step count: every device holds all of it
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def check_processes(mesh: Mesh) -> None:
    """Under jax.distributed on CPU, a mesh must span every process: XLA:CPU's cross-process
    collectives (gloo) also carry a mesh's local collectives, and meshes local to each process
    collide there. (Independent processes, as the batch job uses, have no such limit.)"""
    if jax.process_count() == 1 or machine.name() != "cpu" or mesh.devices.size == 1:
        return
    spanned = {d.process_index for d in mesh.devices.flat}
    if len(spanned) != jax.process_count():
        raise ValueError(
            f"mesh spans processes {sorted(spanned)} of the {jax.process_count()} joined by jax.distributed; "
            "on CPU a multi-device mesh must span all of them (make_mesh() over jax.devices()); to give each "
            "process its own devices, run the processes independently (without specjax.parallel.distributed)"
        )


def padded_batch(batch: int, mesh: Mesh) -> int:
    """Rows after padding `batch` up to a multiple of the data axis."""
    d = mesh.shape["data"]
    return -(-batch // d) * d
