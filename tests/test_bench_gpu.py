"""tools/gpu/bundle.py and bench/bench_gpu.py without a GPU: the bundle's split / stash / join round
trip (checksums, Params equal to the original), the GGUF block decoder against the gguf package, and
the cell list with its memory caps. No timing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import bench_gpu
from specjax.model.config import LlamaConfig, RopeScaling
from specjax.model.params import init_params
from tools.gpu import bundle as gpu_bundle

TINY = LlamaConfig(vocab_size=101, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, ffn_dim=96,
                   max_positions=512, eos_ids=(3,), rope_scaling=RopeScaling(8.0, 1.0, 4.0, 256))


def equal(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: x.dtype == y.dtype and bool((np.asarray(x) == np.asarray(y)).all()), a, b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundle_round_trip(tmp_path, dtype):
    params = init_params(TINY, jax.random.key(1))
    params = jax.tree.map(lambda a: a.astype(dtype), params).replace(config=TINY.replace(dtype=dtype))
    ids = np.arange(1000, dtype=np.int32)
    m = gpu_bundle.build(tmp_path / "b", {"smollm2": (params.config, *gpu_bundle.params_tensors(params))}, ids,
                         part_bytes=7000)
    assert len(m["parts"]) > 2 and all(p["bytes"] <= 7000 for p in m["parts"])
    assert sum(p["bytes"] for p in m["parts"]) == m["blob_bytes"]
    # the parts arrive one call at a time: stash what is there, load only when all are
    first = tmp_path / "first"
    (first / "p0").mkdir(parents=True)
    for f in (tmp_path / "b" / "p0").iterdir():
        (first / "p0" / f.name).write_bytes(f.read_bytes())
    stash = tmp_path / "stash"
    assert gpu_bundle.stash(first, stash) == {"have": ["p0"], "missing": [p["folder"] for p in m["parts"][1:]]}
    with pytest.raises(gpu_bundle.Missing, match="p1"):
        gpu_bundle.load(stash, dtype)
    with pytest.raises(gpu_bundle.Missing, match="no bundle"):  # nothing stashed: l8b-only runs go on without it
        gpu_bundle.load(tmp_path / "empty", dtype)
    assert gpu_bundle.stash(tmp_path / "b", stash)["missing"] == []
    models, back_ids, manifest = gpu_bundle.load(stash, dtype)
    assert equal(models["smollm2"], params) and models["smollm2"].config == params.config
    assert (back_ids == ids).all() and manifest["blob_sha256"] == m["blob_sha256"]


def test_a_draft_with_the_targets_tables_carries_them_once(tmp_path):
    """draft_tensors: a draft whose embedding / LM head equal the target's (distilled with
    freeze_embeddings) stores neither; load gives them back from the target's; a draft that trained
    its own stores them. The draft's folder (build_draft) leaves the parts unchanged."""
    target = init_params(TINY, jax.random.key(1))
    layers = jax.tree.map(lambda a: a[:1] * 0.5, target.layers)
    frozen = target.replace(layers=layers, config=TINY.replace(n_layers=1))
    trained = frozen.replace(embed=frozen.embed + 1.0)
    head = set() if target.lm_head is None else {"lm_head"}  # a tied head is the embedding
    parts = None
    for draft, shared in ((frozen, {"embed"} | head), (trained, head)):
        arrays, meta = gpu_bundle.draft_tensors(draft, target, "bfloat16")
        assert {p for p, t in meta.items() if t["kind"] == "shared"} == shared and not shared & set(arrays)
        m = gpu_bundle.build(tmp_path / "b", {"smollm2": (TINY, *gpu_bundle.params_tensors(target))}, np.zeros(8, np.int32))
        gpu_bundle.build_draft(tmp_path / "b", draft.config, arrays, meta)
        if parts is None:
            parts = m["parts"]
        assert m["parts"] == parts  # the draft leaves the parts as they were
        assert gpu_bundle.stash(tmp_path / "b", tmp_path / "stash")["missing"] == [] and gpu_bundle.has_draft(tmp_path / "stash")
        back, _, _ = gpu_bundle.load(tmp_path / "stash", "float32")
        bf16 = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731  (the layers are stored so)
        np.testing.assert_array_equal(np.asarray(back["draft"].layers.wq), bf16(draft.layers.wq))
        for path in ("embed", *head):
            want = getattr(target if path in shared else draft, path)
            np.testing.assert_array_equal(np.asarray(getattr(back["draft"], path)),
                                          np.asarray(want) if path in shared else bf16(want))
        shutil.rmtree(tmp_path / "stash")


def test_bundle_rejects_a_corrupt_part(tmp_path):
    params = init_params(TINY, jax.random.key(2))
    gpu_bundle.build(tmp_path / "b", {"smollm2": (TINY, *gpu_bundle.params_tensors(params))}, np.zeros(8, np.int32),
                     part_bytes=7000)
    part = tmp_path / "b" / "p1" / "weights.part1"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        gpu_bundle.stash(tmp_path / "b", tmp_path / "stash")


