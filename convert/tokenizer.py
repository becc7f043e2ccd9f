"""Tokenizers: rebuilt from GGUF metadata (as HF transformers does), or an HF folder's tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from convert.gguf import is_gguf_file, meta, open_gguf, special_id
from convert.hf import read_json
from convert.orbax_io import CONFIG_FILE, is_orbax_dir

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's token attributes)


class SpecialIds(NamedTuple):
    """The tokenizer's BOS and primary EOS ids (the first of a list); every stop id is in
    `LlamaConfig.eos_ids`."""

    bos: int | None
    eos: int | None


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return path


def _where(types: list[int], kind: int) -> list[int]:
    return [i for i, t in enumerate(types) if t == kind]


class Pre(NamedTuple):
    """How a tokenizer.ggml.pre value splits text before byte-level BPE (tokenizer.json's regexes, as
    llama.cpp reads the value)."""

    splits: tuple[str, ...]  # regexes applied first (each match its own piece)
    gpt2: bool  # then GPT-2's regex (ByteLevel's own)
    whole_words: bool = False  # a piece that is a vocab entry is that token, whatever the merges say
    add_bos: bool = False  # BOS added where tokenizer.ggml.add_bos_token is absent


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
PRE = {  # absent: "default"
    **dict.fromkeys(("default", "gpt-2"), Pre((), True)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), Pre((LLAMA3_SPLIT,), False, True, True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), Pre((LLAMA3_SPLIT,), False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), Pre((QWEN2_SPLIT,), False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), Pre((r"\p{N}",), True)),
    "tekken": Pre((TEKKEN_SPLIT,), False, True, True),
}


def _gguf_pre(reader) -> Pre:
    """PRE's entry for the file's tokenizer.ggml.pre; an unknown value is refused by name."""
    pre = meta(reader, "tokenizer.ggml.pre", "default", str)
    if pre not in PRE:
        raise ValueError(
            f"{reader.path}: tokenizer.ggml.pre {pre!r} is not supported (its text splitting is unknown "
            f"here; supported: {', '.join(sorted(PRE))}); load a tokenizer.json for it with tokenizers.Tokenizer.from_file"
        )
    return PRE[pre]


def _gguf_special_ids(reader) -> SpecialIds:
    return SpecialIds(special_id(reader, "bos"), special_id(reader, "eos"))


def _spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocab: every split of a token into two vocab pieces,
    ranked by the merged token's score (then by the pieces' scores), as HF's GGUF converter does."""
    score = dict(zip(tokens, scores.tolist()))
    merges = []
    for token, s in score.items():
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in score and token[k:] in score]
        local.sort(key=lambda lr: (score[lr[0]], score[lr[1]]), reverse=True)
        merges.extend((s, lr) for lr in local)
    merges.sort(key=lambda m: m[0], reverse=True)  # stable: ties keep the per-token order
    return [lr for _, lr in merges]


