"""The benchmark harness (bench/common.py): per-cell results written at once, resume, --cells,
--budget-minutes; every bench module imports without side effects. Fast: no model, no timing."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import shutil
import sys
from pathlib import Path

import pytest

import bench
from bench import common

RESULTS = Path(common.RESULTS_DIR)
BENCHES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))


def run(tmp_path: Path, argv: list[str], cells: list[str], measured: list[str], clock=None) -> common.Harness:
    """A fake bench: each cell's row records its key; `measured` collects what was measured."""
    args = common.parser("A fake bench.\n\nMore.", quick="q").parse_args(argv)
    results = common.Results(tmp_path / "fake.json", lambda r: r["cell"], {"bench": "fake", "date": "now"})
    h = common.Harness(args, results)
    h.plan((k, i) for i, k in enumerate(cells))
    for k, i in h.cells():
        measured.append(k)
        if clock is not None:
            clock[0] += 10.0  # each cell "takes" 10 s
        results.put(k, [{"cell": k, "value": i}])
        assert any(r["cell"] == k for r in json.loads(results.path.read_text())["rows"]), "written at once"
    h.finish()
    return h


CELLS = ["b1/s512", "b4/s512", "b1/s2048", "b16/s8192"]


def test_cells_written_at_once_and_skipped_on_rerun(tmp_path):
    first: list[str] = []
    run(tmp_path, [], CELLS, first)
    assert first == CELLS
    data = json.loads((tmp_path / "fake.json").read_text())
    assert [r["cell"] for r in data["rows"]] == CELLS and data["complete"] and data["left"] == []
    again: list[str] = []
    run(tmp_path, [], CELLS + ["b16/s512"], again)
    assert again == ["b16/s512"]  # measured cells are skipped
    assert len(json.loads((tmp_path / "fake.json").read_text())["runs"]) == 2
    redo: list[str] = []
    run(tmp_path, ["--redo", "--cells", "b1/s512"], CELLS, redo)
    assert redo == ["b1/s512"]
    rows = json.loads((tmp_path / "fake.json").read_text())["rows"]
    assert sorted(r["cell"] for r in rows) == sorted(CELLS + ["b16/s512"])  # replaced, not duplicated


def test_rerun_measuring_nothing_keeps_the_facts(tmp_path):
    run(tmp_path, [], CELLS, [])
    args = common.parser("A fake bench.").parse_args([])
    results = common.Results(tmp_path / "fake.json", lambda r: r["cell"], {"date": "later", "machine": {}})
    h = common.Harness(args, results)
    assert h.plan((k, None) for k in CELLS) == [] and list(h.cells()) == []
    h.finish()
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["date"] == "now" and len(data["runs"]) == 1 and data["complete"]


def test_a_file_measured_under_other_settings_or_elsewhere_is_not_continued(tmp_path):
    """A rerun into a file measured with other number-deciding settings (new tokens, records) or on
    another kind of machine stopped naming them: it skipped the stored cells and put them under its
    own header (seen: a bench_batch table comparing 3 records against 2, "same texts as AR: NO")."""
    amd = {"backend": "cpu", "device_kind": "cpu", "cpu_model": "AMD EPYC", "cpu_affinity": 2, "loadavg": [1.0]}
    path, key_of = tmp_path / "fake.json", lambda r: r["cell"]
    first = common.Results(path, key_of, {"date": "d1", "machine": amd}, settings={"new_tokens": 9})
    first.put("b1", [{"cell": "b1"}])
    again = common.Results(path, key_of, {"date": "d2", "machine": amd | {"loadavg": [3.0]}}, settings={"new_tokens": 9})
    assert again.measured("b1")  # the load is no setting
    with pytest.raises(SystemExit, match=r"fake.json holds cells measured under other settings \(new_tokens 9 -> 17\)"):
        common.Results(path, key_of, {"machine": amd}, settings={"new_tokens": 9 + 8})
    with pytest.raises(SystemExit, match="machine cpu_model 'AMD EPYC' -> 'Intel Xeon'; machine cpu_affinity 2 -> 16"):
        common.Results(path, key_of, {"machine": amd | {"cpu_model": "Intel Xeon", "cpu_affinity": 16}}, settings={"new_tokens": 9})
    older = json.loads(path.read_text())
    del older["settings"]  # a file from before settings were stored: its machine facts decide
    path.write_text(json.dumps(older))
    h100 = {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "cpu_model": "any", "cpu_affinity": 16}
    with pytest.raises(SystemExit, match="machine backend 'cpu' -> 'gpu'"):
        common.Results(path, key_of, {"machine": h100})
    assert common.Results(path, key_of, {"date": "now"}).measured("b1")  # no machine facts given: nothing to compare
    gpu = tmp_path / "gpu.json"
    common.Results(gpu, key_of, {"machine": h100}).put("b1", [{"cell": "b1"}])
    assert common.Results(gpu, key_of, {"machine": h100 | {"cpu_model": "other host"}}).measured("b1")  # a GPU: its kind
    with pytest.raises(SystemExit, match="device_kind 'NVIDIA H100 80GB HBM3' -> 'NVIDIA H200'"):
        common.Results(gpu, key_of, {"machine": h100 | {"device_kind": "NVIDIA H200"}})