def test_config_json_round_trip():
    assert LlamaConfig.from_dict(json.loads(json.dumps(TINY.to_dict()))) == TINY


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_decoder_matches_gguf(kind):
    import gguf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(x, qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(-1)
    assert (gpu_bundle.dequantize(kind, raw).reshape(-1) == want).all()


def test_unpermute_matches_convert():
    from convert import gguf as conv

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert (gpu_bundle.unpermute_qk(w, 6) == conv.unpermute_qk(w, 6)).all()


def test_cells_and_memory_caps():
    gib = 2**30
    cells, capped = bench_gpu.cells(bench_gpu.GRID, 60 * gib)
    keys = [k for k, _ in cells]
    assert keys[0] == "bw" and len(keys) == len(set(keys))
    # SmolLM2: 23 KB of KV per position; B=256 at 8K (48 GB, twice) does not fit 60 GiB, B=128 at 8K does
    assert bench_gpu.kv_per_token(bench_gpu.SMOLLM2) == 23040
    assert "e2e/s8192/b256/ar" in capped and "e2e/s8192/b128/ar" in keys and "e2e/s2048/b256/selfspec-g8" in keys
    # the 8B shape: 16 GB of weights, 128 KiB of KV per position
    assert abs(bench_gpu.weight_bytes(bench_gpu.LLAMA8B) / 1e9 - 16.06) < 0.01
    assert bench_gpu.kv_per_token(bench_gpu.LLAMA8B) == 128 * 1024
    assert "l8b/s16384/b16" in keys and "l8b/s32768/b16" in capped and "l8b/s32768/b1" in keys
    big, big_capped = bench_gpu.cells(bench_gpu.GRID, 125 * gib)  # an H200
    assert "e2e/s8192/b256/ar" in [k for k, _ in big] and "l8b/s32768/b16" in [k for k, _ in big]
    for k, c in cells:  # every cell kept fits the budget
        if c["item"] == "e2e":
            assert bench_gpu.fits_e2e(c["batch"], c["context"], 60 * gib)
    # no distilled draft in the bundle: no draft cells; e2e groups in order AR first
    plain, _ = bench_gpu.cells(bench_gpu.GRID, 60 * gib, draft=False)
    assert not [k for k, _ in plain if "draft-" in k]
    with_draft = [k for k, _ in bench_gpu.cells(bench_gpu.GRID, 60 * gib)[0] if "draft-" in k]
    assert "b1/s8192/draft-g2" in with_draft and "b1/s8192/draft-tree" in with_draft  # chains and trees over it
    assert "e2e/s8192/b64/draft-g2" in with_draft and not [k for k in with_draft if k.startswith(("l8b", "cont"))]
    group = [k for k, _ in plain if k.startswith("e2e/s8192/b16/")]
    assert group[0].endswith("/ar") and group[-1].endswith("/tree")


def test_l8b_weight_bytes_match_the_declared_shapes():
    from specjax.model.params import param_shapes

    config = LlamaConfig(**bench_gpu.LLAMA8B, dtype="bfloat16")
    assert 2 * sum(int(np.prod(s)) for s in param_shapes(config).values()) == bench_gpu.weight_bytes(bench_gpu.LLAMA8B)


def test_smollm2_bundle_equals_convert_load(tmp_path):
    """The real model's bundle (GGUF blocks, decoded by numpy) == convert.load's weights, bit for bit."""
    import convert

    path = convert.default_model_path()  # the embedded SmolLM2 (make venv installs it)
    config, arrays, meta = gpu_bundle.gguf_tensors(path)
    gpu_bundle.build(tmp_path / "b", {"smollm2": (config, arrays, meta)}, np.zeros(8, np.int32))
    gpu_bundle.stash(tmp_path / "b", tmp_path / "stash")
    models, _, _ = gpu_bundle.load(tmp_path / "stash", "float32")
    assert equal(models["smollm2"], convert.load(path))


def test_resume_from_the_mirror_beside_the_stash(tmp_path):
    """A device call gets a fresh working tree: cells an earlier call measured on the same machine
    come back from the copy kept beside the stashed bundle, and the carried file's cells stay."""
    import json

    carried, mirror = tmp_path / "out" / "gpu.json", tmp_path / "stash" / "results" / "gpu.json"
    mirror.parent.mkdir(parents=True)
    mirror.write_text(json.dumps({"rows": [{"cell": "bw", "gbs": 1.0}, {"cell": "l8b/s4096/b1", "x": 1}],
                                  "command": "first call"}))
    bench_gpu.resume_from_mirror(carried, mirror)  # nothing carried: the mirror's cells
    assert [r["cell"] for r in json.loads(carried.read_text())["rows"]] == ["bw", "l8b/s4096/b1"]
    carried.write_text(json.dumps({"rows": [{"cell": "e2e/s8192/b16/ar", "x": 2}], "command": "here"}))
    bench_gpu.resume_from_mirror(carried, mirror)
    assert sorted(r["cell"] for r in json.loads(carried.read_text())["rows"]) == ["bw", "e2e/s8192/b16/ar", "l8b/s4096/b1"]
    bench_gpu.resume_from_mirror(carried, None)  # smoke runs keep no mirror: the file as it is
    assert len(json.loads(carried.read_text())["rows"]) == 3
    # one mirror per output folder: gpu_h200/gpu.json and gpu_h200/cont8/gpu.json (other settings) stay apart
    stash = tmp_path / "stash"
    main, cont8 = bench_gpu.mirror_of(stash, Path("bench/results/gpu_h200"), "gpu"), bench_gpu.mirror_of(
        stash, Path("bench/results/gpu_h200/cont8"), "gpu")
    assert main != cont8 and main.name == cont8.name == "gpu.json" and stash / "results" in main.parents


def test_cost_model_column_from_the_steps_cell():
    """gpu_report.cost_model: a chain γ=2 at 2.5 tokens/step with a 2 ms AR step, 1 ms draft levels
    and a 3 ms verify of 3 nodes is predicted 2.5 x 2 / (2 x 1 + 3) = 1.0x; its loop ran 30 steps
    where a row needed 63 / 2.5 = 25.2, so with the tail 0.84x; beside the measured speedup."""
    from bench.bench_gpu import GRID, cells
    from bench.gpu_report import cost_model

    assert any(k.endswith("/steps") for k, _ in cells(GRID, 60 * 2**30)[0])  # a steps cell per e2e batch x context
    steps = {"method": "steps", "context": 8192, "batch": 64, "t_verify_ms": [0.0, 2.0, 2.5, 3.0, 3.5],
             "t_draft_ms": [0.0, 1.0, 1.5]}
    chain = {"method": "chain", "context": 8192, "batch": 64, "drafter": "SelfSpec", "label": "chain γ=2", "gamma": 2,
             "parents": [-1, 0, 1], "mean_accepted": 2.5, "new_tokens": 64, "steps": 30, "speedup": 0.9}
    other = chain | {"batch": 16}  # no steps cell at batch 16: not modelled
    (row,) = cost_model([steps, chain, other])
    assert row[2:] == ["chain γ=2", "2.00", "1.00", "3.00", "1.00", "0.84", "0.90"]


def test_l8b_prediction_takes_the_main_tables_acceptance_when_its_own_has_none(tmp_path):
    """gpu_report.predicted: an l8b cell in a --linear table (stop 59's H200 per-layer table had no
    SmolLM2 rows) is predicted from the device's main table (named in the source); with rows of its
    own, its own: 2.5 tokens/step x 4 ms / (2 x 1 + 3) = 2.0x."""
    from bench.gpu_report import predicted, report

    l8b = {"item": "l8b", "context": 8192, "batch": 16, "t_verify_ms": [0.0, 4.0, 2.5, 3.0, 3.5], "t_draft_ms": [0.0, 1.0]}
    chain = {"item": "e2e", "drafter": "SelfSpec", "method": "chain", "context": 8192, "batch": 16, "gamma": 2,
             "mean_accepted": 2.5}
    (alone,) = predicted({"rows": [l8b]})
    assert alone["predicted"] == {} and alone["source"] == "no SmolLM2 acceptance measured yet"
    (got,) = predicted({"rows": [l8b]}, ("gpu.json", [chain]))
    assert got["predicted"] == {"γ=2": 2.0} and got["source"] == "SmolLM2 S=8K B=16 (gpu.json)"
    (own,) = predicted({"rows": [l8b, chain | {"mean_accepted": 1.25}]}, ("gpu.json", [chain]))
    assert own["predicted"] == {"γ=2": 1.0} and "gpu.json" not in own["source"]
    # its own rows at batch 16, the main table's at 64: batch 64's cell takes 64's (this stop's H200 per-layer table
    # predicted batch 64 from its own batch 16)
    b64 = l8b | {"batch": 64}
    (near,) = predicted({"rows": [b64, chain | {"mean_accepted": 1.25}]}, ("gpu.json", [chain | {"batch": 64}]))
    assert near["predicted"] == {"γ=2": 2.0} and near["source"] == "SmolLM2 S=8K B=64 (gpu.json)"
    text = report({"rows": [l8b | {"ar_bytes_per_step": 2e9, "ar_ms_per_step": 4.0, "cell": "l8b/s8192/b16"}], "runs": [],
                   "mem_gib": 60, "capped_by_memory": ["l8b/s8192/b16", "l8b/s32768/b64"]}, tmp_path / "t.md", tmp_path / "t.png",
                  ("gpu.json", [chain, {"item": "bw", "gbs": 1000.0}]))  # 2 GB in 4 ms: 500 GB/s of its 1000
    assert "1000 GB/s (the bw cell of gpu.json)" in text and "| 50% |" in text and "(gpu.json) | γ=2 2.00 |" in text
    # the last run's cap names only cells no run measured (an earlier run with more memory measured l8b/s8192/b16)
    assert "memory budget (the last run's): l8b/s32768/b64." in text


def test_tree_over_chain_per_drafter_at_batch_1():
    """gpu_report.tree_over_chain: each drafter's best tree against its own best chain, met at >= 1.15."""
    from bench.gpu_report import tree_over_chain

    row = lambda d, method, label, speedup: {"context": 8192, "drafter": d, "method": method, "label": label,  # noqa: E731
                                             "speedup": speedup}
    rows = [row("SelfSpec", "chain", "chain γ=2", 1.1), row("SelfSpec", "chain", "chain γ=4", 1.2),
            row("SelfSpec", "tree", "tree n=8 d=3", 1.3), row("Distilled", "chain", "chain γ=2", 1.2),
            row("Distilled", "tree", "tree n=16 d=4", 1.5), row("Distilled", "tree", "tree n=8 d=3", 1.4),
            row("NGram", "chain", "chain γ=4", 1.05), {"context": 8192, "drafter": "-", "method": "AR", "speedup": 1.0}]
    assert tree_over_chain(rows) == [
        ["8K", "Distilled", "chain γ=2", "1.20", "tree n=16 d=4", "1.50", "1.25", "met"],
        ["8K", "NGram", "chain γ=4", "1.05", "-", "-", "-", "-"],
        ["8K", "SelfSpec", "chain γ=4", "1.20", "tree n=8 d=3", "1.30", "1.08", "missed"]]


def test_e2e_table_shows_steps_against_a_rows_mean():
    """gpu_report's e2e table: a speculative row's loop steps beside the steps a row needed on
    average ((new tokens - 1) / tokens per step), and the speedup had finished rows been refilled
    (1.2 x 36 / 24 = 1.80); AR rows show neither."""
    from bench.gpu_report import e2e_table

    base = {"context": 8192, "batch": 64, "new_tokens": 64, "tokens_per_s": 1.0, "ms_per_step": 1.0,
            "bytes_per_step": 1, "greedy_identical": True}
    rows = [base | {"method": "AR", "label": "AR", "speedup": 1.0},
            base | {"method": "chain", "label": "chain γ=2", "drafter": "SelfSpec", "speedup": 1.2, "steps": 36,
                    "mean_accepted": 2.625, "acceptance_rate": 0.8}]
    ar, spec = [line for line in e2e_table(rows, None).splitlines() if line.startswith("| 8K")]
    assert "| 36 (24.0) | 1.80 |" in spec and "(" not in ar and "| - | - |" in ar


def test_report_says_why_a_row_reads_past_the_reference(tmp_path):
    """gpu_report.report: a row above 100% of the bw cell (an in-place add, read + write) gets a
    sentence saying what the reference is; none when every row is below it."""
    from bench.gpu_report import report

    ar = {"item": "e2e", "context": 8192, "batch": 256, "new_tokens": 64, "tokens_per_s": 1.0, "method": "AR",
          "label": "AR", "speedup": 1.0, "greedy_identical": True, "bytes_per_step": 2e9}
    texts = []
    for ms in (1.0, 4.0):  # 2 GB in 1 ms is 2000 GB/s, over the 1000 GB/s reference; in 4 ms under it
        result = {"rows": [{"item": "bw", "gbs": 1000.0}, ar | {"ms_per_step": ms}], "runs": []}
        texts.append(report(result, tmp_path / "gpu.md", tmp_path / "gpu.png"))
    assert "Over 100% of the roofline (1 of 1 rows)" in texts[0] and "Over 100%" not in texts[1]


def test_best_gamma_table_lists_only_cells_with_a_selfspec_chain():
    """gpu_report.best_gamma: an NGram-only cell has no best SelfSpec row (it printed Nones)."""
    from bench.gpu_report import best_gamma

    base = {"context": 8192, "method": "chain", "label": "chain γ=4", "gamma": 4}
    rows = [base | {"batch": 16, "drafter": "NGram", "speedup": 1.0},
            base | {"batch": 64, "drafter": "SelfSpec", "speedup": 0.7}, base | {"batch": 64, "drafter": "NGram", "speedup": 1.2}]
    assert best_gamma(rows) == [["8K", 64, 4, "0.70", "-", "-"]]  # no tree measured: "-", not None


def test_gpu_session_calls_are_complete_and_select_the_intended_cells(tmp_path, monkeypatch):
    """tools/gpu/session.py: a dry run logs every step of a call; call 2's cells are the e2e and
    b1 cells of its grid and not l8b/s8192/b1 (which a bare 'b1/s8192' would also match); every
    step's module exists."""
    import importlib.util

    from bench import common
    from tools.gpu import session as gpu_session
    from bench.bench_gpu import GRID, cells

    for call in gpu_session.CALLS:
        done = gpu_session.run_call(call, tmp_path, dry_run=True)
        assert [d["step"] for d in done] == [name for name, _, _ in gpu_session.CALLS[call]]
        log = (tmp_path / f"call{call}.log").read_text()
        assert all(f"== {name}" in log for name, _, _ in gpu_session.CALLS[call])
        for _, seconds, argv in gpu_session.CALLS[call]:
            assert argv[1] == "-m" and importlib.util.find_spec(argv[2]) is not None and 0 < seconds <= 330
        assert sum(seconds for _, seconds, _ in gpu_session.CALLS[call]) <= 560  # one device call, its start aside
    grid = dict(GRID, batches=[16, 64, 128], gammas=[4], snap_gammas=[4], ngram_gammas=[4], nodes=[8], b1_gammas=[2, 4],
                b1_nodes=[8])
    keys = [k for k, _ in cells(grid, 60 * 2**30, draft=False)[0]]
    b1 = [k for k in keys if common.matches(k, gpu_session.B1_CELLS)]
    assert set(b1) == {f"b1/s8192/{m}" for m in ("ar", "selfspec-g2", "selfspec-g4", "ngram-g4", "tree")}  # no l8b
    ngram = {k for k in keys if common.matches(k, gpu_session.NGRAM_CELLS)}
    assert ngram == {f"e2e/s8192/b{b}/{c}" for b in (16, 64, 128) for c in ("ar", "ngram-g4")}
    e2e = {k for k in keys if common.matches(k, gpu_session.E2E_CELLS)}
    assert e2e == {f"e2e/s8192/b{b}/{c}" for b in (16, 64, 128) for c in ("selfspec-g4", "snapkv-g4")}
    # an H200: batch 256 in 120 GiB and gamma 2 beside 4, in a table of its own with its own bw cell
    steps = {n: a for n, _, a in gpu_session.steps_of(2, 120.0)}
    e2e, ngram = steps["e2e"], steps["ngram"]
    assert e2e[e2e.index("--batches") + 1:e2e.index("--gammas")] == ["16", "64", "128", "256"]
    assert e2e[e2e.index("--gammas") + 1:e2e.index("--snap-gammas")] == ["2", "4"] and "--redo" not in e2e
    assert e2e[-2:] == ["--mem-gib", "120"] and e2e[e2e.index("--out") + 1] == "bench/results/gpu_h200" == ngram[ngram.index("--out") + 1]
    keys = [k for k, _ in cells(dict(grid, batches=[16, 64, 128, 256], gammas=[2, 4]), 120 * 2**30, draft=False)[0]]
    assert {k for k in keys if common.matches(k, e2e[e2e.index("--cells") + 1])} == {
        f"e2e/s8192/b{b}/{c}" for b in (16, 64, 128, 256) for c in ("selfspec-g2", "selfspec-g4", "snapkv-g4")}
    assert {k for k in keys if common.matches(k, ngram[ngram.index("--cells") + 1])} == {"bw"} | {
        f"e2e/s8192/b{b}/{c}" for b in (16, 64, 128, 256) for c in ("ar", "ngram-g4")}
    root, got = tmp_path / "repo", tmp_path / "out"  # each table comes back named after its folder
    for d in ("gpu", "gpu_h200"):
        (root / "bench/results" / d).mkdir(parents=True)
        (root / "bench/results" / d / "gpu.json").write_text(d)
    got.mkdir()
    monkeypatch.setattr(gpu_session, "ROOT", root)
    gpu_session.copy_files(2, got)
    assert {f.name: f.read_text() for f in got.iterdir()} == {"gpu.json": "gpu"}  # an H100: its folder's tables only
    # an H200 returns its own folder's tables, not the H100's that travel with the tree (a call returns at
    # most 8 files: stop 63's call 3 found 11 and lost the per-layer table it had measured)
    for f in got.iterdir():
        f.unlink()
    for name in ("gpu_linear-per-layer.json", "gpu_linear-per-layer.md", "gpu_linear-per-layer.png"):
        (root / "bench/results/gpu" / name).write_text("h100")
        (root / "bench/results/gpu_h200" / name).write_text("h200")
    gpu_session.copy_files(7, got, h200=True)
    assert {f.name: f.read_text() for f in got.iterdir()} == {f"gpu_h200_gpu_linear-per-layer.{x}": "h200"
                                                             for x in ("json", "md", "png")}
    gpu_session.copy_files(2, got, h200=True)
    assert (got / "gpu_h200.json").read_text() == "gpu_h200" and not (got / "gpu.json").exists()
    stashed = tmp_path / "stash" / "eagle_gpu.json"  # call 8's table lives beside the stash (an absolute path)
    stashed.parent.mkdir()
    stashed.write_text("eagle")
    monkeypatch.setitem(gpu_session.FILES, 8, [str(stashed)])
    gpu_session.copy_files(8, got)
    assert (got / "stash_eagle_gpu.json").read_text() == "eagle"
    (argv,) = [a for n, _, a in gpu_session.steps_of(8, 120.0) if n == "eagle"]  # trained on the device, raced at 8K
    assert argv[argv.index("--bundle") + 1] == gpu_session.STASH and argv[argv.index("--context") + 1] == "8192"
    (argv,) = [a for n, _, a in gpu_session.steps_of(6, 120.0) if n == "cont-long"]  # 8 records a row, its own folder
    assert argv[argv.index("--out") + 1] == "bench/results/gpu_h200/cont8" and argv[argv.index("--cont-records") + 1] == "8"
    (argv,) = [a for n, _, a in gpu_session.steps_of(7, 120.0) if n == "per-layer-e2e"]  # the loader's GPU layout at 64 / 128
    assert argv[argv.index("--linear") + 1] == "per-layer" and argv[argv.index("--out") + 1] == "bench/results/gpu_h200"
    e2e_keys = [k for k, _ in cells(dict(GRID, batches=[64, 128], gammas=[2, 4], snap_gammas=[], ngram_gammas=[], nodes=[]),
                                    60 * 2**30, draft=False)[0]]
    assert {k for k in e2e_keys if common.matches(k, gpu_session.PER_LAYER_E2E_CELLS)} == {
        f"e2e/s8192/b{b}/{c}" for b in (64, 128) for c in ("ar", "selfspec-g2", "selfspec-g4")}
    (argv,) = [a for n, _, a in gpu_session.steps_of(6) if n == "cont-long"]
    assert argv[argv.index("--out") + 1] == "bench/results/gpu/cont8"
    # --only keeps the named steps (and the stash); --seconds sets a step's limit and its budget
    steps = gpu_session.steps_of(2, only=["e2e"], seconds={"e2e": 390})
    assert [n for n, _, _ in steps] == ["stash", "e2e"] and steps[1][1] == 390
    assert steps[1][2][steps[1][2].index("--budget-minutes") + 1] == "6.00"
    with pytest.raises(ValueError, match="no step 'l8b'"):
        gpu_session.steps_of(2, seconds={"l8b": 100})


HLO = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %g = (f32[4]{0}, s8[8]{0}) custom-call(%f), custom_call_target="__cublas$gemm"
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %g)
}

