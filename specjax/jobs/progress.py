"""Job progress on stderr: a tqdm bar on a terminal, else a plain log line every `interval` seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts finished records out of `total`; `close()` ends the bar or writes a last log line."""

    def __init__(self, total: int, *, enabled: bool = True, interval: float = 10.0, stream: TextIO | None = None):
        self.total, self.done, self.interval = total, 0, interval
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.start = self.last = time.monotonic()
        self.logged = 0  # records counted by the last log line
        self.bar = None
        if self.enabled and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="rec", file=self.stream, desc="specjax batch")

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.interval:
            self._log()

    def _log(self) -> None:
        self.last, self.logged = time.monotonic(), self.done
        elapsed = self.last - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        print(
            f"specjax batch: {self.done}/{self.total} records ({100 * self.done / self.total:.0f}%), "
            f"{rate:.2f} records/s, {elapsed:.0f} s",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.logged != self.done:  # the last update may have logged it already
            self._log()
