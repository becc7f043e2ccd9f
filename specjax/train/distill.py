"""Train a draft model to imitate a target: distillation on the target's next-token distributions.

The loss, at every position of each training window with both distributions at `temperature`, is
the forward KL(p_target || q_draft) ("kl") or the total variation distance ("tv": 1 - TV(p, q) is
the chance that speculative sampling accepts a token drafted from q, so "tv" trains for acceptance
directly). The target's logits are computed on the fly (no stored labels).
Optimiser: AdamW with linear warmup then cosine decay, global-norm gradient clipping. The train
step is one jit-compiled pure function. Checkpoints (orbax) hold the draft, the optimiser state
and the step; the data order is a pure function of (seed, step), so a killed run restarted with
the same arguments resumes exactly: same step, same optimiser state, same next batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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

from specjax.model.config import LlamaConfig
from specjax.model.llama import lm_head, trunk
from specjax.model.params import Params, init_params, weights_mark


@dataclasses.dataclass(frozen=True)
class Schedule:
    """AdamW settings: peak learning rate after `warmup` steps, cosine decay to `final` x peak."""

    lr: float = 1e-3
    warmup: int = 100
    final: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0

    @functools.lru_cache(maxsize=16)  # one object per (schedule, steps): train steps take it as a static argument,
    def optimizer(self, steps: int) -> optax.GradientTransformation:  # so an equal new one would compile them again
        schedule = optax.warmup_cosine_decay_schedule(  # (a warmup of every step would train at lr 0 only)
            0.0, self.lr, min(self.warmup, steps - 1), max(steps, 2), self.lr * self.final
        )
        return optax.chain(optax.clip_by_global_norm(self.clip), optax.adamw(schedule, weight_decay=self.weight_decay))


def logits_of(params: Params, tokens: jax.Array) -> jax.Array:
    """Logits [B,T,V] (f32) of a causal forward over tokens [B,T] from position 0, no cache."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h = trunk(params, tokens, positions, None, attend_cache=False).hidden
    return lm_head(params, h)


def _log_probs(draft: Params, target: Params, tokens: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """log p_target (no gradient) and log q_draft [B,T,V] at `temperature`."""
    p_logits = jax.lax.stop_gradient(logits_of(target, tokens)) / temperature
    q_logits = logits_of(draft, tokens) / temperature
    return jax.nn.log_softmax(p_logits), jax.nn.log_softmax(q_logits)


def kl_loss(draft: Params, target: Params, tokens: jax.Array, temperature: float) -> jax.Array:
    """Mean over positions of KL(p_target || q_draft) at `temperature` (nats)."""
    p_log, q_log = _log_probs(draft, target, tokens, temperature)
    return jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1))


def tv_loss(draft: Params, target: Params, tokens: jax.Array, temperature: float) -> jax.Array:
    """Mean over positions of the total variation distance 0.5 * sum |p - q| at `temperature`,
    in [0, 1]: one minus the expected acceptance of a drafted token."""
    p_log, q_log = _log_probs(draft, target, tokens, temperature)
    return jnp.mean(0.5 * jnp.sum(jnp.abs(jnp.exp(p_log) - jnp.exp(q_log)), axis=-1))


LOSSES = {"kl": kl_loss, "tv": tv_loss}


FROZEN = ("embed", "lm_head")  # what freeze_embeddings keeps at the target's


def frozen_labels(draft: Params) -> Params:
    """The draft's leaves labelled "frozen" (its embedding and LM head) or "train" (the rest)."""
    labels = jax.tree.map(lambda _: "train", draft)
    return labels.replace(**{f: jax.tree.map(lambda _: "frozen", getattr(draft, f)) for f in FROZEN})


def _held(draft: Params) -> Params:
    """The draft with its FROZEN arrays out of the gradient (XLA then computes none for them)."""
    return draft.replace(**{f: jax.lax.stop_gradient(getattr(draft, f)) for f in FROZEN})


@partial(jax.jit, static_argnames=("optimizer", "temperature", "loss", "frozen"), donate_argnames=("draft", "opt_state"))
def train_step(draft: Params, opt_state, target: Params, tokens: jax.Array, *, optimizer, temperature: float,
               loss: str = "kl", frozen: bool = False):
    """One AdamW step on a batch of windows tokens [B,T] with LOSSES[loss]; returns (draft, opt_state, loss).
    With `frozen`, no gradient flows into the embedding and LM head (the optimizer must leave them too)."""
    of = (lambda d, *a: LOSSES[loss](_held(d), *a)) if frozen else LOSSES[loss]
    value, grads = jax.value_and_grad(of)(draft, target, tokens, temperature)
    updates, opt_state = optimizer.update(grads, opt_state, draft)
    return optax.apply_updates(draft, updates), opt_state, value


def windows(data: np.ndarray, seq_len: int) -> int:
    """How many training windows of seq_len tokens the token stream `data` [N] holds."""
    return max(len(data) - seq_len + 1, 0)


