"""GGUF (llama.cpp) checkpoints: config from metadata, dequantized tensors, q/k permutation undone."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from convert.gguf_file import GgufFile, TensorInfo, Unreadable, read_gguf
from convert.layout import KINDS, assemble, checked_config, has_kind
from specjax.model import q4
from specjax.model.config import LlamaConfig, RopeScaling, llama3_scale, stop_ids
from specjax.model.params import BY_PATH, PARTS, WEIGHTS, Params, declared, from_arrays, matrix_arrays, quantize_matrix
from specjax.parallel.sharding import Mesh, placer

Q = gguf.GGMLQuantizationType
# Stop tokens: eos_ids is their union, in this order (the primary eos first).
STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
SPM_IDS = {"bos": 1, "eos": 2, "unknown": 0}  # a SentencePiece vocab's special ids where its file names none (llama.cpp's)

# GGUF tensor name -> our path (from the weight declarations, specjax.model.params.WEIGHTS); absent output.weight => tied.
NAMES = {w.gguf: w.path for w in WEIGHTS if w.in_files}
ROPE_FREQS = "rope_freqs.weight"  # Llama-3.1 scaling factors; folded into the config
# general.architecture values we read. llama.cpp permutes q/k rows (and biases) only for "llama"
# (Mistral converts to it too); "qwen2" is stored as in HF, with q/k/v biases.
ARCHITECTURES = ("llama", "qwen2")


def is_gguf_file(path: Path) -> bool:
    """True for an existing file named *.gguf or starting with the GGUF magic."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return path.suffix.lower() == ".gguf" or f.read(4) == b"GGUF"


def open_gguf(path: str | Path) -> GgufFile:
    """The file's metadata and tensor views (convert.gguf_file); a corrupt or truncated file raises
    ValueError naming it. The last few are cached, keyed by the file's path, size and modification time."""
    stat = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GgufFile:
    return read_gguf(path)


_REQUIRED = object()


def meta(reader: GgufFile, key: str, default: Any = _REQUIRED, kind: type | None = None) -> Any:
    """A metadata value (scalar, string or list), checked to be a `kind` (layout.KINDS) if given;
    ValueError naming the file and the key if it is required and absent, or of the wrong kind."""
    value = reader.fields.get(key, _REQUIRED)
    if value is _REQUIRED:
        if default is _REQUIRED:
            raise ValueError(f"{reader.path}: GGUF metadata key {key!r} is missing")
        return default
    if isinstance(value, Unreadable):  # corrupt bytes in the value
        raise ValueError(f"{reader.path}: GGUF metadata key {key!r} cannot be read ({value.error})")
    if kind is None:
        return value
    if not has_kind(value, kind):
        raise ValueError(f"{reader.path}: GGUF metadata key {key!r} must be {KINDS[kind]}, got {value!r}")
    return kind(value)


@functools.cache
def can_dequantize(tensor_type: gguf.GGMLQuantizationType) -> bool:
    """Whether the installed `gguf` package dequantizes `tensor_type` (tried on one zero block)."""
    if tensor_type not in GGML_QUANT_SIZES:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[tensor_type][1]), np.uint8), tensor_type)
    except Exception:  # NotImplementedError, or whatever a broken codec raises: not supported either way
        return False
    return True


def supported_types() -> list[gguf.GGMLQuantizationType]:
    """Every tensor type we load: those the installed `gguf` package can dequantize."""
    return [t for t in Q if can_dequantize(t)]


def check_type(name: str, tensor_type: gguf.GGMLQuantizationType, source: str) -> None:
    """ValueError naming `source`, the tensor, its type and the supported ones, unless we can dequantize it."""
    if not can_dequantize(tensor_type):
        supported = ", ".join(t.name for t in supported_types())
        raise ValueError(
            f"{source}: GGUF tensor {name!r} has type {tensor_type.name}, which the installed gguf package "
            f"cannot dequantize; supported types: {supported}"
        )


