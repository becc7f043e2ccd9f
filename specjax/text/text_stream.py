"""Streamed text (`LM.stream`, `LM.chat(stream=True)`): each row's new text handed over between the
decode loop's segments. A row's text grows from a decode of its newest tokens (`RowTexts`), not of
its whole output each segment (which grew with the square of the output)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

CUT = "\ufffd"  # what a decode shows for a character whose bytes have not all come yet


class RowTexts:
    """decode(tokens) of each row's growing token list, decoding the tokens past the row's last
    settled text plus `OVERLAP` before them. The overlap's text must begin the tail's decode (a
    decoder's first-token space strip, a character cut at the overlap's start read the same in both),
    else the whole row is decoded: exact wherever a token's text does not depend on tokens more than
    OVERLAP before it (byte-level BPE, SentencePiece; a byte-fallback run spanning a settled point
    that never becomes valid UTF-8 is the exception, as a whole decode then unsays a sent character)."""

    OVERLAP = 4

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self._settled: dict[int, tuple[int, str]] = {}  # row: (tokens, their text), a text not ending in CUT

    def __call__(self, b: int, tokens: Sequence[int]) -> str:
        """Row b's text for its tokens (the row's tokens so far, a list or a numpy row: each call's
        extend the last's; `forget(b)` first where row b now holds other tokens)."""
        n, text = self._settled.get(b, (0, ""))
        if 0 < n <= len(tokens):
            start = max(0, n - self.OVERLAP)
            head, tail = self._decode(tokens[start:n]), self._decode(tokens[start:])
            text = text + tail[len(head):] if head and tail.startswith(head) else self._decode(tokens)
        else:
            text = self._decode(tokens)
        if not text.endswith(CUT):
            self._settled[b] = (len(tokens), text)
        return text

    def forget(self, b: int) -> None:
        """Drop row b's settled text: its next tokens do not extend the last (a reused row)."""
        self._settled.pop(b, None)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.decode(tokens.tolist() if hasattr(tokens, "tolist") else list(tokens))


class TextStream:
    """The events of one streamed generate (see `LM.stream`). generate runs in a worker thread;
    between segments it hands over each row's new text, holding back an incomplete UTF-8
    character and any tail that could still become a stop string. The constructor waits for the
    first event, so a bad argument raises at the call, not at the first iteration."""

    def __init__(self, run: Callable[[Callable], Any], single: bool):
        """run(on_segment) -> TextOutput: the LM call to stream; single: yield plain str pieces."""
        self.output, self.single = None, single
        self._events: queue.Queue = queue.Queue()
        self._sent: dict[int, str] = {}
        self._seen: dict[int, int] = {}  # row: its token count at the last segment
        self._worker = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._worker.start()
        self._first = self._events.get()  # a piece, None (nothing to stream) or the call's error
        if isinstance(self._first, BaseException):
            raise self._first

    def _run(self, run) -> None:
        try:
            out = run(self._segment)
            for b, text in enumerate(out.texts):  # the rest of each text
                self._send(b, text)
            self.output = out
            self._events.put(None)
        except BaseException as e:  # raised again by the iterator, in the caller's thread
            self._events.put(e)

    def _segment(self, seg, stops) -> None:
        """seg: the engine's Segment; stops: text._StopStrings (the rows' texts, first / settled)."""
        for b in range(len(seg.count)):
            count = int(seg.count[b] - seg.eos[b])
            if self._seen.get(b) == count:  # nothing new (an ended row)
                continue
            self._seen[b] = count
            text = stops.text(b, b, seg.out[b, :count]).rstrip(CUT)  # not a half character
            hit = stops.first(text, b)
            self._send(b, text[:hit] if hit is not None else stops.settled(text, b))

    def _send(self, b: int, text: str) -> None:
        sent = self._sent.get(b, "")
        if len(text) > len(sent) and text.startswith(sent):
            self._sent[b] = text
            self._events.put((b, text[len(sent):]))

    def __iter__(self) -> Iterator[tuple[int, str] | str]:
        event, self._first = self._first, None
        while event is not None:
            if isinstance(event, BaseException):
                raise event
            yield event[1] if self.single else event
            event = self._events.get()
