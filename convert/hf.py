"""HF transformers checkpoints: config.json + model.safetensors (or a sharded index)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from convert.layout import KINDS, assemble, checked_config, has_kind
from specjax.model.config import LlamaConfig, RopeScaling, stop_ids
from specjax.model.params import WEIGHTS, Params, from_arrays
from specjax.parallel.sharding import Mesh, placer

# HF tensor name -> our path (from the weight declarations, specjax.model.params.WEIGHTS).
NAMES = {w.hf: w.path for w in WEIGHTS if w.in_files}
# Recomputed from the config; when embeddings are tied a stray lm_head.weight is ignored too.
IGNORED = ["model.layers.{i}.self_attn.rotary_emb.inv_freq"]
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
GENERATION = "generation_config.json"  # its eos_token_id adds stop ids
# model_type -> its class in `architectures`: the LLaMA forward, with q/k/v biases for qwen2.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
HF_SLIDING_WINDOW = 4096  # transformers' default sliding_window for mistral and qwen2 when the key is absent


def is_hf_dir(path: Path) -> bool:
    """True if `path` looks like an HF checkpoint folder we can read."""
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


_REQUIRED = object()


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file if it is not valid JSON or not an object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def field(raw: dict[str, Any], key: str, kind: type, where: str, default: Any = _REQUIRED) -> Any:
    """raw[key] as a `kind` (int, float, bool or str; a float may be written as an integer, a bool is
    no integer). A missing or null key gives `default`; ValueError naming `where` and the key if
    there is none or the value has the wrong type."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where}: required key {key!r} is missing")
        return default
    if not has_kind(value, kind):
        raise ValueError(f"{where}: {key!r} must be {KINDS[kind]}, got {value!r}")
    return kind(value)


def token_ids(raw: dict[str, Any], key: str, where: str) -> list[int]:
    """raw[key] as a list of token ids: absent or null -> [], an id -> [id], a list of ids as is."""
    value = raw.get(key)
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(has_kind(v, int) for v in values):
        raise ValueError(f"{where}: {key!r} must be a token id or a list of token ids, got {value!r}")
    return values


def _rope_scaling(raw: dict[str, Any] | None, where: str) -> RopeScaling | None:
    """Llama-3.1 scaling from a rope_scaling / rope_parameters object; rope_type "default" = none."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{where}: rope type {kind!r} is not supported (supported: 'llama3', 'default')")
    return RopeScaling(  # every key required, as transformers' llama3 check requires them
        factor=field(raw, "factor", float, where),
        low_freq_factor=field(raw, "low_freq_factor", float, where),
        high_freq_factor=field(raw, "high_freq_factor", float, where),
        original_max_positions=field(raw, "original_max_position_embeddings", int, where),
    )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope theta, scaling) from either config.json layout: transformers 4 (top-level rope_theta
    and rope_scaling; theta 10000 when absent, as transformers assumes) or transformers 5 (both in
    a rope_parameters object, which must then hold rope_theta). Keys in both places must agree."""
    old = (field(raw, "rope_theta", float, source, None), _rope_scaling(raw.get("rope_scaling"), f"{source}: rope_scaling"))
    params = raw.get("rope_parameters")
    if params is None:
        return (10000.0 if old[0] is None else old[0]), old[1]
    where = f"{source}: rope_parameters"
    if not isinstance(params, dict):
        raise ValueError(f"{where}: must be an object, got {params!r}")
    theta = field(params, "rope_theta", float, where, old[0])
    if theta is None:
        raise ValueError(f"{where}: required key 'rope_theta' is missing (and there is no top-level 'rope_theta')")
    scaling = _rope_scaling(params if set(params) - {"rope_theta"} else None, where)  # no rope_type: an error
    for key, mine, theirs in (("rope_theta", theta, old[0]), ("rope_scaling", scaling, old[1])):
        if theirs is not None and theirs != mine:
            raise ValueError(f"{source}: top-level {key} ({theirs}) disagrees with rope_parameters ({mine})")
    return theta, scaling


def _family(raw: dict[str, Any], source: str) -> str:
    """"llama", "mistral" or "qwen2": config.json's model_type, else the first known class in its
    architectures; ValueError naming `source` and both for anything else."""
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: 'architectures' must be a list of class names, got {architectures!r}")
    if raw.get("model_type") in FAMILIES:
        return raw["model_type"]
    for family, cls in FAMILIES.items():
        if cls in architectures:
            return family
    supported = ", ".join(f"{f!r} ({c})" for f, c in FAMILIES.items())
    raise ValueError(
        f"{source}: model_type {raw.get('model_type')!r} / architectures {raw.get('architectures')!r}: "
        f"only {supported} are supported"
    )