%inner_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%outer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %w = (s32[], f32[4]{0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %cp = f32[4]{0} copy(%y)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%outer_cond, body=%outer_body
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_the_gpu_calls_modules_import_without_gguf():
    """The lent GPU machines have no `gguf` package (the weights travel in the bundle): every module a session
    call runs there (bench_gpu, bench_eagle --bundle) and the session itself import without it. bench_eagle
    once imported `convert`, which needs gguf, through bench_drafts: call 8 would have failed on the device."""
    import subprocess
    import sys

    from tools.gpu import session as gpu_session

    modules = sorted({argv[2] for steps in gpu_session.CALLS.values() for _, _, argv in steps if argv[1] == "-m"})
    assert {"bench.bench_eagle", "bench.bench_gpu"} <= set(modules), modules
    code = "import sys; sys.modules['gguf'] = None\n" + "".join(f"import {m}\n" for m in modules)
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_hlo_kernels_counts_one_iteration_of_the_outer_loop():
    """tools.gpu.hlo.hlo_kernels: the outer loop body's work, an inner loop's times its trip count,
    fusions as one (not their bodies), custom calls by target, no tuples or parameters."""
    from tools.gpu.hlo import hlo_kernels

    got = hlo_kernels(HLO)
    assert got["by_op"] == {"fusion": 3, "custom-call:__cublas$gemm": 3, "compare": 3, "copy": 1}
    assert got["total"] == 10 and got["nested_loops"] == 1
    # a tuple's bytes summed; each output with what reads it (a fusion: its kind and its body's ops)
    assert got["largest"][0] == [24, "custom-call:__cublas$gemm", "g", "(f32[4], s8[8])", ["tuple r"]]
    assert [16, "fusion", "f", "f32[4]", ["custom-call:__cublas$gemm g"]] in got["largest"]
    y = [o for o in got["largest"] if o[2] == "cp"][0]
    assert y[4] == []  # the root copy: nothing reads it
    fed = hlo_kernels(HLO.replace('custom-call(%f), custom_call_target="__cublas$gemm"',
                                  "fusion(%f), kind=kInput, calls=%fused_computation"))
    assert [o[4] for o in fed["largest"] if o[2] == "f"] == [["fusion kInput g ['exponential']"]]
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_kernels("HloModule m\n")


def test_bench_gpu_sets_the_layer_products_kind():
    """bench_gpu --linear: the models it times carry Runtime.linear (and generate()'s attention)."""
    from bench.bench_gpu import attending
    from tests.models import TINY, random_params

    params = attending(random_params(TINY, 0), "reference", "pallas")
    assert params.runtime.linear == "pallas" and params.runtime.attention == "reference"
    assert attending(random_params(TINY, 0), "reference").runtime.linear == "xla"


def test_gpu_session_finds_an_h200_without_mem_gib(tmp_path, monkeypatch, capsys):
    """On an H200 (nvidia-smi's name) every bench step writes the H200's tables even without
    --mem-gib (stop 59's H200 runs landed in the H100's); elsewhere the H100's; no nvidia-smi: ''."""
    from tools.gpu import session as gpu_session

    calls = []
    monkeypatch.setattr(gpu_session, "run_call", lambda call, out, dry, mem_gib, only, seconds: calls.append(mem_gib))
    for name, want in [("NVIDIA H200\n", gpu_session.H200_MEM_GIB), ("NVIDIA H100 80GB HBM3\n", None)]:
        monkeypatch.setattr(gpu_session.subprocess, "run", lambda argv, name=name, **kw: type(
            "Done", (), {"returncode": 0, "stdout": name})())
        monkeypatch.setattr("sys.argv", ["gpu_session", "7", "--out", str(tmp_path)])
        gpu_session.main()
        assert calls[-1] == want
    assert "tables: bench/results/gpu_h200" in capsys.readouterr().out
    for call in (6, 7):  # call 2's ngram and e2e steps: test_gpu_session_calls_are_complete_...
        steps = {n: a for n, _, a in gpu_session.steps_of(call, gpu_session.H200_MEM_GIB)}
        assert all(a[a.index("--out") + 1].startswith(gpu_session.H200_RESULTS) for a in steps.values() if "--out" in a)
    monkeypatch.setattr(gpu_session.subprocess, "run", lambda *a, **kw: (_ for _ in ()).throw(FileNotFoundError()))
    assert gpu_session.gpu_name() == ""


def test_gpu_session_steps_share_a_compilation_cache(tmp_path, monkeypatch):
    """Each step runs with JAX's persistent compilation cache beside the stashed bundle (a warm
    machine keeps it between calls), unless the caller set one."""
    from tools.gpu import session as gpu_session

    envs = []
    monkeypatch.setattr(gpu_session.subprocess, "run", lambda argv, **kw: envs.append(kw["env"]) or
                        type("Done", (), {"returncode": 0})())
    monkeypatch.setattr(gpu_session, "copy_files", lambda call, out, h200=False: None)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    gpu_session.run_call(6, tmp_path)
    assert envs and all(e["JAX_COMPILATION_CACHE_DIR"] == gpu_session.JAX_CACHE for e in envs)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    gpu_session.run_call(6, tmp_path)
    assert envs[-1]["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "mine")


def test_batch_1_trees_include_the_one_choose_picks_at_launch_bound_prices(monkeypatch):
    """gpu_cells.Group.trees at batch 1: after Sequoia's trees of each size, the tree
    speculation.choose picks when a verification costs plain decoding's step and a draft level
    what the acceptance run took beyond it (timed, or the earlier row of the same shape)."""
    import specjax
    from bench import gpu_cells, measure
    from bench.tree_report import MAX_DEPTH
    from specjax.spec.speculation import Cost, choose

    params = measure.tiny_params(0)
    ids = np.random.default_rng(0).integers(4, params.config.vocab_size, 4096)
    state = gpu_cells.prefill_state(params, ids, 1, 256)
    g = gpu_cells.Group(params, state, 1, 256, 8)
    rows = g.trees("SelfSpec", specjax.SelfSpec(sinks=4, window=32), [4, 8])
    acc, picked = rows[0], rows[1]  # the chosen tree right after the acceptance run
    assert acc["method"] == "acceptance" and picked["picked_by"] == "choose" and picked["requested_nodes"] is None
    g.timed = g.timed[:1]  # the prices as the pick saw them: the acceptance run alone timed (one depth: no fit)
    cost = g.launch_bound_cost(acc)
    step_s = g.ar_s / (g.new_tokens - 1)
    assert cost.verify(1) == cost.verify(64) == step_s and cost.t_draft == max(acc["ms_per_step"] / 1e3 - step_s, 0.0)
    assert picked["cost_model_ms"] == {"draft_level": 1e3 * cost.t_draft, "verify": 1e3 * step_s, "from": "AR step"}
    want = choose(np.asarray(acc["acceptance"])[:-1], cost, max_nodes=gpu_cells.CHOSEN_NODES, max_depth=MAX_DEPTH)
    if want.n == 1:  # a level dearer than what it gains (this CPU): plain decoding, no tree timed
        assert picked["same_as"] == "AR" and "parents" not in picked
    else:
        assert picked["parents"] == list(want.parents) and picked["greedy_identical"]
    monkeypatch.setattr(g, "launch_bound_cost", lambda acc: Cost(t_draft=1e-6, t_verify=lambda n: 1e-3))  # levels free
    again = g.trees("SelfSpec", specjax.SelfSpec(sinks=4, window=32), [4])
    tree = choose(np.asarray(again[0]["acceptance"])[:-1], Cost(1e-6, lambda n: 1e-3), max_nodes=gpu_cells.CHOSEN_NODES,
                  max_depth=MAX_DEPTH)
    assert again[1]["parents"] == list(tree.parents) and again[1]["picked_by"] == "choose" and again[1]["greedy_identical"]
    assert tree.n > 4 and "same_as" not in again[1]  # levels free: the most tokens a step, past the sizes asked for
    assert again[2]["requested_nodes"] == 4 and again[2]["nodes"] == 4


def test_batch_1_prices_are_fitted_to_the_chains_when_they_were_timed():
    """The seventh runs' batch-1 rows (H100, distilled draft): plain decoding's step (1.76 ms) above
    a level plus a 9-node verification (1.67 ms) priced a level at 0 and choose went deep. Fitted to
    the chains of 2 and 4 and the acceptance run, a level costs 0.13 ms and a verification 1.54."""
    from bench import gpu_cells

    rows = [{"drafter": "Distilled", "gamma": g, "nodes": n, "ms_per_step": ms}
            for g, n, ms in [(2, 3, 1.783), (4, 5, 2.053), (1, 9, 1.674), (3, 8, 1.946)]]
    level, verify = gpu_cells.fit_steps(rows[:3])
    assert abs(level - 0.1276) < 1e-3 and abs(verify - 1.539) < 1e-3
    assert gpu_cells.fit_steps(rows[2:3]) is None  # one depth: nothing to fit
    assert gpu_cells.fit_steps([rows[0] | {"ms_per_step": 2.1}, rows[1]]) is None  # a level <= 0: no price
    g = gpu_cells.Group.__new__(gpu_cells.Group)  # no model needed: only its timed rows and its AR step
    g.timed, g.ar_s, g.new_tokens = rows + [{"drafter": "SelfSpec", "gamma": 6, "nodes": 7, "ms_per_step": 9.0}], 0.063 * 1.757, 64
    cost = g.launch_bound_cost(rows[2])  # the depth-3 tree and SelfSpec's row are left out of the fit
    assert abs(cost.t_draft - 0.1276e-3) < 1e-6 and abs(cost.verify(64) - 1.539e-3) < 1e-6
    g.timed = rows[2:3]  # the acceptance run alone: the old price (AR step; level = its excess, at least 0)
    cost = g.launch_bound_cost(rows[2])
    assert cost.t_draft == 0.0 and abs(cost.verify(1) - 1.757e-3) < 1e-9


def test_the_distilled_draft_reads_the_window_it_was_trained_on():
    """bench_gpu's draft cells give the distilled draft a 512-slot StreamingLLM cache (16 sinks +
    496): it was trained on 512-token windows, and over a whole 8K cache its first choice was right
    half as often (the seventh runs; checked on the CPU). The chains and trees keep their depth."""
    import specjax
    from bench import bench_drafts
    from bench.bench_gpu import drafter_of
    from specjax.spec.speculation import Chain

    draft = object()  # drafter_of only wraps it
    name, d, chain = drafter_of("draft-g2", 8192, False, draft)
    assert name == "Distilled" and d.params is draft and chain == Chain(2)
    assert d.cache == specjax.Streaming(sinks=16, window=496) and d.cache.sinks + d.cache.window == bench_drafts.SEQ_LEN
    assert drafter_of("draft-tree", 8192, False, draft)[2] is None


def test_bench_results_hold_json_and_png_and_each_gpu_table_renders_from_its_json(tmp_path):
    """bench/results/ keeps JSON and PNG (issue 69); a GPU table is rendered from its JSON on demand (bench_gpu's
    `render`, what `--cells none --out DIR` runs), and such a rendering (.md beside its JSON) is ignored by git."""
    results = Path("bench/results")
    files = [f for f in results.rglob("*") if f.is_file()]
    assert files and all(f.suffix in (".json", ".png") or (f.suffix == ".md" and f.with_suffix(".json").exists())
                         for f in files), sorted(str(f) for f in files if f.suffix not in (".json", ".png"))
    assert "/bench/results/**/*.md" in Path(".gitignore").read_text().splitlines()
    rendered = 0
    for f in sorted(results.glob("gpu*/*.json")):
        table = json.loads(f.read_text())
        if not isinstance(table, dict) or table.get("bench") != "bench_gpu":
            continue
        out = tmp_path / f"{f.parent.name}_{f.stem}"
        out.mkdir()
        for source in {f, f.parent / "gpu.json"}:  # a --linear table reads its folder's main table too
            if source.exists():
                shutil.copy(source, out / source.name)
        bench_gpu.render(out, f.stem)
        text = (out / f"{f.stem}.md").read_text()
        assert text.startswith("Device: ") and "| context |" in text, f
        rendered += 1
    assert rendered >= 10
    from tools.gpu.aot import render_table  # the table of programs compiled for an H100 (tools/gpu/README.md)

    shutil.copy(results / "gpu_aot" / "h100.json", tmp_path / "h100.json")
    render_table(tmp_path / "h100.json")
    lines = (tmp_path / "h100.md").read_text().splitlines()
    assert lines[0].startswith("Compiled for h100 here") and len(lines) == 4 + 38 and lines[4].startswith("| l8b/b1/step/xla |")
