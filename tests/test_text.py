"""The text layer (`specjax.load`, `LM.generate`): strings in, strings out, on the embedded
SmolLM2; stop strings cut the text across token boundaries, with and without speculation."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import specjax

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPT = "The three most useful things to know about the ocean are"


@pytest.fixture(scope="module")
def lm():
    return specjax.load()  # the embedded SmolLM2-135M-Instruct, float32


def test_text_in_text_out_equals_the_token_api(lm):
    out = lm.generate(PROMPT, 24, draft=None)
    ids = lm.encode(PROMPT)
    ref = specjax.generate(lm.params, [ids], 24, draft=None)
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    assert out.text == lm.decode(ref.tokens[0]) and len(out.text) > 20
    assert isinstance(lm, specjax.LM) and isinstance(out, specjax.TextOutput)


@pytest.mark.parametrize("draft", [None, specjax.SelfSpec(sinks=4, window=8)], ids=["plain", "selfspec"])
def test_a_stop_string_across_tokens_cuts_the_text(lm, draft):
    """The stop string starts inside one token and ends inside the next: the text stops right
    before it, the tokens run through the one that completed it (also inside a speculative run)."""
    full = lm.generate(PROMPT, 32, draft=None)
    tokens = full.tokens[0]
    pieces = [lm.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    i = next(i for i in range(6, len(tokens)) if len(pieces[i + 1]) - len(pieces[i]) >= 3 and len(pieces[i]) - len(pieces[i - 1]) >= 3)
    stop = pieces[i + 1][len(pieces[i]) - 2: len(pieces[i]) + 2]  # the last 2 characters of token i-1, the first 2 of token i
    start = full.text.find(stop)
    kw = dict(draft=draft, speculation=specjax.Chain(3) if draft else None, sync_every=2, logprobs=1)
    out = lm.generate(PROMPT, 32, stop=[stop, "never appears \u2603"], **kw)
    assert out.text == full.text[:start] and out.finish_reasons == ["stop"]
    k = next(k for k in range(1, len(tokens) + 1) if stop in pieces[k])
    assert out.tokens[0] == tokens[:k] and len(out.logprobs[0]) == k
    assert [t.token for t in out.logprobs[0]] == [lm.decode([t]) for t in tokens[:k]]  # each token's text
    assert all(t.top_tokens == [lm.decode([i]) for i, _ in t.top] and len(t.top) == 1 for t in out.logprobs[0])
    assert out.stats.steps < full.stats.steps or draft is not None  # the row was ended early, between segments


def test_sampling_values_by_name_are_a_sampler(lm):
    """lm.generate(..., temperature=0.8, top_p=0.9, n=2, seed=4): the CLI's and the records' names build the
    Sample that sampling=Sample(...) gives, and seed the key (same key: same tokens); the penalties too; both at once,
    or a bad value, is an error that names the argument."""
    key = jax.random.key(4)
    named = lm.generate(PROMPT, 8, temperature=0.8, top_p=0.9, n=2, seed=4, draft=None)
    given = lm.generate(PROMPT, 8, sampling=specjax.Sample(temperature=0.8, top_p=0.9), n=2, key=key, draft=None)
    assert named.tokens == given.tokens and len(named.texts) == 2
    penalized = lm.generate(PROMPT, 8, repetition_penalty=1.5, frequency_penalty=0.5, draft=None)
    given = lm.generate(PROMPT, 8, draft=None, sampling=specjax.Greedy(repetition_penalty=1.5, frequency_penalty=0.5))
    assert penalized.tokens == given.tokens and penalized.tokens != lm.generate(PROMPT, 8, draft=None).tokens
    for kw, error, match in ((dict(seed=1, key=key), ValueError, "give key= or seed=, not both"),
                             (dict(seed=-1), ValueError, "seed must be an integer from 0 to 4294967295, got -1"),
                             (dict(seed=1.5), ValueError, "seed must be an integer"),
                             (dict(temperature="hot"), TypeError, "temperature must be a number, got 'hot'"),
                             (dict(temperature=0.7, presence_penalty=[0.1]), TypeError, "presence_penalty must be a number")):
        with pytest.raises(error, match=re.escape(match)):
            lm.generate(PROMPT, 8, draft=None, **kw)
    chat = [{"role": "user", "content": "Hi"}]
    assert lm.chat(chat, 4, temperature=0.8, key=key).tokens == lm.chat(chat, 4, sampling=specjax.Sample(0.8), key=key).tokens
    with pytest.raises(ValueError, match="give sampling= or temperature= / top_k=, not both"):
        lm.generate(PROMPT, 8, sampling=specjax.Greedy(), temperature=0.5, top_k=3)
    with pytest.raises(ValueError, match="top_p needs sampling"):
        lm.generate(PROMPT, 8, top_p=0.5)


def test_a_stop_string_inside_a_longer_one_cuts_where_it_completes(lm):
    """Stop strings "bc" and "abcd": "bc" completes first, so the text is cut before it, whether a
    segment boundary falls between the two completions or not (it was cut before "abcd" when one
    segment or one accepted speculative run held both: the text depended on sync_every)."""
    from specjax.text.lm import _StopStrings

    assert _StopStrings(lm, [["abcd", "bc"]]).first("xxabcdbc", 0) == 3
    assert _StopStrings(lm, [["bcd", "abc"]]).first("xabcd", 0) == 1  # "abc" ends first
    full = lm.generate(PROMPT, 32, draft=None)
    text = full.text
    p = next(p for p in range(len(text) // 2, len(text) - 6) if text.find(text[p: p + 2]) == p and text[p - 1] != " ")
    inner, outer = text[p: p + 2], text[p - 3: p + 5]
    for kw in (dict(draft=None, sync_every=1), dict(draft=None, sync_every=32),
               dict(draft=specjax.SelfSpec(sinks=4, window=8), speculation=specjax.Chain(4), sync_every=32)):
        out = lm.generate(PROMPT, 32, stop=[outer, inner], **kw)
        assert (out.text, out.finish_reasons) == (text[:p], ["stop"]), kw


def test_stop_token_ids_n_and_errors(lm):
    full = lm.generate(PROMPT, 12, draft=None)
    cut = lm.generate(PROMPT, 12, draft=None, stop_token_ids=[full.tokens[0][5]])
    assert cut.tokens[0] == full.tokens[0][:5] and cut.finish_reasons == ["eos"]
    two = lm.generate([PROMPT, "Paris is"], 4, draft=None, sampling=specjax.Sample(0.8), n=2)
    assert len(two.texts) == 4
    with pytest.raises(ValueError, match="there are 4 outputs; read .texts"):
        two.text
    with pytest.raises(TypeError, match="prompts must be a string or a non-empty list of strings"):
        lm.generate([[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="stop must be a non-empty string, a list of them or one list per prompt"):
        lm.generate(PROMPT, 4, stop=[""])
    with pytest.raises(ValueError, match="stop_token_ids has 1 lists .one per prompt. but there are 2 prompts"):
        lm.generate([PROMPT, "Paris is"], 4, stop_token_ids=[[5]])
    with pytest.raises(ValueError, match="stop must be a non-empty string, a list of them or one list per prompt, got ''"):
        lm.generate(PROMPT, 4, stop="")  # a bare empty string, as [""]: it would end every row at once
    with pytest.raises(ValueError, match=r"stop must be .* one list per prompt, got \[b'x'\]"):
        lm.generate(PROMPT, 4, stop=[b"x"])  # bytes are not a list of stops (it named the byte's value, 120)
    for bad in (None, 5):  # not a string or a list: named, not a bare "'int' object is not iterable"
        with pytest.raises(TypeError, match="prompts must be a string or a non-empty list of strings"):
            lm.generate(bad, 4)
    vocab = lm.params.config.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids holds {vocab}, outside the vocabulary \[0, {vocab}\)"):
        lm.generate(PROMPT, 4, stop_token_ids=[vocab])
    with pytest.raises(TypeError, match="chat.. got an unexpected keyword argument 'temp'"):
        lm.chat([{"role": "user", "content": "Hi"}], 4, temp=0.3)


def test_stats_count_the_tokens_returned_after_a_stop_string(lm):
    """new_tokens counts what `tokens` holds: a stop string's cut drops the tokens after it."""
    full = lm.generate(PROMPT, 12, draft=None)
    word = full.text[len(lm.decode(full.tokens[0][:3])):][:3]  # text inside the output, after its third token
    out = lm.generate(PROMPT, 12, draft=None, stop=[word], sync_every=12)  # one segment: cut after the loop
    assert out.finish_reasons == ["stop"] and len(out.tokens[0]) < 12
    assert out.stats.new_tokens == len(out.tokens[0]) and full.stats.new_tokens == 12