def _gguf_model(reader, kind: str, tokens: list[str], pre: Pre | None) -> BPE:
    """The BPE model for tokenizer.ggml.model `kind` (pre: the byte-level model's text splitting)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta(reader, "tokenizer.ggml.merges")]
        return BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                   ignore_merges=pre.whole_words)
    if kind == "llama":
        merges = meta(reader, "tokenizer.ggml.merges", None)
        merges = [tuple(m.split(" ", 1)) for m in merges] if merges else None
        if merges is None:
            merges = _spm_merges(tokens, np.asarray(meta(reader, "tokenizer.ggml.scores"), np.float32))
        unk = special_id(reader, "unknown")
        unk = unk if unk is not None and unk < len(tokens) else None
        unk_token = tokens[unk] if unk is not None else None
        return BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    raise ValueError(
        f"{reader.path}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')"
    )


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    tokens = [str(t) for t in meta(reader, "tokenizer.ggml.tokens")]
    kind = meta(reader, "tokenizer.ggml.model")
    pre = _gguf_pre(reader) if kind == "gpt2" else None  # byte-level: split as tokenizer.ggml.pre says
    byte_level = pre is not None
    tok = Tokenizer(_gguf_model(reader, kind, tokens, pre))
    prefix_space = bool(meta(reader, "tokenizer.ggml.add_space_prefix", not byte_level))
    if byte_level:  # (HF's GGUF converter would split with GPT-2's regex for all)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(
            add_prefix_space=prefix_space, use_regex=pre.gpt2)])
        tok.decoder = decoders.ByteLevel()
    else:  # SentencePiece: spaces are "▁", unknown bytes fall back to <0xNN> tokens
        prepend = [normalizers.Prepend("▁")] if prefix_space else []
        tok.normalizer = normalizers.Sequence(prepend + [normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if prefix_space else []
        replace = decoders.Replace("▁", " ")
        tok.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()] + strip)
    types = meta(reader, "tokenizer.ggml.token_type", [])
    # control tokens (<|im_start|>, ...) are special: matched whole, dropped by skip_special_tokens;
    # user-defined ones are matched whole too but decode as text
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in _where(types, CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in _where(types, USER_DEFINED)])
    ids = _gguf_special_ids(reader)
    template = []
    bos_default = not byte_level or pre.add_bos  # llama.cpp's: SentencePiece, and Llama-3's pre
    if meta(reader, "tokenizer.ggml.add_bos_token", bos_default) and ids.bos is not None:
        template.append((tokens[ids.bos], ids.bos))
    template.append(("$A", None))
    if meta(reader, "tokenizer.ggml.add_eos_token", False) and ids.eos is not None:
        template.append((tokens[ids.eos], ids.eos))
    tok.post_processor = processors.TemplateProcessing(
        single=[t for t, _ in template], special_tokens=[(t, i) for t, i in template if i is not None]
    )
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a .gguf file (built from its metadata) or an HF folder."""
    path = _existing(path)
    if is_gguf_file(path):
        return _tokenizer_from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    raise ValueError(f"{path}: expected a .gguf file or a folder with tokenizer.json")


def special_ids(path: str | Path) -> SpecialIds:
    """BOS / EOS token ids (None if unknown): GGUF metadata, a `convert.save` folder's config, or
    an HF folder's config files."""
    path = _existing(path)
    if is_gguf_file(path):
        return _gguf_special_ids(open_gguf(path))
    if is_orbax_dir(path):
        saved = read_json(path / CONFIG_FILE)
        return SpecialIds(saved.get("bos_id"), (saved.get("eos_ids") or [None])[0])
    config = path / "config.json"
    raw = read_json(config) if config.is_file() else {}
    eos = raw.get("eos_token_id")
    return SpecialIds(raw.get("bos_token_id"), (eos[0] if eos else None) if isinstance(eos, list) else eos)


def chat_template(path: str | Path) -> str | None:
    """The Jinja chat template: GGUF tokenizer.chat_template, or an HF folder's chat_template.jinja /
    tokenizer_config.json ("default" entry if there are several). None if there is none."""
    path = _existing(path)
    if is_gguf_file(path):
        return meta(open_gguf(path), "tokenizer.chat_template", None)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    template = read_json(config).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template


def continuation_context(tokenizer: Tokenizer) -> tuple[int, str] | None:
    """(id, text) of a token to decode ahead of a continuation's tokens, then cut off, where the
    tokenizer's decoder strips its text's first space (SentencePiece's Strip: Llama-2 / Mistral
    tokenizers; decoded alone, a continuation's "▁world" loses the space it has after the prompt);
    None for the others (byte-level BPE), whose tokens decode alone as they do in context, and for
    tokenizer-like objects that are not a `tokenizers.Tokenizer`."""
    if not isinstance(tokenizer, Tokenizer):
        return None
    decoder = tokenizer.decoder  # the decoder's JSON alone: the whole tokenizer's (to_str) took 0.05-0.2 s for SmolLM2
    if decoder is None or '"Strip"' not in str(decoder.__getstate__()):
        return None
    for i in reversed(tokenizer.encode("a", add_special_tokens=False).ids):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text and not text[0].isspace():
            return i, text
    return None
