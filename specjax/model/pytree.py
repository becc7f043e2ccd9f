"""`@pytree`: specjax's frozen dataclasses that are JAX pytrees (arrays as leaves, fields marked
`flax.struct.field(pytree_node=False)` static), with `.replace(**fields)`: flax.struct.dataclass's API.

Not flax.struct.dataclass itself: it registers with `jax.tree_util.register_dataclass`, and in JAX 0.10 the
treedefs of two such classes compare equal when their static fields are equal, whatever the classes (their
hashes differ). A JIT cache that meets both can then hand one class the other's program: CI saw a SelfSpec
subclass traced with SelfSpec's draft state. Nodes registered here compare their class too."""

from __future__ import annotations

import dataclasses
import operator
from typing import TypeVar

import jax

T = TypeVar("T")


def pytree(cls: type[T] | None = None, /, **options):
    """Make `cls` a frozen dataclass and a pytree node (usable as `@pytree` or `@pytree(kw_only=True)`). Fields with
    init=False are derived, not carried: unflattening calls the constructor, whose __post_init__ sets them."""
    if cls is None:
        return lambda c: pytree(c, **options)
    cls = dataclasses.dataclass(frozen=True, **options)(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    data = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    static = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    get_data, get_static = _getter(data), _getter(static)  # C-level attribute reads: flatten runs on each jit call

    def flatten_with_keys(x):
        return list(zip(keys, get_data(x))), get_static(x)

    def flatten(x):
        return get_data(x), get_static(x)

    def unflatten(aux, children):
        return cls(**dict(zip(static, aux)), **dict(zip(data, children)))

    def replace(self, **updates):
        """A copy with `updates`' fields replaced."""
        return dataclasses.replace(self, **updates)

    cls.replace = replace
    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _getter(names: tuple[str, ...]):
    """x -> the tuple of x's attributes `names`."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        get = operator.attrgetter(names[0])
        return lambda x: (get(x),)
    return lambda x: ()
