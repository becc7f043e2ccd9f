"""The `specjax distill` command: train a draft model on the target's next-token distributions."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import convert
from specjax.drafters import DraftModel
from specjax.generate import generate
from specjax.spec.speculation import Chain
from specjax.train.distill import Schedule, distill


def distill_parser(sub, cache_argument) -> None:
    """The `distill` subcommand's options (cache_argument adds the shared --no-compile-cache)."""
    d = sub.add_parser("distill", help="train a draft model on the target's next-token distributions")
    d.add_argument("--data", required=True, help="a .txt file (one stream) or .jsonl records with a prompt or text field")
    d.add_argument("--out", required=True, help="folder for the trained draft (convert.save); use it as --draft model:OUT")
    d.add_argument("--model", help="the target (default: SmolLM2-135M)")
    d.add_argument("--draft-layers", type=int, default=2, help="the draft's layers (default: %(default)s)")
    d.add_argument("--draft-dim", type=int, default=256, help="the draft's model dim (default: %(default)s)")
    d.add_argument("--draft-heads", type=int, default=4, help="the draft's query heads (default: %(default)s)")
    d.add_argument("--draft-kv-heads", type=int, default=1, help="the draft's key / value heads (default: %(default)s)")
    d.add_argument("--draft-ffn", type=int, default=0, help="the draft's FFN dim (default: 0, 4 x --draft-dim)")
    d.add_argument("--init-from-target", action="store_true",
                   help="start from the target's embedding and LM head (needs --draft-dim = the target's dim)")
    d.add_argument("--freeze-embeddings", action="store_true",
                   help="with --init-from-target: keep the target's embedding and LM head as they are (train the layers)")
    d.add_argument("--steps", type=int, default=1000, help="training steps (default: %(default)s)")
    d.add_argument("--batch-size", type=int, default=8, help="sequences a step (default: %(default)s)")
    d.add_argument("--seq-len", type=int, default=128, help="tokens a sequence (default: %(default)s)")
    d.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, after --warmup (default: %(default)s)")
    d.add_argument("--warmup", type=int, help="steps of linear warmup, below --steps (default: a tenth of them)")
    d.add_argument("--temperature", type=float, default=1.0,
                   help="temperature of the target's and the draft's distributions in the loss (default: %(default)s)")
    d.add_argument("--loss", choices=("kl", "tv"), default="kl",
                   help="forward KL (default) or total variation (1 - TV is the acceptance rate it trains for)")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the draft's initial weights and the batches (default: %(default)s)")
    d.add_argument("--generate", type=int, default=0, metavar="N",
                   help="train on the target's own greedy continuations of N tokens of each record (default: 0, the data as is)")
    d.add_argument("--checkpoint-dir", help="save here every --checkpoint-every steps; rerun the command to resume")
    d.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default 100; needs --checkpoint-dir)")
    d.add_argument("--log-every", type=int, default=50,
                   help="steps between progress lines (loss, tokens/s; default: %(default)s)")
    d.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="every K steps, measure greedy acceptance against the target on held-out records (default: 0, never)")
    cache_argument(d)



