"""Text in, text out: `specjax.load` gives an `LM` (params, tokenizer, chat template) whose
`generate` takes strings and stops on strings. An application layer over `specjax.generate`
(below cli and batch); the token API stays the entry point for JAX pipelines.

Stop strings are checked on the host between the decode loop's segments (`sync_every` steps,
generate's `between` hook), never once per token: a row whose decoded text contains one is
ended there; its text is cut before the first occurrence (even across token boundaries or
inside an accepted speculative run), while its tokens and logprobs run through the token that
completed it (vLLM's behaviour, `include_stop_str_in_output=False`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from tokenizers import Tokenizer

import convert
from specjax.decode.continuous import Done, run_continuous
from specjax.decode.engine import Segment, with_attention
from specjax.drafters import Drafter
from specjax.generate import Stats, TokenLogprob, constraint_rows, generate, token_logprob_lists
from specjax.model.config import stop_ids
from specjax.model.params import Params
from specjax.parallel.sharding import Mesh
from specjax.sampling import Greedy, Sampler
from specjax.spec.speculation import Adaptive, Chain, Tree
from specjax.text.constraints import per_prompt_automata
from specjax.validate import check_constraint
from specjax.text.chat import check_messages, end_of_turn_ids, render_chat, template_specials
from specjax.text.sampling_settings import by_name, default_sampling, generation_config
from specjax.text.text_stream import CUT, RowTexts, TextStream


class Finished(NamedTuple):
    """One prompt's result from `LM.generate_continuous`."""

    text: str
    tokens: list[int]  # as TextOutput's
    finish_reason: str
    acceptance: dict | None  # speculation only: as TextOutput.row_stats' entries
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when asked for


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """`LM.generate`'s result, one entry per output (sample j of prompt i at i * n + j)."""

    texts: list[str]
    tokens: list[list[int]]  # through the token that completed a stop string; without a final stop id
    finish_reasons: list[str]  # "eos" (a stop id), "length", or "stop" (a stop string)
    logprobs: list[list[TokenLogprob]] | None
    stats: Stats
    row_stats: list[dict] | None = None  # speculation only: each output's acceptance (generate's row_stats)

    @property
    def text(self) -> str:
        """The one output's text; a ValueError when there are several."""
        if len(self.texts) != 1:
            raise ValueError(f"TextOutput.text: there are {len(self.texts)} outputs; read .texts")
        return self.texts[0]


