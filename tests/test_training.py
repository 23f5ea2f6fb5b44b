"""The trainer on a small real Omniglot slice: resume bit-exactness, early stopping, warnings,
frozen-trunk caching, checkpoints and errors. Each test trains for a second or two on CPU."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from _reference import tiny_sections
from dmlkit.exceptions import CheckpointError, ConfigError, NonFiniteError
from dmlkit.training import (
    UnusedParametersWarning,
    build_loss,
    build_optimizer,
    config_from_dict,
    load_checkpoint,
    read_checkpoint,
    read_log,
    train,
)

TRAIN_CLASSES = list(range(100, 120))  # non-contiguous ids on purpose (remapped for the loss)
VAL_CLASSES = list(range(200, 206))


pytestmark = pytest.mark.usefixtures("one_thread")


def make_config(**overrides):
    base = {
        "name": "tiny",
        "seed": 3,
        "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28},
        **tiny_sections(),  # model, loss, optimizer
        "miner": {"name": "batch_hard"},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 4},
        "training": {"epochs": 3, "device": "cpu", "log_every": 1, "eval_batch_size": 128},
    }
    cfg = config_from_dict(base)
    return cfg.override(overrides) if overrides else cfg


@pytest.fixture(scope="module")
def omniglot_slice(data_root):
    from dmlkit.data import get_transforms, load_dataset

    ds = load_dataset("omniglot", root=data_root, sets=("background",))
    train_t = get_transforms("grayscale", train=True, image_size=28)
    eval_t = get_transforms("grayscale", train=False, image_size=28)
    return (ds.subset_classes(TRAIN_CLASSES).with_transform(train_t),
            ds.subset_classes(VAL_CLASSES).with_transform(eval_t))


def _state(path):
    return read_checkpoint(path)["model"]


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_train_writes_the_run_directory(tmp_path, omniglot_slice):
    train_set, val_set = omniglot_slice
    with pytest.warns(UserWarning, match="test classes overlap"):  # val doubles as test here
        result = train(make_config(), tmp_path / "run", train_set=train_set, val_set=val_set,
                       test_set=val_set, progress=False)
    run = tmp_path / "run"
    for name in ("config.yaml", "provenance.json", "log.jsonl", "metrics.json",
                 "checkpoints/last.pt", "checkpoints/best.pt", "embeddings/test.npz"):
        assert (run / name).exists(), name
    assert result.steps == 12 and result.epochs_completed == 3 and result.stop_reason == "epochs"
    log = read_log(run / "log.jsonl")
    train_events = [r for r in log if r["event"] == "train"]
    evals = [r for r in log if r["event"] == "eval"]
    assert [r["step"] for r in train_events] == list(range(1, 13))
    assert {"epoch", "step", "loss", "lr", "time"} <= set(train_events[0])
    assert len(evals) == 3 and all(r["split"] == "val" and "map_at_r" in r for r in evals)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["best_step"] == result.best_step
    assert metrics["val"]["map_at_r"] == max(r["map_at_r"] for r in evals)
    assert set(metrics["test"]) >= {"map_at_r", "precision_at_1"}
    last = read_checkpoint(run / "checkpoints" / "last.pt")
    assert {"model", "optimizer", "loss", "miner", "rng", "epoch", "step", "sampler_epoch",
            "train_classes"} <= set(last)
    assert last["train_classes"].tolist() == TRAIN_CLASSES
    with np.load(run / "embeddings" / "test.npz") as npz:
        assert npz["embeddings"].shape == (len(val_set), 16)
        assert np.array_equal(npz["labels"], val_set.labels)
    model, cfg = load_checkpoint(run)
    assert not model.training and cfg == make_config()
    _assert_same_state(model.state_dict(), _state(run / "checkpoints" / "best.pt"))


def test_resume_after_a_kill_is_bit_exact(tmp_path, omniglot_slice, monkeypatch):
    train_set, val_set = omniglot_slice
    cfg = make_config()
    train(cfg, tmp_path / "full", train_set=train_set, val_set=val_set, progress=False)

    # kill the second run in the middle of epoch 2 (step 6 of 12)
    from dmlkit.losses.triplet_losses import TripletMarginLoss

    original = TripletMarginLoss.forward
    calls = {"n": 0}

    def dying_forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TripletMarginLoss, "forward", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "killed", train_set=train_set, val_set=val_set, progress=False)
    monkeypatch.setattr(TripletMarginLoss, "forward", original)
    assert read_checkpoint(tmp_path / "killed" / "checkpoints" / "last.pt")["step"] == 4
    with pytest.raises(CheckpointError, match="--resume"):
        train(cfg, tmp_path / "killed", train_set=train_set, val_set=val_set, progress=False)

    result = train(cfg, tmp_path / "killed", train_set=train_set, val_set=val_set,
                   resume=True, progress=False)
    assert result.steps == 12
    for name in ("last.pt", "best.pt"):
        _assert_same_state(_state(tmp_path / "full" / "checkpoints" / name),
                           _state(tmp_path / "killed" / "checkpoints" / name))
    full_opt = read_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")["optimizer"]
    res_opt = read_checkpoint(tmp_path / "killed" / "checkpoints" / "last.pt")["optimizer"]
    for k, v in full_opt["state"].items():
        for name, t in v.items():
            assert torch.equal(t, res_opt["state"][k][name])

    def strip(records):
        return [{k: v for k, v in r.items() if k not in ("time", "wall")} for r in records]

    assert strip(read_log(tmp_path / "full" / "log.jsonl")) == strip(read_log(tmp_path / "killed" / "log.jsonl"))


def test_resume_checks_the_config(tmp_path, omniglot_slice):
    train_set, val_set = omniglot_slice
    cfg = make_config(**{"training.epochs": 1})
    train(cfg, tmp_path / "run", train_set=train_set, val_set=val_set, progress=False)
    with pytest.raises(CheckpointError, match="loss.params.margin"):
        train(cfg.override(["loss.params.margin=0.5"]), tmp_path / "run", train_set=train_set,
              val_set=val_set, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(cfg, tmp_path / "other", train_set=train_set, resume=True, progress=False)
    # more epochs on a finished run continue it
    result = train(cfg.override(["training.epochs=2"]), tmp_path / "run", train_set=train_set,
                   val_set=val_set, resume=True, progress=False)
    assert result.epochs_completed == 2 and result.steps == 8


def test_early_stopping_on_validation_map_at_r(tmp_path, omniglot_slice):
    train_set, val_set = omniglot_slice
    # a vanishing learning rate: validation MAP@R never improves after the first evaluation
    cfg = make_config(**{"optimizer.preset": "reality_check", "optimizer.name": "sgd",
                         "optimizer.trunk_lr": 1e-30, "optimizer.embedder_lr": 1e-30,
                         "training.epochs": 10, "training.patience": 2,
                         "model.freeze_batchnorm": True})
    result = train(cfg, tmp_path / "run", train_set=train_set, val_set=val_set, progress=False)
    assert result.stop_reason == "patience"
    assert result.epochs_completed == 3
    assert result.best_step == 4
    assert len(result.history) == 3


def test_unused_loss_parameters_warn_loudly(caplog):
    model = nn.Sequential()
    model.trunk = nn.Linear(4, 4)
    model.embedder = nn.Linear(4, 8)
    cfg = make_config(**{"loss.name": "arcface", "loss.params": {}, "miner": None,
                         "optimizer.loss_lr": 0.0})
    loss = build_loss(cfg, num_classes=5, embedding_size=8)
    assert loss.num_classes == 5 and loss.embedding_size == 8
    with pytest.warns(UnusedParametersWarning, match="loss_lr"):
        opt = build_optimizer(cfg, model, loss)
    assert "loss_lr" in caplog.text
    assert [g["name"] for g in opt.param_groups] == ["trunk", "embedder"]
    assert not any(p.requires_grad for p in loss.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = build_optimizer(cfg.override(["optimizer.loss_lr=0.01"]), model,
                              build_loss(cfg, num_classes=5, embedding_size=8))
    assert {g["name"]: g["lr"] for g in opt.param_groups}["loss"] == 0.01


def test_loss_config_errors():
    with pytest.raises(ConfigError, match="unknown"):
        build_loss(make_config(**{"loss.name": "no_such_loss"}), 3, 8)
    with pytest.raises(ConfigError, match="loss.params"):
        build_loss(make_config(**{"loss.params": {"bogus": 1}}), 3, 8)
    with pytest.raises(ConfigError, match="set by the trainer"):
        build_loss(make_config(**{"loss.name": "arcface", "loss.params": {"num_classes": 3}}), 3, 8)
    margin = build_loss(make_config(**{"loss.name": "margin", "loss.params": {"num_classes": "auto"}}), 7, 8)
    assert margin.beta.shape == (7,)


def test_proxy_loss_trains_on_remapped_labels(tmp_path, omniglot_slice):
    train_set, val_set = omniglot_slice
    cfg = make_config(**{"loss.name": "arcface", "loss.params": {}, "miner": None,
                         "training.epochs": 1, "training.grad_clip": 1.0})
    result = train(cfg, tmp_path / "run", train_set=train_set, val_set=val_set, progress=False)
    loss_state = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["loss"]
    weight = next(v for v in loss_state.values() if v.dim() == 2)
    assert weight.shape[0] == len(TRAIN_CLASSES)
    assert np.isfinite(result.val_metrics["map_at_r"])


def test_nan_loss_raises_a_helpful_error(tmp_path, omniglot_slice, monkeypatch):
    from dmlkit.losses.triplet_losses import TripletMarginLoss

    train_set, val_set = omniglot_slice

    def nan_loss(self, embeddings, *args, **kwargs):
        return embeddings.sum() * float("nan")

    monkeypatch.setattr(TripletMarginLoss, "forward", nan_loss)
    with pytest.raises(NonFiniteError, match="learning rate"):
        train(make_config(), tmp_path / "run", train_set=train_set, val_set=val_set, progress=False)


def test_frozen_trunk_trains_the_head_on_cached_features(tmp_path, omniglot_slice, monkeypatch):
    import dmlkit.models as models

    train_set, val_set = omniglot_slice
    cache = tmp_path / "cache"
    cfg = make_config(**{"model.frozen_trunk": True, "model.feature_cache_dir": str(cache),
                         "training.epochs": 2})
    result = train(cfg, tmp_path / "a", train_set=train_set, val_set=val_set, progress=False)
    assert any(cache.rglob("*")), "trunk features were not cached"
    raw = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=True)
    assert raw["trunk_file"] == "trunk.pt"  # the fixed trunk is stored once, not per epoch
    assert not any(k.startswith("trunk.") for k in raw["model"])
    first = read_checkpoint(tmp_path / "a" / "checkpoints" / "last.pt")["model"]
    init_model = _initial_model(cfg)
    init = init_model.state_dict()
    trunk_keys = [k for k in first if k.startswith("trunk.")]
    head_keys = [k for k in first if not k.startswith("trunk.")]
    assert trunk_keys and head_keys
    assert all(torch.equal(first[k], init[k]) for k in trunk_keys)  # trunk untouched
    assert any(not torch.equal(first[k], init[k]) for k in head_keys)  # head trained
    assert result.steps == 8

    # a second run reads the cache: the trunk never sees an image
    def no_forward(*args, **kwargs):
        raise AssertionError("trunk ran although its features are cached")

    trunk_forward = type(init_model.trunk).forward
    monkeypatch.setattr(type(init_model.trunk), "forward", no_forward)
    train(cfg, tmp_path / "b", train_set=train_set, val_set=val_set, progress=False)
    monkeypatch.setattr(type(init_model.trunk), "forward", trunk_forward)
    _assert_same_state(_state(tmp_path / "a" / "checkpoints" / "last.pt"),
                       _state(tmp_path / "b" / "checkpoints" / "last.pt"))
    del models


def _initial_model(cfg):
    from dmlkit.training import build_model
    from dmlkit.utils import seed_everything

    seed_everything(cfg.seed)
    return build_model(cfg)


def test_tensorboard_mirrors_the_log(tmp_path):
    """``training.tensorboard: true`` writes the logged scalars as TensorBoard events."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'dmlkit[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dmlkit.training.runlog import RunLogger

    log = RunLogger(tmp_path, tensorboard=True)
    log.log({"event": "train", "epoch": 1, "step": 3, "loss": 0.5})
    log.log({"event": "eval", "epoch": 1, "step": 3, "split": "val", "map_at_r": 0.25})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val/map_at_r"} <= set(events.Tags()["scalars"])
    assert events.Scalars("val/map_at_r")[0].value == pytest.approx(0.25)
    assert (tmp_path / "log.jsonl").read_text().count("\n") == 2


