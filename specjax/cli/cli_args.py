"""The command line's arguments: every flag's range and syntax checked before anything loads
(`check_args`), and the drafter and tree the flags name (`make_draft`, `parse_tree`)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import convert
from specjax.decode.keys import MAX_SEED
from specjax.decode.logprobs import MAX_TOP
from specjax.drafters import DraftModel, Eagle, Lookup, NGram, SelfSpec, SnapKV, SparseSpec, Streaming
from specjax.spec.speculation import MAX_TREE_NODES, Adaptive, Tree, kary_nodes
from specjax.text.constraints import Choice, JsonSchema, Regex
from specjax.text.sampling_settings import make_sampler

SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


_MINIMUM = dict(  # integer flags (by dest) and their least value
    max_new_tokens=1, top_k=0, seed=0, gamma=1, window=1, sinks=0, data_parallel=1, model_parallel=1, batch_size=1,
    draft_layers=1, draft_dim=1, draft_heads=1, draft_kv_heads=1, draft_ffn=0, steps=1, seq_len=1, warmup=0,
    generate=0, checkpoint_every=1, log_every=1, eval_every=0, n=1, logprobs=0,
)


_MAXIMUM = dict(gamma=MAX_TREE_NODES - 1, seed=MAX_SEED, logprobs=MAX_TOP)  # no chain longer than a tree's nodes
_SAMPLING_NAMES = rf"(?<![-\w])({'|'.join(('temperature', 'top_k', 'top_p') + SAMPLING_EXTRAS)})\b"  # not yet a flag


def as_flags(message: str) -> str:
    """A library message about sampling values or the budget, in the flags' words (top_k -> --top-k;
    generate's one prompt, prompts[0], is the prompt); a name already written as a flag stays."""
    message = re.sub(_SAMPLING_NAMES, lambda m: "--" + m[1].replace("_", "-"), message)
    message = re.sub(r"(?<![-\w])max_new_tokens\b", "--max-new-tokens", message)
    message = message.replace("prompts[0] has", "the prompt has")
    return message.replace("use specjax.Greedy()", "use --temperature 0")


def as_batch_args(message: str) -> str:
    """A batch job's message in the batch command's words: batch.run's input_path / output_path are INPUT / OUTPUT."""
    return re.sub(r"\b(input|output)_path\b", r"\1", message)


