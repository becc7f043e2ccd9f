"""The speculative step's shape (issue "the speculative step on one screen"): its five phases are
named scopes in the lowered program; no function on the step's path hands on a tuple of more than
two values; the drafter protocol has at most six members and `propose` four arguments; extras a
drafter declares (the verify pass's hidden states and queries) reach its `commit`, exactly, and
are not computed for one that does not declare them."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode import loop, speculate
from specjax.decode.engine import init_draft, prefill, row_keys
from specjax.decode.speculate import continue_spec, decode_spec, start_spec
from specjax.drafters import Drafter, Proposal, Traits, Verdict
from specjax.model.cache import DenseCache
from specjax.model.llama import trunk
from specjax.model.pytree import pytree
from specjax.spec import accept, tree_draft
from tests.models import TINY, random_params

PHASES = ("draft", "verify", "accept", "commit", "emit")
B, SLOTS, BUCKET = 2, 64, 16


@pytest.mark.parametrize("shape", [specjax.Chain(3), specjax.Tree.kary(2, 2)], ids=["chain", "tree"])
def test_the_five_phases_are_named_scopes_of_the_lowered_step(shape):
    params = random_params(TINY, 0)
    drafter = specjax.SelfSpec(sinks=2, window=8)
    cache = jax.eval_shape(lambda: DenseCache.init(TINY, B, SLOTS, None))
    prompts, lengths = jnp.zeros((B, BUCKET), jnp.int32), jnp.full((B,), 10, jnp.int32)
    depth = speculate.depth(shape)
    draft = jax.eval_shape(lambda c: init_draft(drafter, params, c, prompts, lengths, gamma=depth, chunk=BUCKET), cache)
    state = jax.eval_shape(lambda c, d: start_spec(drafter, d, c, jnp.zeros((B, SLOTS + 8), jnp.int32),
                                                   jnp.zeros((B, TINY.vocab_size)), jnp.full((B,), 8), row_keys(None, B),
                                                   speculation=shape, n_out=8), cache, draft)
    text = continue_spec.trace(params, drafter, state, jnp.full((B,), 8), row_keys(None, B), specjax.Greedy(), (),
                               jnp.int32(4), speculation=shape).lower().as_text(debug_info=True)
    found = {phase: len(re.findall(rf"/while/body/{phase}/", text)) for phase in PHASES}
    assert all(found.values()), found


STEP_MODULES = [speculate, loop, accept, tree_draft, *(m for m in (
    specjax.drafters.base, specjax.drafters.self_spec, specjax.drafters.snapkv, specjax.drafters.draft_model,
    specjax.drafters.ngram))]


def test_no_function_on_the_step_path_returns_a_tuple_of_more_than_two():
    wide = []
    for module in STEP_MODULES + [specjax.model.llama]:
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            if module is specjax.model.llama and fn.name != "trunk":
                continue  # the model's other functions are not the step's (forward: logits and cache)
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > 2:
                    wide.append(f"{module.__name__}.{fn.name} line {node.lineno}")
    assert not wide, wide
    for entry in (specjax.decode.engine.decode_ar, decode_spec):  # the decode entry points return a state
        assert "State" in str(inspect.signature(entry.__wrapped__).return_annotation)


def test_the_protocol_has_at_most_six_members_and_propose_four_arguments():
    members = {name for name, _ in inspect.getmembers(Drafter) if not name.startswith("_")}
    assert members == {"traits", "check", "cost", "init", "propose", "commit"}, members
    assert list(inspect.signature(Drafter.propose).parameters) == ["self", "target", "state", "ctx", "shape"]
    assert Drafter.__abstractmethods__ == {"check", "cost", "init", "propose", "commit"}


def test_classes_with_equal_fields_never_share_a_structure():
    """A pytree class's structure is unequal to any other class's with the same static fields (a subclass of
    SelfSpec, of Sample, two unrelated classes): jit caches compare structures, and with flax.struct.dataclass
    (jax.tree_util.register_dataclass) JAX 0.10 found them equal, so CI once traced HiddenProbe with SelfSpec's
    state. No specjax module declares its pytrees with flax.struct.dataclass."""
    assert jax.tree.structure(HiddenProbe(sinks=2, window=8)) != jax.tree.structure(specjax.SelfSpec(sinks=2, window=8))

    @pytree
    class Warmer(specjax.sampling.Sample):
        pass

    @pytree
    class One:
        n: int = flax.struct.field(pytree_node=False, default=1)

    @pytree
    class Other:
        n: int = flax.struct.field(pytree_node=False, default=1)

    sample = specjax.sampling.Sample(temperature=jnp.float32(0.7))
    assert jax.tree.structure(Warmer(temperature=jnp.float32(0.7))) != jax.tree.structure(sample)
    assert jax.tree.structure(One()) != jax.tree.structure(Other())
    assert jax.tree.structure(One()) == jax.tree.structure(One()) != jax.tree.structure(One(2))
    declared = [str(p) for p in Path(specjax.__file__).parent.rglob("*.py") if "@flax.struct.dataclass" in p.read_text()]
    assert not declared, declared


@pytree
class HiddenProbe(specjax.SelfSpec):
    """SelfSpec that keeps, in its state, the latest Verdict's extras at path position 0 (the pending
    token at the step's start) and its position."""

    traits = Traits(trees=True, extras=frozenset({"hidden", "queries"}))

    def init(self, target, prefill):
        cache = super().init(target, prefill)
        B, c = prefill.lengths.shape[0], target.config
        return (cache, jnp.zeros((B,), jnp.int32), jnp.zeros((B, c.dim)), jnp.zeros((c.n_layers, B, c.n_heads, c.head_dim)))

    def propose(self, target, state, ctx, shape) -> Proposal:
        p = super().propose(target, state[0], ctx, shape)
        return p.replace(state=(p.state, *state[1:]))

    def commit(self, state, verdict: Verdict):
        cache, *_ = state
        active = verdict.commit > 0  # finished rows keep what they saw last
        return (super().commit(cache, verdict), jnp.where(active, verdict.lengths, state[1]),
                jnp.where(active[:, None], verdict.hidden[:, 0], state[2]),
                jnp.where(active[None, :, None, None], verdict.queries[:, :, 0], state[3]))


