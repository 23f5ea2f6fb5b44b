"""Does training do what the config says? (audit s41)

* ``model.freeze_batchnorm`` (default true) freezes only BatchNorm whose statistics were loaded
  (pretrained weights or ``model.weights``); a randomly initialised trunk's BatchNorm trains
  (docs/guide.md, "Trunks and the embedding model"), and a checkpoint's rebuild follows the
  config, not its own ``pretrained=False``;
* ``training.amp``: training and every inference autocast to one dtype
  (:func:`dmlkit.embeddings.autocast_dtype`);
* ``optimizer.trunk_lr: 0`` / ``embedder_lr: 0``: that part runs in eval mode, so its BatchNorm
  running statistics stay fixed with its weights;
* ``data.transform: imagenet``: the evaluation resize scales with ``image_size``.

Each test builds a tiny ``small_cnn`` on random 1 x 8 x 8 images and trains one or two steps
on the CPU.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from _reference import SixClassImages
from dmlkit.config import config_from_dict
from dmlkit.data import get_transforms
from dmlkit.embeddings import autocast_dtype, embed
from dmlkit.exceptions import CheckpointError
from dmlkit.models import trunk_loads_weights
from dmlkit.models.embedder import _FrozenBNMixin
from dmlkit.training import build_model
from dmlkit.training.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(model: dict | None = None, optimizer: dict | None = None):
    return config_from_dict({
        "name": "fidelity", "seed": 5, "data": {"dataset": "binary_alphadigits"},
        "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8]}, "in_channels": 1,
                  "embedding_size": 8, **(model or {})},
        "loss": {"name": "triplet"},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 2},
        "optimizer": {"preset": "cpu_quick", **(optimizer or {})},
        "training": {"epochs": 1, "device": "cpu"},
    })


def _trunk_bns(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.trunk.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _bn_state(model: nn.Module, part: str = "trunk") -> dict[str, torch.Tensor]:
    """Running statistics and affine parameters of every BatchNorm under ``model.<part>``."""
    out = {}
    for name, m in getattr(model, part).named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for key in ("running_mean", "running_var", "weight", "bias"):
                out[f"{name}.{key}"] = getattr(m, key).detach().clone()
    return out


def _trained(config, tmp_path) -> tuple[Trainer, dict, dict]:
    """A trainer of ``config`` after one epoch (2 steps), its trunk BatchNorm state before and after."""
    torch.manual_seed(config.seed)
    trainer = Trainer(config, tmp_path / "run", SixClassImages(), None, device="cpu")
    before = _bn_state(trainer.model)
    trainer.run_epoch(time.perf_counter())
    trainer.run_log.close()
    return trainer, before, _bn_state(trainer.model)


# -- F1: freeze_batchnorm freezes loaded BatchNorm only -------------------------------------------
@pytest.mark.parametrize("model", [{"pretrained": False}, {}],  # small_cnn publishes no weights
                         ids=["pretrained-false", "pretrained-default"])
def test_a_fresh_trunk_trains_its_batchnorm_under_the_default_config(tmp_path, model):
    config = _config(model)
    assert config.model.freeze_batchnorm  # the default
    trainer, before, after = _trained(config, tmp_path)
    bns = _trunk_bns(trainer.model)
    assert len(bns) == 2 and not any(isinstance(b, _FrozenBNMixin) for b in bns)
    in_optimizer = {id(p) for p in trainer.trainable}
    assert all(id(b.weight) in in_optimizer and id(b.bias) in in_optimizer for b in bns)
    for key in before:  # statistics and affine parameters all moved in two steps
        assert not torch.equal(before[key], after[key]), key


def _weights_file(tmp_path) -> str:
    """A small_cnn state dict with non-trivial BatchNorm statistics."""
    torch.manual_seed(1)
    trunk = build_model(_config({"pretrained": False}).model).trunk
    with torch.no_grad():
        for m in trunk.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    path = tmp_path / "trunk.pt"
    torch.save(trunk.state_dict(), path)
    return str(path)


def test_a_trunk_with_loaded_weights_still_freezes_its_batchnorm(tmp_path):
    config = _config({"pretrained": False, "weights": _weights_file(tmp_path)})
    trainer, before, after = _trained(config, tmp_path)
    bns = _trunk_bns(trainer.model)
    assert len(bns) == 2 and all(isinstance(b, _FrozenBNMixin) and not b.training for b in bns)
    in_optimizer = {id(p) for p in trainer.trainable}
    assert not any(id(b.weight) in in_optimizer for b in bns)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert not torch.equal(before["features.1.running_var"], torch.ones(4))  # the file's statistics
    # a checkpoint's rebuild (no weights read: pretrained=False) is the model that trained
    rebuilt = build_model(config.model, pretrained=False)
    assert all(isinstance(b, _FrozenBNMixin) for b in _trunk_bns(rebuilt))
    fresh = build_model(_config().model, pretrained=False)
    assert not any(isinstance(b, _FrozenBNMixin) for b in _trunk_bns(fresh))


def test_which_trunks_load_weights():
    assert not trunk_loads_weights("small_cnn", True, None)  # no published weights
    assert trunk_loads_weights("small_cnn", False, "w.pt")
    assert trunk_loads_weights("resnet18", True, None) and trunk_loads_weights("bn_inception", True, None)
    assert not trunk_loads_weights("resnet18", False, None)


def test_resuming_an_optimiser_of_other_parameters_is_one_line(tmp_path):
    trainer = Trainer(_config(), tmp_path / "run", SixClassImages(), None, device="cpu")
    payload = trainer.payload()
    trainer.run_log.close()
    group = payload["optimizer"]["param_groups"][0]  # the trunk's, as when its BatchNorm was frozen
    group["params"] = group["params"][:-4]
    other = Trainer(_config(), tmp_path / "run2", SixClassImages(), None, device="cpu")
    with pytest.raises(CheckpointError, match="cannot resume: the checkpoint's optimiser"):
        other.restore(payload)
    other.run_log.close()


# -- F3: one autocast dtype for training and inference ----------------------------------------------
def test_autocast_dtype_is_one_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert autocast_dtype("cuda") == autocast_dtype(torch.device("cuda", 0)) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert autocast_dtype("cuda") == torch.float16
    # a T4 / V100: bfloat16 only through emulation (torch's default counts it) -> float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    assert autocast_dtype("cuda") == torch.float16
    assert autocast_dtype("cpu") == torch.bfloat16
    with torch.autocast("cpu", dtype=autocast_dtype("cpu")):  # a dtype CPU autocast takes
        assert nn.Linear(3, 2)(torch.ones(1, 3)).dtype == torch.bfloat16


def test_training_and_inference_autocast_to_the_same_dtype(tmp_path, monkeypatch):
    trainer = Trainer(_config(), tmp_path / "run", SixClassImages(), None, device="cpu")
    trainer.run_log.close()
    assert trainer.amp_dtype == autocast_dtype(trainer.device)
    seen: list[torch.dtype | None] = []
    real = torch.autocast

    def recording(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", recording)
    embed(trainer.model, SixClassImages(), batch_size=16, device="cpu", amp=True)
    assert seen and set(seen) == {trainer.amp_dtype}


# -- F4: a part with learning rate 0 is fixed, BatchNorm statistics included -----------------------
def test_trunk_lr_0_keeps_the_trunk_batchnorm_statistics(tmp_path):
    config = _config({"pretrained": False, "freeze_batchnorm": False}, {"trunk_lr": 0.0})
    trainer, before, after = _trained(config, tmp_path)
    assert not any(m.training for m in trainer.model.trunk.modules())
    assert trainer.model.embedder.training
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_embedder_lr_0_keeps_the_head_batchnorm_statistics(tmp_path):
    config = _config({"pretrained": False, "head": "mlp"}, {"embedder_lr": 0.0})
    torch.manual_seed(config.seed)
    trainer = Trainer(config, tmp_path / "run", SixClassImages(), None, device="cpu")
    head, trunk = _bn_state(trainer.model, "embedder"), _bn_state(trainer.model)
    trainer.run_epoch(time.perf_counter())
    trainer.run_log.close()
    assert head and all(torch.equal(v, _bn_state(trainer.model, "embedder")[k]) for k, v in head.items())
    assert not torch.equal(trunk["features.1.running_mean"], _bn_state(trainer.model)["features.1.running_mean"])


# -- F2: the imagenet evaluation resize scales with the crop ----------------------------------------
@pytest.mark.parametrize(("image_size", "short"), [(None, 256), (227, 256), (64, 72), (112, 126), (320, 361)])
def test_imagenet_eval_resize_scales_with_image_size(image_size, short):
    from torchvision import transforms as T

    def resize(train: bool) -> int:
        steps = get_transforms("imagenet", train=train, image_size=image_size).transforms
        return next(s.size for s in steps if isinstance(s, T.Resize))

    assert resize(False) == short
    crop = image_size or 227
    assert abs(crop / short - 227 / 256) < 0.01  # the centre crop's share of the shorter side
    assert resize(True) == max(256, crop)  # training's source for its random crop is unchanged
    explicit = get_transforms("imagenet", train=False, image_size=64, resize=256).transforms
    assert next(s.size for s in explicit if isinstance(s, T.Resize)) == 256


def test_imagenet_eval_at_64_sees_what_227_sees():
    """The same photo-like image at crop 64 and 227: the 64 px view is the 227 px view shrunk
    (same field of view), not its middle quarter."""
    from PIL import Image

    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, (8, 12, 3), dtype=np.uint8)  # smooth content: 8 x 12 blocks
    image = Image.fromarray(coarse).resize((600, 400), Image.BILINEAR)
    big = get_transforms("imagenet", train=False, image_size=227)(image)
    small = get_transforms("imagenet", train=False, image_size=64)(image)
    shrunk = torch.nn.functional.interpolate(big[None], size=(64, 64), mode="bilinear",
                                             antialias=True, align_corners=False)[0]
    assert (small - shrunk).abs().mean() < 0.1 * big.std()
