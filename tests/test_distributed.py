"""Two gloo processes on the CPU train exactly like one process on the same global batches.

For every loss family (pair loss with a triplet miner, multi-similarity with its miner, ArcFace,
Proxy Anchor, prototypical episodes, cross-batch memory), with frozen and with synchronised
BatchNorm: 2 ranks, each embedding its share of the global batch, gathering the embeddings
with gradient (:func:`dmlkit.distributed.all_gather_with_grad`) under
``DistributedDataParallel``, give the same per-step loss and the same final parameters as
one process (relative 1e-5; parameters: the norm of the difference relative to the tensor's
norm). The ranks are real processes (``torch.multiprocessing.spawn``).
"""

from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dmlkit.distributed import (
    MAX_TIMEOUT_S,
    DistributedError,
    all_gather_with_grad,
    context,
    init_distributed,
    timeout_seconds,
)
from dmlkit.samplers import EpisodeSampler, MPerClassSampler

CASES = ["contrastive+batch_hard", "multi_similarity+miner", "arcface", "proxy_anchor",
         "prototypical", "xbm_triplet"]
BN_MODES = ["frozen", "sync"]
STEPS = 3
NUM_CLASSES, PER_CLASS, DIM_IN, DIM_EMB = 20, 10, 16, 8


def _data():
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(NUM_CLASSES).repeat_interleave(PER_CLASS)
    centres = torch.randn(NUM_CLASSES, DIM_IN, generator=g)
    x = centres[labels] + 0.7 * torch.randn(labels.numel(), DIM_IN, generator=g)
    return x, labels


def _model(bn_mode: str) -> nn.Module:
    from dmlkit.models import freeze_batchnorm

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(DIM_IN, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, DIM_EMB))
    with torch.no_grad():  # non-trivial running statistics for the frozen case
        model[1].running_mean.uniform_(-0.2, 0.2)
        model[1].running_var.uniform_(0.5, 1.5)
    if bn_mode == "frozen":
        freeze_batchnorm(model)
    return model


def _loss_and_miner(case: str):
    from dmlkit.losses import CrossBatchMemory, get_loss
    from dmlkit.miners import get_miner

    torch.manual_seed(2)
    if case == "contrastive+batch_hard":
        return get_loss("contrastive"), get_miner("batch_hard")
    if case == "multi_similarity+miner":
        return get_loss("multi_similarity"), get_miner("multi_similarity")
    if case == "arcface":
        return get_loss("arcface", num_classes=NUM_CLASSES, embedding_size=DIM_EMB), None
    if case == "proxy_anchor":
        return get_loss("proxy_anchor", num_classes=NUM_CLASSES, embedding_size=DIM_EMB), None
    if case == "prototypical":
        return get_loss("prototypical", k_shot=2), None
    if case == "xbm_triplet":
        return CrossBatchMemory(get_loss("triplet", margin=0.1), embedding_size=DIM_EMB, memory_size=48), None
    raise AssertionError(case)


def _sampler(case: str, labels, num_replicas: int, rank: int):
    if case == "prototypical":
        return EpisodeSampler(labels, n_way=4, k_shot=2, n_query=2, episodes=STEPS, seed=3,
                              num_replicas=num_replicas, rank=rank)
    return MPerClassSampler(labels, samples_per_class=4, classes_per_batch=6, batches_per_epoch=STEPS,
                            seed=3, num_replicas=num_replicas, rank=rank)


def _train(case: str, bn_mode: str, num_replicas: int = 1, rank: int = 0):
    """K steps; returns (per-step global losses, final model + loss parameters)."""
    from dmlkit.models.sync_batchnorm import convert_sync_batchnorm

    x, labels = _data()
    model = _model(bn_mode)
    loss_fn, miner = _loss_and_miner(case)
    net: nn.Module = model
    if num_replicas > 1:
        model = convert_sync_batchnorm(model)
        net = nn.parallel.DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad] + list(loss_fn.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    model.train()
    losses = []
    for idx in _sampler(case, labels, num_replicas, rank):
        emb = all_gather_with_grad(net(x[idx]))
        y = all_gather_with_grad(labels[idx])
        loss = loss_fn(emb, y, miner(emb, y) if miner is not None else None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"loss.{k}": v.detach().clone() for k, v in loss_fn.state_dict().items()})
    return losses, state


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from dmlkit.distributed import init_distributed, shutdown

    ctx = init_distributed("cpu", timeout_s=120)
    assert ctx.world_size == world and ctx.backend == "gloo"
    results = {}
    for case in CASES:
        for bn_mode in BN_MODES:
            results[(case, bn_mode)] = _train(case, bn_mode, world, rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("bn_mode", BN_MODES)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process(two_rank_results, case, bn_mode):
    torch.set_num_threads(1)
    ref_losses, ref_state = _train(case, bn_mode)
    for rank, results in enumerate(two_rank_results):
        losses, state = results[(case, bn_mode)]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}")
        assert state.keys() == ref_state.keys()
        for key, ref in ref_state.items():
            if ref.is_floating_point():  # relative to the tensor's norm: ArcFace's s = 64 makes
                # its class weights ~10 and float32 rounding of large gradients ~1e-5 absolute
                diff = float((state[key].double() - ref.double()).norm())
                assert diff <= 1e-5 * max(float(ref.double().norm()), 1e-3), (key, rank, diff)
            else:
                assert torch.equal(state[key], ref), key
        assert any(abs(a - b) > 1e-4 for a, b in zip(ref_losses, ref_losses[1:])) or case == "xbm_triplet"


