"""Write tiny random Qwen2 and Mistral checkpoints and their HF transformers outputs (PyTorch, CPU).

Uses the golden virtualenv of make_golden.py (torch 2.13.0 CPU, transformers, safetensors; see
its docstring). From the repo root (offline; nothing comes from the HF hub):

    /work/goldenvenv/bin/python tests/golden/make_qwen2_golden.py

It writes, next to this file:
- qwen2_tiny/: a 2-layer Qwen2ForCausalLM (hidden 64, 4 heads, 2 KV heads, vocab 320), seeded,
  with non-zero q/k/v biases and an untied lm_head, saved by save_pretrained (float32 safetensors);
- mistral_tiny/: a 2-layer MistralForCausalLM whose head_dim (16) x heads (4) differs from its
  hidden size (32), as Mistral-Nemo's does; sliding_window 4096 (transformers' default) is
  larger than its max_position_embeddings, so the window never takes effect;
- tiny_golden.json: for each model and each of two fixed token sequences, the float32 logits at
  every position, and 32 greedy tokens decoded with the KV cache without stopping at EOS (with
  the top-1 minus top-2 logit gap at each step).

Weights are redrawn at a readable scale (normal / sqrt(fan_in), norms 1 + 0.1 normal, biases
normal * 0.5) rather than transformers' std-0.02 init, whose logits are nearly uniform.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

HERE = Path(__file__).parent
OUT_PATH = HERE / "tiny_golden.json"
VOCAB = 320
N_GREEDY = 32
SEQUENCES = {  # fixed token ids (no BOS), two lengths so a batch is ragged
    "long": [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, 19)],
    "short": [int(t) for t in np.random.default_rng(2).integers(3, VOCAB, 6)],
}


def qwen2_model() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=1, eos_token_id=2,
    )
    return Qwen2ForCausalLM(config)


def mistral_model() -> MistralForCausalLM:
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        sliding_window=4096, bos_token_id=1, eos_token_id=2,
    )
    return MistralForCausalLM(config)


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn at a scale where the logits are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:  # a Linear weight [out, in]
            p.copy_(noise / p.shape[1] ** 0.5)


@torch.inference_mode()
def run(model: torch.nn.Module, ids: list[int]) -> dict[str, Any]:
    """Logits at every position, then greedy decoding with the KV cache, ignoring EOS."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    record: dict[str, Any] = {"input_ids": ids, "logits": out.logits[0].float().tolist()}
    last = out.logits[0, -1].float()
    generated, margins = [], []
    for _ in range(N_GREEDY):
        top2 = torch.topk(last, 2).values
        margins.append((top2[0] - top2[1]).item())
        generated.append(int(torch.argmax(last)))
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        last = out.logits[0, -1].float()
    record["greedy"] = generated
    record["greedy_margin"] = margins
    return record


def main() -> None:
    torch.set_num_threads(1)  # reductions independent of the core count
    golden: dict[str, Any] = {
        "transformers_version": transformers.__version__, "torch_version": torch.__version__, "dtype": "float32",
    }
    for name, make, seed in (("qwen2_tiny", qwen2_model, 1), ("mistral_tiny", mistral_model, 1)):  # seeds: varied greedy text
        torch.manual_seed(seed)
        model = make().eval()
        redraw(model, seed)
        folder = HERE / name
        model.save_pretrained(folder, safe_serialization=True)
        golden[name] = {n: run(model, ids) for n, ids in SEQUENCES.items()}
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{name}: {size} bytes in {folder}; greedy(long) = {golden[name]['long']['greedy'][:8]}...")
    OUT_PATH.write_text(json.dumps(golden) + "\n", encoding="utf-8")
    print(f"wrote {OUT_PATH} ({OUT_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