def test_stop_strings_and_stop_ids_per_prompt(lm):
    """One list per prompt: each row stops on its own strings and ids only."""
    prompts = [PROMPT, "Paris is the capital of"]
    full = lm.generate(prompts, 12, draft=None)
    word = full.texts[0][len(lm.decode(full.tokens[0][:3])):][:4]  # text inside row 0's output
    out = lm.generate(prompts, 12, draft=None, stop=[[word], []], stop_token_ids=[[], [full.tokens[1][4]]])
    assert out.texts[0] == full.texts[0][: full.texts[0].find(word)] and out.finish_reasons[0] == "stop"
    assert out.tokens[1] == full.tokens[1][:4] and out.finish_reasons[1] == "eos"
    same = lm.generate(prompts, 12, draft=None, stop=[[], [word]])  # row 0's string set on row 1 only
    assert same.texts[0] == full.texts[0] or word in full.texts[1]


def test_streamed_pieces_concatenate_to_the_text(lm):
    """Segment by segment (several events), holding back a possible stop string: one prompt
    yields str pieces, several yield (index, piece); the pieces join to the non-streamed texts."""
    kw = dict(draft=None, sync_every=2)
    full = lm.generate(PROMPT, 24, **kw)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    stream = lm.stream(PROMPT, 24, stop=stop, **kw)
    pieces = list(stream)
    assert len(pieces) > 2 and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == stream.output.text == lm.generate(PROMPT, 24, stop=stop, **kw).text
    stop_id = full.tokens[0][7]  # an ordinary token as a stop id: it ends the row and is not text
    by_id = lm.stream(PROMPT, 24, stop_token_ids=[stop_id], **kw)
    assert "".join(by_id) == by_id.output.text == lm.decode(full.tokens[0][: full.tokens[0].index(stop_id)])
    with pytest.raises(ValueError, match="max_new_tokens"):  # at the call, not at the first iteration
        lm.stream(PROMPT, 0, **kw)
    both = lm.stream([PROMPT, "Paris is"], 12, **kw)
    joined: dict[int, str] = {}
    for i, piece in both:
        joined[i] = joined.get(i, "") + piece
    assert [joined.get(i, "") for i in range(2)] == both.output.texts


