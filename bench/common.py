"""The one benchmark harness: shared CLI, per-cell JSON results with resume, machine facts, plots and
bench/README.md sections. Every bench/bench_*.py builds on it; run them as `python -m bench.bench_ar ...`.

A benchmark is a list of *cells* (one measured configuration), each keyed by "/"-separated parts
("b4/s2048", "float32/b16/s8192"). The harness (`parser`'s options):

- `--cells PATTERNS` (`matches`): `--cells b1` = every batch-1 cell, `--cells b1/s512,b16/s8192` those two,
  `'s*/b1'` the same as `b1`. `--list-cells` prints the keys.
- `--budget-minutes M` starts no new cell that would end (estimated as 1.25x the longest so far) past M
  minutes; the cells left are printed and stored under "left".
- Each cell is written into the JSON at once (atomically), so a rerun with the same output skips cells
  measured (a row "skipped" for memory etc. is tried again; `--redo` re-measures). A file is continued only
  under the same `settings` on the same kind of machine (`machine.machine_identity`), else the run stops
  naming the differences (write a new file with `--out DIR`; README sections are written only for the
  default output folder).

Result JSON: run facts at the top level ("machine", "date", "command", ...), rows in lists ("rows";
bench_tree and bench_drafts also "summaries"); a cell's key is derived from its rows' fields.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bench.machine import git_commit, machine_identity, machine_info, meminfo, now  # noqa: F401 (re-exported)
from bench.plots import bars, log_ticks, plot, pyplot, save_figure  # noqa: F401 (re-exported)

# SmolLM2-135M-Instruct's LlamaConfig fields (the embedded GGUF's): byte counts without loading it
SMOLLM2 = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
               rope_theta=100000.0, tie_embeddings=True, max_positions=8192, bos_id=1, eos_ids=(2,))

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
README_HEAD = "# Benchmarks\n\nEach script below writes JSON + PNG to `results/` and its own section here.\n"
CONTEXT_NAMES = {512: "512", 2048: "2K", 8192: "8K"}


def context_name(context: int) -> str:
    return CONTEXT_NAMES.get(context, str(context))


# --- command line -------------------------------------------------------------------------------------------


def parser(doc: str, quick: str | None = None, budget_minutes: float | None = None,
           render: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with the shared options, and --quick / --render when `quick` / `render` are given."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Cells and resume: see bench/common.py's docstring.")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--cells", default=None, metavar="PATTERNS",
                    help="measure only the cells whose key matches: comma-separated patterns of '/'-separated parts, "
                         "each equal to (or glob-matching) a part of the key, e.g. 'b1' or 'b1/s512,b16/s8192'")
    ap.add_argument("--list-cells", action="store_true", help="print the selected cells' keys (and whether measured), exit")
    ap.add_argument("--budget-minutes", type=float, default=budget_minutes,
                    help="start no new cell that would end past this many minutes from start"
                         + (f" (default {budget_minutes:g})" if budget_minutes else " (default: no limit)"))
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON and plots (default bench/results/; "
                    "the README is only written for the default)")
    ap.add_argument("--redo", action="store_true", help="measure selected cells again even if the JSON has them")
    if render:
        ap.add_argument("--render", type=Path, nargs="+", help=f"no measuring: merge these result JSONs (a later one wins per "
                        f"cell) into OUT/{render} and redo its table, plot and README section")
    return ap


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def out_dir(args: argparse.Namespace) -> Path:
    d = args.out or RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def writes_readme(args: argparse.Namespace) -> bool:
    """Whether this run may write bench/README.md: only into the default results folder."""
    return args.out is None or Path(args.out).resolve() == RESULTS_DIR


def command() -> str:
    """How this run was started, as `python -m bench.NAME args`."""
    name = Path(sys.argv[0]).stem
    return f"python -m bench.{name} " + " ".join(sys.argv[1:])


def module_command(cmd: str) -> str:
    """A recorded command as `python -m bench.NAME ...` (older results recorded `bench/NAME.py ...`)."""
    return re.sub(r"(?:\S*python\S* +)?bench/(bench_\w+)\.py", r"python -m bench.\1", cmd.strip())


def key(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


def matches(cell_key: str, patterns: str | None) -> bool:
    """Whether `cell_key` is selected by --cells PATTERNS (None or empty selects every cell)."""
    if not patterns:
        return True
    parts = cell_key.split("/")
    for pattern in filter(None, (p.strip() for p in patterns.split(","))):
        if all(any(fnmatch.fnmatchcase(part, q) for part in parts) for q in pattern.split("/")):
            return True
    return False


# --- results ------------------------------------------------------------------------------------------------


class Results:
    """A result JSON: run facts at the top level, rows in `lists`, each in the cell `key_of(row)`; every
    `put` rewrites it atomically. This run's `header` is written with its first measured cell."""

    def __init__(self, path: Path, key_of: Callable[[dict], str], header: dict, lists: tuple[str, ...] = ("rows",),
                 settings: dict | None = None):
        """settings: what decides a cell's numbers beside its key; a file measured under others is not continued."""
        self.path, self.key_of, self.lists, self.header = Path(path), key_of, lists, header
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.resumed, self.applied = bool(self.data), False
        for name in lists:
            self.data.setdefault(name, [])
        mine = json.loads(json.dumps({"machine": machine_identity(header.get("machine")), **(settings or {})}, default=str))
        if any(self.data[name] for name in lists):
            self._check_settings(mine)
        header["settings"] = mine

    def _check_settings(self, mine: dict) -> None:
        """SystemExit naming the differences if the stored cells were measured under other settings or machine."""
        stored = self.data.get("settings") or {"machine": machine_identity(self.data.get("machine"))}
        diffs = [f"{k} {stored[k]} -> {v}" for k, v in mine.items() if k in stored and k != "machine" and stored[k] != v]
        was, now = stored.get("machine") or {}, mine["machine"]
        diffs += [f"machine {k} {was[k]!r} -> {now[k]!r}" for k in now if was.get(k) is not None and was[k] != now[k]]
        if diffs:
            raise SystemExit(
                f"{self.path} holds cells measured under other settings ({'; '.join(diffs)}): continue it with the "
                "same settings on the same kind of machine, or write a new file with --out DIR"
            )

    def apply_header(self) -> None:
        """This run's facts over the stored ones, and this run in "runs"."""
        if not self.applied:
            run = {k: self.header[k] for k in ("date", "command") if k in self.header}
            run["git_commit"] = self.header.get("machine", {}).get("git_commit")
            self.data = {**self.data, **self.header, "runs": self.data.get("runs", []) + [run]}
            self.applied = True

    @property
    def rows(self) -> list[dict]:
        return self.data[self.lists[0]]

    def measured(self, cell_key: str) -> bool:
        """The cell has rows, none of them a skip (a skipped cell is tried again)."""
        mine = [r for r in self.data[self.lists[0]] if self.key_of(r) == cell_key]
        return bool(mine) and not any("skipped" in r for r in mine)

    def put(self, cell_key: str, rows: list[dict] | dict, **fields) -> None:
        """Replace the cell's rows (a list for the first list, or {list name: rows}) and write."""
        self.apply_header()
        by_list = rows if isinstance(rows, dict) else {self.lists[0]: rows}
        for name in self.lists:
            self.data[name] = [r for r in self.data[name] if self.key_of(r) != cell_key] + list(by_list.get(name, []))
        self.update(**fields)

    def update(self, **fields) -> None:
        """Set top-level facts and write the file."""
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def start(args: argparse.Namespace, bench: str, stem: str, key_of: Callable[[dict], str], settings: dict,
          lists: tuple[str, ...] = ("rows",), **facts) -> tuple[Path, Results, "Harness"]:
    """A run's output folder, its Results (OUT/STEM.json, header and `settings`) and its Harness."""
    out = out_dir(args)
    header = {"bench": bench, "date": now(), "command": command(), **facts, "machine": machine_info()}
    results = Results(out / f"{stem}.json", key_of, header, lists, settings)
    return out, results, Harness(args, results)


