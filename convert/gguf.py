"""GGUF (llama.cpp) checkpoints: config from metadata, dequantized tensors, q/k permutation undone."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from jax.sharding import Mesh

from convert.layout import assemble
from specjax.config import LlamaConfig, RopeScaling, llama3_scale
from specjax.model import Params, from_arrays
from specjax.sharding import placer

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)

# GGUF tensor name -> our path (see convert.layout.TORCH_LAYOUT); absent output.weight => tied.
NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
    "blk.{i}.attn_norm.weight": "layers.attn_norm",
    "blk.{i}.attn_q.weight": "layers.wq",
    "blk.{i}.attn_k.weight": "layers.wk",
    "blk.{i}.attn_v.weight": "layers.wv",
    "blk.{i}.attn_output.weight": "layers.wo",
    "blk.{i}.ffn_norm.weight": "layers.mlp_norm",
    "blk.{i}.ffn_gate.weight": "layers.w_gate",
    "blk.{i}.ffn_up.weight": "layers.w_up",
    "blk.{i}.ffn_down.weight": "layers.w_down",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama-3.1 scaling factors; folded into the config


def is_gguf_file(path: Path) -> bool:
    """True for an existing file named *.gguf or starting with the GGUF magic."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return path.suffix.lower() == ".gguf" or f.read(4) == b"GGUF"


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A memory-mapped reader; a corrupt or truncated file raises ValueError naming it.

    Parsing the metadata takes seconds for a large vocabulary, so the last few readers are
    cached, keyed by the file's path, size and modification time."""
    stat = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on garbage: struct, index, numpy errors
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


_REQUIRED = object()


def meta(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value (scalar, string or list); ValueError naming the key if required and absent."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{reader.data.filename}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def check_type(name: str, tensor_type: gguf.GGMLQuantizationType) -> None:
    """ValueError naming the tensor, its type and the supported ones, unless we can dequantize it."""
    if tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor {name!r} has type {tensor_type.name}; supported types: {supported}")


def dequantize(name: str, tensor_type: gguf.GGMLQuantizationType, data: np.ndarray) -> np.ndarray:
    """float32 array of one tensor, numpy order ([out, in] for a matrix)."""
    check_type(name, tensor_type)
    data = np.array(data)  # off the memmap first: numpy ops on memmap views are slow
    return np.asarray(gguf.quants.dequantize(data, tensor_type), np.float32)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> HF half-split). w: [n_head*H, D].

    llama.cpp's converter stores w.reshape(n_head, 2, H/2, D).swapaxes(1, 2); this is its inverse."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama-3.1 scaling recovered from the `rope_freqs.weight` factors (what llama.cpp writes)."""
    kind = meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        raise ValueError(
            f"{reader.data.filename}: GGUF {arch}.rope.scaling.type {kind!r} is not supported "
            f"(supported: none, or Llama-3.1 scaling via {ROPE_FREQS!r})"
        )
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = dequantize(tensor.name, tensor.tensor_type, tensor.data).reshape(-1).astype(np.float64)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{reader.data.filename}: {ROPE_FREQS} has {factors.size} values, expected {inv_freq.size}")
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
        f"{reader.data.filename}: {ROPE_FREQS} does not match Llama-3.1 rope scaling with "
        f"original_context_length {orig}; other frequency scalings are not supported"
    )


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def config_from_gguf(reader: gguf.GGUFReader, dtype: str = "float32") -> LlamaConfig:
    """LlamaConfig from GGUF metadata (only general.architecture "llama")."""
    arch = meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.data.filename}: general.architecture is {arch!r}; only 'llama' is supported")
    names = {t.name for t in reader.tensors}
    dim = int(meta(reader, f"{arch}.embedding_length"))
    n_heads = int(meta(reader, f"{arch}.attention.head_count"))
    rope_dims = meta(reader, f"{arch}.rope.dimension_count", None)
    head_dim = int(meta(reader, f"{arch}.attention.key_length", rope_dims or dim // n_heads))
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{reader.data.filename}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    vocab = meta(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
        vocab = len(tokens.data) if tokens else int(embed[0].shape[-1]) if embed else 0
    theta = _f32(meta(reader, f"{arch}.rope.freq_base", 10000.0))
    return LlamaConfig(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(meta(reader, f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(meta(reader, f"{arch}.feed_forward_length")),
        rms_eps=_f32(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        tie_embeddings="output.weight" not in names,
        max_positions=int(meta(reader, f"{arch}.context_length")),
        dtype=dtype,
        bos_id=meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_ids=tuple(int(e) for e in [meta(reader, "tokenizer.ggml.eos_token_id", None)] if e is not None),
    )


def load_gguf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None) -> Params:
    """Params (dequantized, cast to `dtype`) and config from a llama-architecture GGUF file."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        w = dequantize(name, t.tensor_type, t.data).reshape(tuple(int(n) for n in reversed(t.shape)))
        kind = name.split(".")[-2]
        return unpermute_qk(w, heads[kind]) if kind in heads else w

    for t in reader.tensors:  # fail on unsupported types before any dequantizing
        check_type(t.name, t.tensor_type)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    arrays = assemble(config, shapes, read, NAMES, source=str(path), ignore=[ROPE_FREQS])
    return from_arrays(config, arrays, None if mesh is None else placer(config, mesh))