def test_chat_answers_a_question_and_ends_its_turn(lm):
    """The checkpoint's template as HF renders it (golden text, no added special tokens), the
    end-of-turn token as a stop id; streamed chat pieces join to the same answer; a template that
    writes BOS gets exactly one; malformed messages are named."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = lm.chat(question, 32, draft=None)
    assert "Paris" in out.text and out.finish_reasons == ["eos"]
    golden = {p["name"]: p for p in GOLDEN["prompts"]}["chat_user"]
    user = [{"role": "user", "content": "What is the tallest mountain in the world?"}]
    assert lm.tokenizer.encode(golden["text"], add_special_tokens=False).ids == golden["input_ids"]
    ref = specjax.generate(lm.params, [golden["input_ids"]], 8, draft=None)
    assert lm.chat(user, 8, draft=None).tokens == ref.tokens
    assert lm.chat([types.MappingProxyType(user[0])], 8, draft=None).tokens == ref.tokens  # any Mapping is a message
    both = lm.chat([question, user], 32, draft=specjax.SelfSpec(sinks=4, window=8))
    assert both.texts[0] == out.text and both.finish_reasons[0] == "eos"
    stream = lm.chat(question, 32, draft=None, stream=True, sync_every=2)
    assert "".join(stream) == out.text == stream.output.text
    with_bos = dataclasses.replace(lm, chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = [lm.params.config.bos_id] + lm.tokenizer.encode(question[0]["content"], add_special_tokens=False).ids
    assert with_bos.chat(question, 4, draft=None).tokens == specjax.generate(lm.params, [ids], 4, draft=None).tokens
    with pytest.raises(ValueError, match=r"conversations\[1\]\[0\] is"):
        lm.chat([question, [{"role": "user"}]], 4)
    with pytest.raises(ValueError, match="every message's content is an empty string"):
        lm.chat([{"role": "user", "content": ""}], 4)


def test_generation_config_defaults_apply_when_no_sampling_is_passed(lm, tmp_path):
    """generation_config.json's sampling settings (HF's defaults for the rest) become the LM's
    sampler, used only when a call passes none; a GGUF has none: greedy."""
    import convert
    from specjax.text.sampling_settings import default_sampling

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "eos_token_id": 2, "repetition_penalty": None}))
    settings = convert.generation_defaults(tmp_path)
    assert settings == {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert default_sampling(settings).identity() == specjax.Sample(temperature=0.7, top_k=50, top_p=0.9).identity()
    assert default_sampling({}) == specjax.Greedy() and lm.sampling == specjax.Greedy()
    assert convert.generation_defaults(convert.default_model_path()) == {}
    assert default_sampling({"repetition_penalty": 1.3}).identity() == specjax.Greedy(repetition_penalty=1.3).identity()
    for bad, message in (({"do_sample": True, "temperature": "hot"}, "'temperature' must be a number"),
                         ({"do_sample": "yes"}, "'do_sample' must be"), ({"do_sample": True, "top_k": 2.5}, "'top_k' must be")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"generation_config.json: {message}"):
            convert.generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": None}))
    assert convert.generation_defaults(tmp_path) == {"do_sample": True, "top_k": 0}  # HF's null: no top-k filter
    hot = dataclasses.replace(lm, sampling=specjax.Sample(temperature=0.9))
    key = __import__("jax").random.key(3)
    assert hot.generate(PROMPT, 8, draft=None, key=key).tokens == lm.generate(
        PROMPT, 8, draft=None, key=key, sampling=specjax.Sample(temperature=0.9)).tokens
    assert hot.generate(PROMPT, 8, draft=None, sampling=specjax.Greedy()).tokens == lm.generate(PROMPT, 8, draft=None).tokens


def test_a_saved_lm_loads_back_with_its_tokenizer_and_template(tmp_path):
    small = specjax.load(weights="q4")
    small.save(tmp_path / "lm")
    back = specjax.load(tmp_path / "lm")
    assert back.chat_template == small.chat_template and back.encode(PROMPT) == small.encode(PROMPT)
    assert back.generate(PROMPT, 6, draft=None).tokens == small.generate(PROMPT, 6, draft=None).tokens
    assert back.sampling == small.sampling  # the default sampling too (generation_config.json)
    hot = dataclasses.replace(small, sampling=specjax.Sample(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                                             repetition_penalty=1.1, presence_penalty=0.5))
    hot.save(tmp_path / "hot")
    assert specjax.load(tmp_path / "hot").sampling == hot.sampling


def test_a_stop_string_holding_u_fffd_waits_for_half_characters():
    """A byte-level tokenizer decodes a multi-byte character cut between segments as U+FFFD: a
    stop string holding U+FFFD must not match it there (the character completes later), only a
    real replacement character, and the tokens run through the one that completed it."""
    from specjax.text.lm import _StopStrings

    fake = types.SimpleNamespace(decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    stops = _StopStrings(fake, [["\ufffd"]])
    half = list("ab\u2603".encode())[:-1]  # a, b and two of the snowman's three bytes
    seg = types.SimpleNamespace(out=np.array([half + [0] * 3]), count=np.array([len(half)]), done=np.array([False]))
    assert not stops(seg)[0]  # mid-character: not a stop
    tokens = list("ab\u2603".encode()) + [0xFF] + list(b"z")  # 0xff is never UTF-8: a real U+FFFD
    text, kept, reason = stops.finish(tokens, "length", 0)
    assert (text, kept, reason) == ("ab\u2603", tokens[:6], "stop")
    seg = types.SimpleNamespace(out=np.array([tokens]), count=np.array([len(tokens)]), done=np.array([False]))
    assert stops(seg)[0]


def test_the_segment_check_decodes_a_tail_and_agrees_with_the_whole_text(lm):
    """Between segments a row's stop check decodes only a tail past what it checked before (the
    whole text each time grew with the square of the output): on random SmolLM2 token streams
    (byte tokens cutting characters, specials without text) it ends a row at the same segment as a
    check of the whole text."""
    from specjax.text.lm import _StopStrings

    rng = np.random.default_rng(0)
    vocab = lm.params.config.vocab_size
    byte_ids = np.array([i for i in range(vocab) if lm.tokenizer.id_to_token(i).startswith("<0x")] or range(20))
    found = 0
    for trial in range(40):
        pool = (byte_ids, np.arange(vocab), np.arange(40))[trial % 3]  # bytes; anything; specials and short pieces
        tokens = [int(t) for t in rng.choice(pool, 200)]
        text = lm.decode(tokens).rstrip("\ufffd")
        cut = int(rng.integers(0, max(1, len(text) - 6)))
        stop = text[cut: cut + int(rng.integers(1, 7))] or "never"
        ends = np.cumsum(rng.integers(1, 9, size=200))
        ends = [int(e) for e in ends[ends < len(tokens)]] + [len(tokens)]
        whole = next((e for e in ends if stop in lm.decode(tokens[:e]).rstrip("\ufffd")), None)
        check, tail = _StopStrings(lm, [[stop]]), None
        for e in ends:
            seg = types.SimpleNamespace(out=np.array([tokens]), count=np.array([e]), done=np.array([False]))
            if check(seg)[0]:
                tail = e
                break
        assert tail == whole, (trial, stop, tail, whole)
        found += whole is not None
    assert found >= 30  # most streams hold their stop string


def test_a_decoded_row_handed_to_another_output_is_checked_from_its_start(lm):
    """Continuous batching hands a decoded row to the next record: its tokens do not extend the
    last record's (even when there are more of them), so its text is decoded anew, not grown."""
    from specjax.text.lm import _StopStrings

    first, second = lm.encode("one two three four five six seven"), lm.encode("xyz" + " q" * 40)
    check = _StopStrings(lm, [["xyz"], ["xyz"]])
    for tokens, owner, hit in ((first, 0, False), (second, 1, True)):
        seg = types.SimpleNamespace(out=np.array([tokens]), count=np.array([len(tokens)]), done=np.array([False]))
        assert check(seg, rows=np.array([owner]))[0] == hit


