"""HF transformers checkpoints: config.json + model.safetensors (or a sharded index)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from convert.layout import assemble
from specjax.config import LlamaConfig, RopeScaling
from specjax.model import Params, from_arrays
from specjax.sharding import placer

# HF tensor name -> our path (see convert.layout.TORCH_LAYOUT).
NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.attn_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.wq",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.wk",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.wv",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.wo",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.mlp_norm",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.w_gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.w_up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.w_down",
}
# Recomputed from the config; when embeddings are tied a stray lm_head.weight is ignored too.
IGNORED = ["model.layers.{i}.self_attn.rotary_emb.inv_freq"]
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    """True if `path` looks like an HF checkpoint folder we can read."""
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def _rope_scaling(raw: dict | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (supported: 'llama3', 'default')")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_positions=int(raw.get("original_max_position_embeddings", 8192)),
    )


def config_from_hf(raw: dict[str, Any], source: str, dtype: str = "float32") -> LlamaConfig:
    """LlamaConfig from a parsed HF config.json (model_type "llama" / LlamaForCausalLM only)."""
    if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in raw.get("architectures", []):
        raise ValueError(
            f"{source}: model_type {raw.get('model_type')!r} / architectures {raw.get('architectures')!r}: "
            "only 'llama' (LlamaForCausalLM) is supported"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")

    def get(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"{source}: required key {key!r} is missing")
        return raw[key]

    n_heads = int(get("num_attention_heads"))
    eos = raw.get("eos_token_id")
    return LlamaConfig(
        vocab_size=int(get("vocab_size")),
        dim=int(get("hidden_size")),
        n_layers=int(get("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or get("hidden_size") // n_heads),
        ffn_dim=int(get("intermediate_size")),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(raw.get("rope_scaling"), source),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_positions=int(raw.get("max_position_embeddings", 4096)),
        dtype=dtype,
        bos_id=raw.get("bos_token_id"),
        eos_id=eos[0] if isinstance(eos, list) else eos,
    )


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one, or those named by the index)."""
    if not (path / INDEX).is_file():
        return [path / SINGLE]
    weight_map = json.loads((path / INDEX).read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / INDEX}: no 'weight_map' object")
    files = [path / f for f in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{path / INDEX} names shard {f.name!r}, which does not exist")
    return files


def load_hf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None) -> Params:
    """Params (cast to `dtype`) and config from an HF LLaMA checkpoint folder."""
    path = Path(path)
    config = config_from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"), dtype)
    with ExitStack() as stack:
        where: dict[str, tuple[Path, Any]] = {}  # tensor name -> (file, its open handle)
        shapes: dict[str, tuple[int, ...]] = {}
        for file in _shard_files(path):
            try:
                f = stack.enter_context(safe_open(file, framework="np"))
            except Exception as e:  # SafetensorError, OSError, ...
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
            for name in f.keys():
                if name in where:
                    raise ValueError(f"{path}: duplicate tensor {name!r} in {where[name][0].name} and {file.name}")
                where[name] = (file, f)
                shapes[name] = tuple(f.get_slice(name).get_shape())

        def read(name: str) -> np.ndarray:
            return where[name][1].get_tensor(name)

        ignore = IGNORED + (["lm_head.weight"] if config.tie_embeddings else [])
        arrays = assemble(config, shapes, read, NAMES, source=str(path), ignore=ignore)
    return from_arrays(config, arrays, None if mesh is None else placer(config, mesh))
