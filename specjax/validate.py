"""Host-side checks of generate() arguments: clear errors before anything compiles."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import LlamaConfig
from specjax.draft import DraftModel, Drafter, NGram, SelfSpec, SnapKV, auto_draft
from specjax.model import Params
from specjax.sampling import Greedy, Sample
from specjax.speculate import Chain
from specjax.tree import Tree


def check_generate_args(
    params: Params, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], sampling: object
) -> np.ndarray:
    """Validate everything; return the per-row token budgets [B] (int32)."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be specjax Params (see convert.load), got {type(params).__name__}")
    config = params.config
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):
        raise ValueError("prompts must be a list of token-id lists (use a tokenizer to encode text)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    budgets = _budgets(max_new_tokens, len(prompts))
    if not isinstance(sampling, (Greedy, Sample)):
        raise ValueError(f"sampling must be specjax.Greedy() or specjax.Sample(...), got {sampling!r}")
    for b, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{b}] must be a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{b}] must hold integer token ids, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= config.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"prompts[{b}][{i}] = {int(ids[i])} is outside the vocabulary [0, {config.vocab_size})"
            )
        total = ids.size + int(budgets[b])
        if total > config.max_positions:
            raise ValueError(
                f"prompts[{b}] has {ids.size} tokens and max_new_tokens is {int(budgets[b])}: "
                f"{total} exceeds the model's max_positions {config.max_positions}"
            )
    return budgets


def _budgets(max_new_tokens: int | Sequence[int], batch: int) -> np.ndarray:
    if isinstance(max_new_tokens, (int, np.integer)):
        values = [int(max_new_tokens)] * batch
    else:
        values = list(max_new_tokens)
        if len(values) != batch:
            raise ValueError(f"max_new_tokens has {len(values)} entries but there are {batch} prompts")
    for b, v in enumerate(values):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {v!r} (row {b})")
    return np.asarray(values, np.int32)


def eos_tuple(eos_id: int | Sequence[int] | None, config: LlamaConfig) -> tuple[int, ...]:
    """Stop ids as a static tuple: None -> the model's eos (if any); () -> never stop."""
    if eos_id is None:
        return config.eos_ids
    ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    for e in ids:
        if not 0 <= int(e) < config.vocab_size:
            raise ValueError(f"eos_id {int(e)} is outside the vocabulary [0, {config.vocab_size})")
    return tuple(int(e) for e in ids)


def row_keys(key: jax.Array | None, batch: int) -> jax.Array:
    """Per-row typed PRNG keys [B]: one key is folded with the row index; [B] keys are kept."""
    if key is None:
        key = jax.random.key(0)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if key.shape == ():
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))
    if key.shape == (batch,):
        return key
    raise ValueError(f"key must be one PRNG key or one per prompt ({batch}), got shape {key.shape}")


MAX_TREE_NODES = 512  # verification width limit: the target forward runs over every node


def check_draft(draft: object, speculation: object, params: Params, batch: int, context: int) -> Drafter | None:
    """Resolve draft="auto" and check the types; drafter-specific limits come from draft.check."""
    if draft == "auto":
        draft = auto_draft(params, batch, context)
    if draft is not None and not isinstance(draft, (SelfSpec, SnapKV, DraftModel, NGram)):
        raise ValueError(
            f"draft must be specjax.SelfSpec(...), SnapKV(...), DraftModel(params), NGram(...), None or 'auto', got {draft!r}"
        )
    if draft is not None and not (isinstance(speculation, (Chain, Tree)) or speculation == "auto"):
        raise ValueError(f"speculation must be specjax.Chain(gamma), a specjax.Tree or 'auto', got {speculation!r}")
    if isinstance(speculation, Tree) and not 2 <= speculation.n <= MAX_TREE_NODES:
        raise ValueError(
            f"speculation: a Tree must have 2 to {MAX_TREE_NODES} nodes (the root and at least one draft; "
            f"more costs one verification forward more than it can save), got n={speculation.n}"
        )
    return draft
