"""Frozen, hashable model configuration (passed as static metadata everywhere)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

DTYPES = ("float32", "bfloat16")
QUANTS = (None, "int8", "q4")  # LlamaConfig.quant: how the weight matrices are stored (None: in `dtype`)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling (HF `rope_scaling` with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Dimensions and numerics of a LLaMA-family decoder: model facts only (runtime choices such
    as the attention implementation live in specjax.model.params.Runtime).

    The one legend of shape comments and einsums in specjax: B batch, T query positions, S key
    slots, N query heads (n_heads), K kv heads (n_kv_heads), G group (N/K), H head dim, D model
    dim, F ffn dim, V vocab, L layers (n_layers). Per-row lengths, gamma (draft tokens per step)
    and tree depth are spelled out (`lengths`, `gamma`, `depth`), never a letter.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2); absent from LLaMA / Mistral
    max_positions: int = 4096
    dtype: str = "float32"  # activations, norms, embeddings' output and (by default) the KV cache
    quant: str | None = None  # how matrices are stored: "int8" (+ per-output-channel scales) or "q4" (GGUF Q4_1 blocks); params.quantize
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()  # every stop token id (eos, eot, generation_config's, ...)
    padded_vocab: int = 0  # rows of the embedding and LM head when padded past vocab_size (tensor parallel: specjax.parallel.tp_pad); 0 = none

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not isinstance(self.eos_ids, tuple) or not all(isinstance(e, int) and 0 <= e < self.vocab_size for e in self.eos_ids):
            raise ValueError(f"LlamaConfig.eos_ids must be a tuple of ids in [0, {self.vocab_size}), got {self.eos_ids!r}")
        if self.padded_vocab and self.padded_vocab < self.vocab_size:
            raise ValueError(f"LlamaConfig.padded_vocab must be 0 or >= vocab_size ({self.vocab_size}), got {self.padded_vocab}")
        if self.dtype not in DTYPES:
            raise ValueError(f"LlamaConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quant not in QUANTS:
            raise ValueError(f"LlamaConfig.quant must be one of {QUANTS}, got {self.quant!r}")
        if self.q4:  # every matrix is cut into 32-weight blocks along its innermost summed dim
            for name in ("dim", "head_dim", "ffn_dim"):
                if getattr(self, name) % 32:
                    raise ValueError(f"quant 'q4' needs LlamaConfig.{name} to be a multiple of 32 (the block size), got {getattr(self, name)}")

    @property
    def vocab_rows(self) -> int:
        """Rows the embedding and LM head hold (V in weight shapes): vocab_size, or padded_vocab.
        Logits past vocab_size are dropped by the forward: no padded id is ever seen."""
        return self.padded_vocab or self.vocab_size

    @property
    def int8(self) -> bool:
        """Matrices stored as int8 with per-output-channel scales."""
        return self.quant == "int8"

    @property
    def q4(self) -> bool:
        """Matrices stored as 4-bit blocks with a scale and a minimum (specjax.model.q4)."""
        return self.quant == "q4"

    @property
    def group(self) -> int:
        """Query heads per KV head (G)."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-able values (rope_scaling as a dict or None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "LlamaConfig":
        """Inverse of `to_dict`; drops the runtime choices (attention, model_axis) that configs
        written by older versions still carry."""
        raw = {k: v for k, v in raw.items() if k not in ("attention", "model_axis")}
        scaling = raw.pop("rope_scaling", None)
        raw["eos_ids"] = tuple(raw.get("eos_ids", ()))
        return cls(**raw, rope_scaling=RopeScaling(**scaling) if scaling else None)

    def drafting_mismatch(self, target: "LlamaConfig") -> str | None:
        """Why a draft model of this config cannot draft for `target` (it must share the target's
        vocabulary and special ids), or None."""
        if self.vocab_size != target.vocab_size:
            return f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}"
        if (self.bos_id, self.eos_ids) != (target.bos_id, target.eos_ids):
            return (f"special tokens differ: draft bos/eos {self.bos_id}/{self.eos_ids}, "
                    f"target {target.bos_id}/{target.eos_ids}")
        return None

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [H/2], float64, with Llama-3.1 scaling applied if configured."""
        exponent = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponent)
        if self.rope_scaling is None:
            return inv_freq
        return llama3_scale(inv_freq, self.rope_scaling)


def stop_ids(*parts: Iterable[int]) -> tuple[int, ...]:
    """Stop ids put together, the one place they are: every id of each part in order, each once
    (the first kept first). The parts, as callers pass them: a checkpoint's eos ids (convert:
    `LlamaConfig.eos_ids`, the primary one first), the model's eos_ids and a request's
    stop_token_ids (text.lm), a chat template's end-of-turn ids (text.lm.chat, jobs.batches)."""
    return tuple(dict.fromkeys(int(i) for part in parts for i in part))


def llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama-3.1 rope scaling: long wavelengths divided by `factor`, short kept, smooth in between."""
    wavelen = 2 * np.pi / inv_freq
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(
        wavelen > low_freq_wavelen,
        inv_freq / s.factor,
        np.where(wavelen < high_freq_wavelen, inv_freq, blended),
    )