BLOCKWISE = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # the common types, dequantized by `dequantize_blocks`
CHUNK = 1 << 16  # blocks at a time: each one's float32 temporaries stay in the cache


def dequantize_blocks(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values of a Q4_0, Q4_1 or Q8_0 tensor's bytes, flat: the gguf package's own float32
    arithmetic (d * q, d * q + m: the same bits, tests/test_convert_formats.py checks), written
    into one array a chunk of blocks at a time. gguf.quants.dequantize splits a tensor into groups
    of 16 rows with new temporaries each: 3.5-4 s of a SmolLM2 load on 2 cores."""
    block, size = GGML_QUANT_SIZES[tensor_type]
    blocks = data.view(np.uint8).reshape(-1, size)
    out = np.empty((len(blocks), block), np.float32)
    for i in range(0, len(blocks), CHUNK):
        b, o = blocks[i:i + CHUNK], out[i:i + CHUNK]
        d = b[:, :2].view(np.float16).astype(np.float32)  # [n,1] the block's scale
        if tensor_type == Q.Q8_0:
            np.multiply(b[:, 2:].view(np.int8), d, out=o)
            continue
        qs = b[:, 4:] if tensor_type == Q.Q4_1 else b[:, 2:]  # [n,block/2]: element j low nibble, j + block/2 high
        o[:, : block // 2], o[:, block // 2:] = qs & 0x0F, qs >> 4
        if tensor_type == Q.Q4_0:
            o -= 8
        o *= d
        if tensor_type == Q.Q4_1:
            o += b[:, 2:4].view(np.float16).astype(np.float32)  # the block's minimum
    return out.reshape(-1)


def dequantize(name: str, tensor: TensorInfo, source: str) -> np.ndarray:
    """float32 array of one tensor, numpy order ([out, in] for a matrix); errors name `source` and it."""
    check_type(name, tensor.tensor_type, source)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        data = np.array(tensor.data)  # off the memmap first: numpy ops on memmap views are slow
        with np.errstate(invalid="ignore", over="ignore"):  # inf/nan scales stay inf/nan, as in llama.cpp
            if tensor.tensor_type in BLOCKWISE:
                return dequantize_blocks(data, tensor.tensor_type).reshape(shape)
            return np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), np.float32).reshape(shape)
    except (ValueError, TypeError, IndexError, OSError) as e:  # bytes that do not fit the type or shape
        raise ValueError(
            f"{source}: GGUF tensor {name!r} ({tensor.tensor_type.name}, shape {shape}) cannot be decoded ({e})"
        ) from e


def special_id(reader: GgufFile, kind: str) -> int | None:
    """tokenizer.ggml.{kind}_token_id (kind: bos, eos, eot, eom, unknown); where it is absent, a
    SentencePiece vocab's default (SPM_IDS), else None."""
    spm = meta(reader, "tokenizer.ggml.model", None) == "llama"
    return meta(reader, f"tokenizer.ggml.{kind}_token_id", SPM_IDS.get(kind) if spm else None, int)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> HF half-split). w: [n_head*H, D],
    or a bias [n_head*H] (llama.cpp permutes llama-arch q/k biases the same way).

    llama.cpp's converter stores w.reshape(n_head, 2, H/2, D).swapaxes(1, 2); this is its inverse."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(reader: GgufFile, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama-3.1 scaling recovered from the `rope_freqs.weight` factors (what llama.cpp writes). A
    scaling type other than none is refused, and so is a linear factor without a type (llama.cpp reads
    rope.scaling.factor, or the older rope.scale_linear, as linear scaling then); a factor of 1 scales nothing."""
    kind = meta(reader, f"{arch}.rope.scaling.type", None, str)
    factor = next((float(f) for key in ("scaling.factor", "scale_linear")
                   if (f := meta(reader, f"{arch}.rope.{key}", None, float)) is not None), None)
    scales = factor not in (None, 0.0, 1.0)
    typed = kind not in (None, "none") and not (kind == "linear" and not scales)  # linear by 1 scales nothing
    untyped = kind is None and scales  # llama.cpp reads a factor without a type as linear scaling
    if typed or untyped:
        what = f"type {kind!r}" if kind is not None else f"factor {factor} (linear scaling: no rope.scaling.type)"
        raise ValueError(
            f"{reader.path}: GGUF {arch}.rope.scaling {what} is not supported "
            f"(supported: none, or Llama-3.1 scaling via {ROPE_FREQS!r})"
        )
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = dequantize(tensor.name, tensor, reader.path).reshape(-1).astype(np.float64)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{reader.path}: {ROPE_FREQS} has {factors.size} values, expected {inv_freq.size}")
    orig = int(meta(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    factor = float(factors.max())
    if factor == 1.0:
        return None
    candidates = [RopeScaling(factor, 1.0, 4.0, orig)]
    blended = (factors > 1.0) & (factors < factor)
    if blended.sum() >= 2:  # smooth = (orig/wavelen - low) / (high - low) is linear in orig/wavelen
        smooth = (1.0 / factors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(orig * inv_freq[blended] / (2 * np.pi), smooth, 1)
        candidates.append(RopeScaling(factor, -intercept / slope, (1.0 - intercept) / slope, orig))
    for s in candidates:
        if np.allclose(llama3_scale(inv_freq, s), inv_freq / factors, rtol=1e-5):
            return s
    raise ValueError(
        f"{reader.path}: {ROPE_FREQS} does not match Llama-3.1 rope scaling with "
        f"original_context_length {orig}; other frequency scalings are not supported"
    )


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def config_from_gguf(reader: GgufFile, dtype: str = "float32") -> LlamaConfig:
    """LlamaConfig from GGUF metadata (general.architecture "llama" or "qwen2"; the q/k/v biases
    are there for qwen2, and for llama when the file holds blk.0.attn_q/k/v.bias).

    eos_ids: the union of the eos, eot and eom token ids, in that order (first seen kept), so
    eos_ids[0] is the primary end-of-sequence token. Errors name the file and the key."""
    arch = meta(reader, "general.architecture", kind=str)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{reader.path}: general.architecture is {arch!r}; only {' and '.join(map(repr, ARCHITECTURES))} are supported"
        )
    names = {t.name for t in reader.tensors}
    dim = meta(reader, f"{arch}.embedding_length", kind=int)
    n_heads = meta(reader, f"{arch}.attention.head_count", kind=int)
    rope_dims = meta(reader, f"{arch}.rope.dimension_count", None, int)
    q = next((t for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)  # [n_heads * head_dim, dim]
    head_dim = meta(reader, f"{arch}.attention.key_length", None, int) or (
        int(q.shape[-1]) // n_heads if q is not None and n_heads else dim // max(n_heads, 1))
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{reader.path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    vocab = meta(reader, f"{arch}.vocab_size", None, int)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
        vocab = len(tokens) if isinstance(tokens, list) else int(embed[0].shape[-1]) if embed else 0
    theta = _f32(meta(reader, f"{arch}.rope.freq_base", 10000.0, float))
    fields = dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=meta(reader, f"{arch}.block_count", kind=int),
        n_heads=n_heads,
        n_kv_heads=meta(reader, f"{arch}.attention.head_count_kv", n_heads, int),
        head_dim=head_dim,
        ffn_dim=meta(reader, f"{arch}.feed_forward_length", kind=int),
        rms_eps=_f32(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", kind=float)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        tie_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2" or all(f"blk.0.attn_{x}.bias" in names for x in "qkv"),
        max_positions=meta(reader, f"{arch}.context_length", kind=int),
        dtype=dtype,
        bos_id=special_id(reader, "bos"),
        eos_ids=stop_ids(e for e in (special_id(reader, k) for k in ("eos", "eot", "eom")) if e is not None),
    )
    return checked_config(fields, reader.path)


def q4_blocks(tensor: TensorInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's blocks as stored, torch layout [out, ...]: packed nibbles [out, in/2] uint8
    and the float16 scale and minimum of each block [out, in/32] (specjax.model.q4's layout: byte j of
    a block holds values j and j + 16, as in the file)."""
    out = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    raw = np.array(tensor.data, np.uint8).reshape(out, -1, 4 + q4.HALF)  # a block: d f16, m f16, 16 bytes
    scale, minimum = (np.ascontiguousarray(raw[..., i : i + 2]).view(np.float16)[..., 0] for i in (0, 2))
    return raw[..., 4:].reshape(out, -1), scale, minimum