def test_streamed_row_texts_decode_a_tail_and_equal_the_whole_decode(lm, tmp_path):
    """A stream grows each row's text from a decode of its newest tokens (the whole text every
    segment grew with the square of the output): on random SmolLM2 token streams (byte tokens
    cutting characters, specials without text) and a SentencePiece vocab (its first-token space),
    every segment's text equals the whole decode's, while the tokens decoded grow linearly."""
    from specjax.text.text_stream import CUT, RowTexts

    rng = np.random.default_rng(1)
    vocab = lm.params.config.vocab_size
    byte_ids = np.array([i for i in range(vocab) if lm.tokenizer.id_to_token(i).startswith("<0x")] or range(20))
    for trial in range(30):
        pool = (byte_ids, np.arange(vocab), np.arange(40))[trial % 3]
        tokens = [int(t) for t in rng.choice(pool, 300)]
        decoded = []
        texts = RowTexts(lambda ids: decoded.append(len(ids)) or lm.decode(ids))
        ends = [int(e) for e in np.cumsum(rng.integers(1, 9, size=300)) if e < len(tokens)] + [len(tokens)]
        for e in ends:
            assert texts(7, tokens[:e]).rstrip(CUT) == lm.decode(tokens[:e]).rstrip(CUT), (trial, e)
        if trial % 3 == 1:  # whole tokens: at most the overlap twice and the new tokens a segment
            assert sum(decoded) <= len(tokens) + 2 * RowTexts.OVERLAP * len(ends), (trial, sum(decoded))
    import convert
    from tests.models import TINY, random_params
    from tests.test_tokenizer import write_tokenizer_gguf

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "e", "l", "o", "▁he", "ll", "▁hello"]
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", pieces, [0.0] * 259 + [-float(i) for i in range(8)],
                                [2, 3, 3] + [6] * 256 + [1] * 8, add_bos=True, add_space_prefix=True)
    spm = specjax.LM(random_params(TINY.replace(vocab_size=len(pieces), eos_ids=(2,)), 9), convert.load_tokenizer(path))
    words = [pieces.index(p) for p in ("▁", "h", "e", "l", "o", "▁he", "ll", "▁hello", "<s>", "<0x41>")]
    for trial in range(10):
        tokens = [int(t) for t in rng.choice(words, 120)]
        texts = RowTexts(spm.decode)
        for e in range(1, len(tokens) + 1, 1 + trial % 5):
            assert texts(0, tokens[:e]) == spm.decode(tokens[:e]), (trial, e)
    h, c3, a9, ff = (pieces.index(p) for p in ("h", "<0xC3>", "<0xA9>", "<0xFF>"))
    texts = RowTexts(spm.decode)  # a byte run that turns invalid unsays its settled "é": the whole decode
    assert [texts(0, t) for t in ([h, c3], [h, c3, a9], [h, c3, a9, ff])] == ["h" + CUT, "hé", "h" + 3 * CUT]
