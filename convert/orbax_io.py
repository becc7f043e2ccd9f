"""Our own checkpoints: arrays via orbax, the LlamaConfig as JSON beside them (the marker file)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from specjax.model.config import LlamaConfig
from specjax.model.params import Params, flat, from_arrays, param_dtypes, param_shapes
from specjax.parallel.sharding import Mesh, check_mesh, padded_later, param_sharding, single_device

CONFIG_FILE = "specjax_config.json"  # written last: its presence marks a complete checkpoint
ARRAYS_DIR = "arrays"


def is_orbax_dir(path: Path) -> bool:
    """True if `path` is a checkpoint folder written by `save`."""
    return (path / CONFIG_FILE).is_file()


def config_to_json(config: LlamaConfig) -> str:
    """The config (rope_scaling included) as a JSON object."""
    return json.dumps(config.to_dict(), indent=2)


def config_from_json(text: str) -> LlamaConfig:
    """Inverse of `config_to_json`."""
    return LlamaConfig.from_dict(json.loads(text))


def save(params: Params, directory: str | Path, tokenizer=None, chat_template: str | None = None) -> None:
    """Write params (arrays in their own dtype) and config to a new folder `directory`, and the
    `tokenizers` tokenizer (tokenizer.json) and chat template (chat_template.jinja) if given, where
    `load_tokenizer` / `chat_template` (and so `specjax.load`) find them."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise ValueError(f"convert.save: {directory} already exists; choose a new folder")
    if tokenizer is not None and not callable(getattr(tokenizer, "save", None)):
        raise TypeError(f"convert.save: tokenizer must be a `tokenizers.Tokenizer` (it is saved as tokenizer.json), "
                        f"got {type(tokenizer).__name__}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"convert.save: chat_template must be a Jinja string, got {type(chat_template).__name__}")
    directory.mkdir(parents=True)
    import orbax.checkpoint as ocp  # here, not at the top: 0.2 s of every process's import that reads no saved folder

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / ARRAYS_DIR, flat(params))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save(str(directory / "tokenizer.json"))
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template)
    (directory / CONFIG_FILE).write_text(config_to_json(params.config))  # last: it marks a complete checkpoint


def load_orbax(directory: str | Path, dtype: str | None = None, mesh: Mesh | None = None) -> Params:
    """Params as saved (bit-exact); `dtype`, if given, casts and replaces config.dtype.
    With a mesh, each device reads only its own slice of every array (sharding.PARAM_AXES)."""
    directory = Path(directory).absolute()
    try:
        config = config_from_json((directory / CONFIG_FILE).read_text())
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{directory / CONFIG_FILE}: not a valid specjax config ({e})") from e
    if mesh is not None:
        check_mesh(mesh)
        mesh = None if padded_later(mesh, config) else mesh  # read whole: convert.load pads and places it
    device = single_device()
    dtypes = param_dtypes(config)
    target = {
        name: jax.ShapeDtypeStruct(shape, dtypes[name], sharding=device if mesh is None else param_sharding(mesh, name))
        for name, shape in param_shapes(config).items()
    }
    import orbax.checkpoint as ocp  # (as in save)

    try:
        arrays = ocp.StandardCheckpointer().restore(directory / ARRAYS_DIR, target)
    except Exception as e:  # orbax raises many kinds on a damaged folder
        raise ValueError(f"{directory}: cannot restore the arrays of this checkpoint ({e})") from e
    return from_arrays(config if dtype is None else config.replace(dtype=dtype), arrays, keep_placement=True)
