"""Model / feature-cache / shard audit: each test fails without its fix."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dmlkit.config import ModelConfig
from dmlkit.data.base import ArrayDataset, ImageFileDataset
from dmlkit.embedding_shards import ShardWriter, open_shards, write_shards
from dmlkit.embeddings import extract_features, feature_cache_key
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.models import EmbeddingModel, build_trunk, freeze_batchnorm, is_batchnorm_frozen
from dmlkit.models.embedder import FrozenBatchNorm1d, FrozenBatchNorm2d
from dmlkit.training.builders import build_model


def _tiny_rgb(n: int = 4, size: int = 32) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.standard_normal((n, 3, size, size)).astype(np.float32),
                        [0, 0, 1, 1][:n], name="tiny")


# -- 1. trunk options in the feature-cache key ------------------------------------------------------
def test_feature_cache_key_includes_trunk_options():
    torch.manual_seed(0)
    a, _ = build_trunk("bn_inception", pretrained=False, input_space="imagenet")
    b, _ = build_trunk("bn_inception", pretrained=False, input_space="caffe")
    b.load_state_dict(a.state_dict())  # same weights: only the option differs
    ds = _tiny_rgb()
    assert a.dmlkit_options["kwargs"] == {"input_space": "'imagenet'"}
    assert feature_cache_key(a, ds) != feature_cache_key(b, ds)


def test_feature_cache_key_includes_non_persistent_buffers():
    torch.manual_seed(0)
    a, _ = build_trunk("bn_inception", pretrained=False)
    ds = _tiny_rgb()
    before = feature_cache_key(a, ds)
    a._caffe_mean.add_(1.0)  # not in the state dict, but changes the outputs
    assert feature_cache_key(a, ds) != before


def test_feature_cache_key_includes_the_forward_precision(monkeypatch, tmp_path):
    """``amp`` features (float16 or bfloat16 on CUDA) and float32 ones shared one cache file."""
    import dmlkit.embeddings as emb

    torch.manual_seed(0)
    a, _ = build_trunk("small_cnn", in_channels=3)
    ds = _tiny_rgb()
    keys = {feature_cache_key(a, ds, precision=p) for p in (torch.float32, torch.float16, torch.bfloat16)}
    assert len(keys) == 3 and feature_cache_key(a, ds) == feature_cache_key(a, ds, precision=torch.float32)
    seen = []  # extract_features keys by the precision the forward runs in: float32 without CUDA
    monkeypatch.setattr(emb, "feature_cache_key", lambda *args, **kw: seen.append(args[3]) or "0" * 64)
    monkeypatch.setattr(emb, "embed", lambda *args, **kw: (np.zeros((4, 2), np.float32), None))
    extract_features(a, ds, cache_dir=tmp_path, amp=True)
    assert seen == [torch.float32]


# -- 2. googlenet / inception_v3 transform_input from the trunk name -------------------------------
def test_googlenet_transform_input_whatever_the_weights(tmp_path):
    random_init, _ = build_trunk("googlenet", pretrained=False)
    assert random_init.transform_input is True  # a checkpoint's rebuild matches training
    path = tmp_path / "g.pth"
    torch.save(random_init.state_dict(), path)
    from_file, _ = build_trunk("googlenet", pretrained=False, weights=path)
    assert from_file.transform_input is True
    with pytest.raises(ConfigError, match="transform_input"):
        build_trunk("googlenet", pretrained=False, in_channels=1)
    gray, _ = build_trunk("googlenet", pretrained=False, in_channels=1, transform_input=False)
    assert gray.transform_input is False


# -- 3. weights=<file> loads every layer but the final classifier -----------------------------------
def test_torchvision_weights_file_loads_classifier_hidden_layers(tmp_path):
    import torchvision

    torch.manual_seed(1)
    src = torchvision.models.get_model("mobilenet_v3_small", weights=None)
    with torch.no_grad():
        src.classifier[0].weight.normal_()
    path = tmp_path / "m.pth"
    torch.save(src.state_dict(), path)
    torch.manual_seed(2)
    trunk, dim = build_trunk("mobilenet_v3_small", pretrained=False, weights=path)
    assert torch.equal(trunk.classifier[0].weight, src.classifier[0].weight)
    assert isinstance(trunk.classifier[3], nn.Identity) and dim == 1024
    # a file without the hidden classifier layer is refused, not silently left random
    state = {k: v for k, v in src.state_dict().items() if not k.startswith("classifier.0.")}
    torch.save(state, path)
    with pytest.raises(ConfigError, match="classifier.0.weight"):
        build_trunk("mobilenet_v3_small", pretrained=False, weights=path)


# -- 4. one-channel input to trunks that convert RGB internally -------------------------------------
def test_in_channels_refused_where_the_trunk_converts_rgb():
    with pytest.raises(ConfigError, match="no exact 1-channel form"):
        build_trunk("bn_inception", pretrained=False, in_channels=1)
    trunk, _ = build_trunk("bn_inception", pretrained=False, in_channels=1, input_space="caffe")
    assert trunk.conv1_7x7_s2.in_channels == 1
    pytest.importorskip("efficientnet_lite_pytorch")
    with pytest.raises(ConfigError, match="input_space='tf'"):
        build_trunk("efficientnet_lite0", pretrained=False, in_channels=1, input_space="tf")


# -- 5. file fingerprint: nanosecond mtime, inode, ctime -------------------------------------------
def test_image_fingerprint_sees_same_second_same_size_edit(tmp_path):
    from PIL import Image

    path = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(path)
    size = path.stat().st_size
    second = 1_700_000_000 * 10**9
    os.utime(path, ns=(second, second + 1000))
    before = ImageFileDataset([path], [0], mode="L", name="f").fingerprint()
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))
    os.utime(path, ns=(second, second + 2000))  # same second
    assert path.stat().st_size == size
    assert ImageFileDataset([path], [0], mode="L", name="f").fingerprint() != before


# -- 6. transforms whose repr says nothing are not cached -------------------------------------------
def test_lambda_transform_is_not_cached(tmp_path):
    from torchvision import transforms as T

    base = ArrayDataset(np.random.default_rng(0).integers(0, 256, (4, 16, 16), dtype=np.uint8),
                        [0, 0, 1, 1], name="tiny")
    ds = base.with_transform(T.Compose([T.Lambda(lambda im: im), T.ToTensor()]))
    torch.manual_seed(0)
    trunk, _ = build_trunk("small_cnn", in_channels=1)
    with pytest.warns(UserWarning, match="not cached"):
        out = extract_features(trunk, ds, cache_dir=tmp_path)
    assert out.meta["cache_file"] is None and list(tmp_path.iterdir()) == []


# -- 7. shard label / id digests always checked -----------------------------------------------------
def test_swapped_shard_labels_refused_on_open(tmp_path):
    emb = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    d = tmp_path / "sh"
    write_shards(d, emb, [0, 0, 1, 1, 2, 2])
    assert open_shards(d).labels.tolist() == [0, 0, 1, 1, 2, 2]
    labels_file = next(d.glob("labels-*.npy"))
    np.save(labels_file, np.array([2, 2, 1, 1, 0, 0], np.int64))
    with pytest.raises(DataError, match="manifest digest"):
        open_shards(d)


# -- 8. weights of other shapes: one-line ConfigError naming the tensors ----------------------------
def test_weights_with_other_shapes_give_config_error(tmp_path):
    other, _ = build_trunk("small_cnn", widths=(8, 16))
    path = tmp_path / "w.pt"
    torch.save(other.state_dict(), path)
    with pytest.raises(ConfigError, match=r"features\.0\.weight \(8, 3, 3, 3\) vs \(32, 3, 3, 3\)"):
        build_trunk("small_cnn", weights=path)
    cfg = ModelConfig(trunk="small_cnn", pretrained=False, weights=str(path), in_channels=1)
    with pytest.raises(ConfigError, match="other shapes"):
        build_model(cfg)


# -- 9. freeze_batchnorm leaves fresh BatchNorm (head, neck) trainable ------------------------------
def test_freeze_batchnorm_spares_head_and_neck(tmp_path):
    weights = tmp_path / "trunk.pt"  # loaded statistics: the trunk's BatchNorm is frozen
    torch.save(build_trunk("small_cnn", in_channels=1, bn_neck=True)[0].state_dict(), weights)
    cfg = ModelConfig(trunk="small_cnn", in_channels=1, head="mlp", weights=str(weights),
                      embedding_size=8, trunk_options={"bn_neck": True})
    model = build_model(cfg)
    assert isinstance(model.trunk.features[1], FrozenBatchNorm2d)
    for bn in (model.embedder[1], model.trunk.neck):
        assert not isinstance(bn, FrozenBatchNorm1d) and bn.weight.requires_grad
    freeze_batchnorm(model)  # freezing the whole model again spares the marked layers
    model.train()
    assert model.embedder[1].training and model.trunk.neck.training
    assert not model.trunk.features[1].training
    trunk, dim = build_trunk("small_cnn", bn_neck=True)
    plain = freeze_batchnorm(EmbeddingModel(trunk, dim, 8))
    assert not isinstance(plain.trunk.neck, FrozenBatchNorm1d) and is_batchnorm_frozen(plain)


# -- 10. float16 underflow warning; embed -o needs .npz ---------------------------------------------
def test_float16_shards_warn_on_subnormal_values(tmp_path):
    emb = np.full((2, 4), 1e-6, np.float32)
    with pytest.warns(UserWarning, match="smallest normal"):
        with ShardWriter(tmp_path / "h", dtype="float16") as w:
            w.append(emb, [0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ShardWriter(tmp_path / "ok", dtype="float16") as w:
            w.append(np.full((2, 4), 0.5, np.float32), [0, 1])


def test_embed_npz_output_needs_npz_suffix(tmp_path):
    from dmlkit.training.trainer import embed_run

    with pytest.raises(ConfigError, match="must end in .npz"):
        embed_run(tmp_path / "no-run", output=tmp_path / "out.npy")


@pytest.mark.parametrize(("marked", "pretrained", "expected"), [
    (False, False, False),  # written before the rule changed: random init never transformed
    (False, True, True),  # ... downloaded weights did
    (True, False, True),  # written since: by the trunk's name
])
def test_a_checkpoint_rebuilds_googlenet_with_the_input_transform_it_trained_with(
        tmp_path, marked, pretrained, expected):
    from dmlkit.config import ModelConfig
    from dmlkit.training.builders import build_model
    from dmlkit.training.checkpoint import INPUT_TRANSFORM_BY_NAME, load_checkpoint, save_checkpoint

    model_cfg = ModelConfig(trunk="googlenet", pretrained=pretrained, embedding_size=8)
    trained = build_model(model_cfg.model_copy(update={"trunk_options": {"transform_input": expected}}),
                          pretrained=False)
    config = {"name": "old", "data": {"dataset": "omniglot"}, "model": model_cfg.model_dump(mode="json"),
              "loss": {"name": "triplet"}}
    payload = {"config": config, "model": trained.state_dict()}
    if marked:
        payload[INPUT_TRANSFORM_BY_NAME] = True
    save_checkpoint(payload, tmp_path / "best.pt")
    model, _ = load_checkpoint(tmp_path / "best.pt")
    assert model.trunk.transform_input is expected