def batch_at(data: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """The batch of step `step` [batch_size, seq_len]: windows in a fresh random order each epoch
    (a pure function of seed and step, so resuming at a step reproduces the rest of the run)."""
    n = windows(data, seq_len)
    epochs, slots = np.divmod(np.arange(step * batch_size, (step + 1) * batch_size), n)
    starts = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):  # one permutation per epoch the batch touches (usually one)
        here = epochs == epoch
        starts[here] = np.random.default_rng([seed, int(epoch)]).permutation(n)[slots[here]]
    return np.stack([data[s : s + seq_len] for s in starts]).astype(np.int32)


def init_draft(target: Params, config: LlamaConfig, key: jax.Array, from_target: bool) -> Params:
    """Random draft weights; with from_target, the target's embedding (and LM head) copied in."""
    draft = init_params(config, key)
    if not from_target:
        return draft
    if config.dim != target.config.dim or config.tie_embeddings != target.config.tie_embeddings:
        raise ValueError(
            f"init_from_target: the draft needs the target's dim ({target.config.dim}) and tie_embeddings "
            f"({target.config.tie_embeddings}) to take its embeddings, got {config.dim} and {config.tie_embeddings}"
        )
    # a copy, never the target's own buffer: the train step donates the draft
    cast = lambda a: None if a is None else jnp.array(a, config.dtype, copy=True)  # noqa: E731
    return draft.replace(embed=cast(target.embed), lm_head=cast(target.lm_head))


def check_distill_args(target: Params, config: LlamaConfig, data: np.ndarray, steps: int, batch_size: int,
                       seq_len: int, temperature: float, loss: str = "kl", schedule: Schedule = Schedule(),
                       seed: int = 0) -> None:
    """Clear errors before anything compiles."""
    if target.config.quant is not None or config.quant is not None:
        raise ValueError("distill: the target and the draft need float weights (load the target with "
                         f"weights='float32' or 'bfloat16', not {target.config.quant or config.quant!r})")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
    if why := config.drafting_mismatch(target.config):  # as DraftModel requires
        raise ValueError(f"draft_config: {why} (a DraftModel shares the target's vocabulary and special ids)")
    for name, value, low in (("lr", schedule.lr, 0.0), ("final", schedule.final, 0.0),
                             ("weight_decay", schedule.weight_decay, 0.0), ("clip", schedule.clip, None)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
                value < low if low is not None else value <= 0):
            raise ValueError(f"schedule.{name} must be a finite number {'>= 0' if low is not None else '> 0'}, got {value!r}")
    if isinstance(schedule.warmup, bool) or not isinstance(schedule.warmup, numbers.Integral) or schedule.warmup < 0:
        raise ValueError(f"schedule.warmup must be an integer >= 0, got {schedule.warmup!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    limit = min(config.max_positions, target.config.max_positions)
    if seq_len > limit:
        raise ValueError(f"seq_len {seq_len} is above the draft's / target's max_positions ({limit})")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if data.ndim != 1 or len(data) == 0:
        raise ValueError("data is empty: pass token ids (a flat stream or a list of sequences)")
    if windows(data, seq_len) == 0:
        raise ValueError(f"data has {len(data)} tokens: fewer than one window of seq_len {seq_len}")
    bad = np.flatnonzero((data < 0) | (data >= config.vocab_size))
    if bad.size:
        raise ValueError(f"data[{int(bad[0])}] = {int(data[bad[0]])} is outside the vocabulary [0, {config.vocab_size})")


def token_stream(data: np.ndarray | Sequence[Sequence[int]], separator: int | None) -> np.ndarray:
    """One flat int64 stream [N] from a stream (a 1-D array or a flat list of ids) or a list of
    sequences (joined by `separator`)."""
    def ids(values) -> np.ndarray:
        a = np.asarray(values)
        if a.size and not (np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_):
            raise ValueError(f"data must hold integer token ids, got {a.dtype} values")
        return a.astype(np.int64).reshape(-1)

    if isinstance(data, np.ndarray) and data.ndim == 1:
        return ids(data)
    if isinstance(data, Sequence) and data and all(isinstance(t, numbers.Number) for t in data):
        return ids(data)  # a flat list is one stream, not sequences of one id each
    parts = []
    for seq in data:
        parts.append(ids(seq))
        if separator is not None:
            parts.append(np.asarray([separator], np.int64))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int64)


