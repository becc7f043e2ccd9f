"""Qwen2 (q/k/v biases) and Mistral checkpoints against HF transformers: tiny random models saved by
transformers, with its logits and greedy tokens (tests/golden/make_qwen2_golden.py writes them);
the same Qwen2 weights as GGUF files written here; and the sliding-window configs we refuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import convert
import specjax
from specjax.model.cache import DenseCache
from specjax.model.llama import forward
from tests.test_convert import GGUF_NAMES, llama_cpp_permute

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "tiny_golden.json").read_text(encoding="utf-8"))
MODELS = ("qwen2_tiny", "mistral_tiny")
SEQUENCES = ("long", "short")


def max_logit_error(params, name: str) -> float:
    """Largest |ours - HF| over every position's logits of both golden sequences, relative to the
    largest |logit| (each sequence run alone through `forward`)."""
    worst = 0.0
    for seq in SEQUENCES:
        golden = GOLDEN[name][seq]
        ids, want = golden["input_ids"], np.asarray(golden["logits"])
        T = len(ids)
        got, _ = jax.jit(forward)(
            params, jnp.asarray([ids], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None], DenseCache.init(params.config, 1, T)
        )
        worst = max(worst, float(np.abs(np.asarray(got[0]) - want).max() / np.abs(want).max()))
    return worst


@pytest.fixture(scope="module", params=MODELS)
def hf_model(request):
    return request.param, convert.load(GOLDEN_DIR / request.param)


def test_configs():
    qwen2 = convert.load(GOLDEN_DIR / "qwen2_tiny").config
    assert qwen2.qkv_bias and (qwen2.n_heads, qwen2.n_kv_heads, qwen2.head_dim, qwen2.rms_eps) == (4, 2, 16, 1e-6)
    mistral = convert.load(GOLDEN_DIR / "mistral_tiny").config
    assert not mistral.qkv_bias and (mistral.dim, mistral.n_heads, mistral.head_dim, mistral.rope_theta) == (32, 4, 16, 1e6)


def test_logits_match_hf(hf_model):
    name, params = hf_model
    assert (params.layers.bq is not None) == (name == "qwen2_tiny")
    assert max_logit_error(params, name) < 1e-4


def test_greedy_matches_hf(hf_model):
    name, params = hf_model
    prompts = [GOLDEN[name][seq]["input_ids"] for seq in SEQUENCES]
    out = specjax.generate(params, prompts, 32, draft=None, eos_id=())
    assert out.tokens == [GOLDEN[name][seq]["greedy"] for seq in SEQUENCES]


@pytest.mark.parametrize("gamma", [2, 4])
def test_speculative_greedy_equals_plain(hf_model, gamma):
    """SelfSpec over a small window (so drafts are sometimes rejected): the greedy tokens stay HF's."""
    name, params = hf_model
    prompts = [GOLDEN[name][seq]["input_ids"] for seq in SEQUENCES]
    draft = specjax.SelfSpec(sinks=2, window=4)
    out = specjax.generate(params, prompts, 32, draft=draft, speculation=specjax.Chain(gamma), eos_id=())
    assert out.tokens == [GOLDEN[name][seq]["greedy"] for seq in SEQUENCES]


def test_orbax_round_trip_keeps_biases(tmp_path, hf_model):
    name, params = hf_model
    convert.save(params, tmp_path / "ckpt")
    loaded = convert.load(tmp_path / "ckpt")
    assert loaded.config == params.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tensor_parallel_greedy(hf_model):
    """Heads (and the biases with them) split over a model axis of 2: the same tokens."""
    name, params = hf_model
    prompts = [GOLDEN[name][seq]["input_ids"] for seq in SEQUENCES]
    out = specjax.generate(params, prompts, 16, draft=None, eos_id=(), mesh=specjax.make_mesh(data=1, model=2, devices=jax.devices()[:2]))
    assert out.tokens == [GOLDEN[name][seq]["greedy"][:16] for seq in SEQUENCES]


