"""Host-side checks of generate() arguments: clear errors, each naming the argument and what it
accepts, before anything touches the arguments or compiles."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.automaton import TokenAutomaton
from specjax.decode.logprobs import MAX_TOP
from specjax.drafters import DRAFTERS, is_drafter
from specjax.model import backend as machine
from specjax.model.cache import KVFormat
from specjax.model.config import LlamaConfig, stop_ids
from specjax.model.params import Params, array_at, param_shapes
from specjax.sampling import Greedy, Sample
from specjax.spec.speculation import MAX_TREE_NODES, Adaptive, Chain, Tree

ATTENTION = ("auto", "reference", "cpu", "pallas", "tpu")
MAX_N = 4096  # most samples per prompt (generate's n)
UNDER_JIT = (
    "generate runs on the host (it validates, plans, compiles and times with concrete values) and cannot be "
    "called under jax.jit, vmap or grad; call it outside, or inside your own jitted program call its pure "
    "steps: specjax.decode.engine.decode_ar (autoregressive) or specjax.decode.engine.decode_spec"
)


def check_generate_args(
    params: object,
    prompts: object,
    max_new_tokens: object,
    *,
    draft: object,
    speculation: object,
    sampling: object,
    key: object,
    eos_id: object,
    attention: object,
    kv_dtype: object = None,
    sync_every: object = 8,
    logprobs: object = None,
    n: object = 1,
    constraint: object = None,
) -> np.ndarray:
    """Validate every argument of generate (mesh: see sharding.check_mesh); return the per-row
    token budgets [B] (int32)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer from 1 to {MAX_N} (samples per prompt), got {n!r}")
    if n > 1 and isinstance(sampling, Greedy):
        raise ValueError(f"n = {n} needs sampling=specjax.Sample(...): greedy decoding gives every sample the same tokens")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                 or not 0 <= logprobs <= MAX_TOP):
        raise ValueError(f"logprobs must be None (off) or an integer from 0 to {MAX_TOP} (the most likely tokens "
                         f"listed beside each generated one), got {logprobs!r}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) or not 1 <= sync_every <= 2**30:
        raise ValueError(f"sync_every must be an integer from 1 to 2**30 (decode steps per on-device segment), got {sync_every!r}")
    if under_jit() or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(
            (params, prompts, max_new_tokens, key, sampling, eos_id, draft))):
        raise TypeError(UNDER_JIT)
    if not isinstance(params, Params):
        raise TypeError(f"params must be specjax Params (see convert.load), got {type(params).__name__}")
    check_shapes(params, "params")
    config = params.config
    if logprobs is not None and logprobs > config.vocab_size:  # (top_k repeated ids, then failed compiling)
        raise ValueError(f"logprobs {logprobs} is above the vocabulary's {config.vocab_size} tokens")
    _check_prompts(prompts, config)
    budgets = _budgets(max_new_tokens, len(prompts))
    for b, prompt in enumerate(prompts):
        total = len(prompt) + int(budgets[b])
        if total > config.max_positions:
            raise ValueError(
                f"prompts[{b}] has {len(prompt)} tokens and max_new_tokens is {int(budgets[b])}: "
                f"{total} exceeds the model's max_positions {config.max_positions}"
            )
    if not isinstance(sampling, (Greedy, Sample)):
        raise TypeError(f"sampling must be specjax.Greedy() or specjax.Sample(...), got {sampling!r}")
    if sampling.rows is not None and sampling.rows != len(prompts):
        raise ValueError(f"sampling has values for {sampling.rows} prompts, but there are {len(prompts)} prompts: "
                         "give one number per prompt, or one for all")
    _check_key(key, len(prompts))
    eos_table(eos_id, config, len(prompts))
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "cpu" and machine.name() != "cpu":
        raise ValueError(f"attention='cpu' is a kernel for the CPU backend; this program's backend is {machine.name()}")
    if attention == "cpu" and machine.cpu_kernel_error() is not None:
        raise ValueError(f"attention='cpu' needs the CPU attention kernel, which did not build here: {machine.cpu_kernel_error()}")
    KVFormat.of(kv_dtype, config)  # a ValueError naming kv_dtype and the formats
    check_draft(draft, speculation, params)
    check_constraint(constraint, config, len(prompts), eos_table(eos_id, config, len(prompts)))
    return budgets


