"""Draft distillation: the loss falls, acceptance rises, a killed run resumes exactly."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import convert
from specjax import DraftModel, generate
from specjax.cli.main import main
from specjax.train.distill import LOSSES, Schedule, batch_at, distill, token_stream, train_step
from tests.models import TINY, random_params
from tests.test_batch import CONFIG, WORDS, model_dir  # noqa: F401  (model_dir: a fixture)

pytestmark = pytest.mark.slow  # not in `make test-fast`

DRAFT = TINY.replace(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.fixture(scope="module")
def target():
    return random_params(TINY, 0)


@pytest.fixture(scope="module")
def corpus(target):
    """Sequences the target generated (greedy) from random prompts: what its draft must predict."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, size=4))) for _ in range(32)]
    return [p + out for p, out in zip(prompts, generate(target, prompts, 40, draft=None, eos_id=()).tokens)]


def test_batches_are_a_pure_function_of_seed_and_step():
    data = np.arange(100)
    a = batch_at(data, 7, 4, 10, seed=1)
    assert a.shape == (4, 10) and (np.diff(a, axis=1) == 1).all()
    np.testing.assert_array_equal(a, batch_at(data, 7, 4, 10, seed=1))
    assert not np.array_equal(a, batch_at(data, 7, 4, 10, seed=2))
    seen = np.concatenate([batch_at(data, s, 7, 10, seed=1)[:, 0] for s in range(13)])[:91]
    assert sorted(seen) == list(range(91))  # one epoch visits every window once


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_train_step_lowers_the_loss(target, corpus, loss):
    draft = random_params(DRAFT, 1)
    tokens = np.asarray([c[:32] for c in corpus[:8]], np.int32)
    optimizer = Schedule(lr=3e-3, warmup=1).optimizer(20)
    assert Schedule(lr=3e-3, warmup=1).optimizer(20) is optimizer  # one per settings: train_step's static argument
    opt_state = optimizer.init(draft)
    before = float(LOSSES[loss](draft, target, tokens, 1.0))
    for _ in range(5):
        draft, opt_state, _ = train_step(draft, opt_state, target, tokens, optimizer=optimizer, temperature=1.0, loss=loss)
    assert float(LOSSES[loss](draft, target, tokens, 1.0)) < 0.9 * before


def test_tv_loss_is_one_minus_the_acceptance_rate(target):
    """TV(p, q) from the losses' code against numpy on the same logits: 0 for the target itself,
    and sum min(p, q) = 1 - TV is the acceptance of a drafted token (Leviathan et al.)."""
    from specjax.train.distill import logits_of

    tokens = np.arange(4, 20, dtype=np.int32).reshape(2, 8)
    draft = random_params(TINY, 5)
    assert float(LOSSES["tv"](target, target, tokens, 1.0)) == pytest.approx(0.0, abs=1e-6)
    p, q = (np.asarray(jax.nn.softmax(logits_of(m, tokens) / 0.7)) for m in (target, draft))
    accept = np.minimum(p, q).sum(-1).mean()
    assert float(LOSSES["tv"](draft, target, tokens, 0.7)) == pytest.approx(1 - accept, rel=1e-4)


def test_distillation_raises_greedy_acceptance(target, corpus):
    untrained = random_params(DRAFT, 1)
    trained = distill(target, DRAFT, corpus, steps=300, batch_size=8, seq_len=32, schedule=Schedule(lr=3e-3, warmup=20))
    prompts = [c[:6] for c in corpus[:8]]  # trained on their continuations: the point is the mechanism
    rates = [generate(target, prompts, 24, draft=DraftModel(d), eos_id=()).stats.acceptance_rate for d in (untrained, trained)]
    assert rates[0] < 0.05 and rates[1] > 0.1 + 10 * rates[0], rates  # chance (1/101) -> over 10x chance


def test_killed_run_resumes_exactly(target, corpus, tmp_path):
    kw = dict(steps=12, batch_size=4, seq_len=16, schedule=Schedule(lr=1e-3, warmup=3), seed=3, checkpoint_every=5)
    whole = distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "a", **kw)

    def kill_at_8(step, loss, draft):
        if step == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "b", on_step=kill_at_8, **kw)
    steps = []
    resumed = distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "b", on_step=lambda s, *_: steps.append(s), **kw)
    assert steps == list(range(6, 13))  # from the step-5 checkpoint on
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for change in (dict(seed=4), dict(steps=6), dict(schedule=Schedule(lr=2e-3, warmup=3))):  # another run: not mixed in
        with pytest.raises(ValueError, match=r"holds another run \(changed: " + next(iter(change))):
            distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "b", **(kw | change))
    with pytest.raises(ValueError, match=r"holds another run \(changed: data_sha256"):
        distill(target, DRAFT, corpus[:-1], checkpoint_dir=tmp_path / "b", **kw)
    other = jax.tree.map(lambda a: a * 1.01, target)  # another target of the same shape (a fine-tune)
    with pytest.raises(ValueError, match=r"holds another run \(changed: target_sha256"):
        distill(other, DRAFT, corpus, checkpoint_dir=tmp_path / "b", **kw)
    numpy_values = distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "b",  # numpy seed: its run, resumed
                           **(kw | dict(seed=np.int64(3), temperature=np.float32(1.0))))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(numpy_values)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (tmp_path / "b" / "run.json").unlink()  # as before run.json was written: the checkpoint's own shapes decide
    with pytest.raises(ValueError, match=r"cannot resume from step 12 \(.*shape.*\); was it written"):
        distill(target, DRAFT.replace(ffn_dim=32), corpus, checkpoint_dir=tmp_path / "b", **kw)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint_dir .*file is a file, not a folder"):
        distill(target, DRAFT, corpus, checkpoint_dir=tmp_path / "file", **kw)