def test_a_checkpoint_with_bit_rot_is_refused_and_orphan_temporaries_are_swept(tmp_path):
    import torch

    from dmlkit.exceptions import CheckpointError
    from dmlkit.training.checkpoint import (
        read_checkpoint,
        save_checkpoint,
        sweep_orphan_temporaries,
    )

    state = {"model": {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)},
             "step": 7, "rng": torch.ByteTensor(list(range(256)))}
    path = save_checkpoint(state, tmp_path / "checkpoints" / "last.pt")
    loaded = read_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert "digest" not in loaded
    # flip one bit inside the stored float tensor: the zip still opens, the digest catches it
    raw = bytearray(path.read_bytes())
    needle = torch.arange(1000, dtype=torch.float32).numpy().tobytes()[400:416]
    at = bytes(raw).index(needle)
    raw[at + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(path)
    # a kill during an atomic write leaves .NAME.XXXX.tmp files; resume sweeps them
    orphan = tmp_path / "checkpoints" / ".last.pt.abc123.tmp"
    orphan.write_bytes(b"partial")
    kept = tmp_path / "checkpoints" / "notes.txt"
    kept.write_text("mine")
    assert sweep_orphan_temporaries(tmp_path) == [orphan]
    assert not orphan.exists() and kept.exists()


def test_a_run_directory_is_one_train_at_a_time_and_never_mixes_attempts(tmp_path, omniglot_slice, caplog):
    """Issue-11 audit: a second `train` in a directory in use is refused (both used to run and
    interleave log.jsonl); a fresh start after an attempt killed before its first checkpoint
    starts a new log (the old steps 1, 2 stayed in front of the new ones); a resume removes the
    previous end's metrics.json and test embeddings, which `dmlkit report` showed beside a newer
    best.pt after a killed resume; damaged log lines are skipped with a warning."""
    from dmlkit.exceptions import DmlkitError
    from dmlkit.training.trainer import open_run_dir
    from dmlkit.utils import directory_lock

    train_set, val_set = omniglot_slice
    cfg = make_config(**{"training.epochs": 1})
    run = tmp_path / "run"
    with directory_lock(run, "train.lock", "busy"), pytest.raises(DmlkitError, match="another `dmlkit train`"):
        train(cfg, run, train_set=train_set, val_set=val_set, progress=False)
    assert not (run / "config.yaml").exists()

    (run / "log.jsonl").write_text('{"event": "train", "step": 1}\n{"event": "train", "step": 2}\n')
    (run / "metrics.json").write_text("{}")
    (run / "provenance.json").write_text("{}")  # written by every attempt before its log
    train(cfg, run, train_set=train_set, val_set=val_set, progress=False)
    steps = [r["step"] for r in read_log(run / "log.jsonl") if r["event"] == "train"]
    assert steps == list(range(1, 5))
    assert json.loads((run / "metrics.json").read_text())["best_step"] >= 0

    assert (run / "embeddings" / "test.npz").exists() or not (run / "embeddings").exists()
    (run / "embeddings").mkdir(exist_ok=True)
    (run / "embeddings" / "test.npz").write_bytes(b"stale")
    assert open_run_dir(run, cfg, resume=True) is not None
    assert not (run / "metrics.json").exists() and not (run / "embeddings" / "test.npz").exists()
    assert (run / "baseline.json").exists()  # read by the resumed run

    with (run / "log.jsonl").open("a") as fh:
        fh.write('[1]\n{"event": "train", "step": "x"}\n{"event": "eval", "step": 4}\n{"torn')
    with caplog.at_level("WARNING", logger="dmlkit.training"):
        records = read_log(run / "log.jsonl")
    assert records[-1] == {"event": "eval", "step": 4}
    assert "skipped 2 line(s)" in caplog.text  # the torn last line is expected: silent


def test_a_damaged_baseline_json_is_one_error_on_resume(tmp_path, omniglot_slice):
    """An empty or non-object baseline.json made `train --resume` end in a JSONDecodeError
    traceback; it is one DataError naming the file."""
    from dmlkit.exceptions import DataError

    train_set, val_set = omniglot_slice
    cfg = make_config(**{"training.epochs": 1})
    run = tmp_path / "run"
    train(cfg, run, train_set=train_set, val_set=val_set, progress=False)
    for text in ("", "[1, 2]"):
        (run / "baseline.json").write_text(text)
        with pytest.raises(DataError, match="baseline.json"):
            train(cfg, run, train_set=train_set, val_set=val_set, resume=True, progress=False)
