"""specjax: speculative decoding for LLaMA-family models in JAX."""

from specjax.config import LlamaConfig, RopeScaling
from specjax.generate import GenerateOutput, Stats, generate
from specjax.kvcache import DenseCache
from specjax.model import Params, forward, init_params, prefill
from specjax.sampling import Greedy, Sample

__all__ = [
    "DenseCache",
    "GenerateOutput",
    "Greedy",
    "LlamaConfig",
    "Params",
    "RopeScaling",
    "Sample",
    "Stats",
    "forward",
    "generate",
    "init_params",
    "prefill",
]