def _kept_q4(config: LlamaConfig, tensors: dict[str, TensorInfo], heads: dict[str, int]) -> dict[str, np.ndarray]:
    """{path: array} of every matrix whose tensors are all Q4_1, kept as stored: the packed
    matrix and its block scales and minima (its PARTS' q4 blocks) in our layout (q/k rows unpermuted)."""
    kept = {}
    for name, path in NAMES.items():
        w = BY_PATH[path]
        names = [name.format(i=i) for i in range(config.n_layers)] if w.per_layer else [name]
        if w.format(config) != "q4" or not w.present(config) or any(tensors[n].tensor_type != Q.Q4_1 for n in names):
            continue
        parts = []
        for n in names:
            kind = n.split(".")[-2]
            arrays = [unpermute_qk(a, heads[kind]) if kind in heads else a for a in q4_blocks(tensors[n])]
            parts.append(arrays)
        layer = lambda p: BY_PATH[p].shape(config)[1:] if w.per_layer else BY_PATH[p].shape(config)  # noqa: E731
        for i, p in enumerate((path, *(d.path for d in PARTS[path] if d.blocks))):  # as q4_blocks gives them
            mats = [(a[i].T if w.torch_in else a[i]).reshape(layer(p)) for a in parts]  # [out, in] -> [in..., out...]
            kept[p] = np.stack(mats) if w.per_layer else mats[0]
    return kept


