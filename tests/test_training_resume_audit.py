"""Resume and stop bookkeeping found by the training audit: the distance_weighted miner's
generator travels in checkpoints, a larger patience continues a patience-stopped run,
best.pt and metrics.json agree after a kill at any point, a resume with no epoch left stops
with reason "epochs", and an epoch cut short by max_steps is not counted as completed.
Each test trains a tiny CNN on synthetic 8x8 images for about a second on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dmlkit.data.base import ArrayDataset
from dmlkit.metrics.scoring import SCORING_REVISION, scoring_stamp
from dmlkit.miners.pair_miners import DistanceWeightedMiner
from dmlkit.training import config_from_dict, read_checkpoint, read_log, train
from dmlkit.training.checkpoint import save_checkpoint
from dmlkit.training.loop import Trainer
from test_training import _assert_same_state, _state

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:training did not beat the untrained model")]
_real_save_best = Trainer.save_best


class Killed(Exception):
    """A kill injected at a chosen point of the run."""


def images(n_classes: int, per: int, seed: int, offset: int = 0) -> ArrayDataset:
    """``per`` noisy copies of one random 8x8 prototype per class (learnable, deterministic)."""
    rng = np.random.default_rng(seed)
    protos = rng.random((n_classes, 8, 8))
    x = np.clip(np.repeat(protos, per, axis=0) + 0.3 * rng.standard_normal((n_classes * per, 8, 8)), 0, 1)
    return ArrayDataset((x * 255).astype(np.uint8), np.repeat(np.arange(n_classes) + offset, per))


TRAIN, VAL = images(10, 6, seed=0), images(5, 6, seed=1, offset=100)


def make_config(**overrides):
    cfg = config_from_dict({
        "name": "audit", "seed": 3,
        "data": {"dataset": "omniglot"},
        "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8]}, "pretrained": False,
                  "in_channels": 1, "embedding_size": 8, "freeze_batchnorm": False},
        "loss": {"name": "triplet", "params": {"margin": 0.2}},
        "optimizer": {"preset": "cpu_quick"},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 3, "batches_per_epoch": 3},
        "training": {"epochs": 3, "device": "cpu", "log_every": 1},
    })
    return cfg.override(overrides) if overrides else cfg


def run(cfg, path, **kwargs):
    return train(cfg, path, train_set=TRAIN, val_set=VAL, progress=False, **kwargs)


def val_map(monkeypatch, value_of_step) -> None:
    """Validation MAP@R as a function of the step (the other metrics are the real ones)."""
    real = Trainer.val_metrics

    def fake(self):
        metrics = real(self)
        return None if metrics is None else {**metrics, "map_at_r": float(value_of_step(self.state.step))}

    monkeypatch.setattr(Trainer, "val_metrics", fake)


def kill_in(monkeypatch, name: str, when, before=None) -> None:
    """Raise :class:`Killed` on entering ``Trainer.<name>`` when ``when(trainer)`` holds (after
    calling ``before(trainer)`` if given)."""
    real = getattr(Trainer, name)

    def dying(self):
        if when(self):
            if before is not None:
                before(self)
            raise Killed
        return real(self)

    monkeypatch.setattr(Trainer, name, dying)




# -- 1. the distance_weighted miner's generator --------------------------------------------------
def test_distance_weighted_state_dict_carries_the_generator():
    emb = torch.nn.functional.normalize(torch.randn(24, 6, generator=torch.Generator().manual_seed(0)), dim=1)
    labels = torch.arange(24) % 4
    miner = DistanceWeightedMiner(seed=5)
    miner(emb, labels)
    state = miner.state_dict()
    expected = miner(emb, labels)[2]
    again = DistanceWeightedMiner(seed=5)
    again.load_state_dict(state)
    assert torch.equal(again(emb, labels)[2], expected)  # continues, does not restart from seed
    old = DistanceWeightedMiner(seed=5)
    old.load_state_dict({})  # a state dict from before the generators were saved: from the seed
    assert torch.equal(old(emb, labels)[2], DistanceWeightedMiner(seed=5)(emb, labels)[2])
    # a state saved on a device this process does not use is kept for a later save, not applied
    elsewhere = {"_extra_state": {"cuda:0": torch.arange(16, dtype=torch.uint8), **state["_extra_state"]}}
    again.load_state_dict(elsewhere)
    kept = again.state_dict()["_extra_state"]
    assert torch.equal(kept["cuda:0"], elsewhere["_extra_state"]["cuda:0"])
    assert torch.equal(kept["cpu"], state["_extra_state"]["cpu"])


@pytest.mark.parametrize("memory", [None, 24], ids=["miner", "cross_batch_memory"])
def test_resume_with_the_distance_weighted_miner_is_bit_identical(tmp_path, memory):
    cfg = make_config(**{"miner": {"name": "distance_weighted"}, "loss.cross_batch_memory": memory})
    run(cfg, tmp_path / "full")
    run(cfg.override(["training.epochs=1"]), tmp_path / "resumed")
    run(cfg, tmp_path / "resumed", resume=True)
    for name in ("last.pt", "best.pt"):
        _assert_same_state(_state(tmp_path / "full" / "checkpoints" / name),
                           _state(tmp_path / "resumed" / "checkpoints" / name))


def test_a_checkpoint_without_the_miners_generator_still_resumes(tmp_path):
    cfg = make_config(**{"miner": {"name": "distance_weighted"}, "loss.cross_batch_memory": 24,
                         "training.epochs": 1})
    run(cfg, tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    payload = read_checkpoint(last)
    assert "_extra_state" in payload["miner"] and "miner._extra_state" in payload["loss"]
    del payload["miner"]["_extra_state"], payload["loss"]["miner._extra_state"]  # as written before
    payload.pop("format")
    save_checkpoint(payload, last)
    result = run(cfg.override(["training.epochs=2"]), tmp_path / "run", resume=True)
    assert result.epochs_completed == 2 and result.steps == 6


def test_a_resume_of_a_best_scored_by_another_dmlkit_warns(tmp_path, recwarn):
    """The resumed best validation MAP@R, which the coming evaluations must beat, was scored by
    an older dmlkit (no "scoring" in last.pt): its metric code may differ in the last digits, so
    a resume says so once (and goes on); one this dmlkit scored says nothing."""
    cfg = make_config(**{"training.epochs": 1})
    run(cfg, tmp_path / "run")
    run(cfg.override(["training.epochs=2"]), tmp_path / "run", resume=True)
    assert not [w for w in recwarn if "scored by" in str(w.message)]
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    payload = read_checkpoint(last)
    assert payload.pop("scoring") == scoring_stamp()
    payload.pop("format")
    save_checkpoint(payload, last)  # as an older dmlkit wrote it
    result = run(cfg.override(["training.epochs=3"]), tmp_path / "run", resume=True)
    said = [str(w.message) for w in recwarn if "scored by" in str(w.message)]
    assert result.epochs_completed == 3 and len(said) == 1, said
    assert "scored by an older dmlkit, which did not record its version" in said[0]
    assert f"scoring revision {SCORING_REVISION}" in said[0]


# -- 2. more patience on resume ----------------------------------------------------------------
def test_a_larger_patience_continues_a_run_that_patience_stopped(tmp_path, monkeypatch):
    val_map(monkeypatch, lambda step: 0.5)  # never improves after the first evaluation
    cfg = make_config(**{"training.epochs": 10, "training.patience": 1})
    first = run(cfg, tmp_path / "run")
    assert (first.stop_reason, first.epochs_completed) == ("patience", 2)
    same = run(cfg, tmp_path / "run", resume=True)  # the same patience: nothing left to train
    assert (same.stop_reason, same.steps) == ("patience", 6)
    more = run(cfg.override(["training.patience=3"]), tmp_path / "run", resume=True)
    assert (more.stop_reason, more.epochs_completed, more.steps) == ("patience", 4, 12)


def test_more_epochs_do_not_revive_a_run_whose_patience_ran_out(tmp_path, monkeypatch):
    """Was: a run that ended its epochs with its patience used up trained on when resumed with
    more epochs (one epoch more than an uninterrupted run with the same settings)."""
    val_map(monkeypatch, lambda step: 0.9 if step == 6 else 0.5)  # worse again at the last epoch
    cfg = make_config(**{"training.epochs": 3, "training.patience": 1})
    first = run(cfg, tmp_path / "run")
    assert first.steps == 9
    longer = cfg.override(["training.epochs=6"])
    resumed = run(longer, tmp_path / "run", resume=True)
    fresh = run(longer, tmp_path / "fresh")
    assert (resumed.stop_reason, resumed.steps) == (fresh.stop_reason, fresh.steps) == ("patience", 9)


# -- 3. best.pt and the best record after a kill ------------------------------------------------
def _assert_best_agrees(run_dir):
    best = read_checkpoint(run_dir / "checkpoints" / "best.pt")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert best["step"] == metrics["best_step"] == best["trainer"]["best_step"]
    assert best["trainer"]["best_map"] == metrics["val"]["map_at_r"]
    return best, metrics


def test_a_kill_while_writing_last_pt_at_a_new_best_leaves_best_pt_and_metrics_agreeing(tmp_path, monkeypatch):
    val_map(monkeypatch, lambda step: step / 100)  # every evaluation is a new best
    kill_in(monkeypatch, "save_last", lambda t: t.state.epoch == 2)
    with pytest.raises(Killed):
        run(make_config(), tmp_path / "run")
    monkeypatch.undo()
    # a continuation that is not bit-identical (another device, world size, ...): no new best
    val_map(monkeypatch, lambda step: 0.0)
    run(make_config(), tmp_path / "run", resume=True)
    best, metrics = _assert_best_agrees(tmp_path / "run")
    assert metrics["best_step"] == 3


@pytest.mark.parametrize(("epoch", "best_step"), [(1, 3), (2, 6)])
def test_a_kill_between_last_pt_and_best_pt_writes_best_pt_again_on_resume(tmp_path, monkeypatch,
                                                                            epoch, best_step):
    """Killed after last.pt recorded a new best at ``epoch``, before best.pt was written (at
    epoch 1 there is no best.pt yet); the best model is the one of that epoch."""
    def best_at(step):
        return step / 100 if step <= best_step else 0.0

    val_map(monkeypatch, best_at)
    run(make_config(), tmp_path / "full")
    kill_in(monkeypatch, "save_best", lambda t: t.state.epoch == epoch)
    with pytest.raises(Killed):
        run(make_config(), tmp_path / "run")
    best_pt = tmp_path / "run" / "checkpoints" / "best.pt"
    assert not best_pt.exists() if epoch == 1 else read_checkpoint(best_pt)["step"] == 3
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["trainer"]["best_step"] == best_step
    monkeypatch.undo()
    val_map(monkeypatch, best_at)
    run(make_config(), tmp_path / "run", resume=True)
    best, metrics = _assert_best_agrees(tmp_path / "run")
    assert (metrics["best_step"], metrics["best_epoch"]) == (best_step, epoch)
    _assert_same_state(best["model"], _state(tmp_path / "full" / "checkpoints" / "best.pt"))
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert metrics == full


def test_a_best_pt_ahead_of_last_pt_is_adopted_as_the_best(tmp_path, monkeypatch):
    """What a kill between the two writes left when best.pt was written first."""
    val_map(monkeypatch, lambda step: step / 100)
    kill_in(monkeypatch, "save_last", lambda t: t.state.epoch == 2, before=_real_save_best)
    with pytest.raises(Killed):
        run(make_config(), tmp_path / "run")
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["step"] == 3
    monkeypatch.undo()
    val_map(monkeypatch, lambda step: 0.0)
    run(make_config(), tmp_path / "run", resume=True)
    best, metrics = _assert_best_agrees(tmp_path / "run")
    assert (metrics["best_step"], metrics["best_epoch"]) == (6, 2)
    assert metrics["val"]["map_at_r"] == pytest.approx(0.06)


# -- 5. a resume with no epoch left ------------------------------------------------------------
def test_a_resume_with_no_epoch_left_stops_with_reason_epochs(tmp_path, monkeypatch):
    real = Trainer.save_last

    def save_then_die(self):
        real(self)
        if self.state.epoch == 2:
            raise Killed

    monkeypatch.setattr(Trainer, "save_last", save_then_die)
    with pytest.raises(Killed):
        run(make_config(), tmp_path / "run")
    monkeypatch.undo()
    result = run(make_config(**{"training.epochs": 1}), tmp_path / "run", resume=True)
    assert (result.stop_reason, result.epochs_completed, result.steps) == ("epochs", 2, 6)


# -- 6. max_steps inside an epoch --------------------------------------------------------------
@pytest.mark.parametrize(("max_steps", "epochs", "partial"), [(4, 1, True), (3, 1, False)])
def test_an_epoch_cut_short_by_max_steps_is_not_counted_as_completed(tmp_path, max_steps, epochs, partial):
    result = run(make_config(**{"training.epochs": 5, "training.max_steps": max_steps}), tmp_path / "run")
    assert (result.stop_reason, result.steps) == ("max_steps", max_steps)
    assert (result.epochs_completed, result.partial_epoch) == (epochs, partial)
    evals = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["event"] == "eval"]
    assert evals[-1]["epoch"] == epochs and evals[-1]["step"] == max_steps
    assert evals[-1].get("partial_epoch", False) == partial
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["epochs_completed"], metrics["partial_epoch"]) == (epochs, partial)
    assert metrics["best_epoch"] <= epochs
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["epoch"] == epochs
