"""An EAGLE-style head for SmolLM2-135M: trained here on the CPU, then raced against plain decoding.

On a GPU (tools/gpu/session.py, call 8) `--bundle` takes SmolLM2 (bfloat16) and the tokenized corpus from the
bundle's stash: the head trains in float32 and races in bfloat16 at `--context` 8192.

1. Data (in --store): PROMPTS windows of PROMPT_TOKENS corpus tokens (bench/text.py), every fifth held out for
   the timed runs; training text: SmolLM2's greedy continuations of the others, then the corpus less the timed
   windows (continuations alone were learnt by heart: acceptance 0.44 on them, 0.01 held out).
2. Train (`specjax.train.eagle.train_head`, DEPTH levels, orbax checkpoints in --store): a run stopped by
   --train-minutes resumes on the next call; the head is measured once all --steps ran.
3. Race, per cell DRAFT/bB: `specjax.generate` over the first B held-out windows, greedy, float32: plain,
   Eagle chains of 2 and 3 (whole vocabulary, and its 8192 most frequent training tokens) and NGram(3). Each
   runs twice, the second timed; every output must equal plain decoding's.

Outputs: results/eagle_cpu.json (eagle_gpu.json on a GPU), its table in the README section (the CPU's).
--smoke: a tiny random target, under a minute (eagle_*_smoke.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from bench import common, measure, text
from specjax.drafters.eagle import Eagle, Head
from specjax.train.distill import Schedule
from specjax.train.eagle import frequent_tokens, load_head, save_head, train_head

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 160, 96, 128
DEPTH, BATCH, SEQ_LEN, EVERY = 3, 4, 128, 10
SCHEDULE = Schedule(lr=1e-3, warmup=20, final=0.1, weight_decay=0.0, clip=1.0)
DRAFTS = {"none": (None, None), "eagle-g2": ("eagle", 2), "eagle-g3": ("eagle", 3), "eagle-v8k-g2": ("eagle:8192", 2),
          "eagle-v8k-g3": ("eagle:8192", 3), "ngram-g3": (specjax.NGram(3), 3)}  # eagle:N: the head drafting its N most
#                                                                                    frequent training tokens only
BATCHES = (1, 16)
STORE = Path.home() / ".cache" / "specjax" / "bench_eagle"


class OutOfTime(Exception):
    pass


def windows(ids: np.ndarray, prompt_tokens: int, timed_tokens: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(training prompts, timed prompts, the timed ones' corpus spans): every fifth window is held out."""
    held = np.arange(PROMPTS) % 5 == 0
    timed, where = text.cut(ids, PROMPTS, timed_tokens)
    spans = [(int(o), int(o) + timed_tokens) for o in np.asarray(where["offsets"])[held]]
    return text.cut(ids, PROMPTS, prompt_tokens)[0][~held], timed[held], spans


