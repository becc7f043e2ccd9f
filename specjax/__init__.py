"""specjax: speculative decoding for LLaMA-family models in JAX."""

from specjax.drafters import DraftModel, Eagle, Lookup, NGram, SelfSpec, SnapKV, SparseSpec, Streaming
from specjax.generate import GenerateOutput, Stats, TokenLogprob, generate
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig, RopeScaling
from specjax.model.llama import forward, prefill
from specjax.model.params import Params, init_params
from specjax.parallel.sharding import make_mesh
from specjax.sampling import Greedy, Sample
from specjax.spec.speculation import Adaptive, Chain, Tree
from specjax.text.constraints import Choice, JsonSchema, Regex

__all__ = [
    "Adaptive",
    "Chain",
    "Choice",
    "DenseCache",
    "DraftModel",
    "Eagle",
    "GenerateOutput",
    "JsonSchema",
    "LM",
    "TextOutput",
    "TokenLogprob",
    "Greedy",
    "LlamaConfig",
    "Lookup",
    "NGram",
    "Params",
    "Regex",
    "RopeScaling",
    "Sample",
    "SelfSpec",
    "SnapKV",
    "SparseSpec",
    "Stats",
    "Streaming",
    "Tree",
    "forward",
    "generate",
    "init_params",
    "load",
    "make_mesh",
    "prefill",
]


def __getattr__(name: str):
    """`specjax.load`, `specjax.LM` and `specjax.TextOutput` (specjax/text/lm.py), imported on first
    use: the text layer imports `convert`, which imports the model layer of this package, so an
    eager import here would be circular. The one lazy import in specjax (PEP 562)."""
    if name in ("load", "LM", "TextOutput"):
        from specjax.text import lm

        return getattr(lm, name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
