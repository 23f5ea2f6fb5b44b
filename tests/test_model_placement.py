"""``dmlkit.models.to_device``: CPU convolutional models stored channels-last, same outputs."""

from __future__ import annotations

import torch
from torch import nn

from dmlkit.config import config_from_dict
from dmlkit.models import SmallCNN, to_device
from dmlkit.training import build_model, load_checkpoint
from dmlkit.training.checkpoint import save_checkpoint


def _conv_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_cpu_conv_model_is_channels_last_with_the_same_outputs():
    torch.manual_seed(0)
    reference = SmallCNN(1, bn_neck=True).eval()
    placed = to_device(SmallCNN(1, bn_neck=True).eval(), "cpu")
    placed.load_state_dict(reference.state_dict())
    weights = _conv_weights(placed)
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert not any(w.is_contiguous() for w in weights[1:])  # (one input channel: either layout)
    x = torch.randn(6, 1, 28, 28)  # an ordinary NCHW batch: the first convolution converts it
    with torch.no_grad():
        torch.testing.assert_close(placed(x), reference(x), rtol=1e-5, atol=1e-5)


def test_models_without_convolutions_are_untouched():
    head = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    before = [p.data_ptr() for p in head.parameters()]
    assert to_device(head, torch.device("cpu")) is head
    assert [p.data_ptr() for p in head.parameters()] == before


def test_a_loaded_checkpoint_is_placed(tmp_path):
    config = config_from_dict({"name": "placed", "data": {"dataset": "omniglot"},
                               "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1,
                                         "embedding_size": 8, "freeze_batchnorm": False},
                               "loss": {"name": "contrastive"}})
    model = build_model(config)
    save_checkpoint({"config": config.model_dump(mode="json"), "model": model.state_dict()},
                    tmp_path / "best.pt")
    loaded, _ = load_checkpoint(tmp_path / "best.pt")
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in _conv_weights(loaded))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


def test_embedding_a_fresh_model_places_it():
    """The shared inference loop places a model too, so any model a user embeds with gets the
    faster layout, with the values of the default one."""
    from dmlkit.data.base import ArrayDataset
    from dmlkit.embeddings import embed

    torch.manual_seed(0)
    reference = SmallCNN(1, bn_neck=True).eval()
    model = SmallCNN(1, bn_neck=True)
    model.load_state_dict(reference.state_dict())
    images = torch.rand(10, 28, 28)  # grayscale in [0, 1]: the dataset gives (1, 28, 28) items
    emb, labels = embed(model, ArrayDataset(images.numpy(), list(range(10))), batch_size=4,
                        device="cpu")
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in _conv_weights(model))
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(emb), reference(images[:, None]), rtol=1e-5,
                                   atol=1e-5)
    assert labels.tolist() == list(range(10))
