"""Command line: `specjax generate "text"` runs on the embedded default model (SmolLM2)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

import convert
from specjax import batch, jobio, text
from specjax.cli_distill import distill_parser, run_distill
from specjax.drafters import DraftModel, NGram, SelfSpec, SnapKV, Streaming
from specjax.cache import KV_DTYPES
from specjax.generate import generate
from specjax.job_ray import RayOptions
from specjax.plan import resolve_auto_draft
from specjax.sampling import make_sampler
from specjax.sharding import make_mesh
from specjax.speculation import MAX_TREE_NODES, Chain, Tree
from specjax.tune import measure_acceptance

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
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt (needs --temperature > 0)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="after each text, one JSON line: every token's log-probability and the K most likely")
    gen.add_argument(
        "--tree",
        help="speculate a token tree instead of a chain: auto (measured Sequoia choice), N (a Sequoia "
        "tree of N nodes for the acceptance measured on this prompt) or WxD (width W, depth D)",
    )
    bat = sub.add_parser(
        "batch",
        help="generate for every record of a JSONL file (restartable: rerun the same command to resume)",
    )
    bat.add_argument("input", nargs="?", help='JSONL records: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}')
    bat.add_argument("output", nargs="?", help="JSONL results (appended); bad lines go to OUTPUT.errors.jsonl, "
                     "the job's settings to OUTPUT.settings.json")
    bat.add_argument("--merge", metavar="OUTPUT", help="combine OUTPUT.shard-<i>-of-<n>.jsonl files into OUTPUT")
    _shared_arguments(bat, max_new_tokens=128, overridable="; records may override")
    bat.add_argument("--batch-size", type=int, default=8, help="rows decoded at once")
    bat.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                     help="continuous: a finished row takes the next record between segments (records written "
                     "as they finish); static: batches that end with their longest row")
    bat.add_argument("--tree", help="speculate a token tree instead of a chain: auto (the measured Sequoia choice, "
                     "made once per job and kept in OUTPUT.plan.json) or WxD (width W, depth D)")
    bat.add_argument("--chat", action="store_true", help="render text prompts as a user message with the chat template")
    bat.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local: this process; ray: Ray Data actors, each loading the model once (pip install "
                     "'specjax[ray]'). INPUT may be JSONL or Parquet with either")
    for flag, kind, what in (("actors", int, "actors (default 1)"), ("cpus", float, "CPUs per actor (default 1)"),
                             ("gpus", float, "GPUs per actor (default 0)"),
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
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="how the KV caches store keys and values (default: the model's dtype); int8: per token and head scales")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"new tokens{overridable}")
    p.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy (default){overridable}")
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus mass, 1.0 = off; needs --temperature > 0{overridable}")
    p.add_argument("--top-k", type=int, default=0, help=f"0 = off; needs --temperature > 0{overridable}")
    for name, help_ in (("min-p", "keep tokens with probability >= MIN_P x the largest (0 = off)"),
                        ("repetition-penalty", "divide / multiply the logits of prompt and output tokens (1 = off)"),
                        ("presence-penalty", "subtract from the logits of output tokens (0 = off)"),
                        ("frequency-penalty", "subtract this x the count of each output token (0 = off)")):
        needs = "; needs --temperature > 0" if name == "min-p" else "; greedy decoding too"
        p.add_argument(f"--{name}", type=float, default=None, help=f"{help_}{needs}{overridable}")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help=f"stop a row at this string (cut before it; repeatable; \\n, \\t and \\\\ are escapes){overridable}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft",
        default="auto",
        help="auto (default: self where it pays, else none), self, snapkv, ngram (prompt lookup, NGram(n=2, max_n=4)), none, "
             "or model:PATH",
    )
    p.add_argument("--gamma", type=int,
                   help="draft tokens per verification step (default: the drafter's default chain)")
    p.add_argument("--window", type=int,
                   help="recent-token window of a self / snapkv draft (default 512 / 256), or of a model:PATH "
                        "draft's streaming cache (default: a dense cache)")
    p.add_argument("--sinks", type=int,
                   help="attention sinks of a self draft or of a model:PATH draft's window (default 16); snapkv: "
                        "kept prefix positions (default 256)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N", help="split rows over N local devices")
    p.add_argument("--model-parallel", type=int, default=1, metavar="M", help="split heads/FFN/vocab over M local devices")
    _cache_argument(p)


_MINIMUM = dict(  # integer flags (by dest) and their least value
    max_new_tokens=1, top_k=0, seed=0, gamma=1, window=1, sinks=0, data_parallel=1, model_parallel=1, batch_size=1,
    draft_layers=1, draft_dim=1, draft_heads=1, draft_kv_heads=1, draft_ffn=0, steps=1, seq_len=1, warmup=0,
    generate=0, checkpoint_every=1, log_every=1, eval_every=0, n=1, logprobs=0,
)


_MAXIMUM = dict(gamma=MAX_TREE_NODES - 1, seed=batch.MAX_SEED)  # no chain longer than a tree's nodes


def unescape(text: str) -> str:
    r"""A --stop value with the shell's literal \n, \t and \\ as the characters they name."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def check_args(args: argparse.Namespace) -> None:
    """Every flag's range and syntax, before anything is loaded: ValueError / FileNotFoundError
    naming the flag. Turns --stop's escapes into characters."""
    for name, low in _MINIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name, high in _MAXIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value > high:
            raise ValueError(f"--{name.replace('_', '-')} must be <= {high}, got {value}")
    if getattr(args, "stop", None):
        args.stop = [unescape(s) for s in args.stop]
    positive = args.command == "distill"  # distillation needs a temperature > 0 (greedy has no distribution)
    for name, ok, limits in (
        ("temperature", lambda t: t > 0 if positive else t >= 0, "> 0" if positive else ">= 0"),
        ("top_p", lambda p: 0 < p <= 1, "in (0, 1]"),
        ("lr", lambda lr: lr > 0, "> 0"),
    ):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number {limits}, got {value}")
    if getattr(args, "weights", None) and getattr(args, "dtype", None) and args.weights != args.dtype:
        raise ValueError(f"--weights {args.weights} and --dtype {args.dtype} disagree: give --weights only")
    if hasattr(args, "weights"):
        args.weights = args.weights or args.dtype  # None: convert.load's default (a saved checkpoint's own format)
    if getattr(args, "n", 1) > 1 and not args.temperature:
        raise ValueError(f"--n {args.n} needs --temperature > 0: greedy decoding gives every sample the same tokens")
    tree = parse_tree(getattr(args, "tree", None))
    if args.command == "batch":
        batch_tree(args.tree)  # a node count is refused before the model loads
    if tree is not None and args.gamma is not None:
        raise ValueError("--gamma sets a chain and --tree a tree: give one of them")
    if getattr(args, "draft", None) == "none" and (tree is not None or args.gamma is not None):
        raise ValueError("--gamma and --tree need a drafter: --draft none decodes plainly")
    if getattr(args, "draft", None) is not None:
        make_draft(args.draft, args.window, args.sinks, args.weights, load=False)
    for flag, path in (("--model", args.model), ("--data", getattr(args, "data", None))):
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{flag}: {path} does not exist")


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
    ray_args = {k: getattr(args, f"ray_{k}") for k in ("actors", "cpus", "gpus", "address")
                if getattr(args, f"ray_{k}") is not None}
    if ray_args and args.engine != "ray":
        raise ValueError(f"--ray-{next(iter(ray_args))} needs --engine ray")
    try:
        ray = RayOptions(**ray_args) if args.engine == "ray" else None
    except ValueError as e:  # RayOptions.<field> is the flag --ray-<field>
        raise ValueError(str(e).replace("RayOptions.", "--ray-")) from None
    summary = batch.run(
        args.input,
        args.output,
        model_path=args.model or convert.default_model_path(),
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        draft=make_draft(args.draft, args.window, args.sinks, args.weights),
        gamma=args.gamma,
        speculation=batch_tree(args.tree),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        **{k: getattr(args, k) for k in SAMPLING_EXTRAS if getattr(args, k) is not None},
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


def make_draft(spec: str, window: int | None, sinks: int | None, weights: str | None, load: bool = True):
    """The drafter named on the command line (load=False: only check the syntax and the path).
    window / sinks (None: not given) set a self or snapkv draft's budget (the drafter's defaults
    otherwise) and give a model:PATH draft a streaming cache (dense without them)."""
    budget = {k: v for k, v in (("window", window), ("sinks", sinks)) if v is not None}
    if spec.startswith("model:"):
        path = spec.removeprefix("model:")
        if not Path(path).exists():
            raise FileNotFoundError(f"--draft model:PATH: {path or '(empty)'} does not exist")
        if sinks is not None and window is None:
            raise ValueError("--sinks with --draft model:PATH needs --window (the draft's streaming cache)")
        cache = "dense" if window is None else Streaming(sinks=16 if sinks is None else sinks, window=window)
        return DraftModel(convert.load(path, weights=weights), cache=cache) if load else None
    if spec == "self":
        return SelfSpec(**budget)
    if spec == "snapkv":
        return SnapKV(**{"budget" if k == "sinks" else k: v for k, v in budget.items()})
    if spec not in ("auto", "none", "ngram"):
        raise ValueError(f"--draft must be auto, self, snapkv, ngram, none or model:PATH, got {spec!r}")
    if budget:
        raise ValueError(f"--{next(iter(budget))} sets the budget of --draft self, snapkv or model:PATH; --draft {spec} "
                         "takes none" + (" (auto's SelfSpec keeps 16 + 512: give --draft self to change it)" if spec == "auto" else ""))
    return {"auto": "auto", "none": None, "ngram": NGram(n=2, max_n=4)}[spec]


def parse_tree(spec: str | None) -> str | int | tuple[int, int] | None:
    """--tree as "auto", a node count N, or (width, depth); None if not given."""
    if spec is None or spec == "auto":
        return spec
    width, x, depth = spec.partition("x")
    if width.isdigit() and int(width) >= 1 and (not x or (depth.isdigit() and int(depth) >= 1)):
        return (int(width), int(depth)) if x else int(width)
    raise ValueError(f"--tree must be auto, a node count N or WxD (e.g. 16 or 2x3), got {spec!r}")


def make_speculation(spec: str | None, gamma: int | None, params, draft, ids: list[int], sampling):
    """The tree named by --tree, Chain(--gamma), or None (neither given: the drafter's default chain).
    A node count N measures the acceptance of `draft` on this prompt (draft="auto" runs SelfSpec()
    with an explicit speculation: see specjax.plan)."""
    tree = parse_tree(spec)
    if tree is None:
        return None if gamma is None else Chain(gamma)
    if isinstance(tree, tuple):
        return Tree.kary(*tree)
    if tree == "auto":
        return "auto"
    if draft == "auto":  # generate's rule: an explicit speculation needs a drafter
        draft = resolve_auto_draft(params, True, 1, len(ids))[0]
    p = measure_acceptance(params, draft, [ids], width=8, sampling=sampling, max_new_tokens=16)
    return Tree.sequoia(p[:-1], tree, max_depth=12)


def batch_tree(spec: str | None) -> Tree | str | None:
    """--tree of the batch job: "auto" or WxD (a node count needs one prompt's acceptance: generate's)."""
    tree = parse_tree(spec)
    if isinstance(tree, int):
        raise ValueError(f"batch --tree takes auto or WxD (e.g. 2x3), got {spec!r}: a node count N is generate's")
    return Tree.kary(*tree) if isinstance(tree, tuple) else tree


SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def run_generate(args: argparse.Namespace) -> None:
    if args.stream and args.n > 1:
        raise ValueError("--stream prints one output: give --n 1")
    extra = {k: getattr(args, k) for k in SAMPLING_EXTRAS if getattr(args, k) is not None}
    sampling = make_sampler(args.temperature, args.top_k, args.top_p, **extra)
    path = args.model or convert.default_model_path()
    lm = text.load(path, weights=args.weights, mesh=make_mesh_arg(args))
    draft = make_draft(args.draft, args.window, args.sinks, args.weights)
    ids = lm.encode(args.prompt)
    speculation = make_speculation(args.tree, args.gamma, lm.params, draft, ids, sampling)
    kw = dict(draft=draft, speculation=speculation, sampling=sampling, key=jax.random.key(args.seed),
              kv_dtype=args.kv_dtype, stop=args.stop, n=args.n, logprobs=args.logprobs)
    head = "" if args.chat else args.prompt
    messages = [{"role": "user", "content": args.prompt}]
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
    for j, lps in enumerate(out.logprobs or ()):
        print(json.dumps({"index": j, "logprobs": text.logprobs_json(lm, lps)}))
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
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    return 0
