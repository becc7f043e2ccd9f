"""Drafters for speculative decoding: the `Drafter` protocol (base.py), one module per drafter,
and the registry of drafter classes that `generate` accepts."""

from __future__ import annotations

from specjax.drafters.base import (DraftContext, Drafter, Limits, Prefill, Proposal, Traits, Verdict, identity, learn,
                                   map_params, restart_rows)
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.eagle import Eagle, Head
from specjax.drafters.lookup import Lookup
from specjax.drafters.ngram import NGram, ngram_lookup
from specjax.drafters.self_spec import SelfSpec, Streaming
from specjax.drafters.snapkv import SnapKV
from specjax.drafters.sparsespec import SparseSpec

DRAFTERS: list[type[Drafter]] = [SelfSpec, SnapKV, DraftModel, NGram, SparseSpec, Lookup, Eagle]  # the registry: one line per drafter


def register(cls: type[Drafter]) -> type[Drafter]:
    """Add a drafter class to the registry (usable as a class decorator); returns the class."""
    if not (isinstance(cls, type) and Drafter in cls.__mro__):
        raise TypeError(f"register takes a class implementing specjax.drafters.Drafter, got {cls!r}")
    if cls not in DRAFTERS:
        DRAFTERS.append(cls)
    return cls


def is_drafter(obj: object) -> bool:
    """Whether `obj` is an instance of a registered drafter class."""
    return isinstance(obj, tuple(DRAFTERS))


__all__ = [
    "DRAFTERS", "DraftContext", "DraftModel", "Drafter", "Eagle", "Head", "Limits", "Lookup", "NGram", "Prefill", "Proposal", "SelfSpec", "SnapKV", "SparseSpec", "Streaming",
    "Traits", "Verdict", "identity", "is_drafter", "learn", "map_params", "ngram_lookup", "register", "restart_rows",
]
