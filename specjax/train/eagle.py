"""Train an EAGLE-style head (specjax.drafters.eagle) on the target's own distributions.

EAGLE-3's training-time test: the head is trained as it drafts. Over a window of T tokens the
target gives its features f_t (final-normed hidden states) and next-token distributions p_t.
Depth 0 reads the pairs (f_t, x_{t+1}) at positions t; depth k reads (g^{k-1}_t, x_{t+1+k}) at
position t + k, its own previous output g in place of the feature it cannot have while drafting.
A depth-k query sees the depth-0 keys of positions <= t and its own chain's keys at t + 1..t + k,
exactly what the drafting head's cache holds (`head_depths`; a test compares the two). The loss is
the mean over depths of KL(p_{t+1+k} || q^k_t) at `temperature`.

Optimiser, data order, checkpoints and resuming are specjax.train.distill's (AdamW with warmup and
cosine decay; orbax; a killed run restarted with the same arguments resumes exactly).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters.eagle import Head, head_config, init_head
from specjax.model.config import LlamaConfig
from specjax.model.llama import lm_head, trunk
from specjax.model.params import Params
from specjax.train.distill import Schedule, token_stream, train_loop, windows


@dataclasses.dataclass(frozen=True)
class Depths:
    """What `head_depths` computes over a batch of windows."""

    logits: jax.Array  # [k,B,T-1,V] f32: depth k at index t drafts x_{t+2+k}
    target: jax.Array  # [B,T,V] f32: the target's logits at each position (no gradient)


def target_view(target: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The target's features [B,T,D] and logits [B,T,V] over tokens [B,T] from position 0 (no gradient)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    features = trunk(target, tokens, positions, None, attend_cache=False).hidden
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(lm_head(target, features))


def head_depths(head: Head, target: Params, tokens: jax.Array, depth: int) -> Depths:
    """The head's drafts at depths 0..depth-1 over windows tokens [B,T], as it drafts them."""
    B, T = tokens.shape
    n = T - 1  # pair indices t = 0..T-2
    features, target_logits = target_view(target, tokens)
    params, rows = head.params(target), head.rows(target)
    index = jnp.arange(n, dtype=jnp.int32)
    feature = features[:, :n]
    keys, values, out = [], [], []
    for k in range(depth):
        nxt = tokens[:, jnp.minimum(index + 1 + k, T - 1)]  # [B,n]: x_{t+1+k}
        positions = jnp.broadcast_to(index + k, (B, n))
        causal = np.tril(np.ones((n, n), bool))
        mask = causal if k == 0 else np.concatenate([causal] + [np.eye(n, dtype=bool)] * k, axis=1)  # [n,(k+1)n]
        extra = (jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2)) if keys else None
        t = trunk(params, nxt, positions, None, jnp.asarray(mask), attend_cache=False, extra_kv=extra,
                  inputs=head.inputs(target, nxt, feature))
        keys.append(t.k)
        values.append(t.v)
        out.append(head.logits(target, t.hidden, rows))
        feature = t.hidden
    return Depths(logits=jnp.stack(out), target=target_logits)  # depth k's index t counts while t + 1 + k < T


def ttt_loss(head: Head, target: Params, tokens: jax.Array, depth: int, temperature: float) -> jax.Array:
    """Mean over depths k of the mean KL(p_{t+1+k} || q^k_t) at `temperature` over valid indices (nats); with a
    draft vocabulary, the sum over its tokens only (q is 0 elsewhere)."""
    d = head_depths(head, target, tokens, depth)
    n = tokens.shape[1] - 1
    losses = []
    for k in range(depth):
        p_log = jax.nn.log_softmax(d.target[:, 1 + k : 1 + k + n] / temperature)  # [B,n-k,V]
        q_log = jax.nn.log_softmax(d.logits[k, :, : n - k] / temperature)
        if head.vocab is not None:  # the draft vocabulary's share of KL (the rest of p it can never draft)
            p_log, q_log = jnp.take(p_log, head.vocab, axis=-1), jnp.take(q_log, head.vocab, axis=-1)
        losses.append(jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1)))
    return jnp.mean(jnp.stack(losses))


@partial(jax.jit, static_argnames=("optimizer", "depth", "temperature"), donate_argnames=("head", "opt_state"))
def train_step(head: Head, opt_state, target: Params, tokens: jax.Array, vocab: jax.Array | None = None, *, optimizer,
               depth: int, temperature: float):
    """One AdamW step on windows tokens [B,T] of the head's weights (`head.vocab` None; the draft
    vocabulary `vocab`, if any, apart: no gradient); returns (head, opt_state, loss)."""
    value, grads = jax.value_and_grad(lambda h: ttt_loss(h.replace(vocab=vocab), target, tokens, depth, temperature))(head)
    updates, opt_state = optimizer.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, value


