"""The embeddings stage: the one inference loop, frozen-trunk routing, embeddings files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dmlkit.data import ArrayDataset
from dmlkit.embeddings import (
    InferenceOptions,
    embed,
    embed_model,
    extract_features,
    load_embeddings,
    save_embeddings,
)
from dmlkit.exceptions import NonFiniteError, ShapeError
from dmlkit.models import EmbeddingModel, freeze_batchnorm


def _images(n: int = 24, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 12, 12)).astype(np.float32)  # grayscale images in [0, 1]
    return ArrayDataset(x, np.repeat(np.arange(n // 4), 4), name="toy")


def _model() -> EmbeddingModel:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return EmbeddingModel(trunk, 4, 6)


def test_embed_keeps_order_labels_and_every_modules_mode():
    ds = _images()
    model = freeze_batchnorm(_model())
    model.train()
    freeze_batchnorm(model)  # frozen BatchNorm stays in eval mode inside a training model
    modes = {name: m.training for name, m in model.named_modules()}
    emb, labels = embed(model, ds, batch_size=5, device="cpu")
    assert emb.shape == (24, 6) and emb.dtype == np.float32
    assert np.array_equal(labels, ds.labels)
    assert {name: m.training for name, m in model.named_modules()} == modes
    with torch.no_grad():
        direct = model.eval()(torch.as_tensor(ds.data)[:, None]).numpy()
    np.testing.assert_allclose(emb, direct, rtol=1e-5, atol=1e-6)


def test_embed_flattens_outputs_and_refuses_non_finite_ones():
    ds = _images(8)
    emb, _ = embed(nn.Identity(), ds, batch_size=3, device="cpu")
    assert emb.shape == (8, 144)
    with pytest.raises(NonFiniteError):
        embed(lambda x: x * float("nan"), ds, device="cpu")


def test_frozen_trunk_route_gives_the_models_embeddings(tmp_path):
    ds, model = _images(), _model().eval()
    full, labels = embed_model(model, ds, InferenceOptions(device="cpu"))
    options = InferenceOptions(batch_size=7, device="cpu", frozen_trunk=True, cache_dir=tmp_path)
    frozen, frozen_labels = embed_model(model, ds, options)
    np.testing.assert_allclose(frozen, full, rtol=1e-5, atol=1e-6)
    assert np.array_equal(labels, frozen_labels)
    cached = extract_features(model.trunk, ds, cache_dir=tmp_path)
    assert cached.meta["cache_hit"]  # the route above wrote the feature cache


def test_embeddings_file_roundtrip_and_errors(tmp_path):
    emb = np.arange(12, dtype=np.float64).reshape(4, 3)
    path = save_embeddings(tmp_path / "e.npz", torch.as_tensor(emb), [3, 3, 1, 1], indices=np.arange(4))
    got, labels, extra = load_embeddings(path)
    assert got.dtype == np.float32 and labels.dtype == np.int64
    np.testing.assert_array_equal(got, emb.astype(np.float32))
    np.testing.assert_array_equal(extra["indices"], np.arange(4))
    with pytest.raises(ShapeError):
        save_embeddings(tmp_path / "bad.npz", emb, [1, 2])


def test_load_embeddings_never_truncates_labels_and_reads_names(tmp_path):
    import numpy as np
    import pytest

    from dmlkit.embeddings import load_embeddings
    from dmlkit.exceptions import DataError, ShapeError

    np.save(tmp_path / "e.npy", np.ones((3, 2), np.float32))
    (tmp_path / "frac.txt").write_text("1\n2.5\n3\n")
    with pytest.raises(DataError, match="'2.5'.*not an integer"):
        load_embeddings(tmp_path / "e.npy", tmp_path / "frac.txt")
    (tmp_path / "names.txt").write_text("cat\ndog\ncat\n")
    _, labels, extra = load_embeddings(tmp_path / "e.npy", tmp_path / "names.txt")
    assert labels.tolist() == ["cat", "dog", "cat"] and "class_names" not in extra
    _, labels, extra = load_embeddings(tmp_path / "e.npy", tmp_path / "names.txt", codes=True)
    assert labels.tolist() == [0, 1, 0] and extra["class_names"].tolist() == ["cat", "dog"]
    np.savez(tmp_path / "f.npz", embeddings=np.ones((3, 2)), labels=np.array([0.1, 0.2, 0.3]))
    with pytest.raises(ShapeError, match="fractional"):
        load_embeddings(tmp_path / "f.npz")
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not a torch file")
    with pytest.raises(DataError, match="cannot read embeddings"):
        load_embeddings(tmp_path / "bad.pt")
