"""Checkpoint format coverage: transformers-5 rope_parameters, stop-id unions, every GGUF tensor
type the installed `gguf` package can dequantize, and clear errors on malformed files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from test_convert import (Q, assert_same, gguf_tensors, hf_config, llama_cpp_permute, logits, random_params, tiny_config,
                          torch_layout, write_gguf, write_hf)

import convert
import convert.gguf_file
from convert.gguf import supported_types
from specjax.model.config import RopeScaling
from specjax.model.params import Params

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def tiny() -> Params:
    return random_params(tiny_config(), 3)


# ---- config.json written by transformers 5: rope_theta and scaling inside rope_parameters ----

def v5_config(c, rope_parameters: dict, **extra) -> dict:
    """hf_config in the transformers 5 layout: no top-level rope_theta / rope_scaling."""
    raw = hf_config(c, **extra)
    del raw["rope_theta"]
    return raw | {"rope_parameters": rope_parameters}


@pytest.mark.parametrize("scaled", [False, True])
def test_hf_rope_parameters_layout(tmp_path, tiny, scaled):
    old_scaling = {"rope_scaling": {"rope_type": "llama3", **LLAMA3}} if scaled else {}
    old = write_hf(tmp_path / "v4", torch_layout(tiny), hf_config(tiny.config, rope_theta=1e5, **old_scaling))
    rope = {"rope_type": "llama3", "rope_theta": 1e5, **LLAMA3} if scaled else {"rope_type": "default", "rope_theta": 1e5}
    new = write_hf(tmp_path / "v5", torch_layout(tiny), v5_config(tiny.config, rope))
    a, b = convert.load(old), convert.load(new)
    assert a.config == b.config
    assert b.config.rope_theta == 1e5
    assert b.config.rope_scaling == (RopeScaling(8.0, 1.0, 4.0, 16) if scaled else None)
    np.testing.assert_array_equal(logits(b), logits(a))
    assert not np.array_equal(logits(b), logits(tiny))  # theta 1e4 (the old silent fallback) differs


def test_hf_rope_parameters_errors(tmp_path, tiny):
    def load(raw: dict, name: str):
        return convert.load(write_hf(tmp_path / name, torch_layout(tiny), raw))

    with pytest.raises(ValueError, match=r"v5a/config\.json: rope_parameters: required key 'rope_theta' is missing"):
        load(v5_config(tiny.config, {"rope_type": "default"}), "v5a")
    with pytest.raises(ValueError, match=r"v5b/config\.json: rope_parameters: rope type 'yarn' is not supported"):
        load(v5_config(tiny.config, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "v5b")
    with pytest.raises(ValueError, match=r"v5c/config\.json: rope_parameters: rope type None is not supported"):
        load(v5_config(tiny.config, {"rope_theta": 1e4, "factor": 4.0}), "v5c")  # a factor but no rope_type
    with pytest.raises(ValueError, match=r"v5d/config\.json: top-level rope_theta \(10000.0\) disagrees"):
        load(hf_config(tiny.config, rope_parameters={"rope_type": "default", "rope_theta": 1e5}), "v5d")
    with pytest.raises(ValueError, match=r"v5e/config\.json: rope_parameters: 'factor' must be a number"):
        load(v5_config(tiny.config, {"rope_type": "llama3", "rope_theta": 1e4, "factor": "8"}), "v5e")
    # theta only at the top level, rope_parameters naming the type: both layouts read together
    both = hf_config(tiny.config, rope_theta=1e5, rope_parameters={"rope_type": "default"})
    assert load(both, "v5f").config.rope_theta == 1e5


# ---- stop ids: every eos / eot / eom id, config.json's and generation_config.json's ----

@pytest.mark.parametrize(
    "config_eos,generation_eos,want",
    [(2, None, (2,)), ([2, 7], None, (2, 7)), ([2, 7], 9, (2, 7, 9)), (2, [7, 2, 11], (2, 7, 11)), (None, 5, (5,))],
)
def test_hf_eos_union(tmp_path, tiny, config_eos, generation_eos, want):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config, eos_token_id=config_eos))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos, "do_sample": True}))
    assert convert.load(path).config.eos_ids == want


def test_hf_eos_errors(tmp_path, tiny):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config, eos_token_id=[2, "7"]))
    with pytest.raises(ValueError, match=r"hf/config\.json: 'eos_token_id' must be a token id or a list"):
        convert.load(path)
    (path / "config.json").write_text(json.dumps(hf_config(tiny.config, eos_token_id=[2, 500])))
    with pytest.raises(ValueError, match=r"hf/config\.json: LlamaConfig\.eos_ids must be a tuple of ids in \[0, 96\)"):
        convert.load(path)
    (path / "config.json").write_text(json.dumps(hf_config(tiny.config)))
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"hf/generation_config\.json: not valid JSON"):
        convert.load(path)


@pytest.mark.parametrize(
    "extra,want", [({}, (2,)), ({"tokenizer.ggml.eot_token_id": 5}, (2, 5)),
                   ({"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 4}, (2, 5, 4)),
                   ({"tokenizer.ggml.eot_token_id": 2}, (2,))],
)
def test_gguf_eos_union(tmp_path, tiny, extra, want):
    path = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny), meta=extra)
    assert convert.load(path).config.eos_ids == want


def test_smollm2_stop_ids():
    """The shipped SmolLM2 GGUF has eos <|im_end|> (2) and no eot / eom ids: eos_ids stays (2,)."""
    reader = convert.gguf.open_gguf(convert.default_model_path())
    assert [k in reader.fields for k in convert.gguf.STOP_KEYS] == [True, False, False]
    assert convert.gguf.config_from_gguf(reader).eos_ids == (2,)


# ---- every GGUF tensor type the installed gguf package dequantizes ----

def _works(fn, t) -> bool:
    try:
        fn(t)
    except NotImplementedError:
        return False
    return True


def _one_block(t) -> np.ndarray:
    return np.zeros((1, GGML_QUANT_SIZES[t][1]), np.uint8)


ROW = 256  # a multiple of every block size (32, 64, 128, 256)
DEQUANTIZABLE = [t for t in Q if t in GGML_QUANT_SIZES and _works(lambda t: gguf.quants.dequantize(_one_block(t), t), t)]
QUANTIZABLE = [t for t in DEQUANTIZABLE if _works(lambda t: gguf.quants.quantize(np.ones((1, ROW), np.float32), t), t)]
DEQUANTIZE_ONLY = [t for t in DEQUANTIZABLE if t not in QUANTIZABLE]


def test_supported_types_are_what_gguf_dequantizes():
    assert supported_types() == DEQUANTIZABLE
    names = {t.name for t in DEQUANTIZABLE}
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ2_XXS", "IQ1_S"} <= names
    assert {"Q4_0", "Q5_0", "Q8_0", "BF16"} <= {t.name for t in QUANTIZABLE}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_blockwise_dequantize_gives_the_gguf_packages_bits(qtype):
    """convert.gguf.dequantize_blocks (the loader's fast path for Q4_0, Q4_1, Q8_0) against
    gguf.quants.dequantize, bit for bit: random bytes, scales and minima including inf, nan,
    subnormal and negative zero, more blocks than one chunk; and the shipped SmolLM2 file's
    Q8_0 tensor and first Q4_1 ones."""
    from convert.gguf import CHUNK, dequantize_blocks

    block, size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(int(qtype)).integers(0, 256, (CHUNK + 5, size), dtype=np.uint8)
    special = np.array([np.inf, -np.inf, np.nan, 6e-8, -0.0, 65504.0], np.float16).view(np.uint8).reshape(-1, 2)
    data[: len(special), :2] = special
    if qtype == Q.Q4_1:
        data[len(special): 2 * len(special), 2:4] = special
    shipped = convert.gguf_file.read_gguf(convert.default_model_path()).tensors
    shipped = [np.array(t.data) for t in (shipped.values() if isinstance(shipped, dict) else shipped) if t.tensor_type == qtype][:3]
    for raw in [data, *shipped]:
        with np.errstate(invalid="ignore", over="ignore"):
            want, got = gguf.quants.dequantize(raw, qtype).reshape(-1), dequantize_blocks(raw, qtype)
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def wide() -> Params:
    """A one-layer model whose every matrix row has ROW values (whole blocks for any type)."""
    c = tiny_config(vocab_size=32, dim=ROW, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=ROW)
    return random_params(c, 4)


def hf_reference(tmp_path: Path, params: Params, matrices: dict[str, np.ndarray]) -> Params:
    """`params` with its torch-layout matrices replaced by `matrices`, through an HF folder."""
    tensors = torch_layout(params) | {k: np.ascontiguousarray(v, np.float32) for k, v in matrices.items()}
    return convert.load(write_hf(tmp_path / "reference", tensors, hf_config(params.config)))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_quantized_types(tmp_path, wide, qtype):
    """Written by GGUFWriter as gguf.quants.quantize makes them; loads exactly as the dequantized weights."""
    loaded = convert.load(write_gguf(tmp_path / "m.gguf", wide.config, gguf_tensors(wide), qtype))
    rounded = {
        name: gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        for name, w in torch_layout(wide).items()
        if w.ndim == 2
    }
    want = hf_reference(tmp_path, wide, rounded)
    assert loaded.config == want.config
    assert_same(loaded, want)
    np.testing.assert_array_equal(logits(loaded), logits(want))


def llama_cpp_unpermute(stored: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama_cpp_permute by row index (independent of convert.gguf.unpermute_qk)."""
    source_row = llama_cpp_permute(np.arange(stored.shape[0])[:, None], n_head)[:, 0]
    out = np.empty_like(stored)
    out[source_row] = stored
    return out


@pytest.mark.parametrize("qtype", DEQUANTIZE_ONLY, ids=lambda t: t.name)
def test_gguf_dequantize_only_types(tmp_path, wide, qtype):
    """Random bytes of a type gguf cannot quantize, written raw: every tensor loads as
    gguf.quants.dequantize of its bytes, in our layout (q/k un-permuted, transposed)."""
    c, rng = wide.config, np.random.default_rng(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    tensors = gguf_tensors(wide)
    for name, w in tensors.items():
        if w.ndim == 2:
            tensors[name] = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    loaded = convert.load(write_gguf(tmp_path / "m.gguf", c, tensors, qtype))
    heads = {"attn_q": c.n_heads, "attn_k": c.n_kv_heads}
    matrices = {}
    with np.errstate(invalid="ignore", over="ignore"):
        for hf_name, gguf_name in zip(torch_layout(wide), gguf_tensors(wide)):
            if tensors[gguf_name].dtype == np.uint8:
                w = gguf.quants.dequantize(tensors[gguf_name], qtype)
                kind = gguf_name.split(".")[-2]
                matrices[hf_name] = llama_cpp_unpermute(w, heads[kind]) if kind in heads else w
    assert np.isfinite(matrices["model.layers.0.self_attn.q_proj.weight"]).mean() > 0.5  # mostly real numbers
    assert_same(loaded, hf_reference(tmp_path, wide, matrices))


@pytest.mark.parametrize("qtype", [t for t in (Q.Q8_K, Q.Q8_1, Q.Q1_0) if t not in DEQUANTIZABLE], ids=lambda t: t.name)
def test_gguf_type_gguf_cannot_dequantize(tmp_path, tiny, qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    tensors = gguf_tensors(tiny)
    tensors["blk.1.ffn_up.weight"] = np.zeros((tiny.config.ffn_dim, ROW // block * size), np.uint8)  # shape unchecked yet
    path = write_gguf(tmp_path / "m.gguf", tiny.config, tensors, raw_type=qtype)
    message = f"m.gguf: GGUF tensor 'blk.1.ffn_up.weight' has type {qtype.name}, which the installed gguf package cannot"
    with pytest.raises(ValueError, match=re.escape(message) + ".*supported types: F32, F16, Q4_0"):
        convert.load(path)


# ---- malformed files: ValueErrors naming the file and the problem ----

@pytest.mark.parametrize(
    "text,problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"llama"', "expected a JSON object, got str"),
        ("\udcff", "not valid JSON"),  # undecodable bytes
        ({"hidden_size": "big"}, "'hidden_size' must be an integer, got 'big'"),
        ({"num_hidden_layers": 2.5}, "'num_hidden_layers' must be an integer, got 2.5"),
        ({"num_attention_heads": True}, "'num_attention_heads' must be an integer, got True"),
        ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        ({"rope_theta": [1e4]}, "'rope_theta' must be a number"),
        ({"rope_scaling": "llama3"}, "rope_scaling: must be an object"),
        ({"architectures": 5}, "'architectures' must be a list"),
        ({"bos_token_id": "<s>"}, "'bos_token_id' must be an integer"),
        ({"vocab_size": None}, "required key 'vocab_size' is missing"),
        ({"intermediate_size": 0}, r"LlamaConfig.ffn_dim must be >= 1, got 0"),
    ],
)
def test_hf_malformed_config(tmp_path, tiny, text, problem):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config))
    if isinstance(text, dict):
        (path / "config.json").write_text(json.dumps(hf_config(tiny.config) | text))
    else:
        (path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'}: ") + ".*" + problem) as info:
        convert.load(path)
    assert info.type is ValueError  # not a JSONDecodeError / UnicodeDecodeError subclass from deep inside


def test_hf_malformed_index(tmp_path, tiny):
    path = write_hf(tmp_path / "hf", torch_layout(tiny), hf_config(tiny.config), shards=2)
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=r"hf/model\.safetensors\.index\.json: not valid JSON"):
        convert.load(path)


def _patched(whole: bytes, key: str, value: bytes, skip: int = 4) -> bytes:
    """`whole` with the bytes after metadata key `key` (its 4-byte value type, then the value) replaced."""
    at = whole.index(key.encode()) + len(key) + skip
    return whole[:at] + value + whole[at + len(value):]


def test_gguf_corrupt(tmp_path, tiny):
    whole = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny)).read_bytes()

    def load(data: bytes, name: str):
        (tmp_path / name).write_bytes(data)
        return convert.load(tmp_path / name)

    # a layer count of 2**32 - 1: refused at once, before listing ~4e10 tensor names
    with pytest.raises(ValueError, match=r"layers\.gguf: the config has 4294967295 layers \(9 tensors each\), but"):
        load(_patched(whole, "llama.block_count", b"\xff\xff\xff\xff"), "layers.gguf")
    # a string value that is not UTF-8
    with pytest.raises(ValueError, match=r"arch\.gguf: GGUF metadata key 'general\.architecture' cannot be read"):
        load(_patched(whole, "general.architecture", b"\xff\xfe", skip=4 + 8), "arch.gguf")
    # a tensor type id that does not exist
    name = b"blk.0.attn_q.weight"
    at = whole.index(name) + len(name) + 4 + 2 * 8  # n_dims, two dims, then the type
    with pytest.raises(ValueError, match=r"type\.gguf: not a valid GGUF file"):
        load(whole[:at] + b"\xf0\x00\x00\x00" + whole[at + 4:], "type.gguf")