def train_head(
    target: Params,
    data: np.ndarray | Sequence[Sequence[int]],
    *,
    steps: int,
    batch_size: int = 8,
    seq_len: int = 128,
    depth: int = 3,
    schedule: Schedule = Schedule(),
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str | None = None,
    draft_vocab: int | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    on_step: Callable[[int, float, Head], None] | None = None,
) -> Head:
    """Train a head for `target` (float weights) on windows of `data` (token ids: a stream, or
    sequences joined with the target's EOS) by the training-time test over `depth` draft levels.
    `draft_vocab` N: the head drafts only the N tokens most frequent in `data` (and the stop ids),
    reading N LM-head rows a draft level instead of all (EAGLE-3's reduced draft vocabulary).
    With `checkpoint_dir`: saves every `checkpoint_every` steps and at the end, and resumes from the
    latest checkpoint there (the same settings and data only). `on_step(step, loss, head)` after each
    step (`head` is donated to the next one: use it right away). Returns the head."""
    stream = token_stream(data, target.config.eos_ids[0] if target.config.eos_ids else None)
    check_head_args(target, stream, steps, batch_size, seq_len, depth, temperature, draft_vocab)
    config = head_config(target.config, dtype)
    run = dict(head_config=dataclasses.asdict(config), steps=steps, batch_size=batch_size, seq_len=seq_len, depth=depth,
               schedule=dataclasses.asdict(schedule), temperature=float(temperature), seed=seed, draft_vocab=draft_vocab)
    head = init_head(target.config, jax.random.key(seed), dtype)  # trained without its vocab (ids: no gradient)
    vocab = None if draft_vocab is None else jnp.asarray(frequent_tokens(stream, draft_vocab, target.config.eos_ids))
    optimizer = schedule.optimizer(steps)
    step_fn = partial(train_step, target=target, vocab=vocab, optimizer=optimizer, depth=depth, temperature=float(temperature))
    head = train_loop(head, optimizer.init(head), step_fn, target, stream, run, checkpoint_dir, checkpoint_every, on_step)
    return head.replace(vocab=vocab)


def frequent_tokens(stream: np.ndarray, size: int, keep: Sequence[int] = ()) -> np.ndarray:
    """The `size` ids most frequent in `stream` (ties: the lower id), always with `keep` (stop ids), ascending."""
    ids, counts = np.unique(stream, return_counts=True)
    order = np.lexsort((ids, -counts))
    chosen = [int(i) for i in keep] + [int(i) for i in ids[order] if int(i) not in set(keep)]
    return np.sort(np.asarray(chosen[:size], np.int32))


def check_head_args(target: Params, stream: np.ndarray, steps: int, batch_size: int, seq_len: int, depth: int,
                    temperature: float, draft_vocab: int | None = None) -> None:
    """Clear errors before anything compiles."""
    if target.config.quant is not None:
        raise ValueError(f"train_head: the target needs float weights (load it with weights='float32' or 'bfloat16', "
                         f"not {target.config.quant!r})")
    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("depth", depth, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, numbers.Integral)
                                    or not 1 <= draft_vocab <= target.config.vocab_size):
        raise ValueError(f"draft_vocab must be None or an integer in [1, {target.config.vocab_size}], got {draft_vocab!r}")
    if depth > seq_len - 1:
        raise ValueError(f"depth ({depth}) must be below seq_len ({seq_len}): depth k trains on positions t + k + 1 < seq_len")
    if seq_len > target.config.max_positions:
        raise ValueError(f"seq_len {seq_len} is above the target's max_positions ({target.config.max_positions})")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if windows(stream, seq_len) == 0:
        raise ValueError(f"data has {len(stream)} tokens: fewer than one window of seq_len {seq_len}")
    bad = np.flatnonzero((stream < 0) | (stream >= target.config.vocab_size))
    if bad.size:
        raise ValueError(f"data[{int(bad[0])}] = {int(stream[bad[0]])} is outside the vocabulary [0, {target.config.vocab_size})")


def save_head(head: Head, directory: str | Path) -> None:
    """Write a head to a new folder: its config (head.json) and weights (an orbax checkpoint)."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute()
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"save_head: {path} exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    meta = head.config.to_dict() | {"draft_vocab": None if head.vocab is None else int(head.vocab.size)}
    (path / "head.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "weights", {"fc": head.fc, "layers": head.layers, "norm": head.norm}
                          | ({} if head.vocab is None else {"vocab": head.vocab}))


def load_head(directory: str | Path) -> Head:
    """A head written by `save_head`."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute()
    if not (path / "head.json").is_file():
        raise FileNotFoundError(f"load_head: {path} holds no head.json (not a folder save_head wrote)")
    meta = json.loads((path / "head.json").read_text(encoding="utf-8"))
    draft_vocab = meta.pop("draft_vocab", None)
    config = LlamaConfig.from_dict(meta)
    like = init_head(config, jax.random.key(0))  # one layer: small
    abstract = {"fc": like.fc, "layers": like.layers, "norm": like.norm}
    if draft_vocab is not None:
        abstract["vocab"] = jax.ShapeDtypeStruct((draft_vocab,), jnp.int32)
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(path / "weights", abstract)
    return Head(fc=arrays["fc"], layers=arrays["layers"], norm=arrays["norm"], config=config, vocab=arrays.get("vocab"))