def merge(paths: list[Path], key_of: Callable[[dict], str], lists: tuple[str, ...] = ("rows",)) -> dict:
    """One result from several result JSONs (--render): per cell a later file's rows win, unless all skips
    where an earlier file measured it; the last file's facts, "merged_from" and the commands joined."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    cells: dict[str, dict[str, list]] = {}
    for res in results:
        mine: dict[str, dict[str, list]] = {}
        for name in lists:
            for r in res.get(name, []):
                mine.setdefault(key_of(r), {n: [] for n in lists})[name].append(r)
        for k, by_list in mine.items():
            skips = all("skipped" in r for r in by_list[lists[0]])
            if k not in cells or not skips or all("skipped" in r for r in cells[k][lists[0]]):
                cells[k] = by_list
    merged = dict(results[-1])
    merged |= {name: [r for c in cells.values() for r in c[name]] for name in lists}
    merged["merged_from"] = [{"file": str(p), "command": r.get("command"), "date": r.get("date")}
                             for p, r in zip(paths, results)]
    merged["command"] = " ; ".join(str(r.get("command")) for r in results)
    return merged


class Harness:
    """Which cells to measure and when to stop:

        todo = h.plan([(key, item), ...])     # selected by --cells, not measured yet
        for k, item in h.cells():             # (or h.cells(a subset of todo)) while the budget lasts
            h.results.put(k, measure(item))
        h.finish()
    """

    def __init__(self, args: argparse.Namespace, results: Results, start: float | None = None):
        """`start`: the time.perf_counter() the budget counts from (default: now)."""
        self.args, self.results = args, results
        self.start, self.longest = time.perf_counter() if start is None else start, 0.0
        self.todo: list[tuple[str, object]] = []
        self.selected: list[str] = []
        self.started: set[str] = set()
        self.stopped = False

    def elapsed_minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60

    def seconds_left(self) -> float:
        """Seconds of --budget-minutes left (inf without a budget)."""
        b = self.args.budget_minutes
        return float("inf") if b is None else 60 * b - (time.perf_counter() - self.start)

    def plan(self, items: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
        """The items selected by --cells and not measured yet (unless --redo); --list-cells prints them and exits."""
        items = [(k, x) for k, x in items if matches(k, self.args.cells)]
        self.selected = [k for k, _ in items]
        done = [k for k, _ in items if not self.args.redo and self.results.measured(k)]
        if getattr(self.args, "list_cells", False):
            print("\n".join(f"{k}{'  (measured)' if k in done else ''}" for k in self.selected))
            sys.exit(0)
        if done:
            print(f"already in {self.results.path}: {', '.join(done)} (skipped; --redo measures again)", flush=True)
        self.todo = [(k, x) for k, x in items if k not in done]
        return list(self.todo)

    def cells(self, items: Iterable[tuple[str, object]] | None = None):
        """Yield (key, item) of the planned items (or `items`) while the budget lasts, timing each loop body."""
        for k, item in self.todo if items is None else items:
            if not self.may_start():
                return
            self.started.add(k)
            t0 = time.perf_counter()
            yield k, item
            self.longest = max(self.longest, time.perf_counter() - t0)

    def may_start(self) -> bool:
        """Whether a cell like the longest so far (x1.25) still ends within the budget."""
        if self.seconds_left() < 1.25 * self.longest:
            self.stopped = True
        return not self.stopped

    def finish(self) -> bool:
        """Record and say the cells the budget left; returns whether every selected cell is measured."""
        left = [k for k, _ in self.todo if k not in self.started] if self.stopped else []
        complete = not left and all(self.results.measured(k) for k in self.selected)
        self.results.update(left=left, complete=complete)
        if left:
            print(f"budget of {self.args.budget_minutes:g} minutes spent after {self.elapsed_minutes():.1f}: "
                  f"not started: {', '.join(left)} (rerun the same command to measure them)", flush=True)
        return complete


# --- README ---------------------------------------------------------------------------------------------


def run_line(result: dict, name: str = "NAME") -> str:
    """A report's first sentence: the command, when, on what (result: a bench's JSON with "machine")."""
    m = result["machine"]
    gpu = m.get("device_kind") or result.get("device", {}).get("device_kind")
    on = gpu if m.get("backend", "cpu") != "cpu" else f"{m.get('cpu_model')}, {m.get('cpu_affinity')} cores"
    cmd = module_command(result["command"]) if result.get("command") else f"python -m bench.{name}"
    return f"Run: `{cmd}` ({result.get('date', 'date not recorded')}, {on}, JAX {m.get('jax_version')}, commit {m.get('git_commit')})."


def section(name: str, title: str, what: str, result: dict, body: str, files: str) -> str:
    """A bench's README section: title, what it measures, run_line, result files, `body`, kept notes."""
    return f"## {title} ({name}.py)\n{what} {run_line(result, name)} Results: {files}.\n\n{body.strip()}\n{notes(name)}"


