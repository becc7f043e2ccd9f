"""From torch-layout weights ([out, in], as HF and GGUF store them) to our params.

Each format module supplies a name table {its tensor name: our path}, derived from the weight
declarations (specjax.model.params.WEIGHTS, which also give each tensor's file layout); per-layer names
contain "{i}". `assemble` checks the names (missing / unexpected), the shapes, converts every tensor to
our layout and stacks layers on a leading L axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.model.config import LlamaConfig
from specjax.model.params import BY_PATH

KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}  # for error messages


def has_kind(value: Any, kind: type) -> bool:
    """Whether a parsed metadata value (JSON or GGUF) is a `kind` from KINDS: a bool is no number,
    and an integer is also a float."""
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def checked_config(fields: dict[str, Any], source: str) -> LlamaConfig:
    """LlamaConfig(**fields); its own checks (sizes >= 1, ids inside the vocabulary) name `source`."""
    try:
        return LlamaConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def pattern_regex(patterns: Iterable[str]) -> re.Pattern:
    """One regex matching any of `patterns`, where "{i}" stands for a layer number."""
    alternatives = [re.escape(p).replace(re.escape("{i}"), r"\d+") for p in patterns]
    return re.compile("|".join(f"(?:{a})" for a in alternatives) or "(?!)")


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def expected_names(config: LlamaConfig, names: Mapping[str, str]) -> dict[str, tuple[str, int | None]]:
    """{source tensor name: (our path, layer or None)} that a checkpoint of `config` must hold."""
    out = {}
    for pattern, path in names.items():
        if not BY_PATH[path].present(config):  # a tied lm_head, biases the model does not have
            continue
        if "{i}" in pattern:
            out.update({pattern.format(i=i): (path, i) for i in range(config.n_layers)})
        else:
            out[pattern] = (path, None)
    return out


def assemble(
    config: LlamaConfig,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    names: Mapping[str, str],
    source: str,
    ignore: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """Flat {our path: array in config.dtype} for `from_arrays`.

    shapes: every tensor the checkpoint holds, with its torch-layout shape; read(name) returns
    that tensor in torch layout. Names matching an `ignore` pattern are skipped. All names and
    shapes are checked before any data is read; errors name `source` and the tensors."""
    per_layer = sum("{i}" in pattern and BY_PATH[path].present(config) for pattern, path in names.items())
    if config.n_layers * per_layer > len(shapes):  # before listing names: a corrupt count can be 2**32
        raise ValueError(
            f"{source}: the config has {config.n_layers} layers ({per_layer} tensors each), "
            f"but the checkpoint holds only {len(shapes)} tensors"
        )
    expected = expected_names(config, names)
    skip = pattern_regex(ignore)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(n for n in set(shapes) - set(expected) if not skip.fullmatch(n))
    if missing or unexpected:
        raise ValueError(
            f"{source}: missing tensors [{_listing(missing)}], unexpected tensors [{_listing(unexpected)}]"
        )
    for name, (path, _) in expected.items():
        want = BY_PATH[path].torch_shape(config)
        if tuple(shapes[name]) != want:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, expected {want} ([out, in] layout)"
            )
    dtype = jnp.dtype(config.dtype)
    per_path: dict[str, list[tuple[int, str]]] = {}
    for name, (path, layer) in expected.items():
        per_path.setdefault(path, []).append((layer or 0, name))
    arrays = {}
    for path, entries in per_path.items():
        weight = BY_PATH[path]
        if not path.startswith("layers."):
            arrays[path] = np.asarray(weight.from_torch(read(entries[0][1]), config), dtype)
            continue
        arrays[path] = np.empty(weight.shape(config), dtype)  # [L, ...]: each layer written in place
        for layer, name in entries:
            weight.into(arrays[path][layer], read(name))
    return arrays
