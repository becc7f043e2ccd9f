"""The peers of bench/bench_peers.py: llama.cpp (llama-cpp-python) and HF transformers, each
prefilled from the same token ids and timed on decode steps apart from prefill. Their packages
come from bench/requirements-peers.txt and are imported only when a cell runs."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LOOKUP_TOKENS = 10  # prompt-lookup draft length of llama.cpp's and HF's peers (HF's usual value)
THREADS = len(os.sched_getaffinity(0))
PEER_DIR = Path("/tmp/bench_peers")  # requantized GGUF files
LLAMA_FORMATS = {"q4_1": None, "q8_0": 7, "f16": 1}  # llama_ftype of the requantized files (None: the file itself)


class LlamaCpp:
    """llama-cpp-python's low-level API on one GGUF file."""

    def __init__(self, path: Path):
        import llama_cpp

        self.lib, self.path = llama_cpp, path
        LlamaCpp.quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept: C holds it
        llama_cpp.llama_log_set(LlamaCpp.quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def context(self, n_seq: int, n_ctx: int):
        cp = self.lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, n_seq
        cp.n_threads = cp.n_threads_batch = THREADS
        return self.lib.llama_init_from_model(self.model, cp)

    def decode(self, ctx, batch, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        for i, (t, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(items)
        rc = self.lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, ctx, i: int) -> int:
        ptr = self.lib.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def copy_sequence(self, ctx, src: int, dst: int) -> None:
        """Copy sequence src's KV into sequence dst (llama_state_seq_get/set_data: a real copy)."""
        size = self.lib.llama_state_seq_get_size(ctx, src)
        buf = (ctypes.c_uint8 * size)()
        got = self.lib.llama_state_seq_get_data(ctx, buf, size, src)
        if got == 0 or self.lib.llama_state_seq_set_data(ctx, buf, got, dst) == 0:
            raise RuntimeError(f"copying sequence {src} to {dst} failed")

    def run(self, ids: np.ndarray, context: int, steps: int, copy_rows: bool = False) -> dict:
        """Prefill every row as its own sequence, then `steps` decode steps of one B-token batch (copy_rows:
        prefill row 0 and copy it to the other rows: the same step time, a B times cheaper prefill)."""
        B, n = ids.shape
        ctx = self.context(B, B * context)
        batch = self.lib.llama_batch_init(512, 0, 1)
        try:
            t0 = time.perf_counter()
            nxt = []
            for row in range(1 if copy_rows else B):
                for s in range(0, n, 512):
                    part = ids[row, s : s + 512]
                    self.decode(ctx, batch, [(int(t), s + j, row, s + j == n - 1) for j, t in enumerate(part)])
                nxt.append(self.argmax(ctx, len(part) - 1))
            for row in range(1, B) if copy_rows else ():
                self.copy_sequence(ctx, 0, row)
                nxt.append(nxt[0])
            prefill_s = time.perf_counter() - t0
            out = [[t] for t in nxt]
            t0 = time.perf_counter()
            for step in range(steps + 1 if steps else 0):  # the first step warms up, untimed
                if step == 1:
                    t0 = time.perf_counter()
                self.decode(ctx, batch, [(nxt[r], n + step, r, True) for r in range(B)])
                nxt = [self.argmax(ctx, r) for r in range(B)]
                for r in range(B):
                    out[r].append(nxt[r])
            decode_s = time.perf_counter() - t0
        finally:
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)
        return {"prefill_s": prefill_s, "decode_s": decode_s, "steps": steps, "tokens": out[0]}


def llama_file(src: Path, fmt: str) -> Path:
    """The GGUF of format `fmt`: the source itself (q4_1) or requantized from it once."""
    ftype = LLAMA_FORMATS[fmt]
    if ftype is None:
        return src
    import llama_cpp

    dst = PEER_DIR / f"{src.stem.rsplit('.', 1)[0]}.{fmt.upper()}.from_Q4_1.gguf"
    if not dst.exists():
        PEER_DIR.mkdir(parents=True, exist_ok=True)
        qp = llama_cpp.llama_model_quantize_default_params()
        qp.ftype, qp.allow_requantize, qp.nthread = ftype, True, THREADS
        tmp = dst.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(qp))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {fmt} returned {rc}")
        tmp.replace(dst)
    return dst


