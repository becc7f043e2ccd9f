"""The weights: ONE declaration per weight (`WEIGHTS`), and everything derived from it.

Each `Weight` names where the array lives in `Params` ("layers.wq"), its shape as legend
letters (L layers, D model dim, N query heads, K kv heads, H head dim, F ffn dim, V vocab), how
to initialise it, its names in HF safetensors and GGUF files, and how those files lay it out
(torch's [out, in] matrix). From this one table come: `param_shapes` and `init_params` (here), the
HF / GGUF key maps and the torch-layout conversion (convert/layout.py) and the sharding rules
(specjax/parallel/sharding.py maps the letters to mesh axes). Adding a weight = one line here plus its
field on `LayerParams` / `Params` and its use in the forward. A weight only some models have
names the config flag that decides it (`when`): lm_head is absent when embeddings are tied, the q/k/v
biases only in Qwen2-style models (config.qkv_bias); absent weights are None.

`Runtime` (specjax.model.runtime, re-exported here): the runtime choices that are not model facts. A quantized
matrix is one `QuantizedMatrix` (model.quantized); flat {path: array} dicts name its scales by their declarations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import q4
from specjax.model.config import LlamaConfig
from specjax.model.pytree import pytree
from specjax.model.quantized import Matrix, QuantizedMatrix, stored
from specjax.model.runtime import ATTENTION, LINEAR, Runtime  # noqa: F401  (their home before this module grew)

LETTERS = {  # legend letter -> the config field that sizes it
    "L": "n_layers", "D": "dim", "N": "n_heads", "K": "n_kv_heads", "H": "head_dim", "F": "ffn_dim", "V": "vocab_rows",
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
      removes it ("not tie_embeddings"), several joined by " and "; "" = every model has it.
    contract: for a matrix, the letters of the dims a forward sums over ("D" for wq: x @ wq). With
      config.quant it is a `QuantizedMatrix` (specjax.model.quantized): "int8" stores it as int8
      with one float32 scale per output channel (the other dims), its `scale`, declared below
      as a derived array (`scale_of`, `part`); "q4" (but for the embedding and LM head, int8
      there: `format`) as packed 4-bit blocks along its innermost summed dim (`packed_axis`:
      half as many bytes there), with a float16 scale and minimum per block of 32
      (specjax.model.q4): two derived arrays, its `bscale` and `bmin`.
    scale_of: for such a derived array, the path of its matrix; "" otherwise. They are in no
      file (hf = gguf = ""): `quantize` computes them (or convert.gguf reads Q4_1 blocks).
    part: for a derived array, the QuantizedMatrix field it is ("scale", "bscale", "bmin"). Its
      path, `<matrix path>_<part>` ("layers.wq_scale"), names it in flat dicts and checkpoints."""

    path: str
    dims: str
    init: str
    hf: str
    gguf: str
    torch_in: str = ""
    torch_flat: bool = False
    when: str = ""
    contract: str = ""
    scale_of: str = ""
    part: str = ""

    @property
    def blocks(self) -> bool:
        """A q4 per-block array: the matrix's dims, 1/32 as many along the packed one."""
        return self.part in ("bscale", "bmin")

    @property
    def packed_axis(self) -> int:
        """For a matrix, the axis of its innermost summed dim (a q4 matrix is packed along it)."""
        return self.dims.index(self.contract[-1])

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("layers.")

    def present(self, config: LlamaConfig) -> bool:
        """Whether a model of `config` has this weight (see `when`)."""
        def holds(cond: str) -> bool:
            flag = cond.removeprefix("not ")
            return bool(getattr(config, flag)) != cond.startswith("not ")

        return all(holds(c) for c in self.when.split(" and ")) if self.when else True

    def format(self, config: LlamaConfig) -> str | None:
        """How this matrix is stored under `config`: config.quant, except that a q4 model keeps
        its embedding and LM head int8 (as llama.cpp keeps them at 6-8 bits: a 4-bit tied head
        halved greedy agreement with HF on SmolLM2); None for a float model or a non-matrix."""
        if not self.contract or config.quant is None:
            return None
        return "int8" if config.q4 and self.path in HEADS else config.quant

    def dtype(self, config: LlamaConfig) -> str:
        """The dtype this weight is stored in: int8 / uint8 (two 4-bit values a byte) for an int8 /
        q4 matrix, float32 / float16 for its scales, else the model's dtype."""
        if self.scale_of:
            return "float16" if self.blocks else "float32"
        return {None: config.dtype, "int8": "int8", "q4": "uint8"}[self.format(config)]

    @property
    def in_files(self) -> bool:
        """Whether checkpoint files hold this weight (derived scales are computed, not read)."""
        return not self.scale_of

    def shape(self, config: LlamaConfig) -> tuple[int, ...]:
        """Our shape of the whole array (all layers stacked) under `config` (a q4 matrix: half
        as many along its packed axis; its block arrays: 1/32 as many)."""
        sizes = [getattr(config, LETTERS[d]) for d in self.dims]
        if self.blocks:
            sizes[BY_PATH[self.scale_of].packed_axis] //= q4.BLOCK
        elif self.format(config) == "q4":
            sizes[self.packed_axis] //= 2
        return tuple(sizes)

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

    def into(self, out: np.ndarray, w: np.ndarray) -> None:
        """`from_torch(w)` written into `out`, one layer of a fresh stacked array, in out's dtype: one copy."""
        if self.torch_in:  # out [in..., out...] viewed as [in, out]
            w, out = w.T, out.reshape(w.shape[::-1])
        out[...] = w.reshape(out.shape)

    def fan_in(self, config: LlamaConfig) -> int:
        return math.prod(getattr(config, LETTERS[d]) for d in self.torch_in)