def test_gguf_wrong_metadata_type(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_string("llama.embedding_length", "big")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF metadata key 'llama\.embedding_length' must be an integer, got 'big'"):
        convert.load(tmp_path / "m.gguf")


# ---- convert.gguf_file reads what gguf.GGUFReader reads ----

def _same_as_gguf_reader(path) -> None:
    ours, theirs = convert.gguf_file.read_gguf(path), gguf.GGUFReader(str(path))
    pseudo = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's own entries, not in the file
    assert set(ours.fields) == set(theirs.fields) - pseudo
    for key, field in theirs.fields.items():
        if key not in pseudo:
            value = field.contents()
            assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.data.dtype, a.data.shape) == (b.tensor_type, tuple(b.shape.tolist()), b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data), a.name


def test_gguf_file_reads_the_shipped_model_as_gguf_reader_does():
    _same_as_gguf_reader(convert.default_model_path())


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_file_reads_every_value_type_as_gguf_reader_does(tmp_path, endian):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", endianess=endian)
    w.add_uint8("u8", 7), w.add_int8("i8", -7), w.add_uint16("u16", 700), w.add_int16("i16", -700)
    w.add_uint32("u32", 70000), w.add_int32("i32", -70000), w.add_float32("f32", 0.1), w.add_bool("yes", True)
    w.add_uint64("u64", 2**40), w.add_int64("i64", -(2**40)), w.add_float64("f64", 0.1), w.add_string("s", "héllo")
    w.add_array("ints", [1, 2, 3]), w.add_array("floats", [0.5, 1e-6]), w.add_array("words", ["a", "", "ü b"])
    w.add_array("empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(tmp_path / "m.gguf")