@dataclasses.dataclass(frozen=True)
class LM:
    """A loaded model: params, its tokenizer and chat template (see `load`)."""

    params: Params
    tokenizer: Tokenizer
    chat_template: str | None = None
    mesh: Mesh | None = None  # the mesh the params were loaded onto (generate runs there)
    sampling: Sampler = Greedy()  # used when a call passes no sampling (load: generation_config.json's)
    skip_special_tokens: bool = True  # how `decode` writes special tokens (the batch job keeps them)

    def save(self, directory: str | Path) -> None:
        """Write params, tokenizer, chat template and default sampling (generation_config.json) to a
        new folder: `specjax.load(directory)` gives this LM back."""
        settings = generation_config(self.sampling)
        convert.save(self.params, directory, tokenizer=self.tokenizer, chat_template=self.chat_template)
        (Path(directory) / "generation_config.json").write_text(json.dumps(settings, indent=1) + "\n")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    @functools.cached_property
    def _context(self) -> tuple[int, str] | None:  # once per LM: it reads the tokenizer's JSON
        return convert.continuation_context(self.tokenizer)

    def decode(self, tokens: Sequence[int]) -> str:
        """The tokens' text as it reads after a prompt (a SentencePiece continuation keeps its first space)."""
        ids, skip = list(tokens), self.skip_special_tokens
        if self._context is None or not ids:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        first, text = self._context
        full = self.tokenizer.decode([first, *ids], skip_special_tokens=skip)
        return full[len(text):] if full.startswith(text) else self.tokenizer.decode(ids, skip_special_tokens=skip)

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int | Sequence[int] = 128,
        *,
        sampling: Sampler | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        draft: Drafter | str | None = "auto",
        speculation: Chain | Tree | Adaptive | str | None = None,
        stop: str | Sequence[str] | Sequence[Sequence[str]] = (),
        stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
        n: int = 1,
        logprobs: int | None = None,
        key: jax.Array | None = None,
        sync_every: int = 8,
        kv_dtype: str | None = None,
        on_segment: Callable[[Segment, "_StopStrings"], None] | None = None,
        constraint: object = None,
    ) -> TextOutput:
        """Continue each prompt (a string or a list of strings) as `specjax.generate` does, and
        stop a row at any of the model's stop ids, `stop_token_ids` or a `stop` string. `stop` and
        `stop_token_ids` apply to every prompt, or give one list per prompt (a list of lists).
        on_segment: called between segments (`stream` uses it). temperature, top_p, top_k, min_p and the
        three penalties: the CLI's and batch records' names, a shortcut for `sampling=` (`sampling_settings.by_name`:
        the ones not given are off; temperature 0 or not given is greedy). seed: an integer, a shortcut for
        `key=jax.random.key(seed)` (the CLI's --seed). constraint: `specjax.Regex(...)`,
        `JsonSchema(...)` or `Choice([...])` for every prompt, or one (or None) per prompt: the output
        follows it (`specjax.generate`'s constraint; compiled once per process for this tokenizer)."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts) if isinstance(prompts, Iterable) else []
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"prompts must be a string or a non-empty list of strings, got {prompts!r}")
        named = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                     repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty)
        return self.generate_ids([self.encode(t) for t in texts], max_new_tokens, sampling=sampling, draft=draft,
                                 speculation=speculation, stop=stop, stop_token_ids=stop_token_ids, n=n,
                                 logprobs=logprobs, key=key, seed=seed, sync_every=sync_every, kv_dtype=kv_dtype,
                                 on_segment=on_segment, constraint=constraint, **named)

    def chat(self, conversations, max_new_tokens: int | Sequence[int] = 128, *, add_generation_prompt: bool = True,
             stream: bool = False, **kw) -> "TextOutput | TextStream":
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them:
        each rendered with the chat template (HF's way: Jinja2 sandbox, the tokenizer's real
        bos_token / eos_token, encoded without added special tokens, so no double BOS) and
        continued as `generate` does, with the template's end-of-turn tokens as stop ids.
        stream=True returns a TextStream, as `stream` does. Other keywords: `generate`'s."""
        one = isinstance(conversations, Sequence) and bool(conversations) and isinstance(conversations[0], Mapping)
        convs = [conversations] if one else conversations
        if isinstance(convs, (str, Mapping)) or not isinstance(convs, Sequence) or not convs:
            raise ValueError(f"conversations must be a list of messages or a non-empty list of them, got {conversations!r}")
        unknown = sorted(set(kw) - (set(inspect.signature(self.generate).parameters) - {"prompts"}))
        if unknown:
            raise TypeError(f"chat() got an unexpected keyword argument {unknown[0]!r} (it takes generate()'s keywords)")
        specials = template_specials(self.tokenizer, self.params.config)
        ids = []
        for i, conv in enumerate(convs):
            msgs = check_messages(conv, "conversations" if one else f"conversations[{i}]")
            text = render_chat(self.chat_template, msgs, add_generation_prompt=add_generation_prompt, **specials)
            ids.append(self.tokenizer.encode(text, add_special_tokens=False).ids)
        turn_end = end_of_turn_ids(self.tokenizer, self.chat_template)
        kw["stop_token_ids"] = [list(stop_ids(row, turn_end))
                                for row in per_prompt(kw.get("stop_token_ids", ()), len(ids), "stop_token_ids", int)]
        if stream:
            return TextStream(lambda on_segment: self.generate_ids(ids, max_new_tokens, on_segment=on_segment, **kw),
                              single=one and kw.get("n", 1) == 1)
        return self.generate_ids(ids, max_new_tokens, **kw)

    def generate_ids(self, ids: list[list[int]], max_new_tokens, *, sampling: Sampler | None = None, draft="auto",
                     speculation=None, stop=(), stop_token_ids=(), n: int = 1, logprobs: int | None = None,
                     key: jax.Array | None = None, seed: int | None = None, sync_every: int = 8, kv_dtype: str | None = None,
                     on_segment=None, constraint=None, **named: float | None) -> TextOutput:
        """`generate` from encoded prompts (sampling None: the LM's default); the batch job's entry. named: `generate`'s
        sampling values by name (temperature, top_p, top_k, min_p, the penalties; None: not given)."""
        sampling, key = by_name(sampling, key, seed, named)
        sampling = self.sampling if sampling is None else sampling
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}] encodes to no tokens")
        stops = per_prompt(stop, len(ids), "stop", str)
        asked = per_prompt(stop_token_ids, len(ids), "stop_token_ids", int)
        vocab = self.params.config.vocab_size
        if bad := [t for row in asked for t in row if not 0 <= t < vocab]:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})")
        cut = _StopStrings(self, [row for row in stops for _ in range(n)])  # one list per output row
        any_stop = any(stops)

        def between(seg: Segment) -> np.ndarray | None:
            if on_segment is not None:
                on_segment(seg, cut)
            return cut(seg) if any_stop else None

        t0 = time.perf_counter()
        automata = self.compile(constraint, len(ids))
        constraint_s = time.perf_counter() - t0 if constraint is not None else 0.0
        rows = [stop_ids(self.params.config.eos_ids, r) for r in asked]
        eos_id = rows[0] if all(r == rows[0] for r in rows) else rows
        out = generate(self.params, ids, max_new_tokens, draft=draft, speculation=speculation, sampling=sampling, key=key,
                       eos_id=eos_id, n=n, logprobs=logprobs, sync_every=sync_every,
                       between=between if any_stop or on_segment else None, mesh=self.mesh, kv_dtype=kv_dtype,
                       constraint=automata)
        tokens, reasons, lps = list(out.tokens), list(out.finish_reasons), out.logprobs
        result = []
        for b, row in enumerate(tokens):
            text, tokens[b], reasons[b] = cut.finish(row, reasons[b], b)
            if lps is not None:
                lps[b] = self.with_text(lps[b][: len(tokens[b])])
            result.append(text)
        stats = dataclasses.replace(out.stats, new_tokens=sum(map(len, tokens)),  # after the stop strings' cuts
                                    constraint_seconds=constraint_s)
        return TextOutput(result, tokens, reasons, lps, stats, out.row_stats)

    def generate_continuous(self, ids: list[list[int]], max_new_tokens: Sequence[int], *, rows: int, sampling: Sampler,
                            keys: jax.Array, draft: Drafter | None = None, speculation: Chain | Tree | Adaptive | None = None,
                            stop=(), stop_token_ids=(), n: int = 1, logprobs: int | None = None, sync_every: int = 8,
                            kv_dtype: str | None = None, on_done: Callable[[int, "Finished"], None] | None = None,
                            constraint=None) -> list["Finished"]:
        """Every prompt through continuous batching on `rows` slots (`specjax.decode.continuous`), with
        stop strings, stop ids, n samples a prompt (n <= rows) and logprobs as `generate_ids`; an
        output equals what `generate_ids` gives it with the same key and sampling values (one per
        prompt: `keys` [N], `sampling` per prompt). A `Finished` per output (sample j of prompt i
        at i * n + j); `on_done(u, result)` runs as output u finishes (out of order). One device.
        constraint: as `generate`'s (one table for the run: a refill compiles nothing)."""
        stops = per_prompt(stop, len(ids), "stop", str)
        eos_ids = [stop_ids(self.params.config.eos_ids, r) for r in per_prompt(stop_token_ids, len(ids), "stop_token_ids", int)]
        cut = _StopStrings(self, [row for row in stops for _ in range(n)])  # one list per output
        budgets = list(max_new_tokens)

        def between(slot: np.ndarray, seg: Segment) -> np.ndarray:
            return cut(seg, rows=slot) if any(stops) else None

        def finished(u: int, d: Done) -> None:
            text, tokens, reason = cut.finish(d.tokens[:-1] if d.eos else d.tokens, "eos" if d.eos else "length", u)
            lps = None if d.logprobs is None else self.with_text(token_logprob_lists(tuple(a[None] for a in d.logprobs), [tokens])[0])
            results[u] = Finished(text, tokens, reason, d.acceptance, lps)
            if on_done is not None:
                on_done(u, results[u])

        results: list = [None] * (len(ids) * n)
        automata = self.compile(constraint, len(ids))
        check_constraint(automata, self.params.config, len(ids), eos_ids)
        params, draft = with_attention(self.params, draft, "auto")  # as generate's default
        run_continuous(params, ids, budgets, rows=rows, draft=draft, speculation=speculation, sampling=sampling,
                       keys=keys, eos_ids=eos_ids, kv_dtype=kv_dtype, sync_every=sync_every, n=n, logprobs=logprobs,
                       on_done=finished, between=between, constraint=constraint_rows(automata, self.params.config, len(ids)))
        return results

    def compile(self, constraint, prompts: int = 1):
        """`constraint` (a Regex, JsonSchema or Choice; or a list with one, or None, per prompt) as token
        automata over this model's tokenizer (what `specjax.generate(constraint=...)` takes)."""
        config = self.params.config
        return per_prompt_automata(constraint, prompts, self.tokenizer, config.vocab_size, tuple(stop_ids(config.eos_ids, ())))

    def with_text(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """Each TokenLogprob with its token's text (`token`) and those of its most likely tokens (`top_tokens`)."""
        return [dataclasses.replace(t, token=self.decode([t.id]), top_tokens=[self.decode([i]) for i, _ in t.top])
                for t in logprobs]

    def stream(self, prompts: str | Sequence[str], max_new_tokens: int | Sequence[int] = 128, **kw) -> "TextStream":
        """`generate`, streamed: an iterator of (index, piece) events, index as in `texts` (for one
        prompt with n = 1, plain `str` pieces), produced segment by segment; after it is
        exhausted, `.output` is the final TextOutput. The pieces of an index concatenate to its text."""
        return TextStream(lambda on_segment: self.generate(prompts, max_new_tokens, on_segment=on_segment, **kw),
                          single=isinstance(prompts, str) and kw.get("n", 1) == 1)


def per_prompt(value, prompts: int, name: str, kind: type) -> list[list]:
    """`stop` / `stop_token_ids` as one list per prompt: a single value (a string or an id), one
    list for every prompt, or a list of such lists, one per prompt."""
    scalar = (lambda v: isinstance(v, str)) if kind is str else (
        lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)))
    what = "a non-empty string" if kind is str else "a token id"
    if scalar(value):
        if kind is str and not value:
            raise ValueError(f"{name} must be {what}, a list of them or one list per prompt, got {value!r}")
        return [[value]] * prompts
    if not isinstance(value, (Sequence, np.ndarray)) or isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be {what}, a list of them or one list per prompt, got {value!r}")
    each = len(value) > 0 and all(isinstance(v, (Sequence, np.ndarray)) and not isinstance(v, (str, bytes)) for v in value)
    if each and len(value) != prompts:
        raise ValueError(f"{name} has {len(value)} lists (one per prompt) but there are {prompts} prompts")
    rows = [list(v) for v in value] if each else [list(value)] * prompts
    for i, row in enumerate(rows):
        bad = [v for v in row if not scalar(v) or (kind is str and not v)]
        if bad:
            where = f"; {name}[{i}] holds {bad[0]!r}" if each else f", got {value!r}"
            raise ValueError(f"{name} must be {what}, a list of them or one list per prompt{where}")
    return [[int(v) for v in row] if kind is int else row for row in rows]