def test_one_process_helpers_are_no_ops():
    x = torch.randn(4, 3, requires_grad=True)
    assert all_gather_with_grad(x) is x
    assert not context().enabled and context().is_main


def test_rank_shares_rebuild_the_global_batch():
    labels = np.repeat(np.arange(12), 5)
    whole = list(MPerClassSampler(labels, 4, 6, batches_per_epoch=4, seed=7))
    shares = [list(MPerClassSampler(labels, 4, 6, batches_per_epoch=4, seed=7, num_replicas=3, rank=r))
              for r in range(3)]
    for b, batch in enumerate(whole):
        assert sum((s[b] for s in shares), []) == batch
    episodes = list(EpisodeSampler(labels, 3, 2, 2, episodes=2, seed=1))
    halves = [list(EpisodeSampler(labels, 3, 2, 2, episodes=2, seed=1, num_replicas=2, rank=r))
              for r in range(2)]
    assert [h0 + h1 for h0, h1 in zip(*halves)] == episodes


def test_a_world_size_that_does_not_divide_the_batch_is_refused():
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match="cannot be split evenly over 3 processes"):
        MPerClassSampler(np.repeat(np.arange(10), 4), 4, 5, num_replicas=3, rank=0)
    with pytest.raises(ConfigError, match="rank must be an integer from 0 to 1"):
        MPerClassSampler(np.repeat(np.arange(10), 4), 4, 4, num_replicas=2, rank=2)


def test_missing_launcher_variables_are_one_clear_error(monkeypatch):
    from dmlkit.distributed import DistributedError, init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(DistributedError, match="MASTER_ADDR, MASTER_PORT not set: start the job with `torchrun"):
        init_distributed("cpu")


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e30", str(MAX_TIMEOUT_S + 1), "0", "-5", "ten"])
def test_a_collective_timeout_that_is_not_a_finite_positive_number_is_refused(raw):
    """nan passed the old `<= 0` check (a misleading "could not join" line later); inf and 1e30
    overflowed converting to a timedelta (a traceback on every rank)."""
    with pytest.raises(DistributedError, match=rf"^DMLKIT_DIST_TIMEOUT='{re.escape(raw)}' must be a "
                                               rf"number of seconds above 0 and at most {MAX_TIMEOUT_S}"):
        timeout_seconds({"DMLKIT_DIST_TIMEOUT": raw})
    assert timeout_seconds({"DMLKIT_DIST_TIMEOUT": str(MAX_TIMEOUT_S)}) == MAX_TIMEOUT_S
    assert timeout_seconds({"DMLKIT_DIST_TIMEOUT": "2.5"}) == 2.5 and timeout_seconds({}) == 600
    with pytest.raises(DistributedError, match="^timeout_s=inf must be"):
        init_distributed("cpu", timeout_s=math.inf)


def _one_rank_fails(rank: int, world: int, port: int, out_dir: str) -> None:
    import json
    import time

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    from dmlkit.distributed import (
        DistributedError,
        agree,
        init_distributed,
        leaving_alone_on_failure,
        on_main,
        shutdown,
    )
    from dmlkit.exceptions import DataError

    init_distributed("cpu", timeout_s=120)
    report: dict = {}

    def own_data() -> str:  # e.g. each rank's data root
        if rank == 1:
            raise DataError("no data under /rank1/root")
        return "ok"

    try:
        agree(own_data)
    except DistributedError as exc:
        report["agree"] = [str(exc), rank]
    t0 = time.perf_counter()
    try:
        with leaving_alone_on_failure():
            if rank == 1:  # fails on its own while rank 0 is in a collective
                raise DataError("a corrupt image on rank 1")
            on_main(lambda: time.sleep(1))
    except (DataError, DistributedError) as exc:
        report["error"] = type(exc).__name__ + ": " + str(exc)
    finally:
        shutdown()
    report["seconds"] = time.perf_counter() - t0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_a_rank_failing_alone_ends_the_job_in_bounded_time(tmp_path):
    """A rank that failed on its own waited at the exit barrier for rank 0, itself waiting in a
    collective: the job hung for the collective timeout (10 minutes by default). Now it leaves
    at once and rank 0's collective fails with an error that does not blame rank 0; a check on
    each rank's own inputs fails on every rank with one line naming the rank."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_one_rank_fails, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["agree"][0] == r1["agree"][0] == "1 of 2 ranks failed to start: rank 1: no data under /rank1/root"
    assert r1["error"] == "DataError: a corrupt image on rank 1"
    assert r0["error"].startswith("DistributedError: rank 0 lost contact with the other ranks while rank 0 ran")
    assert r0["seconds"] < 60 and r1["seconds"] < 60  # the process group's timeout is 120 s
