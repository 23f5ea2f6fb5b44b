"""``training.distributed_loss: local_anchors``: each rank computes its own anchors' terms, exactly.

Two levels:

* one process: the shares of a partition of the batch rows (:func:`local_share`), finished
  with the summed counts, give the loss and its gradient of ``loss_fn`` on the whole batch
  (float64, every supported loss/reduction/miner combination, uneven partitions);
* two real gloo processes (``torch.multiprocessing.spawn``) run :class:`dmlkit.training.Trainer`
  steps (synchronised BatchNorm, DDP) with the replicated and the sharded loss: per-step losses
  and final parameters equal the one-process run's (relative 1e-5), which also checks that the
  world-size factor is compensated exactly once.

Unsupported losses are refused with a ConfigError that names them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import get_loss
from dmlkit.losses.sharding import check_shardable, local_share, sharded_loss
from dmlkit.miners import get_miner

pytestmark = pytest.mark.usefixtures("one_thread")

# -- one process: shares of a partition sum to the loss ---------------------------------------
SHARE_CASES = [
    ("contrastive", {}, None),
    ("contrastive", {"reduction": "mean", "distance": "cosine", "pos_margin": 0.8,
                     "neg_margin": 0.3}, None),
    ("contrastive", {"distance_power": 2, "hinge_power": 2}, "batch_hard"),
    ("contrastive", {}, "multi_similarity"),
    ("contrastive", {"reduction": "pooled", "hinge_power": 2}, None),
    ("contrastive", {"reduction": "pooled"}, "batch_hard"),
    ("triplet", {"form": "ratio"}, None),  # the sorting path
    ("triplet", {"form": "ratio", "reduction": "batch_hard", "swap": True}, None),
    ("triplet", {"form": "ratio", "distance": "cosine", "swap": True}, None),
    ("triplet", {"form": "ratio", "reduction": "batch_all"}, "all_triplets"),
    ("triplet", {}, None),  # > 8 positives per anchor: the sorting path
    ("triplet", {"reduction": "batch_all"}, None),
    ("triplet", {"reduction": "batch_hard", "swap": True}, None),
    ("triplet", {"soft_margin": True, "distance": "cosine"}, None),
    ("triplet", {"swap": True}, None),
    ("triplet", {}, "batch_hard"),
    ("triplet", {"swap": True}, "semi_hard"),
    ("triplet", {"reduction": "batch_hard"}, "all_triplets"),
    ("triplet", {"reduction": "batch_all"}, "all_triplets"),
    ("triplet", {}, "multi_similarity"),
    ("multi_similarity", {}, None),
    ("multi_similarity", {}, "multi_similarity"),
    ("multi_similarity", {"distance": "euclidean"}, "batch_hard"),
]


def _batch(per_class: int = 10, classes: int = 6, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(classes).repeat_interleave(per_class)[torch.randperm(classes * per_class, generator=g)]
    return torch.randn(labels.numel(), dim, generator=g, dtype=torch.float64), labels


@pytest.mark.parametrize(("name", "params", "miner"), SHARE_CASES)
def test_shares_of_a_partition_sum_to_the_loss_and_its_gradient(name, params, miner):
    emb, labels = _batch()
    loss_fn = get_loss(name, **params)
    indices = get_miner(miner)(emb, labels) if miner else None
    x_ref = emb.clone().requires_grad_(True)
    ref = loss_fn(x_ref, labels, indices)
    ref.backward()
    x = emb.clone().requires_grad_(True)
    bounds = [(0, 7), (7, 31), (31, 31), (31, emb.shape[0])]  # uneven, one empty share
    shares = [local_share(loss_fn, x, labels, indices, a, b) for a, b in bounds]
    total = sum(s.counts for s in shares)
    parts = [s.finish(total) for s in shares]
    loss = torch.stack(parts).sum()
    loss.backward()
    assert float(ref.detach()) > 0
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-12)
    assert sum(float(p.detach()) != 0 for p in parts) >= 2  # the work really is split


def test_one_process_sharded_loss_is_the_loss():
    emb, labels = _batch()
    loss_fn = get_loss("triplet")
    torch.testing.assert_close(sharded_loss(loss_fn, emb, labels), loss_fn(emb, labels))


def test_a_batch_without_pairs_gives_a_zero_with_a_gradient():
    emb = torch.randn(4, 3, requires_grad=True)
    labels = torch.arange(4)  # no positive pair
    loss = sharded_loss(get_loss("triplet"), emb, labels)
    loss.backward()
    assert float(loss.detach()) == 0 and torch.count_nonzero(emb.grad) == 0


@pytest.mark.parametrize("name", ["arcface", "fastap", "lifted_structure", "ntxent", "margin"])
def test_other_losses_are_refused_by_name(name):
    kwargs = {"num_classes": 4, "embedding_size": 8} if name == "arcface" else {}
    with pytest.raises(ConfigError, match=f"'{name}'.*replicated"):
        check_shardable(get_loss(name, **kwargs), name)


def test_rows_outside_the_batch_are_a_shape_error():
    emb, labels = _batch()
    with pytest.raises(ShapeError, match="anchor rows"):
        local_share(get_loss("contrastive"), emb, labels, None, 5, emb.shape[0] + 1)


def test_the_trainer_refuses_an_unsupported_loss_and_cross_batch_memory(tmp_path):
    for loss in ({"name": "arcface"}, {"name": "triplet", "cross_batch_memory": 64}):
        config = _config("triplet", "batch_hard", "local_anchors").override({"loss": loss})
        with pytest.raises(ConfigError, match="local_anchors does not support"):
            _trainer(config, tmp_path)
        # and the preflight reports it, before a run directory is written
        from dmlkit.training.preflight import build_problems

        found = {p.key: p for p in build_problems(config, 10)}["training.distributed_loss"]
        assert "local_anchors does not support" in found.message and found.fit == "replicated"


# -- two gloo processes run the Trainer's steps ------------------------------------------------
TRAIN_CASES = [("triplet", "batch_hard"), ("contrastive", None), ("multi_similarity", "multi_similarity")]
MODES = ["replicated", "local_anchors"]
STEPS = 3
CLASSES, PER_CLASS, SIDE = 12, 8, 8


class _Images(torch.utils.data.Dataset):
    """Fixed random 1 x 8 x 8 images of 12 classes (class means + noise)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = np.repeat(np.arange(CLASSES) + 100, PER_CLASS)
        means = torch.randn(CLASSES, 1, SIDE, SIDE, generator=g)
        self.x = means.repeat_interleave(PER_CLASS, 0) + 0.8 * torch.randn(
            CLASSES * PER_CLASS, 1, SIDE, SIDE, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.x[i], int(self.labels[i])


def _config(loss: str, miner: str | None, mode: str):
    from dmlkit.config import config_from_dict

    return config_from_dict({
        "name": "shard", "seed": 5,
        "data": {"dataset": "binary_alphadigits"},
        "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8], "bn_neck": True},
                  "pretrained": False, "in_channels": 1, "embedding_size": 8,
                  "freeze_batchnorm": False},
        "loss": {"name": loss},
        **({"miner": {"name": miner}} if miner else {}),
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": STEPS},
        # plain SGD: the step is proportional to the gradient (Adam's would hide a scale error)
        "optimizer": {"preset": None, "name": "sgd", "trunk_lr": 0.05, "embedder_lr": 0.05,
                      "loss_lr": 0.05, "weight_decay": 0.0, "momentum": 0.9},
        "training": {"epochs": 1, "device": "cpu", "distributed_loss": mode},
    })


