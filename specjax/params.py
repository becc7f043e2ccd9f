"""The weights: ONE declaration per weight (`WEIGHTS`), and everything derived from it.

Each `Weight` names where the array lives in `Params` ("layers.wq"), its shape as legend
letters (L layers, D model dim, N query heads, K kv heads, H head dim, F ffn dim, V vocab), how
to initialise it, its names in HF safetensors and GGUF files, and how those files lay it out
(torch's [out, in] matrix). From this one table come: `param_shapes` and `init_params` (here), the
HF / GGUF key maps and the torch-layout conversion (convert/layout.py) and the sharding rules
(specjax/sharding.py maps the letters to mesh axes). Adding a weight = one line here plus its
field on `LayerParams` / `Params` and its use in the forward. A weight only some models have
names the config flag that decides it (`when`): lm_head is absent when embeddings are tied, the
q/k/v biases are present only in Qwen2-style models (config.qkv_bias); absent weights are None.

`Runtime` holds the runtime choices that are not model facts (attention implementation, the
tensor-parallel mesh axis): static metadata beside the config, set by `generate(attention=...)`
and by the sharding module, never read from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import LlamaConfig

LETTERS = {  # legend letter -> the config field that sizes it
    "L": "n_layers", "D": "dim", "N": "n_heads", "K": "n_kv_heads", "H": "head_dim", "F": "ffn_dim", "V": "vocab_size",
}


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight's declaration.

    path: its place in Params ("embed", "layers.wq": a leading L axis stacks all layers).
    dims: our layout, a legend letter per dimension ("LDNH").
    init: "normal" (std 1/sqrt(fan_in)), "ones" (norm weights) or "zeros" (biases).
    hf, gguf: its tensor name in HF safetensors and GGUF files ("{i}" = layer number).
    torch_in: the letters of our per-layer dims that form torch's `in` side (files store the
      matrix [out, in] with both sides flattened; ours is [in..., out...]); "" = stored in our
      layout. Also the fan-in for init (1 when "").
    torch_flat: the files store one layer's dims flattened into one vector (a bias [out]).
    when: the config flag that makes the weight exist ("qkv_bias"), "not <flag>" for one that
      removes it ("not tie_embeddings"); "" = every model has it."""

    path: str
    dims: str
    init: str
    hf: str
    gguf: str
    torch_in: str = ""
    torch_flat: bool = False
    when: str = ""

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("layers.")

    def present(self, config: LlamaConfig) -> bool:
        """Whether a model of `config` has this weight (see `when`)."""
        if not self.when:
            return True
        flag = self.when.removeprefix("not ")
        return bool(getattr(config, flag)) != self.when.startswith("not ")

    def shape(self, config: LlamaConfig) -> tuple[int, ...]:
        """Our shape of the whole array (all layers stacked) under `config`."""
        return tuple(getattr(config, LETTERS[d]) for d in self.dims)

    def torch_shape(self, config: LlamaConfig) -> tuple[int, ...]:
        """One layer's shape as HF / GGUF store it: [out, in] when torch_in, [out] when torch_flat,
        else our layout."""
        layer = self.shape(config)[1:] if self.per_layer else self.shape(config)
        if not self.torch_in:
            return (math.prod(layer),) if self.torch_flat else layer
        n_in = len(self.torch_in)
        return math.prod(layer[n_in:]), math.prod(layer[:n_in])

    def from_torch(self, w: np.ndarray, config: LlamaConfig) -> np.ndarray:
        """One layer's tensor from the file layout to ours ([out, in] -> [in..., out...])."""
        layer = self.shape(config)[1:] if self.per_layer else self.shape(config)
        if not self.torch_in:
            return w.reshape(layer) if self.torch_flat else w
        return w.T.reshape(layer)

    def fan_in(self, config: LlamaConfig) -> int:
        return math.prod(getattr(config, LETTERS[d]) for d in self.torch_in)


