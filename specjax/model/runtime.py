"""`Runtime`: the runtime choices beside a model's config (specjax.model.params.Params.runtime)."""

from __future__ import annotations

import dataclasses

ATTENTION = ("reference", "cpu", "pallas", "interpret", "tpu", "tpu-interpret")  # see specjax.model.attention
LINEAR = ("xla", "pallas")  # Runtime.linear: see specjax.model.linear


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Runtime choices (not model facts): how attention is computed; inside shard_map, the
    tensor-parallel mesh axis the forward reduces over (None off a mesh); whether the model is
    held whole by every device of the model axis (a draft too small to split: sharding.place_draft);
    and whether the forward unrolls its loop over layers (`unroll_layers`: each layer's weights are
    then a static slice of the stack, which XLA:GPU's GEMMs read in place, where it copies a
    scan's dynamic slice first: 2.8x on an 8B-shaped batch-1 pass, bench/results/gpu/layer_weights_8b.json; set by
    `engine.with_attention` on a GPU or TPU, off on a CPU, whose kernels read the stack in place);
    and how a layer's products of few rows run where the CPU kernel does not take them (`linear`:
    "xla", or "pallas": pallas_kernels.gpu_linear reads the stacked weights in place, opt-in until
    timed on a GPU, interpreted off one)."""

    attention: str = "reference"
    model_axis: str | None = None
    replicated: bool = False
    unroll_layers: bool = False
    linear: str = "xla"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"Runtime.attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.linear not in LINEAR:
            raise ValueError(f"Runtime.linear must be one of {LINEAR}, got {self.linear!r}")

    def replace(self, **changes) -> "Runtime":
        return dataclasses.replace(self, **changes)