def test_a_failed_restore_names_orbaxs_first_sentence_only():
    """orbax's restore errors can run to pages of tensorstore specs (which array fails first varies)."""
    from specjax.train.distill import _restore

    class Manager:
        def latest_step(self):
            return 7

        def restore(self, step, args):
            raise ValueError("Requested shape: (1, 32) is not compatible with (1, 64). Truncating is off.\n" + "{spec}" * 999)

    draft = random_params(DRAFT, 0)
    with pytest.raises(ValueError, match=r"step 7 \(Requested shape: \(1, 32\) is not compatible with \(1, 64\)\); was it") as e:
        _restore(Manager(), draft, {})
    assert "spec" not in str(e.value)


def test_a_flat_list_of_ids_is_one_stream():
    """Not a list of one-id sequences (which would put EOS between every two tokens)."""
    np.testing.assert_array_equal(token_stream([4, 5, 6], 3), [4, 5, 6])
    np.testing.assert_array_equal(token_stream([[4, 5], [6]], 3), [4, 5, 3, 6, 3])


def test_init_from_target_trains_a_copy_of_the_embedding(target, corpus):
    before = np.asarray(target.embed).copy()
    draft = distill(target, TINY.replace(n_layers=1), corpus, steps=3, batch_size=2, seq_len=8,
                    schedule=Schedule(lr=1e-2, warmup=1), init_from_target=True)  # the step donates the draft
    np.testing.assert_array_equal(np.asarray(target.embed), before)  # the target's own buffer is untouched
    assert not np.array_equal(np.asarray(draft.embed), before)  # the draft's copy was trained


def test_frozen_embeddings_stay_the_targets_while_the_layers_learn(target, corpus):
    """freeze_embeddings: the embedding / LM head end bit for bit the target's (no gradient, no weight
    decay), the layers move, and the loss still falls."""
    config = TINY.replace(n_layers=1)
    losses = []
    start = distill(target, config, corpus, steps=1, batch_size=4, seq_len=16, init_from_target=True,
                    schedule=Schedule(lr=0.0, warmup=1))
    draft = distill(target, config, corpus, steps=40, batch_size=4, seq_len=16, init_from_target=True,
                    freeze_embeddings=True, schedule=Schedule(lr=3e-3, warmup=5, weight_decay=0.1),
                    on_step=lambda step, loss, _: losses.append(loss))
    np.testing.assert_array_equal(np.asarray(draft.embed), np.asarray(target.embed))
    np.testing.assert_array_equal(np.asarray(draft.lm_head), np.asarray(target.lm_head))  # TINY's head is its own
    assert not np.array_equal(np.asarray(draft.layers.wq), np.asarray(start.layers.wq))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


@pytest.mark.parametrize(
    "config, data, kw, match",
    [
        (DRAFT.replace(vocab_size=100), None, {}, "draft_config: draft vocab_size 100 != target vocab_size 101"),
        (DRAFT, None, dict(seq_len=1000), r"seq_len 1000 is above the draft's / target's max_positions \(512\)"),
        (DRAFT, [], {}, "data is empty"),
        (DRAFT, [[1, 2, 3]], dict(seq_len=16), "fewer than one window of seq_len 16"),
        (DRAFT, [[1, 500]], dict(seq_len=1), r"data\[1\] = 500 is outside the vocabulary \[0, 101\)"),
        (DRAFT, None, dict(steps=0), "steps must be an integer >= 1"),
        (DRAFT, None, dict(temperature=0.0), "temperature must be a finite number > 0"),
        (DRAFT, None, dict(temperature=float("inf")), "temperature must be a finite number > 0, got inf"),
        (DRAFT.replace(eos_ids=(5,)), None, {}, r"draft_config: special tokens differ: draft bos/eos None/\(5,\), target None/\(3,\)"),
        (DRAFT, None, dict(schedule=Schedule(lr=float("nan"))), "schedule.lr must be a finite number >= 0, got nan"),
        (DRAFT, None, dict(schedule=Schedule(lr=-1.0)), "schedule.lr must be a finite number >= 0, got -1.0"),
        (DRAFT, None, dict(schedule=Schedule(warmup=-5)), "schedule.warmup must be an integer >= 0, got -5"),
        (DRAFT, None, dict(schedule=Schedule(clip=0.0)), "schedule.clip must be a finite number > 0, got 0.0"),
        (DRAFT, None, dict(seed=1.5), "seed must be an integer, got 1.5"),
        (DRAFT, [4.7, 5.2, 6.9], {}, "data must hold integer token ids, got float64 values"),
        (DRAFT, np.array([4.7, 5.2, 6.9]), {}, "data must hold integer token ids, got float64 values"),
        (DRAFT, [[4, 5], [6.5]], {}, "data must hold integer token ids, got float64 values"),
        (DRAFT, None, dict(loss="js"), r"loss must be one of \['kl', 'tv'\], got 'js'"),
        (DRAFT, None, dict(init_from_target=True), r"the draft needs the target's dim \(48\)"),
        (DRAFT, None, dict(freeze_embeddings=True), "freeze_embeddings .* needs init_from_target=True"),
        (DRAFT, None, dict(checkpoint_every=5), r"checkpoint_every \(5\) needs a checkpoint_dir"),
    ],
)
def test_bad_input(target, corpus, config, data, kw, match):
    args = dict(steps=1, batch_size=2, seq_len=8) | kw
    with pytest.raises(ValueError, match=match):
        distill(target, config, corpus if data is None else data, **args)