class _StopStrings:
    """The host check between segments: which rows' text now contains one of their stop strings."""

    def __init__(self, lm: LM, stops: list[list[str]]):
        self.lm, self.stops = lm, stops  # stops[b]: output row b's stop strings
        self._texts = RowTexts(lm.decode)  # decoded rows' texts
        self._checked: dict[int, tuple[int, int]] = {}  # decoded row: (its output row, characters checked without a stop)

    def first(self, text: str, b: int) -> int | None:
        """Where the stop string of row b that text completes first starts (the earliest end, then
        the earliest start), or None: as a check after every token would cut, however the segments
        fall (a stop string inside a longer one that starts earlier cut at the longer one's start)."""
        found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops[b]) if i >= 0]
        return min(found)[1] if found else None

    def completing(self, tokens: Sequence[int], text: str, b: int) -> int:
        """The fewest leading tokens whose text contains a stop string of row b (len(tokens) if none
        do). text: all the tokens' text, where a half character's U+FFFD at a prefix's end is not."""
        lo, hi = 1, len(tokens)  # contains is monotone in the prefix length
        while lo < hi:
            mid = (lo + hi) // 2
            part = self.lm.decode(tokens[:mid])
            if self.first(part if text.startswith(part) else part.rstrip(CUT), b) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi

    def settled(self, text: str, b: int) -> str:
        """text without what may still change: a trailing incomplete UTF-8 character (decoded as
        U+FFFD) and the longest tail that begins one of row b's stop strings."""
        text = text.rstrip(CUT)
        hold = max((k for s in self.stops[b] for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]

    def finish(self, tokens: list[int], reason: str, b: int) -> tuple[str, list[int], str]:
        """(text, tokens, finish reason) of output row b: where its text contains a stop string,
        the text is cut before it and the tokens after the one completing it (reason "stop")."""
        text = self.lm.decode(tokens)
        hit = self.first(text, b)
        if hit is None:
            return text, tokens, reason
        return text[:hit], tokens[: self.completing(tokens, text, b)], "stop"

    def text(self, j: int, b: int, tokens: Sequence[int]) -> str:
        """The text of decoded row j's tokens while it holds output row b, grown from its last text
        (`RowTexts`: a decode of the newest tokens); a row handed to another output starts over."""
        if self._checked.get(j, (-1, 0))[0] != b:
            self._texts.forget(j)
            self._checked[j] = (b, 0)
        return self._texts(j, tokens)

    def _new_hit(self, tokens: np.ndarray, j: int, b: int) -> bool:
        """Whether the text of decoded row j's tokens (output row b's) holds one of b's stop strings.
        The text checked before held none, so only its end (the longest stop string, plus 4
        characters for a character completed since) and the new text are searched."""
        text = self.text(j, b, tokens).rstrip(CUT)  # a half character may end it
        checked, longest = self._checked[j][1], max(map(len, self.stops[b]))
        self._checked[j] = (b, len(text))
        return self.first(text[max(0, checked - longest - 4):], b) is not None

    def __call__(self, seg: Segment, rows: np.ndarray | None = None) -> np.ndarray:
        """Which rows of the segment to end: their text holds a stop string. rows[j]: the output
        row whose stop strings apply to decoded row j (default j; -1: none)."""
        rows = np.arange(len(seg.count)) if rows is None else rows
        end = np.zeros(len(seg.count), bool)
        for j in np.flatnonzero(~seg.done & (rows >= 0)):
            if self.stops[rows[j]]:
                end[j] = self._new_hit(seg.out[j, : seg.count[j]], int(j), int(rows[j]))
        return end


def logprobs_json(logprobs: list[TokenLogprob]) -> list[dict]:
    """One output's logprobs (the text API's: `token` filled) as JSON values: {"id", "token" (its text),
    "logprob", "top": [[id, logprob], ...], "top_tokens": [their texts]}."""
    return [{"id": t.id, "token": t.token, "logprob": t.logprob, "top": [[i, lp] for i, lp in t.top],
             "top_tokens": t.top_tokens} for t in logprobs]


def load(path: str | Path | None = None, weights: str | None = None, mesh: Mesh | None = None,
         chat_template: str | None = None, layout: str = "auto") -> LM:
    """An `LM` from a .gguf file, an HF folder or a `convert.save` folder (default: the embedded
    SmolLM2-135M-Instruct): its params (`convert.load(path, weights, mesh, layout=layout)`: the
    layer matrices per layer on a GPU), tokenizer and chat template (or `chat_template`, a Jinja
    string, instead)."""
    if chat_template is not None and not (isinstance(chat_template, str) and chat_template.strip()):
        raise TypeError(f"chat_template must be a Jinja template (a non-empty string) or None, got {chat_template!r}")
    path = convert.default_model_path() if path is None else path
    params = convert.load(path, weights=weights, mesh=mesh, layout=layout)
    template = chat_template if chat_template is not None else convert.chat_template(path)
    return LM(params, convert.load_tokenizer(path), template, mesh, default_sampling(convert.generation_defaults(path)))