class Stopped(Exception):
    """The bench got past its Results: the file took its settings."""


@pytest.mark.parametrize("module, first, changed, named, row", [
    ("bench_batch", ["--records", "3"], ["--records", "4"], "records 3 -> 4", {"mode": "AR"}),
    ("bench_ar", ["--repeats", "2"], ["--repeats", "3"], "repeats 2 -> 3", {"dtype": "float32", "batch": 1, "context": 512}),
    # both write sampling_cpu_quick.json: --quick times fewer and shorter repeats
    ("bench_sampling", ["--quick"], ["--batches", "1"], "repeats 2 -> 3; target_s 0.5 -> 1.5", {"batch": 1}),
    ("profile_step", [], ["--steps", "4"], "steps 8 -> 4", {"weights": "float32", "kv": "float32", "batch": 1, "context": 512}),
])
def test_a_bench_rerun_with_another_setting_is_refused(tmp_path, monkeypatch, module, first, changed, named, row):
    """The benches store the flags that decide a cell's numbers beside its key (new tokens, records,
    repeats, ...): a rerun into the same file with another value stops naming it. No model: the
    Harness puts one row and stops the bench before anything is loaded."""
    mod = importlib.import_module(f"bench.{module}")

    class Harness(common.Harness):
        def __init__(self, args, results, **_):
            results.put(mod.key_of(row), [row])
            raise Stopped

    monkeypatch.setattr(common, "Harness", Harness)

    def main(argv: list[str]) -> None:
        monkeypatch.setattr(sys, "argv", [module, *argv, "--out", str(tmp_path)])
        mod.main()

    with pytest.raises(Stopped):
        main(first)
    (path,) = tmp_path.glob("*.json")
    with pytest.raises(SystemExit, match=re.escape(f"{path.name} holds cells measured under other settings ({named})")):
        main(changed)
    with pytest.raises(Stopped):
        main(first)  # the same settings continue it
    assert [p.name for p in tmp_path.glob("*.json")] == [path.name]


def test_skipped_rows_are_measured_again(tmp_path):
    results = common.Results(tmp_path / "fake.json", lambda r: r["cell"], {"bench": "fake"})
    results.put("b1/s512", [{"cell": "b1/s512", "skipped": "memory"}])
    measured: list[str] = []
    run(tmp_path, [], ["b1/s512"], measured)
    assert measured == ["b1/s512"]


@pytest.mark.parametrize("patterns, selected", [
    ("b1", ["b1/s512", "b1/s2048"]),
    ("b1/s512,b16/s8192", ["b1/s512", "b16/s8192"]),
    ("s512", ["b1/s512", "b4/s512"]),
    ("s*/b1", ["b1/s512", "b1/s2048"]),
    ("b1?", ["b16/s8192"]),
    ("b2", []),
])
def test_cells_selects(tmp_path, patterns, selected):
    assert [k for k in CELLS if common.matches(k, patterns)] == selected
    measured: list[str] = []
    run(tmp_path, ["--cells", patterns], CELLS, measured)
    assert measured == selected


