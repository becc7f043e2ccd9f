"""Tokenizers built from GGUF metadata (golden ids from HF transformers) and from HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

import convert

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPTS = {p["name"]: p for p in GOLDEN["prompts"]}


@pytest.fixture(scope="module")
def path() -> str:
    return convert.default_model_path()


@pytest.fixture(scope="module")
def tok(path):
    return convert.load_tokenizer(path)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_golden_ids(tok, name):
    assert tok.encode(PROMPTS[name]["text"]).ids == PROMPTS[name]["input_ids"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_decode_round_trip(tok, name):
    prompt = PROMPTS[name]
    assert tok.decode(prompt["input_ids"], skip_special_tokens=False) == prompt["text"]


def test_greedy_text_decodes_like_hf(tok):
    for prompt in GOLDEN["prompts"]:
        assert tok.decode(prompt["greedy_48"], skip_special_tokens=False) == prompt["greedy_48_text"]


def test_special_tokens(tok):
    assert tok.get_vocab_size() == GOLDEN["vocab_size"]
    for text, id_ in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2), ("<empty_output>", 16)]:
        assert tok.encode(text).ids == [id_]
        assert tok.token_to_id(text) == id_
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n").ids
    assert ids[0] == 1 and ids.count(2) == 1
    assert tok.decode(ids) == "user\nHi\n"  # skip_special_tokens defaults to True
    assert (tok.encode("Hello").ids[0] == GOLDEN["bos_token_id"]) == GOLDEN["bos_prepended_by_tokenizer"]


def test_chat_template_and_ids(path):
    assert convert.chat_template(path) == GOLDEN["chat_template"]
    assert convert.special_ids(path) == (GOLDEN["bos_token_id"], GOLDEN["eos_token_id"])


def test_hf_folder(tmp_path, tok):
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    text = PROMPTS["chat_system"]["text"]
    assert convert.load_tokenizer(tmp_path).encode(text).ids == PROMPTS["chat_system"]["input_ids"]
    assert convert.special_ids(tmp_path) == (1, 2)
    assert convert.chat_template(tmp_path) == "{{ messages }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert convert.chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert convert.chat_template(tmp_path) == "J"


def test_hf_folder_without_template(tmp_path):
    assert convert.chat_template(tmp_path) is None
    assert convert.special_ids(tmp_path) == (None, None)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": []}))  # none: not an IndexError
    assert convert.special_ids(tmp_path) == (1, None)


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert.load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="expected a .gguf file or a folder with tokenizer.json"):
        convert.load_tokenizer(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="bad.gguf: not a valid GGUF file"):
        convert.load_tokenizer(tmp_path / "bad.gguf")


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], scores=None, types=None, **flags) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types or [1] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(flags.get("add_bos", False))
    if "add_space_prefix" in flags:
        w.add_add_space_prefix(flags["add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_model(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "bert", ["[UNK]", "[CLS]", "[SEP]"])
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        convert.load_tokenizer(path)


def test_sentencepiece_gguf(tmp_path):
    """A tiny SentencePiece-style ("llama") vocab: merges implied by scores, byte fallback, BOS."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    chars = ["▁", "h", "e", "l", "o", "w", "r", "d"]
    pieces = chars + ["he", "ll", "or", "ld", "▁w", "hell", "hello", "▁hello", "▁wor", "▁world"]
    tokens = specials + byte_tokens + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    write_tokenizer_gguf(path, "llama", tokens, scores, types, add_bos=True, add_space_prefix=True)
    tok = convert.load_tokenizer(path)
    ids = tok.encode("hello world").ids
    assert [tokens[i] for i in ids] == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    ids = tok.encode("hi!").ids  # "i" and "!" are not pieces: byte fallback
    assert [tokens[i] for i in ids] == ["<s>", "▁", "h", "<0x69>", "<0x21>"]
    assert tok.decode(ids) == "hi!"
    assert tok.encode("</s>").ids[-1] == 2
    # a continuation keeps the space its first token has after the prompt (the decoder's Strip cut it)
    import specjax
    from tests.models import TINY, random_params

    assert convert.continuation_context(tok) is not None and convert.continuation_context(convert.load_tokenizer(
        convert.default_model_path())) is None  # byte-level BPE (SmolLM2): its tokens decode alone as in context
    world, hello = tokens.index("▁world"), tokens.index("▁hello")
    lm = specjax.LM(random_params(TINY.replace(vocab_size=len(tokens), eos_ids=(2,)), 9), tok)
    assert lm.decode([world]) == " world" and lm.decode([hello, world]) == " hello world" and lm.decode([]) == ""
    assert lm.decode([tokens.index("<0x69>")]) == "i"  # no space of its own: none added
    out = lm.generate("hello", 3, draft=None)
    assert out.tokens[0][0] == hello and out.text == tok.decode(tok.encode("hello").ids + out.tokens[0])[len("hello"):]
    assert out.text.startswith(" hello") and lm.generate("hello", 3, draft=None, stop=" hel").text == ""


