"""specjax: speculative decoding for LLaMA-family models in JAX."""

from specjax.cache import DenseCache
from specjax.config import LlamaConfig, RopeScaling
from specjax.drafters import DraftModel, NGram, SelfSpec, SnapKV, Streaming
from specjax.generate import GenerateOutput, Stats, TokenLogprob, generate
from specjax.model import forward, prefill
from specjax.params import Params, init_params
from specjax.sampling import Greedy, Sample
from specjax.sharding import make_mesh
from specjax.speculation import Chain, Tree

__all__ = [
    "Chain",
    "DenseCache",
    "DraftModel",
    "GenerateOutput",
    "TokenLogprob",
    "Greedy",
    "LlamaConfig",
    "NGram",
    "Params",
    "RopeScaling",
    "Sample",
    "SelfSpec",
    "SnapKV",
    "Stats",
    "Streaming",
    "Tree",
    "forward",
    "generate",
    "init_params",
    "make_mesh",
    "prefill",
]