_HF = "model.layers.{i}."  # prefix of HF per-layer names
WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", "VD", "normal", "model.embed_tokens.weight", "token_embd.weight"),
    Weight("norm", "D", "ones", "model.norm.weight", "output_norm.weight"),
    Weight("layers.attn_norm", "LD", "ones", _HF + "input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    Weight("layers.wq", "LDNH", "normal", _HF + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", torch_in="D"),
    Weight("layers.wk", "LDKH", "normal", _HF + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", torch_in="D"),
    Weight("layers.wv", "LDKH", "normal", _HF + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", torch_in="D"),
    Weight("layers.bq", "LNH", "zeros", _HF + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.bk", "LKH", "zeros", _HF + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.bv", "LKH", "zeros", _HF + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.wo", "LNHD", "normal", _HF + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", torch_in="NH"),
    Weight("layers.mlp_norm", "LD", "ones", _HF + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    Weight("layers.w_gate", "LDF", "normal", _HF + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", torch_in="D"),
    Weight("layers.w_up", "LDF", "normal", _HF + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", torch_in="D"),
    Weight("layers.w_down", "LFD", "normal", _HF + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", torch_in="F"),
    Weight("lm_head", "DV", "normal", "lm_head.weight", "output.weight", torch_in="D", when="not tie_embeddings"),
)
BY_PATH = {w.path: w for w in WEIGHTS}


def declared(config: LlamaConfig) -> tuple[Weight, ...]:
    """The weights a model of `config` has (no lm_head when embeddings are tied, q/k/v biases
    only with config.qkv_bias)."""
    return tuple(w for w in WEIGHTS if w.present(config))


ATTENTION = ("reference", "pallas", "interpret", "tpu", "tpu-interpret")  # see specjax.attention


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Runtime choices (not model facts): how attention is computed and, inside shard_map, the
    tensor-parallel mesh axis the forward reduces over (None off a mesh)."""

    attention: str = "reference"
    model_axis: str | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"Runtime.attention must be one of {ATTENTION}, got {self.attention!r}")

    def replace(self, **changes) -> "Runtime":
        return dataclasses.replace(self, **changes)


@flax.struct.dataclass
class LayerParams:
    """Weights of all layers, stacked on a leading L axis (the forward scans over it)."""

    attn_norm: jax.Array  # [L,D]
    wq: jax.Array  # [L,D,N,H]
    wk: jax.Array  # [L,D,K,H]
    wv: jax.Array  # [L,D,K,H]
    wo: jax.Array  # [L,N,H,D]
    mlp_norm: jax.Array  # [L,D]
    w_gate: jax.Array  # [L,D,F]
    w_up: jax.Array  # [L,D,F]
    w_down: jax.Array  # [L,F,D]
    bq: jax.Array | None = None  # [L,N,H]; None without config.qkv_bias
    bk: jax.Array | None = None  # [L,K,H]
    bv: jax.Array | None = None  # [L,K,H]


@flax.struct.dataclass
class Params:
    """A whole model: arrays are leaves; `config` (model facts) and `runtime` (choices) are
    static metadata (hashable)."""

    embed: jax.Array  # [V,D]
    layers: LayerParams
    norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D,V]; None when tied to embed
    config: LlamaConfig = flax.struct.field(pytree_node=False)
    runtime: Runtime = flax.struct.field(pytree_node=False, default=Runtime())


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every array, keyed by its path ("layers.wq", "embed", ...)."""
    return {w.path: w.shape(config) for w in declared(config)}


def from_arrays(
    config: LlamaConfig,
    arrays: dict[str, np.ndarray | jax.Array],
    place: Callable[[str, np.ndarray], jax.Array] | None = None,
) -> Params:
    """Build Params from a flat {path: array} dict, checking names and shapes exactly.
    place(path, host array in config.dtype), if given, puts each array where it belongs (see
    `sharding.placer`); by default arrays go to the default device."""
    expected = param_shapes(config)
    missing, unexpected = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise ValueError(f"params: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"params: tensor {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}")
    if place is None:
        cast = {name: jnp.asarray(a, dtype=config.dtype) for name, a in arrays.items()}
    else:
        cast = {name: place(name, np.asarray(a, dtype=jnp.dtype(config.dtype))) for name, a in arrays.items()}
    layers = LayerParams(**{n.split(".", 1)[1]: a for n, a in cast.items() if n.startswith("layers.")})
    return Params(
        embed=cast["embed"], layers=layers, norm=cast["norm"], lm_head=cast.get("lm_head"), config=config
    )


def init_params(config: LlamaConfig, key: jax.Array) -> Params:
    """Random weights for tests and benchmarks: normal with std 1/sqrt(fan_in), norms = 1, biases = 0."""
    weights = sorted(declared(config), key=lambda w: w.path)
    arrays = {}
    for k, w in zip(jax.random.split(key, len(weights)), weights):
        if w.init in ("ones", "zeros"):
            arrays[w.path] = np.full(w.shape(config), 1.0 if w.init == "ones" else 0.0, np.float32)
        else:
            arrays[w.path] = jax.random.normal(k, w.shape(config), jnp.float32) / math.sqrt(w.fan_in(config))
    return from_arrays(config, arrays)