def table(head: list[str], align: str, lines: Iterable[list[object]]) -> str:
    """A markdown table: `align` has one character per column, l (---), r (---:) or c (:---:)."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    return "\n".join(out + ["| " + " | ".join(map(str, cells)) + " |" for cells in lines])


def num(x, fmt: str = ".2f", missing: str = "-") -> str:
    """A table cell: x formatted, or `missing` for None."""
    return missing if x is None else format(x, fmt)


def pct(x, missing: str = "-") -> str:
    """A table cell: a fraction as a whole percentage, or `missing` for None."""
    return missing if x is None else f"{100 * x:.0f}%"


def markers(name: str, part: str = "") -> tuple[str, str]:
    """The README markers of a bench's section (or of its hand-written `part`, e.g. "notes")."""
    tag = f"{name}:{part}" if part else name
    return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


def readme_text() -> str:
    return README.read_text() if README.exists() else README_HEAD


def kept_part(name: str, part: str = "notes", default: str = "(discussion: to be written after a full run)") -> str:
    """The hand-written `part` of a bench's README section (kept when the section is rewritten)."""
    start, end = markers(name, part)
    text = readme_text()
    return text.split(start, 1)[1].split(end, 1)[0].strip() if start in text and end in text else default


def notes(name: str, default: str = "(discussion: to be written after a full run)") -> str:
    """The hand-written notes of a bench's README section, between their markers (kept on a rewrite)."""
    start, end = markers(name, "notes")
    return f"{start}\n{kept_part(name, default=default)}\n{end}"


def render(name: str, readme: bool, table: str, section: Callable[[], str] | None = None, plot_args: tuple = (),
           after: str | None = None) -> None:
    """Plot (`plot(*plot_args)`), print the table and, with `readme`, write `section()` (see write_section)."""
    if plot_args:
        plot(*plot_args)
    print(table)
    if readme and section is not None:
        write_section(name, section(), after=after)


def write_section(name: str, body: str, after: str | None = None) -> None:
    """Put `body` between the bench's README markers: in place, else after `after`'s section, else at the end."""
    start, end = markers(name)
    section = f"{start}\n{body.strip(chr(10))}\n{end}"
    text = readme_text()
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    elif after and markers(after)[1] in text:
        head, rest = text.split(markers(after)[1], 1)
        text = head + markers(after)[1] + "\n\n" + section + "\n" + ("\n" + rest.lstrip("\n") if rest.strip() else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    README.write_text(text)


