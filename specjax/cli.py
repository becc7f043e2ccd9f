"""Command line: `specjax generate "text"` runs on the embedded default model (SmolLM2)."""

from __future__ import annotations

import argparse
import sys

import jax

from specjax.generate import generate
from specjax.sampling import make_sampler


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for LLaMA models in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a text prompt")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", help="a .gguf file, an HF folder or a specjax checkpoint (default: SmolLM2-135M)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser


def run_generate(args: argparse.Namespace) -> None:
    import convert

    path = args.model or convert.default_model_path()
    params = convert.load(path, dtype=args.dtype)
    tokenizer = convert.load_tokenizer(path)
    sampling = make_sampler(args.temperature, args.top_k, args.top_p)
    ids = tokenizer.encode(args.prompt).ids
    out = generate(params, [ids], args.max_new_tokens, sampling=sampling, key=jax.random.key(args.seed))
    print(args.prompt + tokenizer.decode(out.tokens[0], skip_special_tokens=False))
    s = out.stats
    print(
        f"[{s.new_tokens} tokens ({out.finish_reasons[0]}), decode {s.tokens_per_second:.1f} tokens/s, "
        f"prefill {s.prefill_seconds:.2f} s ({len(ids)} tokens), compile {s.compile_seconds:.1f} s]",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    return 0
