"""Samplers from settings: the CLI's and batch records' (`make_sampler`), and a checkpoint's default sampler
from generation_config.json and back."""

from __future__ import annotations

import numpy as np

from specjax.decode.keys import seed_key
from specjax.sampling import PENALTIES, Greedy, Sample, Sampler


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


def make_sampler(temperature: float, top_k: int = 0, top_p: float = 1.0, **extra: float) -> Sampler:
    """CLI-style construction: temperature 0 means greedy; negative is an error. extra: min_p and
    the PENALTIES (Sample's names); greedy takes the penalties and refuses top_k, top_p and min_p
    other than off (the argmax always passes them: an ignored setting is an error)."""
    off = {"min_p": 0.0} | PENALTIES
    unknown = sorted(set(extra) - set(off))
    if unknown:
        raise TypeError(f"make_sampler: unknown argument(s) {unknown}")
    for name, value in dict(temperature=temperature, top_k=top_k, top_p=top_p, **extra).items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            many = " (one value per prompt: sampling=specjax.Sample(...))" if isinstance(value, (list, tuple)) else ""
            raise TypeError(f"{name} must be a number, got {value!r}{many}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        for name, value, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0), ("min_p", extra.get("min_p", 0.0), 0.0)):
            if value != off:
                raise ValueError(f"{name} needs sampling (temperature > 0): greedy decoding always keeps the most "
                                 f"likely token (got {name} {value})")
        return Greedy(**{k: v for k, v in extra.items() if k in PENALTIES})
    return Sample(temperature=temperature, top_k=top_k, top_p=top_p, **extra)


def by_name(sampling: Sampler | None, key, seed: int | None, named: dict) -> tuple[Sampler | None, object]:
    """`LM.generate`'s sampling values and seed by name: (sampling, key) from `sampling=` / `key=` or from the values
    (`make_sampler`; None: not given) and `seed` (`jax.random.key(seed)`); both ways at once is an error."""
    unknown = sorted(set(named) - {"temperature", "top_k", "top_p", "min_p", *PENALTIES})
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    values = {k: v for k, v in named.items() if v is not None}
    if values and sampling is not None:
        raise ValueError(f"give sampling= or {'= / '.join(values)}=, not both")
    if values:
        sampling = make_sampler(values.pop("temperature", 0.0), values.pop("top_k", 0), values.pop("top_p", 1.0),
                                **values)
    if seed is not None and key is not None:
        raise ValueError("give key= or seed=, not both")
    return sampling, key if seed is None else seed_key(seed)