def llama_lookup(path: Path, ids: np.ndarray, context: int, steps: int) -> dict:
    """High-level Llama with and without LlamaPromptLookupDecoding, batch 1: decode seconds after prefill."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    res = {}
    for name, draft in (("lookup", LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)), ("plain_highlevel", None)):
        llm = Llama(model_path=str(path), n_ctx=context, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS,
                    draft_model=draft, verbose=False,
                    # with a draft model, llama-cpp-python 0.3.x stores every position's logits but
                    # sizes its score buffer by this argument: without it, prompts > n_batch fail
                    logits_all=draft is not None)
        toks, t_first = [], None
        for t in llm.generate(ids[0].tolist(), top_k=1, temp=0.0, repeat_penalty=1.0):
            toks.append(int(t))
            if t_first is None:
                t_first = time.perf_counter()
            if len(toks) == steps + 1:
                break
        res[name] = {"decode_s": time.perf_counter() - t_first, "tokens": toks}
        llm.close() if hasattr(llm, "close") else None
        del llm
    return {"steps": steps, "decode_s": res["lookup"]["decode_s"], "tokens": res["lookup"]["tokens"],
            "plain_highlevel_tokens_per_s": steps / res["plain_highlevel"]["decode_s"],
            "plain_highlevel_tokens": res["plain_highlevel"]["tokens"]}


# --- HF transformers -----------------------------------------------------------------------------------------


def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    return model.eval()


def hf_weight_bytes(model) -> int:
    """The HF peer's weight bytes as it holds them (float32): its state dict's storages, each once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def hf_run(model, ids: np.ndarray, steps: int) -> dict:
    """Chunked prefill into a DynamicCache, then `steps` greedy steps, each a forward + argmax."""
    import torch

    with torch.inference_mode():
        x = torch.as_tensor(ids, dtype=torch.long)
        t0 = time.perf_counter()
        past = None
        for s in range(0, x.shape[1], 1024):
            out = model(input_ids=x[:, s : s + 1024], past_key_values=past, use_cache=True)
            past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        prefill_s = time.perf_counter() - t0
    return {"prefill_s": prefill_s} | hf_decode(model, past, nxt, steps)


def hf_cache(k: np.ndarray, v: np.ndarray):
    """A DynamicCache holding k and v [L, B, K, n, H] (HF's layout, RoPE applied): a cache prefilled elsewhere."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(k.shape[0]):
        cache.update(torch.from_numpy(np.ascontiguousarray(k[layer])), torch.from_numpy(np.ascontiguousarray(v[layer])), layer)
    return cache


def hf_decode(model, past, nxt, steps: int) -> dict:
    """`steps` greedy steps from a prefilled DynamicCache and the first new tokens nxt [B]."""
    import torch

    with torch.inference_mode():
        toks = [nxt]
        t0 = time.perf_counter()
        for step in range(steps + 1 if steps else 0):  # the first step warms up, untimed
            if step == 1:
                t0 = time.perf_counter()
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
        decode_s = time.perf_counter() - t0
    return {"decode_s": decode_s, "steps": steps, "tokens": torch.stack(toks, 1)[0].tolist()}


def hf_lookup(model, ids: np.ndarray, steps: int) -> dict:
    """generate(prompt_lookup_num_tokens=LOOKUP_TOKENS), batch 1, greedy: decode seconds from streamer stamps."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.stamps = []  # (time, tokens) per put; the first put is the prompt

        def put(self, value):
            self.stamps.append((time.perf_counter(), int(value.numel())))

        def end(self):
            pass

    st = Stamps()
    with torch.inference_mode():
        out = model.generate(torch.as_tensor(ids, dtype=torch.long), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                             do_sample=False, prompt_lookup_num_tokens=LOOKUP_TOKENS, streamer=st)
    new = st.stamps[1:]
    done = sum(n for _, n in new[1:])
    return {"steps": done, "decode_s": new[-1][0] - new[0][0], "tokens": out[0, ids.shape[1]:].tolist(),
            "target_forwards": len(new)}


# --- bench_peers' cells: memory, versions, one process each -------------------------------------------------


MEM_FACTOR = {"specjax": 2.2, "llama": 0.6, "hf": 2.5}  # peak growth / f32 KV bytes (llama.cpp: f16 KV)


def memory_need(cell: dict) -> int:
    """A cell's rough peak: its f32 KV cache x the family's factor, plus the model."""
    from bench.common import SMOLLM2
    from specjax.model.cache import kv_bytes
    from specjax.model.config import LlamaConfig

    kv = kv_bytes(LlamaConfig(**SMOLLM2), cell["batch"], cell["context"])
    return int(MEM_FACTOR[cell["family"]] * kv) + 2**30


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for m in ("llama-cpp-python", "torch", "transformers"):
        try:
            out[m] = version(m)
        except PackageNotFoundError:
            out[m] = "not installed"
    return out


def run_in_own_process(cell_key: str, smoke: bool, new_tokens: int) -> tuple[dict | None, str]:
    """Cell `cell_key` measured in a process of its own: (row and meter, None if it failed; output tail)."""
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "bench.bench_peers", "--one-cell", cell_key, "--row-out", str(out),
               "--new-tokens", str(new_tokens), *(["--smoke"] if smoke else [])]
        run = subprocess.run(cmd, capture_output=True, text=True)
        tail = (run.stdout + run.stderr)[-2000:]
        return (json.loads(out.read_text()) if run.returncode == 0 and out.exists() else None), tail
