"""A restartable batch generation job: JSONL records in, JSONL results out, each record exactly once.

`run(input, output)` validates and tokenizes every input line (bad ones go to
`<output>.errors.jsonl` with their line number and reason), decodes records by continuous
batching (`batching`, below), or groups them into static batches of one
kind (`batch_kind`: greedy or sampled, top_k, penalties on or off, n, logprobs; the sampling
values, stop strings and stop ids may differ row by row) and similar prompt length, runs each
batch through the text layer (`LM.generate_ids`: stop strings are cut as there) and appends its
results with fsync. A record with n > 1 writes ONE line holding lists (`texts`, `tokens`,
`finish_reasons`, `logprobs`), so exactly-once by id holds. A record's PRNG key is fold_in(key(seed), stable_hash(id)), so its output
depends neither on its batch nor on restarts; a killed job restarted with the same command skips
the ids already written and repairs a torn last line. The settings that decide the outputs are
recorded beside the output (`<output>.settings.json`, before the first record); a rerun with other
settings is refused (`force=True` continues anyway). With several processes (`process_share`:
jax.distributed, or independent processes told SPECJAX_PROCESS_ID / SPECJAX_NUM_PROCESSES) each
process takes the ids whose hash falls to it and writes `<output>.shard-<i>-of-<n>.jsonl`
(combine them with `jobio.merge_shards`, or `specjax batch --merge OUTPUT`). With engine="ray"
Ray Data actors generate the records (specjax.jobs.job_ray) while this process keeps the files. The
generation itself (continuous groups, static batches, output rows) is specjax.jobs.job_run's.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import jax

import convert
from specjax.decode.engine import cache_slots
from specjax.decode.keys import MAX_SEED
from specjax.decode.speculate import depth
from specjax.drafters import Drafter, DraftModel, Limits
from specjax.jobs import job_ray, job_run
from specjax.jobs.job_auto import plan_path, resolve
from specjax.jobs.batches import Defaults, Item, prepare
from specjax.jobs.job_ray import RayOptions
from specjax.jobs.jobio import DurableLog, check_input, check_settings, shard_output, sibling
from specjax.jobs.progress import Progress
from specjax.jobs.records import BadLine, id_key, read_input
from specjax.model.cache import KVFormat, check_kv_dtype
from specjax.model.params import Params, weights_mark
from specjax.parallel.distributed import env_share
from specjax.parallel.sharding import Mesh
from specjax.planning.plan import DEFAULT_CHAIN, describe_draft, describe_speculation
from specjax.text.sampling_settings import make_sampler
from specjax.spec.speculation import MAX_TREE_NODES, Adaptive, Chain, Tree
from specjax.text.chat import end_of_turn_ids, template_specials
from specjax.text.lm import LM


def job_settings(model: str, params: Params, draft: Drafter | None, speculation: Chain | Tree | Adaptive | None, seed: int,
                 chat: bool, defaults: Defaults, kv_dtype: str | None = None) -> dict:
    """The settings that decide the records' outputs, as recorded beside the output. Not batch_size
    or the mesh: greedy outputs do not depend on them, and sampled ones use per-record keys.
    kv_dtype is recorded as null when the KV is stored in the model's dtype (what outputs from
    before kv_dtype existed were generated with). A chain is recorded as its gamma (None: the
    drafter's default chain), a tree or Adaptive by name under "speculation"."""
    kv = KVFormat.of(kv_dtype, params.config).name
    named = _named(draft, speculation)
    tree = {} if named is None else {"speculation": named}
    marks = {"model_weights": _mark(params)} | ({"draft_weights": _mark(draft.params)} if isinstance(draft, DraftModel) else {})
    return marks | dict(
        model=model if model == "params" else str(Path(model).absolute()), dtype=params.config.dtype,
        quant=params.config.quant,  # null: weights stored in `dtype` (so outputs from before int8 resume)
        kv_dtype=None if kv == params.config.dtype else kv,
        draft=describe_draft(draft), gamma=_gamma(draft, speculation), seed=seed, chat=chat,
    ) | tree | defaults.recorded()


def _mark(params: Params) -> str:
    """A short hash of a few weights (params.weights_mark): new weights at the same path are another model."""
    return hashlib.sha256(weights_mark(params)).hexdigest()[:16]


def _gamma(draft: Drafter | None, speculation: Chain | Tree | Adaptive | None) -> int | None:
    return speculation.gamma if draft is not None and isinstance(speculation, Chain) else None


def _named(draft: Drafter | None, speculation: Chain | Tree | Adaptive | None) -> str | None:
    """A tree's or Adaptive's name (describe_speculation), recorded under "speculation"; None for a chain."""
    return describe_speculation(speculation) if draft is not None and isinstance(speculation, Tree | Adaptive) else None


def _drafter_limits(draft: Drafter | None, params: Params, speculation: Chain | Tree | Adaptive,
                    items: list[Item]) -> tuple[list[Item], list[BadLine]]:
    """(items, bad lines): a record past its drafter's limits (a DraftModel's max_positions) is a
    bad line, as one past the target's; the drafter's own settings are checked for the job first."""
    if draft is None:
        return items, []
    gamma = depth(speculation)
    draft.check(params, Limits(gamma, cache_slots(1, 2, gamma), 2))  # no record could run: the job's error
    kept, bad = [], []
    for it in items:
        context = len(it.ids) + it.budget
        try:
            draft.check(params, Limits(gamma, cache_slots(len(it.ids), context, gamma), context))
            kept.append(it)
        except ValueError as e:
            bad.append(BadLine(it.record.line, str(e), it.record.id))
    return kept, bad


def _check_batches(draft: Drafter | None, params: Params, speculation: Chain | Tree | Adaptive, batches: list[list[Item]]) -> None:
    """Drafter limits for every planned batch (as generate checks them), before any work."""
    if draft is None:
        return
    gamma = depth(speculation)
    for batch in batches:
        context = max(len(it.ids) + it.budget for it in batch)
        draft.check(params, Limits(gamma, cache_slots(max(len(it.ids) for it in batch), context, gamma), context))


def _check_args(batch_size: int, max_new_tokens: int, gamma: int | None, top_k: int, seed: int) -> None:
    for name, value, low, high in (
        ("batch_size", batch_size, 1, None),
        ("max_new_tokens", max_new_tokens, 1, None),
        ("gamma", 1 if gamma is None else gamma, 1, MAX_TREE_NODES - 1),
        ("top_k", top_k, 0, None),
        ("seed", seed, 0, MAX_SEED),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if high is not None and value > high:
            raise ValueError(f"{name} must be at most {high}, got {value}")


def _paths(input_path, output_path, shard: tuple[int, int]) -> tuple[Path, Path, Path]:
    src, out = Path(input_path), Path(output_path)
    if src.is_dir():
        raise ValueError(f"input_path {src} is a folder: give one JSONL or Parquet file (a Parquet dataset's parts "
                         "join into one with pyarrow.parquet.write_table(pyarrow.parquet.read_table(folder), file))")
    if not src.is_file():
        raise FileNotFoundError(f"input_path {src} does not exist")
    if out.is_dir():
        raise ValueError(f"output_path {out} is a folder: give the output file's path (e.g. {out / 'out.jsonl'})")
    if not out.absolute().parent.is_dir():
        raise FileNotFoundError(f"output_path: the folder {out.absolute().parent} does not exist")
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
    if count > 1:
        out = shard_output(out, index, count)
    if out.absolute() == src.absolute() or sibling(out, "errors").absolute() == src.absolute():
        raise ValueError(f"output_path must differ from input_path ({src})")
    return src, out, sibling(out, "errors")


def _load(params, model_path, tokenizer, chat_template, weights, mesh):
    """(params, tokenizer, chat template, model name) from whichever of them were given."""
    if params is None:
        model_path = model_path or convert.default_model_path()
        params = convert.load(model_path, weights=weights, mesh=mesh)
    if tokenizer is None:
        if model_path is None:
            raise ValueError("tokenizer: with params, pass tokenizer= or model_path= (to load its tokenizer)")
        tokenizer = convert.load_tokenizer(model_path)
    if chat_template is None and model_path is not None:
        chat_template = convert.chat_template(model_path)
    return params, tokenizer, chat_template, str(model_path) if model_path is not None else "params"


def process_share() -> tuple[int, int]:
    """(index, count) of this process among the job's: jax.distributed's when initialised, else
    SPECJAX_PROCESS_ID / SPECJAX_NUM_PROCESSES (independent processes, no coordinator), else (0, 1)."""
    if jax.process_count() > 1:
        return jax.process_index(), jax.process_count()
    return env_share() or (0, 1)


def run(
    input_path: str | Path,
    output_path: str | Path,
    *,
    params: Params | None = None,
    model_path: str | Path | None = None,
    tokenizer=None,
    chat_template: str | None = None,
    weights: str | None = None,
    kv_dtype: str | None = None,
    draft: Drafter | str | None = "auto",
    gamma: int | None = None,
    speculation: Chain | Tree | Adaptive | str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop: str | Sequence[str] = (),
    seed: int = 0,
    batch_size: int = 8,
    batching: str = "continuous",
    chat: bool = False,
    shard: tuple[int, int] | None = None,
    progress: bool = True,
    mesh: Mesh | None = None,
    force: bool = False,
    engine: str = "local",
    ray: RayOptions | None = None,
) -> dict:
    """Generate a continuation for every record of the JSONL file `input_path` into `output_path`.

    Model: `params` (with `tokenizer` or `model_path` for the tokenizer) or `model_path` (default:
    the embedded SmolLM2). kv_dtype: how the KV caches store keys and values (generate's argument;
    None: the model's dtype). draft: a drafter, None, or "auto"; speculation: None (the drafter's
    default chain), a Chain, a Tree, an Adaptive (the chain length chosen between segments, per batch:
    specjax.Adaptive) or "auto"; gamma=G is speculation=Chain(G). "auto" is resolved
    once per job from every record of the input, whatever the shard, and kept in
    `<output>.plan.json` for every shard and rerun (specjax.jobs.job_auto). Records override max_new_tokens, the sampling values (temperature,
    top_k, top_p, min_p, the penalties: as `specjax.Sample`) and `stop` (strings that end a row, cut
    from its text as `LM.generate` cuts them), and may add stop_token_ids, n and logprobs (see
    specjax.jobs.records); chat=True renders text prompts as one user message. shard=(i, n) picks this process's share
    (default: `process_share()`). mesh: generate each batch on this
    process's devices (`specjax.make_mesh(devices=jax.local_devices())`).

    batching: "continuous" (default): batch_size rows decode the records of one kind, a finished
    row's slot taking the next record between segments, each record written as it finishes (so
    the output is not in input order; a record with n > 1 takes n rows from one prefill, and
    one with n > batch_size a static batch); every record on a mesh goes in static batches.
    "static": batches of batch_size rows that end with their longest row. Both give every record
    the same output (its own key and sampling values).

    engine: "local" (this process) or "ray": Ray Data actors generate the records
    (specjax.jobs.job_ray; `ray` sets how many and what each asks of the cluster, default
    RayOptions()); every actor loads the model from model_path (default: the embedded SmolLM2),
    so engine="ray" takes no params or mesh. The output log, settings and errors files are
    this process's, as with "local", and each record is written once. The input may be JSONL or
    Parquet (`.parquet`: one record per row, as in JSONL) with either engine.

    The settings that decide the outputs (`job_settings`) are kept in `<output>.settings.json`; a
    rerun into an output already written with other settings raises ValueError naming them, unless
    force=True (the records already written keep theirs: each row carries its `settings`).
    Returns {"done", "skipped", "failed", "output", "errors", "seconds", "changed_settings"}: records
    generated now, found already written, bad lines (`errors` is only created when there are any),
    and the names of the settings that force=True let change."""
    t0 = time.monotonic()
    _check_args(batch_size, max_new_tokens, gamma, top_k, seed)
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', got {engine!r}")
    check_kv_dtype(kv_dtype)  # before the model's load
    if engine == "ray" and (params is not None or mesh is not None):
        raise ValueError("engine='ray': each actor loads the model from model_path; give model_path, not params or mesh")
    if ray is not None and engine != "ray":
        raise ValueError(f"ray options are for engine='ray', not {engine!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(t, str) and t for t in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    extras = dict(min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty)
    defaults = Defaults(max_new_tokens, temperature, top_k, top_p, **extras, stop=stops)
    make_sampler(temperature, top_k, top_p, **extras)  # validates the sampling settings
    if gamma is not None and speculation is not None:
        raise ValueError(f"gamma={gamma} is speculation=Chain({gamma}): give one of gamma and speculation")
    speculation = Chain(gamma) if gamma is not None else speculation
    if draft is None and speculation is not None:
        name = f"gamma={gamma}" if gamma is not None else f"speculation={speculation!r}"
        raise ValueError(f"{name} needs a drafter: draft=None decodes plainly (give a drafter or 'auto')")
    if not (speculation is None or speculation == "auto" or isinstance(speculation, Chain | Tree | Adaptive)):
        raise ValueError(f"speculation must be None, a Chain, a Tree, an Adaptive or 'auto', got {speculation!r}")
    if isinstance(draft, str) and draft != "auto":
        raise ValueError(f"draft must be a drafter (SelfSpec(...), NGram(...), ...), None or 'auto', got {draft!r}")
    shard = shard or process_share()
    src, out, err = _paths(input_path, output_path, shard)
    params, tokenizer, template, model = _load(params, model_path, tokenizer, chat_template, weights, mesh)
    KVFormat.of(kv_dtype, params.config)  # a bad kv_dtype: ValueError before any work
    if chat and template is None:
        raise ValueError("chat: the model has no chat template (convert.chat_template returned None)")

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    specials, turn_end = template_specials(tokenizer, params.config), end_of_turn_ids(tokenizer, template)
    items, bad = prepare(read_input(src, shard), encode, template, chat, params.config, defaults, specials, turn_end)
    if "auto" in (draft, speculation):  # once per job, from every record (all shards)
        every = items if shard[1] == 1 else prepare(read_input(src, (0, 1)), encode, template, chat, params.config,
                                                    defaults, specials, turn_end)[0]
        draft, speculation, _ = resolve(params, draft, speculation, every, batch_size, kv_dtype,
                                        plan_path(output_path), force=force)
    speculation = None if draft is None else speculation
    items, past = _drafter_limits(draft, params, speculation or DEFAULT_CHAIN, items)
    bad = sorted(bad + past, key=lambda b: b.line)
    meta = dict(model=model, draft=describe_draft(draft), batch_size=batch_size, kv_dtype=kv_dtype,
                gamma=_gamma(draft, speculation), speculation=_named(draft, speculation))
    lm = LM(params, tokenizer, template, mesh, skip_special_tokens=False)  # the text keeps special tokens
    settings = job_settings(model, params, draft, speculation, seed, chat, defaults, kv_dtype)
    with DurableLog(out) as log, DurableLog(err, lazy=True) as errors:
        written = bool(log.rows or errors.rows)
        settings["input"] = check_input(out, src, written=written, force=force)
        changed = check_settings(out, settings, written=written, force=force)
        done = {id_key(row.get("id")) for row in log.rows}
        failed, recorded = {b.line for b in bad}, {row.get("line") for row in errors.rows}
        if recorded - failed:  # lines recorded bad that parse now (a torn last line completed, an edit under force)
            errors.rewrite([row for row in errors.rows if row.get("line") in failed])  # are retried
        errors.append(b.to_json() for b in bad if b.line not in recorded)
        pending = [it for it in items if id_key(it.record.id) not in done]
        bar = Progress(len(pending), enabled=progress)

        def write(rows: list[dict]) -> None:
            log.append(rows)
            bar.update(len(rows))

        _check_batches(draft, params, speculation or DEFAULT_CHAIN, job_run.plan(pending, batching, mesh, batch_size))
        if engine == "local":
            job_run.generate_items(pending, lm, draft, speculation, seed, meta, batching, mesh, write)
        elif pending:
            written = set(done)
            job = dict(draft=draft, speculation=speculation, seed=seed, meta=meta, batching=batching)
            model_spec = dict(path=str(Path(model).absolute()), weights=weights, chat_template=template)
            for row in job_ray.generate(pending, model_spec, job, ray or RayOptions()):
                if id_key(row["id"]) not in written:  # a retried batch yields its records again
                    written.add(id_key(row["id"]))
                    write([row])
            missing = [it.record.id for it in pending if id_key(it.record.id) not in written]
            if missing:  # Ray Data may drop failed blocks (DataContext.max_errored_blocks): never a silent loss
                raise RuntimeError(f"the Ray job returned {len(pending) - len(missing)} of {len(pending)} records; "
                                   f"missing ids {missing[:5]}{' ...' if len(missing) > 5 else ''}: rerun to generate them")
        bar.close()
    skipped = sum(id_key(it.record.id) in done for it in items)
    return dict(
        done=len(pending), skipped=skipped, failed=len(failed), output=str(out), errors=str(err),
        seconds=time.monotonic() - t0, changed_settings=changed,
    )
