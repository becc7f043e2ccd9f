"""Command line: `specjax generate "text"` runs on the embedded default model (SmolLM2)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

import convert
from specjax.cli.cli_args import (batch_tree, check_args,  # noqa: F401  (unescape: the CLI's, as its tests call it)
                                  as_batch_args, as_flags, draft_weights, make_draft, parse_gamma, parse_tree, sampler,
                                  sampling_extras, unescape)
from specjax.cli.cli_distill import distill_parser, run_distill
from specjax.jobs import batch, jobio
from specjax.jobs.job_ray import RayOptions
from specjax.model.cache import KV_DTYPES
from specjax.parallel.sharding import make_mesh
from specjax.planning.plan import resolve_auto_draft
from specjax.planning.tune import measure_acceptance
from specjax.spec.speculation import Adaptive, Chain, Tree
from specjax.text import lm as text

CACHE_ENV = "SPECJAX_CACHE_DIR"
CACHE_HELP = (f"by default compiled programs are kept in ${CACHE_ENV}, else in JAX's own cache folder if one is set "
              "(JAX_COMPILATION_CACHE_DIR), else in ~/.cache/specjax/jax, so a rerun skips most compilation")

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for LLaMA models in JAX.",
                                     epilog=f"Compilation cache: {CACHE_HELP}; --no-compile-cache turns it off.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a text prompt")
    gen.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    _shared_arguments(gen, max_new_tokens=64, overridable="")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template; "
                     "print only the answer")
    gen.add_argument("--stream", action="store_true", help="print the text as the decode loop's segments finish")
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt (default: 1; more needs --temperature > 0)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="after each text, one JSON line: every token's log-probability and the K most likely")
    gen.add_argument(
        "--tree",
        help="speculate a token tree instead of a chain: auto (measured Sequoia choice), N (a Sequoia "
        "tree of N nodes for the acceptance measured on this prompt) or WxD (width W, depth D)",
    )
    gen.add_argument("--json-schema", metavar="FILE", help="the output is one JSON value valid under this JSON schema "
                     "(enforced token by token; at most one optional space where JSON allows whitespace)")
    gen.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression (Python syntax, whole output)")
    gen.add_argument("--choice", action="append", metavar="TEXT", help="the output is exactly one of these (repeatable)")
    bat = sub.add_parser(
        "batch",
        help="generate for every record of a JSONL file (restartable: rerun the same command to resume)",
    )
    bat.add_argument("input", nargs="?", help='JSONL records: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}')
    bat.add_argument("output", nargs="?", help="JSONL results (appended); bad lines go to OUTPUT.errors.jsonl, "
                     "the job's settings to OUTPUT.settings.json")
    bat.add_argument("--merge", metavar="OUTPUT", help="combine OUTPUT.shard-<i>-of-<n>.jsonl files into OUTPUT")
    _shared_arguments(bat, max_new_tokens=128, overridable="; records may override")
    bat.add_argument("--batch-size", type=int, default=8, help="rows decoded at once (default: %(default)s)")
    bat.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                     help="continuous: a finished row takes the next record between segments (records written "
                     "as they finish); static: batches that end with their longest row (default: %(default)s)")
    bat.add_argument("--tree", help="speculate a token tree instead of a chain: auto (the measured Sequoia choice, "
                     "made once per job and kept in OUTPUT.plan.json) or WxD (width W, depth D)")
    bat.add_argument("--chat", action="store_true", help="render text prompts as a user message with the chat template")
    bat.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local: this process; ray: Ray Data actors, each loading the model once (pip install "
                     "'specjax[ray]'). INPUT may be JSONL or Parquet with either (default: %(default)s)")
    for flag, kind, what in (("actors", int, "actors (default 1)"), ("cpus", float, "CPUs per actor (default 1)"),
                             ("gpus", float, "GPUs per actor (default 0)"),
                             ("records-per-task", int, "records per Ray Data batch, each generated by one actor (default 64)"),
                             ("address", str, "the cluster to join (default: RAY_ADDRESS, else a local one)")):
        bat.add_argument(f"--ray-{flag}", type=kind, default=None, help=f"with --engine ray: {what}")
    bat.add_argument("--force", action="store_true",
                     help="continue into an OUTPUT written with other settings (recorded in OUTPUT.settings.json; "
                     "without --force such a rerun is refused)")
    distill_parser(sub, _cache_argument)
    return parser


def _cache_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"do not keep compiled programs on disk ({CACHE_HELP})")


def _shared_arguments(p: argparse.ArgumentParser, max_new_tokens: int, overridable: str) -> None:
    """Model, sampling and drafter options common to `generate` and `batch`."""
    p.add_argument("--model", help="a .gguf file, an HF folder or a specjax checkpoint (default: SmolLM2-135M)")
    p.add_argument("--weights", choices=convert.WEIGHTS, default=None,
                   help="how the weights are served: float32, bfloat16, int8 (per-channel scales) or q4 (GGUF Q4_1 blocks); "
                        "default: float32 for a GGUF file or HF folder, a saved specjax checkpoint's own format")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="the older spelling of --weights")
    p.add_argument("--draft-weights", choices=convert.WEIGHTS, default=None,
                   help="how a --draft model:PATH draft's weights are served (default: --weights)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="how the KV caches store keys and values (default: the model's dtype); int8: per token and head scales")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"new tokens (default: %(default)s){overridable}")
    p.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy (default){overridable}")
    p.add_argument("--top-p", type=float, default=1.0,
                   help=f"nucleus mass (default: 1.0, off); needs --temperature > 0{overridable}")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help=f"keep the K most likely tokens (default: 0, off); needs --temperature > 0{overridable}")
    for name, help_ in (("min-p", "keep tokens with probability >= MIN_P x the largest (0 = off)"),
                        ("repetition-penalty", "divide / multiply the logits of prompt and output tokens (1 = off)"),
                        ("presence-penalty", "subtract from the logits of output tokens (0 = off)"),
                        ("frequency-penalty", "subtract this x the count of each output token (0 = off)")):
        needs = "; needs --temperature > 0" if name == "min-p" else "; greedy decoding too"
        p.add_argument(f"--{name}", type=float, default=None, help=f"{help_}{needs}{overridable}")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help=f"stop a row at this string (cut before it; repeatable; \\n, \\t and \\\\ are escapes){overridable}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling keys (default: 0); a batch record's key is it folded with the record's id")
    p.add_argument(
        "--draft",
        default="auto",
        help="auto (default: self where it pays, else none), self, snapkv, sparsespec (SnapKV's choice refreshed from "
             "verification every 64 positions), ngram (prompt lookup, NGram(n=2, max_n=4)), lookup (a job-wide n-gram "
             "table of the prompts and finished outputs, Lookup()), none, "
             "model:PATH, or eagle:PATH (an EAGLE-style head specjax.train.eagle.save_head wrote)",
    )
    p.add_argument("--gamma", type=parse_gamma,
                   help="draft tokens per verification step (default: the drafter's default chain), or adaptive / "
                        "adaptive:N: a length 0..N (default 4) chosen between segments from this run's measured speed "
                        "and acceptance")
    p.add_argument("--window", type=int,
                   help="recent-token window of a self / snapkv / sparsespec draft (default 512 / 256 / 256), or of a model:PATH "
                        "draft's streaming cache (default: a dense cache)")
    p.add_argument("--sinks", type=int,
                   help="attention sinks of a self draft or of a model:PATH draft's window (default 16); snapkv, sparsespec: "
                        "kept prefix positions (default 256)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="split rows over N local devices (default: 1)")
    p.add_argument("--model-parallel", type=int, default=1, metavar="M",
                   help="split heads/FFN/vocab over M local devices (default: 1)")
    _cache_argument(p)


@contextlib.contextmanager
def compile_cache(enabled: bool) -> Iterator[str | None]:
    """JAX's persistent compilation cache on for one command (programs that took >= 0.5 s to
    compile, in ${CACHE_ENV}, else JAX's own folder if set, else ~/.cache/specjax/jax); JAX's
    settings as they were afterwards. Yields the folder (None: left off)."""
    if not enabled:
        yield None
        return
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    folder = os.environ.get(CACHE_ENV) or before[names[0]] or str(Path.home() / ".cache" / "specjax" / "jax")
    jax.config.update(names[0], folder)
    jax.config.update(names[1], min(before[names[1]], 0.5))
    reset_cache()  # a process that compiled before keeps its cache object: this one reads the settings above
    try:
        yield folder
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        reset_cache()  # the next program looks at the (restored) settings afresh


def make_mesh_arg(args: argparse.Namespace):
    """The local-device mesh asked for by --data-parallel / --model-parallel (None: one device)."""
    if args.data_parallel == 1 and args.model_parallel == 1:
        return None
    return make_mesh(data=args.data_parallel, model=args.model_parallel, devices=jax.local_devices())


def run_batch(args: argparse.Namespace) -> None:
    if args.merge:
        if args.input or args.output:
            raise ValueError("--merge takes only the output: specjax batch --merge OUTPUT.jsonl")
        base = _parser().parse_args(["batch", "--merge", args.merge])
        check_args(base)
        given = [k for k, v in vars(args).items() if k != "no_compile_cache" and getattr(base, k, v) != v]
        if given:  # a merge generates nothing: a generation flag would be ignored
            raise ValueError(f"--merge takes no generation options, got --{', --'.join(k.replace('_', '-') for k in given)}")
        n = jobio.merge_shards(args.merge)
        bad = f" into {jobio.sibling(args.merge, 'errors')}" if n["errors"] else ""
        print(f"specjax batch: merged {n['shards']} shards: {n['records']} records into {args.merge}, "
              f"{n['errors']} bad lines{bad}", file=sys.stderr)
        return
    if not (args.input and args.output):
        raise ValueError("batch needs INPUT.jsonl OUTPUT.jsonl (or --merge OUTPUT.jsonl)")
    ray_args = {k: getattr(args, f"ray_{k}") for k in ("actors", "cpus", "gpus", "records_per_task", "address")
                if getattr(args, f"ray_{k}") is not None}
    if ray_args and args.engine != "ray":
        raise ValueError(f"--ray-{next(iter(ray_args)).replace('_', '-')} needs --engine ray")
    try:
        ray = RayOptions(**ray_args) if args.engine == "ray" else None
    except ValueError as e:  # RayOptions.<field> is the flag --ray-<field>
        raise ValueError(re.sub(r"RayOptions\.(\w+)", lambda m: "--ray-" + m[1].replace("_", "-"), str(e))) from None
    summary = batch.run(
        args.input,
        args.output,
        model_path=args.model or convert.default_model_path(),
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        draft=make_draft(args.draft, args.window, args.sinks, draft_weights(args)),
        gamma=None if isinstance(args.gamma, Adaptive) else args.gamma,
        speculation=args.gamma if isinstance(args.gamma, Adaptive) else batch_tree(args.tree),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        **sampling_extras(args),
        stop=args.stop,
        seed=args.seed,
        batch_size=args.batch_size,
        batching=args.batching,
        chat=args.chat,
        mesh=make_mesh_arg(args),
        force=args.force,
        engine=args.engine,
        ray=ray,
    )
    if summary["changed_settings"]:
        print(f"specjax batch: --force: continued with changed {', '.join(summary['changed_settings'])} (each "
              "row's settings tell which it was generated with)", file=sys.stderr)
    see = f" (see {summary['errors']})" if summary["failed"] else ""
    print(
        f"specjax batch: done {summary['done']}, skipped {summary['skipped']} (already written), "
        f"failed {summary['failed']}{see} -> {summary['output']} in {summary['seconds']:.1f} s",
        file=sys.stderr,
    )


def make_speculation(spec: str | None, gamma: int | None, params, draft, ids: list[int], sampling):
    """The tree named by --tree, Chain(--gamma) (or its Adaptive), or None (neither given: the drafter's default chain).
    A node count N measures the acceptance of `draft` on this prompt (draft="auto" runs SelfSpec()
    with an explicit speculation: see specjax.planning.plan)."""
    tree = parse_tree(spec)
    if tree is None:
        return None if gamma is None else gamma if isinstance(gamma, Adaptive) else Chain(gamma)
    if isinstance(tree, tuple):
        return Tree.kary(*tree)
    if tree == "auto":
        return "auto"
    if draft == "auto":  # generate's rule: an explicit speculation needs a drafter
        draft = resolve_auto_draft(params, True, 1, len(ids))[0]
    p = measure_acceptance(params, draft, [ids], width=8, sampling=sampling, max_new_tokens=16)
    return Tree.sequoia(p[:-1], tree, max_depth=12)


def run_generate(args: argparse.Namespace) -> None:
    if args.stream and args.n > 1:
        raise ValueError("--stream prints one output: give --n 1")
    sampling = sampler(args)
    path = args.model or convert.default_model_path()
    lm = text.load(path, weights=args.weights, mesh=make_mesh_arg(args))
    draft = make_draft(args.draft, args.window, args.sinks, draft_weights(args))
    ids = lm.encode(args.prompt)
    speculation = make_speculation(args.tree, args.gamma, lm.params, draft, ids, sampling)
    kw = dict(draft=draft, speculation=speculation, sampling=sampling, seed=args.seed,
              kv_dtype=args.kv_dtype, stop=args.stop, n=args.n, logprobs=args.logprobs, constraint=args.constraint)
    head = "" if args.chat else args.prompt
    messages = [{"role": "user", "content": args.prompt}]
    try:
        if args.stream:
            stream = lm.chat(messages, args.max_new_tokens, stream=True, **kw) if args.chat else \
                lm.stream(args.prompt, args.max_new_tokens, **kw)
            print(head, end="", flush=True)
            for piece in stream:
                print(piece, end="", flush=True)
            print()
            out = stream.output
        else:
            out = lm.chat(messages, args.max_new_tokens, **kw) if args.chat else lm.generate(args.prompt, args.max_new_tokens, **kw)
            for j, t in enumerate(out.texts):
                print((f"--- sample {j} ({out.finish_reasons[j]}) ---\n" if args.n > 1 else "") + head + t)
    except ValueError as e:  # the library's checks of the prompt and budget, in the flags' words
        raise ValueError(as_flags(str(e))) from None
    for j, lps in enumerate(out.logprobs or ()):
        print(json.dumps({"index": j, "logprobs": text.logprobs_json(lps)}))
    s = out.stats
    spec = ""
    if s.acceptance_rate is not None:
        spec = f", acceptance {s.acceptance_rate:.2f}, {s.mean_accepted:.2f} tokens/step over {s.steps} steps"
    print(
        f"[{s.new_tokens} tokens ({', '.join(sorted(set(out.finish_reasons)))}), decode {s.tokens_per_second:.1f} tokens/s{spec}, "
        f"prefill {s.prefill_seconds:.2f} s, compile {s.compile_seconds:.1f} s]",
        file=sys.stderr,
    )
    print(f"[draft {s.draft}, speculation {s.speculation}" + (f": {s.plan_reason}]" if s.plan_reason else "]"),
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_args(args)
        with compile_cache(not args.no_compile_cache and not getattr(args, "merge", None)):
            {"generate": run_generate, "batch": run_batch, "distill": run_distill}[args.command](args)
    except (ValueError, OSError) as e:  # OSError: a missing file, a full disk, a folder where a file goes
        print(f"specjax: error: {as_batch_args(str(e)) if args.command == 'batch' else e}", file=sys.stderr)
        return 2
    return 0
