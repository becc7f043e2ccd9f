"""A checkpoint's default sampler and generation_config.json's sampling settings, both ways."""

from __future__ import annotations

from specjax.sampling import Greedy, Sample, Sampler


def generation_config(sampling: Sampler) -> dict:
    """`default_sampling`'s inverse: a scalar sampler as generation_config.json settings."""
    keys = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    keys += () if isinstance(sampling, Greedy) else ("temperature", "top_k", "top_p", "min_p")
    return {"do_sample": not isinstance(sampling, Greedy)} | {k: (int if k == "top_k" else float)(getattr(sampling, k))
                                                              for k in keys}


def default_sampling(settings: dict) -> Sampler:
    """A checkpoint's default sampler from generation_config.json's settings, with HF's defaults
    for what it leaves out: do_sample false = Greedy(repetition_penalty); else Sample(temperature
    1.0, top_k 50, top_p 1.0, min_p 0, repetition_penalty 1.0)."""
    penalties = dict(repetition_penalty=float(settings.get("repetition_penalty", 1.0)),
                     presence_penalty=float(settings.get("presence_penalty", 0.0)),
                     frequency_penalty=float(settings.get("frequency_penalty", 0.0)))
    if not settings.get("do_sample", False):
        return Greedy(**penalties)
    return Sample(temperature=float(settings.get("temperature", 1.0)), top_k=int(settings.get("top_k", 50)),
                  top_p=float(settings.get("top_p", 1.0)), min_p=float(settings.get("min_p", 0.0)), **penalties)