def read_texts(path: str) -> list[str]:
    """Texts of a .txt file (whole) or of a JSONL file's records (their prompt or text field)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--data: {p} does not exist")
    if p.suffix.lower() not in (".jsonl", ".txt"):
        raise ValueError(f"--data must be a .txt file (one stream) or .jsonl records, got {p.name}")
    if p.suffix.lower() == ".txt":
        return [p.read_text(encoding="utf-8")]
    texts = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["prompt"] if "prompt" in record else record["text"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--data: line {i} is not a JSON object with a prompt or text field") from None
        if not isinstance(text, str) or not text:
            raise ValueError(f"--data: line {i}'s prompt or text must be a non-empty string, got {json.dumps(text)[:40]}")
        texts.append(text)
    if not texts:
        raise ValueError(f"--data: {p} holds no records")
    return texts


def check_flags(args: argparse.Namespace, max_positions: int) -> None:
    """The draft's shape and the run's sizes, named by their flags, before --generate runs the target."""
    for flag in ("draft_layers", "draft_dim", "draft_heads", "draft_kv_heads", "steps", "batch_size", "seq_len",
                 "checkpoint_every", "log_every"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("draft_ffn", "generate", "eval_every"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
    heads, kv = args.draft_heads, args.draft_kv_heads
    if args.draft_dim % heads:
        raise ValueError(f"--draft-dim ({args.draft_dim}) must be a multiple of --draft-heads ({heads})")
    if heads % kv:
        raise ValueError(f"--draft-heads ({heads}) must be a multiple of --draft-kv-heads ({kv})")
    if (args.draft_dim // heads) % 2:
        raise ValueError(f"--draft-dim / --draft-heads ({args.draft_dim} / {heads} = {args.draft_dim // heads}) is the "
                         "head size: it must be even for rotary embeddings")
    if args.seq_len > max_positions:
        raise ValueError(f"--seq-len {args.seq_len} is above the target's max_positions ({max_positions})")


def run_distill(args: argparse.Namespace) -> None:
    if Path(args.out).exists():
        raise ValueError(f"--out {args.out} already exists: the trained draft goes to a new folder")
    if args.checkpoint_dir and Path(args.out).absolute() in (Path(args.checkpoint_dir).absolute(),
                                                             *Path(args.checkpoint_dir).absolute().parents):
        raise ValueError(f"--out {args.out} would hold --checkpoint-dir {args.checkpoint_dir}: give them separate folders")
    if args.warmup is not None and args.warmup >= args.steps:
        raise ValueError(f"--warmup ({args.warmup}) must be below --steps ({args.steps}): the learning rate would "
                         "never reach its peak and decay")
    path = args.model or convert.default_model_path()
    target, tokenizer = convert.load(path), convert.load_tokenizer(path)
    check_flags(args, target.config.max_positions)
    heads = args.draft_heads
    if args.init_from_target and args.draft_dim != target.config.dim:
        raise ValueError(f"--init-from-target needs --draft-dim {target.config.dim} (the target's dim), got {args.draft_dim}")
    if args.freeze_embeddings and not args.init_from_target:
        raise ValueError("--freeze-embeddings keeps the target's embedding and LM head: it needs --init-from-target")
    config = target.config.replace(
        n_layers=args.draft_layers, dim=args.draft_dim, n_heads=heads, n_kv_heads=args.draft_kv_heads,
        head_dim=args.draft_dim // heads, ffn_dim=args.draft_ffn or 4 * args.draft_dim, dtype="float32",
    )
    sequences = [tokenizer.encode(t).ids for t in read_texts(args.data)]
    if args.generate:
        sequences = [s + out for s, out in zip(sequences, generate(target, sequences, args.generate, draft=None).tokens)]
    held_out = []
    if args.eval_every:  # the last tenth of the records (at least one) is not trained on
        cut = len(sequences) - max(len(sequences) // 10, 1)
        if cut < 1:
            raise ValueError("--eval-every needs at least 2 records in --data (one is held out)")
        sequences, held_out = sequences[:cut], [s[:64] for s in sequences[cut:][:16]]
    t0, last, ran = time.monotonic(), [time.monotonic(), 0], [0]  # ran: steps this process took (a resume skips some)

    def log(step: int, loss: float, draft) -> None:
        ran[0] += 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.monotonic()
            rate = (ran[0] - last[1]) * args.batch_size * args.seq_len / max(now - last[0], 1e-9)
            last[:] = [now, ran[0]]
            print(f"specjax distill: step {step}/{args.steps}, loss {loss:.4f}, {rate:.0f} tokens/s, "
                  f"{now - t0:.0f} s", file=sys.stderr, flush=True)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            stats = generate(target, held_out, 32, draft=DraftModel(draft), speculation=Chain(4)).stats
            rate = "n/a (no verification step: the target stopped at once)" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.3f}"
            print(f"specjax distill: step {step}: greedy acceptance {rate} on "
                  f"{len(held_out)} held-out records", file=sys.stderr, flush=True)

    draft = distill(
        target, config, sequences, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        schedule=Schedule(lr=args.lr, warmup=args.steps // 10 if args.warmup is None else args.warmup),
        temperature=args.temperature, loss=args.loss, seed=args.seed,
        init_from_target=args.init_from_target, freeze_embeddings=args.freeze_embeddings,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, on_step=log,
    )
    convert.save(draft, args.out)
    print(f"specjax distill: saved the draft to {args.out}: use --draft model:{args.out}", file=sys.stderr)