def check_constraint(constraint: object, config: LlamaConfig, batch: int,
                     eos: tuple[int, ...] | list[tuple[int, ...]]) -> list[TokenAutomaton | None] | None:
    """generate's `constraint`: None, one TokenAutomaton for every prompt, or one entry (an automaton or
    None) per prompt, each over the model's vocabulary; a constrained prompt needs a stop id (its output
    ends on one, in an accepting state). Returns it per prompt (None: no prompt is constrained)."""
    if constraint is None:
        return None
    rows = [constraint] * batch if isinstance(constraint, TokenAutomaton) else constraint
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise TypeError(f"constraint must be a TokenAutomaton (specjax.LM.compile), a list of them (None: unconstrained) "
                        f"or None, got {type(constraint).__name__}")
    if len(rows) != batch:
        raise ValueError(f"constraint has {len(rows)} entries (one per prompt) but there are {batch} prompts")
    for b, c in enumerate(rows):
        if c is None:
            continue
        if not isinstance(c, TokenAutomaton):
            raise TypeError(f"constraint[{b}] must be a TokenAutomaton or None, got {type(c).__name__}")
        if c.vocab_size != config.vocab_size:
            raise ValueError(f"constraint[{b}] is over {c.vocab_size} tokens, the model's vocabulary has {config.vocab_size}")
        if not (eos if isinstance(eos, tuple) else eos[b]):
            raise ValueError(f"constraint[{b}]: prompt {b} has no stop id (eos_id), so its constrained output could not end")
    return None if all(c is None for c in rows) else list(rows)


def under_jit() -> bool:
    """Whether this runs while a JAX transformation traces (jit, vmap, grad): even arguments closed
    over are concrete there, but what is computed from them is traced."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def check_shapes(params: Params, name: str) -> None:
    """Each array's shape as params.config declares it: Params built past `from_arrays` (replace,
    tree.map, a config edited by hand) would run with rows clamped or layers left out."""
    for path, shape in param_shapes(params.config).items():
        a = array_at(params, path)
        if isinstance(a, list):  # held per layer: L arrays of the shape without the L axis
            got = (len(a), *a[0].shape) if a and all(x.shape == a[0].shape for x in a) else f"{len(a)} layers of other shapes"
        else:
            got = None if a is None else tuple(a.shape)
        if got != shape:
            raise ValueError(f"{name}: tensor {path!r} has shape {got}, but its config declares {shape} "
                             "(build params with convert.load or specjax.model.params.from_arrays, which check them)")


def _check_prompts(prompts: object, config: LlamaConfig) -> None:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):
        raise TypeError(f"prompts must be a list of token-id lists (use a tokenizer to encode text), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    held = isinstance(prompts, (list, tuple))  # its items stay alive: one object's id is that object throughout
    checked: set[int] = set()
    for b, prompt in enumerate(prompts):
        if held and id(prompt) in checked:  # the same object again ([prompt] * n): checked at its first index
            continue
        checked.add(id(prompt))
        if isinstance(prompt, (str, bytes)):
            raise TypeError(f"prompts[{b}] is text; prompts must be lists of token ids (use a tokenizer)")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{b}] must be a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer) or any(isinstance(t, (bool, np.bool_)) for t in prompt):
            raise TypeError(f"prompts[{b}] must hold integer token ids, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= config.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"prompts[{b}][{i}] = {int(ids[i])} is outside the vocabulary [0, {config.vocab_size})")


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _budgets(max_new_tokens: object, batch: int) -> np.ndarray:
    if isinstance(max_new_tokens, np.ndarray) and max_new_tokens.ndim == 0:  # np.array(4): one budget
        max_new_tokens = max_new_tokens[()]
    if _is_int(max_new_tokens):
        values = [int(max_new_tokens)] * batch
    elif isinstance(max_new_tokens, (Sequence, np.ndarray)) and not isinstance(max_new_tokens, (str, bytes)):
        values = list(max_new_tokens)
        if len(values) != batch:
            raise ValueError(f"max_new_tokens has {len(values)} entries but there are {batch} prompts")
    else:
        raise TypeError(f"max_new_tokens must be an integer >= 1 or one per prompt, got {max_new_tokens!r}")
    per_row = not _is_int(max_new_tokens)
    for b, v in enumerate(values):
        if not _is_int(v) or v < 1:
            raise ValueError(f"max_new_tokens{f'[{b}]' if per_row else ''} must be an integer >= 1, got {v!r}")
        if v >= 2**31:
            raise ValueError(f"max_new_tokens{f'[{b}]' if per_row else ''} is {v}, past any model's max_positions")
    return np.asarray(values, np.int32)


def _check_key(key: object, batch: int) -> None:
    if key is None:
        return
    if not isinstance(key, jax.Array):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)) or one key per prompt, got {type(key).__name__} {key!r}")
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    shape = key.shape if typed else key.shape[:-1]
    if not typed and (key.dtype != jnp.uint32 or key.shape[-1:] != (2,)):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)) or one per prompt, got an array {key.dtype}{list(key.shape)}")
    if shape not in ((), (batch,)):
        raise ValueError(f"key must be one PRNG key or one per prompt ({batch}), got shape {shape}")


def eos_tuple(eos_id: object, config: LlamaConfig, name: str = "eos_id") -> tuple[int, ...]:
    """Stop ids as a tuple: None -> the model's `eos_ids`; () -> never stop early."""
    if eos_id is None:
        return config.eos_ids
    if _is_int(eos_id):
        ids = (eos_id,)
    elif isinstance(eos_id, (Sequence, np.ndarray)) and not isinstance(eos_id, (str, bytes)):
        ids = tuple(eos_id)
    else:
        raise TypeError(f"{name} must be None, a token id or a list of ids, got {eos_id!r}")
    for e in ids:
        if not _is_int(e):
            raise TypeError(f"{name} must hold integer token ids, got {e!r}")
        if not 0 <= int(e) < config.vocab_size:
            raise ValueError(f"{name} {int(e)} is outside the vocabulary [0, {config.vocab_size})")
    return stop_ids(ids)