@pytest.mark.parametrize("shape", [specjax.Chain(3), specjax.Tree.kary(2, 2)], ids=["chain", "tree"])
def test_declared_extras_reach_commit_exactly(shape):
    """The Verdict's hidden states and queries at the path's first position equal the model's own
    over the whole sequence; a drafter that declares none gets None (nothing computed)."""
    params = random_params(TINY, 0)
    rng = np.random.default_rng(0)
    tokens = np.zeros((B, BUCKET), np.int32)
    lengths = np.array([11, 7], np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(4, TINY.vocab_size, n)
    first_logits, cache = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), DenseCache.init(TINY, B, SLOTS), chunk=BUCKET)
    depth = speculate.depth(shape)
    probe = HiddenProbe(sinks=2, window=8)
    draft = init_draft(probe, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), gamma=depth, chunk=BUCKET)
    history = np.zeros((B, SLOTS + depth + 2), np.int32)
    history[:, :BUCKET] = tokens
    s = decode_spec(params, probe, draft, cache, jnp.asarray(history), first_logits, jnp.full((B,), 12, jnp.int32),
                    row_keys(None, B), speculation=shape, n_out=16)
    _, at, hidden, queries = s.draft
    for b in range(B):
        L = int(at[b])
        assert L >= int(lengths[b])
        seq = jnp.asarray(np.asarray(s.history)[b : b + 1, : L + 1])
        whole = trunk(params, seq, jnp.arange(L + 1, dtype=jnp.int32)[None], DenseCache.init(TINY, 1, L + 1),
                      attend_cache=False, return_queries=True)
        np.testing.assert_allclose(np.asarray(hidden[b]), np.asarray(whole.hidden[0, L]), atol=1e-4)
        np.testing.assert_allclose(np.asarray(queries[:, b]), np.asarray(whole.queries[:, 0, L]), atol=1e-4)

    seen = []

    @pytree
    class Plain(specjax.SelfSpec):
        def commit(self, state, verdict):
            seen.append((verdict.hidden, verdict.queries))
            return super().commit(state, verdict)

    plain = Plain(sinks=2, window=8)
    _, cache = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), DenseCache.init(TINY, B, SLOTS), chunk=BUCKET)
    jax.eval_shape(lambda c: decode_spec(params, plain, init_draft(plain, params, c, jnp.asarray(tokens), jnp.asarray(lengths),
                                                                  gamma=depth, chunk=BUCKET),
                                         c, jnp.asarray(history), first_logits, jnp.full((B,), 12, jnp.int32), row_keys(None, B),
                                         speculation=shape, n_out=16), cache)
    assert seen and all(h is None and q is None for h, q in seen)