def _trainer(config, run_dir):
    from dmlkit.training.loop import Trainer
    from dmlkit.utils import seed_everything

    seed_everything(config.seed)  # as dmlkit.training.train does: the same initial weights
    return Trainer(config, run_dir, _Images(), None, device="cpu")


def _train(loss: str, miner: str | None, mode: str, run_dir: Path):
    """STEPS real ``Trainer.train_step`` calls on the sampler's batches: (losses, parameters)."""
    trainer = _trainer(_config(loss, miner, mode), run_dir)
    data = trainer.train_input
    trainer.train_module.train()
    trainer.sampler.set_epoch(0)
    losses = []
    for idx in trainer.sampler:
        x = data.x[list(idx)]
        y = torch.as_tensor(data.labels[list(idx)])
        losses.append(trainer.train_step(x, y))
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.run_log.close()
    return losses, state


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from dmlkit.distributed import init_distributed, shutdown

    init_distributed("cpu", timeout_s=120)
    results = {}
    for loss, miner in TRAIN_CASES:
        for mode in MODES:
            run = Path(out_dir) / f"{loss}-{mode}"
            results[f"{loss}|{mode}"] = _train(loss, miner, mode, run)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("shard")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _assert_same_state(state: dict, ref: dict, what: str) -> None:
    assert state.keys() == ref.keys()
    for key, value in ref.items():
        if value.is_floating_point():
            diff = float((state[key].double() - value.double()).norm())
            assert diff <= 1e-5 * max(float(value.double().norm()), 1e-3), (what, key, diff)
        else:
            assert torch.equal(state[key], value), (what, key)


@pytest.mark.parametrize(("loss", "miner"), TRAIN_CASES)
def test_two_ranks_local_anchors_equal_replicated_and_one_process(two_rank_results, loss, miner, tmp_path):
    ref_losses, ref_state = _train(loss, miner, "replicated", tmp_path / "one")
    start_state = {k: v.clone() for k, v in _trainer(_config(loss, miner, "replicated"),
                                                     tmp_path / "init").model.state_dict().items()}
    assert any(abs(a - b) > 1e-4 for a, b in zip(ref_losses, ref_losses[1:])), ref_losses
    for rank, results in enumerate(two_rank_results):
        for mode in MODES:
            losses, state = results[f"{loss}|{mode}"]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-7,
                                       err_msg=f"rank {rank} {mode}")
            _assert_same_state(state, ref_state, f"rank {rank} {mode}")
    # the parameters moved, by much more than the tolerance: a missing or doubled world-size
    # factor (half or twice the step) could not pass the comparison above
    moved = max(float((ref_state[k].double() - v.double()).norm() / max(float(v.double().norm()), 1e-3))
                for k, v in start_state.items() if v.is_floating_point())
    assert moved > 1e-3
