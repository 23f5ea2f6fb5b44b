"""Resume bookkeeping found by the training audit: the distance_weighted miner's generator
travels in checkpoints.
Each test trains a tiny CNN on synthetic 8x8 images for about a second on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.data.base import ArrayDataset
from dmlkit.miners.pair_miners import DistanceWeightedMiner
from dmlkit.training import config_from_dict, read_checkpoint, train
from dmlkit.training.checkpoint import save_checkpoint

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:training did not beat the untrained model")]


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


def _weights(path):
    return read_checkpoint(path)["model"]


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


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
        _assert_same_weights(_weights(tmp_path / "full" / "checkpoints" / name),
                             _weights(tmp_path / "resumed" / "checkpoints" / name))


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
