"""``train()`` in 2 real gloo processes (``torch.multiprocessing.spawn``) on a tiny image folder.

Ranks that loaded different data: per-machine data roots may differ (docs/distributed.md). A
rank whose copy lacked a training image built its sampler from its own labels and embedded its
test shard from its own files: the job exited 0 with a ``metrics.json`` that mixed two datasets.
``train()`` now compares what each rank loaded, split by split
(``MetricDataset.portable_fingerprint``: labels, class names, file paths relative to the data and
their sizes), and refuses a mismatch with one error line on every rank before the run directory
is touched.

Nothing to train in the model: a frozen trunk with an identity head under a proxy loss trains
the loss's proxies alone. One process trained; under torchrun every rank died in
``DistributedDataParallel``'s constructor (it refuses a module without a parameter that
requires a gradient). The trainer now leaves such a module unwrapped, and the proxies train as
in one process.

An OSError rank 0 met inside ``on_main`` (a file where the run's ``checkpoints`` folder goes) is
re-raised on every rank: every rank printed it. It is printed once, by rank 0, as dmlkit's own
errors are (``dmlkit train`` under a real ``torchrun``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import yaml

from _reference import grey_image_folder, tiny_image_folder_config
from dmlkit.config import config_from_dict
from dmlkit.data.base import ArrayDataset
from dmlkit.data.datasets import load_dataset
from dmlkit.distributed import init_distributed, raised_on_every_rank, shutdown
from dmlkit.exceptions import DataError
from dmlkit.training import read_checkpoint, read_log, train
from dmlkit.training.builders import build_datasets
from dmlkit.training.same_inputs import check_same_data

CONFIG = tiny_image_folder_config("same-data", val_fraction=0.25)


def _splits(root: Path) -> dict:
    sets = build_datasets(config_from_dict({**CONFIG, "data": {**CONFIG["data"], "root": str(root)}}))
    return {name: sets[name] for name in ("train", "val", "test")}


def _fingerprints(root: Path) -> dict[str, str]:
    return {name: ds.portable_fingerprint() for name, ds in _splits(root).items()}


def test_a_copy_elsewhere_has_the_same_portable_fingerprint_and_a_changed_split_another(tmp_path):
    original = grey_image_folder(tmp_path / "a")
    copy = Path(shutil.copytree(original, tmp_path / "elsewhere" / "b"))
    assert load_dataset("image_folder", root=original).fingerprint() != \
        load_dataset("image_folder", root=copy).fingerprint()  # the cache key knows the place
    before = _fingerprints(original)
    assert _fingerprints(copy) == before
    (copy / "class00" / "3.png").unlink()  # a training image (class 0 trains)
    assert {k for k, v in _fingerprints(copy).items() if v != before[k]} == {"train"}
    shutil.copy(original / "class00" / "3.png", copy / "class00" / "3.png")
    with open(copy / "class09" / "0.png", "ab") as f:  # a test image of another size
        f.write(b"\0")
    assert {k for k, v in _fingerprints(copy).items() if v != before[k]} == {"test"}

    data = np.arange(6 * 4, dtype=np.uint8).reshape(6, 2, 2)
    arrays = ArrayDataset(data, [0, 0, 1, 1, 2, 2])
    changed = data.copy()
    changed[5, 0, 0] += 1
    other = ArrayDataset(changed, [0, 0, 1, 1, 2, 2])
    assert arrays.subset_classes([0, 1]).portable_fingerprint() == other.subset_classes([0, 1]).portable_fingerprint()
    assert arrays.subset_classes([2]).portable_fingerprint() != other.subset_classes([2]).portable_fingerprint()


def test_the_portable_fingerprint_is_computed_once_per_selection_of_rows(monkeypatch):
    """A run's start reads it several times (ranks compared, split.json written): one pass over
    the storage per selection, a new one after the rows change."""
    data = np.arange(6 * 4, dtype=np.uint8).reshape(6, 2, 2)
    arrays = ArrayDataset(data, [0, 0, 1, 1, 2, 2])
    passes = []
    read = ArrayDataset._portable_samples_fingerprint
    monkeypatch.setattr(ArrayDataset, "_portable_samples_fingerprint", lambda self: passes.append(1) or read(self))
    first = arrays.portable_fingerprint()
    assert arrays.portable_fingerprint() == first and len(passes) == 1
    part = arrays.subset([0, 1, 2, 3])
    assert part.portable_fingerprint() != first and len(passes) == 2
    assert arrays.with_transform(None).portable_fingerprint() == first and len(passes) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Rank ``rank`` of 2: compares identical copies, then trains on a copy that lacks an image
    on rank 1; writes what it met to ``rank<r>.json``."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    out = Path(out_dir)
    init_distributed("cpu", timeout_s=120)
    report: dict = {}
    try:
        check_same_data(_splits(out / f"same{rank}"))  # identical copies in different places
        report["same"] = "ok"
        train(CONFIG, out / "run", data_root=out / f"data{rank}", progress=False)
        report["train"] = "trained"
    except DataError as exc:
        report["train"] = str(exc)
        report["every_rank"] = raised_on_every_rank(exc)
    finally:
        shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.filterwarnings("ignore")
def test_ranks_that_loaded_different_data_are_refused_before_training(tmp_path):
    for name in ("same0", "data0"):
        grey_image_folder(tmp_path / name)
    shutil.copytree(tmp_path / "same0", tmp_path / "same1")
    shutil.copytree(tmp_path / "data0", tmp_path / "data1")
    (tmp_path / "data1" / "class00" / "3.png").unlink()  # rank 1's copy lacks a training image
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["same"] == r1["same"] == "ok"
    assert r0 == r1 and r0["every_rank"]  # one line, printed once by rank 0
    message = r0["train"]
    assert message.startswith("the ranks loaded different data (train split: rank 0: 24 samples of "
                              "6 classes (digest "), message
    assert "rank 1: 23 samples of 6 classes" in message and "val split" not in message
    assert "test split" not in message and "--data-root" in message
    assert not (tmp_path / "run").exists()  # refused before the run directory is touched


#: Only the loss trains: frozen trunk, identity head (the trunk's 8 features are the embedding).
LOSS_ONLY = {**CONFIG, "model": {**CONFIG["model"], "frozen_trunk": True, "freeze_batchnorm": True,
                                 "head": "identity"},
             "loss": {"name": "proxy_anchor", "params": {}}, "miner": None}


def _loss_only_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=120)
    try:
        train(LOSS_ONLY, Path(out_dir) / "two", data_root=Path(out_dir) / "data", progress=False)
    finally:
        shutdown()


@pytest.mark.filterwarnings("ignore")
def test_a_model_with_nothing_to_train_trains_its_proxies_as_one_process(tmp_path):
    grey_image_folder(tmp_path / "data")
    mp.spawn(_loss_only_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    train(LOSS_ONLY, tmp_path / "one", data_root=tmp_path / "data", progress=False)
    one, two = (read_checkpoint(tmp_path / run / "checkpoints" / "last.pt") for run in ("one", "two"))
    losses = [[r["loss"] for r in read_log(tmp_path / run / "log.jsonl") if r["event"] == "train"] for run in ("one", "two")]
    assert len(losses[0]) == 2 and losses[0][0] != losses[0][1]  # the proxies trained
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    proxies = one["loss"]["proxies"]
    diff = float((two["loss"]["proxies"] - proxies).norm())
    assert diff <= 1e-5 * float(proxies.norm()), diff


def test_an_os_error_every_rank_meets_is_printed_once(tmp_path):
    grey_image_folder(tmp_path / "data")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").touch()  # a file where the run's folder goes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
         "127.0.0.1", "--master-port", str(_free_port()), "-m", "dmlkit", "train",
         str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path / "run"), "--data-root",
         str(tmp_path / "data"), "-q"], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "checkpoints" in lines[0] and "Not a directory" in lines[0]