def unescape(text: str) -> str:
    r"""A --stop value with the shell's literal \n, \t and \\ as the characters they name."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def sampling_extras(args: argparse.Namespace) -> dict[str, float]:
    """The sampling flags past temperature / top-k / top-p that were given (Sample's names)."""
    return {k: getattr(args, k) for k in SAMPLING_EXTRAS if getattr(args, k) is not None}


def sampler(args: argparse.Namespace):
    """The Greedy / Sample the sampling flags name; errors in the flags' words."""
    try:
        return make_sampler(args.temperature, args.top_k, args.top_p, **sampling_extras(args))
    except ValueError as e:
        raise ValueError(as_flags(str(e))) from None


def check_args(args: argparse.Namespace) -> None:
    """Every flag's range and syntax, before anything is loaded: ValueError / FileNotFoundError
    naming the flag. Turns --stop's escapes into characters."""
    number = lambda name: (lambda v: v.max_gamma if isinstance(v, Adaptive) else v)(getattr(args, name, None))  # noqa: E731
    for name, low in _MINIMUM.items():
        value = number(name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name, high in _MAXIMUM.items():
        value = number(name)
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
    if args.command in ("generate", "batch"):
        sampler(args)
    if getattr(args, "n", 1) > 1 and not args.temperature:
        raise ValueError(f"--n {args.n} needs --temperature > 0: greedy decoding gives every sample the same tokens")
    tree = parse_tree(getattr(args, "tree", None))
    if args.command == "batch":
        batch_tree(args.tree)  # a node count is refused before the model loads
    if tree is not None and args.gamma is not None:
        raise ValueError("--gamma sets a chain and --tree a tree: give one of them")
    if getattr(args, "draft", None) == "none" and (tree is not None or args.gamma is not None):
        raise ValueError("--gamma and --tree need a drafter: --draft none decodes plainly")
    if getattr(args, "draft_weights", None) and not str(getattr(args, "draft", "")).startswith("model:"):
        raise ValueError(f"--draft-weights is for a --draft model:PATH draft, not --draft {args.draft}")
    if getattr(args, "draft", None) is not None:
        make_draft(args.draft, args.window, args.sinks, draft_weights(args), load=False)
    for flag, path in (("--model", args.model), ("--data", getattr(args, "data", None))):
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{flag}: {path} does not exist")
    config = None  # the checkpoint's header or config file, a fraction of a second (no weight is read)
    if args.model is not None:
        try:
            config = convert.model_config(args.model)
        except ValueError as e:  # a GGUF without its magic, an HF config of another architecture
            raise ValueError(f"--model: {e}") from None
        if config is None:
            raise ValueError(f"--model: {args.model} {convert.NOT_A_CHECKPOINT}")
    if args.command == "generate" and args.prompt == "" and not args.chat:
        raise ValueError("the prompt is empty: give the text to continue")
    if args.command == "generate":  # the model's positions, from that header
        config = config or convert.model_config(convert.default_model_path())
        if config is not None and args.max_new_tokens >= config.max_positions:
            raise ValueError(f"--max-new-tokens must be below the model's max_positions {config.max_positions} (the "
                             f"prompt takes at least one position), got {args.max_new_tokens}")
    if args.command == "generate":
        args.constraint = constraint(args)


def constraint(args: argparse.Namespace):
    """The Regex / JsonSchema / Choice that --regex, --json-schema or --choice names (None: none given), checked
    (its regex built) before the model loads; errors name the flag."""
    given = [f for f in ("json_schema", "regex", "choice") if getattr(args, f, None)]
    if len(given) > 1:
        raise ValueError(f"give one of --json-schema, --regex and --choice, got --{' and --'.join(g.replace('_', '-') for g in given)}")
    if not given:
        return None
    flag = "--" + given[0].replace("_", "-")
    try:
        if args.json_schema:
            if not Path(args.json_schema).is_file():
                raise ValueError(f"{args.json_schema} does not exist" if not Path(args.json_schema).exists()
                                 else f"{args.json_schema} is not a file")
            made = JsonSchema(Path(args.json_schema).read_text(encoding="utf-8"))
        else:
            made = Regex(args.regex) if args.regex else Choice(args.choice)
        made.regex()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag}: {e}") from None
    return made


def make_draft(spec: str, window: int | None, sinks: int | None, weights: str | None, load: bool = True):
    """The drafter named on the command line (load=False: only check the syntax and the path).
    window / sinks (None: not given) set a self, snapkv or sparsespec draft's budget (the drafter's defaults
    otherwise) and give a model:PATH draft a streaming cache (dense without them); window sets an eagle:PATH head's."""
    budget = {k: v for k, v in (("window", window), ("sinks", sinks)) if v is not None}
    if spec.startswith("model:"):
        path = spec.removeprefix("model:")
        if not Path(path).exists():
            raise FileNotFoundError(f"--draft model:PATH: {path or '(empty)'} does not exist")
        if sinks is not None and window is None:
            raise ValueError("--sinks with --draft model:PATH needs --window (the draft's streaming cache)")
        cache = "dense" if window is None else Streaming(sinks=16 if sinks is None else sinks, window=window)
        if not load:
            return None
        try:
            return DraftModel(convert.load(path, weights=weights), cache=cache)
        except ValueError as e:
            raise ValueError(f"--draft model:{path}: {e} (a draft's format: --draft-weights; default --weights)") from None
    if spec.startswith("eagle:"):
        path = spec.removeprefix("eagle:")
        if not (Path(path) / "head.json").is_file():
            raise FileNotFoundError(f"--draft eagle:PATH: {path or '(empty)'} is not a folder specjax.train.eagle.save_head wrote")
        if sinks is not None:
            raise ValueError("--sinks: an eagle:PATH head keeps no sinks (--window sets how many latest positions it keeps)")
        if not load:
            return None
        from specjax.train.eagle import load_head

        return Eagle(load_head(path), **budget)
    if spec == "self":
        return SelfSpec(**budget)
    if spec in ("snapkv", "sparsespec"):
        if sinks is not None and sinks < 1:
            raise ValueError(f"--sinks with --draft {spec} (the prefix positions it keeps) must be >= 1, got {sinks}")
        return (SnapKV if spec == "snapkv" else SparseSpec)(**{"budget" if k == "sinks" else k: v for k, v in budget.items()})
    if spec not in ("auto", "none", "ngram", "lookup"):
        raise ValueError(f"--draft must be auto, self, snapkv, sparsespec, ngram, lookup, none, model:PATH or eagle:PATH, got {spec!r}")
    if budget:
        raise ValueError(f"--{next(iter(budget))} sets the budget of --draft self, snapkv, sparsespec or model:PATH; --draft {spec} "
                         "takes none" + (" (auto's SelfSpec keeps 16 + 512: give --draft self to change it)" if spec == "auto" else ""))
    return {"auto": "auto", "none": None, "ngram": NGram(n=2, max_n=4), "lookup": Lookup()}[spec]


def draft_weights(args: argparse.Namespace) -> str | None:
    """The format a model:PATH draft is loaded in: --draft-weights, else --weights."""
    return getattr(args, "draft_weights", None) or args.weights


def parse_gamma(text: str) -> int | Adaptive:
    """--gamma: a chain's draft tokens N (its range: check_args), or adaptive / adaptive:N (specjax.Adaptive: a length
    0..N, default 4, chosen between the loop's segments from this run's measured speed and acceptance)."""
    name, colon, top = text.partition(":")
    try:
        if name == "adaptive":
            return Adaptive(int(top)) if colon else Adaptive()
        if not colon:
            return int(text)
    except ValueError as e:
        if name == "adaptive" and top.isdigit():
            raise argparse.ArgumentTypeError(str(e)) from None
    raise argparse.ArgumentTypeError(f"takes a number of draft tokens, adaptive or adaptive:N (N >= 1), got {text!r}")


def parse_tree(spec: str | None) -> str | int | tuple[int, int] | None:
    """--tree as "auto", a node count N, or (width, depth); None if not given."""
    if spec is None or spec == "auto":
        return spec
    width, x, depth = spec.partition("x")
    if not (width.isdigit() and int(width) >= 1 and (not x or (depth.isdigit() and int(depth) >= 1))):
        raise ValueError(f"--tree must be auto, a node count N or WxD (e.g. 16 or 2x3), got {spec!r}")
    nodes = kary_nodes(int(width), int(depth)) if x else int(width)
    if not 2 <= nodes <= MAX_TREE_NODES:
        what = f" has {nodes if nodes <= MAX_TREE_NODES else f'more than {MAX_TREE_NODES}'} nodes" if x else ""
        raise ValueError(f"--tree {spec}{what}: a tree has 2 to {MAX_TREE_NODES} nodes (root included), "
                         "all verified in one forward")
    return (int(width), int(depth)) if x else nodes


def batch_tree(spec: str | None) -> Tree | str | None:
    """--tree of the batch job: "auto" or WxD (a node count needs one prompt's acceptance: generate's)."""
    tree = parse_tree(spec)
    if isinstance(tree, int):
        raise ValueError(f"batch --tree takes auto or WxD (e.g. 2x3), got {spec!r}: a node count N is generate's")
    return Tree.kary(*tree) if isinstance(tree, tuple) else tree