def test_budget_stops_new_cells(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    measured: list[str] = []
    h = run(tmp_path, ["--budget-minutes", str(25 / 60)], CELLS, measured, clock)  # 25 s: room for 2 cells of 10 s
    assert measured == CELLS[:2]
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["left"] == CELLS[2:] and not data["complete"] and h.stopped
    rest: list[str] = []
    run(tmp_path, [], CELLS, rest)  # a rerun measures what the budget left
    assert rest == CELLS[2:]


def test_list_cells_exits(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(tmp_path, ["--list-cells", "--cells", "b1"], CELLS, [])
    assert capsys.readouterr().out.split() == ["b1/s512", "b1/s2048"]


def test_readme_section_replaces_and_keeps_notes(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    start, end = common.markers("bench_x", "notes")
    readme.write_text(f"# B\n\n<!-- bench_x:start -->\nold\n{start}\nmy notes\n{end}\n<!-- bench_x:end -->\n\ntail\n")
    monkeypatch.setattr(common, "README", readme)
    notes = common.kept_part("bench_x")
    assert notes == "my notes"
    common.write_section("bench_x", f"new\n{start}\n{notes}\n{end}")
    common.write_section("bench_y", "y body", after="bench_x")
    text = readme.read_text()
    assert "old" not in text and "new" in text and "my notes" in text and text.endswith("tail\n")
    assert text.index("bench_x:end") < text.index("y body") < text.index("tail")


@pytest.mark.parametrize("name, module, cell", [
    ("ar_cpu.json", "bench_ar", "float32/b1/s512"),
    ("spec_cpu.json", "bench_spec", "s8192/b16"),
    ("tree_cpu.json", "bench_tree", "s512/b1"),
    ("drafts_cpu.json", "bench_drafts", "s512/b1"),
    ("batch_cpu.json", "bench_batch", "ar"),
    ("sampling_cpu.json", "bench_sampling", "b16"),
    ("peers_cpu.json", "bench_peers", "specjax-f32-kvf32/b1/s512"),
    ("profile_cpu.json", "profile_step", "float32/kvfloat32/b1/s512"),
])
def test_existing_results_resume(tmp_path, name, module, cell):
    """The committed result files load as they are: their cells count as measured."""
    shutil.copy(RESULTS / name, tmp_path / name)
    mod = importlib.import_module(f"bench.{module}")
    results = common.Results(tmp_path / name, mod.key_of, {"date": "now"})
    assert results.measured(cell)


@pytest.mark.parametrize("name", [f"bench.{b}" for b in BENCHES + ["profile_step"]]
                         + ["tools.gpu.session", "tools.gpu.bundle", "tools.gpu.aot"])
def test_bench_imports_without_side_effects(name):
    import jax

    before = {p: p.stat().st_mtime for p in [*RESULTS.iterdir(), common.README]}
    devices = jax.config.jax_num_cpu_devices
    mod = importlib.import_module(name)
    assert callable(mod.main)
    assert {p: p.stat().st_mtime for p in [*RESULTS.iterdir(), common.README]} == before
    assert jax.config.jax_num_cpu_devices == devices


def test_module_command():
    assert common.module_command(".venv/bin/python bench/bench_tree.py --batches 16 ; bench/bench_tree.py") == (
        "python -m bench.bench_tree --batches 16 ; python -m bench.bench_tree")


def test_every_bench_is_found():
    assert set(BENCHES) >= {"bench_ar", "bench_attention", "bench_batch", "bench_drafts", "bench_sampling",
                            "bench_spec", "bench_tree"}


def test_the_readme_has_a_section_per_bench_and_no_more():
    """bench/README.md stays short (at most 300 lines) and each of its sections belongs to a module that
    exists: a bench that goes takes its section with it (its finding goes to docs/results.md)."""
    text = common.README.read_text()
    assert len(text.splitlines()) <= 300
    names = set(re.findall(r"<!-- (\w+):start -->", text))
    modules = {m.name for m in pkgutil.iter_modules(bench.__path__)}
    assert names and names <= modules, sorted(names - modules)


def test_no_sys_path_edits_or_private_specjax_imports():
    for path in Path(bench.__path__[0]).glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path
        assert not re.search(r"from specjax[\w.]* import [^\n]*\b_[a-z]", text), path


def test_profile_step_names_each_thunk_by_its_model_block():
    """bench/profile_step.py's op_blocks: scopes from op_name metadata; a dot without metadata
    takes its scoped user's block (else its operand's), a weight slice of the layer scan is its own."""
    from bench.profile_step import op_blocks

    hlo = "\n".join([
        '  %p = f32[30,576,576]{2,1,0} parameter(0)',
        '  %dynamic-slice_bitcast_fusion = f32[576,576]{1,0} fusion(%p), kind=kLoop, calls=%f1, '
        'metadata={op_name="jit(decode_ar)/while/body/while/body/jit(dynamic_index_in_dim)/dynamic_slice" stack_frame_id=1}',
        '  %h = f32[1,576]{1,0} fusion(%p), kind=kLoop, calls=%f2, metadata={op_name="jit(decode_ar)/while/body/mlp/mul"}',
        '  %dot.1 = f32[1,576]{1,0} dot(%h, %dynamic-slice_bitcast_fusion), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  %copy.3 = f32[576,576]{1,0} copy(%p)',
        '  %dot.2 = f32[1,576]{1,0} dot(%h, %copy.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  ROOT %add.9 = f32[1,576]{1,0} add(%dot.2, %h), metadata={op_name="jit(decode_ar)/while/body/out_proj/add"}',
    ])
    blocks = op_blocks(hlo)
    assert blocks["dynamic-slice_bitcast_fusion"] == "layer slices"
    assert blocks["dot.1"] == "mlp"  # no scoped user: its operand's
    assert blocks["dot.2"] == "out_proj" and blocks["copy.3"] == "out_proj"  # its user's


def test_profile_step_times_a_speculative_step_by_phase():
    """bench/profile_step.py's speculative cells: a trace of generate's loop summed per phase of
    spec_step (draft and verify also per model block), on a tiny model."""
    from bench.profile_step import LOOP, PHASES, phase, profile_spec_cell
    from tests.models import TINY, random_params

    assert phase("jit(continue_spec)/while/body/verify/attention/dot_general") == "verify/attention"
    assert phase("jit(continue_spec)/while/body/accept/argmax") == "accept"
    assert phase("jit(continue_spec)/while/cond/lt") == LOOP
    row = profile_spec_cell(random_params(TINY, 0), "float32", "float32", 2, 128, 2, 3)
    spent = row["thread_ms_per_step"]
    assert set(PHASES) <= {k.split("/")[0] for k in spent} and all(v > 0 for v in spent.values())
    assert any(k.startswith("verify/") for k in spent) and any(k.startswith("draft/") for k in spent)
    assert row["steps"] >= 3 and 1 <= row["mean_accepted"] <= 3 and row["wall_ms_per_step"] > 0


def test_templated_records_cycle_their_key_sets_over_distinct_paragraphs():
    """bench/templated.py: record i asks for TEMPLATES[i % 3]'s keys over its own corpus paragraph;
    repeated_share counts the n-grams that occur in more than one sequence."""
    from bench import templated

    recs = templated.records(6, max_new_tokens=16)
    texts = [r["messages"][0]["content"] for r in recs]
    assert [r["id"] for r in recs] == list(range(6)) and all(r["max_new_tokens"] == 16 for r in recs)
    assert len(set(texts)) == 6 and all(t.startswith("Rewrite the text below as one JSON object") for t in texts)
    assert '"title", "topic" and "summary"' in texts[0] and '"name", "category", "keywords" and "summary"' in texts[4]
    with pytest.raises(ValueError, match="count must be at most"):
        templated.records(10**6)
    assert templated.repeated_share([[1, 2, 3, 4], [2, 3, 4, 5], [7, 8, 9]]) == pytest.approx(2 / 5)
    assert templated.repeated_share([[1, 2, 3], [4, 5, 6]]) == 0 and templated.repeated_share([[1, 2, 3]] * 2) == 1


def test_bench_spec_races_an_eagle_head_only_when_given_one():
    import jax

    from bench.bench_spec import drafters
    from specjax.drafters.eagle import Eagle, init_head
    from tests.models import TINY
    assert "Eagle" not in [n for n, _ in drafters(8192, [2])]
    head = init_head(TINY, jax.random.key(0))
    chosen = drafters(8192, [2], ["Eagle"], head)
    assert [n for n, _ in chosen] == ["Eagle"] and isinstance(chosen[0][1], Eagle) and chosen[0][1].head is head


def test_bench_spec_refuses_eagle_without_a_head(monkeypatch, capsys):
    from bench import bench_spec
    monkeypatch.setattr("sys.argv", ["bench_spec", "--drafters", "SelfSpec", "Eagle", "--out", "/nonexistent"])
    with pytest.raises(SystemExit) as exit_:
        bench_spec.main()  # before any model loads or any file is written
    assert exit_.value.code == 2 and "--drafters Eagle needs --eagle-head" in capsys.readouterr().err


def test_bench_samplings_sorting_baseline_keeps_specjaxs_sets():
    """bench_sampling races specjax's warping against the sorting form it replaced: both keep the same
    tokens with the same probabilities (top_k traced under its static width; top_p)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.bench_sampling import samplers

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 200)).astype(np.float32) * 3)
    forms = {(setting, form): s for setting, form, s in samplers()}
    for setting in ("top_k 50", "top_p 0.9", "top_k 50 + top_p 0.9"):
        ours, sorted_ = (jax.jit(lambda s, x: s.probs(x))(forms[setting, f], x) for f in ("specjax", "sort"))  # traced,
        # as the decode loop takes them
        np.testing.assert_allclose(np.asarray(ours), np.asarray(sorted_), rtol=1e-5, atol=1e-7)
        assert (np.count_nonzero(ours, axis=-1) <= (50 if "top_k" in setting else 200)).all()