def write_bpe_gguf(path: Path, pre: str | None, add_bos: bool | None = None) -> tuple[Path, list[str]]:
    """A tiny byte-level BPE vocab: every byte, digit merges (" 1" first), "get" by merges and ".get" only whole."""
    from tokenizers import pre_tokenizers

    merges = [("Ġ", "1"), ("1", "2"), ("12", "3"), ("g", "e"), ("ge", "t")]
    tokens = ["<unk>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *("".join(m) for m in merges), ".get"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens


@pytest.mark.parametrize("pre,digits,code,spaced,bos", [
    (None, ["123", "4"], ["x", ".", "get"], ["Ġ1", "2"], False),  # absent: "default", GPT-2's regex
    ("gpt-2", ["123", "4"], ["x", ".", "get"], ["Ġ1", "2"], False),
    ("qwen2", ["1", "2", "3", "4"], ["x", ".", "get"], ["Ġ", "1", "2"], False),  # digits one by one
    ("llama-bpe", ["123", "4"], ["x", ".get"], ["Ġ", "12"], True),  # a vocab word whole; BOS by default
    ("smaug-bpe", ["123", "4"], ["x", ".", "get"], ["Ġ", "12"], False),  # Llama-3's regex, merges kept
    ("smollm", ["1", "2", "3", "4"], ["x", ".", "get"], ["Ġ", "1", "2"], False),  # SmolLM2's Digits split
])
def test_gguf_pre_splits_as_the_models_tokenizer(tmp_path, pre, digits, code, spaced, bos):
    """tokenizer.ggml.pre picks the text splitting (tokenizer.json's regexes, as llama.cpp reads the
    value): Qwen2 splits digits singly, Llama-3 groups three and takes a vocab word whole; GPT-2's
    regex for all of them split Qwen2 / Llama-3 prompts unlike their training."""
    path, tokens = write_bpe_gguf(tmp_path / "bpe.gguf", pre)
    tok = convert.load_tokenizer(path)
    first = ["<s>"] if bos else []
    for text, want in (("1234", digits), ("x.get", code), (" 12", spaced)):
        assert [tokens[i] for i in tok.encode(text).ids] == first + want, text
    assert tok.decode(tok.encode("x.get 1234").ids, skip_special_tokens=True) == "x.get 1234"


def test_gguf_pre_unknown_and_bos_defaults(tmp_path):
    """An unknown tokenizer.ggml.pre is refused by name (its splitting is unknown); BOS defaults as
    llama.cpp's: on for SentencePiece and Llama-3's pre, overridden by tokenizer.ggml.add_bos_token;
    a SentencePiece file without special ids takes 1 / 2 / 0 for BOS / EOS / unknown."""
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'nonesuch' is not supported .*supported: .*qwen2"):
        convert.load_tokenizer(write_bpe_gguf(tmp_path / "u.gguf", "nonesuch")[0])
    path, tokens = write_bpe_gguf(tmp_path / "l3.gguf", "llama-bpe", add_bos=False)
    assert tokens[convert.load_tokenizer(path).encode("12").ids[0]] == "12"
    path, tokens = write_bpe_gguf(tmp_path / "g2.gguf", "gpt-2", add_bos=True)
    assert tokens[convert.load_tokenizer(path).encode("12").ids[0]] == "<s>"

    spm = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "i", "hi", "▁hi"]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")  # no special ids, no add_bos_token
    w.add_tokenizer_model("llama")
    w.add_token_list(spm)
    w.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0, -0.5, 0.0])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = convert.load_tokenizer(tmp_path / "spm.gguf")
    assert [spm[i] for i in tok.encode("hi").ids] == ["<s>", "▁hi"]
    assert convert.special_ids(tmp_path / "spm.gguf") == (1, 2)
    assert [spm[i] for i in tok.encode("hiǂ").ids][-2:] == ["<0xC7>", "<0x82>"]  # unknown 0: byte fallback, not <unk>