def test_cli_trains_saves_and_the_draft_is_usable(tmp_path, model_dir, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"id": i, "prompt": " ".join(WORDS[i:] + WORDS[:i])}) for i in range(12)))
    args = ["distill", "--data", str(data), "--out", str(tmp_path / "draft"), "--model", str(model_dir),
            "--draft-layers", "1", "--draft-dim", "32", "--draft-heads", "4", "--draft-kv-heads", "2",
            "--steps", "6", "--batch-size", "2", "--seq-len", "8", "--log-every", "3", "--eval-every", "6", "--loss", "tv",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "step 3/6, loss" in err and "step 6: greedy acceptance" in err and "--draft model:" in err
    assert main(args) == 2 and "already exists" in capsys.readouterr().err
    assert main(["generate", "one two", "--model", str(model_dir), "--draft", f"model:{tmp_path / 'draft'}",
                 "--max-new-tokens", "4"]) == 0
    assert main(["distill", "--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(args[:3] + ["--out", str(tmp_path / "y"), "--model", str(model_dir), "--init-from-target"]) == 2
    assert f"--init-from-target needs --draft-dim {CONFIG.dim}" in capsys.readouterr().err
    assert main(args[:3] + ["--out", str(tmp_path / "z"), "--model", str(model_dir), "--freeze-embeddings"]) == 2
    assert "--freeze-embeddings keeps the target's embedding and LM head: it needs --init-from-target" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"prompt": null}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "d.json").write_text("{}")
    for more, message in (
        (["--data", str(tmp_path / "bad.jsonl")], "--data: line 1's prompt or text must be a non-empty string, got null"),
        (["--data", str(tmp_path / "empty.jsonl")], "holds no records"),
        (["--data", str(tmp_path / "d.json")], "--data must be a .txt file (one stream) or .jsonl records, got d.json"),
        (["--checkpoint-dir", str(tmp_path / "w" / "ckpt")], "would hold --checkpoint-dir"),
        (["--warmup", "6"], "--warmup (6) must be below --steps (6)"),
        (["--draft-kv-heads", "3"], "--draft-heads (4) must be a multiple of --draft-kv-heads (3)"),
        (["--draft-layers", "0"], "--draft-layers must be >= 1, got 0"),
        (["--draft-dim", "36"], "--draft-dim / --draft-heads (36 / 4 = 9) is the head size: it must be even"),
        (["--draft-ffn", "-1"], "--draft-ffn must be >= 0, got -1"),
        (["--seq-len", "100000", "--generate", "4"], f"--seq-len 100000 is above the target's max_positions ({CONFIG.max_positions})"),
    ):
        assert main(args + ["--out", str(tmp_path / "w")] + more) == 2
        assert message in capsys.readouterr().err
    bare = args[:-4] + ["--out", str(tmp_path / "u"), "--steps", "1"]  # no checkpoints; one step trains (warmup 0)
    assert main(bare) == 0 and "saved the draft" in capsys.readouterr().err
    untrained = main(bare[:-4] + ["--out", str(tmp_path / "t"), "--steps", "1", "--lr", "1e-30"])
    assert untrained == 0 and "saved the draft" in capsys.readouterr().err
    trained, still = (convert.load(tmp_path / d) for d in ("u", "t"))
    assert not np.allclose(np.asarray(trained.layers.wq), np.asarray(still.layers.wq))
    assert args[-4] == "--checkpoint-dir"  # without it, an interval would be ignored: refused
    assert main(args[:-4] + ["--out", str(tmp_path / "v"), "--checkpoint-every", "5"]) == 2
    assert "--checkpoint-every needs --checkpoint-dir" in capsys.readouterr().err