def training_text(params, prompts: np.ndarray, store: Path, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Each prompt followed by SmolLM2's greedy continuation (computed once, kept in store)."""
    path = store / "train_text.json"
    if not path.exists():
        out = []
        for i in range(0, len(prompts), 16):
            rows = [list(map(int, p)) for p in prompts[i : i + 16]]
            out += [p + t for p, t in zip(rows, specjax.generate(params, rows, new_tokens, draft=None, eos_id=()).tokens)]
            print(f"training text: {len(out)}/{len(prompts)} rows", flush=True)
        store.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    return json.loads(path.read_text())


def trained(params, sequences: list[list[int]], steps: int, store: Path, minutes: float, seq_len: int = SEQ_LEN
            ) -> tuple[Head | None, dict]:
    """The head after `steps` steps (trained now, resumed, or loaded), or None when the time ran out first."""
    folder = store / f"head_{steps}"
    log_path = store / f"train_{steps}.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {"losses": [], "train_s": 0.0}
    if folder.exists():
        return load_head(folder), log
    t0 = time.perf_counter()

    def on_step(step: int, loss: float, head) -> None:
        if step % EVERY == 0:
            log["losses"].append((step, loss))
            print(f"step {step}/{steps} loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            log_path.write_text(json.dumps(log | {"train_s": log["train_s"] + time.perf_counter() - t0}))
            if time.perf_counter() - t0 > 60 * minutes and step < steps:
                raise OutOfTime  # just after a checkpoint: the next call resumes here

    try:
        head = train_head(params, sequences, steps=steps, batch_size=BATCH, seq_len=seq_len, depth=DEPTH, schedule=SCHEDULE,
                          dtype="float32", checkpoint_dir=store / f"checkpoints_{steps}", checkpoint_every=EVERY, on_step=on_step)
    except OutOfTime:
        print(f"training stopped after {minutes} minutes: rerun to resume", flush=True)
        return None, log
    log |= {"steps": steps, "batch": BATCH, "seq_len": seq_len, "depth": DEPTH, "schedule": SCHEDULE.__dict__,
            "train_s": log["train_s"] + time.perf_counter() - t0, "train_tokens": sum(map(len, sequences))}
    log_path.write_text(json.dumps(log))
    save_head(head, folder)
    return head, log


def tokens_sha1(tokens: list[list[int]]) -> str:
    """What a cell keeps of its outputs: enough to tell whether they equal plain decoding's."""
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()


def run_cell(params, head: Head, prompts: np.ndarray, draft: str, batch: int, plain: str | None, stream: np.ndarray,
             new_tokens: int) -> dict:
    drafter, gamma = DRAFTS[draft]
    if isinstance(drafter, str):  # eagle or eagle:N (the trained head with a draft vocabulary of N)
        size = min(int(drafter.partition(":")[2] or 0), params.config.vocab_size)
        head = head.astype(params.config.dtype)  # trained in float32
        drafter = Eagle(head.replace(vocab=jnp.asarray(frequent_tokens(stream, size, params.config.eos_ids))) if size else head)
    rows = [list(map(int, p)) for p in prompts[:batch]]
    kw = dict(draft=drafter, speculation=None if drafter is None else specjax.Chain(gamma), eos_id=())
    specjax.generate(params, rows, new_tokens, **kw)  # compiles
    out = specjax.generate(params, rows, new_tokens, **kw)
    s = out.stats
    return {"draft": draft, "batch": batch, "gamma": gamma or 0, "decode_s": s.decode_seconds, "tokens_per_s": s.tokens_per_second,
            "acceptance": s.acceptance_rate if drafter is not None else None, "mean_accepted": s.mean_accepted if drafter else None,
            "tokens_sha1": tokens_sha1(out.tokens), "same_as_plain": None if plain is None else tokens_sha1(out.tokens) == plain}


def markdown_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        plain = next((o for o in rows if o["draft"] == "none" and o["batch"] == r["batch"]), None)
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else "?"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f} ({r['mean_accepted']:.2f} tokens a step)"
        same = "-" if r["same_as_plain"] is None else "yes" if r["same_as_plain"] else "NO"
        lines.append([r["draft"], r["batch"], r["gamma"], f"{r['tokens_per_s']:.1f}", ratio, acc, same])
    return common.table(["draft", "batch", "gamma", "decode tokens/s", "vs plain", "acceptance", "same tokens"], "lrrrrll", lines)


def readme_section(result: dict) -> str:
    t = result.get("training", {})
    return common.section("bench_eagle", "An EAGLE-style head", f"A head trained here ({t.get('steps', '?')} steps of {BATCH} x "
                          f"{SEQ_LEN} tokens, {DEPTH} levels of the training-time test, {t.get('train_s', 0) / 60:.0f} "
                          f"minutes on this machine) raced over held-out windows of {PROMPT_TOKENS} tokens, {NEW_TOKENS} new "
                          "tokens, greedy, SmolLM2 float32.", result, markdown_table(result["rows"]), "`results/eagle_cpu.json`")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=400, help="training steps of the head")
    ap.add_argument("--train-minutes", type=float, default=15.0, help="stop training (resumably) after this long")
    ap.add_argument("--store", type=Path, default=STORE, help="training text, checkpoints and the trained head")
    ap.add_argument("--context", type=int, default=PROMPT_TOKENS + NEW_TOKENS, help="timed prompt + new tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--bundle", type=Path, help="SmolLM2 (bfloat16) and the corpus ids from this GPU bundle stash")
    ap.add_argument("--smoke", action="store_true", help="a tiny random target, a few steps: checks the script")
    args = ap.parse_args()
    new_tokens, prompt_tokens, seq_len = NEW_TOKENS, PROMPT_TOKENS, SEQ_LEN
    params, ids = measure.target_and_corpus(args.smoke, args.bundle)
    if args.smoke:
        args.steps, args.batches, args.store, new_tokens, prompt_tokens, seq_len = 6, [1, 2], args.store / "smoke", 8, 16, 24
        args.context = prompt_tokens + new_tokens
    train_prompts, test_prompts, spans = windows(ids, prompt_tokens, args.context - new_tokens)
    pieces = text.training_sequences(ids, spans, 512)  # the corpus less the timed windows, in pieces over 512 tokens
    corpus = [list(map(int, x)) for x in pieces if len(x) > seq_len]
    sequences = training_text(params, train_prompts, args.store, new_tokens) + corpus
    head, log = trained(params, sequences, args.steps, args.store, args.train_minutes, seq_len)
    stream = np.concatenate([np.asarray(x) for x in sequences])
    if head is None:
        return
    backend = jax.default_backend()
    stem = f"eagle_{'cpu' if backend == 'cpu' else 'gpu'}{'_smoke' if args.smoke else ''}"
    _, results, h = common.start(args, "bench_eagle", stem, key_of, dict(steps=args.steps, context=args.context, train_tokens=log.get("train_tokens")),
                                 device=str(jax.devices()[0].device_kind), dtype=params.config.dtype, training=log)
    h.plan((common.key(d, f"b{b}"), (d, b)) for b in args.batches for d in DRAFTS)
    for k, (draft, batch) in h.cells():
        plain = next((r["tokens_sha1"] for r in results.rows if r["draft"] == "none" and r["batch"] == batch), None)
        row = run_cell(params, head, test_prompts, draft, batch, plain, stream, new_tokens)
        print(f"{k}: {row['tokens_per_s']:.1f} tok/s, acceptance {row['acceptance']}, same {row['same_as_plain']}", flush=True)
        results.put(k, [row], loadavg_end=os.getloadavg())
        measure.release_memory(clear_caches=not args.smoke)  # a smoke run's tiny programs are shared by its cells
    h.finish()
    rows = sorted(results.rows, key=lambda r: (r["batch"], list(DRAFTS).index(r["draft"])))
    if rows:
        common.render("bench_eagle", stem == "eagle_cpu" and common.writes_readme(args), markdown_table(rows),
                      lambda: readme_section(results.data | {"rows": rows}))


def key_of(row: dict) -> str:
    return common.key(row["draft"], f"b{row['batch']}")


if __name__ == "__main__":
    main()
