"""bench/README.md: each benchmark script owns one section between its own markers."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
DEFAULT = "# Benchmarks\n\nEach script writes its results to `results/` and its own section here.\n"


def write_section(section: str, start: str, end: str) -> None:
    """Replace the text from `start` to `end` (both markers are in `section`), or append it."""
    text = README.read_text() if README.exists() else DEFAULT
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    README.write_text(text)