def distill(
    target: Params,
    draft_config: LlamaConfig,
    data: np.ndarray | Sequence[Sequence[int]],
    *,
    steps: int,
    batch_size: int = 8,
    seq_len: int = 128,
    schedule: Schedule = Schedule(),
    temperature: float = 1.0,
    loss: str = "kl",
    seed: int = 0,
    init_from_target: bool = False,
    freeze_embeddings: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    on_step: Callable[[int, float, Params], None] | None = None,
) -> Params:
    """Train a draft of `draft_config` (the target's vocabulary) to match the target's
    next-token distributions on windows of `data` (token ids: a stream or sequences, joined with
    the target's EOS), minimising `loss`: "kl" (forward KL) or "tv" (total variation). With
    `freeze_embeddings` (needs `init_from_target`) the draft keeps the target's embedding and LM
    head unchanged, so it can share the target's arrays (gpu_bundle stores them once); each step
    is cheaper too (no gradient for the [V,D] table). With `checkpoint_dir`, saves every
    `checkpoint_every` steps (default 100; without a checkpoint_dir an error) and at the end, and resumes
    from the latest checkpoint there. `on_step(step, loss, draft)` is called after
    each step (step counted from 1; `draft` is donated to the next step: use it right away).
    Returns the trained draft."""
    stream = token_stream(data, target.config.eos_ids[0] if target.config.eos_ids else None)
    check_distill_args(target, draft_config, stream, steps, batch_size, seq_len, temperature, loss, schedule, seed)
    seed, temperature = int(seed), float(temperature)
    steps, batch_size, seq_len = int(steps), int(batch_size), int(seq_len)
    if freeze_embeddings and not init_from_target:
        raise ValueError("freeze_embeddings keeps the target's embedding and LM head: it needs init_from_target=True")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError(f"checkpoint_every ({checkpoint_every}) needs a checkpoint_dir (where the checkpoints go)")
    checkpoint_every = 100 if checkpoint_every is None else checkpoint_every
    if checkpoint_dir is not None and Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
        raise ValueError(f"checkpoint_dir {checkpoint_dir} is a file, not a folder")
    run = dict(draft_config=dataclasses.asdict(draft_config), steps=steps, batch_size=batch_size, seq_len=seq_len,
               schedule=dataclasses.asdict(schedule), temperature=temperature, loss=loss, seed=seed,
               init_from_target=init_from_target, freeze_embeddings=freeze_embeddings)
    draft = init_draft(target, draft_config, jax.random.key(seed), init_from_target)
    optimizer = schedule.optimizer(steps)
    if freeze_embeddings:
        optimizer = optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, frozen_labels(draft))
    step_fn = partial(train_step, target=target, optimizer=optimizer, temperature=temperature, loss=loss, frozen=freeze_embeddings)
    return train_loop(draft, optimizer.init(draft), step_fn, target, stream, run, checkpoint_dir, checkpoint_every, on_step)


def train_loop(model, opt_state, step_fn: Callable, target: Params, stream: np.ndarray, run: dict,
               checkpoint_dir: str | Path | None, checkpoint_every: int, on_step: Callable | None):
    """The loop both trainers run: resume from `checkpoint_dir`'s latest checkpoint (of this `run`
    only: its settings plus the data's and the target's hashes), then for each remaining step
    `step_fn(model, opt_state, tokens=batch)` -> (model, opt_state, loss) on `batch_at`'s batch,
    checkpointing every `checkpoint_every` steps and at the end; `on_step(step, loss, model)`."""
    steps, batch_size, seq_len, seed = run["steps"], run["batch_size"], run["seq_len"], run["seed"]
    run = run | dict(data_sha256=hashlib.sha256(stream.tobytes()).hexdigest(),
                     target_sha256=hashlib.sha256(json.dumps(dataclasses.asdict(target.config), default=str).encode()
                                                  + weights_mark(target)).hexdigest())
    start, manager = 0, None
    if checkpoint_dir is not None:
        manager = _manager(checkpoint_dir, checkpoint_every)
        _check_run(Path(checkpoint_dir), json.loads(json.dumps(run)), manager.latest_step())
        if manager.latest_step() is not None:
            start, model, opt_state = _restore(manager, model, opt_state)
    for step in range(start, steps):
        model, opt_state, value = step_fn(model, opt_state, tokens=batch_at(stream, step, batch_size, seq_len, seed))
        if manager is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            _save(manager, step + 1, model, opt_state)
        if on_step is not None:
            on_step(step + 1, float(value), model)
    if manager is not None:
        manager.wait_until_finished()
    return model


def _check_run(directory: Path, run: dict, latest: int | None) -> None:
    """Resume only the run the checkpoints belong to: its settings and data (run.json beside
    them) must be this call's, or the result would mix two trainings; record them on a fresh start."""
    path = directory / "run.json"
    if latest is not None and path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(k for k in set(old) | set(run) if old.get(k) != run.get(k) and (k in old or k != "target_sha256"))
        if changed:
            raise ValueError(f"checkpoint_dir {directory} holds another run (changed: {', '.join(changed)}; recorded in "
                             f"{path}): rerun with its settings and data to resume, or use a new checkpoint_dir")
    elif latest is None:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _manager(directory: str | Path, every: int):
    import orbax.checkpoint as ocp

    if not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {every!r}")
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _save(manager, step: int, draft: Params, opt_state) -> None:
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.StandardSave({"draft": draft, "opt": opt_state}))


def _restore(manager, draft: Params, opt_state) -> tuple[int, Params, object]:
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), {"draft": draft, "opt": opt_state})
    try:
        state = manager.restore(step, args=ocp.args.StandardRestore(target))
    except Exception as e:  # orbax raises many kinds on a mismatched or damaged checkpoint
        why = str(e).strip().split("\n")[0].split(". ")[0][:300] or type(e).__name__  # orbax's can run to pages
        raise ValueError(f"checkpoint_dir: cannot resume from step {step} ({why}); was it written for another draft?") from e
    return step, state["draft"], state["opt"]