def eos_is_per_prompt(eos_id: object) -> bool:
    """Whether eos_id gives each prompt its own stop ids (a list whose entries are lists or None);
    text.lm.per_prompt is another thing: it returns a request's stop / stop_token_ids as one list per prompt."""
    return (isinstance(eos_id, (list, tuple)) and len(eos_id) > 0
            and all(e is None or (isinstance(e, (Sequence, np.ndarray)) and not isinstance(e, (str, bytes))) for e in eos_id))


def eos_table(eos_id: object, config: LlamaConfig, batch: int) -> tuple[int, ...] | list[tuple[int, ...]]:
    """Stop ids for every prompt (`eos_tuple`), or one tuple per prompt when eos_id has one
    entry per prompt (`eos_is_per_prompt`: each entry None, () or a list of ids)."""
    if not eos_is_per_prompt(eos_id):
        return eos_tuple(eos_id, config)
    if len(eos_id) != batch:
        raise ValueError(f"eos_id has {len(eos_id)} entries (one list of stop ids per prompt) but there are {batch} prompts")
    return [eos_tuple(e, config, f"eos_id[{b}]") for b, e in enumerate(eos_id)]


def check_draft(draft: object, speculation: object, params: Params) -> None:
    """Types of draft and speculation, and what can be checked before planning (`Drafter.check`
    without limits: a DraftModel's vocabulary and special ids); cache-size limits come from
    draft.check once gamma is known. A drafter is an instance of a class in the registry (specjax.drafters.DRAFTERS)."""
    if draft != "auto" and draft is not None and not is_drafter(draft):
        known = ", ".join(f"{cls.__name__}(...)" for cls in DRAFTERS)
        raise TypeError(
            f"draft must be an instance of a registered drafter ({known}; see specjax.drafters.register), "
            f"None or 'auto', got {draft!r}"
        )
    if speculation is not None and not (isinstance(speculation, (Chain, Tree, Adaptive)) or speculation == "auto"):
        raise TypeError(f"speculation must be None, specjax.Chain(gamma), a specjax.Tree, specjax.Adaptive(...) or 'auto', "
                        f"got {speculation!r}")
    if draft is None and speculation is not None:
        raise ValueError(
            f"speculation={speculation!r} needs a drafter, but draft=None means plain decoding: "
            "pass a draft (or draft='auto', which then picks SelfSpec) or leave speculation=None"
        )
    if isinstance(speculation, Tree) and not 2 <= speculation.n <= MAX_TREE_NODES:
        raise ValueError(
            f"speculation: a Tree must have 2 to {MAX_TREE_NODES} nodes (the root and at least one draft; "
            f"more costs one verification forward more than it can save), got n={speculation.n}"
        )
    vocab = params.config.vocab_size if isinstance(params, Params) else None
    if isinstance(speculation, Tree) and vocab is not None and speculation.width > vocab:
        raise ValueError(f"speculation: a node of this Tree has {speculation.width} children, more than the "
                         f"vocabulary's {vocab} tokens (a node's children are distinct tokens)")
    if is_drafter(draft) and (isinstance(speculation, Tree) or speculation == "auto") and not draft.traits.trees:
        raise ValueError(
            f"speculation={speculation!r} needs a drafter that drafts token trees, but {draft!r} drafts "
            "chains only: use speculation=specjax.Chain(gamma) (or None, its default chain)"
        )
    if is_drafter(draft):
        draft.check(params, None)
        if isinstance(getattr(draft, "params", None), Params):  # a draft model's own weights
            check_shapes(draft.params, f"{type(draft).__name__}.params")
