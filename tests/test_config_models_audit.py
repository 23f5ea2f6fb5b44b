"""Config / models / embeddings-files audit: each test fails without its fix."""

from __future__ import annotations

import pytest
import torch

from dmlkit.config import dump_config, load_config
from dmlkit.exceptions import CheckpointError, ConfigError
from dmlkit.models import build_trunk


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