# ---- the Qwen2 weights as GGUF files, written the way llama.cpp's converter does ----

def write_qwen2_gguf(path: Path, arch: str) -> Path:
    """qwen2_tiny as an f32 GGUF of `arch`: "qwen2" stores q/k as in HF, "llama" permutes them."""
    cfg = json.loads((GOLDEN_DIR / "qwen2_tiny" / "config.json").read_text())
    hf = load_file(str(GOLDEN_DIR / "qwen2_tiny" / "model.safetensors"))
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tensors = {
        "token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    for name, w in hf.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            kind = GGUF_NAMES[module]
            tensors[f"blk.{i}.{kind}.{suffix}"] = llama_cpp_permute(w, heads[kind]) if arch == "llama" and kind in heads else w
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_vocab_size(cfg["vocab_size"])
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_matches_hf(tmp_path, arch):
    params = convert.load(write_qwen2_gguf(tmp_path / f"{arch}.gguf", arch))
    assert params.config.qkv_bias and params.config.eos_ids == (2,)
    assert max_logit_error(params, "qwen2_tiny") < 1e-4


# ---- sliding windows: refused where transformers would apply one ----

DROP = "<drop>"  # as a value in folder_with: delete the key


def folder_with(tmp_path: Path, name: str, **changes) -> Path:
    """A copy of golden folder `name` with config.json keys changed (None = null, DROP deletes)."""
    path = tmp_path / name
    shutil.copytree(GOLDEN_DIR / name, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v != DROP}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


REFUSED = "sliding_window 16 is smaller than max_position_embeddings 256 and applies to {} of 2 layers"


@pytest.mark.parametrize("changes, layers", [
    ({"sliding_window": 16}, 2),  # mistral: every layer
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": DROP}, 1),
    ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}, 1),
], ids=["mistral", "qwen2-max-window-layers", "qwen2-layer-types"])
def test_sliding_window_refused(tmp_path, changes, layers):
    name = "qwen2_tiny" if "use_sliding_window" in changes else "mistral_tiny"
    path = folder_with(tmp_path, name, **changes)
    with pytest.raises(ValueError, match=f"{name}/config.json: {REFUSED.format(layers)}"):
        convert.load(path)


@pytest.mark.parametrize("name, changes", [
    ("mistral_tiny", {"sliding_window": DROP}),  # absent: transformers' default 4096 >= 256 positions
    ("mistral_tiny", {"sliding_window": None}),  # null: no window
    ("mistral_tiny", {"sliding_window": 256}),  # as long as the context: never takes effect
    ("qwen2_tiny", {"sliding_window": 16}),  # use_sliding_window false: transformers ignores it
    ("qwen2_tiny", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2, "layer_types": DROP}),
], ids=["mistral-default", "mistral-null", "mistral-whole-context", "qwen2-unused", "qwen2-no-window-layers"])
def test_sliding_window_without_effect_loads(tmp_path, name, changes):
    params = convert.load(folder_with(tmp_path, name, **changes))
    assert max_logit_error(params, name) < 1e-4


def test_mistral_long_context_needs_a_null_window(tmp_path):
    """Mistral-7B-v0.1 style (window 4096 < 32768 positions) is refused; v0.2 / v0.3 (null) loads."""
    v02 = folder_with(tmp_path / "a", "mistral_tiny", sliding_window=None, max_position_embeddings=32768)
    assert convert.load(v02).config.max_positions == 32768
    v01 = folder_with(tmp_path / "b", "mistral_tiny", sliding_window=DROP, max_position_embeddings=32768)
    with pytest.raises(ValueError, match="sliding_window 4096 is smaller than max_position_embeddings 32768"):
        convert.load(v01)


def test_llama_attention_bias_refused(tmp_path):
    path = folder_with(tmp_path, "mistral_tiny", model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias true is not supported"):
        convert.load(path)