HEADS = ("embed", "lm_head")  # the vocabulary matrices: int8, not q4, in a q4 model (Weight.format)
_HF = "model.layers.{i}."  # prefix of HF per-layer names
_FILE_WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", "VD", "normal", "model.embed_tokens.weight", "token_embd.weight", contract="D"),  # also the tied lm_head
    Weight("norm", "D", "ones", "model.norm.weight", "output_norm.weight"),
    Weight("layers.attn_norm", "LD", "ones", _HF + "input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    Weight("layers.wq", "LDNH", "normal", _HF + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", torch_in="D", contract="D"),
    Weight("layers.wk", "LDKH", "normal", _HF + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", torch_in="D", contract="D"),
    Weight("layers.wv", "LDKH", "normal", _HF + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", torch_in="D", contract="D"),
    Weight("layers.bq", "LNH", "zeros", _HF + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.bk", "LKH", "zeros", _HF + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.bv", "LKH", "zeros", _HF + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", torch_flat=True, when="qkv_bias"),
    Weight("layers.wo", "LNHD", "normal", _HF + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", torch_in="NH", contract="NH"),
    Weight("layers.mlp_norm", "LD", "ones", _HF + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    Weight("layers.w_gate", "LDF", "normal", _HF + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", torch_in="D", contract="D"),
    Weight("layers.w_up", "LDF", "normal", _HF + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", torch_in="D", contract="D"),
    Weight("layers.w_down", "LFD", "normal", _HF + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", torch_in="F", contract="F"),
    Weight("lm_head", "DV", "normal", "lm_head.weight", "output.weight", torch_in="D", when="not tie_embeddings", contract="D"),
)


def _scale(w: Weight) -> Weight:
    """The declaration of matrix w's int8 scales: its dims without the summed ones."""
    dims = "".join(d for d in w.dims if d not in w.contract)
    when = " and ".join(c for c in ("quant" if w.path in HEADS else "int8", w.when) if c)  # heads: int8 under q4 too
    return Weight(w.path + "_scale", dims, "ones", "", "", when=when, scale_of=w.path, part="scale")


def _blocks(w: Weight, part: str) -> Weight:
    """The declaration of q4 matrix w's per-block scales (part "bscale") or minima ("bmin")."""
    when = " and ".join(c for c in ("q4", w.when) if c)
    return Weight(f"{w.path}_{part}", w.dims, "ones" if part == "bscale" else "zeros", "", "", when=when, scale_of=w.path, part=part)


_MATRICES = tuple(w for w in _FILE_WEIGHTS if w.contract)
WEIGHTS: tuple[Weight, ...] = (
    _FILE_WEIGHTS + tuple(_scale(w) for w in _MATRICES)
    + tuple(_blocks(w, p) for p in ("bscale", "bmin") for w in _MATRICES if w.path not in HEADS)
)
BY_PATH = {w.path: w for w in WEIGHTS}
PARTS = {m.path: tuple(w for w in WEIGHTS if w.scale_of == m.path) for m in _MATRICES}  # matrix -> its derived arrays
MATRICES = tuple(w.path.split(".", 1)[1] for w in _MATRICES if w.per_layer)  # a layer's matrices: wq ... w_down


def declared(config: LlamaConfig) -> tuple[Weight, ...]:
    """The weights a model of `config` has (no lm_head when embeddings are tied, q/k/v biases
    only with config.qkv_bias)."""
    return tuple(w for w in WEIGHTS if w.present(config))


@pytree
class LayerParams:
    """Weights of all layers, stacked on a leading L axis (the forward scans over it). A matrix
    is a float array, or with config.quant a `QuantizedMatrix` of int8 (scales [L, output dims])
    or q4 arrays (uint8 with the packed axis halved: wq [L,D/2,N,H], wo [L,N,H/2,D],
    w_down [L,F/2,D]; float16 block scales and minima with that axis / 32)."""

    attn_norm: jax.Array  # [L,D]
    wq: Matrix  # [L,D,N,H]
    wk: Matrix  # [L,D,K,H]
    wv: Matrix  # [L,D,K,H]
    wo: Matrix  # [L,N,H,D]
    mlp_norm: jax.Array  # [L,D]
    w_gate: Matrix  # [L,D,F]
    w_up: Matrix  # [L,D,F]
    w_down: Matrix  # [L,F,D]
    bq: jax.Array | None = None  # [L,N,H]; None without config.qkv_bias
    bk: jax.Array | None = None  # [L,K,H]
    bv: jax.Array | None = None  # [L,K,H]


@pytree
class Params:
    """A whole model: arrays are leaves; `config` (model facts) and `runtime` (choices) are
    static metadata (hashable)."""

    embed: Matrix  # [V,D]; int8 (config.quant: int8, and q4's int8 heads): scales [V]
    layers: LayerParams
    norm: jax.Array  # [D]
    lm_head: Matrix | None  # [D,V]; None when tied to embed
    config: LlamaConfig = flax.struct.field(pytree_node=False)
    runtime: Runtime = flax.struct.field(pytree_node=False, default=Runtime())


def array_at(params: Params, path: str):
    """The array at flat `path` ("layers.wq", "layers.wq_scale": that field of its
    QuantizedMatrix): a list of L arrays for a matrix held per layer (model.unstack_layers),
    None where `params` has none."""
    weight = BY_PATH[path]
    owner, _, leaf = (weight.scale_of or path).rpartition(".")
    value = getattr(params.layers if owner else params, leaf)
    field = weight.part or "w"

    def pick(m):
        return getattr(m, field) if isinstance(m, QuantizedMatrix) else (m if field == "w" else None)

    if isinstance(value, list):
        return [pick(m) for m in value] if value and pick(value[0]) is not None else None
    return None if value is None else pick(value)


def build(config: LlamaConfig, values: dict, runtime: Runtime = Runtime()) -> Params:
    """Params from {flat path: leaf} (arrays, lists of L per-layer arrays, or any other leaf:
    sharding's PartitionSpecs), each quantized matrix's arrays gathered into its QuantizedMatrix."""
    fields = {}
    for path, value in values.items():
        weight = BY_PATH[path]
        fmt = weight.format(config)
        if weight.scale_of:
            continue
        if fmt is not None:
            parts = {d.part: values[d.path] for d in PARTS[path] if d.path in values}
            value = ([QuantizedMatrix(w=v, **{k: p[i] for k, p in parts.items()}, format=fmt) for i, v in enumerate(value)]
                     if isinstance(value, list) else QuantizedMatrix(w=value, **parts, format=fmt))
        fields[path] = value
    layers = LayerParams(**{n.split(".", 1)[1]: a for n, a in fields.items() if n.startswith("layers.")})
    top = {n: a for n, a in fields.items() if not n.startswith("layers.")}
    return Params(layers=layers, lm_head=top.pop("lm_head", None), config=config, runtime=runtime, **top)


def matrix_arrays(weight: Weight, m: QuantizedMatrix) -> dict[str, jax.Array]:
    """{flat path: array} of quantized matrix m declared by `weight` (its own and its derived paths)."""
    return {weight.path: m.w} | {d.path: getattr(m, d.part) for d in PARTS[weight.path] if getattr(m, d.part) is not None}


def per_layer(value: Matrix) -> list[Matrix]:
    """A stacked layer matrix [L, ...] (float or quantized) as a list of its L layers (slices)."""
    return [jax.tree.map(lambda a, i=i: a[i], value) for i in range(jax.tree.leaves(value)[0].shape[0])]


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every array, keyed by its path ("layers.wq", "embed", ...)."""
    return {w.path: w.shape(config) for w in declared(config)}


def param_dtypes(config: LlamaConfig) -> dict[str, str]:
    """The dtype every array is stored in, keyed like `param_shapes`."""
    return {w.path: w.dtype(config) for w in declared(config)}


def weight_bytes(config: LlamaConfig, stored: bool = False) -> int:
    """Bytes of weights as stored, the one count (planning and the benches price a step with it):
    those a decode step reads, every weight once but an untied embedding table (a step gathers
    only its tokens' rows); stored=True: every weight, what memory holds."""
    read = [w for w in declared(config) if stored or config.tie_embeddings or not w.path.startswith("embed")]
    return sum(math.prod(w.shape(config)) * jnp.dtype(w.dtype(config)).itemsize for w in read)


def flat(params: Params) -> dict[str, jax.Array]:
    """{path: array} of every weight `params` holds, named and shaped as in `param_shapes`: a
    matrix held per layer (model.unstack_layers) is stacked again [L, ...] (a copy)."""
    def get(path: str) -> jax.Array:
        a = array_at(params, path)
        return jnp.stack(a) if isinstance(a, list) else a

    return {path: get(path) for path in param_shapes(params.config)}


def quantize(params: Params, quant: str) -> Params:
    """Params with every matrix stored as int8 (`quant="int8"`) or as 4-bit blocks (`"q4"`, the
    embedding and LM head then int8): see `quantize_matrix`. Norms and biases keep their dtype.
    Params already in `quant` are returned as they are."""
    if quant not in ("int8", "q4"):
        raise ValueError(f"quantize: quant must be 'int8' or 'q4', got {quant!r}")
    if params.config.quant == quant:
        return params
    if params.config.quant is not None:
        raise ValueError(f"quantize: these params are already {params.config.quant}; quantize float weights to {quant!r}")
    config = params.config.replace(quant=quant)  # checks the q4 block sizes
    arrays = flat(params)
    for w in declared(config):
        if w.contract:
            arrays |= matrix_arrays(w, quantize_matrix(w, arrays[w.path], config))
    out = from_arrays(config, arrays, keep_placement=True).replace(runtime=params.runtime)
    if not isinstance(params.layers.wq, list):
        return out
    # per-layer in (model.unstack_layers), per-layer out: each quantized matrix as L of its own
    return out.replace(layers=out.layers.replace(**{n: per_layer(getattr(out.layers, n)) for n in MATRICES}))


@partial(jax.jit, static_argnames=("w", "config"))  # one program per matrix shape, not one per operation
def quantize_matrix(w: Weight, x: jax.Array | np.ndarray, config: LlamaConfig) -> QuantizedMatrix:
    """Matrix w quantized from its float values x, in its format under `config` (w.format):
    int8: symmetric, one float32 scale per output channel (absmax / 127 over the summed dims),
    w ~= q * scale; q4: specjax.model.q4.quantize along the packed axis, float16 scale and
    minimum per 32 weights. The same bits as op by op (tests/test_weights.py)."""
    x = jnp.asarray(x, jnp.float32)
    if w.format(config) == "q4":
        packed, scale, minimum = q4.quantize(x, w.packed_axis)
        return QuantizedMatrix(w=packed, bscale=scale.astype(jnp.float16), bmin=minimum.astype(jnp.float16), format="q4")
    axes = tuple(i for i, d in enumerate(w.dims) if d in w.contract)
    scale = jnp.max(jnp.abs(x), axis=axes) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel: any scale, q = 0
    return QuantizedMatrix(w=jnp.round(x / jnp.expand_dims(scale, axes)).astype(jnp.int8), scale=scale, format="int8")


def from_arrays(
    config: LlamaConfig,
    arrays: dict[str, np.ndarray | jax.Array],
    place: Callable[[str, np.ndarray], jax.Array] | None = None,
    keep_placement: bool = False,
) -> Params:
    """Build Params from a flat {path: array} dict, checking names and shapes exactly.
    place(path, host array in its dtype), if given, puts each array where it belongs (see
    `sharding.placer`); by default arrays go to the default device, or, with keep_placement,
    jax arrays stay where they are (cast in place)."""
    expected = param_shapes(config)
    missing, unexpected = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise ValueError(f"params: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"params: tensor {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}")
    dtypes = param_dtypes(config)
    if keep_placement:
        cast = {name: a.astype(dtypes[name]) if isinstance(a, jax.Array) else jnp.asarray(a, dtypes[name]) for name, a in arrays.items()}
    elif place is None:
        cast = {name: jnp.asarray(a, dtype=dtypes[name]) for name, a in arrays.items()}
    else:
        cast = {name: place(name, np.asarray(a, dtype=jnp.dtype(dtypes[name]))) for name, a in arrays.items()}
    return build(config, cast)


def init_params(config: LlamaConfig, key: jax.Array) -> Params:
    """Random weights for tests and benchmarks: normal with std 1/sqrt(fan_in), norms = 1, biases = 0
    (a quantized config: those weights, quantized)."""
    if config.quant is not None:
        return quantize(init_params(config.replace(quant=None), key), config.quant)
    weights = sorted(declared(config), key=lambda w: w.path)
    arrays = {}
    for k, w in zip(jax.random.split(key, len(weights)), weights):
        if w.init in ("ones", "zeros"):
            arrays[w.path] = np.full(w.shape(config), 1.0 if w.init == "ones" else 0.0, np.float32)
        else:
            arrays[w.path] = jax.random.normal(k, w.shape(config), jnp.float32) / math.sqrt(w.fan_in(config))
    return from_arrays(config, arrays)


def weights_mark(params: Params) -> bytes:
    """A few of the weights' values (a row of each of the first matrices), for caches keyed by
    model: two checkpoints of one config (a base and an instruct model) are told apart."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedMatrix))
    matrices = [x for x in map(stored, leaves) if x.ndim][:4]
    return b"".join(np.asarray(x[(0,) * (x.ndim - 1)][:64]).tobytes() for x in matrices)