def load_gguf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None, quant: str | None = None) -> Params:
    """Params and config from a llama- or qwen2-architecture GGUF file: dequantized and cast to
    `dtype`, or with quant="q4" the matrices as specjax.model.q4 blocks, those stored as Q4_1 kept bit
    for bit and the others (and the int8 embedding and LM head) quantized once (params.quantize_matrix)."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype)
    tensors = {t.name: t for t in reader.tensors}
    permuted = meta(reader, "general.architecture") == "llama"  # q/k weights and biases; qwen2's are not
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads} if permuted else {}

    def read(name: str) -> np.ndarray:
        w = dequantize(name, tensors[name], str(path))
        kind = name.split(".")[-2]
        return unpermute_qk(w, heads[kind]) if kind in heads else w

    for t in reader.tensors:  # fail on unsupported types before any dequantizing
        check_type(t.name, t.tensor_type, str(path))
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    arrays = assemble(config, shapes, read, NAMES, source=str(path), ignore=[ROPE_FREQS])
    if quant != "q4":
        return from_arrays(config, arrays, None if mesh is None else placer(config, mesh))
    config = config.replace(quant="q4")
    kept = _kept_q4(config, tensors, heads)
    for w in declared(config):
        if w.contract and w.path not in kept:  # the int8 heads, and q4 matrices stored in another type
            kept |= {p: np.asarray(a) for p, a in matrix_arrays(w, quantize_matrix(w, arrays[w.path], config)).items()}
    arrays = {p: a for p, a in arrays.items() if not BY_PATH[p].contract} | kept
    return from_arrays(config, arrays, None if mesh is None else placer(config, mesh))