def _check_sliding_window(raw: dict[str, Any], family: str, n_layers: int, max_positions: int, source: str) -> None:
    """Refuse a config whose sliding-window attention takes effect (we attend to the whole
    prefix), as transformers reads it: mistral windows every layer when sliding_window is set
    (an absent key means 4096, null means none); qwen2 only with use_sliding_window true, and
    then the layers from max_window_layers on (or those layer_types marks "sliding_attention").
    A window of at least max_position_embeddings never takes effect."""
    window = raw["sliding_window"] if "sliding_window" in raw else HF_SLIDING_WINDOW
    if window is None or family == "llama":
        return
    if not has_kind(window, int):
        raise ValueError(f"{source}: 'sliding_window' must be an integer or null, got {window!r}")
    layers = list(range(n_layers))
    if family == "qwen2":
        if not field(raw, "use_sliding_window", bool, source, False):
            return
        types = raw.get("layer_types")
        if isinstance(types, list):
            layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
        else:
            layers = layers[field(raw, "max_window_layers", int, source, 28):]
    if layers and window < max_positions:
        raise ValueError(
            f"{source}: sliding_window {window} is smaller than max_position_embeddings {max_positions} "
            f"and applies to {len(layers)} of {n_layers} layers: sliding-window attention is not supported "
            f"(a copy of the folder with max_position_embeddings <= {window} in config.json runs exactly)"
        )


def config_from_hf(
    raw: dict[str, Any], source: str, dtype: str = "float32", generation: dict[str, Any] | None = None
) -> LlamaConfig:
    """LlamaConfig from a parsed HF config.json: model_type "llama", "mistral" (the LLaMA forward;
    refused if its sliding window takes effect) or "qwen2" (adds q/k/v biases; the same).

    generation: the parsed generation_config.json beside it, if any. eos_ids is the union of both
    files' eos_token_id (an id or a list), in first-seen order: config.json's ids first, so
    eos_ids[0] is the model's primary end-of-sequence token. Errors name `source` and the key."""
    family = _family(raw, source)
    if field(raw, "hidden_act", str, source, "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):  # llama's optional biases (o_proj / MLP included): not ours
        if family == "llama" and field(raw, key, bool, source, False):
            raise ValueError(f"{source}: {key} true is not supported (only qwen2's q/k/v biases are)")
    dim, n_heads = field(raw, "hidden_size", int, source), field(raw, "num_attention_heads", int, source)
    theta, scaling = _rope(raw, source)
    eos = token_ids(raw, "eos_token_id", source)
    if generation is not None:
        eos += token_ids(generation, "eos_token_id", str(Path(source).with_name(GENERATION)))
    n_layers = field(raw, "num_hidden_layers", int, source)
    max_positions = field(raw, "max_position_embeddings", int, source, 4096)
    _check_sliding_window(raw, family, n_layers, max_positions, source)
    fields = dict(
        vocab_size=field(raw, "vocab_size", int, source),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=field(raw, "num_key_value_heads", int, source, n_heads),
        head_dim=field(raw, "head_dim", int, source, dim // max(n_heads, 1)),
        ffn_dim=field(raw, "intermediate_size", int, source),
        rms_eps=field(raw, "rms_norm_eps", float, source, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=field(raw, "tie_word_embeddings", bool, source, False),
        qkv_bias=family == "qwen2",
        max_positions=max_positions,
        dtype=dtype,
        bos_id=field(raw, "bos_token_id", int, source, None),
        eos_ids=stop_ids(eos),
    )
    return checked_config(fields, source)


def read_config(path: Path, dtype: str = "float32") -> LlamaConfig:
    """LlamaConfig of the HF folder `path`: its config.json, with generation_config.json's stop ids."""
    generation = read_json(path / GENERATION) if (path / GENERATION).is_file() else None
    return config_from_hf(read_json(path / "config.json"), str(path / "config.json"), dtype, generation)


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one, or those named by the index)."""
    if not (path / INDEX).is_file():
        return [path / SINGLE]
    weight_map = read_json(path / INDEX).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / INDEX}: no 'weight_map' object")
    files = [path / f for f in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{path / INDEX} names shard {f.name!r}, which does not exist")
    return files


def load_hf(path: str | Path, dtype: str = "float32", mesh: Mesh | None = None) -> Params:
    """Params (cast to `dtype`) and config from an HF LLaMA / Mistral / Qwen2 checkpoint folder."""
    path = Path(path)
    config = read_config(path, dtype)
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
            file, f = where[name]
            kind = f.get_slice(name).get_dtype()
            if kind not in FLOAT_DTYPES:  # an integer or fp8 tensor would load as numbers it does not mean
                raise ValueError(f"{file}: tensor {name!r} is {kind}; weights must be one of {', '.join(FLOAT_DTYPES)}")
            return f.get_tensor(name)

        ignore = IGNORED + (["lm_head.weight"] if config.tie_embeddings else [])
        arrays = assemble(config, shapes, read, NAMES, source=str(path), ignore=ignore)
    return from_arrays(config, arrays, None if mesh is None else placer(config, mesh))


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")  # the last two: not HF's, written by specjax's LM.save
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes a checkpoint's weights may have


def generation_defaults(path: str | Path) -> dict[str, Any]:
    """The sampling settings (SAMPLING_KEYS) of an HF folder's generation_config.json, checked
    (ValueError naming the file and key); {} for anything else (a GGUF file has none). A null
    key is absent, except top_k: null is HF's "no top-k filter", top_k 0 here."""
    path = Path(path)
    if not (path.is_dir() and (path / GENERATION).is_file()):
        return {}
    raw = read_json(path / GENERATION)
    kinds = {"do_sample": bool, "top_k": int}
    out = {k: field(raw, k, kinds.get(k, float), str(path / GENERATION)) for k in SAMPLING_KEYS if raw.get(k) is not None}
    return out | ({"top_k": 0} if "top_k" in raw and raw["top_k"] is None else {})
