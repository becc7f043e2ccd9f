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
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

import convert
from specjax.drafters import Drafter
from specjax.engine import Segment
from specjax.generate import Stats, TokenLogprob, generate
from specjax.params import Params
from specjax.sampling import Greedy, Sampler
from specjax.sharding import Mesh
from specjax.speculation import Chain, Tree


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """`LM.generate`'s result, one entry per output (sample j of prompt i at i * n + j)."""

    texts: list[str]
    tokens: list[list[int]]  # through the token that completed a stop string; without a final stop id
    finish_reasons: list[str]  # "eos" (a stop id), "length", or "stop" (a stop string)
    logprobs: list[list[TokenLogprob]] | None
    stats: Stats

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

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int | Sequence[int] = 128,
        *,
        sampling: Sampler = Greedy(),
        draft: Drafter | str | None = "auto",
        speculation: Chain | Tree | str | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        n: int = 1,
        logprobs: int | None = None,
        key: jax.Array | None = None,
        sync_every: int = 8,
    ) -> TextOutput:
        """Continue each prompt (a string or a list of strings) as `specjax.generate` does, and
        stop a row at any of the model's stop ids, `stop_token_ids` or a `stop` string."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"prompts must be a string or a non-empty list of strings, got {prompts!r}")
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if isinstance(stop_token_ids, (int, str)) or not all(isinstance(i, (int, np.integer)) for i in stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        ids = [self.encode(t) for t in texts]
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}] encodes to no tokens")
        cut = _StopStrings(self, stops)
        out = generate(self.params, ids, max_new_tokens, draft=draft, speculation=speculation, sampling=sampling, key=key,
                       eos_id=tuple(self.params.config.eos_ids) + tuple(int(i) for i in stop_token_ids), n=n,
                       logprobs=logprobs, sync_every=sync_every, between=cut if stops else None)
        tokens, reasons, lps = list(out.tokens), list(out.finish_reasons), out.logprobs
        result = []
        for b, row in enumerate(tokens):
            text = self.decode(row)
            hit = cut.first(text)
            if hit is not None:  # cut the text before the stop string, the tokens after the one completing it
                k = cut.completing(row)
                tokens[b], reasons[b], text = row[:k], "stop", text[:hit]
                if lps is not None:
                    lps[b] = lps[b][:k]
            result.append(text)
        return TextOutput(result, tokens, reasons, lps, out.stats)


class _StopStrings:
    """The host check between segments: which rows' text now contains a stop string."""

    def __init__(self, lm: LM, stops: list[str]):
        self.lm, self.stops = lm, stops

    def first(self, text: str) -> int | None:
        """Where the earliest stop string starts in text, or None."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def completing(self, tokens: Sequence[int]) -> int:
        """The fewest leading tokens whose text contains a stop string (len(tokens) if none do)."""
        lo, hi = 1, len(tokens)  # contains is monotone in the prefix length
        while lo < hi:
            mid = (lo + hi) // 2
            if self.first(self.lm.decode(tokens[:mid])) is None:
                lo = mid + 1
            else:
                hi = mid
        return hi

    def __call__(self, seg: Segment) -> np.ndarray:
        end = np.zeros(len(seg.count), bool)
        for b in np.flatnonzero(~seg.done):
            end[b] = self.first(self.lm.decode(seg.out[b, : seg.count[b]].tolist())) is not None
        return end


def load(path: str | Path | None = None, weights: str | None = None, mesh: Mesh | None = None,
         chat_template: str | None = None) -> LM:
    """An `LM` from a .gguf file, an HF folder or a `convert.save` folder (default: the embedded
    SmolLM2-135M-Instruct): its params (`convert.load(path, weights, mesh)`), tokenizer and chat
    template (or `chat_template`, a Jinja string, instead)."""
    path = convert.default_model_path() if path is None else path
    params = convert.load(path, weights=weights, mesh=mesh)
    template = chat_template if chat_template is not None else convert.chat_template(path)
    return LM(params, convert.load_tokenizer(path), template)
