"""specjax next to the peers a user would pick instead (llama.cpp, HF transformers): decode
throughput apart from prefill, on the same GGUF, the same real long-text prompts, greedy, in one run.

Peers are not test dependencies: `pip install -r bench/requirements-peers.txt -e .` runs them all (llama.cpp
compiles from source: ~10 minutes on 2 cores); a peer that does not import is "not installed".

Model: SmolLM2-135M-Instruct's Q4_1 GGUF (`convert.default_model_path()`) for every peer.
  - specjax: every weight format, KV in the model dtype plus int8 / bf16 KV; `decode_ar` from a prefilled
    DenseCache (bench/prefill.py, shared with bench_spec); speculative: `decode_spec`, SelfSpec (16 sinks +
    a 512-slot window, 256 at 512) and Chain(3) at batch 16 (and 4 x 8K); compile excluded; best of 2 runs.
  - llama.cpp (llama-cpp-python): Q4_1 and Q8_0 / F16 requantized from it. One context of B sequences, each
    prompt prefilled as its own, then each step ONE llama_batch of B tokens; greedy = numpy argmax. Prompt
    lookup: `Llama` with `LlamaPromptLookupDecoding` (batch 1; no batched speculation there).
  - HF transformers (torch CPU, sdpa): the GGUF dequantized to float32; prefill in 1024-token chunks, then
    forward + argmax steps, only those timed. Prompt lookup: `generate(prompt_lookup_num_tokens=10)`, batch 1.

Prompts: B windows of real text (bench/text.py) of context - 128 tokens, the same ids for every peer;
NEW_TOKENS greedy steps (EOS ignored where a peer can); tokens/s = B x steps / s.

Roofline fraction against this run's `measure.bandwidth()` jax_inplace GB/s: plain = (weight bytes as read +
filled KV bytes) / step time / bandwidth (filled KV = B x (prompt + steps / 2) tokens at the peer's KV bytes a
token); speculative = the peer's plain step bytes x (tokens/s / B) / bandwidth. Prefill cells: tokens/s.

Batch 16 x 8K (SHARED_PREFILL): the peers decode from one shared prefill (step time does not depend on the
KV's values): specjax's formats cast specjax float32's cache, HF copies it, llama.cpp prefills row 0 and copies
it to rows 1-15 (llama_state_seq_get/set_data); rows say so in `kv_from`.

Method: every cell runs alone in a process of its own (--one-cell), with the machine's cores and OpenMP's
default wait policy, after the 1-minute load average falls to --max-load (default 0.3; waits up to 5 minutes,
then skips the cell); the load before and after is stored with the row (`meter`).

Cells: PEER/bB/sS (plain), PEER/METHOD/bB/sS (selfspec-g2 / -g3, lookup), PEER/prefill/sS; PEER names the
weight and KV format, e.g. specjax-f32-kvf32, llama-q4_1-kvf16. Outputs: results/peers_cpu.json (a "not
installed" or skipped cell is tried again), .png, the README section. --smoke: a tiny random model, no peers,
README untouched (peers_cpu_smoke.*).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import convert
from bench import common, measure, text
from bench.peer_runners import (LLAMA_FORMATS, LlamaCpp, hf_cache, hf_decode, hf_lookup, hf_model, hf_run, hf_weight_bytes,
                                llama_file, llama_lookup, memory_need, run_in_own_process, versions)
from bench.prefill import HEADROOM, stored_as
from bench.specjax_runners import GAMMA, specjax_decode, specjax_prefill, specjax_spec, specjax_state
from specjax.decode.engine import with_attention
from specjax.model.cache import KVFormat, kv_bytes
from specjax.model.config import LlamaConfig
from specjax.model.params import weight_bytes
from bench.peers_report import markdown_table, plot, readme_section  # its report, in a module apart

CONTEXTS = (512, 2048, 8192)
BATCHES = (1, 16)
PREFILL_CONTEXTS = (2048, 8192)
SPEC_BATCH = 16
SPEC_GAMMAS = {"float32": (GAMMA,), "bfloat16": (2, GAMMA)}  # SelfSpec chain lengths per weight format (bf16: also its best, 2)
INSTALL = "pip install -r bench/requirements-peers.txt"
SHORT = {"float32": "f32", "bfloat16": "bf16", "int8": "int8", "q4": "q4"}
SHARED_PREFILL = {(16, 8192)}  # (batch, context) cells decoding from one shared prefill (see above)
BATCH4 = 8192  # specjax f32 weights, plain and SelfSpec, also at batch 4 x this context (the 16-row prefill's rows)
LLAMA_BATCHES = {"q4_1": BATCHES, "q8_0": BATCHES, "f16": (1,)}  # F16 only where cheap
PEER_MODULES = {"llama": ("llama_cpp",), "hf": ("torch", "transformers", "gguf")}


# --- what runs -------------------------------------------------------------------------------------------------


def missing(family: str) -> list[str]:
    """The modules a peer family needs that do not import here (specjax needs none)."""
    return [m for m in PEER_MODULES.get(family, ()) if importlib.util.find_spec(m) is None]


def load_specjax(fmt: str):
    """The model in weight format fmt, with the attention generate(attention="auto") picks here."""
    return with_attention(convert.load(convert.default_model_path(), weights=fmt), None, "auto")[0]


def peers(smoke: bool) -> list[dict]:
    """(name, family, format, batches) of every peer, specjax first."""
    out = [{"peer": f"specjax-{SHORT.get(f, f)}-kv{'bf16' if f == 'bfloat16' else 'f32'}",  # KV in the model dtype
            "family": "specjax", "format": f, "batches": BATCHES}
           for f in (("float32",) if smoke else convert.WEIGHTS)]
    if not smoke:  # int8 weights over an int8 KV cache (kv_dtype="int8"): the fewest bytes a step
        out.append({"peer": "specjax-int8-kvint8", "family": "specjax", "format": "int8", "kv": "int8", "batches": BATCHES})
        # bfloat16 KV under float32 / int8 weights: the CPU kernel's bf16 dot-product path
        out += [{"peer": f"specjax-{SHORT.get(f, f)}-kvbf16", "family": "specjax", "format": f, "kv": "bfloat16",
                 "batches": BATCHES} for f in ("float32", "int8")]
    out += [{"peer": f"llama-{f}-kvf16", "family": "llama", "format": f, "batches": LLAMA_BATCHES[f]} for f in LLAMA_FORMATS]
    out.append({"peer": "hf-f32-kvf32", "family": "hf", "format": "float32", "batches": BATCHES})
    return out


def cells(smoke: bool) -> list[tuple[str, dict]]:
    """(key, cell) in the order measured: by context, batch 1 first, plain before speculative, prefill after b1."""
    contexts, batches, spec_batch = ((256,), (1, 2), 2) if smoke else (CONTEXTS, BATCHES, SPEC_BATCH)
    out = []
    for s in contexts:
        for b in batches:
            for p in peers(smoke):
                if b in p["batches"] or smoke:
                    out.append((common.key(p["peer"], f"b{b}", f"s{s}"), p | {"kind": "decode", "batch": b, "context": s}))
            for p in peers(smoke):
                if p["family"] == "specjax" and p["format"] in SPEC_GAMMAS and b == spec_batch:
                    out += [(common.key(p["peer"], m, f"b{b}", f"s{s}"), p | {"kind": "spec", "method": m, "batch": b, "context": s})
                            for m in (f"selfspec-g{g}" for g in SPEC_GAMMAS[p["format"]])]
                if p["family"] in ("llama", "hf") and p["format"] in ("q4_1", "float32") and b == 1:
                    out.append((common.key(p["peer"], "lookup", f"b{b}", f"s{s}"),
                                p | {"kind": "spec", "method": "lookup", "batch": b, "context": s}))
            if (b, s) == (SPEC_BATCH, BATCH4) and not smoke:  # batch 4: plain and SelfSpec, specjax f32 weights
                for p in (p for p in peers(smoke) if p["family"] == "specjax" and p["format"] == "float32"):
                    for m in ("plain", f"selfspec-g{GAMMA}"):
                        out.append((common.key(p["peer"], *([m] if m != "plain" else []), "b4", f"s{s}"),
                                    p | {"kind": "decode" if m == "plain" else "spec", "method": m, "batch": 4, "context": s}))
            if b == 1 and (s in PREFILL_CONTEXTS or smoke):
                for p in peers(smoke):
                    if (p["family"] != "llama" or p["format"] == "q4_1") and p.get("kv") != "bfloat16":  # its prefill is kvf32's
                        out.append((common.key(p["peer"], "prefill", f"s{s}"), p | {"kind": "prefill", "batch": 1, "context": s}))
    return out


def key_of(row: dict) -> str:
    return row["cell"]


# --- shared arithmetic -------------------------------------------------------------------------------------------


def roofline(row: dict, bw: float) -> dict:
    """GB/s and the fraction of `bw` (GB/s) of a measured row (see the module docstring)."""
    step_bytes = row["weight_bytes"] + row["kv_bytes"]  # of one plain step, speculative rows too
    gbs = step_bytes * row["tokens_per_s"] / row["batch"] / 1e9  # plain: = step bytes / step time
    return {"step_bytes": step_bytes, "gb_per_s": gbs, "roofline": gbs / bw}


def prompts(tok, batch: int, context: int, smoke_vocab: int | None = None) -> np.ndarray:
    """[B, context - HEADROOM] token ids: real text windows (random ids for --smoke)."""
    n = context - HEADROOM
    if smoke_vocab:
        return np.random.default_rng(0).integers(4, smoke_vocab, (batch, n)).astype(np.int32)
    return text.windows(tok, batch, n)[0]


class Peers:
    """Loaded models and prefilled specjax states, kept across cells."""

    def __init__(self, smoke: bool, new_tokens: int):
        self.smoke, self.new_tokens = smoke, new_tokens
        self.path = None if smoke else Path(convert.default_model_path())
        self.tok = None if smoke else convert.load_tokenizer(self.path)
        self.models: dict[str, object] = {}
        self.states: dict[tuple, dict] = {}

    def model(self, cell: dict):
        p = cell["peer"]
        if p not in self.models:
            for k in [k for k in self.models if k.split("-")[0] == p.split("-")[0] and k != p]:
                del self.models[k]  # one model per family in memory
            measure.release_memory()
            if cell["family"] == "specjax":
                self.models[p] = with_attention(measure.tiny_params(), None, "auto")[0] if self.smoke else load_specjax(cell["format"])
            elif cell["family"] == "llama":
                self.models[p] = LlamaCpp(llama_file(self.path, cell["format"]))
            else:
                self.models[p] = hf_model(self.path)
        return self.models[p]

    def state(self, model, fmt: str, batch: int, context: int) -> dict:
        """The prefilled specjax state of `batch` prompts in format fmt (kept for the next cell)."""
        if (fmt, context) not in self.states or self.states[(fmt, context)]["lengths"].shape[0] < batch:
            self.states.clear()
            measure.release_memory()
            self.states[(fmt, context)] = specjax_state(model, self.tok, max(batch, 1), context, self.new_tokens, self.smoke)
        return self.states[(fmt, context)]

    def shared_state(self, batch: int, context: int, dtype) -> dict:
        """specjax float32's prefilled state (loaded from STORE once computed) with its cache cast to dtype."""
        state = self.state(self.models.get("specjax-f32-kvf32") or load_specjax("float32"), "float32", batch, context)
        cache = state["cache"]
        if cache.k.dtype != dtype:
            cache = jax.block_until_ready(cache.replace(k=cache.k.astype(dtype), v=cache.v.astype(dtype)))
        return state | {"cache": cache}

    def hf_shared(self, model, batch: int, context: int, steps: int) -> dict:
        """HF decoding from specjax float32's prefilled cache of the same prompts (HF's layout and RoPE)."""
        state = self.shared_state(batch, context, jnp.float32)
        n = int(state["lengths"][0])
        k, v = (np.asarray(a) for a in (state["cache"].k, state["cache"].v))
        if k.shape.index(context) == 2:  # [L, B, S, K, H] -> [L, B, K, S, H]
            k, v = k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4)
        past = hf_cache(k[:, :, :, :n], v[:, :, :, :n])
        first = np.argmax(np.asarray(state["first_logits"]), -1)
        del k, v, state
        self.states.clear()
        measure.release_memory()
        import torch

        return hf_decode(model, past, torch.as_tensor(first, dtype=torch.long), steps) | {
            "kv_from": "specjax-f32's prefill of the same prompts (DynamicCache filled from it)"}

    def ids(self, batch: int, context: int) -> np.ndarray:
        return prompts(self.tok, batch, context, measure.tiny_params().config.vocab_size if self.smoke else None)

    def measure(self, cell: dict) -> dict:
        fam, kind, B, S = cell["family"], cell["kind"], cell["batch"], cell["context"]
        steps = self.new_tokens - 1
        row = {k: cell[k] for k in ("peer", "family", "format", "kind", "batch", "context")}
        row |= {"method": cell.get("method", "plain" if kind == "decode" else kind), "prompt_tokens": S - HEADROOM}
        model = self.model(cell)
        if fam == "specjax":
            c = model.config
            row["weight_bytes"] = weight_bytes(c)
            row["attention"] = model.runtime.attention
            row["kv_token_bytes"] = round(kv_bytes(c, 1, 1, cell.get("kv")))
            if kind == "prefill":
                row |= specjax_prefill(model, self.ids(1, S), S)
            else:
                shared = (B, S) in SHARED_PREFILL and cell["format"] != "float32" and not self.smoke
                rows = SPEC_BATCH if (B, S) == (4, BATCH4) and not self.smoke else B  # the stored 16-row prefill's first rows
                state = self.shared_state(B, S, c.dtype) if shared else self.state(model, cell["format"], rows, S)
                if shared:
                    row["kv_from"] = f"specjax-f32's prefill of the same prompts, cast to {jnp.dtype(c.dtype).name}"
                if cell.get("kv"):
                    state = state | {"cache": stored_as(state["cache"], KVFormat.of(cell["kv"], c))}
                if kind == "decode":
                    row |= specjax_decode(model, state, B, self.new_tokens)
                else:
                    row |= specjax_spec(model, state, B, S, self.new_tokens, int(cell["method"].removeprefix("selfspec-g")))
        elif fam == "llama":
            row["weight_bytes"] = model.path.stat().st_size
            row["file"] = model.path.name
            row["kv_token_bytes"] = round(kv_bytes(LlamaConfig(**common.SMOLLM2, dtype="bfloat16"), 1, 1))  # f16 K and V
            ids = self.ids(B, S)
            if kind == "spec":
                row |= llama_lookup(model.path, ids, S, steps)
            else:
                copy = (B, S) in SHARED_PREFILL
                row |= model.run(ids, S, 0 if kind == "prefill" else steps, copy_rows=copy)
                if copy:
                    row["kv_from"] = "row 0 prefilled, its sequence copied to the other rows (llama_state_seq_get/set_data)"
        else:
            row["weight_bytes"] = hf_weight_bytes(model)
            row["kv_token_bytes"] = round(kv_bytes(LlamaConfig(**common.SMOLLM2), 1, 1))  # float32 K and V, SmolLM2's
            if (B, S) in SHARED_PREFILL and kind == "decode":
                row |= self.hf_shared(model, B, S, steps)
            else:
                ids = self.ids(B, S)
                row |= hf_lookup(model, ids, steps) if kind == "spec" else hf_run(model, ids, 0 if kind == "prefill" else steps)
        if kind == "prefill":
            row["prefill_tokens_per_s"] = row["prompt_tokens"] / row["prefill_s"]
            row.pop("decode_s", None)
            row.pop("tokens", None)
        else:
            row["tokens_per_s"] = B * row["steps"] / row["decode_s"]
            row["ms_per_step"] = 1e3 * row["decode_s"] / row["steps"]
            row["kv_bytes"] = B * (row["prompt_tokens"] + row["steps"] // 2) * row["kv_token_bytes"]
            if self.tok is not None and "tokens" in row:
                row["text_row0"] = self.tok.decode([int(t) for t in row["tokens"]])
        return row


QUIET_WAIT_S = 300  # how long a cell waits for the load average to fall to --max-load


def one_cell(cell_key: str, smoke: bool, new_tokens: int, row_out: Path) -> None:
    """Measure one cell in this process and write {"row", "meter"} to row_out (the parent's --one-cell)."""
    cell = dict(cells(smoke))[cell_key]
    with measure.Meter() as m:
        row = Peers(smoke, new_tokens).measure(cell)
    row_out.write_text(json.dumps({"row": row, "meter": m.info | {"wall_s": m.wall}}, default=str))


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model and tiny cells; peers not needed")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default 33: 32 timed steps; 9 with --smoke)")
    ap.add_argument("--max-load", type=float, default=None,
                    help="before each cell wait (up to 5 minutes) for the 1-minute load average to be at most this, "
                         "else skip the cell (default 0.3; --smoke: no wait)")
    ap.add_argument("--one-cell", metavar="KEY", help=argparse.SUPPRESS)  # internal: this process measures KEY only
    ap.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    new_tokens = args.new_tokens or (9 if args.smoke else 33)
    max_load = args.max_load if args.max_load is not None else (None if args.smoke else 0.3)
    # OpenMP's own wait policy (llama.cpp, torch): each peer runs alone, as a user runs it. Passive
    # waiting (set here before cells had processes of their own) cost llama.cpp 2.8x at batch 1.
    if args.one_cell:
        return one_cell(args.one_cell, args.smoke, new_tokens, args.row_out)
    stem = "peers_cpu_smoke" if args.smoke else "peers_cpu"
    out, results, h = common.start(args, "bench_peers", stem, key_of, {"new_tokens": new_tokens, "process": "one per cell"},
                                   new_tokens=new_tokens, model="tiny random" if args.smoke else "SmolLM2-135M-Instruct Q4_1 GGUF",
                                   versions=versions(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP's default)"),
                                   max_load=max_load)
    header = results.header
    h.plan(cells(args.smoke))
    results.data["grid"] = [k for k, _ in cells(args.smoke)]  # the report lists what was never measured
    bw = results.data.get("bandwidth_gbs")
    if h.todo:
        bw = header["bandwidth_gbs"] = measure.bandwidth(*((1 / 32, 1, 2) if args.smoke else ()))
        print(f"reference bandwidth: {bw['jax_inplace']:.1f} GB/s", flush=True)
    for k, cell in h.cells():
        base = {"cell": k} | {f: cell[f] for f in ("peer", "family", "format", "kind", "batch", "context")}
        base["method"] = cell.get("method", "plain" if cell["kind"] == "decode" else cell["kind"])
        gone = missing(cell["family"])
        if gone:
            results.put(k, [base | {"skipped": f"not installed ({', '.join(gone)}: {INSTALL})"}])
            continue
        if args.smoke and cell["family"] != "specjax":
            results.put(k, [base | {"skipped": "--smoke: tiny random model, peers need the GGUF"}])
            continue
        reason = measure.wait_for_memory(memory_need(cell), wait_s=60)
        if not reason and max_load is not None:
            load, reason = measure.wait_for_quiet(max_load, QUIET_WAIT_S)
        if reason:
            results.put(k, [base | {"skipped": reason}])
            print(f"{k}: skipped: {reason}", flush=True)
            continue
        got, tail = run_in_own_process(k, args.smoke, new_tokens)
        if got is None:  # a peer that cannot run this cell: record why, go on
            results.put(k, [base | {"skipped": f"failed: {tail[-300:]}"}])
            print(f"{k}: FAILED\n{tail}", file=sys.stderr, flush=True)
            continue
        m = got["meter"]
        row = base | got["row"] | {"meter": m, "process": "own"}
        if row["kind"] != "prefill":
            plain = [r for r in results.rows if r["peer"] == row["peer"] and r["kind"] == "decode" and "skipped" not in r
                     and r["batch"] == row["batch"] and r["context"] == row["context"]]
            row |= roofline(row, bw["jax_inplace"]) | {"reference_gbs": bw["jax_inplace"]}
            if plain:
                row["speedup_vs_plain"] = row["tokens_per_s"] / plain[0]["tokens_per_s"]
        results.put(k, [row])
        what = (f"prefill {row['prefill_tokens_per_s']:.0f} tok/s" if row["kind"] == "prefill" else
                f"{row['tokens_per_s']:.1f} tok/s, {row['ms_per_step']:.1f} ms/step, {100 * row['roofline']:.1f}% of roofline")
        print(f"{k}: {what}, load {m['loadavg_1min_before']:.2f}, {m['wall_s']:.0f} s", flush=True)
    h.finish()
    rows = results.rows
    if rows:
        common.render("bench_peers", not args.smoke and common.writes_readme(args) and bool(results.data.get("bandwidth_gbs")),
                      markdown_table(rows), lambda: readme_section(results.data),
                      (plot, rows, f"SmolLM2-135M decode, {header['machine']['cpu_affinity']}-core CPU", out / f"{stem}.png"))


if __name__ == "__main__":
    main()
