"""Config / models / embeddings-files audit: each test fails without its fix."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from _reference import SixClassImages
from dmlkit.config import config_from_dict, dump_config, load_config
from dmlkit.data.base import ArrayDataset
from dmlkit.distributed import init_distributed, shutdown
from dmlkit.embeddings import extract_features, load_embeddings, save_embeddings
from dmlkit.exceptions import CheckpointError, ConfigError, DataError, ShapeError
from dmlkit.models import build_trunk, freeze_batchnorm
from dmlkit.models.sync_batchnorm import convert_sync_batchnorm
from dmlkit.training.builders import build_model, model_setting_problems
from dmlkit.training.loop import Trainer
from dmlkit.training.preflight import PreflightError, preflight
from dmlkit.utils import seed_everything


# -- 1. timm trunks load a weights file strictly ---------------------------------------------------
def test_timm_weights_file_missing_layers_or_other_architecture_is_refused(tmp_path):
    timm = pytest.importorskip("timm", reason="timm is not installed (pip install 'dmlkit[timm]')")
    torch.manual_seed(0)
    good = timm.create_model("resnet18", pretrained=False).state_dict()  # with its fc
    files = {"empty": {}, "no_layer4": {k: v for k, v in good.items() if not k.startswith("layer4")},
             "resnet34": timm.create_model("resnet34", pretrained=False).state_dict()}
    for name, state in files.items():
        torch.save(state, tmp_path / f"{name}.pth")
        with pytest.raises(ConfigError, match="do not fit this trunk"):
            build_trunk("timm:resnet18", pretrained=False, weights=tmp_path / f"{name}.pth")
    torch.save(good, tmp_path / "good.pth")  # the classifier (fc) is ignored, every other key loads
    trunk, _ = build_trunk("timm:resnet18", pretrained=False, weights=tmp_path / "good.pth")
    assert torch.equal(trunk.layer4[1].conv2.weight, good["layer4.1.conv2.weight"])
    data = (tmp_path / "good.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])  # a local file: no "download" advice
    with pytest.raises(CheckpointError, match="cannot load weights file .*cut.pth"):
        build_trunk("timm:resnet18", pretrained=False, weights=tmp_path / "cut.pth")


# -- 2. naming the preset a config already has keeps its explicit learning rates -----------------
def test_same_optimizer_preset_override_keeps_explicit_values(tmp_path):
    config = load_config(None, {"data.dataset": "omniglot", "loss.name": "triplet",
                                "optimizer.preset": "cpu_quick", "optimizer.trunk_lr": 0.003})
    run_yaml = tmp_path / "config.yaml"
    dump_config(config, run_yaml)  # a run's config.yaml: every optimizer key written out
    assert load_config(run_yaml, ["optimizer.preset=cpu_quick"]).optimizer.trunk_lr == 0.003
    assert config.override(["optimizer.preset=cpu_quick"]).optimizer.trunk_lr == 0.003
    # another preset still starts the section afresh; explicit keys given with it win
    switched = config.override(["optimizer.preset=reality_check", "optimizer.loss_lr=0.01"]).optimizer
    assert (switched.name, switched.trunk_lr, switched.loss_lr) == ("rmsprop", 1e-6, 0.01)
    assert load_config(run_yaml, ["optimizer.preset=reality_check"]).optimizer.trunk_lr == 1e-6


# -- 3. 2 gloo processes: freeze_batchnorm leaves a fresh (head / neck) BatchNorm training --------
FRESH_BN = config_from_dict({
    "name": "fresh-bn", "seed": 5, "data": {"dataset": "binary_alphadigits"},
    "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8], "bn_neck": True},
              "pretrained": False, "in_channels": 1, "embedding_size": 8, "head": "mlp",
              "freeze_batchnorm": True},
    "loss": {"name": "triplet"},
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 2},
    "optimizer": {"preset": "cpu_quick"}, "training": {"epochs": 1, "device": "cpu"},
})


def _fresh_bn_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight.detach().clone() for name, m in model.named_modules()
            if name in ("trunk.neck", "embedder.1")}


def _fresh_bn_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=60)
    seed_everything(FRESH_BN.seed)
    trainer = Trainer(FRESH_BN, Path(out_dir) / "run", SixClassImages(), None, device="cpu")
    before = _fresh_bn_weights(trainer.model)
    trainer.run_epoch(time.perf_counter())  # freezes BatchNorm at its start, after DDP was built
    trainer.run_log.close()
    torch.save({"before": before, "after": _fresh_bn_weights(trainer.model)},
               Path(out_dir) / f"rank{rank}.pt")
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_conversion_for_distributed_training_keeps_the_fresh_batchnorm_mark():
    model = convert_sync_batchnorm(build_model(FRESH_BN.model), "cpu")
    freeze_batchnorm(model)
    fresh = [m for name, m in model.named_modules() if name in ("trunk.neck", "embedder.1")]
    assert len(fresh) == 2 and all(m.weight.requires_grad and m.training for m in fresh)


def test_two_gloo_ranks_train_a_fresh_batchnorm_with_frozen_trunk_batchnorm(tmp_path):
    mp.spawn(_fresh_bn_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["before"].keys() == {"trunk.neck", "embedder.1"}
        for name, weight in result["before"].items():  # the fresh layers trained
            assert not torch.equal(weight, result["after"][name]), (rank, name)


# -- 4. an .npz class_names table naming two codes alike is refused ----------------------------
def test_npz_class_names_with_a_repeated_name_is_refused(tmp_path):
    emb = np.eye(6, 3, dtype=np.float32)
    np.savez(tmp_path / "dup.npz", embeddings=emb, labels=np.array([0, 0, 1, 1, 2, 2]),
             class_names=np.array(["a", "a", "b"]))
    with pytest.raises(DataError, match="class_names holds 'a' twice"):
        load_embeddings(tmp_path / "dup.npz")
    np.savez(tmp_path / "ok.npz", embeddings=emb, labels=np.array([0, 0, 1, 1, 2, 2]),
             class_names=np.array(["a", "b", "c"]))
    assert load_embeddings(tmp_path / "ok.npz")[1].tolist() == ["a", "a", "b", "b", "c", "c"]
    assert load_embeddings(tmp_path / "ok.npz", codes=True)[1].tolist() == [0, 0, 1, 1, 2, 2]


# -- 5. model.in_channels against the data's own samples when there is no transform --------------
@pytest.mark.parametrize("transform", [None, "none"])
def test_in_channels_is_checked_against_the_samples_without_a_transform(transform):
    rng = np.random.default_rng(0)
    gray = ArrayDataset(rng.standard_normal((48, 8, 8)).astype(np.float32), np.repeat(np.arange(8), 6),
                        name="gray")
    config = config_from_dict({
        "data": {"dataset": "gray", "transform": transform, "split": {"kind": "ratio", "ratios": [4, 2, 2]}},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 3, "embedding_size": 8},
        "loss": {"name": "triplet"}, "sampler": {"classes_per_batch": 2, "samples_per_class": 2},
    })
    with pytest.raises(PreflightError) as info:
        preflight(config, dataset=gray)
    [problem] = [p for p in info.value.problems if p.key == "model.in_channels"]
    assert problem.fit == 1 and "1-channel" in problem.message
    assert not preflight(config.override(["model.in_channels=1"]), dataset=gray).errors


# -- 6. a damaged feature-cache file is recomputed -------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_a_damaged_feature_cache_file_is_recomputed_and_rewritten(tmp_path, damage):
    torch.manual_seed(0)
    trunk, _ = build_trunk("small_cnn", in_channels=1, widths=[4, 8])
    images = (np.random.default_rng(0).random((6, 16, 16)) * 255).astype(np.uint8)
    ds = ArrayDataset(images, [0, 0, 1, 1, 2, 2])
    first = extract_features(trunk, ds, cache_dir=tmp_path)
    path = Path(first.meta["cache_file"])
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncated"
                     else raw[:200] + bytes([raw[200] ^ 0xFF]) + raw[201:])
    again = extract_features(trunk, ds, cache_dir=tmp_path)
    assert not again.meta["cache_hit"] and np.array_equal(again.data, first.data)
    assert extract_features(trunk, ds, cache_dir=tmp_path).meta["cache_hit"]  # rewritten whole


# -- 7. an explicit optimizer.momentum that Adam / AdamW would ignore is refused ------------------
def test_momentum_with_adam_is_refused_unless_it_is_the_presets():
    base = {"data": {"dataset": "omniglot"}, "loss": {"name": "triplet"}}
    for optimizer in ({"preset": None, "name": "adam", "momentum": 0.5},
                      {"preset": "cpu_quick", "momentum": 0.9},
                      {"preset": "reality_check", "name": "adamw", "momentum": 0.5}):
        with pytest.raises(ConfigError, match="optimizer.momentum .* rmsprop and sgd only.*beta1"):
            config_from_dict({**base, "optimizer": optimizer})
    # the preset's value (a run's config.yaml repeats it) and the optimisers that read it load
    quick = config_from_dict({**base, "optimizer": {"preset": "cpu_quick"}})
    assert config_from_dict({**base, "optimizer": quick.optimizer.model_dump()}).optimizer.momentum == 0.0
    assert config_from_dict({**base, "optimizer": {"preset": "reality_check", "name": "adam"}})
    assert config_from_dict({**base, "optimizer": {"name": "sgd", "momentum": 0.5}}).optimizer.momentum == 0.5


# -- 8. save_embeddings writes no extra that its readers refuse ----------------------------------
def test_save_embeddings_stores_paths_as_strings_and_refuses_object_extras(tmp_path):
    emb, labels = np.eye(4, dtype=np.float32), [0, 0, 1, 1]
    paths = [Path(f"img{i}.png") for i in range(4)]
    save_embeddings(tmp_path / "p.npz", emb, labels, paths=paths, root=tmp_path)
    extra = load_embeddings(tmp_path / "p.npz")[2]
    assert extra["paths"].tolist() == [f"img{i}.png" for i in range(4)]
    assert extra["root"].item() == str(tmp_path)
    for key, value in (("meta", {"model": "r18"}), ("missing", [None, 1, 2, 3]), ("ragged", [[1], [1, 2]])):
        with pytest.raises(ShapeError, match=f"extra '{key}' is not an array of numbers or strings"):
            save_embeddings(tmp_path / f"{key}.npz", emb, labels, **{key: value})
        assert not (tmp_path / f"{key}.npz").exists()


# -- 9. trunk options whose features the head refuses are found before the run dir is written ----
def test_trunk_options_giving_zero_features_are_a_setting_problem():
    config = config_from_dict({
        "data": {"dataset": "omniglot"}, "loss": {"name": "triplet"},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1,
                  "trunk_options": {"widths": [8, 0]}}})
    [(key, message)] = model_setting_problems(config)
    assert key == "model.trunk_options" and "head, for the trunk's 0 features" in message
    assert model_setting_problems(config.override({"model.trunk_options.widths": [8, 4]})) == []
